"""The MTP head (models/mtp.py, runner/mtp_runner.py) against a reference built from transformers (float32).

transformers has no MTP for Qwen3.5 (it drops mtp.* at load), so the reference is wired as vLLM's
qwen3_next_mtp.py: x = fc([pre_fc_norm_embedding(embed(x_{q+1})) | pre_fc_norm_hidden(h_q)]) with h the target's
final-normed hidden state, then the head's layer and norm as a one-layer transformers Qwen3.5 fed x as its input
embeddings (positions q), then the target's lm_head.
"""

import json

import pytest
import tokenizers
import torch
from hf_compare import BLOCK, float32_runner
from safetensors.torch import load_file, save_file
from test_hybrid_vs_hf import hf_hybrid

from conveyor.engine.llm import LLM
from conveyor.engine.outputs import ScheduledChunk, SchedulerOutput
from conveyor.engine.sampling_params import SamplingParams
from conveyor.loading import load_checkpoint
from conveyor.loading.checkpoint import select_weights
from conveyor.models import mtp
from conveyor.models.config import ModelConfig
from conveyor.models.weights import WeightLoader
from conveyor.runner.model_runner import ModelRunner
from conveyor.runner.mtp_runner import MTPRunner
from conveyor.testing import random_mtp_weights

transformers = pytest.importorskip("transformers")


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's RMSNorm: x / rms(x) * (1 + w)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def _reference(hf, head: dict, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the target's hidden states h_0..h_{P-1}, the head's logits at positions 0..P-1) for tokens x_0..x_P."""
    cfg = hf.config
    one = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(
        **{**cfg.to_dict(), "num_hidden_layers": 1, "layer_types": ["full_attention"]})).eval()
    state = {f"model.layers.0.{n[len('mtp.layers.0.'):]}": w for n, w in head.items() if n.startswith("mtp.layers.0.")}
    state.update({"model.norm.weight": head["mtp.norm.weight"], "lm_head.weight": hf.lm_head.weight,
                  "model.embed_tokens.weight": hf.model.embed_tokens.weight})
    one.load_state_dict(state)
    with torch.no_grad():
        hidden = hf.model(torch.tensor([ids[:-1]])).last_hidden_state[0]  # (P, H), after the final norm
        embedded = hf.model.embed_tokens(torch.tensor(ids[1:]))  # (P, H): x_{q+1}
        x = torch.cat([_norm(embedded, head["mtp.pre_fc_norm_embedding.weight"], cfg.rms_norm_eps),
                       _norm(hidden, head["mtp.pre_fc_norm_hidden.weight"], cfg.rms_norm_eps)], dim=-1)
        x = x @ head["mtp.fc.weight"].T  # (P, H)
        return hidden, one(inputs_embeds=x[None]).logits[0]


def test_head_logits_match_the_reference(tmp_path):
    hf = hf_hybrid("qwen3_5")
    hf.save_pretrained(tmp_path)
    config = ModelConfig.from_hf_dict(json.loads((tmp_path / "config.json").read_text()))
    target = float32_runner(config, select_weights(config, load_file(tmp_path / "model.safetensors"), str(tmp_path)))
    head = random_mtp_weights(config, scale=0.3)
    model = mtp.MTPHead(config, target.model.ops, target.model)
    model.load_weights(mtp.layer_weights(config, head),
                       WeightLoader(target.model.ops, torch.float32, torch.device("cpu"), "auto", lambda t: None))
    drafter = MTPRunner(ModelRunner(model, config, num_blocks=32, block_size=BLOCK, dtype=torch.float32,
                                    device=torch.device("cpu"), ops=model.ops))
    target.drafter = drafter

    ids = torch.randint(0, config.vocab_size, (14,), generator=torch.Generator().manual_seed(3)).tolist()
    want_hidden, want_logits = _reference(hf, head, ids)
    table = [3, 1, 7, 5]
    # The target's prefill of x_0..x_{P-1} hands its hidden states to the drafter ...
    prefill = ScheduledChunk("r", ids[:-1], 0, table, True, SamplingParams(temperature=0), state_slot=0)
    target.forward(SchedulerOutput(chunks=[prefill]))
    pending = drafter._pending["r"]
    torch.testing.assert_close(pending.hiddens, want_hidden, atol=1e-5, rtol=1e-5)
    # ... and the head reads them with the tokens after each: its last row's logits give the first draft.
    step = ScheduledChunk("r", ids[1:], 0, table, True, SamplingParams(temperature=0))
    last = drafter._forward([step], pending.hiddens)
    torch.testing.assert_close(model.compute_logits(last)[0], want_logits[-1], atol=1e-4, rtol=1e-4)
    # A second pass over the first rows reads the head's own K/V of the positions before them.
    step = ScheduledChunk("r", ids[1:9], 0, table, True, SamplingParams(temperature=0))
    last = drafter._forward([step], pending.hiddens[:8])
    torch.testing.assert_close(model.compute_logits(last)[0], want_logits[7], atol=1e-4, rtol=1e-4)


@pytest.mark.batch_invariant
def test_an_hf_directory_drafts_with_its_own_head(tmp_path):
    """A Qwen3.5 directory as the Hub ships one, mtp.* beside the model in model.safetensors: the loader keeps the
    head aside, --draft-kind mtp drafts with it, and greedy output is plain decoding's."""
    hf = hf_hybrid("qwen3_5")
    hf.save_pretrained(tmp_path)
    config = ModelConfig.from_hf_dict(json.loads((tmp_path / "config.json").read_text()))
    head = random_mtp_weights(config)
    weights = load_file(tmp_path / "model.safetensors")
    save_file({**weights, **{name: w.contiguous() for name, w in head.items()}}, tmp_path / "model.safetensors")
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(128)}, unk_token="t0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))

    checkpoint = load_checkpoint(str(tmp_path))
    assert set(checkpoint.mtp_weights) == set(head) and not any(n.startswith("mtp.") for n in checkpoint.weights)
    prompts = [" ".join(f"t{(7 * i + j) % 128}" for j in range(5 + 3 * i)) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = [o.token_ids for o in LLM(checkpoint=checkpoint, parallel=4, speculative_ngram=0).generate(prompts, params)]
    spec = LLM(checkpoint=checkpoint, parallel=4, draft_kind="mtp", draft_policy="enable", speculative_max_rows=64)
    assert [o.token_ids for o in spec.generate(prompts, params)] == want
    assert spec.engine.scheduler.stats.num_model_draft_tokens > 0
    spec.engine.kv.check_integrity()
