"""First run of the TensorRT-LLM adapter on a real TensorRT-LLM: check every assumption it makes.

Run inside NVIDIA's TensorRT-LLM release container (or the Bento's image), from the repository
root, with a small Hugging Face checkpoint TensorRT-LLM's PyTorch backend supports:

    python scripts/trtllm_first_run.py --model /models/Qwen2.5-0.5B-Instruct

Each check prints PASS (or SKIP, or INFO for what is only reported) with what it saw; the
script stops with exit status 1 at the first FAIL. What each check guards is in
docs/tensorrt-llm.md ("First run on a real TensorRT-LLM"). Loads the model several times
(one LLM per scheduler setting); a few minutes on one GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TLLM_WORKER_USE_SINGLE_PROCESS", "1")

CALLS: list[dict] = []  # what ProbeProcessor saw, in this process (TP 1 in-process)


class ProbeProcessor:
    """A per-request logits processor that records what TensorRT-LLM hands it and, from
    `force_end_at` on, allows only `end_id` (or raises, with `fail`)."""

    def __init__(self, tag: str, end_id: int = -1, force_end_at: int = -1, fail: bool = False) -> None:
        self.tag, self.end_id, self.force_end_at, self.fail = tag, end_id, force_end_at, fail
        self.pickled = False

    def __getstate__(self) -> dict:
        return {**self.__dict__, "pickled": True}

    def __call__(self, req_id, logits, token_ids, stream_ptr, client_id) -> None:
        import torch

        calls = [c for c in CALLS if c["tag"] == self.tag]
        CALLS.append({"tag": self.tag, "shape": tuple(logits.shape), "dtype": str(logits.dtype),
                      "device": str(logits.device), "stream_ptr": stream_ptr,
                      "current_stream": torch.cuda.current_stream().cuda_stream if logits.is_cuda else None,
                      "seq_len": len(token_ids[0]),
                      "pickled": self.pickled})
        if self.fail:
            raise RuntimeError("probe processor failure")
        if 0 <= self.force_end_at <= len(calls):
            logits.fill_(float("-inf"))
            logits[..., self.end_id] = 0.0


class Failed(Exception):
    pass


def report(status: str, name: str, detail: str) -> None:
    print(f"[{status}] {name}: {detail}", flush=True)


def check(name: str, run: Callable[[], tuple[bool, str]]) -> None:
    try:
        ok, detail = run()
    except Exception as error:  # an assumption broken badly enough to raise
        ok, detail = False, f"{type(error).__name__}: {error}"
    report("PASS" if ok else "FAIL", name, detail)
    if not ok:
        raise Failed(name)


def versions() -> tuple[bool, str]:
    import llguidance
    import tensorrt_llm
    import torch
    import transformers

    seen = (f"tensorrt_llm {tensorrt_llm.__version__}, torch {torch.__version__}, transformers "
            f"{transformers.__version__}, llguidance {getattr(llguidance, '__version__', '?')}")
    return tensorrt_llm.__version__.startswith("1.2") and not getattr(tensorrt_llm, "IS_FAKE", False), seen


def pip_check() -> tuple[bool, str]:
    """Conflicts are expected only on what the image build replaced (docker/image_constraints.py):
    other packages' pins on llguidance, fastapi and starlette, which only trtllm-serve and
    TensorRT-LLM's built-in guided decoding use."""
    out = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True).stdout
    lines = [line for line in out.splitlines() if line.strip() and "No broken requirements" not in line]
    replaced = ("llguidance", "fastapi", "starlette")
    unexpected = [line for line in lines
                  if (m := re.search(r"has requirement ([A-Za-z0-9_.-]+)", line)) is None
                  or m.group(1).lower() not in replaced]
    return not unexpected, "; ".join(lines) or "no conflicts"


def build(model: str, **kwargs: Any) -> Any:
    from tensorrt_llm import LLM

    return LLM(model, skip_tokenizer_init=True, max_seq_len=4096, **kwargs)


def params(end_id: int, max_tokens: int, **kwargs: Any) -> Any:
    from tensorrt_llm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, end_id=end_id, pad_id=end_id, top_k=1, detokenize=False, **kwargs)


async def stream(llm: Any, prompt: list[int], sampling: Any) -> tuple[list[list[int]], Any]:
    diffs, output = [], None
    async for output in llm.generate_async(prompt, sampling, streaming=True):
        diffs.append(list(output.outputs[0].token_ids_diff))
    return diffs, output


