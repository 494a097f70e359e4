"""The CPU decode step with its decoder layers compiled (torch.compile, inductor's C++ backend):
the ~25 torch ops of each layer, dispatched one by one from Python, become a few fused C++ loops
around the matmuls, and the 30 layers one compiled call (docs/benchmarks/cpu.md: a batch-1 step
~0.6x the eager one's time).

One graph covers every layer of a step: `decode_layers` takes the layers and their cache tensors
as inputs, so the layers' weights and the cache are the graph's inputs (dynamo lifts the
parameters of built-in modules), and dynamo checks its guards once a step, not once a layer
(that cost ~4 ms of a ~19 ms step with one compiled call per layer). Shapes are dynamic in batch
size, key length and cache size. Compiling the five graphs (six with `prompt_threads`) takes
~8 min of a core the first time with the GEMM templates' autotuning (~4.5 min with inductor's
disk cache, docs/benchmarks/cpu.md), so it runs in a thread of its own at engine start while
the eager step serves; the thread compiles every graph a decode can need on scratch tensors
(`warm_up_shapes`) and only then is `layers_decode` handed out. A later step whose shapes no
graph covers runs eagerly rather than compiling in the engine loop (stance "eager_on_recompile").

Numerics: inductor rounds the bfloat16 intermediates where eager does (`emulate_precision_casts`);
what differs is fused float32 arithmetic, within tolerances tests/test_compiled_decode.py checks.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from typing import NamedTuple, Optional

import torch

from llgtrt_core.engine.idle_cores import IdleCores
from llgtrt_core.engine.kv_cache import KVCache
from llgtrt_core.layers.ops import TORCH_OPS
from llgtrt_core.models.llama import LayersDecode, LlamaForCausalLM, decode_layers, torch_threads

logger = logging.getLogger(__name__)

INDUCTOR_OPTIONS = {"emulate_precision_casts": True, "online_softmax": False}
# The weights as constants of the graphs (freezing), so that inductor may replace the packed
# int4/int8 matmuls by its C++ GEMM template where that times faster (max_autotune, against the
# aten kernel at each graph's warm-up rows): at one row the template's AVX-512 int4 microkernel
# reads the weights faster (docs/benchmarks/cpu.md, session 10). Inductor reads `freezing` from
# its global config, not from torch.compile's options: patched around the compile.
GEMM_TEMPLATE_CONFIG = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}


# From this many rows the int4 GEMM template (its AMX microkernel, as autotuned at a graph's
# warm-up rows) reads the weights faster than the aten kernel, which makes a pass over them per 4
# rows: 30 layers' projections streamed, 1 thread, ~17 ms flat from 2 to 12 rows against aten's
# 11.5 / 15 / 27 / 38 ms at 2 / 4 / 8 / 12 (docs/benchmarks/cpu.md, session 11). Those rows get a
# graph of their own, warmed up at its most rows, so that autotuning keeps the template there and
# the aten kernel below.
TEMPLATE_MIN_ROWS = 5


# torch.fx's Tracer.trace patches torch.nn.Module.__call__ and __getattr__ for every thread while it
# runs (AOTAutograd's make_fx and inductor's pattern passes trace with it), so a module another thread
# calls meanwhile is traced too: the eager step serving on the engine thread during the compile
# failed with a NameError ("module is not installed as a submodule") or crashed the engine process
# (SIGSEGV; session 15, a completion-rate run in the compile's first minutes). Every trace holds
# TRACING (`hold_tracing_lock`), and the engine thread holds it for each step while a compile runs
# (`CompiledDecode.exclusive`). Reentrant: a trace may start another.
TRACING = threading.RLock()
NO_LOCK = contextlib.nullcontext()  # what a step holds once the compile is over (reusable)


def hold_tracing_lock() -> None:
    """Make every torch.fx trace in this process hold TRACING (once; later calls change nothing)."""
    from torch.fx._symbolic_trace import Tracer  # torch.fx is imported by torch.compile anyway

    if getattr(Tracer.trace, "holds_tracing_lock", False):
        return
    trace = Tracer.trace

    @functools.wraps(trace)
    def trace_holding_lock(self, *args, **kwargs):
        with TRACING:
            return trace(self, *args, **kwargs)

    trace_holding_lock.holds_tracing_lock = True
    Tracer.trace = trace_holding_lock


class WarmUp(NamedTuple):
    """One graph's warm-up: `rows` rows over `key_len` keys, the graph covering low..high rows
    (high None: no bound)."""
    rows: int
    key_len: int
    low: int
    high: Optional[int]


def warm_up_shapes(max_rows: int, block_size: int, max_packed_rows: int, template_rows: bool) -> list[WarmUp]:
    """The warm-ups that together compile every graph a decode step can need: dynamo specializes
    size 1 (batch 1, keys within one block), the quantized layers branch on the rows
    (`max_packed_rows`: WeightOnlyLinear.max_rows) and, with `template_rows`, the packed rows from
    TEMPLATE_MIN_ROWS on are a range of their own. A step of those rows within one block (a
    prompt of <= 16 tokens prefilled in one pass) runs eagerly: not worth a graph's compile."""
    split = template_rows and 1 < TEMPLATE_MIN_ROWS <= max_packed_rows
    ranges = [(1, 1), *([(2, TEMPLATE_MIN_ROWS - 1), (TEMPLATE_MIN_ROWS, max_packed_rows)] if split
                        else [(2, max_packed_rows)]), (max_packed_rows + 1, None)]
    shapes = []
    # Dynamo tries the newest graph first: batch 1 over several blocks, the commonest, goes last.
    for low, high in reversed([(low, high) for low, high in ranges if low <= max_rows]):
        on_template = split and low == TEMPLATE_MIN_ROWS  # autotuned at its most rows, where the template wins
        key_lens = (2 * block_size + 1,) if on_template else (2, 2 * block_size + 1)
        shapes += [WarmUp(high if on_template else low, key_len, low, high) for key_len in key_lens]
    return shapes


