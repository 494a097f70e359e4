"""Which MaskBench schemas have slow token masks: the cost one constrained row adds to every step.

A batch's mask fill runs its rows in parallel, so the step waits for its slowest row: one schema
whose mask takes longer than the GPU's decode step slows the whole batch (docs/benchmarks/engine.md,
session 17). This finds such schemas on the CPU, without a server: each schema is compiled as the
server compiles a `response_format` json_schema (its default llguidance settings) for the Llama 3
tokenizer, then walked `--walks` times for up to `--steps` tokens, each token drawn uniformly from
those its mask allows (EOS aside), as a random-weight model's argmax falls anywhere the mask allows;
each mask computation is timed on one thread. The walks share the compiled grammar, whose lexer
states persist: the first walk pays for the states it builds (a schema's first requests), later
ones mostly reuse them. Walks that end on an llguidance error (a lexer out of its per-token fuel)
are listed by schema; a lexer that failed fails the later walks of its grammar at their first token.

    python3 bench/slow_masks.py --schemas 1500                   # a random draw of the pool (seed printed)
    python3 bench/slow_masks.py --run constrained_tbt.json       # the schemas of a constrained_tbt run
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from constrained_tbt import DEFAULT_DATA, schema_candidates  # noqa: E402
from llama3 import EOT_ID  # noqa: E402
from maskbench import load_hf_tokenizer  # noqa: E402
from llgtrt_core.config import LlguidanceConfig  # noqa: E402
from llgtrt_core.constraints.grammar import (CompiledGrammar, GrammarCompiler, GrammarRequestError,  # noqa: E402
                                             build_ll_tokenizer)
from llgtrt_core.constraints.mask_probe import mask_probe_seconds  # noqa: E402
from llgtrt_core.constraints.request_grammar import request_grammar  # noqa: E402

VOCAB = 128256  # Llama 3's logits width


def llama3_compiler() -> GrammarCompiler:
    """The server's grammar compiler (its default llguidance settings) for the Llama 3 tokenizer,
    without the server's background probe (which would build lexer states before the first walk)."""
    ll_tokenizer = build_ll_tokenizer(load_hf_tokenizer("llama3"), VOCAB, [EOT_ID])
    compiler = GrammarCompiler.from_config(ll_tokenizer, LlguidanceConfig())
    compiler.slow_mask_s = None
    return compiler


def compiled(compiler: GrammarCompiler, schema: dict[str, Any]) -> Optional[CompiledGrammar]:
    """The schema's grammar as the server builds and compiles it; None when the server refuses it."""
    request = {"response_format": {"type": "json_schema", "json_schema": {"name": "maskbench", "schema": schema}}}
    try:
        found = compiler.request_grammar(request)
        return compiler.checked(compiler.compile_future(found.grammar).result(), found.param)
    except GrammarRequestError:  # a 400 at the server
        return None


def compiled_draw(compiler: GrammarCompiler, data: Path, seed: int, count: int) -> list[CompiledGrammar]:
    """The first `count` schemas of the pool shuffled by `seed` that the server accepts, compiled."""
    grammars = []
    for _, schema in schema_candidates(data, 0, seed):
        grammar = compiled(compiler, schema)
        if grammar is not None:
            grammars.append(grammar)
        if len(grammars) == count:
            break
    return grammars


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="MaskBench folder or a .jsonl.gz pool")
    parser.add_argument("--schemas", type=int, default=0, help="a random draw of this many schemas (0: all)")
    parser.add_argument("--run", type=Path, help="the schemas of a bench/constrained_tbt.py run (its --json)")
    parser.add_argument("--seed", type=int, default=None, help="of the draw and the walks (random by default)")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--walks", type=int, default=2)
    parser.add_argument("--top", type=int, default=20, help="list this many of the slowest")
    parser.add_argument("--json", type=Path, help="write every schema's mask times here")
    args = parser.parse_args()
    seed = random.randrange(2**31) if args.seed is None else args.seed
    print(f"seed {seed}")
    candidates = dict(schema_candidates(args.data, 0, seed))
    if args.run is not None:
        names = json.loads(args.run.read_text())["schemas"]
    else:
        names = list(candidates)[:args.schemas or None]
    compiler = llama3_compiler()
    rng = random.Random(seed)
    rows = []
    for name in names:
        grammar = compiled(compiler, candidates[name])
        if grammar is None:
            continue
        walks = [mask_probe_seconds(grammar.matcher, args.steps, rng, [EOT_ID]) for _ in range(args.walks)]
        first, *later = [walk.times for walk in walks]
        later_times = [t for walk in later for t in walk]
        rows.append({"name": name, "first_walk_mean_ms": 1e3 * statistics.mean(first),
                     "later_walks_mean_ms": 1e3 * statistics.mean(later_times) if later_times else None,
                     "max_ms": 1e3 * max(first + later_times), "masks": len(first) + len(later_times),
                     "errors": [(i, len(walk.times), walk.error.split("\n", 1)[0])
                                for i, walk in enumerate(walks) if walk.error is not None]})
    rows.sort(key=lambda row: -row["first_walk_mean_ms"])
    print(f"{len(rows)} of {len(names)} schemas compiled; {compiler.tokenizer.vocab_size} tokens; "
          f"{args.walks} walks of up to {args.steps} tokens each")
    print("| schema | first walk mean ms | later walks mean ms | max ms | masks |\n| --- | ---: | ---: | ---: | ---: |")
    for row in rows[:args.top]:
        later = "" if row["later_walks_mean_ms"] is None else f"{row['later_walks_mean_ms']:.3f}"
        print(f"| {row['name']} | {row['first_walk_mean_ms']:.3f} | {later} | {row['max_ms']:.2f} | {row['masks']} |")
    means = [row["first_walk_mean_ms"] for row in rows]
    print(f"first walk mean per schema: median {statistics.median(means):.3f} ms")
    for limit in (0.5, 1.0, 2.0):
        share = sum(m >= limit for m in means) / len(means)
        odds = "" if args.run else f"; a random draw of 128 holds one with probability {1 - (1 - share) ** 128:.0%}"
        print(f">= {limit} ms: {share:.2%} of the schemas{odds}")
    failed = [row for row in rows if row["errors"]]
    print(f"schemas whose walks ended on an llguidance error: {len(failed)}")
    for row in failed:
        walk, masks, error = row["errors"][0]
        print(f"  {row['name']}: {len(row['errors'])} of {args.walks} walks; walk {walk} after {masks} masks: {error}")
    if args.json is not None:
        args.json.write_text(json.dumps({"seed": seed, "args": {k: str(v) for k, v in vars(args).items()},
                                         "schemas": rows}, indent=1))


if __name__ == "__main__":
    main()
