"""The processors' shared pieces: the marker count is a 400, resample numbers are PIL's (a bad one a load error that
names it), an unknown activation a load error, and the normalization is transformers' (rescale in float64)."""

import numpy as np
import pytest
from PIL import Image

from conveyor.errors import InvalidRequestError
from conveyor.multimodal.image_input import ImageInput
from conveyor.multimodal.preprocess import (HALF, ImageRun, PixelNormalizer, activation, check_marker_count,
                                          expand_markers, resample_filter)


def test_marker_count_mismatch_is_a_400():
    image = ImageInput.from_pil(Image.new("RGB", (4, 4)))
    check_marker_count([1, 7, 2], 7, "<image>", [image])
    with pytest.raises(InvalidRequestError, match=r"2 image markers \(<image>\) for 1 images") as info:
        check_marker_count([7, 7], 7, "<image>", [image])
    assert info.value.param == "messages"


def test_expand_markers_places_each_run_in_order():
    """Marker 7 -> its image's run (width + 1 tokens, the embed rows after a head token); offsets count the runs
    before; the images' order is the markers'."""
    import torch

    images = [ImageInput.from_pil(Image.new("RGB", (w, 2))) for w in (2, 3)]
    calls = []

    def image_run(image: ImageInput) -> ImageRun:
        calls.append(image)
        width = image.size[0]
        return ImageRun([8] + [7] * width, ((1, width),), torch.zeros(width), {"width": width})

    ids, items = expand_markers([1, 7, 2, 7, 3], 7, "<m>", images, image_run)
    assert ids == [1, 8, 7, 7, 2, 8, 7, 7, 7, 3]
    assert [(i.offset, i.num_tokens, i.embed_runs, i.extras) for i in items] == [
        (1, 3, ((1, 2),), {"width": 2}), (5, 4, ((1, 3),), {"width": 3})]
    assert [i.content_hash for i in items] == [image.content_hash for image in images] and calls == images
    with pytest.raises(InvalidRequestError, match="1 image markers"):
        expand_markers([1, 7], 7, "<m>", images, image_run)
    assert len(calls) == 2  # refused before any image was processed


def test_resample_is_pils_numbering():
    filters = [Image.Resampling.NEAREST, Image.Resampling.LANCZOS, Image.Resampling.BILINEAR,
               Image.Resampling.BICUBIC, Image.Resampling.BOX, Image.Resampling.HAMMING]
    assert [resample_filter({"resample": n}, 0) for n in range(6)] == filters
    assert resample_filter({}, 3) is Image.Resampling.BICUBIC
    for bad in (9, 6, "bicubic"):
        with pytest.raises(ValueError, match="is not one of PIL's filters"):
            resample_filter({"resample": bad}, 2)


def test_unknown_activation_names_itself():
    assert activation("silu", "x") is not None
    with pytest.raises(ValueError, match="mistral3: activation 'relu2' is not supported"):
        activation("relu2", "mistral3")


def test_normalizer_rounds_like_transformers():
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (5, 7, 3), dtype=np.uint8)
    normalize = PixelNormalizer.from_config({"image_mean": [0.1, 0.2, 0.3]}, HALF, HALF)
    want = ((pixels.astype(np.float64) * (1 / 255)).astype(np.float32) - np.float32([0.1, 0.2, 0.3])) / np.float32(0.5)
    got = normalize(Image.fromarray(pixels))
    assert got.shape == (3, 5, 7) and got.dtype == np.float32
    assert np.array_equal(got, want.transpose(2, 0, 1))


def test_a_missing_tower_tensor_is_a_value_error():
    """The CLI reports a ValueError as a one-line load failure (a KeyError would be a traceback)."""
    import torch

    from conveyor.multimodal.tower_weights import find_prefix, load_renamed

    with pytest.raises(ValueError, match="gemma3 vision: no patch.weight under a., b."):
        find_prefix({"c.patch.weight": 0}, ("a.", "b."), "patch.weight", "gemma3")
    with pytest.raises(ValueError, match="idefics3 vision: missing tensor t.weight"):
        load_renamed(torch.nn.Linear(2, 2), {}, {"weight": "t.weight"}, torch.float32, "idefics3")
