"""Distil a Qwen3.5 MTP head from its model's own greedy outputs (issue #43 item 4): the head in trainable torch,
fed exactly what conveyor's MTP drafting feeds it (models/mtp.py, runner/mtp_runner.py):

    row q:   x = fc([pre_fc_norm_embedding(embed(x_{q+1})) | pre_fc_norm_hidden(h_q)]);  out_q = norm(layer(x))
    loss:    cross-entropy of lm_head(out_q) against g_{q+1} (the target's greedy token after x_{q+1}), plus
             1 - cos(out_q, h_{q+1}) (out_q stands in for h_{q+1} when drafts chain), and the same for a second,
             chained pass

On a greedy continuation g_{q+1} is x_{q+2} itself; on teacher-forced text (any token sequence prefilled, so every
token id can be covered) it is the target's argmax at q+1, recorded beside the hidden state (Sequence.greedy_ids).

h_q is the target's final-normed hidden state (what ModelRunner hands MTPRunner.record); the embedding and head
are the model's (the same tensor where it ties them), frozen. Names are the Hugging Face checkpoint's mtp.* names,
so `head_weights()` goes into the checkpoint as it is and llama.cpp's converter exports it.
"""

from __future__ import annotations

from dataclasses import dataclass

import conveyor  # noqa: F401  (first: OpenMP's waiters sleep, see docs/kernels.md)
import torch
from torch import nn
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen


@dataclass
class Sequence:
    """One distillation example: prompt + greedy continuation and the target's hidden states along it."""

    token_ids: list[int]  # x_0 .. x_{N-1}
    hiddens: torch.Tensor  # (N-1, H): h_0 .. h_{N-2} (the last token was never fed back)
    num_prompt_tokens: int  # rows whose target x_{q+2} is prompt text, not the model's output, carry no loss
    # Teacher-forced text: the target's argmax at positions 0 .. N-2 (what it would write after x_q), the labels in
    # place of the forced x_{q+2}; None for a greedy continuation (there x_{q+1} is that argmax).
    greedy_ids: list[int] | None = None


