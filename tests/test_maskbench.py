"""MaskBench conformance with the default model's tokenizer (SmolLM2, 49,152 tokens).

For every schema: it compiles, or fails with GrammarRequestError carrying llguidance's own
message (never another exception). For every valid instance, serialized the way the default
grammar wants (compact JSON), each token is allowed by the mask our post-processor fills,
step by step, and EOS is allowed at the end; every invalid instance is refused at some step
or at the end. A fixed sample runs in CI; every file runs under `-m slow`. The benchmark's
continuous batching (bench/maskbench.py) is checked here for correctness, not speed.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

import llguidance
import pytest

from llgtrt_core.constraints import GrammarCompiler, GrammarRequestError, build_ll_tokenizer
from llgtrt_core.constraints.postprocessor import MaskPostProcessor
from llgtrt_core.constraints.request_grammar import dumps_compact, json_schema_grammar
from llgtrt_core.engine.interface import ConstrainedRow

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "maskbench"
FILES = sorted(DATA.glob("*.json")) if DATA.is_dir() else []
SAMPLE_SIZE = 40
SAMPLE = FILES[:: max(1, len(FILES) // SAMPLE_SIZE)][:SAMPLE_SIZE]
NO_DATA = pytest.mark.skipif(not FILES, reason=f"MaskBench data not found at {DATA}")

# Files where llguidance 1.9.1 refuses a valid instance, found by test_every_file_conforms
# (14 of 7,985 files; every invalid instance of every file is refused).
SCHEMA_ORDER = "an object's keys are not in the schema's property order (llguidance keeps that order)"
REF_SIBLINGS = "`$ref` with sibling keywords: draft-04/07 ignore the siblings, llguidance applies them"
KNOWN_DEVIATIONS = {
    "Github_easy---o21053.json": "pattern `^$|(^(?:\\S+\\s+){0,99}\\S+$)` refuses a matching string",
    "Github_medium---o14421.json": REF_SIBLINGS,
    "JsonSchemaStore---drupal-libraries.json": REF_SIBLINGS,
    "Github_hard---o57716.json": "a number with `minimum` refuses exponent notation (1e-06)",
    "Github_ultra---o46322.json": "`multipleOf: 0.01` refuses 6000.0",
    "Github_hard---o67291.json": SCHEMA_ORDER,
    "Github_medium---o61349.json": SCHEMA_ORDER,
    "Github_medium---o57617.json": SCHEMA_ORDER,
    "Github_hard---o77403.json": SCHEMA_ORDER,
    "Github_ultra---o69209.json": SCHEMA_ORDER,
    "Snowplow---sp_163_Normalized.json": SCHEMA_ORDER,
    "Github_hard---o13693.json": "refused inside a nested object (not analysed)",
    "Github_hard---o38538.json": "refused inside a nested object (not analysed)",
    "Github_ultra---o359.json": "refused inside a nested object (not analysed)",
}


class Checker:
    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer
        self.ll = build_ll_tokenizer(hf_tokenizer)
        self.compiler = GrammarCompiler(self.ll, cache_size=0)
        self.processor = MaskPostProcessor(self.ll, max_batch_size=1)

    def compile(self, schema: Any) -> tuple[str, Any]:
        """(grammar, compiled) or GrammarRequestError."""
        grammar = json_schema_grammar(schema)
        return grammar, asyncio.run(self.compiler.compile(grammar))

    def refusal(self, compiled: Any, instance: Any) -> Optional[str]:
        """None when every token of the instance is allowed and EOS is allowed after it,
        else where it was refused."""
        tokens = self.hf.encode(dumps_compact(instance), add_special_tokens=False)
        constraint = self.compiler.new_constraint(compiled)
        previous = None
        for step, token in enumerate(tokens + [self.ll.eos_token]):
            mask = self.processor.fill([ConstrainedRow(constraint, 0, previous)])[0]
            if not (int(mask[token // 32]) >> (token % 32)) & 1:
                where = "EOS" if step == len(tokens) else repr(self.hf.decode(tokens[: step + 1])[-40:])
                return f"refused at step {step}/{len(tokens)}: {where}"
            previous = token
        assert constraint.error is None
        return None

    def check_file(self, path: Path) -> list[str]:
        """Failures for one file (empty list: it conforms)."""
        data = json.loads(path.read_text())
        try:
            grammar, compiled = self.compile(data["schema"])
        except GrammarRequestError as error:
            assert error.message, f"{path.name}: empty compile error"
            return []
        failures = []
        if path.name in KNOWN_DEVIATIONS:
            return failures
        for index, test in enumerate(data.get("tests") or []):
            refusal = self.refusal(compiled, test["data"])
            if test["valid"] and refusal:
                failures.append(f"{path.name} test {index} (valid) {refusal}")
            elif not test["valid"] and not refusal:
                failures.append(f"{path.name} test {index} (invalid) was accepted")
        return failures


@pytest.fixture(scope="module")
def checker(smollm2_tokenizer_dir: Path) -> Checker:
    from transformers import AutoTokenizer

    return Checker(AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir)))


@NO_DATA
@pytest.mark.parametrize("path", SAMPLE, ids=[p.stem for p in SAMPLE])
def test_sample_file_conforms(checker: Checker, path: Path):
    assert checker.check_file(path) == []


@NO_DATA
def test_sample_holds_schemas_of_both_kinds(checker: Checker):
    """The sample must exercise both paths: schemas that compile and schemas that do not;
    those that do not carry llguidance's own message."""
    compiled, refused = 0, 0
    for path in SAMPLE:
        schema = json.loads(path.read_text())["schema"]
        try:
            checker.compile(schema)
            compiled += 1
        except GrammarRequestError as error:
            refused += 1
            grammar = json_schema_grammar(schema)
            assert error.message == llguidance.LLMatcher.validate_grammar(
                grammar, checker.ll, limits=checker.compiler.limits)
    assert compiled >= SAMPLE_SIZE // 2 and refused >= 1


