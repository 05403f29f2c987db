"""MTPRunner's bookkeeping with a stand-in head: which hidden state and which token each head row reads, at which
position, after prefill, drafting, accepted and rejected drafts, a hybrid's recompute and a flush."""

from dataclasses import dataclass, field

import torch

from conveyor.engine.outputs import DraftRequest, ScheduledChunk
from conveyor.engine.sampling_params import SamplingParams
from conveyor.runner import mtp_runner
from conveyor.runner.mtp_runner import MTPRunner

GREEDY = SamplingParams(temperature=0)
VOCAB = 50


class _Ops:
    @staticmethod
    def argmax(logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)


@dataclass
class _Inputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_indices: torch.Tensor
    meta: None = None


@dataclass
class _Head:
    """Records each row it reads (position, token, hidden[0]); proposes token (hidden[0] + 1) % VOCAB and hands
    on hidden + 1 as its output, so a chained draft shows which row it came from."""

    rows: list[tuple[int, int, float]] = field(default_factory=list)

    def __call__(self, input_ids, hidden, positions, caches, meta):
        self.rows += [(int(p), int(t), float(h[0])) for p, t, h in zip(positions, input_ids, hidden)]
        return hidden + 1

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot(hidden[:, 0].long() % VOCAB, VOCAB).float()

    def draft_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.compute_logits(hidden), None


class _Runner:
    """The parts of a ModelRunner over the head that MTPRunner reads."""

    def __init__(self) -> None:
        self.model = _Head()
        self.kv_caches = []
        self.sampler = type("S", (), {"ops": _Ops(), "forget": lambda self, ids: None})()

    def prepare_inputs(self, plan):
        ids, positions, last = [], [], []
        for chunk in plan.chunks:
            ids += chunk.token_ids
            positions += range(chunk.start_position, chunk.start_position + len(chunk.token_ids))
            if chunk.sample:
                last.append(len(ids) - 1)
        return _Inputs(torch.tensor(ids), torch.tensor(positions), torch.tensor(last, dtype=torch.long))


def _chunk(tokens, start, drafts=0, draft=None):
    return ScheduledChunk("r", list(tokens), start, (0, 1, 2, 3), True, GREEDY, num_draft_tokens=drafts, draft=draft)


def _hidden(start, n):
    """The target's hidden state at position q: (H,) filled with 100 + q."""
    return (100 + torch.arange(start, start + n, dtype=torch.float32))[:, None].expand(n, 4).clone()


def test_the_head_reads_h_q_with_the_token_after_it():
    runner = MTPRunner(_Runner())
    head = runner.head
    prompt = [11, 12, 13, 14, 15]
    runner.record([_chunk(prompt, 0)], _hidden(0, 5))  # prefill: h_0..h_4 wait for x_5
    assert head.rows == []
    decode = _chunk([16], 5, draft=DraftRequest(3, tuple(prompt + [16]), 0))
    proposal = runner.propose([decode])["r"]
    # rows at q = 0..4 read (x_{q+1}, h_q); then the head chains on its own output (+1 each)
    assert head.rows == [(0, 12, 100.0), (1, 13, 101.0), (2, 14, 102.0), (3, 15, 103.0), (4, 16, 104.0),
                         (5, 5, 105.0), (6, 6, 106.0)]
    assert proposal.token_ids == [105 % VOCAB, 106 % VOCAB, 107 % VOCAB]
    assert proposal.probs is None  # greedy


def test_a_verify_chunk_is_cut_where_the_next_chunk_starts():
    runner = MTPRunner(_Runner())
    head = runner.head
    runner.record([_chunk([1, 2, 3], 0)], _hidden(0, 3))
    runner.propose([_chunk([4], 3, draft=DraftRequest(2, (1, 2, 3, 4), 0))])
    head.rows.clear()
    # The verify chunk x_3, d_1, d_2 at 3..5; one draft accepted: the next decode token (the bonus) sits at 5.
    runner.record([_chunk([4, 7, 8], 3, drafts=2)], _hidden(3, 3))
    runner.propose([_chunk([9], 5, draft=DraftRequest(1, (1, 2, 3, 4, 7, 9), 0))])
    assert head.rows == [(3, 7, 103.0), (4, 9, 104.0)]  # h_5 (after the rejected d_2) is dropped


