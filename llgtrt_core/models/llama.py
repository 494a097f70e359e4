"""Llama-family decoder in plain PyTorch (SmolLM2, Llama 3.x, Qwen2/2.5/3, Mistral shapes).

Parameter names follow Hugging Face checkpoints, except that q/k/v and gate/up projections are
packed into one matrix each (`checkpoint_tensors` maps the checkpoint's names onto them). The
model reads and writes an external KV cache (`llgtrt_core.engine.kv_cache.KVCache`): one
sequence at a time for `extend` (a prompt, or tokens a grammar forced), the first `n` cache
slots at once for decode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from llgtrt_core.engine.kv_cache import KVCache

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict[str, Any]]
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2: biases on q/k/v projections
    qk_norm: bool  # Qwen3: RMSNorm on each head of q and k

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "ModelConfig":
        architecture = (config.get("architectures") or ["LlamaForCausalLM"])[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = config["num_attention_heads"]
        return cls(
            architecture=architecture,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0),
            rope_scaling=config.get("rope_scaling") or config.get("rope_parameters"),  # transformers 5 merged them
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            attention_bias=config.get("attention_bias", architecture == "Qwen2ForCausalLM"),
            qk_norm=architecture == "Qwen3ForCausalLM",
        )


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies of rotary embeddings, with Llama 3's long-context scaling when configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        return inv_freq.float()
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled).float()


def rope_tables(config: ModelConfig, max_positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin, (max_positions, head_dim), in Hugging Face's half-split layout."""
    inv_freq = rope_inverse_frequencies(config).to(device)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim); cos/sin: (batch, 1, seq, head_dim)."""
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention of one query per sequence over its cached keys.

    q: (n, heads, 1, head_dim); keys/values: (n, kv_heads, key_len, head_dim), a strided view of
    the cache; mask: (n, 1, 1, key_len) bool. Plain matmuls: for a single query they beat SDPA's
    CPU kernel by an order of magnitude and need no copy of the cache view.
    """
    n, heads, _, head_dim = q.shape
    kv_heads = keys.shape[1]
    q = q.view(n, kv_heads, heads // kv_heads, head_dim)
    scores = torch.matmul(q, keys.transpose(2, 3)) * head_dim**-0.5  # (n, kv_heads, group, key_len)
    scores = scores.float().masked_fill(~mask, float("-inf"))
    out = torch.matmul(scores.softmax(dim=-1).to(values.dtype), values)  # (n, kv_heads, group, head_dim)
    return out.view(n, heads, head_dim)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Hugging Face's order: normalize in float32, round to the input dtype, then scale.
        # F.rms_norm is one fused kernel on CUDA and bit-identical to the unfused ops on CPU.
        normalized = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normalized.to(x.dtype)


class PackedLinear(nn.Linear):
    """Several projections of one input as one matrix (q/k/v, gate/up): one kernel instead of
    several, and checkpoints still load by their per-projection names."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool):
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = parts

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return out.split(list(self.parts.values()), dim=-1)

    def checkpoint_views(self, prefix: str) -> dict[str, torch.Tensor]:
        """Views of this matrix's rows under the checkpoint's names, e.g. `...self_attn.q_proj.weight`."""
        views, offset = {}, 0
        for part, size in self.parts.items():
            for kind in ("weight", "bias"):
                tensor = getattr(self, kind)
                if tensor is not None:
                    views[f"{prefix}{part}.{kind}"] = tensor.detach().narrow(0, offset, size)
            offset += size
        return views


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = PackedLinear(hidden, {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}, bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        batch, seq, _ = x.shape
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(batch, seq, self.num_heads, self.head_dim)
        k = k.view(batch, seq, self.num_kv_heads, self.head_dim)
        v = v.view(batch, seq, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def extend(self, x: torch.Tensor, cos, sin, cache: KVCache, slot: int, start: int,
               attn_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """One sequence's new tokens at positions start..start+seq-1: attends to the slot's cached
        keys and causally among the new ones. attn_mask: (seq, start+seq) bool, None when start is 0."""
        q, k, v = self._project(x, cos, sin)
        keys, values = cache.write_extend(self.layer_index, slot, start, k[0], v[0])
        out = F.scaled_dot_product_attention(q, keys.unsqueeze(0), values.unsqueeze(0), attn_mask=attn_mask,
                                             is_causal=attn_mask is None, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))

    def decode(
        self, x: torch.Tensor, cos, sin, cache: KVCache, positions: torch.Tensor, attn_mask: torch.Tensor
    ) -> torch.Tensor:
        """One new token for each of the first n slots; slot i's token sits at positions[i]."""
        q, k, v = self._project(x, cos, sin)
        keys, values = cache.write_decode(self.layer_index, positions, k[:, :, 0], v[:, :, 0], attn_mask.shape[-1])
        return self.o_proj(decode_attention(q, keys, values, attn_mask).reshape(x.shape[0], 1, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = PackedLinear(config.hidden_size, {"gate_proj": size, "up_proj": size}, bias=False)
        self.down_proj = nn.Linear(size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.self_attn = Attention(config, layer_index)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, attend) -> torch.Tensor:
        x = x + attend(self.self_attn, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.max_positions = max_positions
        # Filled by reset_rope_tables once the model sits on its device (it is built on "meta").
        self.register_buffer("rope_cos", torch.empty(max_positions, config.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(max_positions, config.head_dim), persistent=False)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter under its Hugging Face checkpoint name (packed ones as row views), shared
        storage: loading copies into these, and a reference model can borrow them."""
        packed = {name: module for name, module in self.named_modules() if isinstance(module, PackedLinear)}
        tensors: dict[str, torch.Tensor] = {}
        for name, parameter in self.named_parameters():  # tied weights appear once
            module_name, _, _ = name.rpartition(".")
            if module_name in packed:
                tensors.update(packed[module_name].checkpoint_views(module_name.rpartition(".")[0] + "."))
            else:
                tensors[name] = parameter.detach()
        return tensors

    def reset_rope_tables(self) -> None:
        """Recompute the float32 cos/sin tables on the model's device (after to_empty or a dtype cast)."""
        self.rope_cos, self.rope_sin = rope_tables(self.config, self.max_positions, self.lm_head.weight.device)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for positions shaped (batch, seq) -> (batch, 1, seq, head_dim)."""
        return self.rope_cos[positions].unsqueeze(1).to(dtype), self.rope_sin[positions].unsqueeze(1).to(dtype)

    def _run(self, token_ids: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        x = self.model.embed_tokens(token_ids)
        cos, sin = self._rope(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, lambda attn, h: attend(attn, h, cos, sin))
        return self.model.norm(x)

    @torch.inference_mode()
    def extend(self, token_ids: torch.Tensor, cache: KVCache, slot: int, start: int = 0) -> torch.Tensor:
        """token_ids: (seq,) appended to one cache slot at positions start..start+seq-1 (a prompt when
        start is 0, tokens a grammar forced otherwise). Returns the last position's logits (vocab,)."""
        end = start + token_ids.shape[0]
        positions = torch.arange(start, end, device=token_ids.device)
        # Query i sees keys 0..start+i; from 0 that is plain causal attention (SDPA's is_causal).
        attn_mask = None if start == 0 else torch.arange(end, device=token_ids.device) <= positions[:, None]
        hidden = self._run(
            token_ids.unsqueeze(0), positions.unsqueeze(0),
            lambda attn, h, cos, sin: attn.extend(h, cos, sin, cache, slot, start, attn_mask),
        )
        return self.lm_head(hidden[0, -1]).float()

    def prefill(self, token_ids: torch.Tensor, cache: KVCache, slot: int) -> torch.Tensor:
        """A prompt: `extend` from position 0."""
        return self.extend(token_ids, cache, slot)

    @torch.inference_mode()
    def decode(self, token_ids: torch.Tensor, positions: torch.Tensor, key_len: int, cache: KVCache) -> torch.Tensor:
        """token_ids, positions: (n,) for cache slots 0..n-1; key_len = max(positions) + 1, known to the
        caller without a device sync. Returns logits (n, vocab)."""
        attn_mask = (torch.arange(key_len, device=positions.device) <= positions[:, None])[:, None, None, :]
        hidden = self._run(
            token_ids.unsqueeze(1),
            positions.unsqueeze(1),
            lambda attn, h, cos, sin: attn.decode(h, cos, sin, cache, positions, attn_mask),
        )
        return self.lm_head(hidden[:, 0]).float()
