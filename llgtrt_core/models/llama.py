"""Llama-family decoder (SmolLM2, Llama 3.x, Qwen2/2.5/3, Mistral shapes): PyTorch modules for the
weights; the ops (projections, residual add + RMSNorm, RoPE + KV write, SiLU x up, decode
attention) come from `llgtrt_core.layers`, as Triton kernels on CUDA, plain torch elsewhere.

Parameter names follow Hugging Face checkpoints, except that q/k/v and gate/up projections are
packed into one matrix each (`checkpoint_tensors` maps the checkpoint's names onto them). The
model reads and writes an external paged KV cache (`llgtrt_core.engine.kv_cache.KVCache`):
`extend_batch` for new tokens of one or more sequences (prompts, or tokens a grammar forced),
`decode` for one token of each of the first `n` cache rows.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from llgtrt_core.engine.kv_cache import KVCache
from llgtrt_core.layers.quantized_linear import Int4Linear, Int8Linear, exact_int4_groups
from llgtrt_core.kernels import int64_to_device
from llgtrt_core.layers.layernorm import rms_norm
from llgtrt_core.layers.ops import LayerOps, layer_ops
from llgtrt_core.layers.rotary import apply_rope

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


# decode_layers's signature: (layers, x, ops, cos_table, sin_table, keys, values, block_table,
# positions, key_len) -> (x, residual).
LayersDecode = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Segment:
    """`length` new tokens of the sequence in cache row `slot`, at positions start..start+length-1."""

    slot: int
    start: int
    length: int


@dataclass(frozen=True)
class NewTokens:
    """Where new tokens of one or more sequences go, concatenated segment after segment: each
    token's cache block and offset (total,), float32 cos/sin (1, 1, total, head_dim), and per
    segment its causal mask over its row's keys ((length, start+length) bool; None from 0)."""

    segments: Sequence[Segment]
    blocks: torch.Tensor
    offsets: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    attn_masks: list[Optional[torch.Tensor]]


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


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's intra-op thread count set to `threads` (0: left as it is) inside the block."""
    if not threads:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: Optional[torch.Tensor],
            ops: LayerOps) -> tuple[torch.Tensor, torch.Tensor]:
        """x joins the residual stream (in place), which is then normalized: ops.add_rms_norm."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class PackedLinear(nn.Linear):
    """Several projections of one input as one matrix (q/k/v, gate/up): one kernel instead of
    several, and checkpoints still load by their per-projection names."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool):
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = parts

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
        self.qkv_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = PackedLinear(hidden, {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}, bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def extend(self, x: torch.Tensor, ops: LayerOps, new: NewTokens, cache: KVCache) -> torch.Tensor:
        """New tokens of one or more sequences, concatenated (see `NewTokens`); x: (1, total, hidden)."""
        return ops.linear(self.o_proj, self._attend_new(ops.linear(self.qkv_proj, x[0]), new, cache)).unsqueeze(0)

    def mixed(self, x: torch.Tensor, num_decoding: int, ops: LayerOps, cos_table: torch.Tensor,
              sin_table: torch.Tensor, cache: KVCache, block_table: torch.Tensor, positions: torch.Tensor,
              key_len: int, new: NewTokens) -> torch.Tensor:
        """`decode` for the first `num_decoding` rows of x, `extend` for the rest, with one projection
        over all of them: x: (num_decoding + total, hidden)."""
        qkv = ops.linear(self.qkv_proj, x)
        keys, values = cache.keys[self.layer_index], cache.values[self.layer_index]
        qk_norm = () if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        q = ops.rope_write_kv(qkv[:num_decoding], positions, cos_table, sin_table, keys, values, block_table, *qk_norm)
        decoded = ops.decode_attention(q, keys, values, block_table, positions, key_len)
        return ops.linear(self.o_proj, torch.cat([decoded, self._attend_new(qkv[num_decoding:], new, cache)]))

    def _attend_new(self, qkv: torch.Tensor, new: NewTokens, cache: KVCache) -> torch.Tensor:
        """Attention of new tokens, qkv: (total, q+k+v): each segment's tokens attend to its row's
        cached keys and causally among themselves; their keys and values are written to the cache.
        Returns (total, heads * head_dim). Attention runs one segment at a time."""
        total = qkv.shape[0]
        q, k, v = qkv.unsqueeze(0).split(self.qkv_sizes, dim=-1)
        q = q.view(1, total, self.num_heads, self.head_dim)
        k = k.view(1, total, self.num_kv_heads, self.head_dim)
        v = v.view(1, total, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (1, heads, total, head_dim)
        q, k = apply_rope(q, new.cos, new.sin), apply_rope(k, new.cos, new.sin)
        cache.write(self.layer_index, new.blocks, new.offsets, k[0].transpose(0, 1), v[0].transpose(0, 1))
        outputs, offset = [], 0
        for segment, attn_mask in zip(new.segments, new.attn_masks):
            part = slice(offset, offset + segment.length)
            if segment.start == 0:  # nothing cached before: its own keys are all it sees
                keys, values = k[0, :, part], v[0, :, part]
            else:
                keys, values = cache.read(self.layer_index, segment.slot, segment.start + segment.length)
            outputs.append(F.scaled_dot_product_attention(q[:, :, part], keys.unsqueeze(0), values.unsqueeze(0),
                                                          attn_mask=attn_mask, is_causal=attn_mask is None,
                                                          enable_gqa=True))
            offset += segment.length
        out = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
        return out[0].transpose(0, 1).reshape(total, -1)

    def decode(self, x: torch.Tensor, ops: LayerOps, cos_table: torch.Tensor, sin_table: torch.Tensor,
               keys: torch.Tensor, values: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor,
               key_len: int) -> torch.Tensor:
        """One new token per row; x: (n, hidden), row i's token sits at positions[i] of the sequence
        whose blocks block_table[i] lists; keys, values: this layer's cache."""
        qk_norm = () if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        q = ops.rope_write_kv(ops.linear(self.qkv_proj, x), positions, cos_table, sin_table, keys, values, block_table,
                              *qk_norm)
        return ops.linear(self.o_proj, ops.decode_attention(q, keys, values, block_table, positions, key_len))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = PackedLinear(config.hidden_size, {"gate_proj": size, "up_proj": size}, bias=False)
        self.down_proj = nn.Linear(size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        return ops.linear(self.down_proj, ops.silu_mul(ops.linear(self.gate_up_proj, x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.self_attn = Attention(config, layer_index)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor], ops: LayerOps,
                attend) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, not yet added to the residual stream (vLLM's order, which
        lets each add fuse into the norm after it); returns this layer's output and the stream."""
        h, residual = self.input_layernorm.add(x, residual, ops)
        h, residual = self.post_attention_layernorm.add(attend(self.self_attn, h), residual, ops)
        return self.mlp(h, ops), residual

    def decode(self, x: torch.Tensor, residual: Optional[torch.Tensor], ops: LayerOps, cos_table: torch.Tensor,
               sin_table: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_table: torch.Tensor,
               positions: torch.Tensor, key_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` for a decode step (`Attention.decode`), given this layer's cache tensors."""
        return self(x, residual, ops, lambda attn, h: attn.decode(h, ops, cos_table, sin_table, keys, values,
                                                                  block_table, positions, key_len))


def decode_layers(layers: Sequence[DecoderLayer], x: torch.Tensor, ops: LayerOps, cos_table: torch.Tensor,
                  sin_table: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                  block_table: torch.Tensor, positions: torch.Tensor, key_len: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer's `decode` in turn over embeddings x, given each layer's cache tensors; returns
    the last layer's output and the residual stream. Its inputs are modules, tensors and ints, not
    the cache object: a compiled copy (engine/compiled_decode.py) is one graph for the whole step."""
    residual = None
    for layer, layer_keys, layer_values in zip(layers, keys, values):
        x, residual = layer.decode(x, residual, ops, cos_table, sin_table, layer_keys, layer_values, block_table,
                                   positions, key_len)
    return x, residual


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
        # Triton kernels for the ops between matmuls on CUDA; False keeps the plain torch ops (the
        # reference) on every device, which benchmarks time against.
        self.fused_ops = True
        self.head_threads = 0  # torch threads of the lm_head (`logits`); 0: the caller's

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

    def quantize_weights(self, weights: str, dtype: torch.dtype) -> str:
        """The projections to weight-only int8 or int4 (`weights`: "int8", "int4", or "auto": int4
        when every projection holds in int4 groups exactly, as a checkpoint dequantized from Q4_1
        blocks does, else int8), with activations in `dtype` (bfloat16; CPU only); the lm_head to
        int8 (a tied embedding table stays dense, for lookups), the other parameters cast to `dtype`.
        Quantize float32 weights: rounding them to bfloat16 first would add its error. The
        checkpoint names (`checkpoint_tensors`) are gone afterwards. Returns "int8" or "int4"."""
        projections = [(module, name) for layer in self.model.layers
                       for module, names in ((layer.self_attn, ("qkv_proj", "o_proj")),
                                             (layer.mlp, ("gate_up_proj", "down_proj")))
                       for name in names]
        linears = [getattr(module, name) for module, name in projections]
        # The check's int4 groups are the layers' own: each weight is quantized once, not again to build.
        exact = exact_int4_groups([linear.weight for linear in linears]) if weights == "auto" else None
        if weights == "auto":
            weights = "int4" if exact is not None else "int8"
        for index, ((module, name), linear) in enumerate(zip(projections, linears)):
            if weights == "int4":
                groups = exact[index] if exact is not None else None
                setattr(module, name, Int4Linear(linear.weight.detach(), linear.bias, dtype, groups))
            else:
                setattr(module, name, Int8Linear.of(linear, dtype))
        self.lm_head = Int8Linear.of(self.lm_head, dtype)
        self.to(dtype)
        self.reset_rope_tables()
        return weights

    def uses_cpu_kernels(self) -> bool:
        """Whether the quantized matmuls run our CPU kernels (kernels/cpu_quant.py; all of them or none)."""
        return getattr(self.lm_head, "vnni", False)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The lm_head's float32 logits of final hidden states, on `head_threads` torch threads when
        set: on the CPU the lm_head (49152 x 576 for the default model, a fifth of a decode step's
        bytes) is bound by memory bandwidth, which a second core nearly doubles, and it is one
        OpenMP region a step (the layers' ~120 stalled a team of two on a shared machine,
        docs/benchmarks/cpu.md). The compiled layers keep the caller's count: their graphs are
        specific to it."""
        with torch_threads(self.head_threads):
            return layer_ops(hidden.device, self.fused_ops).linear(self.lm_head, hidden).float()

    def reset_rope_tables(self) -> None:
        """Recompute the float32 cos/sin tables on the model's device (after to_empty or a dtype cast)."""
        self.rope_cos, self.rope_sin = rope_tables(self.config, self.max_positions, self.model.norm.weight.device)

    def _run(self, x: torch.Tensor, ops: LayerOps, layer_step) -> torch.Tensor:
        """The decoder layers and the final norm over embeddings x; layer_step(layer, x, residual) ->
        (x, residual) runs one layer."""
        residual = None
        for layer in self.model.layers:
            x, residual = layer_step(layer, x, residual)
        hidden, _ = self.model.norm.add(x, residual, ops)
        return hidden

    @torch.inference_mode()
    def extend(self, token_ids: torch.Tensor, cache: KVCache, slot: int, start: int = 0) -> torch.Tensor:
        """token_ids: (seq,) appended to one cache row at positions start..start+seq-1 (a prompt when
        start is 0, tokens a grammar forced otherwise). Returns the last position's logits (vocab,)."""
        return self.extend_batch(token_ids, cache, [Segment(slot, start, token_ids.shape[0])])[0]

    @torch.inference_mode()
    def extend_batch(self, token_ids: torch.Tensor, cache: KVCache, segments: Sequence[Segment]) -> torch.Tensor:
        """`extend` for several rows in one pass: token_ids holds each segment's tokens in turn.
        Returns each segment's last-position logits (segments, vocab)."""
        last = int64_to_device([end - 1 for end in itertools.accumulate(s.length for s in segments)], token_ids.device)
        return self.logits(self.extend_hidden(token_ids, cache, segments)[last])

    @torch.inference_mode()
    def extend_hidden(self, token_ids: torch.Tensor, cache: KVCache, segments: Sequence[Segment]) -> torch.Tensor:
        """`extend_batch`, returning every new position's final hidden state (total, hidden) instead
        of the last positions' logits (prompt logprobs project them chunk by chunk)."""
        new = self._new_tokens(cache, segments, token_ids.device)
        ops = layer_ops(token_ids.device, self.fused_ops)
        hidden = self._run(self.model.embed_tokens(token_ids.unsqueeze(0)), ops, lambda layer, x, residual: layer(
            x, residual, ops, lambda attn, h: attn.extend(h, ops, new, cache)))
        return hidden[0]

    @torch.inference_mode()
    def mixed(self, decode_tokens: torch.Tensor, positions: torch.Tensor, key_len: int, cache: KVCache,
              block_table: torch.Tensor, new_tokens: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor:
        """`decode` of the first rows and `extend_batch` of the segments in one forward pass: the
        weights are read once for both. Returns the decoded rows' logits, then each segment's
        last-position logits (n + segments, vocab)."""
        device = decode_tokens.device
        n = decode_tokens.shape[0]
        new = self._new_tokens(cache, segments, device)
        ops = layer_ops(device, self.fused_ops)
        hidden = self._run(
            self.model.embed_tokens(torch.cat([decode_tokens, new_tokens])), ops,
            lambda layer, x, residual: layer(x, residual, ops, lambda attn, h: attn.mixed(
                h, n, ops, self.rope_cos, self.rope_sin, cache, block_table, positions, key_len, new)),
        )
        ends = itertools.accumulate(s.length for s in segments)
        rows = int64_to_device([*range(n), *(n + end - 1 for end in ends)], device)
        return self.logits(hidden[rows])

    def _new_tokens(self, cache: KVCache, segments: Sequence[Segment], device: torch.device) -> NewTokens:
        # From pinned memory: a pageable copy would wait for the work already queued (the GPU idles
        # while the host then queues this pass).
        positions = int64_to_device([p for s in segments for p in range(s.start, s.start + s.length)], device)
        rows = int64_to_device([s.slot for s in segments for _ in range(s.length)], device)
        blocks, offsets = cache.locate(rows, positions)
        # Query i of a segment sees keys 0..start+i; from 0 that is plain causal attention (SDPA's is_causal).
        attn_masks = [None if s.start == 0 else
                      torch.arange(s.start + s.length, device=device) <= torch.arange(s.start, s.start + s.length,
                                                                                       device=device)[:, None]
                      for s in segments]
        return NewTokens(segments, blocks, offsets, self.rope_cos[positions][None, None],
                         self.rope_sin[positions][None, None], attn_masks)

    @torch.inference_mode()
    def decode(self, token_ids: torch.Tensor, positions: torch.Tensor, key_len: int, cache: KVCache,
               block_table: torch.Tensor, layers_decode: Optional[LayersDecode] = None,
               picked: Optional[torch.Tensor] = None) -> torch.Tensor:
        """token_ids, positions: (n,); row i continues the sequence whose blocks block_table[i] lists
        (the cache's own table for its rows 0..n-1, or a CUDA graph's copy of it). key_len >=
        max(positions) + 1, known to the caller without a device sync, bounds the keys the torch
        ops read; the Triton ops read each row's own length on the device. layers_decode replaces
        `decode_layers` (a compiled copy on the CPU, engine/compiled_decode.py). picked: the rows
        projected to the vocabulary (default: all; prompt tokens riding as rows need only their
        last). Returns logits (n or picked, vocab)."""
        ops = layer_ops(token_ids.device, self.fused_ops)
        x, residual = (layers_decode or decode_layers)(self.model.layers, self.model.embed_tokens(token_ids), ops,
                                                       self.rope_cos, self.rope_sin, cache.keys, cache.values,
                                                       block_table, positions, key_len)
        if picked is not None:
            x, residual = x.index_select(0, picked), residual.index_select(0, picked)
        hidden, _ = self.model.norm.add(x, residual, ops)
        return self.logits(hidden)
