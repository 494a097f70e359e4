"""CPU decode speed of the embedded engine against Hugging Face transformers' eager `generate`.

Both run the same packed checkpoint (float32) in the same process, back to back, round after
round, so a machine shared with other busy processes slows both alike: compare the ratio.
Decode rate = tokens after the first / time after the first token (prefill excluded):
ours from the streamed deltas, HF's as (N - 1) / (t(N tokens) - t(1 token)).

    BENTOML_HOME=/tmp/bench-home python pack_model.py   # once
    BENTOML_HOME=/tmp/bench-home python bench/engine_cpu.py [--rounds 5] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llgtrt_core.engine.torch_engine import TorchEngine  # noqa: E402
from llgtrt_core.engine.torch_engine_config import TorchEngineConfig  # noqa: E402
from engine_rate import decode_tokens_per_s  # noqa: E402  (bench/ is the script's folder)

QUESTIONS = (
    "Tell me a story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "Write a poem about autumn leaves.",
    "Describe the water cycle in detail.",
)


def default_model_dir() -> Path:
    models = Path(os.environ.get("BENTOML_HOME", Path.home() / "bentoml")) / "models" / "smollm2-135m-instruct"
    return models / (models / "latest").read_text().strip()


def chat_prompt(tokenizer, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def hf_tokens_per_s(model, tokenizer, prompts: list[list[int]], tokens: int) -> float:
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def timed(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, pad_token_id=pad)
        assert out.shape[1] == width + n
        return time.perf_counter() - start

    return len(prompts) * (tokens - 1) / (timed(tokens) - timed(1))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--engine-threads", type=int, default=None, help="TorchEngineConfig.cpu_threads")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = args.model_dir or default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch_default_threads = torch.get_num_threads()
    engine = TorchEngine(model_dir, TorchEngineConfig(device="cpu", max_batch_size=max(args.batches),
                                                      cpu_threads=args.engine_threads))
    await engine.start()
    engine_threads = torch.get_num_threads()
    thread_counts = sorted({engine_threads, torch_default_threads})

    def hf_at(threads: int, prompts: list[list[int]], tokens: int) -> float:
        torch.set_num_threads(threads)  # process-wide; the engine is idle meanwhile
        try:
            return hf_tokens_per_s(hf_model, tokenizer, prompts, tokens)
        finally:
            torch.set_num_threads(engine_threads)

    print(f"torch {torch.__version__}, {os.cpu_count()} cpus, engine threads {engine_threads}, torch default "
          f"{torch_default_threads}, load average {os.getloadavg()[0]:.1f}, model {model_dir}")
    results: dict[int, list[tuple[float, dict[int, float]]]] = {b: [] for b in args.batches}
    try:
        await decode_tokens_per_s(engine, [chat_prompt(tokenizer, QUESTIONS[0])], 8, "warmup")
        hf_at(torch_default_threads, [chat_prompt(tokenizer, QUESTIONS[0])], 4)
        for round_index in range(args.rounds):
            for batch in args.batches:
                prompts = [chat_prompt(tokenizer, QUESTIONS[i % len(QUESTIONS)]) for i in range(batch)]
                ours = await decode_tokens_per_s(engine, prompts, args.tokens, f"r{round_index}b{batch}")
                hf = {threads: hf_at(threads, prompts, args.tokens) for threads in thread_counts}
                results[batch].append((ours, hf))
                print(f"round {round_index} batch {batch}: ours {ours:6.1f} tok/s  "
                      + "  ".join(f"HF@{t} threads {v:6.1f} tok/s" for t, v in hf.items())
                      + f"  ours/best HF {ours / max(hf.values()):.2f}", flush=True)
    finally:
        await engine.shutdown()
    header = " | ".join(f"HF generate @{t} threads tok/s" for t in thread_counts)
    print(f"\n| batch | ours @{engine_threads} threads tok/s | {header} | ours / best HF (median of rounds) |")
    print("| ---: | ---: | " + "---: | " * len(thread_counts) + "---: |")
    for batch, rounds in results.items():
        ours = statistics.median(o for o, _ in rounds)
        hf = " | ".join(f"{statistics.median(h[t] for _, h in rounds):.1f}" for t in thread_counts)
        ratio = statistics.median(o / max(h.values()) for o, h in rounds)
        print(f"| {batch} | {ours:.1f} | {hf} | {ratio:.2f} |")


if __name__ == "__main__":
    asyncio.run(main())
