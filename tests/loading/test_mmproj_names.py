"""The shared projector renaming (loading/mmproj_names.py): stems and block parts by table, unused names dropped,
anything else a one-line LoadError that names the tensors and the file."""

from __future__ import annotations

import pytest
import torch

from conveyor.loading.checkpoint import LoadError
from conveyor.loading.mmproj_names import TensorNames, rename_tensors

NAMES = TensorNames({"v.post_ln": "tower.post_norm", "mm.1": "proj.linear_1"}, "tower.layers.{}",
                    {"ln1": "norm1", "attn_q": "attn.q_proj"}, unused=frozenset({"v.token_embd.img_break"}))


def test_stems_and_block_parts_are_renamed_and_unused_names_dropped():
    t = [torch.full((2,), float(i)) for i in range(5)]
    tensors = {"v.post_ln.weight": t[0], "v.post_ln.bias": t[1], "mm.1.weight": t[2], "v.blk.12.attn_q.bias": t[3],
               "v.blk.0.ln1.weight": t[4], "v.token_embd.img_break": torch.zeros(2)}
    renamed = rename_tensors(tensors, NAMES, "p.gguf", "test")
    assert renamed == {"tower.post_norm.weight": t[0], "tower.post_norm.bias": t[1], "proj.linear_1.weight": t[2],
                       "tower.layers.12.attn.q_proj.bias": t[3], "tower.layers.0.norm1.weight": t[4]}
    assert all(renamed[name] is tensor for name, tensor in zip(renamed, t))  # the same tensors, not copies


@pytest.mark.parametrize("extra", ["v.blk.0.attn_q_norm.weight", "mm.model.peg.0.weight", "v.blk.x.ln1.weight",
                                   "v.post_ln", "v.blk.0.ln1"])
def test_an_unknown_tensor_is_a_load_error_naming_it_and_the_file(extra):
    tensors = {"v.post_ln.weight": torch.zeros(2), extra: torch.zeros(2)}
    with pytest.raises(LoadError) as error:
        rename_tensors(tensors, NAMES, "/models/mmproj.gguf", "pixtral")
    message = str(error.value)
    assert message == f"/models/mmproj.gguf: unknown tensor {extra} in a pixtral projector (not a file this loader " \
                      "can run)"


def test_many_unknown_tensors_are_listed_in_one_line():
    tensors = {f"a.{i}.weight": torch.zeros(1) for i in range(8)}
    with pytest.raises(LoadError, match=r"^p\.gguf: unknown tensors a\.0\.weight, a\.1\.weight, a\.2\.weight, "
                                        r"a\.3\.weight, a\.4\.weight and 3 more in a test projector") as error:
        rename_tensors(tensors, NAMES, "p.gguf", "test")
    assert "\n" not in str(error.value)
