"""An API worker's grammar text for a json_schema request, timed, against llguidance's own writer.

For a random draw of MaskBench schemas (seed printed), each round times, per schema, the server's
`json_schema_grammar` under its default JSON policy (the number bounds' copy of the schema, the
options merged, Python's JSON encoder) and, as the peer in the same run, llguidance's
`grammar_from_json_schema` on the same bounded copy (what the server called before: it walks the
schema holding the GIL). Both run on one thread; the work runs once per request in the serving
process, on a worker thread. Reports mean, p50, p99 and max ms per round; the spread is the rounds'.

    python3 bench/grammar_text.py --schemas 2000 --rounds 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from llguidance import LLMatcher

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from constrained_tbt import DEFAULT_DATA, schema_candidates  # noqa: E402
from measure import machine, percentile  # noqa: E402

from llgtrt_core.constraints.errors import GrammarRequestError  # noqa: E402
from llgtrt_core.constraints.request_grammar import JsonPolicy, NumberBounds, bound_numbers, json_schema_grammar  # noqa: E402


def llguidance_text(schema: dict, bounds: NumberBounds) -> str:
    return LLMatcher.grammar_from_json_schema(bound_numbers(schema, bounds), defaults={"whitespace_flexible": False})


def summary(seconds: list[float]) -> str:
    ms = [1e3 * s for s in seconds]
    return (f"mean {statistics.mean(ms):.3f} p50 {percentile(ms, 50):.3f} p99 {percentile(ms, 99):.2f} "
            f"max {max(ms):.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="MaskBench folder or a .jsonl.gz pool")
    parser.add_argument("--schemas", type=int, default=2000, help="drawn from the pool (0: all)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    schemas = [schema for _, schema in schema_candidates(args.data, 0, seed)]
    schemas = schemas[:args.schemas] if args.schemas else schemas
    print(f"seed {seed}, {len(schemas)} schemas; {machine()}")
    bounds = NumberBounds()
    policy = JsonPolicy(number_bounds=bounds)
    writers = {"server": lambda schema: json_schema_grammar(schema, policy),
               "llguidance": lambda schema: llguidance_text(schema, bounds)}
    for round_index in range(args.rounds):
        order = list(writers)
        random.Random(seed + round_index).shuffle(order)  # neither writer always runs first
        times: dict[str, list[float]] = {name: [] for name in writers}
        for schema in schemas:
            for name in order:
                start = time.perf_counter()
                try:
                    writers[name](schema)
                except (GrammarRequestError, ValueError):  # refused alike by both (a 400)
                    pass
                times[name].append(time.perf_counter() - start)
        ratio = statistics.mean(times["server"]) / statistics.mean(times["llguidance"])
        print(f"round {round_index}: server {summary(times['server'])}; llguidance {summary(times['llguidance'])}; "
              f"mean server / llguidance {ratio:.2f}")


if __name__ == "__main__":
    main()
