"""--draft-vocab (FR-Spec): the MTP / DFlash drafter scores only a subset of token ids. Greedy output stays bitwise
plain decoding at 1 and 16 concurrent requests with a subset that holds the right tokens (drafts accepted) and one
that holds none of them (drafts rejected); a GGML-quantized head is gathered as blocks; sampled rows are verified;
bad files and sizes are refused at startup."""

from dataclasses import replace

import pytest
import torch

from conveyor.config import ConfigError, EngineConfig
from conveyor.engine.draft_vocab import read_token_counts, select_token_ids, write_token_counts
from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams
from conveyor.kernels.quant_ref import quantize_raw
from conveyor.loading import LoadError
from conveyor.models.tensors import QuantizedTensor
from conveyor.testing import agreeing_mtp_head, tiny_checkpoint, tiny_hybrid_checkpoint, write_tiny_dflash

pytestmark = pytest.mark.batch_invariant

PROMPTS = [f"Echo {i}: " + "alpha beta gamma delta " * (1 + i % 4) for i in range(16)]
Q8_0 = 8


def _greedy(i: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=12 + 5 * (i % 3), ignore_eos=True)


def _run(checkpoint, parallel: int, prompts=PROMPTS, **extra) -> tuple[LLM, list[list[int]]]:
    llm = LLM(checkpoint=checkpoint, parallel=parallel, speculative_max_rows=64, **extra)
    outs = llm.generate(prompts, [_greedy(i) for i in range(len(prompts))])
    llm.engine.kv.check_integrity()
    assert llm.engine.pool.stats().num_used == 0
    return llm, [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def bigram(tmp_path_factory):
    """An MTP head that agrees with its target, the lm_head in Q8_0 blocks; plain outputs; a vocab file of them."""
    checkpoint = agreeing_mtp_head(tiny_hybrid_checkpoint("qwen3_5_text", mtp=True, tie_word_embeddings=False))
    head = checkpoint.weights["lm_head.weight"]
    weights = {**checkpoint.weights, "lm_head.weight": QuantizedTensor(Q8_0, tuple(head.shape), quantize_raw(head, Q8_0))}
    checkpoint = replace(checkpoint, weights=weights)
    _, want = _run(checkpoint, len(PROMPTS), speculative_ngram=0)
    path = tmp_path_factory.mktemp("vocab") / "counts.txt"
    write_token_counts(path, want)
    return checkpoint, want, path


@pytest.mark.parametrize("concurrency", [1, 16])
def test_greedy_with_a_draft_vocab_is_plain_decoding(bigram, concurrency):
    checkpoint, want, path = bigram
    llm, got = _run(checkpoint, concurrency, draft_kind="mtp", draft_policy="enable", draft_vocab=str(path))
    assert got == want
    stats = llm.engine.scheduler.stats
    assert stats.num_model_accepted_tokens >= 0.9 * stats.num_model_draft_tokens > 0
    vocab = llm.engine.draft.model.draft_vocab
    num_ids = len(read_token_counts(path))
    # the head's rows gathered as Q8_0 blocks: N rows, not the vocabulary's
    assert vocab.lm_head.segments[0].type_name == "Q8_0"
    assert num_ids <= vocab.lm_head.out_features < num_ids + 64  # plus the special tokens
    assert llm.engine.draft.name.endswith(f":vocab{vocab.lm_head.out_features}")


@pytest.mark.parametrize("row_type", ["q4_0", "q8_0"])
def test_requantized_vocab_rows_keep_plain_decoding(bigram, row_type):
    """--draft-vocab-type: the gathered rows requantized once at load (fewer bytes per draft); output unchanged."""
    checkpoint, want, path = bigram
    llm, got = _run(checkpoint, 16, draft_kind="mtp", draft_policy="enable", draft_vocab=str(path),
                    draft_vocab_type=row_type)
    assert got == want
    stats = llm.engine.scheduler.stats
    assert stats.num_model_accepted_tokens >= 0.5 * stats.num_model_draft_tokens > 0  # still the right drafts
    vocab = llm.engine.draft.model.draft_vocab
    assert vocab.lm_head.segments[0].type_name == row_type.upper()
    assert llm.engine.draft.name.endswith(f":vocab{vocab.lm_head.out_features}:{row_type}")


def test_a_vocab_without_the_right_tokens_gives_exact_output(bigram, tmp_path):
    checkpoint, want, _ = bigram
    written = {t for w in want for t in w}
    path = tmp_path / "wrong.txt"
    path.write_text("".join(f"{t} 1\n" for t in range(1000, 3000) if t not in written))
    llm, got = _run(checkpoint, 16, draft_kind="mtp", draft_policy="enable", draft_vocab=str(path),
                    draft_vocab_size=500)
    assert got == want
    stats = llm.engine.scheduler.stats
    assert stats.num_model_draft_tokens > 0 and stats.num_model_accepted_tokens == 0
    assert llm.engine.draft.model.draft_vocab.lm_head.out_features == 500


def test_sampled_rows_draft_from_the_vocab_and_are_verified(bigram, tmp_path):
    checkpoint, _, _ = bigram
    # Sampled text soon leaves the greedy outputs' few ids: here every id ranks equal and the 9k highest are out.
    path = tmp_path / "all.txt"
    path.write_text("".join(f"{t} 1\n" for t in range(checkpoint.config.vocab_size)))
    llm = LLM(checkpoint=checkpoint, parallel=8, draft_kind="mtp", draft_policy="enable", draft_vocab=str(path),
              draft_vocab_size=40000, speculative_max_rows=64)
    outs = llm.generate(PROMPTS[:8], SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True))
    assert all(len(o.token_ids) == 12 for o in outs)
    stats = llm.engine.scheduler.stats
    assert stats.num_model_accepted_tokens > stats.num_model_draft_tokens / 2 > 0