NOT_COMPILING = [
    ({"type": "string", "format": "not-a-format"}, "Unknown format"),
    ({"type": "string", "pattern": "(?<=x)y"}, "look-around"),
    ({"not": {"type": "string"}}, "Unimplemented keys"),
    ({"type": "integer", "minimum": "zero"}, "minimum"),
    ({"$ref": "#/$defs/missing"}, "missing"),
    ({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}, "oneOf"),
]


@pytest.mark.parametrize("schema, fragment", NOT_COMPILING, ids=[f for _, f in NOT_COMPILING])
def test_schemas_llguidance_cannot_compile_are_request_errors(checker: Checker, schema, fragment):
    with pytest.raises(GrammarRequestError) as error:
        checker.compile(schema)
    assert fragment in error.value.message
    assert error.value.message == llguidance.LLMatcher.validate_grammar(
        json_schema_grammar(schema), checker.ll, limits=checker.compiler.limits)


@NO_DATA
@pytest.mark.slow
def test_every_file_conforms(checker: Checker):
    """Every file but KNOWN_DEVIATIONS (which still must compile or raise GrammarRequestError)."""
    failures = [failure for path in FILES for failure in checker.check_file(path)]
    assert failures == [], f"{len(failures)} failures:\n" + "\n".join(failures[:50])


