"""One decode step of the Llama-3-8B shape (random bf16 weights) as CUDA-graph replays: the
plain torch ops against the Triton ops of llgtrt_core/layers, next to the roofline.

- plain: the model with `fused_ops = False` captured as the engine captured it before the
  Triton ops, with the attended keys padded to a bucket (--key-bucket, 256 then);
- fused: `DecodeGraphs` (Triton ops, one graph per batch bucket, each row's own length).
Every row sits at --context (its prompt plus the tokens decoded so far). The roofline is
(weights read + each row's KV cache) / the bandwidth of a device-to-device copy measured here.
First a correctness check (fused vs plain logits at batch 8), last a torch.profiler summary of
one eager fused step at batch 1: kernel count and the top CUDA kernels by time.

    python bench/decode_step.py --out $OUT   # writes decode_step.json there
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_decode import replay_ms  # noqa: E402  (bench/ is the script's folder)
from measure import copy_bandwidth  # noqa: E402
from llama3 import LLAMA3_8B  # noqa: E402
from llgtrt_core.engine.decode_graphs import DecodeGraphs  # noqa: E402
from llgtrt_core.engine.kv_cache import KVCache  # noqa: E402
from llgtrt_core.models.llama import LlamaForCausalLM, ModelConfig  # noqa: E402
from llgtrt_core.models.loader import random_model  # noqa: E402


def plain_graph(model: LlamaForCausalLM, cache: KVCache, token_ids: torch.Tensor, positions: torch.Tensor,
                key_len: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """The torch ops' step captured with a fixed key bound, as DecodeGraphs did with its key buckets."""
    model.fused_ops = False
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model.decode(token_ids, positions, key_len, cache, cache.block_table[: len(token_ids)])
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = model.decode(token_ids, positions, key_len, cache, cache.block_table[: len(token_ids)])
        return graph, logits
    finally:
        model.fused_ops = True


def step_inputs(batch: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    token_ids = torch.randint(0, LLAMA3_8B["vocab_size"], (batch,), device="cuda")
    return token_ids, torch.full((batch,), context - 1, device="cuda")


def check_fused_matches_plain(model: LlamaForCausalLM, cache: KVCache, graphs: DecodeGraphs, context: int,
                              key_bucket: int) -> dict:
    token_ids, positions = step_inputs(8, context)
    plain, plain_logits = plain_graph(model, cache, token_ids, positions, key_bucket)
    plain.replay()
    expected = plain_logits.clone()
    fused = graphs.decode(token_ids, positions)
    relative = float((fused - expected).norm() / expected.norm())
    agree = float((fused.argmax(-1) == expected.argmax(-1)).float().mean())
    print(f"check at batch 8: |fused - plain| / |plain| = {relative:.2e}, argmax agreement {agree:.2f}", flush=True)
    if relative > 3e-2:
        raise SystemExit("fused logits differ from the plain ops' beyond bf16 error")
    return {"relative_error": relative, "argmax_agreement": agree}


def kernel_profile(model: LlamaForCausalLM, cache: KVCache, context: int, top: int = 10) -> dict:
    """Kernels of one eager fused step at batch 1 (the graph replays the same kernels)."""
    from torch.profiler import ProfilerActivity, profile

    token_ids, positions = step_inputs(1, context)
    model.decode(token_ids, positions, context, cache, cache.block_table[:1])  # warm
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model.decode(token_ids, positions, context, cache, cache.block_table[:1])
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    device_us = [e.self_device_time_total for e in kernels]
    rows = sorted(zip(device_us, [e.count for e in kernels], [e.key for e in kernels]), reverse=True)
    total_us, count = sum(device_us), sum(e.count for e in kernels)
    print(f"\nbatch-1 fused step, eager: {count} kernels, {total_us / 1e3:.2f} ms of kernel time")
    print("| kernel time ms | share | calls | kernel |\n| ---: | ---: | ---: | --- |")
    for us, calls, name in rows[:top]:
        print(f"| {us / 1e3:.3f} | {us / total_us:.0%} | {calls} | {name[:90]} |")
    return {"kernels": count, "kernel_ms": total_us / 1e3,
            "top": [{"ms": us / 1e3, "calls": calls, "name": name} for us, calls, name in rows[:top]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--context", type=int, default=160, help="each row's length (keys attended)")
    parser.add_argument("--key-bucket", type=int, default=256, help="the plain path's padded key length")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()

    bandwidth = copy_bandwidth()
    device_name = torch.cuda.get_device_name()
    print(f"{device_name}, torch {torch.__version__}, copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    config = ModelConfig.from_hf(LLAMA3_8B)
    model = random_model(config, args.max_model_len, torch.bfloat16, torch.device("cuda"))
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    kv_bytes_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2
    cache = KVCache.for_device(config.num_layers, max(args.batches), config.num_kv_heads, config.head_dim,
                               args.max_model_len, torch.bfloat16, torch.device("cuda"))
    for row in range(max(args.batches)):  # every row holds its own blocks, as in the engine
        assert cache.allocate(row, args.context)
    cache.sync_table()
    graphs = DecodeGraphs(model, cache)
    summary = {"device": device_name, "torch": torch.__version__, "copy_bandwidth_bytes_s": bandwidth,
               "context": args.context, "key_bucket": args.key_bucket,
               "check": check_fused_matches_plain(model, cache, graphs, args.context, args.key_bucket), "results": []}
    for batch in args.batches:
        token_ids, positions = step_inputs(batch, args.context)
        plain_ms = replay_ms(plain_graph(model, cache, token_ids, positions, args.key_bucket)[0])
        fused_ms = replay_ms(graphs.graphs[batch][0])
        roofline_ms = 1e3 * (weight_bytes + batch * args.context * kv_bytes_per_token) / bandwidth
        summary["results"].append({"batch": batch, "plain_ms": plain_ms, "fused_ms": fused_ms,
                                   "roofline_ms": roofline_ms})
        print(f"batch {batch:4d}: plain {plain_ms:6.2f} ms  fused {fused_ms:6.2f} ms  roofline {roofline_ms:5.2f} ms",
              flush=True)
    summary["profile_batch1"] = kernel_profile(model, cache, args.context)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_step.json").write_text(json.dumps(summary, indent=1))
    print(f"\nLlama-3-8B shape, bf16, context {args.context}, {device_name}: one decode step as a CUDA-graph replay")
    print("| batch | plain torch ops ms | Triton ops ms | roofline ms | plain: share of roofline | "
          "Triton: share of roofline |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in summary["results"]:
        print(f"| {r['batch']} | {r['plain_ms']:.2f} | {r['fused_ms']:.2f} | {r['roofline_ms']:.2f} | "
              f"{r['roofline_ms'] / r['plain_ms']:.2f} | {r['roofline_ms'] / r['fused_ms']:.2f} |")


if __name__ == "__main__":
    main()
