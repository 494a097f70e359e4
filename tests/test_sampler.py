"""The batched sampler against a straightforward per-request reference, on random logits.

Every row of a batch has its own settings; each step the batched sampler must pick, for every
row, the token the one-request-at-a-time reference below picks with the same generator (or, for
a temperature-only row, the fused kernel's seed), and report the same logprobs.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from llgtrt_core.engine.interface import SamplingParams
from llgtrt_core.engine.sampler import BatchSampler, fused_seed_base, uses_fused_sampling
from llgtrt_core.kernels.sampling import sample_with_bitmask_torch

VOCAB = 64
NEG_INF = float("-inf")


# --------------------------------------------------------------------------- reference


def reference_adjusted(logits: torch.Tensor, p: SamplingParams, prompt: list[int], generated: list[int]
                       ) -> torch.Tensor:
    scores = logits.clone()
    if len(generated) < p.min_tokens:
        held = scores.clone()
        for t in p.stop_token_ids:
            held[t] = NEG_INF
        if torch.isfinite(held).any():
            scores = held
    for t, bias in p.logit_bias.items():
        scores[t] += bias
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(generated):
            scores[t] = scores[t] / p.repetition_penalty if scores[t] > 0 else scores[t] * p.repetition_penalty
    for t, count in Counter(generated).items():
        scores[t] -= count * p.frequency_penalty + p.presence_penalty
    return scores


def reference_filtered(scores: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    scores = scores / (p.temperature if not p.greedy else 1.0)
    if p.min_p > 0:
        probs = scores.softmax(-1)
        scores = scores.masked_fill(probs < p.min_p * probs.max(), NEG_INF)
    if p.top_k > 0:
        kth = scores.topk(p.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, NEG_INF)
    if p.top_p < 1.0:
        order = scores.argsort(descending=True)
        probs = scores.softmax(-1)
        mass = 0.0
        for t in order.tolist():
            if mass >= p.top_p:
                scores[t] = NEG_INF
            mass += probs[t].item()
    return scores


def reference_step(logits: torch.Tensor, raw: torch.Tensor, p: SamplingParams, prompt: list[int], generated: list[int],
                   generator: torch.Generator) -> tuple[int, torch.Tensor]:
    """(token, the logprobs the request reports)."""
    adjusted = reference_adjusted(logits, p, prompt, generated)
    filtered = reference_filtered(adjusted, p)
    if uses_fused_sampling(p):  # Gumbel-max keyed by the request's seed and its position
        seed = torch.tensor([fused_seed_base(generator.initial_seed()) + len(generated)])
        token = int(sample_with_bitmask_torch(logits[None], torch.tensor([p.temperature]), seed, None, None))
    elif p.greedy:
        token = int(adjusted.argmax())
    else:
        noise = torch.empty(VOCAB).exponential_(generator=generator)
        token = int((filtered.softmax(-1) / noise).argmax())
    reported = raw if p.logprobs_mode == "raw_logprobs" else filtered.log_softmax(-1)
    return token, reported


# --------------------------------------------------------------------------- helpers


def random_params(rng: random.Random) -> SamplingParams:
    greedy = rng.random() < 0.3
    if rng.random() < 0.3:  # temperature only: the fused path
        return SamplingParams(max_tokens=100, temperature=0.0 if greedy else rng.choice([0.5, 1.0, 1.5]),
                              stop_token_ids=frozenset({0, 1}), seed=rng.randrange(2**31))
    return SamplingParams(
        max_tokens=100,
        temperature=0.0 if greedy else rng.choice([0.5, 1.0, 1.5]),
        top_k=rng.choice([0, 0, 5, 20]),
        top_p=rng.choice([1.0, 1.0, 0.9, 0.5]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.2]),
        presence_penalty=rng.choice([0.0, 0.0, 0.8, -0.5]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.6, -0.4]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.8]),
        logit_bias=rng.choice([{}, {}, {rng.randrange(VOCAB): rng.choice([-100.0, 5.0, 100.0])}]),
        min_tokens=rng.choice([0, 0, 3]),
        stop_token_ids=frozenset({0, 1}),
        seed=rng.randrange(2**31),
        logprobs=rng.choice([None, 0, 3]),
        logprobs_mode=rng.choice(["raw_logprobs", "processed_logprobs"]),
    )


class Request:
    def __init__(self, params: SamplingParams, prompt: list[int]):
        self.params = params
        self.prompt = prompt
        self.generated: list[int] = []
        self.batched_generator = torch.Generator().manual_seed(params.seed)
        self.reference_generator = torch.Generator().manual_seed(params.seed)


def run_step(sampler: BatchSampler, requests: list[Request], logits: torch.Tensor, mask: torch.Tensor = None) -> None:
    """One batched step checked row by row against the reference; the tokens extend each history."""
    raw = sampler.raw_logprobs(logits)
    raw_expected = logits.log_softmax(-1)
    if mask is not None:
        logits = logits.masked_fill(~mask, NEG_INF)  # what the constraint post-processor does
    output = sampler.sample(logits.clone(), raw)
    for row, request in enumerate(requests):
        token, reported = reference_step(logits[row], raw_expected[row], request.params, request.prompt,
                                         request.generated, request.reference_generator)
        assert output.token_ids[row] == token, f"row {row}: {request.params}"
        logprob = output.logprobs[row]
        if request.params.logprobs is None:
            assert logprob is None
        else:
            assert logprob.logprob == pytest.approx(reported[token].item(), abs=1e-4)
            top = reported.topk(request.params.logprobs)
            assert [t for t, _ in logprob.top] == top.indices.tolist()
            assert [lp for _, lp in logprob.top] == pytest.approx(top.values.tolist(), abs=1e-4)
        request.generated.append(token)


def admit(sampler: BatchSampler, row: int, request: Request) -> None:
    sampler.add(row, request.params, request.prompt, request.batched_generator)


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("seed", range(6))
def test_batched_sampler_matches_per_request_reference(seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    requests = [Request(random_params(rng), [rng.randrange(VOCAB) for _ in range(8)]) for _ in range(6)]
    sampler = BatchSampler(8, VOCAB, torch.device("cpu"), fused=True)
    for row, request in enumerate(requests):
        admit(sampler, row, request)
    for _ in range(6):
        run_step(sampler, requests, torch.randn(len(requests), VOCAB) * 3)


def test_rows_keep_their_state_when_the_batch_changes() -> None:
    """Requests leave (the last row moves into the hole) and join; each keeps its own counts and seed."""
    rng = random.Random(7)
    sampler = BatchSampler(4, VOCAB, torch.device("cpu"), fused=True)
    penalized = dict(frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.2)
    requests = [Request(SamplingParams(max_tokens=50, temperature=1.0, seed=i, logprobs=1, **penalized),
                        [rng.randrange(VOCAB) for _ in range(5)]) for i in range(3)]
    for row, request in enumerate(requests):
        admit(sampler, row, request)
    for _ in range(3):
        run_step(sampler, requests, torch.randn(len(requests), VOCAB))
    sampler.move(2, 0)  # request 0 leaves
    requests = [requests[2], requests[1]]
    newcomer = Request(SamplingParams(max_tokens=50, temperature=0.0, logit_bias={5: 3.0}, seed=9), [1, 2, 3])
    admit(sampler, 2, newcomer)
    requests.append(newcomer)
    for _ in range(3):
        run_step(sampler, requests, torch.randn(len(requests), VOCAB))


def test_rows_admitted_and_moved_between_draws_reach_the_device_together() -> None:
    """Admissions and moves wait on the host for the next draw's upload: a row moved twice, rows
    admitted where others left, forced tokens counted before a first draw, and a penalized
    newcomer whose (rows, vocab) state is written at once, after the moves."""
    rng = random.Random(3)
    sampler = BatchSampler(4, VOCAB, torch.device("cpu"), fused=True)
    requests = [Request(SamplingParams(max_tokens=50, temperature=1.0, seed=i), [rng.randrange(VOCAB)])
                for i in range(4)]
    for row, request in enumerate(requests):
        admit(sampler, row, request)
    run_step(sampler, requests, torch.randn(4, VOCAB))
    sampler.move(3, 2)  # request 2 leaves; 3 takes its row
    sampler.move(2, 1)  # request 1 leaves; 3 moves again
    forced = Request(SamplingParams(max_tokens=50, temperature=0.7, seed=11), [1, 2])
    admit(sampler, 2, forced)
    sampler.record_forced(2, [5, 6])
    forced.generated += [5, 6]
    penalized = Request(SamplingParams(max_tokens=50, temperature=1.0, seed=12, frequency_penalty=0.5), [3])
    admit(sampler, 3, penalized)
    requests = [requests[0], requests[3], forced, penalized]
    for _ in range(3):
        run_step(sampler, requests, torch.randn(4, VOCAB))


def test_a_seeded_request_samples_the_same_alone_and_in_a_batch() -> None:
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234, frequency_penalty=0.5)
    logits = torch.randn(5, 4, VOCAB)  # steps x rows x vocab; the request sits in row 2

    def tokens(rows: list[int]) -> list[int]:
        sampler = BatchSampler(4, VOCAB, torch.device("cpu"), fused=True)
        for row in range(len(rows)):
            other = SamplingParams(max_tokens=10, temperature=0.9, top_k=3, seed=row)
            sampler.add(row, params if rows[row] == 2 else other, [3, 4], torch.Generator().manual_seed(
                params.seed if rows[row] == 2 else row))
        mine = rows.index(2)
        return [sampler.sample(logits[step, rows]).token_ids[mine] for step in range(5)]

    assert tokens([2]) == tokens([0, 1, 2, 3]) == tokens([3, 2])


def test_the_constraint_mask_beats_logit_bias_and_penalties() -> None:
    """A +100 bias and a negative penalty on a masked token never bring it back; greedy or not."""
    forbidden = 7
    mask = torch.ones(2, VOCAB, dtype=torch.bool)
    mask[:, forbidden] = False
    sampler = BatchSampler(2, VOCAB, torch.device("cpu"), fused=True)
    pushy = dict(logit_bias={forbidden: 100.0}, frequency_penalty=-2.0, presence_penalty=-2.0,
                 repetition_penalty=0.5, logprobs=2)
    requests = [Request(SamplingParams(max_tokens=9, temperature=0.0, seed=0, **pushy), [forbidden]),
                Request(SamplingParams(max_tokens=9, temperature=1.0, seed=1, logprobs_mode="processed_logprobs",
                                       **pushy), [forbidden])]
    for row, request in enumerate(requests):
        admit(sampler, row, request)
    for _ in range(5):
        run_step(sampler, requests, torch.randn(2, VOCAB), mask)
    assert all(forbidden not in r.generated for r in requests)


def test_logit_bias_forces_and_bans_tokens() -> None:
    sampler = BatchSampler(2, VOCAB, torch.device("cpu"), fused=True)
    sampler.add(0, SamplingParams(max_tokens=5, temperature=1.0, logit_bias={11: 100.0}, seed=0), [1],
                torch.Generator().manual_seed(0))
    sampler.add(1, SamplingParams(max_tokens=5, temperature=0.0, logit_bias={11: -100.0}, seed=0), [1],
                torch.Generator().manual_seed(0))
    logits = torch.randn(2, VOCAB)
    logits[1, 11] = 50.0  # the favourite, banned
    assert sampler.sample(logits).token_ids[0] == 11
    assert sampler.sample(logits).token_ids[1] != 11


def test_min_tokens_holds_stop_tokens_back_but_never_empties_a_row() -> None:
    sampler = BatchSampler(2, VOCAB, torch.device("cpu"), fused=True)
    params = SamplingParams(max_tokens=9, temperature=0.0, min_tokens=2, stop_token_ids=frozenset({3}))
    for row in range(2):
        sampler.add(row, params, [1], torch.Generator())
    logits = torch.zeros(2, VOCAB)
    logits[:, 3] = 10.0  # the stop token is the favourite
    logits[1, :] = NEG_INF  # row 1: a constraint allowing the stop token only
    logits[1, 3] = 0.0
    assert sampler.sample(logits.clone()).token_ids == [int(logits[0].masked_fill(
        torch.arange(VOCAB) == 3, NEG_INF).argmax()), 3]
    assert sampler.sample(logits.clone()).token_ids[0] != 3  # one generated so far: still held
    assert sampler.sample(logits.clone()).token_ids[0] == 3  # min_tokens reached


def test_state_made_inside_a_step_moves_outside_one() -> None:
    """The engine admits inside inference mode and may move rows outside it (an abort)."""
    sampler = BatchSampler(2, VOCAB, torch.device("cpu"), fused=True)
    params = SamplingParams(max_tokens=5, temperature=0.0, frequency_penalty=1.0, logit_bias={4: 1.0}, min_tokens=1,
                            repetition_penalty=1.1, stop_token_ids=frozenset({0}))
    with torch.inference_mode():
        for row in range(2):
            sampler.add(row, params, [1, 2], torch.Generator())
        sampler.sample(torch.randn(2, VOCAB))
    sampler.move(1, 0)
    assert len(sampler.sample(torch.randn(1, VOCAB)).token_ids) == 1


# --------------------------------------------------------------------------- fused path


def random_masks(rows: list[int], generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed int32 masks for `rows` allowing about half the tokens each, and the row indices."""
    allowed = torch.rand(len(rows), VOCAB, generator=generator) < 0.5
    allowed[:, 0] = True  # never an empty row
    bits = allowed.view(len(rows), VOCAB // 32, 32).long() << torch.arange(32)
    words = bits.sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).int(), torch.tensor(rows)


