"""Every projector type's mmproj loader refuses a tensor it does not know, naming it and the file (a tensor dropped
silently would run a different tower than the file's): the tiny families' files as llama.cpp's converter writes
them, plus one extra tensor inside a block and one outside. A missing one is named by the tower's loader."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from conveyor.loading.checkpoint import LoadError

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

# projector type -> the tiny family module that writes it
FAMILIES = {"gemma3": "tiny_gemma3_vision", "idefics3": "tiny_idefics3", "lfm2": "tiny_lfm2_vl",
            "pixtral": "tiny_mistral3", "qwen3vl_merger": "tiny_qwen3_vl"}
EXTRA = ["v.blk.1.attn_q_norm.weight", "mm.model.peg.0.weight"]  # names llama.cpp gives other towers' tensors


class AnyVocabulary:
    """Every special token the loaders look up is there (the renaming does not depend on the vocabulary)."""

    def token_to_id(self, token: str) -> int:
        return 3


def _write(path, family: str, extra: list[str], monkeypatch) -> None:
    """The family's mmproj with `extra` tensors added just before its header is written."""
    tiny = importlib.import_module(FAMILIES[family])
    write_header = gguf.GGUFWriter.write_header_to_file

    def with_extra(writer, *args, **kwargs):
        for name in extra:
            writer.add_tensor(name, np.zeros(4, dtype=np.float32))
        return write_header(writer, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "write_header_to_file", with_extra)
    tiny.write_mmproj(path, tiny.hf_model(transformers))
    monkeypatch.undo()


@pytest.mark.parametrize("family", FAMILIES)
def test_an_unknown_tensor_is_named(family, tmp_path, monkeypatch):
    from conveyor.loading.mmproj import read_mmproj

    _write(tmp_path / "valid.gguf", family, [], monkeypatch)
    assert read_mmproj(str(tmp_path / "valid.gguf"), AnyVocabulary()).weights  # the files load without the extra
    path = tmp_path / "extra.gguf"
    _write(path, family, EXTRA, monkeypatch)
    with pytest.raises(LoadError) as error:
        read_mmproj(str(path), AnyVocabulary())
    assert str(error.value) == (f"{path}: unknown tensors {', '.join(EXTRA)} in a {family} projector (not a file "
                                "this loader can run)")


@pytest.mark.parametrize("family, missing", [
    ("pixtral", "vision_tower.transformer.layers.0.attention.k_proj.weight"),  # one part of the fused qkv
    ("pixtral", "multi_modal_projector.patch_merger.merging_layer.weight"),
    ("qwen3vl_merger", "model.visual.blocks.1.attn.qkv.bias"),
    ("qwen3vl_merger", "model.visual.deepstack_merger_list.1.linear_fc2.weight")])
def test_a_missing_tensor_is_named(family, missing, tmp_path, monkeypatch):
    import torch

    from conveyor.loading.mmproj import read_mmproj
    from conveyor.multimodal.vision import build_vision

    _write(tmp_path / "mmproj.gguf", family, [], monkeypatch)
    checkpoint = read_mmproj(str(tmp_path / "mmproj.gguf"), AnyVocabulary())
    del checkpoint.weights[missing]
    name = "mistral3" if family == "pixtral" else "qwen3_vl"
    with pytest.raises(ValueError, match=f"^{name} vision: missing tensor {missing}$"):
        build_vision(checkpoint, AnyVocabulary(), torch.float32, torch.device("cpu"))