def test_a_hybrid_recompute_replaces_the_rows_it_recomputes():
    runner = MTPRunner(_Runner())
    head = runner.head
    runner.record([_chunk([1, 2, 3], 0)], _hidden(0, 3))
    runner.propose([_chunk([4], 3, draft=DraftRequest(2, (1, 2, 3, 4), 0))])
    runner.record([_chunk([4, 7, 8], 3, drafts=2)], _hidden(3, 3))
    head.rows.clear()
    # A hybrid rolled back after x_3: d_1 and the bonus 9 are recomputed from position 4 (their own hidden states).
    runner.record([_chunk([7, 9], 4)], _hidden(4, 2) + 0.5)
    runner.propose([_chunk([10], 6, draft=DraftRequest(1, (1, 2, 3, 4, 7, 9, 10), 0))])
    assert head.rows == [(3, 7, 103.0), (4, 9, 104.5), (5, 10, 105.5)]


def test_rows_that_do_not_draft_flush_through_the_head(monkeypatch):
    monkeypatch.setattr(mtp_runner, "FLUSH_ROWS", 4)
    runner = MTPRunner(_Runner())
    head = runner.head
    runner.record([_chunk(range(20, 26), 0)], _hidden(0, 6))  # 6 rows > 4: all but the last go through now
    assert head.rows == [(q, 21 + q, 100.0 + q) for q in range(5)]
    head.rows.clear()
    runner.record([_chunk([26], 6)], _hidden(6, 1))  # one decode row: waits
    assert head.rows == []
    runner.propose([_chunk([27], 7, draft=DraftRequest(1, tuple(range(20, 28)), 0))])
    assert head.rows == [(5, 26, 105.0), (6, 27, 106.0)]


def test_no_hidden_state_before_the_row_means_no_draft_and_forget_drops_it():
    runner = MTPRunner(_Runner())
    assert runner.propose([_chunk([4], 3, draft=DraftRequest(2, (1, 2, 3, 4), 0))])["r"].token_ids == []
    runner.record([_chunk([1, 2, 3], 0)], _hidden(0, 3))
    runner.forget(["r"])
    assert runner.propose([_chunk([4], 3, draft=DraftRequest(2, (1, 2, 3, 4), 0))])["r"].token_ids == []
    assert runner.head.rows == []


def _run(defer: bool, monkeypatch) -> tuple[list, list]:
    """A 6-row prompt, 5 decode rows that do not draft, then a draft: the head rows read, and the proposal."""
    monkeypatch.setattr(mtp_runner, "FLUSH_ROWS", 4)
    monkeypatch.setattr(mtp_runner, "DEFER_BYTES", 9 * 4 * 4)  # 9 pending rows of (4,) fp32 while deferring
    runner = MTPRunner(_Runner())
    runner.defer = defer
    runner.record([_chunk(range(20, 26), 0)], _hidden(0, 6))
    flushed_before_draft = []
    for q in range(6, 11):
        runner.record([_chunk([20 + q], q)], _hidden(q, 1))
        flushed_before_draft.append(len(runner.head.rows))
    runner.defer = False
    proposal = runner.propose([_chunk([31], 11, draft=DraftRequest(2, tuple(range(20, 32)), 0))])["r"]
    return runner, flushed_before_draft, proposal.token_ids


def test_rows_wait_while_the_policy_declines_and_a_draft_runs_them(monkeypatch):
    eager, eager_flushes, eager_drafts = _run(False, monkeypatch)
    deferred, deferred_flushes, deferred_drafts = _run(True, monkeypatch)
    assert eager_flushes[-1] > 0 and not eager.paid_deferred
    # Deferred: nothing runs until a request holds more than 9 rows (the prompt's 6 plus 4 decode rows = 10)
    assert deferred_flushes == [0, 0, 0, 9, 9]
    assert deferred.paid_deferred  # the flush past the cap ran rows kept while declining
    # The head read the same rows either way (its kernels are row-invariant), so the drafts are the same.
    assert sorted(deferred.head.rows) == sorted(eager.head.rows)
    assert deferred_drafts == eager_drafts


def test_a_draft_after_deferred_rows_reports_them(monkeypatch):
    monkeypatch.setattr(mtp_runner, "FLUSH_ROWS", 4)
    runner = MTPRunner(_Runner())
    runner.defer = True
    runner.record([_chunk(range(20, 26), 0)], _hidden(0, 6))  # 6 > FLUSH_ROWS rows wait
    assert runner.head.rows == [] and not runner.paid_deferred
    runner.propose([_chunk([26], 6, draft=DraftRequest(1, tuple(range(20, 27)), 0))])
    assert runner.paid_deferred  # the engine does not time this tick for the policy
    assert [q for q, _, _ in runner.head.rows] == list(range(6))  # h_0..h_5 with x_1..x_6, in one forward
