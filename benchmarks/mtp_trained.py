"""The trained-head MTP benchmark (issue #43 item 4): a Qwen3.5-0.8B-shaped model with random base weights and an
MTP head distilled here on CPU from the model's own greedy outputs, so acceptance is what a trained head gives.

Stages (each writes under --dir, default /tmp/mtp-trained; run them in order, or `all`):
  build    HF directory: Qwen3.5-0.8B's shape (hidden 1024, 24 layers = 6 x (3 DeltaNet + 1 attention), vocab
           248320: SmolLM2's 49152 tokens + padding rows, as the converter pads), random weights with the head a
           permutation of the embedding scaled so the text neither collapses nor is a hash (build()), a random
           MTP head (mtp.*)
  convert  llama.cpp's convert_hf_to_gguf.py (MTP block included) -> F16, llama-quantize -> Q4_K_M
  collect  conveyor on the Q4_K_M file: greedy continuations of training prompts (stdlib module docstrings),
           batched, with every position's final-normed hidden state (what MTP drafting reads)
  collect-forced
           teacher-forced prefill by conveyor on the same file of windows covering every real token id several
           times (random permutations of the ids, cut into --seq-tokens windows): every position's hidden state
           and the target's greedy argmax there, the head's label (DIR/FORCED.pt; needs DIR/tokenizer-ids.txt, every
           id 0..49151 once, for the argmax over the target's own lm_head rows). The greedy continuations cover
           only ~17k of the 49k ids, and a head trained on them alone memorises them
  train    the head (block + fc + norms; embedding/head frozen, tied) by benchmarks/mtp_distill.py; --forced adds
           collect-forced's windows to the training set (the held-out tenth stays greedy continuations);
           metrics (train / held-out, first and chained draft) in DIR/HEAD.json
  export   the trained head into the HF directory (--hf-out: into DIR/hf-HEAD, hf/ untouched), convert +
           quantize again (base weights unchanged)
  vocab    the draft vocabulary's token counts (--draft-vocab): the collected greedy continuations of the TRAINING
           prompts (never the held-out ones the bench asks), DIR/draft-vocab.txt; --forced adds the target's greedy
           ids along the forced windows (its own outputs there), --vocab-out names the file
  bench    held-out prompts, same file: conveyor plain vs --draft-kind mtp at C=1 and C=16 (MTP output asserted
           == plain), llama-server plain vs --spec-type draft-mtp at C=1 and C=16 (DIR/bench-FILE.json)
  sweep    C=1 plain / MTP k pairs alternated --reps times in one process, each pair's ratio
  profile  C=1: ms per target forward (by rows), per head layer and per head lm_head call, plain and MTP

Usage (the results.md section's runs):
  python benchmarks/mtp_trained.py build; ... convert; ... collect --tokens 128
  ... train --head head-scratch --init checkpoint --minutes 14; ... export --head head-scratch
  ... bench --model DIR/qwen35-08b-mtp-head-scratch-Q4_K_M.gguf --tokens 96 --k 3
  ... vocab; ... bench ... --only conveyor --draft-vocab DIR/draft-vocab.txt --draft-vocab-size 8192
The full-coverage head (results.md, "a head distilled with full coverage"):
  ... collect-forced --forced forced --sequences 900      (900 x 176 tokens, ~3 passes over the ids, ~17 min)
  ... train --head head-forced --init random --forced forced --minutes 30 --cosine --eval-every 100
  ... export --head head-forced --hf-out; ... vocab --forced forced --vocab-out draft-vocab-forced.txt
  ... bench --model DIR/qwen35-08b-mtp-head-forced-Q4_K_M.gguf --only conveyor --tokens 96 --k 3 [--draft-vocab ...]
  ... sweep --model DIR/qwen35-08b-mtp-head-forced-Q4_K_M.gguf --tokens 96 --k 3 --reps 5 \
      --draft-vocab DIR/draft-vocab-forced.txt --draft-vocab-type q4_0
  ... cold  (the same arguments: C=16, a cold adaptive policy between two plain runs, --reps times)
"""

from __future__ import annotations

import argparse
import ast
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import conveyor  # noqa: F401  (first: it asks for sleeping OpenMP waiters before torch loads OpenMP)
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from server_process import ServerProcess, free_port  # noqa: E402
LLAMA = Path("/tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp")
PROMPT_TOKENS = 48


def config(vocab: int = 248320):
    import transformers
    # Qwen3.5-0.8B's card: hidden 1024, FFN 3584, 24 layers (3 DeltaNet + 1 gated attention, x6), 8 heads / 2 KV of
    # 256, DeltaNet 16 key / 16 value heads of 128, vocab 248320; one MTP layer. NOTE: the head is untied here (the
    # card ties it; build() explains why): a decode step reads the same bytes either way.
    return transformers.Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=1024, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
        head_dim=256, intermediate_size=3584, linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, max_position_embeddings=32768, tie_word_embeddings=False,
        mtp_num_hidden_layers=1)


# ---- build -------------------------------------------------------------------------------------------------------

