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
