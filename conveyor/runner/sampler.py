"""Batched token sampling: one pass over the (rows, vocab) logits for every rule at once.

Per-request RNG (a torch.Generator per seeded request) makes a seeded request's draws
independent of its batch-mates; the draw itself is an exponential race (argmax p/q,
q ~ Exp(1)), which needs no normalisation and no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.engine.outputs import TokenLogprob
from conveyor.engine.sampling_params import SamplingParams
from conveyor.kernels import KernelBackend


@dataclass
class SamplingRow:
    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, ops: KernelBackend, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.ops = ops
        self.device = device
        self._shared_generator = torch.Generator(device=device).manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._generators.pop(request_id, None)

    # A seeded request handed to another engine (KV handoff) carries its generator's state along.
    def generator_state(self, request_id: str) -> bytes | None:
        generator = self._generators.get(request_id)
        return bytes(generator.get_state().numpy().tobytes()) if generator is not None else None

    def set_generator_state(self, request_id: str, state: bytes) -> None:
        generator = torch.Generator(device=self.device)
        generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        self._generators[request_id] = generator

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits (R, V) float32 -> one token id per row (+ logprobs where asked)."""
        raw_logits = logits
        logits = self._apply_bias_and_penalties(logits, rows)
        params = [r.params for r in rows]
        greedy = torch.tensor([p.greedy for p in params], device=self.device)
        tokens = self.ops.argmax(logits)
        if not bool(greedy.all()):
            tokens = torch.where(greedy, tokens, self._sample_random(logits, rows))
        token_list = tokens.tolist()
        return token_list, self._logprobs(raw_logits, token_list, params)

    # -- logits processing -------------------------------------------------------------------
    def _apply_bias_and_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        biased = [i for i, r in enumerate(rows) if r.params.logit_bias]
        penalized = [i for i, r in enumerate(rows) if r.output_token_ids is not None]
        if not biased and not penalized:
            return logits
        logits = logits.clone()
        for i in biased:  # sparse, few entries per row
            ids = torch.tensor(list(rows[i].params.logit_bias), device=self.device)
            values = torch.tensor(list(rows[i].params.logit_bias.values()), device=self.device, dtype=logits.dtype)
            logits[i].index_add_(0, ids, values)
        if penalized:
            self._apply_penalties(logits, [rows[i] for i in penalized], torch.tensor(penalized, device=self.device))
        return logits

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow], index: torch.Tensor) -> None:
        n, vocab = len(rows), self.vocab_size
        out_counts = torch.zeros(n, vocab, device=self.device)
        seen = torch.zeros(n, vocab, dtype=torch.bool, device=self.device)
        for j, row in enumerate(rows):
            if row.output_token_ids:
                ids = torch.tensor(row.output_token_ids, device=self.device)
                out_counts[j].index_add_(0, ids, torch.ones(len(ids), device=self.device))
            seen[j, torch.tensor(row.prompt_token_ids or [], dtype=torch.long, device=self.device)] = True
        seen |= out_counts > 0
        rep = torch.tensor([r.params.repetition_penalty for r in rows], device=self.device)[:, None]
        presence = torch.tensor([r.params.presence_penalty for r in rows], device=self.device)[:, None]
        frequency = torch.tensor([r.params.frequency_penalty for r in rows], device=self.device)[:, None]
        sub = logits[index]
        # Repetition penalty as in transformers/vLLM: shrink positive logits, grow negative ones.
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - frequency * out_counts - presence * (out_counts > 0).float()
        logits[index] = sub

    # -- random draws ------------------------------------------------------------------------
    def _sample_random(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        probs = self.probabilities(logits, [r.params for r in rows])
        noise = torch.empty_like(probs)
        for i, row in enumerate(rows):
            noise[i].exponential_(generator=self._generator_for(row))
        return (probs / noise).argmax(dim=-1)

    def processed_probabilities(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """(R, V) logits -> the distribution each row's sampled token is drawn from (bias, penalties,
        temperature, top-k/top-p/min-p applied), for speculative rejection sampling."""
        return self.probabilities(self._apply_bias_and_penalties(logits, rows), [r.params for r in rows])

    def generator_for(self, row: SamplingRow) -> torch.Generator:
        return self._generator_for(row)

    def probabilities(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params],
                                   device=self.device)[:, None]
        logits = logits / temperature
        logits = self._top_k_top_p(logits, params)
        min_p = torch.tensor([p.min_p for p in params], device=self.device)[:, None]
        if bool((min_p > 0).any()):
            rel = torch.exp(logits - logits.max(dim=-1, keepdim=True).values)  # p / p_max
            logits = logits.masked_fill(rel < min_p, float("-inf"))
        return torch.softmax(logits, dim=-1)

    def _generator_for(self, row: SamplingRow) -> torch.Generator:
        seed = row.params.seed
        if seed is None:
            return self._shared_generator
        generator = self._generators.get(row.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
            self._generators[row.request_id] = generator
        return generator

    def _top_k_top_p(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        top_k = [min(p.top_k, self.vocab_size) if p.top_k > 0 else self.vocab_size for p in params]  # no int64 overflow
        top_p = [p.top_p for p in params]
        if all(k >= self.vocab_size for k in top_k) and all(p >= 1.0 for p in top_p):
            return logits
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[-1], device=self.device)[None, :]
        drop = ranks >= torch.tensor(top_k, device=self.device)[:, None]
        sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= mass_before >= torch.tensor(top_p, device=self.device)[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(-1, order, sorted_logits)

    # -- logprobs ----------------------------------------------------------------------------
    def _logprobs(self, logits: torch.Tensor, tokens: list[int],
                  params: list[SamplingParams]) -> list[TokenLogprob | None]:
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        result: list[TokenLogprob | None] = [None] * len(params)
        if not wanted:
            return result
        logprobs = torch.log_softmax(logits[wanted], dim=-1)
        chosen = logprobs.gather(1, torch.tensor([[tokens[i]] for i in wanted], device=self.device))
        chosen_list = chosen[:, 0].tolist()
        for j, i in enumerate(wanted):
            result[i] = TokenLogprob(tokens[i], chosen_list[j], _alternatives(logprobs[j], params[i].logprobs))
        return result


_TIE_SLACK = 8  # candidates beyond k that topk returns, so a tie at the k-th value is usually seen whole


def _alternatives(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """A row's k best (token id, logprob), ties in token-id order.

    NOTE: bf16 logits tie often, and topk orders ties by whatever k it was asked for, so the
    alternatives would depend on the other rows of the batch; every token at or above the k-th
    value, in id order, then sorted stably by value, does not.
    """
    if k == 0:
        return []
    num = min(k + _TIE_SLACK, logprobs.numel())
    values, ids = logprobs.topk(num)
    threshold = values[k - 1]
    if num < logprobs.numel() and values[-1] >= threshold:  # the tie runs past what topk returned
        ids = (logprobs >= threshold).nonzero()[:, 0]
    else:
        ids = ids[values >= threshold].sort().values
    order = ids[logprobs[ids].sort(descending=True, stable=True).indices[:k]]
    return list(zip(order.tolist(), logprobs[order].tolist()))