def build(folder: Path, tokenizer_dir: Path, embed_std: float, seed: int = 0) -> None:
    """Random weights (transformers' init) with the head a row permutation of the embedding: the final hidden state
    is norm(embed(x) + what the layers add), so the next token is perm(x) where the embedding outweighs the layers
    and the layers' (context's) choice where it does not. `embed_std` sets that balance: at the init's 0.02 the
    layers decide every token (the text is a hash of the context, which no small head learns); here 0.3 gives
    perm(x) every time, 0.15 a quarter of the time (transformers, fp32, 4 held-out prompts x 48 tokens)."""
    import safetensors.torch
    import transformers

    cfg = config()
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    weights = {n: w.detach() for n, w in model.state_dict().items()}
    num_real = len(json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"])
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size)
    # NOTE: padding rows (ids past the tokenizer) small, so no greedy step picks a token with no text
    embed[num_real:] *= 0.05
    embed *= embed_std
    perm = torch.arange(cfg.vocab_size)
    perm[:num_real] = torch.randperm(num_real)
    head = torch.empty_like(embed)
    head[perm] = embed  # lm_head row perm[x] is embed(x): logits peak at perm(x) when h ~ embed(x)
    weights["model.embed_tokens.weight"], weights["lm_head.weight"] = embed, head
    weights.update(random_head(cfg, weights))
    folder.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file({n: w.to(torch.bfloat16).contiguous() for n, w in weights.items()},
                                folder / "model.safetensors", metadata={"format": "pt"})
    torch.save(perm, folder.parent / "perm.pt")
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    cfg.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)


def random_head(cfg, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The untrained head: its layer a copy of the last attention layer, fc random, norms at 1 (stored as 0)."""
    last = max(i for i, t in enumerate(cfg.layer_types) if t == "full_attention")
    prefix = f"model.layers.{last}."
    head = {f"mtp.layers.0.{n[len(prefix):]}": w.clone() for n, w in weights.items() if n.startswith(prefix)}
    h = cfg.hidden_size
    head["mtp.fc.weight"] = torch.randn(h, 2 * h) * 0.02
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        head[f"mtp.{name}.weight"] = torch.zeros(h)
    return head


def write_head(folder: Path, head: dict[str, torch.Tensor], out: Path | None = None) -> None:
    """The HF directory with `head` as its mtp.* tensors: in place, or as `out` (its other files linked)."""
    import safetensors.torch
    path = folder / "model.safetensors"
    weights = {n: w for n, w in safetensors.torch.load_file(path).items() if not n.startswith("mtp.")}
    weights.update({n: w.to(torch.bfloat16).contiguous() for n, w in head.items()})
    if out is not None:
        out.mkdir(exist_ok=True)
        for other in folder.iterdir():
            if other.name != path.name and not (out / other.name).exists():
                (out / other.name).symlink_to(other)
        path = out / path.name
    safetensors.torch.save_file(weights, path.with_suffix(".tmp"), metadata={"format": "pt"})
    path.with_suffix(".tmp").rename(path)


def convert(folder: Path, out: Path, quant: str = "Q4_K_M") -> Path:
    f16 = out.with_name(out.name + "-F16.gguf")
    env = {**os.environ, "PYTHONPATH": str(LLAMA / "gguf-py")}
    subprocess.run([sys.executable, str(LLAMA / "convert_hf_to_gguf.py"), str(folder), "--outfile", str(f16),
                    "--outtype", "f16"], check=True, env=env)
    target = out.with_name(f"{out.name}-{quant}.gguf")
    subprocess.run([str(LLAMA / "build-noamx/bin/llama-quantize"), str(f16), str(target), quant, "2"], check=True)
    return target


# ---- prompts -----------------------------------------------------------------------------------------------------

def docstrings() -> list[tuple[str, str]]:
    """(module, docstring) of the stdlib's top-level .py modules with a docstring of 400+ characters, by name."""
    found = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError):
            continue
        if doc and len(doc) >= 400:
            found.append((path.stem, doc))
    return found


def prompts(tokenizer, split: str) -> list[list[int]]:
    """PROMPT_TOKENS-token windows of module docstrings (up to 4 per module for `train`, 2 for `eval`); every fourth
    module is held out for `eval`."""
    out = []
    for i, (_, doc) in enumerate(docstrings()):
        if (i % 4 == 3) != (split == "eval"):
            continue
        ids = tokenizer.encode(doc)
        for w in range(4 if split == "train" else 2):
            window = ids[w * PROMPT_TOKENS:(w + 1) * PROMPT_TOKENS]
            if len(window) == PROMPT_TOKENS:
                out.append(window)
    return out


# ---- collect -----------------------------------------------------------------------------------------------------