def unpacked(masks: tuple[torch.Tensor, torch.Tensor], batch: int) -> torch.Tensor:
    """(batch, VOCAB) bool: True = allowed; unlisted rows allow everything."""
    bitmask, rows = masks
    allowed = torch.ones(batch, VOCAB, dtype=torch.bool)
    allowed[rows] = ((bitmask.long()[:, :, None] >> torch.arange(32)) & 1).bool().view(len(rows), VOCAB)
    return allowed


def test_fused_and_general_paths_pick_the_same_greedy_tokens() -> None:
    """Greedy rows without logprobs take the fused kernel, with logprobs=0 the general path; under
    the same masks they pick the same tokens, and the fused-only batch leaves the logits unwritten."""
    generator = torch.Generator().manual_seed(3)
    fused, general = BatchSampler(4, VOCAB, torch.device("cpu"), fused=True), BatchSampler(4, VOCAB, torch.device("cpu"), fused=True)
    for row in range(4):
        fused.add(row, SamplingParams(max_tokens=9, temperature=0.0), [1], torch.Generator())
        general.add(row, SamplingParams(max_tokens=9, temperature=0.0, logprobs=0), [1], torch.Generator())
    for _ in range(4):
        logits = torch.randn(4, VOCAB, generator=generator)
        masks = random_masks([0, 2, 3], generator)
        before = logits.clone()
        tokens = fused.sample(logits, masks=masks).token_ids
        assert torch.equal(logits, before)
        assert tokens == general.sample(logits.clone(), masks=masks).token_ids
        assert tokens == logits.masked_fill(~unpacked(masks, 4), NEG_INF).argmax(-1).tolist()


