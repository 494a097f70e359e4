"""A slow grammar's rows are filled apart from the batch's, and a row whose mask is late sits the
step out (its draw dropped, its previous token decoded again): on the real default model with real
llguidance, every request's greedy tokens are the same as when the step waits for the mask, with
the request's penalties, with and without overlapped steps.

Whether a real grammar's mask misses its step depends on the machine; `LateMaskPostProcessor`
makes it certain: the real post-processor, whose fills apart end only after the step they serve.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Optional

import pytest

from llgtrt_core.constraints import GrammarCompiler
from llgtrt_core.constraints.postprocessor import MaskPostProcessor
from llgtrt_core.constraints.request_grammar import json_schema_grammar
from llgtrt_core.engine.interface import GenerationRequest, SamplingParams
from llgtrt_core.engine.torch_engine import TorchEngine
from llgtrt_core.engine.torch_engine_config import TorchEngineConfig
from llgtrt_core.tokenizer import Tokenizer

from test_fast_forward import SCHEMA, chat_prompt, greedy, ll_tokenizer, tokenizer  # noqa: F401 (fixtures)


class LateMaskPostProcessor(MaskPostProcessor):
    """The real post-processor; each of its fills apart (a slow grammar's rows) ends once the engine
    has begun two more steps, so the step it serves draws without it, however long a step takes on
    this machine (a fixed 150 ms delay stopped being late on a VM whose CPU steps took 180 ms). While
    only slow rows run, the step waits for it: it ends at once."""

    engine: Optional[TorchEngine] = None

    def fill_apart(self, rows):
        started = self.engine.num_steps
        while self.engine.num_steps < started + 2 and any(
                seq.request.constraint is None or not seq.request.constraint.mask_cost.slow
                for seq in list(self.engine.scheduler.running)):
            time.sleep(0.002)
        return super().fill_apart(rows)


def run(stored_model_dir: Path, ll_tokenizer, tokenizer: Tokenizer, slow: bool, overlap_steps: bool
        ) -> tuple[list[list[int]], list[str], int]:
    """A plain request, a constrained one and a constrained one with a frequency penalty, together;
    slow: their grammar is marked slow (as the compiler's probe marks one). Each one's tokens and
    finish reason, and the steps rows sat out."""

    async def generate():
        compiler = GrammarCompiler(ll_tokenizer)
        processor = LateMaskPostProcessor(ll_tokenizer, max_batch_size=4)
        engine = TorchEngine(stored_model_dir, TorchEngineConfig(device="cpu", dtype="float32", max_batch_size=4,
                                                                 fast_forward=False, overlap_steps=overlap_steps),
                             processor)
        processor.engine = engine
        await engine.start()
        try:
            compiled = await compiler.compile(json_schema_grammar(SCHEMA))
            if slow:
                compiled.mask_cost.mark_slow()
            specs = [("Name three colors.", False, greedy(tokenizer, max_tokens=30)),
                     ("Describe a person as JSON.", True, greedy(tokenizer, max_tokens=40)),
                     ("Describe a friend as JSON.", True, greedy(tokenizer, max_tokens=40, frequency_penalty=0.5))]

            async def one(i: int, question: str, constrained: bool, sampling: SamplingParams):
                request = GenerationRequest(f"r{i}", chat_prompt(tokenizer, question), sampling,
                                            compiler.new_constraint(compiled) if constrained else None)
                tokens, reason = [], None
                async for delta in engine.generate(request):
                    tokens += delta.token_ids
                    reason = delta.finish_reason
                return tokens, reason

            results = await asyncio.gather(*(one(i, *spec) for i, spec in enumerate(specs)))
            return [r[0] for r in results], [r[1] for r in results], engine.step_stats()["num_sit_outs"]
        finally:
            await engine.shutdown()
            compiler.close()

    return asyncio.run(generate())


@pytest.mark.parametrize("overlap_steps", [False, True], ids=["plain-steps", "overlapped-steps"])
def test_rows_that_sit_out_for_a_late_mask_generate_what_waiting_would(
        stored_model_dir: Path, ll_tokenizer, tokenizer: Tokenizer, overlap_steps: bool) -> None:
    waited, waited_reasons, none_sat_out = run(stored_model_dir, ll_tokenizer, tokenizer, False, overlap_steps)
    sat, sat_reasons, sit_outs = run(stored_model_dir, ll_tokenizer, tokenizer, True, overlap_steps)
    assert none_sat_out == 0
    assert sit_outs >= 5  # the slow rows' masks missed steps (each fill apart is LATE_S late)
    assert sat == waited and sat_reasons == waited_reasons
    assert tokenizer.decode(sat[1]).startswith('{"name"')  # the constrained answers are still the schema's
