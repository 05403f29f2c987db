import pytest
import torch

from conveyor.engine.llm import LLM
from conveyor.kernels import resolve_backend
from conveyor.engine.sampling_params import SamplingParams
from conveyor.models.layers import RowInvariantLinear, calibrate_row_tile


def test_int8_linear_is_close_and_row_invariant():
    torch.manual_seed(0)
    linear = RowInvariantLinear(96, 160, bias=True, ops=resolve_backend("cpu"))
    linear.load_dense((torch.randn(160, 96) * 0.05).bfloat16(), torch.randn(160).bfloat16())
    x = torch.randn(40, 96).bfloat16()
    want = torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float())
    assert linear.quantize_int8()
    assert linear.weight is None  # one copy: the int8 weight replaces the dense one
    got = linear(x).float()
    assert (got - want).abs().max() < 0.02 * want.abs().max()
    linear.row_tile = calibrate_row_tile(linear)
    rows = torch.cat([linear(x[i:i + 1]) for i in range(40)])
    assert torch.equal(linear(x), rows)


@pytest.mark.batch_invariant
def test_int8_engine_keeps_batch_invariance(tiny_checkpoint):
    llm = LLM(checkpoint=tiny_checkpoint, parallel=8, weight_dtype="int8")
    prompts = [f"int8 prompt {i} " + "x " * (3 * i) for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    batched = llm.generate(prompts, params)
    for prompt, got in zip(prompts, batched):
        assert llm.generate([prompt], params)[0].token_ids == got.token_ids
