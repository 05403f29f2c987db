"""The family-independent plumbing: image block keys, chunk ends around bidirectional runs, multimodal rotary
positions (the hook Qwen-VL's mrope plugs into)."""

import torch

from conveyor.engine.block_keys import chain_hashes
from conveyor.engine.outputs import ScheduledChunk, SchedulerOutput
from conveyor.engine.request import Request
from conveyor.engine.sampling_params import SamplingParams
from conveyor.multimodal.vision import ImageItem
from conveyor.runner.model_runner import _rope_positions


def _item(content_hash: str, offset: int, bidirectional: bool = True) -> ImageItem:
    return ImageItem(content_hash, offset, 6, ((1, 4),), torch.zeros(1), bidirectional=bidirectional)


def test_block_keys_fold_the_image_hash_only_where_an_image_lies():
    tokens = list(range(24))
    a = chain_hashes(tokens, 8, 3, spans=[(9, 15, b"\x01" * 16)])
    b = chain_hashes(tokens, 8, 3, spans=[(9, 15, b"\x02" * 16)])
    plain = chain_hashes(tokens, 8, 3)
    assert a[0] == b[0] == plain[0]  # before the image: the text key
    assert a[1] != b[1] and a[1] != plain[1] and a[2] != b[2]  # the image's block, and every block after it


def test_chunk_ends_never_fall_inside_a_bidirectional_run():
    request = Request("r", list(range(40)), SamplingParams())
    request.images = [_item("00", 10)]  # embed run [11, 15)
    assert request.whole_run_end(0, 13) == 11  # back to the run's start
    assert request.whole_run_end(11, 13) == 15  # a chunk starting at the run takes all of it
    assert request.whole_run_end(12, 14) == 15  # (a prefix hit may end inside it)
    assert request.whole_run_end(0, 11) == 11 and request.whole_run_end(0, 15) == 15
    request.images = [_item("00", 10, bidirectional=False)]
    assert request.whole_run_end(0, 13) == 13


def test_rope_positions_for_prompt_and_later_rows():
    request = Request("r", [1, 2, 3, 4], SamplingParams())
    request.rope_positions, request.rope_delta = ([0, 1, 1, 2], [0, 1, 2, 2], [0, 1, 1, 3]), -1
    request.output_token_ids = [9, 9]
    assert request.rope_positions_for(2, 4) == ([1, 2, 3, 4], [2, 2, 3, 4], [1, 3, 3, 4])
    assert request.rope_positions_for(5, 1) == ([4], [4], [4])
    assert Request("p", [1], SamplingParams()).rope_positions_for(0, 1) is None


def test_runner_rope_positions_continue_for_drafts_and_plain_chunks():
    params = SamplingParams()
    mrope = ScheduledChunk("a", [7, 8, 9], 5, (0,), True, params, rope_positions=([4], [4], [4]))  # + 2 drafts
    plain = ScheduledChunk("b", [1, 2], 3, (1,), True, params)
    got = _rope_positions(SchedulerOutput(chunks=[mrope, plain]), torch.device("cpu"))
    assert got.tolist() == [[4, 5, 6, 3, 4]] * 3
    assert _rope_positions(SchedulerOutput(chunks=[plain]), torch.device("cpu")) is None
