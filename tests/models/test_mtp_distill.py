"""benchmarks/mtp_distill.py (the MTP head trained by distillation, issue #43 item 4) computes what conveyor's MTP
drafting computes with the same weights: the trained head is only worth its acceptance if the head conveyor loads
from `head_weights()` is the function that was trained."""

import json
import sys
from pathlib import Path

import pytest
import torch
from hf_compare import BLOCK, float32_runner
from safetensors.torch import load_file
from test_hybrid_vs_hf import hf_hybrid

from conveyor.engine.outputs import ScheduledChunk, SchedulerOutput
from conveyor.engine.sampling_params import SamplingParams
from conveyor.loading.checkpoint import select_weights
from conveyor.models import mtp
from conveyor.models.config import ModelConfig
from conveyor.models.weights import WeightLoader
from conveyor.runner.model_runner import ModelRunner
from conveyor.runner.mtp_runner import MTPRunner

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from mtp_distill import MTPStudent, Sequence, draft_accuracy, loss, windows  # noqa: E402
from mtp_trained import forced_token_ids  # noqa: E402


def _student(hf) -> MTPStudent:
    torch.manual_seed(0)
    student = MTPStudent(hf.config, hf.model.embed_tokens.weight.detach(), hf.lm_head.weight.detach())
    with torch.no_grad():  # norms off their init, so a swapped norm or concat order shows
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            getattr(student, name).weight.normal_(0, 0.3)
        student.fc.weight.normal_(0, 0.1)
    return student


def test_trained_head_is_the_head_conveyor_drafts_with(tmp_path):
    hf = hf_hybrid("qwen3_5")
    hf.save_pretrained(tmp_path)
    config = ModelConfig.from_hf_dict(json.loads((tmp_path / "config.json").read_text()))
    target = float32_runner(config, select_weights(config, load_file(tmp_path / "model.safetensors"), str(tmp_path)))
    student = _student(hf)
    head = mtp.MTPHead(config, target.model.ops, target.model)
    head.load_weights(mtp.layer_weights(config, student.head_weights()),
                      WeightLoader(target.model.ops, torch.float32, torch.device("cpu"), "auto", lambda t: None))
    drafter = MTPRunner(ModelRunner(head, config, num_blocks=32, block_size=BLOCK, dtype=torch.float32,
                                    device=torch.device("cpu"), ops=head.ops))
    target.drafter = drafter

    ids = torch.randint(0, config.vocab_size, (14,), generator=torch.Generator().manual_seed(3)).tolist()
    table = [3, 1, 7, 5]
    target.forward(SchedulerOutput(chunks=[ScheduledChunk("r", ids[:-1], 0, table, True,
                                                          SamplingParams(temperature=0), state_slot=0)]))
    hidden = drafter._pending["r"].hiddens  # (P, H): what record() keeps, the rows the student trains on
    with torch.no_grad():
        want = student(torch.tensor([ids[1:]]), hidden[None], torch.arange(len(ids) - 1)[None])[0]  # (P, H)
    for rows in (len(ids) - 1, 6):  # every row, and a prefix (the head's own K/V of earlier rows)
        got = drafter._forward([ScheduledChunk("r", ids[1:rows + 1], 0, table, True, SamplingParams(temperature=0))],
                               hidden[:rows])
        torch.testing.assert_close(got[0], want[rows - 1], atol=1e-4, rtol=1e-4)
        assert head.compute_logits(got).argmax() == student.logits(want[rows - 1]).argmax()


def test_windows_label_only_the_models_own_tokens_and_training_lowers_the_loss():
    hf = hf_hybrid("qwen3_5")
    student = _student(hf)
    gen = torch.Generator().manual_seed(1)
    vocab, hidden = hf.config.vocab_size, hf.config.hidden_size
    # The "model" here repeats a fixed successor map, so x_{q+2} is learnable from x_{q+1}.
    succ = torch.randperm(vocab, generator=gen)
    seqs = []
    for i in range(6):
        ids = [i]
        for _ in range(21):
            ids.append(int(succ[ids[-1]]))
        seqs.append(Sequence(ids, torch.randn(len(ids) - 1, hidden, generator=gen), num_prompt_tokens=5))
    batch = windows(seqs, 20)
    assert batch.token_ids.shape == (6, 20)
    assert (batch.labels[:, :3] == -100).all() and (batch.labels[:, 3:] >= 0).all()  # x_{q+2} prompt for q < 3
    assert batch.labels[0, 3] == seqs[0].token_ids[5] and batch.token_ids[0, 0] == seqs[0].token_ids[1]
    optimizer = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=1e-2)
    first = loss(student, batch)[1]
    for _ in range(30):
        total, _ = loss(student, batch)
        optimizer.zero_grad()
        total.backward()
        optimizer.step()
    last = loss(student, batch)[1]
    assert last["ce"] < first["ce"] and last["acc"] > first["acc"] + 0.5, (first, last)


def test_forced_windows_label_the_models_argmax_not_the_forced_text():
    """Teacher-forced text (collect-forced) carries the target's argmax per position: row q's label is the argmax
    at q+1 (what the model writes after x_{q+1}), never the forced x_{q+2}; such windows mix with greedy ones."""
    hf = hf_hybrid("qwen3_5")
    student = _student(hf)
    gen = torch.Generator().manual_seed(2)
    vocab, hidden = hf.config.vocab_size, hf.config.hidden_size
    succ = torch.randperm(vocab, generator=gen)  # the "model" writes succ[x] after x, whatever the context
    forced = []
    for _ in range(6):
        ids = torch.randint(0, vocab, (22,), generator=gen).tolist()  # forced text: random, not succ's chain
        forced.append(Sequence(ids, torch.randn(21, hidden, generator=gen).bfloat16(), 0,
                               [int(succ[t]) for t in ids[:-1]]))
    greedy = [Sequence([i] + [0] * 21, torch.randn(21, hidden, generator=gen).bfloat16(), 5) for i in range(2)]
    batch = windows(greedy + forced, 20)
    assert batch.hidden.dtype == torch.bfloat16  # kept as collected; as_float() casts a minibatch
    assert (batch.labels[2:] >= 0).all()  # every forced row labelled, prompt or not
    for row, seq in enumerate(forced, start=2):
        assert batch.labels[row].tolist() == [int(succ[t]) for t in seq.token_ids[1:21]]
        assert batch.token_ids[row].tolist() == seq.token_ids[1:21]
    batch.hidden, batch.next_hidden = batch.hidden.float(), batch.next_hidden.float()
    forced_part = type(batch)(*(t[2:] for t in vars(batch).values()))
    before = draft_accuracy(student, forced_part)
    optimizer = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(30):
        total, _ = loss(student, forced_part)
        optimizer.zero_grad()
        total.backward()
        optimizer.step()
    after = draft_accuracy(student, forced_part)
    assert after["first"] > before["first"] + 0.5 and after["second"] > before["second"] + 0.5, (before, after)
    assert after["both"] <= min(after["first"], after["second"]) and after["rows"] == 6 * 20


def test_forced_token_ids_cover_every_real_id_but_the_skipped():
    windows_ = forced_token_ids(100, {0, 1}, num_sequences=10, length=25)
    assert [len(w) for w in windows_] == [25] * 10
    flat = [t for w in windows_ for t in w]
    assert set(flat) == set(range(2, 100))  # 250 tokens: every id of the 98 at least twice
    assert min(flat.count(t) for t in range(2, 100)) >= 2