def run_tp1(args: argparse.Namespace, tokenizer: Any, vocab_size: int) -> None:
    eos = tokenizer.eos_token_id
    prompt = tokenizer.encode("Count from one to twenty: one, two,")
    for overlap_off in (True, False):
        llm = build(args.model, disable_overlap_scheduler=overlap_off, kv_cache_config=_kv(args))
        try:
            if overlap_off:
                check("executor in-process at TP 1", lambda: _in_process(llm))
                tp1_checks(llm, args, prompt, eos, vocab_size)
            lag_check(llm, prompt, eos, overlap_off)
        finally:
            llm.shutdown()
    adapter_check(args, tokenizer, vocab_size)


def _kv(args: argparse.Namespace) -> Any:
    from tensorrt_llm.llmapi import KvCacheConfig

    return KvCacheConfig(free_gpu_memory_fraction=0.3, max_tokens=args.kv_tokens)


def _in_process(llm: Any) -> tuple[bool, str]:
    name = type(getattr(llm, "_executor", None)).__name__
    return name == "GenerationExecutorWorker", f"LLM._executor is {name} (TLLM_WORKER_USE_SINGLE_PROCESS=1)"


def tp1_checks(llm: Any, args: argparse.Namespace, prompt: list[int], eos: int, vocab_size: int) -> None:
    CALLS.clear()
    asyncio.run(stream(llm, prompt, params(eos, 4, logits_processor=ProbeProcessor("shape"))))

    def shape() -> tuple[bool, str]:
        first = CALLS[0]
        ok = first["shape"] == (1, 1, vocab_size) and first["device"].startswith("cuda") and first["stream_ptr"] is None
        return ok, (f"{len(CALLS)} calls; logits {first['shape']} {first['dtype']} on {first['device']}, vocab_size "
                    f"{vocab_size}, stream_ptr {first['stream_ptr']}, current stream {first['current_stream']}")

    check("processor sees (1, 1, V) device logits on the current stream", shape)
    report("INFO", "processor object", f"pickled copy: {CALLS[0]['pickled']} (the adapter works either way)")

    def end_token() -> tuple[bool, str]:
        diffs, output = asyncio.run(stream(llm, prompt, params(eos, 16, logits_processor=ProbeProcessor("end", eos, 2))))
        reason, last = output.outputs[0].finish_reason, output.outputs[0].token_ids
        ok = reason == "stop" and len(last) <= 3
        return ok, f"forced end_id at step 3: finish_reason {reason!r}, token_ids {last}, diffs {diffs}"

    check("a forced end_id ends the request with 'stop'", end_token)

    def processor_error() -> tuple[bool, str]:
        async def both():
            return await asyncio.gather(stream(llm, prompt, params(eos, 8, logits_processor=ProbeProcessor("bad", fail=True))),
                                        stream(llm, prompt, params(eos, 8)), return_exceptions=True)

        bad, neighbour = asyncio.run(both())
        later = asyncio.run(stream(llm, prompt, params(eos, 4)))[1].outputs[0].finish_reason
        report("INFO", "a request in the same step as a raising processor",
               f"{type(neighbour).__name__}: {neighbour}" if isinstance(neighbour, BaseException) else "finished")
        ok = isinstance(bad, BaseException) and later in ("stop", "length")
        return ok, f"raising request: {type(bad).__name__}: {bad}; a later request: finish_reason {later!r}"

    check("a raising processor fails with an error and the executor goes on", processor_error)

    def penalty() -> tuple[bool, str]:
        plain, _ = asyncio.run(stream(llm, prompt, params(eos, 32)))
        penalised, _ = asyncio.run(stream(llm, prompt, params(eos, 32, repetition_penalty=5.0, presence_penalty=2.0)))
        same = sum(plain, []) == sum(penalised, [])
        return same, ("greedy output identical with and without penalties: TorchSampler ignores them (the adapter "
                      "refuses them)" if same else "penalties change the output: TorchSampler applies them, relax "
                      "_TORCH_SAMPLER_LACKS in trtllm_engine.py")

    check("TorchSampler ignores penalties (greedy A/B)", penalty)

    def long_prompt() -> tuple[bool, str]:
        try:
            llm.generate_async([prompt[-1]] * 8193, params(eos, 1), streaming=True)
        except (ValueError, RuntimeError) as error:
            return True, f"refused at once: {type(error).__name__}: {error}"
        return False, "accepted: the adapter's max_num_tokens pre-check is stricter than TensorRT-LLM"

    check("a prompt over max_num_tokens (8192) is refused by generate_async", long_prompt)

    def abort_frees() -> tuple[bool, str]:
        async def aborted_then_long():
            for _ in range(args.kv_tokens // 1024 + 2):  # more than the KV cache holds unless aborts free it
                output = llm.generate_async([prompt[-1]] * 1000, params(eos, 2000, ignore_eos=True), streaming=True)
                await output.__anext__()
                output.abort()
                async for _ in output:
                    pass
            return await stream(llm, [prompt[-1]] * 1000, params(eos, 1000, ignore_eos=True))

        diffs, output = asyncio.run(asyncio.wait_for(aborted_then_long(), 300))  # leaked blocks: no admission
        return output.outputs[0].finish_reason == "length", f"after the aborts, a 2,000-token request finished with {output.outputs[0].finish_reason!r}"

    check("abort frees the KV blocks", abort_frees)


def lag_check(llm: Any, prompt: list[int], eos: int, overlap_off: bool) -> None:
    CALLS.clear()
    asyncio.run(stream(llm, prompt, params(eos, 5, logits_processor=ProbeProcessor("lag"))))
    lengths = [c["seq_len"] - len(prompt) for c in CALLS]
    expected = [0, 1, 2, 3, 4] if overlap_off else [0, 0, 1, 2, 3]
    name = f"processor's sequence with the overlap scheduler {'off' if overlap_off else 'on'}"
    check(name, lambda: (lengths == expected, f"generated tokens seen per call {lengths}, expected {expected}"))


def adapter_check(args: argparse.Namespace, tokenizer: Any, vocab_size: int, tp: int = 1) -> None:
    from llgtrt_core.constraints.grammar import GrammarCompiler, build_ll_tokenizer
    from llgtrt_core.constraints.postprocessor import MaskPostProcessor
    from llgtrt_core.constraints.request_grammar import json_schema_grammar
    from llgtrt_core.engine.interface import GenerationRequest, SamplingParams
    from llgtrt_core.engine.trtllm_engine import TrtLlmEngine, TrtLlmEngineConfig

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}

    async def main() -> tuple[str, str, float]:
        ll_tokenizer = build_ll_tokenizer(tokenizer, vocab_size, [tokenizer.eos_token_id])
        grammars = GrammarCompiler(ll_tokenizer)
        config = TrtLlmEngineConfig(model_dir=args.model, backend="pytorch", vocab_size=vocab_size, max_model_len=4096,
                                    eos_token_id=tokenizer.eos_token_id, tokenizer_dir=args.model,
                                    tensor_parallel_size=tp, kv_cache_free_gpu_memory_fraction=0.3)
        engine = TrtLlmEngine(config, MaskPostProcessor(ll_tokenizer), grammars)
        started = time.perf_counter()
        await engine.start()
        try:
            compiled = await grammars.compile(json_schema_grammar(schema))
            request = GenerationRequest("json", tokenizer.encode("A number as JSON:"),
                                        SamplingParams(max_tokens=32, temperature=0.0,
                                                       stop_token_ids=frozenset({tokenizer.eos_token_id})),
                                        grammars.new_constraint(compiled))
            tokens, reason = [], None
            async for delta in engine.generate(request):
                tokens += delta.token_ids
                reason = delta.finish_reason or reason
            return tokenizer.decode(tokens), reason, time.perf_counter() - started
        finally:
            await engine.shutdown()
            grammars.close()

    def constrained() -> tuple[bool, str]:
        text, reason, seconds = asyncio.run(main())
        try:
            ok = reason == "stop" and isinstance(json.loads(text).get("n"), int)
        except ValueError:
            ok = False
        return ok, f"{text!r}, finish_reason {reason!r} ({seconds:.0f} s with start-up)"

    check(f"constrained JSON through the adapter at TP {tp}", constrained)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint directory (PyTorch backend)")
    parser.add_argument("--kv-tokens", type=int, default=16384, help="KV-cache size for the abort check")
    parser.add_argument("--skip-tp2", action="store_true", help="skip the TP=2 check even with two GPUs")
    args = parser.parse_args()
    try:
        check("package versions", versions)
        check("pip check", pip_check)
        import torch
        from transformers import AutoConfig, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        vocab_size = AutoConfig.from_pretrained(args.model).vocab_size
        run_tp1(args, tokenizer, vocab_size)
        if torch.cuda.device_count() >= 2 and not args.skip_tp2:
            adapter_check(args, tokenizer, vocab_size, tp=2)
        else:
            report("SKIP", "TP=2 spawn", f"{torch.cuda.device_count()} GPU(s) visible")
    except Failed as failed:
        print(f"first broken assumption: {failed}", flush=True)
        return 1
    print("every assumption held", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
