"""The DFlash drafter (models/dflash.py, runner/dflash_runner.py) against a plain-torch reference written from
z-lab's published dflash/model.py (float32): the context is transformers' `hidden_states[L + 1]` for each target
layer L, fused as hidden_norm(fc(.)); each layer's queries are the block's, its keys and values k_proj / v_proj of
[context | block] (per-head q_norm / k_norm, then the rotary), attention unmasked; logits are the target's LM head
on norm(out) at the block's mask rows. A second request's block in the same forward checks rows stay apart.
"""

import json
from types import SimpleNamespace

import pytest
import torch
from hf_compare import BLOCK, float32_runner
from safetensors.torch import load_file

from conveyor.engine.outputs import DraftRequest, ScheduledChunk, SchedulerOutput
from conveyor.engine.sampling_params import SamplingParams
from conveyor.loading.checkpoint import select_weights
from conveyor.models import dflash
from conveyor.models.config import ModelConfig
from conveyor.models.weights import WeightLoader
from conveyor.runner.dflash_runner import DFlashRunner
from conveyor.runner.model_runner import ModelRunner
from conveyor.testing import write_tiny_dflash

transformers = pytest.importorskip("transformers")

LAYER_IDS = [0, 2]
GREEDY = SamplingParams(temperature=0)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x (N, heads, D) at positions (N,): rotate_half, as Qwen3's rotary."""
    d = x.shape[-1]
    freqs = positions[:, None].float() / theta ** (torch.arange(0, d, 2).float() / d)  # (N, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], dim=-1)
    return x * emb.cos() + half * emb.sin()


def _reference(raw: dict, t: dict, context: torch.Tensor, noise: torch.Tensor, start: int) -> torch.Tensor:
    """DFlashDraftModel.forward: context (P, nH) target features at 0..P-1, noise (B, H) the block's embeddings
    at start..start+B-1 -> norm(out) (B, H). (P == start: every earlier position is context.)"""
    eps, theta, d = raw["rms_norm_eps"], raw["rope_theta"], raw["head_dim"]
    heads, kv_heads = raw["num_attention_heads"], raw["num_key_value_heads"]
    ctx = _rms(context @ t["fc.weight"].T, t["hidden_norm.weight"], eps)
    positions = torch.arange(start + noise.shape[0])
    h = noise
    for i in range(raw["num_hidden_layers"]):
        p = f"layers.{i}."
        x = _rms(h, t[p + "input_layernorm.weight"], eps)
        both = torch.cat([ctx, x])
        q = _rms((x @ t[p + "self_attn.q_proj.weight"].T).view(-1, heads, d), t[p + "self_attn.q_norm.weight"], eps)
        k = _rms((both @ t[p + "self_attn.k_proj.weight"].T).view(-1, kv_heads, d), t[p + "self_attn.k_norm.weight"],
                 eps)
        v = (both @ t[p + "self_attn.v_proj.weight"].T).view(-1, kv_heads, d)
        q, k = _rope(q, positions[start:], theta), _rope(k, positions, theta)
        k, v = (z.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1) for z in (k, v))  # (heads, N, D)
        attn = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None])[0]
        h = h + attn.transpose(0, 1).reshape(x.shape[0], -1) @ t[p + "self_attn.o_proj.weight"].T
        y = _rms(h, t[p + "post_attention_layernorm.weight"], eps)
        gate, up = y @ t[p + "mlp.gate_proj.weight"].T, y @ t[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ t[p + "mlp.down_proj.weight"].T
    return _rms(h, t["norm.weight"], eps)


def test_block_logits_match_the_reference(tmp_path):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)).eval()
    hf.save_pretrained(tmp_path / "target")
    config = ModelConfig.from_hf_dict(json.loads((tmp_path / "target" / "config.json").read_text()))
    target = float32_runner(config, select_weights(config, load_file(tmp_path / "target" / "model.safetensors"),
                                                   str(tmp_path / "target")))
    path = write_tiny_dflash(tmp_path / "drafter", SimpleNamespace(config=config), seed=2, block_size=5,
                             target_layer_ids=LAYER_IDS)
    raw = json.loads((tmp_path / "drafter" / "config.json").read_text())
    tensors = load_file(f"{path}/model.safetensors")
    spec = dflash.DFlashConfig.from_hf_dict(raw)
    assert (spec.block_size, spec.mask_token_id, spec.target_layer_ids) == (5, 127, tuple(LAYER_IDS))
    head = dflash.DFlashHead(spec, spec.target_layer_ids, config, target.model.ops, target.model)
    head.load_weights(dflash.checkpoint_names(tensors),
                      WeightLoader(target.model.ops, torch.float32, torch.device("cpu"), "auto", lambda t: None))
    drafter = DFlashRunner(ModelRunner(head, config, num_blocks=32, block_size=BLOCK, dtype=torch.float32,
                                       device=torch.device("cpu"), ops=head.ops))
    target.drafter = drafter

    gen = torch.Generator().manual_seed(3)
    a, b = (torch.randint(0, 120, (n,), generator=gen).tolist() for n in (11, 6))
    tables = {"a": [3, 1, 7, 5], "b": [9, 2, 11]}
    # The target's prefill of both prompts but their last tokens hands the drafter its context ...
    target.forward(SchedulerOutput(chunks=[ScheduledChunk("a", a[:-1], 0, tables["a"], True, GREEDY),
                                           ScheduledChunk("b", b[:-1], 0, tables["b"], True, GREEDY)]))
    # ... and both blocks [x_p, MASK x k] run in one drafter forward.
    steps = [ScheduledChunk(rid, ids[-1:] + [spec.mask_token_id] * k, len(ids) - 1, tables[rid], True, GREEDY,
                            num_draft_tokens=k) for rid, ids, k in (("a", a, 4), ("b", b, 2))]
    got = drafter.block_logits(steps)
    assert got.shape == (6, config.vocab_size)
    want = []
    with torch.no_grad():
        for ids, k in ((a, 4), (b, 2)):
            streams = hf.model(torch.tensor([ids[:-1]]), output_hidden_states=True).hidden_states
            context = torch.cat([streams[i + 1][0] for i in LAYER_IDS], dim=-1)  # the reference's offset 1
            noise = hf.model.embed_tokens(torch.tensor(ids[-1:] + [spec.mask_token_id] * k))
            out = _reference(raw, tensors, context, noise, len(ids) - 1)
            want.append(out[1:] @ hf.lm_head.weight.T)
    torch.testing.assert_close(got, torch.cat(want), atol=1e-4, rtol=1e-4)
    # propose() drafts the argmax of each mask row (block sizes capped by the drafter's: 4 drafts at most)
    chunks = [ScheduledChunk(s.request_id, s.token_ids[:1], s.start_position, s.block_table, True, GREEDY,
                             draft=DraftRequest(k, (), 0)) for s, k in zip(steps, (9, 2))]
    proposals = drafter.propose(chunks)
    assert proposals["a"].token_ids == torch.cat(want)[:4].argmax(-1).tolist()
    assert proposals["b"].token_ids == torch.cat(want)[4:].argmax(-1).tolist()