def test_a_seeded_temperature_request_ignores_its_neighbours_and_its_mask_holds() -> None:
    """A fused-path request (temperature and seed only) draws the same tokens alone and beside a
    general-path top_p request, whose mask is then applied in place; every token is allowed."""
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=77)
    neighbour = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.5, seed=1)
    generator = torch.Generator().manual_seed(5)
    steps = [(torch.randn(2, VOCAB, generator=generator), random_masks([0, 1], generator)) for _ in range(6)]

    def run(with_neighbour: bool) -> tuple[list[int], list[int]]:
        sampler = BatchSampler(2, VOCAB, torch.device("cpu"), fused=True)
        sampler.add(0, params, [1], torch.Generator().manual_seed(params.seed))
        if with_neighbour:
            sampler.add(1, neighbour, [1], torch.Generator().manual_seed(neighbour.seed))
        mine, theirs = [], []
        for logits, (bitmask, rows) in steps:
            n = 2 if with_neighbour else 1
            tokens = sampler.sample(logits[:n].clone(), masks=(bitmask[:n], rows[:n])).token_ids
            mine.append(tokens[0])
            theirs += tokens[1:]
        return mine, theirs

    alone, _ = run(False)
    together, neighbour_tokens = run(True)
    assert alone == together
    assert len(set(alone)) > 1  # really sampled, not a constant
    for (logits, masks), mine, theirs in zip(steps, together, neighbour_tokens):
        allowed = unpacked(masks, 2)
        assert allowed[0, mine] and allowed[1, theirs]
