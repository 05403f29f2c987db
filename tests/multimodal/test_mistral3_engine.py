"""Mistral 3 image requests through the engine (tiny random checkpoint, the default dtype and kernels): 16 concurrent
requests, several on one image, each image several embed runs (one per row of merged patches, the [IMG_BREAK]s
between them token embeddings), give bitwise the greedy tokens of one at a time, also with a 3-token prefill chunk
budget; each image encoded once; every KV block comes back; llama.cpp's mmproj == the directory's tower."""

import pytest
from tiny_mistral3 import random_image, write_model_dir
from vision_harness import EngineCase, mmproj_core, sixteen_jobs, tokens

from conveyor.multimodal.image_input import ImageInput

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.batch_invariant

IMAGES = [ImageInput.from_pil(random_image(seed, (30 + 11 * seed, 40))) for seed in range(4)]
JOBS = sixteen_jobs("<s>[INST][IMG]Describe picture {i}.[/INST]", "<s>[INST]two[IMG][IMG]\nSame?[/INST]", IMAGES)


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> EngineCase:
    path = tmp_path_factory.mktemp("mistral3_engine")
    write_model_dir(path, transformers, tie=False)  # tied, greedy repeats [/INST] whatever the image
    return EngineCase(str(path), JOBS, IMAGES)


@pytest.fixture(scope="module")
def alone(case):
    return case.alone()


def test_outputs_depend_on_the_image(alone):
    assert len({tuple(tokens(trace)) for trace in alone[:4]}) > 1


def test_an_image_has_a_run_per_row(case):
    core = case.core()
    ids = core.tokenizer.encode(JOBS[3][0], add_special_tokens=False)
    item = core.make_request(ids, case.params, images=[IMAGES[3]]).images[0]
    assert len(item.embed_runs) == item.extras["rows"] > 1


def test_concurrent_equals_one_at_a_time_and_encodes_each_image_once(case, alone):
    case.check_concurrent(alone)


def test_chunk_budget_smaller_than_a_row(case, alone):
    case.check_chunk_budget(alone)


@pytest.fixture(scope="module")
def mmproj(tmp_path_factory):
    from tiny_mistral3 import hf_model, write_mmproj

    path = tmp_path_factory.mktemp("mistral3_mmproj") / "mmproj.gguf"
    write_mmproj(path, hf_model(transformers, tie=False))  # the directory's weights
    return str(path)


def test_mmproj_equals_the_hf_directory(case, alone, mmproj):
    """llama.cpp's mmproj (projector type pixtral, q / k permuted) beside the text model == the directory's tower."""
    from conveyor.loading.hf_loader import load_hf_dir

    core = mmproj_core(load_hf_dir(case.model_dir), mmproj, enable_prefix_caching=False)
    assert core.vision is not None and core.vision.model_type == "mistral3"
    assert [case.run(core, [job])[0] for job in JOBS[:4]] == alone[:4]


def test_mmproj_pairs_with_mistral_text_models_only(case, mmproj):
    """Ministral 3's text GGUF (ministral3) and Mistral Small 3.1's (converted as llama) take it; others do not."""
    from dataclasses import replace

    from conveyor.loading.checkpoint import LoadError
    from conveyor.loading.hf_loader import load_hf_dir
    from conveyor.loading.mmproj import read_mmproj

    checkpoint = load_hf_dir(case.model_dir)
    for architecture in ("ministral3", "llama"):
        read_mmproj(mmproj, checkpoint.tokenizer, replace(checkpoint.config, architecture=architecture))
    with pytest.raises(LoadError, match="cannot feed a qwen3"):
        read_mmproj(mmproj, checkpoint.tokenizer, replace(checkpoint.config, architecture="qwen3"))
    with pytest.raises(LoadError, match="64-wide"):
        read_mmproj(mmproj, checkpoint.tokenizer, replace(checkpoint.config, hidden_size=32))


def test_pixtral_12b_mmproj_equals_its_directory(tmp_path):
    """Pixtral 12B's Llava projector (no norm, no merger: the converter writes no spatial_merge_size) loads as llava:
    the same processor output and tower output, bitwise (fp32), as the HF directory's."""
    import torch
    from tiny_mistral3 import write_mmproj

    from conveyor.loading.hf_loader import load_hf_dir
    from conveyor.loading.mmproj import read_mmproj
    from conveyor.multimodal.vision import build_vision

    model = write_model_dir(tmp_path, transformers, kind="llava")
    write_mmproj(tmp_path / "mmproj.gguf", model)
    checkpoint = load_hf_dir(str(tmp_path))
    from_gguf = read_mmproj(str(tmp_path / "mmproj.gguf"), checkpoint.tokenizer, checkpoint.config)
    assert from_gguf.model_type == checkpoint.vision.model_type == "llava"
    ours, theirs = (build_vision(v, checkpoint.tokenizer, torch.float32, torch.device("cpu"))
                    for v in (from_gguf, checkpoint.vision))
    ids = checkpoint.tokenizer.encode(JOBS[1][0], add_special_tokens=False)
    a, b = (v.processor.expand(ids, [IMAGES[1]]) for v in (ours, theirs))
    assert a.token_ids == b.token_ids and torch.equal(a.items[0].pixel_values, b.items[0].pixel_values)
    assert a.items[0].num_embeds == a.items[0].extras["rows"] * a.items[0].extras["cols"] > 16  # no merge
    assert torch.equal(ours.encoder.encode(a.items[0]), theirs.encoder.encode(b.items[0]))
