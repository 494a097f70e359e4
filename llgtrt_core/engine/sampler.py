"""Batched sampling with every per-request control, and logprobs.

`BatchSampler` keeps the sampling state of the running batch on the device, one row per running
sequence (row i samples logits row i): a table of per-row parameters written once when a request
is admitted, and the token counts the penalties need, updated on the device after every draw. A
step therefore applies every request's own settings in a few batched tensor ops, with no host
copy of parameters; the host only reads back the sampled tokens (and logprobs, when asked), once.
The rows admitted in a step reach the device together, in one upload before its draw: each
tensor op on the engine thread lets other threads take the GIL, and at a burst of 256 arrivals
per-row writes cost ~0.1 ms a request there (docs/benchmarks/engine.md, session 14).

Pipeline of one row (docs/sampling.md): the constraint mask (given to `sample`, or already in
the logits), then min_tokens (stop tokens masked), logit_bias, repetition / frequency /
presence penalties, temperature, min_p, top_k, top_p, the draw. A masked token is -inf and
every later step keeps it -inf (-inf + bias, -inf * penalty), so no control can bring back a
token the constraint forbids.

Two paths, chosen per row by the request's settings alone (on CUDA; CPU engines take the
general one). A row that needs only temperature
(greedy included: no top-k/top-p/min-p, penalties, logit_bias, min_tokens or logprobs) is
sampled by the fused kernel (`kernels.sampling.sample_with_bitmask`): mask, temperature and an
exact Gumbel-max draw in one read of the logits, which it never writes; its noise comes from a
hash of (the row's 64-bit key + tokens generated so far, token id), the key derived from the
request's seed (`fused_seed_base`). Every other row takes the general path above, its mask
applied in place first, and draws with the exponential race (argmax of p / Exp(1), a categorical
draw free of a cumulative-sum search) from its own generator. Either way a row's token depends
on its own logits, settings and seed only, so a seeded request samples the same tokens whatever
else shares its batch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from llgtrt_core.engine.interface import SamplingParams, TokenLogprob
from llgtrt_core.kernels import apply_token_bitmask_inplace, cuda_kernel_available, int64_to_device
from llgtrt_core.kernels.sampling import sample_with_bitmask

# The constraint masks of a step on the logits' device: (N, words) int32 and the N logits rows.
DeviceMasks = tuple[torch.Tensor, torch.Tensor]
_MASK64 = (1 << 64) - 1


class _Col(enum.IntEnum):
    """Columns of the per-row parameter table."""

    TEMPERATURE = 0
    TOP_K = 1
    TOP_P = 2
    MIN_P = 3
    PRESENCE = 4
    FREQUENCY = 5
    REPETITION = 6
    MIN_TOKENS = 7
    RAW_LOGPROBS = 8  # 1: report the raw distribution, 0: the processed one
    FUSED = 9  # 1: sampled by the fused kernel


def _table_row(params: SamplingParams, fused: bool) -> list[float]:
    row = [0.0] * len(_Col)
    row[_Col.TEMPERATURE] = params.temperature
    row[_Col.TOP_K] = params.top_k
    row[_Col.TOP_P] = params.top_p
    row[_Col.MIN_P] = params.min_p
    row[_Col.PRESENCE] = params.presence_penalty
    row[_Col.FREQUENCY] = params.frequency_penalty
    row[_Col.REPETITION] = params.repetition_penalty
    row[_Col.MIN_TOKENS] = params.min_tokens
    row[_Col.RAW_LOGPROBS] = float(params.logprobs_mode == "raw_logprobs")
    row[_Col.FUSED] = float(fused)
    return row


def uses_fused_sampling(params: SamplingParams) -> bool:
    """Temperature is the only control the request uses (greedy included)."""
    return (params.top_k == 0 and params.top_p == 1.0 and params.min_p == 0.0 and not _uses_penalties(params)
            and not params.logit_bias and params.min_tokens == 0 and params.logprobs is None)


def fused_seed_base(seed: int) -> int:
    """A request's 64-bit noise key for the fused kernel: splitmix64 of its generator's seed, so
    seeds s and s + 1 (two choices of one request) get unrelated keys and their per-step seeds
    (key + tokens generated) never coincide. Returned as a signed int64."""
    z = (seed + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z - (1 << 64) if z >= 1 << 63 else z


def _uses_penalties(params: SamplingParams) -> bool:
    return params.presence_penalty != 0.0 or params.frequency_penalty != 0.0 or params.repetition_penalty != 1.0


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p nucleus to -inf. top_k 0 = off, top_p 1 = off."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
    drop = ranks >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep a token while the mass before it is below top_p (the top token is always kept).
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p.unsqueeze(1)
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf the tokens whose probability is below min_p times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int]
                   ) -> tuple[list[int], list[TokenLogprob]]:
    """Row i: token_ids[i], its logprob and its num_top[i] most likely alternatives.

    One device-to-host copy for all rows.
    """
    return parse_logprob_table(logprob_table(logprobs, token_ids, max(num_top, default=0)).tolist(), num_top)


def logprob_table(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> torch.Tensor:
    """(n, 2 + 2k) float64 on the logprobs' device: token, its logprob, the top k logprobs, their
    tokens (token ids travel as float64, exact below 2**53), so one copy brings a step's back."""
    parts = [token_ids.unsqueeze(1).double(), logprobs.gather(1, token_ids.unsqueeze(1)).double()]
    if k:
        top = logprobs.topk(k, dim=-1)
        parts += [top.values.double(), top.indices.double()]
    return torch.cat(parts, dim=1)


