"""The model's forward passes alone on the CPU: a prefill and decode steps at batch 1, 4 and 8, for
each weight format (int8/int4+compiled: with the engine's compiled decode layers,
engine/compiled_decode.py), rounds alternating between the formats (a shared machine slows them alike).
--profile adds torch.profiler's table of the ops that took the time (matmuls vs the rest).

    BENTOML_HOME=/tmp/bench-home python pack_model.py   # once
    BENTOML_HOME=/tmp/bench-home python bench/cpu_forward.py [--rounds 3] [--threads 1] [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_cpu import default_model_dir  # noqa: E402  (bench/ is the script's folder)
from llgtrt_core.engine.compiled_decode import CompiledDecode  # noqa: E402
from llgtrt_core.engine.kv_cache import KVCache  # noqa: E402
from llgtrt_core.kernels import cpu_quant  # noqa: E402
from llgtrt_core.models.loader import load_model  # noqa: E402
from measure import machine  # noqa: E402

# name: (dtype, weights (load_model's), compiled decode layers)
FORMATS = {"float32": (torch.float32, "dense", False), "bfloat16": (torch.bfloat16, "dense", False),
           "int8": (torch.bfloat16, "int8", False), "int8+compiled": (torch.bfloat16, "int8", True),
           "int4": (torch.bfloat16, "int4", False), "int4+compiled": (torch.bfloat16, "int4", True),
           "int4-aten": (torch.bfloat16, "int4", False), "int4-aten+compiled": (torch.bfloat16, "int4", True)}
ATEN_INT4 = ("int4-aten", "int4-aten+compiled")  # aten's int4 kernel, as before our VNNI one (kernels/cpu_quant.py)
MAX_LEN = 1024
CONTEXT = 200  # tokens already cached when a decode step runs
SHORT_PROMPT = (32, 8)  # a chat prompt's new tokens after its cached prefix: (cached, new)
COMPILE_TIMEOUT_S = 1800


def passes(model, dtype: torch.dtype, compile_decode: bool, prompt_tokens: int, seed: int
           ) -> dict[str, Callable[[], torch.Tensor]]:
    config = model.config
    cache = KVCache(config.num_layers, 8, config.num_kv_heads, config.head_dim, MAX_LEN, dtype, torch.device("cpu"))
    for row in range(8):
        cache.allocate(row, CONTEXT + 64)
    cache.sync_table()
    layers_decode, stance = None, contextlib.nullcontext
    if compile_decode:
        started = time.perf_counter()
        # As the engine: every core for a prompt step, GEMM templates only for aten's matmuls.
        compiled = CompiledDecode(model, cache, gemm_templates=not model.uses_cpu_kernels(),
                                  prompt_threads=model.head_threads)
        compiled.start()
        if not compiled.wait(COMPILE_TIMEOUT_S):
            raise SystemExit("compiling the decode layers failed or timed out")
        print(f"compiled the decode layers in {time.perf_counter() - started:.1f} s", flush=True)
        layers_decode, stance = compiled.layers_decode(), compiled.stance
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, config.vocab_size, (prompt_tokens,), generator=generator)

    @torch.inference_mode()  # the inputs made as the engine makes them: compiled graphs are specific to that
    def decode(n: int) -> torch.Tensor:
        tokens = torch.randint(0, config.vocab_size, (n,), generator=generator)
        with stance():
            return model.decode(tokens, torch.full((n,), CONTEXT), CONTEXT + 1, cache, cache.block_table[:n],
                                layers_decode)

    cached, new = SHORT_PROMPT
    # A normal tensor, sliced, as the engine's (the graphs guard on a view's base).
    ride_table = torch.zeros(cache.block_table.shape, dtype=torch.long)[:new]

    @torch.inference_mode()
    def short_prompt() -> torch.Tensor:
        """Eagerly, or with compiled layers as the engine does: each token a row of the compiled step."""
        if layers_decode is None:
            return model.extend(prompt[:new], cache, slot=8 - 1, start=cached)
        torch.index_select(cache.block_table, 0, torch.full((new,), 8 - 1), out=ride_table)
        with compiled.prompt_stance(new, cached + new):
            return model.decode(prompt[:new], torch.arange(cached, cached + new), cached + new, cache, ride_table,
                                layers_decode, torch.tensor([new - 1]))

    return {f"prefill {prompt_tokens}": lambda: model.extend(prompt, cache, slot=8 - 1),
            f"prompt {new} after {cached}": short_prompt, "decode 1": lambda: decode(1), "decode 4": lambda: decode(4),
            "decode 8": lambda: decode(8)}


@contextlib.contextmanager
def aten_int4(on: bool) -> Iterator[None]:
    """Int4 layers made while this is on use aten's kernel, as where ours cannot run."""
    available, cpu_quant.available = cpu_quant.available, (lambda: False) if on else cpu_quant.available
    try:
        yield
    finally:
        cpu_quant.available = available


def timed_ms(run: Callable[[], torch.Tensor], repeats: int) -> float:
    run()  # warm-up: oneDNN picks its kernels on the first call of a shape
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"of {', '.join(FORMATS)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10, help="passes timed per round")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (the engine's default on 2 cores)")
    parser.add_argument("--head-threads", type=int, default=0,
                        help="torch threads of the lm_head (the engine's: every core); 0: --threads")
    parser.add_argument("--kernel-threads", type=int, default=1,
                        help="threads our cpu kernels share (the engine's while the cores are idle: every core)")
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0, help="the random token ids")
    parser.add_argument("--profile", action="store_true", help="torch.profiler table per format and pass")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_quant.available():
        cpu_quant.set_threads(args.kernel_threads)
    model_dir = default_model_dir()
    models = {}
    for name in args.formats.split(","):
        dtype, weights, compile_decode = FORMATS[name]
        with aten_int4(name in ATEN_INT4):
            model = load_model(model_dir, MAX_LEN, dtype, torch.device("cpu"), weights)
        model.head_threads = 0 if model.uses_cpu_kernels() else args.head_threads  # ours: --kernel-threads
        models[name] = passes(model, dtype, compile_decode, args.prompt_tokens, args.seed)
    print(f"{machine()}; {args.threads} thread(s), lm_head {args.head_threads or args.threads}, our kernels "
          f"{args.kernel_threads}; seed {args.seed}",
          flush=True)
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for name, runs in models.items():
            for label, run in runs.items():
                times.setdefault((name, label), []).append(timed_ms(run, args.repeats))
    for (name, label), values in times.items():
        print(f"{name:<13} {label:<18} {statistics.median(values):7.1f} ms  [{min(values):.1f}-{max(values):.1f}]")
    print(f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for name, runs in models.items():
            for label, run in runs.items():
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(args.repeats):
                        run()
                print(f"\n{name}, {label} ({args.repeats} passes)")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))


if __name__ == "__main__":
    main()