class CompiledDecode:
    def __init__(self, model: LlamaForCausalLM, cache: KVCache, on_miss: str = "eager_on_recompile",
                 gemm_templates: bool = True, prompt_threads: int = 0):
        """cache: the engine's, for its geometry only (the warm-up runs on scratch tensors).
        on_miss: torch.compiler stance for a step no graph fits: run it eagerly, or (tests)
        "fail_on_recompile" to raise. gemm_templates: GEMM_TEMPLATE_CONFIG (the weights frozen
        into the graphs, inductor's GEMM template where it is faster). prompt_threads: torch threads
        of a step that only prefills TEMPLATE_MIN_ROWS..max_packed_rows tokens (`prompt_stance`),
        its graph compiled at that count too; 0: the engine's."""
        self.model = model
        self.prompt_threads = prompt_threads
        self.idle_cores = IdleCores(os.cpu_count() or 1)
        self.num_spread_steps = 0  # prompt steps run on prompt_threads (/v1/engine/stats, the step log)
        self.on_miss = on_miss
        self.gemm_templates = gemm_templates
        self.max_batch = cache.num_slots
        # Rows the graphs take without a compile: the one past batch 1 serves up to the quantized
        # layers' packed-kernel rows, the one past those (if max_batch reaches it) any count.
        self.max_rows = max(self.max_batch, self._max_packed_rows())
        self.block_size = cache.block_size
        self.table_width = cache.block_table.shape[1]
        self.ready = threading.Event()
        self._compiled: Optional[LayersDecode] = None
        self._thread: Optional[threading.Thread] = None
        self._threads = 1

    def start(self) -> None:
        """Compile in the background; `layers_decode` stays None until every graph is compiled.
        Called on a thread with the engine's torch thread count."""
        self._threads = torch.get_num_threads()
        if self.gemm_templates and self.prompt_threads > self._threads:
            self.idle_cores.start()
        hold_tracing_lock()
        self._thread = threading.Thread(target=self._compile, name="cpu-compile", daemon=True)
        self._thread.start()

    def wait(self, timeout: float) -> bool:
        """Whether the compile finished and succeeded within `timeout` seconds (tests, benchmarks)."""
        self._thread.join(timeout)
        return self.ready.is_set()

    @property
    def compiling(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def exclusive(self) -> contextlib.AbstractContextManager:
        """What the engine thread holds around a step: TRACING while the compile runs (see there),
        then nothing."""
        return TRACING if self.compiling else NO_LOCK

    def layers_decode(self) -> Optional[LayersDecode]:
        """`LlamaForCausalLM.decode`'s layers_decode once compiled, else None (eager); a step that
        uses it runs under `stance()`."""
        return self._compiled if self.ready.is_set() else None

    def stance(self):
        """The torch.compile stance of a step with the compiled layers (`on_miss`), entered once a
        step (it is not cheap: entered for each layer's call it took ~8 % of a batch-1 step)."""
        return torch.compiler.set_stance(self.on_miss)

    def prompt_stance(self, rows: int, key_len: int):
        """`stance()` of a step that only prefills (nothing decodes: a client waits for its first
        token and the API process idles), `rows` tokens over `key_len` keys: on `prompt_threads`
        threads where a graph was compiled at that count (the GEMM template's rows over several
        blocks) and the cores are idle (`IdleCores`), else as `stance()`."""
        if not self._prompt_graph(rows, key_len) or not self.idle_cores.spare(self.prompt_threads - self._threads):
            return self.stance()
        self.num_spread_steps += 1
        stack = contextlib.ExitStack()
        stack.enter_context(torch_threads(self.prompt_threads))
        stack.enter_context(self.stance())
        return stack

    def _prompt_graph(self, rows: int, key_len: int) -> bool:
        return (self.gemm_templates and self.prompt_threads > self._threads and key_len > self.block_size
                and TEMPLATE_MIN_ROWS <= rows <= self._max_packed_rows())

    def _max_packed_rows(self) -> int:
        return getattr(self.model.model.layers[0].mlp.down_proj, "max_rows", self.max_batch)

    def _compile(self) -> None:
        import torch._inductor.config as inductor_config  # torch.compile's own imports: not at module import
        import torch.fx.experimental._config as fx_config

        started = time.perf_counter()
        # Dynamo guards the thread count: the engine's, not whatever a new thread would pick up
        # while the engine thread has the lm_head's count set (LlamaForCausalLM.logits).
        torch.set_num_threads(self._threads)
        try:
            # Isolated: another model's graphs (a second engine in one process) neither count
            # against this one's recompile limit nor lengthen its lookups.
            self._compiled = torch.compile(decode_layers, dynamic=True, options=INDUCTOR_OPTIONS,
                                           isolate_recompiles=True)
            # Without duck sizing: a warm-up size that happens to equal another (2 rows, 2 keys)
            # would otherwise tie the two in every graph.
            with fx_config.patch(use_duck_shape=False), \
                    inductor_config.patch(GEMM_TEMPLATE_CONFIG if self.gemm_templates else {}):
                self._warm_up()
        except Exception:  # no C++ compiler, an unsupported op: the eager step goes on serving
            logger.exception("compiling the cpu decode step failed; it stays eager")
            return
        self.ready.set()
        logger.info("compiled the cpu decode step in %.1f s", time.perf_counter() - started)

    def _warm_up(self) -> None:
        """Run the compiled layers over every warm-up shape, on scratch tensors (the engine's cache
        is the engine thread's) of the kinds a step gets (graphs are specific to them): the cache
        and its table normal tensors, the rest made in inference mode. Each layer gets its own
        cache tensors, as in the engine (the same tensor for all would compile a graph for aliased
        inputs)."""
        model = self.model
        dtype = model.model.norm.weight.dtype
        kv_heads, head_dim = model.config.num_kv_heads, model.config.head_dim
        shapes = warm_up_shapes(self.max_rows, self.block_size, self._max_packed_rows(), self.gemm_templates)
        blocks_per_row = -(-max(shape.key_len for shape in shapes) // self.block_size)
        shape = (blocks_per_row * self.max_batch + 1, kv_heads, self.block_size, head_dim)
        keys = [torch.zeros(shape, dtype=dtype) for _ in model.model.layers]
        values = [torch.zeros(shape, dtype=dtype) for _ in model.model.layers]
        # As the cache's (a prefill row past the slots), or the runner's riding rows, whichever is longer.
        table = torch.zeros(max(self.max_batch + 1, self.max_rows), self.table_width, dtype=torch.long)
        table[: self.max_batch, :blocks_per_row] = torch.arange(1, shape[0]).view(self.max_batch, -1)
        # Only the batch, the key length and the cache's block count vary: the model's own sizes
        # stay constants of the graph (vectorized loops, guards that are cheap to check).
        for tensor, dims in [*((t, [1, 2, 3]) for t in (*keys, *values)), (model.rope_cos, [0, 1]),
                             (model.rope_sin, [0, 1])]:
            for dim in dims:
                torch._dynamo.mark_static(tensor, dim)
        with torch.inference_mode():
            for n, key_len, low, high in shapes:
                block_table = table[:n]
                positions = torch.full((n,), key_len - 1, dtype=torch.long)
                x = torch.zeros(n, model.config.hidden_size, dtype=dtype)
                for tensor in (x, block_table):
                    torch._dynamo.mark_static(tensor, 1)
                if n > 1 and high is not None:  # the graph's rows a range of their own (the last one's: the branch's)
                    for tensor in (x, block_table, positions):
                        torch._dynamo.mark_dynamic(tensor, 0, min=low, max=high)
                # Dynamo guards the thread count: a prompt step's graph on more threads is one of its own.
                counts = [self._threads, *([self.prompt_threads] if self._prompt_graph(n, key_len) else [])]
                for threads in counts:
                    with torch_threads(threads):
                        self._compiled(model.model.layers, x, TORCH_OPS, model.rope_cos, model.rope_sin, keys,
                                       values, block_table, positions, key_len)