def test_dflash_with_a_draft_vocab_is_plain_decoding(tmp_path):
    target = tiny_checkpoint(0, num_hidden_layers=4)
    drafter = write_tiny_dflash(tmp_path / "dflash", target)
    _, want = _run(target, 16, PROMPTS[:8], speculative_ngram=0)
    path = tmp_path / "counts.txt"
    write_token_counts(path, want)
    llm, got = _run(target, 4, PROMPTS[:8], draft_kind="dflash", draft_model=drafter, draft_policy="enable",
                    draft_vocab=str(path))
    assert got == want
    assert llm.engine.scheduler.stats.num_model_draft_tokens > 0
    assert llm.engine.draft.model.draft_vocab is not None
    # a confidence floor cuts each block at its first unsure draft
    floor, got = _run(target, 4, PROMPTS[:8], draft_kind="dflash", draft_model=drafter, draft_policy="enable",
                      draft_vocab=str(path), draft_p_min=0.5)
    assert got == want
    assert floor.engine.scheduler.stats.num_model_draft_tokens < llm.engine.scheduler.stats.num_model_draft_tokens


def test_selection_keeps_special_tokens_and_ranks_by_count():
    counts = {5: 10, 7: 10, 3: 2, 9: 30, 11: 1}
    assert select_token_ids(counts, 4, 20, keep=[0, 1]).tolist() == [0, 1, 5, 9]  # ties: the lower id first
    assert select_token_ids(counts, 0, 20, keep=[0, 99]).tolist() == [0, 3, 5, 7, 9, 11]  # 99: past the vocab
    with pytest.raises(LoadError, match="outside the model's vocabulary"):
        select_token_ids({25: 1}, 0, 20, keep=[])
    with pytest.raises(LoadError, match="larger than the model's vocabulary"):
        select_token_ids(counts, 21, 20, keep=[])
    with pytest.raises(LoadError, match="leaves no room"):
        select_token_ids(counts, 2, 20, keep=[0, 1])


@pytest.mark.parametrize("text, error", [
    ("5 10\nseven 3\n", r"counts.txt:2: expected `TOKEN_ID COUNT`"),
    ("5 10 7\n", r"counts.txt:1: expected"),
    ("-1 4\n", "must be >= 0"),
    ("# nothing\n\n", "no `TOKEN_ID COUNT` lines"),
])
def test_a_bad_file_is_refused_with_its_line(tmp_path, text, error):
    path = tmp_path / "counts.txt"
    path.write_text(text)
    with pytest.raises(LoadError, match=error):
        read_token_counts(path)


def test_bad_files_and_sizes_are_refused_at_startup(bigram, tmp_path):
    checkpoint, _, path = bigram
    with pytest.raises(LoadError, match="cannot read it"):
        LLM(checkpoint=checkpoint, draft_kind="mtp", draft_vocab=str(tmp_path / "missing.txt"))
    with pytest.raises(LoadError, match="larger than the model's vocabulary"):
        LLM(checkpoint=checkpoint, draft_kind="mtp", draft_vocab=str(path), draft_vocab_size=10**6)
    with pytest.raises(ConfigError, match="needs --draft-vocab FILE"):
        EngineConfig(draft_kind="mtp", draft_vocab_size=100)
    with pytest.raises(ConfigError, match="must be >= 0"):
        EngineConfig(draft_kind="mtp", draft_vocab=str(path), draft_vocab_size=-1)
    with pytest.raises(ConfigError, match="applies to --draft-kind mtp or dflash"):
        EngineConfig(draft_kind="eagle3", draft_model="x", draft_vocab=str(path))
    with pytest.raises(ConfigError, match="draft_vocab_type must be one of"):
        EngineConfig(draft_kind="mtp", draft_vocab=str(path), draft_vocab_type="q6_k")
    with pytest.raises(ConfigError, match="--draft-vocab-type needs --draft-vocab FILE"):
        EngineConfig(draft_kind="mtp", draft_vocab_type="q4_0")


