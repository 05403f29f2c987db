"""The target's forward with an EAGLE3 drafter recording: its logits bitwise the plain forward's (the aux streams
are taken on the side), and what the drafter keeps per request is its fc over the streams entering its layers."""

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from conveyor.engine.outputs import ScheduledChunk, SchedulerOutput
from conveyor.engine.sampling_params import SamplingParams
from conveyor.kernels import resolve_backend
from conveyor.models import eagle3
from conveyor.models.registry import build_model
from conveyor.models.weights import WeightLoader
from conveyor.runner.model_runner import ModelRunner
from conveyor.runner.mtp_runner import Eagle3Runner
from conveyor.testing import tiny_checkpoint, write_tiny_eagle3

pytestmark = pytest.mark.batch_invariant

CPU = torch.device("cpu")


def _runner(model, config, drafter=None) -> ModelRunner:
    return ModelRunner(model, config, num_blocks=16, block_size=4, dtype=torch.bfloat16, device=CPU, ops=model.ops,
                       drafter=drafter)


def test_recording_forward_is_the_plain_forward_bitwise(tmp_path):
    target = tiny_checkpoint(0, num_hidden_layers=6)
    config = target.config
    ops = resolve_backend(CPU, torch.bfloat16)
    model = build_model(config, target.weights, torch.bfloat16, CPU, ops=ops)
    path = write_tiny_eagle3(tmp_path, SimpleNamespace(config=config, weights={}), aux_layer_ids=[1, 3, 6])
    spec = eagle3.Eagle3Config.from_hf_dict(json.loads((tmp_path / "config.json").read_text()))
    head = eagle3.Eagle3Head(spec, (1, 3, 6), config, ops, model)
    head.load_weights(eagle3.checkpoint_names(load_file(f"{path}/model.safetensors")),
                      WeightLoader(ops, torch.bfloat16, CPU))
    drafter = Eagle3Runner(_runner(head, config))
    plain, recording = _runner(model, config), _runner(model, config, drafter)

    greedy = SamplingParams(temperature=0)
    chunks = [ScheduledChunk("a", list(range(5, 16)), 0, [0, 1, 2], True, greedy),
              ScheduledChunk("b", list(range(40, 47)), 0, [3, 4], True, greedy)]
    want, _ = plain.forward(SchedulerOutput(chunks=chunks))
    got, inputs = recording.forward(SchedulerOutput(chunks=chunks))
    assert torch.equal(got, want)

    # What waits for request "b": fc over its rows' streams into layers 1, 3 and the final norm's input.
    hidden, aux = model.aux_hidden_states(inputs.input_ids, inputs.positions, plain.kv_caches, inputs.meta,
                                          inputs.logits_indices, (1, 3, 6))
    assert torch.equal(model.compute_logits(hidden), want)
    assert aux.shape == (18, 3 * config.hidden_size)
    assert torch.equal(drafter._pending["b"].hiddens, head.fuse(aux)[11:])
    assert drafter._pending["b"].token_ids == list(range(40, 47))
    # The stream into layer 0 is the embedding.
    _, first = model.aux_hidden_states(inputs.input_ids, inputs.positions, plain.kv_caches, inputs.meta,
                                       inputs.logits_indices, (0, 0, 0))
    assert torch.equal(first[:, :config.hidden_size], model.embed_tokens(inputs.input_ids))