def collect(gguf: Path, out: Path, num_tokens: int, parallel: int, limit: int | None) -> None:
    """Greedy continuations of the training prompts by conveyor on the file, with the final-normed hidden state
    of every position the target forwards (recorded through MTPRunner.record, policy pinned to decline)."""
    from conveyor.engine.llm import LLM
    from conveyor.engine.sampling_params import SamplingParams
    from conveyor.runner import mtp_runner
    from mtp_distill import Sequence

    rows: dict[str, dict[int, torch.Tensor]] = {}
    original = mtp_runner.MTPRunner.record

    def record(self, chunks, hidden):
        at = 0
        for chunk in chunks:
            for i in range(len(chunk.token_ids)):
                rows.setdefault(chunk.request_id, {})[chunk.start_position + i] = hidden[at + i].float().clone()
            at += len(chunk.token_ids)
        original(self, chunks, hidden)

    mtp_runner.MTPRunner.record = record
    llm = LLM(model=str(gguf), parallel=parallel, speculative_ngram=0, enable_prefix_caching=False,
              draft_kind="mtp", draft_policy="decline")
    asked = prompts(llm.tokenizer, "train")[:limit]
    started = time.perf_counter()
    results = llm.generate(asked, SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True))
    print(f"collect: {len(asked)} prompts x {num_tokens} tokens in {time.perf_counter() - started:.0f} s")
    sequences = []
    for result in results:
        ids = result.prompt_token_ids + result.token_ids
        got = rows[result.request_id]
        assert sorted(got) == list(range(len(ids) - 1)), "a position's hidden state is missing"
        sequences.append(Sequence(ids, torch.stack([got[p] for p in range(len(ids) - 1)]).to(torch.bfloat16),
                                  len(result.prompt_token_ids)))
    torch.save(sequences, out)
    report_text(llm.tokenizer, results, torch.load(out.parent / "perm.pt"))


def forced_token_ids(num_real: int, skip: set[int], num_sequences: int, length: int, seed: int = 0) -> list[list[int]]:
    """`num_sequences` windows of `length` tokens that cover every real id (the tokenizer's, `skip` left out) about
    equally: random permutations of the ids laid end to end, cut into windows."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([i for i in range(num_real) if i not in skip])
    stream: list[int] = []
    while len(stream) < num_sequences * length:
        stream += ids[torch.randperm(len(ids), generator=gen)].tolist()
    return [stream[i * length:(i + 1) * length] for i in range(num_sequences)]


def collect_forced(gguf: Path, out: Path, all_ids: Path, num_sequences: int, length: int, parallel: int) -> None:
    """Teacher-forced prefill of token windows covering every real id (forced_token_ids) by conveyor on the file:
    at every position the target's final-normed hidden state and its greedy argmax there (the head's label: what
    the model would have written, not the forced next token). The argmax is the target's own lm_head rows (the
    Q6_K rows of the real ids, gathered as --draft-vocab does: `all_ids` lists every real id); each window's last
    position is also sampled by the engine, which checks that argmax against the engine's own greedy token."""
    from conveyor.engine.draft_vocab import special_token_ids
    from conveyor.engine.llm import LLM
    from conveyor.engine.sampling_params import SamplingParams
    from conveyor.runner import mtp_runner
    from mtp_distill import Sequence

    rows: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    original = mtp_runner.MTPRunner.record

    def record(self, chunks, hidden):
        vocab = self.head.draft_vocab
        picked = torch.cat([vocab.token_ids[vocab(hidden[i:i + 256]).argmax(-1)]
                            for i in range(0, hidden.shape[0], 256)])  # (T,) the target's greedy ids
        at = 0
        for chunk in chunks:
            n = len(chunk.token_ids)
            if not chunk.pool:
                rows.setdefault(chunk.request_id, []).append(
                    (chunk.start_position, hidden[at:at + n].to(torch.bfloat16).clone(), picked[at:at + n].clone()))
            at += n
        original(self, chunks, hidden)

    mtp_runner.MTPRunner.record = record
    llm = LLM(model=str(gguf), parallel=parallel, speculative_ngram=0, enable_prefix_caching=False,
              draft_kind="mtp", draft_policy="decline", draft_vocab=str(all_ids))
    # NOTE: the tokenizer's own count, not the GGUF's: the converter pads the GGUF vocabulary to 248320 ids
    num_real = len(json.loads((gguf.parent / "hf" / "tokenizer.json").read_text())["model"]["vocab"])
    asked = forced_token_ids(num_real, special_token_ids(llm.tokenizer), num_sequences, length)
    started = time.perf_counter()
    results = llm.generate(asked, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    seconds = time.perf_counter() - started
    sequences, agree = [], 0
    for result in results:
        parts = sorted(rows[result.request_id], key=lambda part: part[0])
        assert [p[0] for p in parts] == list(itertools.accumulate([0] + [len(p[1]) for p in parts[:-1]]))
        hiddens, greedy = torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])  # (N, H), (N,)
        assert hiddens.shape[0] == len(result.prompt_token_ids), "a position's hidden state is missing"
        agree += int(greedy[-1]) == result.token_ids[0]
        # x_N (the sampled token) closes the sequence, so h_0 .. h_{N-1} all feed rows (windows' layout)
        sequences.append(Sequence(result.prompt_token_ids + result.token_ids[:1], hiddens, 0, greedy.tolist()))
    torch.save(sequences, out)
    positions = sum(len(s.greedy_ids) for s in sequences)
    covered = len({t for s in sequences for t in s.token_ids})
    print(json.dumps({"sequences": len(sequences), "positions": positions, "seconds": round(seconds, 1),
                      "positions_per_s": round(positions / seconds, 1), "distinct_input_ids": covered,
                      "distinct_greedy_ids": len({t for s in sequences for t in s.greedy_ids}),
                      "last_argmax_equals_engine_greedy": f"{agree} of {len(results)}", "file": str(out)}))