def parse_logprob_table(table: list[list[float]], num_top: Sequence[int]) -> tuple[list[int], list[TokenLogprob]]:
    k = max(num_top, default=0)
    ids, reported = [], []
    for row, wanted in zip(table, num_top):
        ids.append(int(row[0]))
        reported.append(TokenLogprob(row[1], tuple((int(row[2 + k + j]), row[2 + j]) for j in range(wanted))))
    return ids, reported


@dataclass(frozen=True)
class SampleOutput:
    token_ids: list[int]
    logprobs: list[Optional[TokenLogprob]]  # None for rows that did not ask for logprobs


@dataclass
class _Admitted:
    """A row added since the last upload: what it writes to the device state."""

    table_row: list[float]
    seed_base: int
    generated: int = 0  # tokens forced before its first draw


class PendingSample:
    """A step's draw queued on the device. `tokens` can feed the next forward pass before the host
    has read them; `result()` waits for the one device-to-host copy the draw started (from any
    thread: the mask fill's reads the tokens too)."""

    def __init__(self, tokens: torch.Tensor, readback: torch.Tensor,
                 parse: Callable[[list], SampleOutput]):
        self.tokens = tokens  # (n,) int64, on the logits' device
        self._parse = parse
        self._ready: Optional[torch.cuda.Event] = None
        self._result: Optional[SampleOutput] = None
        if readback.is_cuda:
            self._host = torch.empty(readback.shape, dtype=readback.dtype, pin_memory=True)
            self._host.copy_(readback, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = readback

    def result(self) -> SampleOutput:
        if self._result is None:  # two threads may both parse it: the same output
            if self._ready is not None:
                self._ready.synchronize()  # drops the GIL while it waits
            self._result = self._parse(self._host.tolist())
        return self._result


class BatchSampler:
    """Sampling state of up to `max_rows` running sequences; row i samples logits row i."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device, fused: Optional[bool] = None):
        """fused: route temperature-only rows to the fused kernel; by default where its CUDA
        build runs. Its torch twin (CPU) hashes noise for every token, slower than the general
        path's draw there, so CPU engines leave it off (tests turn it on to check the routing)."""
        self.vocab_size = vocab_size
        self.device = device
        self.fused = device.type == "cuda" and cuda_kernel_available() if fused is None else fused
        self._pinned = device.type == "cuda"  # host staging for asynchronous uploads
        self._table = torch.zeros(max_rows, len(_Col), device=device)
        self._generated = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self._seed_base = torch.zeros(max_rows, dtype=torch.int64, device=device)  # fused rows' noise keys
        # Changes since the last upload (`_upload`): rows added, and rows moved (dst: its source row).
        self._admitted: dict[int, _Admitted] = {}
        self._moved: dict[int, int] = {}
        self._params: list[Optional[SamplingParams]] = [None] * max_rows
        self._generators: list[Optional[torch.Generator]] = [None] * max_rows
        self._fused: list[bool] = [False] * max_rows  # uses_fused_sampling of the row's params
        # (max_rows, vocab) state, allocated when a request first needs it.
        self._output_counts: Optional[torch.Tensor] = None  # int32: times each token was generated
        self._prompt_tokens: Optional[torch.Tensor] = None  # bool: token is in the prompt
        self._bias: Optional[torch.Tensor] = None  # float32: logit_bias
        self._stop_tokens: Optional[torch.Tensor] = None  # bool: tokens min_tokens holds back

    # ---- batch membership (called between steps) ---------------------------------------
    # Every method runs in inference mode: state allocated in one call (an inference tensor) is
    # updated in place by the next, whichever mode the engine calls from.

    @torch.inference_mode()
    def add(self, row: int, params: SamplingParams, prompt_token_ids: Sequence[int],
            generator: torch.Generator) -> None:
        """Admit a request into `row`: one host-to-device copy of its parameters, plus its
        prompt / bias / stop-token rows when it uses penalties, logit_bias or min_tokens."""
        self._params[row] = params
        self._generators[row] = generator
        self._fused[row] = self.fused and uses_fused_sampling(params)
        self._admitted[row] = _Admitted(_table_row(params, self._fused[row]), fused_seed_base(generator.initial_seed()))
        # The (max_rows, vocab) state is written at once, after the moves that read its rows.
        if self._uses_vocab_state(params):
            self._upload_moves()
        if _uses_penalties(params) or self._output_counts is not None:
            self._output_counts = self._allocated(self._output_counts, torch.int32)
            self._output_counts[row].zero_()
        if params.repetition_penalty != 1.0 or self._prompt_tokens is not None:
            self._prompt_tokens = self._allocated(self._prompt_tokens, torch.bool)
            self._prompt_tokens[row].zero_()
            if params.repetition_penalty != 1.0:
                self._prompt_tokens[row, int64_to_device(prompt_token_ids, self.device)] = True
        if params.logit_bias or self._bias is not None:
            self._bias = self._allocated(self._bias, torch.float32)
            self._bias[row].zero_()
            if params.logit_bias:
                self._bias[row] = self._dense_row(params.logit_bias, torch.float32)
        if params.min_tokens > 0 or self._stop_tokens is not None:
            self._stop_tokens = self._allocated(self._stop_tokens, torch.bool)
            self._stop_tokens[row].zero_()
            if params.min_tokens > 0:
                self._stop_tokens[row] = self._dense_row(dict.fromkeys(params.stop_token_ids, True), torch.bool)

    @torch.inference_mode()
    def move(self, src: int, dst: int) -> None:
        """Row `src` now lives in row `dst` (the batch stays dense); the device rows follow at the next upload."""
        self._params[dst], self._generators[dst] = self._params[src], self._generators[src]
        self._fused[dst] = self._fused[src]
        self._params[src] = self._generators[src] = None
        self._admitted.pop(dst, None)  # dst's sequence left
        if src in self._admitted:  # not uploaded yet: it moves on the host
            self._admitted[dst] = self._admitted.pop(src)
        self._moved[dst] = self._moved.pop(src, src)  # row src of the device state, as last uploaded

    def record_forced(self, row: int, token_ids: Sequence[int]) -> None:
        """Count tokens appended to `row` without a draw (a grammar forced them), as if sampled:
        min_tokens and the penalties see them. With none, it returns before entering inference mode."""
        if token_ids:
            self._count_forced(row, token_ids)

    @torch.inference_mode()
    def _count_forced(self, row: int, token_ids: Sequence[int]) -> None:
        admitted = self._admitted.get(row)
        if admitted is not None:
            admitted.generated += len(token_ids)
        else:
            self._upload_moves()
            self._generated[row] += len(token_ids)
        if self._output_counts is not None:
            self._upload_moves()
            ids = int64_to_device(token_ids, self.device)
            self._output_counts[row].scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def _allocated(self, state: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        if state is None:
            state = torch.zeros(self._table.shape[0], self.vocab_size, dtype=dtype, device=self.device)
        return state

    def _dense_row(self, values: dict[int, float], dtype: torch.dtype) -> torch.Tensor:
        row = torch.zeros(self.vocab_size, dtype=dtype, pin_memory=self._pinned)
        if values:
            ids = torch.tensor([t for t in values if t < self.vocab_size], dtype=torch.int64)
            row[ids] = torch.tensor([values[t] for t in values if t < self.vocab_size], dtype=dtype)
        return row.to(self.device, non_blocking=True)

    # ---- one step ------------------------------------------------------------------------

    @torch.inference_mode()
    def raw_logprobs(self, logits: torch.Tensor) -> Optional[torch.Tensor]:
        """The model's distribution, for rows reporting raw logprobs; call before the constraint mask."""
        params = self._params[: logits.shape[0]]
        if not any(p.logprobs is not None and p.logprobs_mode == "raw_logprobs" for p in params):
            return None
        return logits.float().log_softmax(dim=-1)

    def sample(self, logits: torch.Tensor, raw_logprobs: Optional[torch.Tensor] = None,
               masks: Optional[DeviceMasks] = None) -> SampleOutput:
        """`sample_async`, waited for."""
        return self.sample_async(logits, raw_logprobs, masks).result()

    def redraws_alike(self, row: int) -> bool:
        """Whether `row`'s draw, dropped, is made again alike a step later: greedy, or the fused kernel
        (its noise is keyed by the tokens generated, which a dropped draw does not count); a draw
        from the row's generator would move it on."""
        return self._fused[row] or self._params[row].greedy

    @torch.inference_mode()
    def sample_async(self, logits: torch.Tensor, raw_logprobs: Optional[torch.Tensor] = None,
                     masks: Optional[DeviceMasks] = None, dropped: Sequence[int] = ()) -> PendingSample:
        """logits: (n, vocab) float32 of rows 0..n-1. Queues one draw per row; the logits are not
        needed once this returns (the next forward pass may overwrite them).

        masks: the constraint masks, not yet applied (on the logits' device); without them the
        logits count as constrained already. raw_logprobs: what `raw_logprobs` returned before a
        constraint mask was applied; without it, the logits given here count as the raw ones.
        dropped: rows whose draw the engine drops (`redraws_alike` rows): the token counts that
        penalties, min_tokens and the fused seeds read stay as they were.
        """
        n = logits.shape[0]
        params: list[SamplingParams] = self._params[:n]  # type: ignore[assignment]
        fused = self._fused[:n]
        self._upload()
        if all(fused):  # the common case: one kernel, the logits only read (fused rows ask no logprobs)
            tokens = self._sample_fused(logits, masks)
            pending = PendingSample(tokens, tokens, lambda ids: SampleOutput(ids, [None] * n))
        else:
            if raw_logprobs is None:
                raw_logprobs = self.raw_logprobs(logits)
            if masks is not None:
                # Fused rows are masked too; their draw is unchanged (the kernel skips the same tokens).
                apply_token_bitmask_inplace(logits, *masks)
            tokens, processed_scores = self._sample_general(logits, params, fused)
            if any(fused):
                fused_rows = self._table[:n, _Col.FUSED].bool()
                tokens = torch.where(fused_rows, self._sample_fused(logits, None), tokens)
            pending = self._read_back(params, tokens, raw_logprobs, processed_scores)
        self._record(tokens, dropped)
        return pending

    def _sample_fused(self, logits: torch.Tensor, masks: Optional[DeviceMasks]) -> torch.Tensor:
        """Mask + temperature + draw in one pass; each row's seed is its key + tokens generated so far."""
        n = logits.shape[0]
        seeds = self._seed_base[:n] + self._generated[:n]
        bitmask, rows = masks if masks is not None else (None, None)
        temperature = self._table[:n, _Col.TEMPERATURE].contiguous()  # a column: the kernel wants it packed
        return sample_with_bitmask(logits, temperature, seeds, bitmask, rows)

    def _sample_general(self, logits: torch.Tensor, params: Sequence[SamplingParams], fused: Sequence[bool]
                        ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Every control, sort-based cuts, per-row generators: (tokens, the processed scores when a
        row reports processed logprobs). Fused rows' tokens are placeholders."""
        table = self._table[: len(params)]
        scores = self._adjusted(logits, params)
        greedy_tokens = scores.argmax(dim=-1)
        wants_processed = any(p.logprobs is not None and p.logprobs_mode == "processed_logprobs" for p in params)
        if all(p.greedy or f for p, f in zip(params, fused)) and not wants_processed:
            return greedy_tokens, None
        temperature = table[:, _Col.TEMPERATURE]
        scores = scores / torch.where(temperature > 0, temperature, 1.0).unsqueeze(1)
        if any(p.min_p > 0 for p in params):
            scores = apply_min_p(scores, table[:, _Col.MIN_P])
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            scores = apply_top_k_top_p(scores, table[:, _Col.TOP_K].long(), table[:, _Col.TOP_P])
        drawn = self._draw(scores, [not p.greedy and not f for p, f in zip(params, fused)])
        return torch.where(temperature > 0, drawn, greedy_tokens), scores if wants_processed else None

    def _adjusted(self, logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """min_tokens, logit_bias and penalties: the controls that apply to greedy rows too."""
        n = logits.shape[0]
        scores = logits
        if any(p.min_tokens > 0 for p in params):
            holding = self._generated[:n] < self._table[:n, _Col.MIN_TOKENS]
            held = scores.masked_fill(self._stop_tokens[:n] & holding.unsqueeze(1), float("-inf"))
            # A row the constraint lets end only with a stop token keeps it (never an empty row).
            scores = torch.where(held.isfinite().any(dim=-1, keepdim=True), held, scores)
        if any(p.logit_bias for p in params):
            scores = scores + self._bias[:n]
        if any(_uses_penalties(p) for p in params):
            scores = self._penalized(scores, n)
        return scores

    def _penalized(self, scores: torch.Tensor, n: int) -> torch.Tensor:
        table = self._table[:n]
        counts = self._output_counts[:n]
        generated = counts > 0
        repetition = table[:, _Col.REPETITION].unsqueeze(1)
        if self._prompt_tokens is not None:
            seen = generated | self._prompt_tokens[:n]
            scores = torch.where(seen, torch.where(scores > 0, scores / repetition, scores * repetition), scores)
        return (scores - counts * table[:, _Col.FREQUENCY].unsqueeze(1)
                - generated * table[:, _Col.PRESENCE].unsqueeze(1))

    def _draw(self, scores: torch.Tensor, drawing: Sequence[bool]) -> torch.Tensor:
        probs = scores.softmax(dim=-1)
        noise = torch.ones_like(probs)
        for row, draws in enumerate(drawing):
            if draws:
                noise[row].exponential_(generator=self._generators[row])
        # A zero draw would turn a masked (p = 0) token into 0/0 = nan: keep noise positive.
        return (probs / noise.clamp_(min=torch.finfo(noise.dtype).tiny)).argmax(dim=-1)

    def _read_back(self, params: Sequence[SamplingParams], tokens: torch.Tensor, raw: Optional[torch.Tensor],
                   processed_scores: Optional[torch.Tensor]) -> PendingSample:
        """The tokens, with the logprobs the rows asked for, read back in one device-to-host copy."""
        if not any(p.logprobs is not None for p in params):
            return PendingSample(tokens, tokens, lambda ids: SampleOutput(ids, [None] * len(params)))
        if processed_scores is None:
            logprobs = raw
        else:
            processed = processed_scores.log_softmax(dim=-1)
            use_raw = self._table[: len(params), _Col.RAW_LOGPROBS].bool().unsqueeze(1)
            logprobs = processed if raw is None else torch.where(use_raw, raw, processed)
        num_top = [p.logprobs or 0 for p in params]

        def parse(table: list[list[float]]) -> SampleOutput:
            ids, reported = parse_logprob_table(table, num_top)
            return SampleOutput(ids, [lp if p.logprobs is not None else None for lp, p in zip(reported, params)])

        return PendingSample(tokens, logprob_table(logprobs, tokens, max(num_top)), parse)

    def _uses_vocab_state(self, params: SamplingParams) -> bool:
        return (_uses_penalties(params) or bool(params.logit_bias) or params.min_tokens > 0
                or any(state is not None for state in self._vocab_states()))

    def _vocab_states(self) -> tuple[Optional[torch.Tensor], ...]:
        return self._output_counts, self._prompt_tokens, self._bias, self._stop_tokens

    def _upload(self) -> None:
        """Bring the device state up to date: the moves, then the rows added (which may sit where a
        moved row was). Asynchronous copies from pinned memory: a pageable one would wait for the
        queued decode."""
        self._upload_moves()
        if not self._admitted:
            return
        rows, admitted = list(self._admitted), list(self._admitted.values())
        self._admitted = {}
        index = self._to_device(rows, torch.int64)
        self._table.index_copy_(0, index, self._to_device([a.table_row for a in admitted], torch.float32))
        self._seed_base.index_copy_(0, index, self._to_device([a.seed_base for a in admitted], torch.int64))
        self._generated.index_copy_(0, index, self._to_device([a.generated for a in admitted], torch.int32))

    def _upload_moves(self) -> None:
        """Every row moved since the last upload takes its source row's state, all at once."""
        if not self._moved:
            return
        moved, self._moved = self._moved, {}
        pairs = [(dst, src) for dst, src in moved.items() if dst != src]
        if not pairs:
            return
        dst = self._to_device([d for d, _ in pairs], torch.int64)
        src = self._to_device([s for _, s in pairs], torch.int64)
        for state in (self._table, self._generated, self._seed_base, *self._vocab_states()):
            if state is not None:
                state[dst] = state[src]

    def _to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, pin_memory=self._pinned).to(self.device, non_blocking=True)

    def _record(self, tokens: torch.Tensor, dropped: Sequence[int]) -> None:
        n = tokens.shape[0]
        counted = None  # rows whose draw counts: all but the dropped ones
        if dropped:
            out = set(dropped)
            counted = self._to_device([0 if row in out else 1 for row in range(n)], torch.int32)
        self._generated[:n] += 1 if counted is None else counted
        if self._output_counts is not None:
            ones = torch.ones(n, dtype=torch.int32, device=tokens.device) if counted is None else counted
            self._output_counts[:n].scatter_add_(1, tokens.unsqueeze(1), ones.unsqueeze(1))