def load_maskbench() -> ModuleType:
    """bench/maskbench.py, loaded from its path (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "maskbench_script", Path(__file__).resolve().parent.parent / "bench" / "maskbench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


maskbench = load_maskbench()
BATCH_FILES = SAMPLE[:10]  # quick for XGrammar too: SAMPLE[11] takes it 30 s to compile


def test_batch_schedule_gives_a_finished_slot_the_next_sequence():
    # Sequences of 1 and 2 tokens take 2 and 3 steps; sequence k replays pool entry k % 2.
    assert maskbench.batch_schedule([1, 2], size=2, steps=5) == [
        [(0, 0), (1, 0)], [(0, 1), (1, 1)], [(2, 0), (1, 2)], [(2, 1), (3, 0)], [(4, 0), (3, 1)]]


def test_spread_order_reaches_every_part_of_the_folder_first():
    order = maskbench.spread_order(list(range(200)), stride=64)
    assert order[:4] == [0, 64, 128, 192] and order[4:7] == [1, 65, 129]
    assert sorted(order) == list(range(200))


def test_shards_split_the_selection_and_merge_into_one_report(tmp_path: Path):
    for name in "abcdefg":
        (tmp_path / f"{name}.json").write_text("{}")
    shards = [maskbench.select_files(tmp_path, every=2, limit=0, shard=(k, 3)) for k in range(3)]
    assert [total for _, total in shards] == [4, 4, 4]
    assert sorted(p.name for files, _ in shards for p in files) == ["a.json", "c.json", "e.json", "g.json"]

    def file(name: str, steps: list[float]) -> Any:
        return maskbench.FileResult(name, compiled=bool(steps), valid=1, valid_accepted=bool(steps),
                                    first_mask_us={"raw": 9.0, "ours": 10.0} if steps else {},
                                    step_us={"raw": steps, "ours": [t + 1 for t in steps]} if steps else {})

    parts = [[file("a", [1.0, 2.0]), file("b", [])], [file("c", [30.0, 40.0, 50.0])]]
    runs = [{"shard": {"index": k, "of": 2, "files_of_all_shards": 3}, "files": len(part), "command": "",
             "date": "", "machine": "", "seconds": 1.0, "llguidance_seconds": 1.0, "llguidance": "1",
             "tokenizer": "t", "vocab_size": 9, "executor_threads": 2, "batch": {"skipped": ""},
             "per_file": {"llguidance": [maskbench.compact(r) for r in part]}} for k, part in enumerate(parts)]
    merged = maskbench.merge_shards(runs[::-1])
    assert merged["files"] == 3 and merged["schemas_compiled"] == 2 and merged["valid_accepted"] == 2
    assert merged["step"] == maskbench.summarize(parts[0] + parts[1])["step"]
    assert merged["step"]["raw"]["p50_us"] == 30.0  # of the five steps, not an average of the shards' p50s
    with pytest.raises(SystemExit):
        maskbench.merge_shards(runs[:1])


@pytest.fixture(scope="module")
def bench(smollm2_tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    bench = maskbench.Bench(AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir)), threads=2)
    bench.results = [asyncio.run(bench.run_file(path, raw_first=i % 2 == 0)) for i, path in enumerate(BATCH_FILES)]
    return bench


@NO_DATA
def test_continuous_batch_masks_agree_and_allow_every_next_token(bench: Any):
    summary = maskbench.summarize(bench.results)
    assert summary["schemas_compiled"] >= 6 and summary["mask_mismatches"] == 0
    pool = maskbench.batch_pool(bench, 8, None)
    assert len(pool) >= 4
    batch = maskbench.run_batch(bench, pool, size=4, steps=60)
    assert batch["sequences"] > 4  # slots were refilled
    assert batch["mask_mismatches_ours_vs_llguidance"] == 0
    assert batch["next_token_disallowed"] == {"ours": 0, "llguidance_par": 0, "llguidance_one_thread": 0}
    assert batch["ours"]["n"] == 60


@NO_DATA
def test_xgrammar_runs_the_same_files_and_batch(bench: Any):
    pytest.importorskip("xgrammar")
    xgrammar_files = maskbench.XGrammarFiles(bench.hf, bench.ll.vocab_size)
    results = [xgrammar_files.run_file(path) for path in BATCH_FILES]
    summary = maskbench.summarize(results)
    assert summary["files"] == len(BATCH_FILES) and summary["schemas_compiled"] >= 6
    assert summary["step"]["xgrammar"]["n"] > 0
    pool = maskbench.batch_pool(bench, 8, results)
    assert pool and all(sequence.name in {r.name for r in results if r.compiled} for sequence in pool)
    maskbench.compile_xgrammar_pool(pool, DATA, xgrammar_files)
    batch = maskbench.run_batch(bench, pool, size=4, steps=30, xgr=xgrammar_files.xgr, threads=2)
    assert set(batch["next_token_disallowed"].values()) == {0}
    assert batch["xgrammar_batch"]["n"] == batch["xgrammar_one_thread"]["n"] == 30
