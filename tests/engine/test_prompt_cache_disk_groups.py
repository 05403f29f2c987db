"""The disk tier and saved slots for every memory group (issue #44 item 1): a sliding window's own blocks,
hybrids' recurrent-state snapshots and MLA's latent rows are written and read with the same checks as the
full-attention blocks, and a restart resumes a shared prefix from disk with bitwise the cold output."""

import os

import pytest

from conveyor.engine import slot_store
from conveyor.engine.block_keys import chain_hashes
from conveyor.engine.disk_store import STATE, SUFFIXES, WINDOW
from conveyor.engine.llm import LLM
from conveyor.engine.prefix_disk import group_key
from conveyor.engine.sampling_params import SamplingParams
from conveyor.testing import FAMILY_OVERRIDES, tiny_checkpoint, tiny_hybrid_checkpoint, tiny_mla_checkpoint

pytestmark = pytest.mark.batch_invariant

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
SYSTEM = "You are a careful assistant who answers in one short sentence. " * 8  # ~96 tokens: 6 blocks
PROMPTS = [SYSTEM + "What is the capital of France?", SYSTEM + "Name a prime number."]
# family -> (checkpoint, the file kinds besides the full group's that a restart needs)
FAMILIES = {
    "sliding-window": (lambda: tiny_checkpoint(**FAMILY_OVERRIDES["gemma3"]), {WINDOW}),  # window 8
    "hybrid-deltanet": (lambda: tiny_hybrid_checkpoint("qwen3_5_text"), {STATE}),
    "hybrid-conv": (lambda: tiny_hybrid_checkpoint("lfm2"), {STATE}),
    "mla": (tiny_mla_checkpoint, set()),
}


def _engine(checkpoint, cache_dir=None, **fields) -> LLM:
    return LLM(checkpoint=checkpoint, parallel=2, ctx_size=2 * 1024, prompt_cache_dir=cache_dir, **fields)


def _close(llm: LLM) -> None:
    llm.engine.kv.check_integrity()
    llm.engine.close()


def _kinds(directory) -> dict[str, int]:
    """Files per kind in a cache directory."""
    by_suffix = {suffix: kind for kind, suffix in SUFFIXES.items()}
    counts: dict[str, int] = {}
    for name in os.listdir(directory):
        kind = by_suffix.get(name[32:])
        if kind is not None:
            counts[kind] = counts.get(kind, 0) + 1
    return counts


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    """(name, checkpoint, the extra file kinds, cold greedy outputs of PROMPTS)."""
    make, kinds = FAMILIES[request.param]
    checkpoint = make()
    cold = [r.token_ids for r in _engine(checkpoint, enable_prefix_caching=False).generate(PROMPTS, GREEDY)]
    return request.param, checkpoint, kinds, cold


@pytest.mark.parametrize("preload", ["0", "1G"])
def test_a_restart_resumes_the_prefix_from_disk_bitwise(family, tmp_path, preload):
    """Preload off: every group comes back on demand; on: the full group is read in at start, the others on
    demand (they are a window's few blocks and one snapshot)."""
    _, checkpoint, kinds, cold = family
    first = _engine(checkpoint, str(tmp_path), prompt_cache_preload=preload)
    assert [r.token_ids for r in first.generate(PROMPTS, GREEDY)] == cold
    _close(first)
    on_disk = _kinds(tmp_path)
    assert set(on_disk) == {"kv"} | kinds and on_disk["kv"] >= 6

    again = _engine(checkpoint, str(tmp_path), prompt_cache_preload=preload)
    results = again.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in results] == cold
    assert all(r.num_cached_tokens >= 16 * 5 for r in results)  # no prefill of the shared text
    report = again.engine.disk_report()
    assert report["hits"] > 0 and report["corrupt"] == report["rejected"] == 0
    assert all(report["group_reads"][kind] >= 1 for kind in kinds)
    _close(again)


