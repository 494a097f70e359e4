"""Benchmark bitmask application on a CUDA GPU: ours against llguidance, XGrammar and masked_fill_.

    python bench/mask_kernel.py --out results/   # mask_kernel.json / _table.md / .png, masked_sampling.json

Useful bytes per call = the packed mask read (batch * words * 4) + one write per disallowed
logit; achieved bytes/s is printed as a fraction of the HBM bandwidth measured in the same run
by a large device-to-device copy (bytes read + bytes written); the JSON also holds it as a
fraction of a large fill's bandwidth (writes only), the ceiling of a write-only op. Each call is timed alone with
CUDA events after L2 is flushed by reading a buffer larger than it; the median is reported.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llgtrt_core.kernels import apply_token_bitmask_inplace  # noqa: E402
from llgtrt_core.kernels.cuda_ext import load_extension  # noqa: E402
from llgtrt_core.kernels.sampling import sample_with_bitmask  # noqa: E402
from measure import copy_bandwidth  # noqa: E402  (bench/ is the script's folder)

BATCHES = [1, 8, 64, 256, 1024]
VOCABS = {"32k": 32000, "128k": 128256, "152k": 151936}
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
DISALLOWED = {"99%": 0.99, "50%": 0.50}

Apply = Callable[[torch.Tensor, torch.Tensor], None]


class Timer:
    """Median of per-call CUDA event timings, L2 flushed by a read before each call."""

    def __init__(self, reps: int) -> None:
        self.reps = reps
        l2 = torch.cuda.get_device_properties(0).L2_cache_size
        self.flush_buffer = torch.ones(4 * l2 // 4, dtype=torch.float32, device="cuda")
        self.sink = torch.empty((), device="cuda")

    def median_seconds(self, fn: Callable[[], None], warmup: int = 3) -> float:
        for _ in range(warmup):
            fn()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        for start, end in zip(starts, ends):
            torch.sum(self.flush_buffer, dim=0, out=self.sink)  # reads only: leaves no dirty lines
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return float(np.median([s.elapsed_time(e) for s, e in zip(starts, ends)])) / 1e3


def write_bandwidth(timer: Timer, gib: float = 2.0) -> float:
    """Bytes/s of a large fill (writes only): the ceiling of an op that is nearly all writes."""
    buffer = torch.empty(int(gib * 2**30) // 4, device="cuda")
    seconds = timer.median_seconds(lambda: buffer.fill_(float("-inf")))
    return buffer.numel() * 4 / seconds


def packed_mask(batch: int, vocab: int, disallowed: float, generator: np.random.Generator) -> np.ndarray:
    words = (vocab + 31) // 32
    allowed = generator.random((batch, words * 32), dtype=np.float32) >= disallowed
    allowed[:, vocab:] = False
    return np.packbits(allowed, axis=1, bitorder="little").view("<i4").reshape(batch, words)


def implementations() -> dict[str, Optional[Apply]]:
    """name -> apply(logits, bitmask), None where the baseline cannot be imported here."""
    found: dict[str, Optional[Apply]] = {
        "ours": apply_token_bitmask_inplace,
    }
    # Our kernel without the whole-sector rewrite: the design it replaced, kept to measure it.
    found["ours, masked writes only"] = lambda logits, bitmask: load_extension().apply_token_bitmask_inplace(
        logits, bitmask, None, whole_sectors=False
    )
    try:
        from llguidance.torch import apply_token_bitmask_inplace as llguidance_apply

        found["llguidance (torch.compile)"] = llguidance_apply
    except ImportError as error:
        print(f"llguidance unavailable: {error}")
        found["llguidance (torch.compile)"] = None
    loaders = {
        "xgrammar cuda": ("apply_token_bitmask_inplace_cuda", "apply_token_bitmask_inplace_cuda"),
        "xgrammar triton": ("apply_token_bitmask_inplace_triton", "apply_token_bitmask_inplace_triton"),
        "xgrammar torch_compile": (
            "apply_token_bitmask_inplace_torch_compile",
            "apply_token_bitmask_inplace_torch_compile",
        ),
    }
    for name, (module, function) in loaders.items():
        try:
            found[name] = getattr(__import__(f"xgrammar.kernels.{module}", fromlist=[function]), function)
        except Exception as error:  # noqa: BLE001 - a baseline failing to build is reported, not fatal
            print(f"{name} unavailable: {type(error).__name__}: {error}")
            found[name] = None
    return found


def run(args: argparse.Namespace) -> list[dict]:
    timer = Timer(args.reps)
    bandwidth = copy_bandwidth()
    fill_bandwidth = write_bandwidth(timer)
    device = torch.cuda.get_device_name(0)
    print(f"device: {device}; measured copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write), "
          f"fill {fill_bandwidth / 1e12:.2f} TB/s (writes only)")
    impls = implementations()
    generator = np.random.default_rng(0)
    results = []
    for vocab_name, vocab in VOCABS.items():
        for disallowed_name, disallowed in DISALLOWED.items():
            for batch in args.batches:
                mask_host = packed_mask(batch, vocab, disallowed, generator)
                bitmask = torch.from_numpy(mask_host).cuda()
                allowed = np.unpackbits(mask_host.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
                disallowed_bool = torch.from_numpy(allowed == 0).cuda()
                for dtype_name, dtype in DTYPES.items():
                    logits = torch.randn(batch, vocab, device="cuda", dtype=dtype)
                    useful_bytes = bitmask.numel() * 4 + int(disallowed_bool.sum()) * logits.element_size()
                    calls: dict[str, Optional[Callable[[], None]]] = {
                        name: (None if fn is None else (lambda fn=fn: fn(logits, bitmask)))
                        for name, fn in impls.items()
                    }
                    calls["masked_fill_ (unpacked bool mask)"] = lambda: logits.masked_fill_(
                        disallowed_bool, float("-inf")
                    )
                    for name, call in calls.items():
                        seconds = math.nan
                        if call is not None:
                            try:
                                seconds = timer.median_seconds(call)
                            except Exception as error:  # noqa: BLE001
                                print(f"{name} failed at {dtype_name} {vocab_name} {batch}: {error}")
                        results.append(
                            dict(
                                impl=name, dtype=dtype_name, vocab=vocab, batch=batch, disallowed=disallowed_name,
                                us=seconds * 1e6, fraction=useful_bytes / seconds / bandwidth,
                                fraction_of_fill=useful_bytes / seconds / fill_bandwidth,
                                useful_bytes=useful_bytes,
                            )
                        )
                    done = results[-len(calls):]
                    print(f"{dtype_name} {vocab_name} {disallowed_name} batch {batch}: "
                          + ", ".join(f"{r['impl']} {r['us']:.1f}us {r['fraction']:.0%}" for r in done), flush=True)
                    del logits
                del disallowed_bool, bitmask
    torch.cuda.empty_cache()
    return [dict(r, device=device, copy_tb_s=bandwidth / 1e12, fill_tb_s=fill_bandwidth / 1e12) for r in results]


def run_sampling(args: argparse.Namespace, vocab: int = 128256) -> list[dict]:
    """Fused constrained sampling against fused unconstrained sampling and the unfused path
    (mask kernel, then softmax + multinomial), 99%-disallowed masks, temperature 0.8."""
    timer = Timer(args.reps)
    generator = np.random.default_rng(1)
    results = []
    for dtype_name, dtype in DTYPES.items():
        for batch in [1, 8, 64, 256]:
            logits = torch.randn(batch, vocab, device="cuda", dtype=dtype)
            bitmask = torch.from_numpy(packed_mask(batch, vocab, 0.99, generator)).cuda()
            temperature = torch.full((batch,), 0.8, device="cuda")
            seeds = torch.arange(batch, device="cuda")

            def unfused(masked: bool) -> None:
                scaled = logits.float() if not masked else logits.clone().float()
                if masked:
                    apply_token_bitmask_inplace(scaled, bitmask)
                torch.multinomial(torch.softmax(scaled / temperature[:, None], dim=-1), 1)

            calls = {
                "fused, unconstrained": lambda: sample_with_bitmask(logits, temperature, seeds),
                "fused, constrained": lambda: sample_with_bitmask(logits, temperature, seeds, bitmask),
                "torch softmax + multinomial, unconstrained": lambda: unfused(False),
                "mask kernel + torch softmax + multinomial": lambda: unfused(True),
            }
            timings = {name: timer.median_seconds(call) * 1e6 for name, call in calls.items()}
            print(f"sampling {dtype_name} vocab {vocab} batch {batch}: "
                  + ", ".join(f"{name} {us:.1f}us" for name, us in timings.items()), flush=True)
            results += [
                dict(impl=name, dtype=dtype_name, vocab=vocab, batch=batch, us=us) for name, us in timings.items()
            ]
    return results


def markdown_table(results: list[dict]) -> str:
    names = list(dict.fromkeys(r["impl"] for r in results))
    lines = [
        "| dtype | vocab | disallowed | batch | " + " | ".join(names) + " |",
        "|" + " --- |" * (4 + len(names)),
    ]
    keyed = {(r["dtype"], r["vocab"], r["disallowed"], r["batch"], r["impl"]): r for r in results}
    for key in dict.fromkeys((r["dtype"], r["vocab"], r["disallowed"], r["batch"]) for r in results):
        cells = []
        for name in names:
            r = keyed[key + (name,)]
            cells.append("n/a" if math.isnan(r["us"]) else f"{r['us']:.1f} us ({r['fraction']:.0%})")
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path, vocab: int = 128256) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(d, m) for d in DTYPES for m in DISALLOWED]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), sharey=True)
    for ax, (dtype_name, disallowed_name) in zip(axes, panels):
        for name in dict.fromkeys(r["impl"] for r in results):
            rows = [
                r for r in results
                if r["impl"] == name and r["dtype"] == dtype_name and r["vocab"] == vocab
                and r["disallowed"] == disallowed_name
            ]
            ax.plot([r["batch"] for r in rows], [r["fraction"] for r in rows], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{dtype_name}, vocab {vocab}, {disallowed_name} disallowed")
        ax.set_xlabel("batch")
        ax.axhline(0.85, color="grey", linestyle="--", linewidth=0.8)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("useful bytes/s / measured copy bandwidth")
    axes[-1].legend(fontsize=7)
    fig.suptitle(f"Token bitmask apply on {results[0]['device']} (copy {results[0]['copy_tb_s']:.2f} TB/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--batches", type=int, nargs="+", default=BATCHES)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    results = run(args)
    (args.out / "mask_kernel.json").write_text(json.dumps(results, indent=1))
    table = markdown_table(results)
    (args.out / "mask_kernel_table.md").write_text(table + "\n")
    plot(results, args.out / "mask_kernel.png")
    sampling = run_sampling(args)
    (args.out / "masked_sampling.json").write_text(json.dumps(sampling, indent=1))
    print(table)


if __name__ == "__main__":
    main()