def report_text(tokenizer, results, perm: torch.Tensor | None = None) -> dict:
    """How degenerate the greedy text is: distinct tokens / tokens per continuation; how much of it a bigram
    table explains (a token seen before followed by the same successor as its first time); a sample."""
    ratios = [len(set(r.token_ids)) / len(r.token_ids) for r in results]
    first: dict[int, int] = {}
    same = seen = 0
    for r in results:
        for a, b in zip(r.token_ids, r.token_ids[1:]):
            if a in first:
                seen += 1
                same += first[a] == b
            else:
                first[a] = b
    summary = {"distinct_token_ratio_mean": round(sum(ratios) / len(ratios), 3), "min": round(min(ratios), 3),
               "max": round(max(ratios), 3), "distinct_tokens_all": len({t for r in results for t in r.token_ids}),
               "tokens_all": sum(len(r.token_ids) for r in results),
               "bigram_repeat_same_successor": round(same / max(seen, 1), 3),
               "sample": tokenizer.decode(results[0].token_ids[:40])}
    if perm is not None:  # how often the embedding's bigram (build()) chose the token rather than the layers
        pairs = [(a, b) for r in results for a, b in zip(r.token_ids, r.token_ids[1:])]
        summary["next_is_perm_share"] = round(sum(int(perm[a]) == b for a, b in pairs) / len(pairs), 3)
    print(json.dumps(summary))
    return summary


# ---- train -------------------------------------------------------------------------------------------------------

def train(folder: Path, data: Path, out: Path, minutes: float, window: int, batch_size: int, lr: float,
          init: str, temperature: float, forced: Path | None = None, eval_every: int = 0,
          cosine: bool = False) -> None:
    """AdamW on the head (bf16 autocast); the held-out tenth's first-draft accuracy after every epoch (and every
    `eval_every` steps), the best head kept (a few thousand sequences overfit within a few epochs). `init`:
    `checkpoint` (the head the HF directory holds now: the random one build() wrote, until an export), `random`
    (random_head() again, seeded: the honest trained head whatever was exported since) or `copy` (fc passes the
    next token's normed embedding through, the layer adds nothing: the head starts as the bigram the embedding
    mostly decides, and training fits what the context adds). `forced`: teacher-forced sequences (collect-forced)
    added to the training windows only; the held-out tenth stays greedy continuations. `cosine`: the learning
    rate decays to 0 over the `minutes`. Metrics: OUT with .json."""
    import safetensors.torch
    from mtp_distill import MTPStudent, as_float, draft_accuracy, loss, windows

    sequences = torch.load(data, weights_only=False)
    held = max(1, len(sequences) // 10)  # the last tenth checks the fit (the benchmark's prompts are other modules)
    window = window or min(len(s.token_ids) for s in sequences) - 2  # 0: each sequence one window
    train_batch, check_batch = windows(sequences[:-held], window), windows(sequences[-held:], window)
    forced_batch = None
    if forced is not None:
        forced_batch = windows(torch.load(forced, weights_only=False), window)
        train_batch = type(train_batch)(*(torch.cat([a, b]) for a, b in zip(vars(train_batch).values(),
                                                                             vars(forced_batch).values())))
    weights = safetensors.torch.load_file(folder / "model.safetensors")
    num_real = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"])
    student = MTPStudent(config(), weights["model.embed_tokens.weight"].float(), weights["lm_head.weight"].float(),
                         num_real)
    if init == "random":
        torch.manual_seed(0)
        weights.update(random_head(config(), weights))
    student.load_head({n: w.float() for n, w in weights.items() if n.startswith("mtp.")})
    if init == "copy":
        with torch.no_grad():
            h = student.fc.weight.shape[0]
            student.fc.weight.copy_(torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1))
            student.layer.self_attn.o_proj.weight.zero_()
            student.layer.mlp.down_proj.weight.zero_()
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    best = (draft_accuracy(student, check_batch)["first"], "start", student.head_weights())
    print(f"train: {train_batch.token_ids.shape[0]} windows of {window} ("
          f"{0 if forced_batch is None else forced_batch.token_ids.shape[0]} forced); check "
          f"{check_batch.token_ids.shape[0]}; first-draft accuracy before {best[0]:.3f}", flush=True)

    def evaluate(when: str) -> None:
        nonlocal best
        held_accuracy = draft_accuracy(student, check_batch)["first"]
        print(f"{when}: held-out first-draft accuracy {held_accuracy:.3f}", flush=True)
        if held_accuracy > best[0]:
            best = (held_accuracy, when, student.head_weights())

    started, step, epoch = time.perf_counter(), 0, 0
    while time.perf_counter() - started < minutes * 60:
        order = torch.randperm(train_batch.token_ids.shape[0])
        for i in range(0, len(order), batch_size):
            pick = order[i:i + batch_size]
            part = as_float(type(train_batch)(*(t[pick] for t in vars(train_batch).values())))
            if cosine:
                for group in optimizer.param_groups:
                    group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (time.perf_counter() - started)
                                                                          / (minutes * 60))))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                total, stats = loss(student, part, temperature=temperature)
            optimizer.zero_grad()
            total.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            step += 1
            if step % 20 == 0:
                print(f"step {step} epoch {epoch} {time.perf_counter() - started:.0f}s "
                      + " ".join(f"{k}={v:.3f}" for k, v in stats.items() if k != "rows"), flush=True)
            if eval_every and step % eval_every == 0:
                evaluate(f"step {step}")
            if time.perf_counter() - started > minutes * 60:
                break
        epoch += 1
        evaluate(f"epoch {epoch}")
    seconds = time.perf_counter() - started
    student.load_head(best[2])
    gen = torch.Generator().manual_seed(0)
    sample = torch.randperm(train_batch.token_ids.shape[0], generator=gen)[:check_batch.token_ids.shape[0] * 2]
    metrics = {"steps": step, "epochs": epoch, "train_seconds": round(seconds), "kept": best[1],
               "train_windows": train_batch.token_ids.shape[0], "window": window, "batch_size": batch_size, "lr": lr,
               "init": init, "cosine": cosine, "held_out": draft_accuracy(student, check_batch),
               "train_sample": draft_accuracy(student, type(train_batch)(*(t[sample] for t in
                                                                        vars(train_batch).values())))}
    if forced_batch is not None:
        metrics["forced_windows"] = forced_batch.token_ids.shape[0]
    print("train: " + json.dumps(metrics), flush=True)
    out.with_suffix(".json").write_text(json.dumps(metrics, indent=1))
    torch.save(best[2], out)