class MTPStudent(nn.Module):
    def __init__(self, config: qwen.Qwen3_5TextConfig, embed: torch.Tensor, lm_head: torch.Tensor | None = None,
                 num_real_tokens: int | None = None):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        config._attn_implementation = "sdpa"  # no mask given: sdpa is causal over the window
        full = config.layer_types.index("full_attention")
        self.pre_fc_norm_embedding = qwen.Qwen3_5RMSNorm(hidden, eps)
        self.pre_fc_norm_hidden = qwen.Qwen3_5RMSNorm(hidden, eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = qwen.Qwen3_5DecoderLayer(config, full)
        self.norm = qwen.Qwen3_5RMSNorm(hidden, eps)
        self.rotary = qwen.Qwen3_5TextRotaryEmbedding(config)
        self.register_buffer("embed", embed, persistent=False)  # (V, H), frozen: the model's embedding
        self.register_buffer("lm_head", embed if lm_head is None else lm_head, persistent=False)  # (V, H), frozen
        # NOTE: the loss's softmax runs over the tokenizer's tokens only; padding rows past them (small-norm, never
        # any argmax) would cost 5x the head's work here for nothing the drafts use.
        self.num_real_tokens = num_real_tokens or embed.shape[0]

    def forward(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """token_ids (B, T): x_{q+1}; hidden (B, T, H): h_q; positions (B, T): q -> normed out_q (B, T, H)."""
        embedded = self.pre_fc_norm_embedding(self.embed[token_ids].to(hidden.dtype))  # (B, T, H)
        x = self.fc(torch.cat([embedded, self.pre_fc_norm_hidden(hidden)], dim=-1))  # (B, T, H)
        x = self.layer(x, self.rotary(x, positions), attention_mask=None, position_ids=positions)
        return self.norm(x)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return out @ self.lm_head[:self.num_real_tokens].to(out.dtype).T  # (B, T, V_real)

    def head_weights(self) -> dict[str, torch.Tensor]:
        """The head under the checkpoint's names (mtp.fc, mtp.pre_fc_norm_*, mtp.norm, mtp.layers.0.*)."""
        out = {f"mtp.{name}": w.detach().clone() for name, w in self.state_dict().items()
               if not name.startswith(("layer.", "rotary."))}
        out.update({f"mtp.layers.0.{name}": w.detach().clone() for name, w in self.layer.state_dict().items()})
        return out

    def load_head(self, weights: dict[str, torch.Tensor]) -> None:
        own = {name[len("mtp."):]: w for name, w in weights.items() if not name.startswith("mtp.layers.0.")}
        self.load_state_dict(own, strict=False)
        self.layer.load_state_dict({name[len("mtp.layers.0."):]: w for name, w in weights.items()
                                    if name.startswith("mtp.layers.0.")})


@dataclass
class Batch:
    token_ids: torch.Tensor  # (B, T) x_{q+1}
    hidden: torch.Tensor  # (B, T, H) h_q
    positions: torch.Tensor  # (B, T) q
    labels: torch.Tensor  # (B, T) x_{q+2}, -100 where no loss
    next_hidden: torch.Tensor  # (B, T, H) h_{q+1} (zeros at the last row, which carries no loss then)


def windows(sequences: list[Sequence], length: int) -> Batch:
    """Every sequence's rows q = 0 .. N-3 cut into windows of `length` rows from q = 0 (the head's attention sees
    the rows before q in its window only; windows start at the sequence start so the prompt is context). Hidden
    states keep the sequences' dtype (bf16 as collected: the caller casts a minibatch)."""
    parts: list[tuple] = []
    for seq in sequences:
        ids = torch.tensor(seq.token_ids)
        num_rows = len(seq.token_ids) - 2
        if seq.greedy_ids is None:
            labels = ids[2:].clone()
            labels[:max(0, seq.num_prompt_tokens - 2)] = -100  # x_{q+2} still prompt text
        else:  # row q: the target's own choice after x_{q+1}, not the forced x_{q+2}
            labels = torch.tensor(seq.greedy_ids[1:num_rows + 1])
        h = seq.hiddens
        next_h = torch.cat([h[1:], torch.zeros(1, h.shape[1], dtype=h.dtype)])[:num_rows]
        for start in range(0, num_rows - length + 1, length):
            end = start + length
            parts.append((ids[start + 1:end + 1], h[start:end], torch.arange(start, end), labels[start:end],
                          next_h[start:end]))
    return Batch(*(torch.stack(column) for column in zip(*parts)))


def loss(student: MTPStudent, batch: Batch, chained_weight: float = 0.5,
         temperature: float = 1.0) -> tuple[torch.Tensor, dict]:
    """Cross-entropy on x_{q+2} + (1 - cos(out_q, h_{q+1})), and the same once more chained: the second pass reads
    out_q in place of h_{q+1} and x_{q+2}, as a second draft does."""
    out = student(batch.token_ids, batch.hidden, batch.positions)  # (B, T, H)
    total, stats = _terms(student, out, batch.labels, batch.next_hidden)
    if chained_weight:  # rows at q+1 read (x_{q+2}, out_q) and predict x_{q+3}, regress h_{q+2}
        chained = student(batch.token_ids[:, 1:], out[:, :-1], batch.positions[:, 1:])  # (B, T-1, H)
        more, chained_stats = _terms(student, chained, batch.labels[:, 1:], batch.next_hidden[:, 1:], temperature)
        total = total + chained_weight * more
        stats.update({f"chained_{k}": v for k, v in chained_stats.items()})
    return total, stats


def _terms(student: MTPStudent, out: torch.Tensor, labels: torch.Tensor, next_hidden: torch.Tensor,
           temperature: float = 1.0) -> tuple[torch.Tensor, dict]:
    mask = labels >= 0
    rows = out[mask]  # (R, H)
    logits = student.logits(rows).float()  # (R, V)
    ce = nn.functional.cross_entropy(logits / temperature, labels[mask])
    cos = nn.functional.cosine_similarity(rows.float(), next_hidden[mask].float(), dim=-1).mean()
    accuracy = (logits.argmax(-1) == labels[mask]).float().mean()
    return ce + (1 - cos), {"ce": ce.item(), "cos": cos.item(), "acc": accuracy.item(), "rows": int(mask.sum())}


def as_float(batch: Batch) -> Batch:
    """The batch with float32 hidden states (windows() keeps the collected bf16)."""
    return Batch(batch.token_ids, batch.hidden.float(), batch.positions, batch.labels, batch.next_hidden.float())


@torch.no_grad()
def accuracy(student: MTPStudent, batch: Batch, chunk: int = 4) -> float:
    """First-draft accuracy: argmax(lm_head(out_q)) == the label (x_{q+2} / the target's argmax) where labelled."""
    return draft_accuracy(student, batch, chunk)["first"]


@torch.no_grad()
def draft_accuracy(student: MTPStudent, batch: Batch, chunk: int = 4) -> dict[str, float]:
    """first: the first draft right; second: the chained draft at q+1 (reading x_{q+2} and out_q, as a second
    draft does once the first was right) right; both: both right, the share of rows yielding two accepted drafts."""
    hits = {"first": 0, "second": 0, "both": 0}
    totals = {"first": 0, "second": 0}
    for i in range(0, batch.token_ids.shape[0], chunk):
        part = as_float(Batch(*(t[i:i + chunk] for t in vars(batch).values())))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = student(part.token_ids, part.hidden, part.positions)  # (B, T, H)
            chained = student(part.token_ids[:, 1:], out[:, :-1], part.positions[:, 1:])  # (B, T-1, H)
        first = student.logits(out).argmax(-1) == part.labels  # (B, T)
        second = student.logits(chained).argmax(-1) == part.labels[:, 1:]  # (B, T-1)
        mask, pair = part.labels >= 0, (part.labels[:, :-1] >= 0) & (part.labels[:, 1:] >= 0)
        hits["first"] += int(first[mask].sum())
        hits["second"] += int(second[pair].sum())
        hits["both"] += int((first[:, :-1] & second)[pair].sum())
        totals["first"] += int(mask.sum())
        totals["second"] += int(pair.sum())
    return {"first": hits["first"] / max(totals["first"], 1), "second": hits["second"] / max(totals["second"], 1),
            "both": hits["both"] / max(totals["second"], 1), "rows": totals["first"]}
