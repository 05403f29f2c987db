"""The EAGLE3 drafter (models/eagle3.py, runner/mtp_runner.py's Eagle3Runner) against a reference built from
transformers pieces (float32), wired as vLLM's llama_eagle3.py: the target's aux hidden states are transformers'
`hidden_states[L]` (the stream entering layer L), g = fc([a_0 | a_2 | a_3]); the layer is transformers'
LlamaAttention with q/k/v reading 2H, LlamaMLP and LlamaRMSNorms, its rotary LlamaRotaryEmbedding; logits are
lm_head(norm(out)) over a 64-token draft vocabulary placed by d2t, and the second draft chains on `out`.
"""

import json
from types import SimpleNamespace

import pytest
import torch
from hf_compare import BLOCK, float32_runner
from safetensors.torch import load_file
from torch import nn

from conveyor.engine.outputs import ScheduledChunk, SchedulerOutput
from conveyor.engine.sampling_params import SamplingParams
from conveyor.loading.checkpoint import select_weights
from conveyor.models import eagle3
from conveyor.models.config import ModelConfig
from conveyor.models.weights import WeightLoader
from conveyor.runner.model_runner import ModelRunner
from conveyor.runner.mtp_runner import Eagle3Runner
from conveyor.testing import write_tiny_eagle3

transformers = pytest.importorskip("transformers")
from transformers.models.llama import modeling_llama as hf_llama  # noqa: E402

AUX = [0, 2, 3]


def _reference_layer(raw: dict, tensors: dict) -> tuple:
    """The drafter's pieces from transformers, loaded from the checkpoint's tensors."""
    cfg = transformers.LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    cfg._attn_implementation = "eager"
    h = cfg.hidden_size
    attn = hf_llama.LlamaAttention(cfg, 0)
    for name in "qkv":  # EAGLE3's attention reads [embedding | hidden]
        proj = getattr(attn, f"{name}_proj")
        setattr(attn, f"{name}_proj", nn.Linear(2 * h, proj.out_features, bias=False))
    layer = {"attn": attn, "mlp": hf_llama.LlamaMLP(cfg)}
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm", "norm"):
        layer[name] = hf_llama.LlamaRMSNorm(h, cfg.rms_norm_eps)
    state = {n[len("midlayer."):]: w for n, w in tensors.items() if n.startswith("midlayer.")}
    for name, module in layer.items():
        prefix = "self_attn." if name == "attn" else f"{name}." if name != "norm" else None
        if prefix is None:
            module.load_state_dict({"weight": tensors["norm.weight"]})
        else:
            module.load_state_dict({k[len(prefix):]: w for k, w in state.items() if k.startswith(prefix)})
    return cfg, layer


def _reference(hf, raw: dict, tensors: dict, ids: list[int], chained: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(g_0..g_{P-1}, the drafter's target-vocabulary logits at positions 0..P) for tokens x_0..x_P, the row at P
    reading the draft `chained` with the previous row's output as its hidden state."""
    cfg, layer = _reference_layer(raw, tensors)
    with torch.no_grad():
        streams = hf.model(torch.tensor([ids[:-1]]), output_hidden_states=True).hidden_states
        g = torch.cat([streams[i][0] for i in AUX], dim=-1) @ tensors["fc.weight"].T  # (P, H)
        tokens = torch.tensor(ids[1:] + [chained])
        rows, hidden = [], g
        for step in range(2):  # the P target rows, then the chained row on the last output
            n = hidden.shape[0]
            x = torch.cat([layer["input_layernorm"](hf.model.embed_tokens(tokens[:n])),
                           layer["hidden_norm"](hidden)], dim=-1)[None]  # (1, n, 2H)
            rope = hf_llama.LlamaRotaryEmbedding(cfg)(x, torch.arange(n)[None])
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            attn, _ = layer["attn"](x, rope, mask)
            residual = hidden + attn[0]
            out = residual + layer["mlp"](layer["post_attention_layernorm"](residual))
            rows.append(out[-1])
            hidden = torch.cat([g, out[-1:]])
        draft = layer["norm"](torch.stack(rows)) @ tensors["lm_head.weight"].T  # (2, draft_vocab)
        vocab = torch.arange(draft.shape[1]) + tensors["d2t"]
        logits = torch.full((2, hf.config.vocab_size), float("-inf"))
        logits[:, vocab] = draft
        return g, logits


def test_drafter_logits_match_the_reference(tmp_path):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)).eval()
    hf.save_pretrained(tmp_path / "target")
    config = ModelConfig.from_hf_dict(json.loads((tmp_path / "target" / "config.json").read_text()))
    target = float32_runner(config, select_weights(config, load_file(tmp_path / "target" / "model.safetensors"),
                                                   str(tmp_path / "target")))
    path = write_tiny_eagle3(tmp_path / "drafter", SimpleNamespace(config=config, weights={}), seed=2,
                             draft_vocab_size=64, aux_layer_ids=AUX)
    raw = json.loads((tmp_path / "drafter" / "config.json").read_text())
    tensors = load_file(f"{path}/model.safetensors")

    spec = eagle3.Eagle3Config.from_hf_dict(raw)
    head = eagle3.Eagle3Head(spec, tuple(AUX), config, target.model.ops, target.model)
    head.load_weights(eagle3.checkpoint_names(tensors),
                      WeightLoader(target.model.ops, torch.float32, torch.device("cpu"), "auto", lambda t: None))
    drafter = Eagle3Runner(ModelRunner(head, config, num_blocks=32, block_size=BLOCK, dtype=torch.float32,
                                       device=torch.device("cpu"), ops=head.ops))
    target.drafter = drafter

    ids = torch.randint(0, config.vocab_size, (14,), generator=torch.Generator().manual_seed(3)).tolist()
    table = [3, 1, 7, 5]
    # The target's prefill of x_0..x_{P-1} hands its fused aux hidden states to the drafter ...
    target.forward(SchedulerOutput(chunks=[ScheduledChunk("r", ids[:-1], 0, table, True,
                                                          SamplingParams(temperature=0))]))
    pending = drafter._pending["r"]
    # ... which reads them with the tokens after each (the first draft), then chains on its own output.
    step = ScheduledChunk("r", ids[1:], 0, table, True, SamplingParams(temperature=0))
    first = drafter._forward([step], pending.hiddens)
    d1 = int(head.compute_logits(first)[0].argmax())
    second = drafter._forward([ScheduledChunk("r", [d1], len(ids) - 1, table, True, SamplingParams(temperature=0))],
                              first)
    want_g, want_logits = _reference(hf, raw, tensors, ids, d1)
    torch.testing.assert_close(pending.hiddens, want_g, atol=1e-5, rtol=1e-5)
    got = head.compute_logits(torch.cat([first, second]))
    assert torch.equal(torch.isinf(got), torch.isinf(want_logits))  # the draft vocabulary's places, by d2t
    torch.testing.assert_close(got, want_logits, atol=1e-4, rtol=1e-4)