def test_the_counts_file_round_trips(tmp_path):
    path = tmp_path / "counts.txt"
    write_token_counts(path, [[3, 4, 3], [4, 4, 9]])
    assert path.read_text() == "4 3\n3 2\n9 1\n"
    assert read_token_counts(path) == {4: 3, 3: 2, 9: 1}
    assert torch.equal(select_token_ids(read_token_counts(path), 2, 10, keep=[]), torch.tensor([3, 4]))


def test_a_confidence_floor_stops_unsure_drafts_and_keeps_greedy_exact():
    """--draft-p-min: a random head is seldom sure, so a high floor drafts far less; output stays plain."""
    checkpoint = tiny_hybrid_checkpoint("qwen3_5_text", mtp=True)
    _, want = _run(checkpoint, 8, PROMPTS[:8], speculative_ngram=0)
    counts = {}
    for p_min in (0.0, 0.9):
        llm, got = _run(checkpoint, 8, PROMPTS[:8], draft_kind="mtp", draft_policy="enable", draft_p_min=p_min)
        assert got == want
        counts[p_min] = llm.engine.scheduler.stats.num_model_draft_tokens
    assert counts[0.9] < counts[0.0] / 2
    with pytest.raises(ConfigError, match="draft_p_min"):
        EngineConfig(draft_kind="mtp", draft_p_min=1.0)


def test_the_cli_counts_text_files_with_the_models_tokenizer(tmp_path, capsys):
    from collections import Counter

    from conveyor.cli import main
    from conveyor.loading import load_checkpoint
    from conveyor.testing import write_tiny_model_dir

    model = write_tiny_model_dir(tmp_path / "model")
    (tmp_path / "a.txt").write_text("alpha beta gamma alpha beta alpha")
    (tmp_path / "b.txt").write_text("delta alpha")
    out = tmp_path / "counts.txt"
    assert main(["draft-vocab", "-m", model, str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), "-o", str(out)]) == 0
    tokenizer = load_checkpoint(model).tokenizer
    want = Counter(tokenizer.encode("alpha beta gamma alpha beta alpha", add_special_tokens=False)
                   + tokenizer.encode("delta alpha", add_special_tokens=False))
    assert read_token_counts(out) == dict(want)
    assert f"{sum(want.values())} tokens" in capsys.readouterr().out
    assert main(["draft-vocab", "-m", model, str(tmp_path / "missing.txt"), "-o", str(out)]) == 1
    # an output it cannot write: one line, exit 1 (no traceback)
    assert main(["draft-vocab", "-m", model, str(tmp_path / "a.txt"), "-o", str(tmp_path / "no" / "x.txt")]) == 1
    assert "cannot write" in capsys.readouterr().err


def test_a_tied_head_gathers_the_embeddings_rows(tmp_path):
    """Qwen3.5's card ties the head: the draft vocabulary's rows come from the embedding."""
    checkpoint = tiny_hybrid_checkpoint("qwen3_5_text", mtp=True)
    assert checkpoint.config.tie_word_embeddings and "lm_head.weight" not in checkpoint.weights
    _, want = _run(checkpoint, 4, PROMPTS[:4], speculative_ngram=0)
    path = tmp_path / "counts.txt"
    write_token_counts(path, want)
    llm, got = _run(checkpoint, 4, PROMPTS[:4], draft_kind="mtp", draft_policy="enable", draft_vocab=str(path))
    assert got == want
    vocab = llm.engine.draft.model.draft_vocab
    embed = checkpoint.weights["model.embed_tokens.weight"]
    assert torch.equal(vocab.lm_head.dense_weight().float(), embed[vocab.token_ids].to(torch.bfloat16).float())


def test_draft_p_min_without_a_model_drafter_says_it_does_nothing(caplog):
    with caplog.at_level("WARNING", logger="conveyor.engine.engine"):
        _run(tiny_checkpoint(), 1, PROMPTS[:1], draft_p_min=0.5)
    assert any("--draft-p-min 0.5 has no effect" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="conveyor.engine.engine"):
        _run(tiny_checkpoint(), 1, PROMPTS[:1])
    assert not any("draft-p-min" in r.getMessage() for r in caplog.records)
