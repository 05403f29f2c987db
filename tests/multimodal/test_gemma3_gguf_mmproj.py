"""A real Gemma 3 GGUF (270M, Q4_K_M: the real tokenizer, no <image_soft_token> in its vocabulary) with a random
mmproj at --mmproj: images expand with Gemma's own newline tokens, the image changes the answer, and 6 concurrent
image requests give the one-at-a-time tokens."""

import pytest
from tiny_gemma3_vision import random_image, write_random_mmproj

from conveyor.config import EngineConfig
from conveyor.engine.engine import EngineCore
from conveyor.engine.sampling_params import SamplingParams
from conveyor.multimodal.image_input import ImageInput
from conveyor.testing import gemma3_270m_path

PATH = gemma3_270m_path()
pytestmark = pytest.mark.skipif(PATH is None, reason="the gemma3-270m test packages are not installed")
PROMPT = "<start_of_turn>user\n<start_of_image>What is in this picture?<end_of_turn>\n<start_of_turn>model\n"
PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    mmproj = tmp_path_factory.mktemp("gemma3_gguf") / "mmproj.gguf"
    write_random_mmproj(mmproj, text_hidden=640)
    return EngineCore(EngineConfig(model=PATH, mmproj=str(mmproj), parallel=6, ctx_size=6 * 512,
                                   speculative_ngram=0))


def _run(core, images) -> list[list[int]]:
    ids = core.tokenizer.encode(PROMPT)
    requests = [core.make_request(ids, PARAMS, images=[ImageInput.from_pil(i)]) for i in images]
    for request in requests:
        core.add_request(request)
    while core.has_work():
        core.step()
    core.kv.check_integrity()
    return [r.output_token_ids for r in requests]


def test_expansion_uses_gemma_newline_tokens(core):
    assert core.vision is not None
    ids = core.tokenizer.encode(PROMPT)
    request = core.make_request(ids, PARAMS, images=[ImageInput.from_pil(random_image(0))])
    item = request.images[0]
    run = request.prompt_token_ids[item.offset:item.end]
    # "user\n" + "\n\n<start_of_image>" -> "\n\n\n" (109), 4 soft rows (pad stands in), "<end_of_image>\n\n" (108)
    assert run == [109, 255999, 0, 0, 0, 0, 256000, 108]


def test_images_change_the_answer_and_batches_match_one_at_a_time(core):
    images = [random_image(seed, (40 + seed, 30)) for seed in range(6)]
    alone = [_run(core, [image])[0] for image in images]
    assert len({tuple(a) for a in alone}) > 1
    assert _run(core, images) == alone
