"""Host and wall time of single forward passes of the Llama-3-8B shape (random bf16 weights) on a
GPU: eager prefills of several shapes, graph decode, graph decode with prompt tokens as extra rows
(decode_graphs.py), eager decode and the eager mixed pass. Min of 3 after a warm-up; "host" is the
time until the call returns (Python and kernel launches), "wall" until the GPU is done.

    python3 bench/pass_probe.py     # on a GPU machine (docs/benchmarks/engine.md, session 7)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llama3 import LLAMA3_8B  # noqa: E402  (bench/ is the script's folder)

from llgtrt_core.engine.decode_graphs import DecodeGraphs  # noqa: E402
from llgtrt_core.engine.kv_cache import KVCache  # noqa: E402
from llgtrt_core.models.llama import ModelConfig, Segment  # noqa: E402
from llgtrt_core.models.loader import random_model  # noqa: E402

SLOTS = 256
VOCAB_DRAWN = 128000


def timed(run: Callable[[], object], repeats: int = 3) -> str:
    run()
    torch.cuda.synchronize()
    host, wall = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        host.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        wall.append(time.perf_counter() - start)
    return f"host {1e3 * min(host):.1f} ms, wall {1e3 * min(wall):.1f} ms"


@torch.inference_mode()
def main() -> None:
    device = torch.device("cuda")
    config = ModelConfig.from_hf(LLAMA3_8B)
    model = random_model(config, 4096, torch.bfloat16, device)
    cache = KVCache.for_device(config.num_layers, SLOTS, config.num_kv_heads, config.head_dim, 4096, torch.bfloat16,
                               device, max_tokens=300_000)
    generator = torch.Generator().manual_seed(0)

    def tokens(count: int) -> torch.Tensor:
        return torch.randint(0, VOCAB_DRAWN, (count,), generator=generator).to(device)

    for slot in range(SLOTS):
        assert cache.allocate(slot, 2100 if slot < 32 else 700)
    cache.sync_table()
    prefills = {"32 x 512 fresh": [Segment(i, 0, 512) for i in range(32)],
                "16 x 512 fresh": [Segment(i, 0, 512) for i in range(16)],
                "1 x 2000 fresh": [Segment(0, 0, 2000)],
                "1 x 40 fresh": [Segment(0, 0, 40)],
                "4 x 40 fresh": [Segment(i, 0, 40) for i in range(4)],
                "32 x 100 after 1500 cached": [Segment(i, 1500, 100) for i in range(32)],
                "1 x 100 after 1500 cached": [Segment(0, 1500, 100)]}
    for name, segments in prefills.items():
        ids = tokens(sum(s.length for s in segments))
        print(f"eager prefill {name}:", timed(lambda: model.extend_batch(ids, cache, segments)))

    graphs = DecodeGraphs(model, cache)
    ids, positions = tokens(SLOTS), torch.full((SLOTS,), 600, dtype=torch.int64, device=device)
    print(f"graph decode {SLOTS} @600:", timed(lambda: graphs.decode(ids, positions)))
    print(f"eager decode {SLOTS} @600:",
          timed(lambda: model.decode(ids, positions, 601, cache, cache.block_table[:SLOTS])))
    for extra in (40, 128, 256):
        rows_ids = tokens(SLOTS + extra)
        rows_positions = torch.cat([positions, torch.arange(extra, device=device)])
        cache_rows = torch.cat([torch.arange(SLOTS, device=device), torch.full((extra,), SLOTS - 1, device=device)])
        print(f"graph decode {SLOTS} + {extra} prompt rows:",
              timed(lambda: graphs.decode(rows_ids, rows_positions, cache_rows)))
    for prompts in (1, 4):
        n = SLOTS - prompts
        new = tokens(40 * prompts)
        segments = [Segment(n + i, 0, 40) for i in range(prompts)]
        print(f"eager mixed {n} + {prompts} x 40:", timed(lambda: model.mixed(
            ids[:n], positions[:n], 601, cache, cache.block_table[:n], new, segments)))


if __name__ == "__main__":
    main()