# ---- vocab -------------------------------------------------------------------------------------------------------

def vocab(data: Path, out: Path, forced: Path | None = None) -> None:
    """Count the collected continuations (the model's own greedy outputs on the training prompts) into a
    --draft-vocab file; with `forced`, also the target's greedy ids along the teacher-forced sequences (its own
    outputs there, not the forced text)."""
    from conveyor.engine.draft_vocab import coverage, write_token_counts

    sequences = torch.load(data, weights_only=False)
    outputs = [s.token_ids[s.num_prompt_tokens:] for s in sequences]
    if forced is not None:
        sequences += torch.load(forced, weights_only=False)
        outputs += [s.greedy_ids for s in sequences if s.greedy_ids is not None]
    counts = write_token_counts(out, outputs)
    print(json.dumps({"sequences": len(sequences), "tokens": sum(counts.values()), "distinct": len(counts),
                      "share_of_tokens_in_top_n": coverage(counts, (1024, 2048, 4096, 8192, 16384)), "file": str(out)}))


# ---- check -------------------------------------------------------------------------------------------------------

def check(model: Path, num_prompts: int, num_tokens: int, perm: Path) -> dict:
    """Greedy continuations of a few held-out prompts: is the text degenerate?"""
    from conveyor.engine.llm import LLM
    from conveyor.engine.sampling_params import SamplingParams

    llm = LLM(model=str(model), parallel=num_prompts, speculative_ngram=0, enable_prefix_caching=False)
    asked = prompts(llm.tokenizer, "eval")[:num_prompts]
    results = llm.generate(asked, SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True))
    return report_text(llm.tokenizer, results, torch.load(perm) if perm.exists() else None)


# ---- bench -------------------------------------------------------------------------------------------------------

