"""Top logprob alternatives under ties: bf16 logits tie often, and a row's alternatives must not
depend on what the other rows of its batch asked for (a node and the router's decode node batch
the same request with different neighbours)."""

import torch

from conveyor.runner.sampler import _alternatives


def test_ties_are_ordered_by_token_id_whatever_k():
    logprobs = torch.tensor([-3.0, -1.0, -2.0, -1.0, -2.0, -2.0, -5.0])
    assert _alternatives(logprobs, 0) == []
    assert _alternatives(logprobs, 3) == [(1, -1.0), (3, -1.0), (2, -2.0)]
    for k in range(1, 8):  # a prefix of any longer list: the same row answers the same in any batch
        assert _alternatives(logprobs, k) == _alternatives(logprobs, 7)[:k]


def test_a_tie_wider_than_what_topk_returned_is_seen_whole():
    logprobs = torch.full((64,), -4.0)
    logprobs[40] = -1.0
    assert _alternatives(logprobs, 3) == [(40, -1.0), (0, -4.0), (1, -4.0)]
    rows = torch.randn(4, 5000).bfloat16().float().log_softmax(-1)
    for row in rows:
        assert [v for _, v in _alternatives(row, 5)] == row.topk(5).values.tolist()
