"""Which share of MaskBench schemas the server's mask probe marks slow, and by which of its windows.

Each schema of a random draw (seed printed) is compiled as the server compiles a `response_format`
json_schema for the Llama 3 tokenizer and walked by the server's own probe (`probe_grammar`, its
64 tokens seeded by the grammar's text); it counts as slow by its first `PROBE_START_TOKENS` masks,
by the whole walk, and by either (`probe_cost`, what the server judges by), at
`llguidance.slow_mask_ms`. Mask times vary from run to run: run it more than once.

    python3 bench/probe_share.py --schemas 800 --seed 99
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from constrained_tbt import DEFAULT_DATA, schema_candidates  # noqa: E402
from llama3 import EOT_ID  # noqa: E402
from slow_masks import compiled, llama3_compiler  # noqa: E402

from llgtrt_core.config import LlguidanceConfig  # noqa: E402
from llgtrt_core.constraints.mask_probe import PROBE_START_TOKENS, probe_cost, probe_grammar  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="MaskBench folder or a .jsonl.gz pool")
    parser.add_argument("--schemas", type=int, default=800, help="a random draw of this many")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    seed = random.randrange(2**31) if args.seed is None else args.seed
    slow_s = LlguidanceConfig().slow_mask_ms / 1e3
    compiler = llama3_compiler()
    walked = by_start = by_walk = by_either = 0
    for _, schema in schema_candidates(args.data, 0, seed)[:args.schemas]:
        grammar = compiled(compiler, schema)
        if grammar is None:
            continue
        times = probe_grammar(grammar.matcher, grammar.grammar, [EOT_ID]).times
        walked += 1
        by_start += statistics.fmean(times[:PROBE_START_TOKENS]) >= slow_s
        by_walk += statistics.fmean(times) >= slow_s
        by_either += probe_cost(times) >= slow_s
    print(f"seed {seed}: {walked} of {args.schemas} schemas compiled; slow (>= {1e3 * slow_s:g} ms a mask) by the first "
          f"{PROBE_START_TOKENS} masks {by_start} ({by_start / walked:.2%}), by the whole walk {by_walk} "
          f"({by_walk / walked:.2%}), by either {by_either} ({by_either / walked:.2%})")


if __name__ == "__main__":
    main()
