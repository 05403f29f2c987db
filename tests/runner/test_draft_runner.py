"""pick_drafts over a draft vocabulary (--draft-vocab, EAGLE3's d2t): greedy drafts are the subset's argmax mapped to
target ids; a sampled row's q is the subset's distribution over the whole vocabulary (0 off it, summing to 1), and
rejection sampling with that q still emits the target's distribution. confident_rows: --draft-p-min."""

import torch

from conveyor.engine.outputs import ScheduledChunk
from conveyor.engine.sampling_params import SamplingParams
from conveyor.runner.draft_runner import confident_rows, pick_drafts
from conveyor.runner.rejection import rejection_sample
from conveyor.runner.sampler import Sampler

VOCAB = 12
SUBSET = torch.tensor([1, 4, 7, 9, 10])  # ascending target ids of the N = 5 columns


class _Ops:
    @staticmethod
    def argmax(logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)


def _step(request_id: str, params: SamplingParams) -> ScheduledChunk:
    return ScheduledChunk(request_id, [0], 3, (0,), True, params)


def test_drafts_come_from_the_subset_and_q_sums_to_one_over_it():
    sampler = Sampler(VOCAB, torch.device("cpu"), _Ops(), seed=0)
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5, 0.3],
                           [1.0, 0.2, 0.4, 3.0, -2.0],
                           [0.0, 0.0, 1.5, 0.2, 0.1]])  # (R, N)
    steps = [_step("g", SamplingParams(temperature=0)), _step("s", SamplingParams(temperature=0.7)),
             _step("k", SamplingParams(temperature=1.0, top_k=2))]
    probs = {"s": [], "k": []}
    tokens = pick_drafts(sampler, logits, steps, {"s", "k"}, probs, SUBSET)
    assert tokens[0] == 4  # column 1's target id
    assert all(t in SUBSET.tolist() for t in tokens)
    off = torch.ones(VOCAB, dtype=torch.bool)
    off[SUBSET] = False
    (q_s,), (q_k,) = probs["s"], probs["k"]
    for q in (q_s, q_k):
        assert q.shape == (VOCAB,) and bool((q[off] == 0).all()) and abs(q.sum().item() - 1) < 1e-6
    torch.testing.assert_close(q_s[SUBSET], torch.softmax(logits[1] / 0.7, dim=-1))
    assert set(q_k.nonzero().flatten().tolist()) == {7, 9}  # top_k 2 of the subset: columns 2 and 3


def test_rejection_with_a_subset_q_emits_the_target_distribution():
    """q from the subset (0 at ids the drafter cannot propose): the emitted token still follows p."""
    gen = torch.Generator().manual_seed(0)
    rows = 40_000
    p = torch.softmax(torch.randn(2, VOCAB, generator=gen), dim=-1)  # (k + 1, V), k = 1
    sampler = Sampler(VOCAB, torch.device("cpu"), _Ops(), seed=1)
    steps = [_step("s", SamplingParams(temperature=1.0))]
    probs = {"s": []}
    pick_drafts(sampler, torch.randn(1, len(SUBSET), generator=gen), steps, {"s"}, probs, SUBSET)
    q = probs["s"][0]
    drafts = torch.multinomial(q, rows, replacement=True, generator=gen)[:, None]  # (rows, 1)
    tokens, accepted = rejection_sample(p.expand(rows, -1, -1), q.expand(rows, 1, -1), drafts, gen)
    counts = torch.bincount(tokens[:, 0], minlength=VOCAB).float()
    expected = p[0] * rows
    assert float(((counts - expected) ** 2 / expected).sum()) < 31.3  # df 11, p = 0.001
    assert abs(accepted.float().mean().item() - torch.minimum(p[0], q).sum().item()) < 0.01


def test_a_confidence_floor_drops_unsure_greedy_drafts_only():
    logits = torch.tensor([[5.0, 0.0, 0.0], [0.1, 0.0, 0.0], [0.1, 0.0, 0.0]])  # sure, unsure, unsure
    steps = [_step("a", SamplingParams(temperature=0)), _step("b", SamplingParams(temperature=0)),
             _step("c", SamplingParams(temperature=0.8))]
    assert confident_rows(logits, steps, {"c"}, 0.9) == [True, False, True]  # sampled rows keep theirs
    assert confident_rows(logits, steps, {"c"}, 0.0) == [True, True, True]