def test_bad_files_of_the_other_groups_are_never_used(family, tmp_path):
    """A flipped bit in each sliding block / snapshot file (MLA: each latent block file): counted corrupt, the
    prefix is computed again."""
    _, checkpoint, kinds, cold = family
    first = _engine(checkpoint, str(tmp_path), prompt_cache_preload="0")
    first.generate(PROMPTS, GREEDY)
    _close(first)
    kind = next(iter(kinds), "kv")
    bad = [file for file in os.listdir(tmp_path) if file.endswith(SUFFIXES[kind])]
    assert bad
    for file in bad:
        data = bytearray((tmp_path / file).read_bytes())
        data[len(data) // 2] ^= 0x01
        (tmp_path / file).write_bytes(bytes(data))
    again = _engine(checkpoint, str(tmp_path), prompt_cache_preload="0")
    assert [r.token_ids for r in again.generate(PROMPTS[:1], GREEDY)] == cold[:1]
    assert again.engine.disk_report()["corrupt"] >= 1
    _close(again)


def test_state_snapshots_evicted_from_ram_come_back_from_disk(tmp_path):
    """With one snapshot kept in RAM, a second prompt's snapshot pushes the first one's to disk; the first
    prompt again resumes from it (read back), bitwise."""
    checkpoint = tiny_hybrid_checkpoint("qwen3_5_text")
    cold = [r.token_ids for r in _engine(checkpoint, enable_prefix_caching=False).generate(PROMPTS, GREEDY)]
    llm = _engine(checkpoint, str(tmp_path), prompt_cache_preload="0")
    llm.engine.states.max_snapshots = 1
    assert llm.generate(PROMPTS[:1], GREEDY)[0].token_ids == cold[0]
    other = "Another topic entirely, about rivers and hills. " * 6
    llm.generate([other], GREEDY)
    assert llm.engine.disk.writer.flush(timeout=60)
    assert _kinds(tmp_path).get(STATE, 0) >= 1
    again = llm.generate(PROMPTS[:1], GREEDY)[0]
    assert again.token_ids == cold[0] and again.num_cached_tokens >= 16 * 5
    _close(llm)


def test_sliding_blocks_evicted_from_ram_come_back_from_disk(tmp_path):
    """A cold cache of two blocks per group: later prompts evict the first one's sliding blocks, which go to
    disk and serve it again in the same run."""
    checkpoint = tiny_checkpoint(**FAMILY_OVERRIDES["gemma3"])
    cold = [r.token_ids for r in _engine(checkpoint, enable_prefix_caching=False).generate(PROMPTS, GREEDY)]
    probe = _engine(checkpoint, enable_prefix_caching=False)
    plan = probe.engine.pool_plan
    budget = 2 * (plan.bytes_per_block + plan.window_bytes_per_block)
    llm = _engine(checkpoint, str(tmp_path), prompt_cache_preload="0", prompt_cache_budget=str(budget))
    assert llm.generate(PROMPTS[:1], GREEDY)[0].token_ids == cold[0]
    llm.generate(["Another topic entirely, about rivers and hills. " * 6 + str(i) for i in range(3)], GREEDY)
    assert llm.engine.disk.writer.flush(timeout=60)
    ids = llm.tokenizer.encode(PROMPTS[0])
    last = chain_hashes(ids, 16, len(ids) // 16)[-1]
    assert llm.engine.disk.store.contains(group_key(last, WINDOW))
    reads = llm.engine.disk_report()["group_reads"][WINDOW]  # the other prompts share their own text
    again = llm.generate(PROMPTS[:1], GREEDY)[0]
    # The cold-cache budget of two blocks bounds the hit; its sliding block came back from disk.
    assert again.token_ids == cold[0] and again.num_cached_tokens >= 32
    assert llm.engine.disk_report()["group_reads"][WINDOW] > reads
    _close(llm)


def test_a_saved_slot_restores_every_group_after_a_restart(family, tmp_path):
    """llama-server's slot save on one engine, restore on a fresh one (same files): the next request with the
    slot's prefix resumes after it, bitwise."""
    _, checkpoint, _, cold = family
    slots = tmp_path / "slots"
    first = _engine(checkpoint, slot_save_path=str(slots))
    first.generate(PROMPTS[:1], GREEDY)
    first.engine.slot_contents[0] = first.tokenizer.encode(PROMPTS[0])
    saved = slot_store.save(first.engine, 0, str(slots), "a.bin")
    assert saved["n_saved"] >= 16 * 5 and saved["n_written"] > 0
    _close(first)

    again = _engine(checkpoint, slot_save_path=str(slots))
    restored = slot_store.restore(again.engine, 1, str(slots), "a.bin")
    assert restored["n_restored"] == saved["n_saved"] and restored["n_read"] > 0
    result = again.generate(PROMPTS[:1], GREEDY)[0]
    assert result.token_ids == cold[0] and result.num_cached_tokens >= saved["n_saved"]
    _close(again)