def conveyor_run(path: Path, asked: list[list[int]], concurrency: int, num_tokens: int, **engine) -> dict:
    """Greedy, ignore_eos: `asked` in waves of `concurrency` (C=1: one request at a time), after a warm-up."""
    import gc

    from conveyor.engine.llm import LLM
    from conveyor.engine.sampling_params import SamplingParams

    llm = LLM(model=str(path), parallel=concurrency, speculative_ngram=0, speculative_max_rows=128,
              enable_prefix_caching=False, **engine)
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    llm.generate(asked[:concurrency], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm up
    stats = llm.engine.scheduler.stats
    drafted0, accepted0 = stats.num_model_draft_tokens, stats.num_model_accepted_tokens
    outs, started = [], time.perf_counter()
    for i in range(0, len(asked), concurrency):
        outs += llm.generate(asked[i:i + concurrency], params)
    seconds = time.perf_counter() - started
    drafted, accepted = stats.num_model_draft_tokens - drafted0, stats.num_model_accepted_tokens - accepted0
    del llm
    gc.collect()
    return {"tokens_per_s": round(sum(len(o.token_ids) for o in outs) / seconds, 2), "seconds": round(seconds, 1),
            "drafted": drafted, "accepted": accepted,
            "acceptance": round(accepted / drafted, 3) if drafted else None, "token_ids": [o.token_ids for o in outs]}


class LlamaServer(ServerProcess):
    def __init__(self, path: Path, parallel: int, log: Path, extra: list[str]) -> None:
        port = free_port()
        super().__init__([str(LLAMA / "build-noamx/bin/llama-server"), "-m", str(path), "-np", str(parallel),
                          "-c", str(parallel * 512), "-t", "2", "--host", "127.0.0.1", "--port", str(port),
                          "--no-webui", *extra], port, log, timeout=300, name="llama-server")


def llama_run(path: Path, asked: list[list[int]], concurrency: int, num_tokens: int, log: Path,
              extra: list[str]) -> dict:
    """The same requests through llama-server's /completion (token-id prompts), `concurrency` at a time."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    server = LlamaServer(path, concurrency, log, extra)
    try:
        def ask(prompt: list[int], n: int) -> dict:
            body = {"prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1, "ignore_eos": True,
                    "cache_prompt": False, "return_tokens": True}
            return httpx.post(f"{server.url}/completion", json=body, timeout=600).json()

        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(lambda p: ask(p, 8), asked[:concurrency]))  # warm up
            outs, started = [], time.perf_counter()
            for i in range(0, len(asked), concurrency):
                outs += list(pool.map(lambda p: ask(p, num_tokens), asked[i:i + concurrency]))
            seconds = time.perf_counter() - started
    finally:
        server.stop()
    drafted = sum(o["timings"].get("draft_n", 0) for o in outs)
    accepted = sum(o["timings"].get("draft_n_accepted", 0) for o in outs)
    return {"tokens_per_s": round(sum(len(o["tokens"]) for o in outs) / seconds, 2), "seconds": round(seconds, 1),
            "drafted": drafted, "accepted": accepted, "acceptance": round(accepted / drafted, 3) if drafted else None,
            "token_ids": [o["tokens"] for o in outs]}


def _agree(a: list[list[int]], b: list[list[int]]) -> list[int]:
    """Per request: how many leading tokens two runs share."""
    return [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q))) for p, q in zip(a, b)]


def draft_vocab_args(args: argparse.Namespace) -> dict:
    """--draft-vocab / --draft-vocab-size as engine arguments (none without a file)."""
    if args.draft_vocab is None:
        return {}
    return {"draft_vocab": str(args.draft_vocab), "draft_vocab_size": args.draft_vocab_size,
            "draft_vocab_type": args.draft_vocab_type}


def bench(args: argparse.Namespace) -> None:
    import transformers

    path = args.model or args.dir / "qwen35-08b-mtp-head-copy-Q4_K_M.gguf"
    asked_all = prompts(transformers.AutoTokenizer.from_pretrained(args.dir / "tok"), "eval")
    out_path = args.dir / f"bench-{path.stem}.json"
    results = json.loads(out_path.read_text()) if out_path.exists() else {}
    k = args.k
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        asked = asked_all[:args.c1_prompts] if concurrency == 1 else asked_all[:concurrency]
        runs: dict[str, dict] = {}
        if "conveyor" in args.only:
            runs["conveyor_plain"] = conveyor_run(path, asked, concurrency, args.tokens, draft_kind="none")
            vocab = draft_vocab_args(args)
            tag = (f"_vocab{args.draft_vocab_size or 'all'}"
                   + ("" if args.draft_vocab_type == "same" else f"_{args.draft_vocab_type}")) if vocab else ""
            runs[f"conveyor_mtp_k{k}{tag}"] = conveyor_run(path, asked, concurrency, args.tokens, draft_kind="mtp",
                                                           draft_policy="enable", draft_block_size=k, **vocab)
            runs[f"conveyor_mtp_adaptive{tag}"] = conveyor_run(path, asked, concurrency, args.tokens,
                                                               draft_kind="mtp", draft_block_size=k, **vocab)
            for name in (f"conveyor_mtp_k{k}{tag}", f"conveyor_mtp_adaptive{tag}"):  # greedy: bitwise plain
                assert runs[name]["token_ids"] == runs["conveyor_plain"]["token_ids"], name
        if "llama" in args.only:
            log = args.dir / f"llama-server-c{concurrency}"
            runs["llama_plain"] = llama_run(path, asked, concurrency, args.tokens, log.with_suffix(".plain.log"), [])
            runs[f"llama_mtp_k{k}"] = llama_run(path, asked, concurrency, args.tokens, log.with_suffix(".mtp.log"),
                                                ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(k)])
            same = runs[f"llama_mtp_k{k}"]["token_ids"] == runs["llama_plain"]["token_ids"]
            runs["llama_mtp_agrees_with_plain"] = same
        key = f"C={concurrency}"
        merged = {**results.get(key, {}), **runs}
        if "conveyor_plain" in merged and "llama_plain" in merged:
            merged["conveyor_vs_llama_plain_leading_tokens_equal"] = _agree(merged["conveyor_plain"]["token_ids"],
                                                                            merged["llama_plain"]["token_ids"])
        results[key] = merged
        print(key, json.dumps({n: {f: v for f, v in r.items() if f != "token_ids"} if isinstance(r, dict) else r
                               for n, r in merged.items()}), flush=True)
    out_path.write_text(json.dumps(results))


def profile(path: Path, asked: list[list[int]], num_tokens: int, k: int, vocab: dict) -> dict:
    """Where a C=1 step's time goes, plain and with MTP drafting: mean ms of the target's forward (one row; a
    verify's k+1 rows), of the head's layer and of its lm_head per draft, and what a verify round yields."""
    from conveyor.runner import model_runner, mtp_runner

    times: dict[str, list[float]] = {}

    def timed(owner, name: str, label):
        original = getattr(owner, name)

        def wrapper(self, *args, **kwargs):
            started = time.perf_counter()
            result = original(self, *args, **kwargs)
            key = label(self, args) if callable(label) else label
            times.setdefault(key, []).append((time.perf_counter() - started) * 1e3)
            return result
        setattr(owner, name, wrapper)
        return original

    def target_rows(self, args) -> str:
        rows = sum(len(c.token_ids) for c in args[0].chunks)  # drafts are appended to a verify chunk
        return f"target forward, {rows} rows"

    saved = [(model_runner.ModelRunner, "forward", timed(model_runner.ModelRunner, "forward", target_rows)),
             (mtp_runner.MTPRunner, "_forward", timed(mtp_runner.MTPRunner, "_forward", "head layer (+ fc, norms)")),
             (mtp_runner.MTPRunner, "propose", timed(mtp_runner.MTPRunner, "propose", "propose (k drafts)"))]
    from conveyor.models.mtp import MTPHead
    saved.append((MTPHead, "draft_logits", timed(MTPHead, "draft_logits", "head lm_head")))
    try:
        out = {}
        for name, engine in (("plain", {"draft_kind": "none"}),
                             (f"mtp_k{k}", {"draft_kind": "mtp", "draft_policy": "enable", "draft_block_size": k,
                                            **vocab})):
            times.clear()
            run = conveyor_run(path, asked, 1, num_tokens, **engine)
            out[name] = {"tokens_per_s": run["tokens_per_s"], "acceptance": run["acceptance"],
                         "ms": {key: [len(v), round(sum(v) / len(v), 2)] for key, v in sorted(times.items())
                                if len(v) >= 5}}
        return out
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=("build", "convert", "check", "collect", "collect-forced", "train", "export",
                                     "vocab", "bench", "profile", "sweep", "cold"))
    p.add_argument("--dir", type=Path, default=Path("/tmp/mtp-trained"))
    p.add_argument("--embed-std", type=float, default=0.215)
    p.add_argument("--model", type=Path, help="check: an HF directory or GGUF (default: the Q4_K_M file)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--parallel", type=int, default=16)
    p.add_argument("--limit", type=int)
    p.add_argument("--minutes", type=float, default=15)
    p.add_argument("--window", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=6)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--head", default="head", help="train / export: the trained head's name (DIR/HEAD.pt)")
    p.add_argument("--init", choices=("checkpoint", "random", "copy"), default="copy")
    p.add_argument("--forced", help="collect-forced / train / vocab: the teacher-forced data's name (DIR/NAME.pt)")
    p.add_argument("--sequences", type=int, default=1300, help="collect-forced: windows of --seq-tokens tokens")
    p.add_argument("--seq-tokens", type=int, default=PROMPT_TOKENS + 128,
                   help="collect-forced: tokens per window (the greedy sequences' length, so windows stack)")
    p.add_argument("--eval-every", type=int, default=0, help="train: held-out check every N steps too")
    p.add_argument("--cosine", action="store_true", help="train: learning rate decays to 0 over --minutes")
    p.add_argument("--hf-out", action="store_true", help="export: into DIR/hf-HEAD (hf/ itself left as it is)")
    p.add_argument("--vocab-out", default="draft-vocab.txt", help="vocab: the file's name under DIR")
    p.add_argument("--temperature", type=float, default=1.0, help="train: the cross-entropy's logit divisor")
    p.add_argument("--k", type=int, default=3, help="bench: draft tokens per step")
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--c1-prompts", type=int, default=4)
    p.add_argument("--reps", type=int, default=5, help="sweep: plain / MTP pairs")
    p.add_argument("--only", default="conveyor,llama")
    p.add_argument("--draft-vocab", type=Path, help="bench / profile: conveyor's MTP runs with this draft vocabulary")
    p.add_argument("--draft-vocab-size", type=int, default=0)
    p.add_argument("--draft-vocab-type", default="same", help="bench / profile: the draft vocabulary rows' format")
    args = p.parse_args()
    hf, base = args.dir / "hf", args.dir / "qwen35-08b-mtp"
    if args.stage == "build":
        build(hf, args.dir / "tok", args.embed_std)
    elif args.stage == "convert":
        print(convert(hf, base))
    elif args.stage == "check":
        check(args.model or base.with_name(base.name + "-Q4_K_M.gguf"), args.prompts, args.tokens, args.dir / "perm.pt")
    elif args.stage == "collect":
        collect(base.with_name(base.name + "-Q4_K_M.gguf"), args.dir / "distill.pt", args.tokens, args.parallel,
                args.limit)
    elif args.stage == "collect-forced":
        collect_forced(base.with_name(base.name + "-Q4_K_M.gguf"), args.dir / f"{args.forced}.pt",
                       args.dir / "tokenizer-ids.txt", args.sequences, args.seq_tokens, args.parallel)
    elif args.stage == "train":
        train(hf, args.dir / "distill.pt", args.dir / f"{args.head}.pt", args.minutes, args.window, args.batch_size,
              args.lr, args.init, args.temperature, args.forced and args.dir / f"{args.forced}.pt", args.eval_every,
              args.cosine)
    elif args.stage == "export":
        folder = args.dir / f"hf-{args.head}" if args.hf_out else hf
        write_head(hf, torch.load(args.dir / f"{args.head}.pt"), folder if args.hf_out else None)
        print(convert(folder, args.dir / f"qwen35-08b-mtp-{args.head}"))
    elif args.stage == "vocab":
        vocab(args.dir / "distill.pt", args.dir / args.vocab_out, args.forced and args.dir / f"{args.forced}.pt")
    elif args.stage == "bench":
        bench(args)
    elif args.stage == "profile":
        import transformers
        asked = prompts(transformers.AutoTokenizer.from_pretrained(args.dir / "tok"), "eval")[:args.c1_prompts]
        print(json.dumps(profile(args.model or args.dir / "qwen35-08b-mtp-head-copy-Q4_K_M.gguf", asked, args.tokens,
                                 args.k, draft_vocab_args(args))))
    elif args.stage == "sweep":
        import transformers
        asked = prompts(transformers.AutoTokenizer.from_pretrained(args.dir / "tok"), "eval")[:args.c1_prompts]
        print(json.dumps(sweep(args.model or args.dir / "qwen35-08b-mtp-head-copy-Q4_K_M.gguf", asked, args.tokens,
                               args.k, args.reps, draft_vocab_args(args))))
    elif args.stage == "cold":
        import transformers
        asked = prompts(transformers.AutoTokenizer.from_pretrained(args.dir / "tok"), "eval")[:16]
        print(json.dumps(cold(args.model or args.dir / "qwen35-08b-mtp-head-copy-Q4_K_M.gguf", asked, args.tokens,
                              args.k, args.reps, draft_vocab_args(args))))


def sweep(path: Path, asked: list[list[int]], num_tokens: int, k: int, reps: int, vocab: dict) -> dict:
    """C=1 plain and MTP k (draft_policy enable) alternated `reps` times in one process: each pair's ratio, so a
    shared machine's drift hits both sides of it alike (a single bench run moves ~10 %)."""
    import statistics
    runs: dict[str, list[float]] = {"plain": [], "mtp": []}
    for _ in range(reps):
        for name, engine in (("plain", {"draft_kind": "none"}),
                             ("mtp", {"draft_kind": "mtp", "draft_policy": "enable", "draft_block_size": k, **vocab})):
            run = conveyor_run(path, asked, 1, num_tokens, **engine)
            runs[name].append(run["tokens_per_s"])
            print(name, run["tokens_per_s"], run["acceptance"], flush=True)
    ratios = [round(m / p, 3) for p, m in zip(runs["plain"], runs["mtp"])]
    return {"k": k, **runs, "ratios": ratios, "median_ratio": statistics.median(ratios)}


def cold(path: Path, asked: list[list[int]], num_tokens: int, k: int, reps: int, vocab: dict) -> dict:
    """C=16 with a cold adaptive policy (an empty policy cache: the run pays its profile) between two plain runs,
    `reps` times in one process; each ratio is adaptive / the mean of the plain runs beside it."""
    import statistics
    import tempfile
    ratios, drafts = [], []
    for _ in range(reps):
        before = conveyor_run(path, asked, 16, num_tokens, draft_kind="none")
        with tempfile.TemporaryDirectory() as cache:
            adaptive = conveyor_run(path, asked, 16, num_tokens, draft_kind="mtp", draft_block_size=k,
                                    cache_dir=cache, **vocab)
        after = conveyor_run(path, asked, 16, num_tokens, draft_kind="none")
        assert adaptive["token_ids"] == before["token_ids"]  # greedy: bitwise plain
        plain = (before["tokens_per_s"] + after["tokens_per_s"]) / 2
        ratios.append(round(adaptive["tokens_per_s"] / plain, 3))
        drafts.append(adaptive["drafted"])
        print("plain", before["tokens_per_s"], after["tokens_per_s"], "adaptive", adaptive["tokens_per_s"],
              "drafts", adaptive["drafted"], flush=True)
    return {"k": k, "ratios": ratios, "drafts": drafts, "median_ratio": statistics.median(ratios)}


if __name__ == "__main__":
    main()
