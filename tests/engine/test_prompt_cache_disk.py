"""The prefix cache's disk tier: blocks survive a restart and come back bitwise, bad files are never used,
the budget evicts the oldest, and the writer never blocks the step loop."""

import logging
import os
import threading

import pytest

from conveyor.engine import prefix_disk, prefix_reads
from conveyor.engine.block_keys import chain_hashes, key_hex
from conveyor.engine.disk_store import SUFFIX, DiskStore, SpillWriter
from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams
from conveyor.testing import tiny_checkpoint as make_tiny_checkpoint

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
SYSTEM = "You are a careful assistant who answers in one short sentence. " * 8
PROMPTS = [SYSTEM + "What is the capital of France?", SYSTEM + "Name a prime number."]


def _engine(checkpoint, cache_dir=None, **fields) -> LLM:
    fields.setdefault("prompt_cache_preload", "0")  # these tests read on demand; the preload has its own
    return LLM(checkpoint=checkpoint, parallel=2, ctx_size=2 * 1024, prompt_cache_dir=cache_dir, **fields)


@pytest.fixture(scope="module")
def cold(tiny_checkpoint):
    """Greedy outputs of a RAM-only engine, per prompt: what every disk hit must reproduce."""
    llm = _engine(tiny_checkpoint, enable_prefix_caching=False)
    return [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]


def _block_path(directory, llm: LLM, prompt: str, index: int) -> str:
    ids = llm.tokenizer.encode(prompt)
    key = chain_hashes(ids, llm.engine.kv.block_size, index + 1)[-1]
    return os.path.join(directory, key_hex(key) + SUFFIX)


def _run_and_close(checkpoint, directory, prompts=PROMPTS, **fields):
    llm = _engine(checkpoint, str(directory), **fields)
    out = [r.token_ids for r in llm.generate(prompts, GREEDY)]
    llm.engine.kv.check_integrity()
    llm.engine.close()
    return llm, out


@pytest.mark.batch_invariant
def test_restart_reads_the_prefix_back_bitwise(tiny_checkpoint, cold, tmp_path):
    first, out = _run_and_close(tiny_checkpoint, tmp_path)
    assert out == cold
    report = first.engine.disk_report()
    assert report["entries"] > 0 and report["writes"] == report["entries"] and report["hits"] == 0

    again = _engine(tiny_checkpoint, str(tmp_path))  # a new process would see the same files
    results = again.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in results] == cold
    report = again.engine.disk_report()
    assert report["hits"] > 0 and report["hit_tokens"] >= 16 * 4
    assert report["corrupt"] == report["rejected"] == 0
    assert results[0].num_cached_tokens >= 16 * 4  # adopted: no prefill of the system prompt
    again.engine.kv.check_integrity()
    again.engine.close()


@pytest.mark.batch_invariant
def test_a_restart_reads_in_batches_with_the_same_result(tiny_checkpoint, cold, tmp_path, monkeypatch):
    """Blocks come back in batches of READ_BATCH (read on several threads, copied per tensor at once): runs
    of 3 give what one run gives, bitwise, with the same hits."""
    _run_and_close(tiny_checkpoint, tmp_path)
    hits = {}
    for batch in (1000, 3):
        monkeypatch.setattr(prefix_disk, "READ_BATCH", batch)
        llm = _engine(tiny_checkpoint, str(tmp_path))
        assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == cold
        hits[batch] = llm.engine.disk_report()["hits"]
        llm.engine.kv.check_integrity()
        llm.engine.close()
    assert hits[3] == hits[1000] > 3


@pytest.mark.batch_invariant
def test_blocks_spilled_under_pressure_come_back_in_the_same_run(tiny_checkpoint, cold, tmp_path):
    # A prompt cache of two blocks: later prompts evict the first one's blocks, which go to disk.
    probe = _engine(tiny_checkpoint, enable_prefix_caching=False)
    budget = 2 * probe.engine.pool_plan.bytes_per_block
    llm = _engine(tiny_checkpoint, str(tmp_path), prompt_cache_budget=str(budget))
    assert [r.token_ids for r in llm.generate(PROMPTS[:1], GREEDY)] == cold[:1]
    others = ["Another topic entirely, about rivers and hills. " * 6 + str(i) for i in range(3)]
    llm.generate(others, GREEDY)
    assert llm.engine.disk.writer.flush(timeout=60)
    assert os.path.exists(_block_path(tmp_path, llm, PROMPTS[0], 0))
    hits_before = llm.engine.disk_report()["hits"]
    assert [r.token_ids for r in llm.generate(PROMPTS[:1], GREEDY)] == cold[:1]
    assert llm.engine.disk_report()["hits"] > hits_before
    llm.engine.kv.check_integrity()
    llm.engine.close()


@pytest.mark.batch_invariant
def test_corrupt_or_truncated_files_are_counted_and_never_used(tiny_checkpoint, cold, tmp_path, caplog):
    first, _ = _run_and_close(tiny_checkpoint, tmp_path)
    path = _block_path(tmp_path, first, PROMPTS[0], 0)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01  # one flipped bit in the payload
    open(path, "wb").write(bytes(data))
    with caplog.at_level(logging.WARNING, logger="conveyor.engine.disk_store"):
        llm, out = _run_and_close(tiny_checkpoint, tmp_path, prompts=PROMPTS[:1])
    assert out == cold[:1]
    report = llm.engine.disk_report()
    assert report["corrupt"] == 1 and report["hits"] == 0  # the first block failed: a cold prefill
    assert "checksum" in caplog.text

    path = _block_path(tmp_path, first, PROMPTS[0], 3)  # block 0 was rewritten at close; cut block 3 short
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    llm, out = _run_and_close(tiny_checkpoint, tmp_path, prompts=PROMPTS[:1])
    assert out == cold[:1]
    report = llm.engine.disk_report()
    assert report["corrupt"] == 1 and report["hits"] == 3  # blocks 0-2 came back, then a prefill


def test_another_kv_dtype_is_rejected_not_used(tiny_checkpoint, tmp_path):
    _run_and_close(tiny_checkpoint, tmp_path, prompts=PROMPTS[:1])
    fp32_cold = _engine(tiny_checkpoint, dtype="float32", enable_prefix_caching=False)
    want = [r.token_ids for r in fp32_cold.generate(PROMPTS[:1], GREEDY)]
    llm, out = _run_and_close(tiny_checkpoint, tmp_path, prompts=PROMPTS[:1], dtype="float32")
    assert out == want
    report = llm.engine.disk_report()
    assert report["rejected"] == 1 and report["hits"] == 0
    # A preload meeting another layout's files stops at the first one (one warning, not one per file).
    other = _engine(tiny_checkpoint, str(tmp_path), dtype="float16", prompt_cache_preload="64M")
    report = other.engine.disk_report()
    assert report["entries"] > 1 and report["rejected"] == 1 and report["preloaded"] == 0
    other.engine.close()


def _tag(**overrides):
    return {"model": "m", "block_size": 16, "tensors": [["bfloat16", [16, 2, 8]]], **overrides}


def test_a_store_rejects_another_block_size_and_another_prefix(tmp_path):
    DiskStore(str(tmp_path), _tag(), None).write(7, (1, 2, 3), b"x" * 64)
    other = DiskStore(str(tmp_path), _tag(block_size=32), None)
    assert other.contains(7) and other.read(7, (1, 2, 3)) is None
    assert other.stats.num_rejected == 1 and not other.contains(7)
    same = DiskStore(str(tmp_path), _tag(), None)
    assert same.read(7, (1, 2, 4)) is None and same.stats.num_rejected == 1  # tokens differ: not this block
    assert bytes(DiskStore(str(tmp_path), _tag(), None).read(7, (1, 2, 3))) == b"x" * 64


def test_the_budget_evicts_the_least_recently_used(tmp_path):
    store = DiskStore(str(tmp_path), _tag(), None)
    size = store.write(1, (1,), b"a" * 1000)
    store = DiskStore(str(tmp_path), _tag(), budget_bytes=3 * size)
    store.write(2, (2,), b"b" * 1000)
    store.write(3, (3,), b"c" * 1000)
    assert store.read(1, (1,)) is not None  # 1 is now the most recent
    store.write(4, (4,), b"d" * 1000)
    assert store.keys() == [3, 1, 4] and store.stats.num_evictions == 1
    assert not os.path.exists(store.path(2))
    # A restart keeps the order (mtime) and the budget.
    again = DiskStore(str(tmp_path), _tag(), budget_bytes=2 * size)
    assert again.keys() == [1, 4] and again.stats.num_bytes == 2 * size


class _StuckStore(DiskStore):
    """Writes wait for `release`: a disk that does not keep up."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.writing, self.release = threading.Event(), threading.Event()

    def write(self, key, tokens, payload, parent=None, kind="kv"):
        self.writing.set()
        assert self.release.wait(60)
        return super().write(key, tokens, payload, parent, kind)


def test_a_full_writer_queue_drops_and_never_waits(tmp_path):
    store = _StuckStore(str(tmp_path), _tag(), None)
    writer = SpillWriter(store, max_queued=2)
    assert writer.offer(1, (1,), b"1")
    assert store.writing.wait(60)  # the writer holds block 1; the queue is empty again
    assert writer.offer(2, (2,), b"2") and writer.offer(3, (3,), b"3")
    assert not writer.has_room()
    assert [writer.offer(k, (k,), b"k") for k in (4, 5, 6)] == [False] * 3  # returned at once, dropped
    assert store.stats.num_dropped == 3
    store.release.set()
    assert writer.flush(timeout=60)
    writer.close()
    assert sorted(store.keys()) == [1, 2, 3] and store.stats.num_writes == 3


@pytest.mark.batch_invariant
def test_quantized_kv_blocks_go_to_disk_as_they_are(tmp_path):
    """q8_0 K/V blocks (int8 rows and scales) spill and come back bitwise; a bf16 engine never reads them."""
    checkpoint = make_tiny_checkpoint(head_dim=32)  # q8_0 needs whole 32-value blocks
    q8 = {"cache_type_k": "q8_0", "cache_type_v": "q8_0"}
    want = [r.token_ids for r in _engine(checkpoint, enable_prefix_caching=False, **q8).generate(PROMPTS, GREEDY)]
    _, out = _run_and_close(checkpoint, tmp_path, **q8)
    assert out == want
    llm, out = _run_and_close(checkpoint, tmp_path, **q8)
    assert out == want
    assert llm.engine.disk_report()["hits"] > 0
    bf16, _ = _run_and_close(checkpoint, tmp_path, prompts=PROMPTS[:1])
    report = bf16.engine.disk_report()
    assert report["hits"] == 0 and report["rejected"] >= 1


def _hold_disk_reads(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """(started, release): every disk read, once on the loader thread, waits for release (and every read
    goes there: the tiny model's blocks would all be small enough to read inline)."""
    monkeypatch.setattr(prefix_reads, "INLINE_READ_BYTES", 0)
    started, release = threading.Event(), threading.Event()
    real = prefix_disk.DiskTier.load_run

    def held(self, *args):
        if threading.current_thread().name.startswith("conveyor-disk-loader"):
            started.set()
            assert release.wait(60)
        return real(self, *args)

    monkeypatch.setattr(prefix_disk.DiskTier, "load_run", held)
    return started, release


@pytest.mark.batch_invariant
def test_a_disk_read_does_not_stall_running_streams(tiny_checkpoint, cold, tmp_path, monkeypatch):
    """A restart's read runs on the loader thread: a stream already decoding keeps stepping while the read
    is held, the request waits, and then takes its prefix from RAM with the cold output; no block is lost."""
    _run_and_close(tiny_checkpoint, tmp_path)
    started, release = _hold_disk_reads(monkeypatch)
    llm = _engine(tiny_checkpoint, str(tmp_path))
    engine = llm.engine
    other = engine.make_request(llm.tokenizer.encode("Rivers, hills and a long road. " * 3), GREEDY)
    engine.add_request(other)
    engine.step()  # the other prompt (never cached) is admitted before the disk hit arrives
    hit = engine.make_request(llm.tokenizer.encode(PROMPTS[0]), GREEDY)
    engine.add_request(hit)
    steps = 0
    while not started.is_set() or steps < 3:  # the read starts at the next schedule, then stays held
        assert any(out.request_id == other.request_id for out in engine.step()), "the running stream stalled"
        steps += 1
    assert engine.kv.disk_reads.in_flight(hit.request_id) and hit.num_computed_tokens == 0
    release.set()
    tokens = {other.request_id: [], hit.request_id: []}
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert tokens[hit.request_id] == cold[0]
    assert engine.disk_report()["hits"] > 0 and hit.num_cached_tokens >= 16 * 4
    engine.kv.check_integrity()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    engine.close()


def test_an_aborted_request_s_read_still_returns_its_blocks(tiny_checkpoint, tmp_path, monkeypatch):
    """Aborting the request whose read is in flight: the read ends, its blocks are published to the prefix
    cache (they are valid), and the pool gets every block back."""
    _run_and_close(tiny_checkpoint, tmp_path)
    started, release = _hold_disk_reads(monkeypatch)
    llm = _engine(tiny_checkpoint, str(tmp_path))
    engine = llm.engine
    request = engine.make_request(llm.tokenizer.encode(PROMPTS[0]), GREEDY)
    engine.add_request(request)
    engine.step()
    assert started.wait(60) and engine.kv.disk_reads_pending
    assert engine.abort(request.request_id) is not None
    assert engine.has_work()  # the read still owns blocks: the loop keeps reaping
    release.set()
    while engine.has_work():
        engine.step()
    engine.kv.check_integrity()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    assert engine.disk_report()["hits"] > 0
    assert not engine.kv.disk_reads.take_done(request.request_id)  # nothing kept for a request that is gone
    engine.close()


@pytest.mark.batch_invariant
def test_a_start_preloads_recent_blocks_into_ram(tiny_checkpoint, cold, tmp_path):
    """--prompt-cache-preload: a restart reads the newest blocks into the RAM prefix cache before any request,
    so the first request hits RAM (no read on its way) with the cold output; a corrupt file is skipped alone."""
    _run_and_close(tiny_checkpoint, tmp_path)
    bad = _block_path(tmp_path, _engine(tiny_checkpoint), PROMPTS[1], 5)
    with open(bad, "r+b") as f:
        f.seek(100)
        f.write(b"\xff\x00\xff")
    llm = _engine(tiny_checkpoint, str(tmp_path), prompt_cache_preload="64M")
    report = llm.engine.disk_report()
    entries = report["entries"] + report["corrupt"]  # the bad file was dropped from the index as it was read
    assert report["preloaded"] == report["hits"] == entries - 1 and report["corrupt"] == 1
    assert llm.engine.pool.num_cached_free_blocks == report["preloaded"]
    results = llm.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in results] == cold
    assert llm.engine.disk_report()["hits"] == report["hits"]  # every hit came from RAM
    assert results[0].num_cached_tokens >= 16 * 4
    llm.engine.kv.check_integrity()
    llm.engine.close()

    small = _engine(tiny_checkpoint, str(tmp_path), prompt_cache_preload=str(2 * llm.engine.disk.block_bytes))
    assert small.engine.disk_report()["preloaded"] == 2  # the byte bound holds
    small.engine.close()


@pytest.mark.batch_invariant
def test_preloaded_blocks_serve_a_prompt_that_ends_inside_one(tiny_checkpoint, tmp_path):
    """Block files carry their parent's key, so a preloaded block is a partial-block candidate too: a prompt
    ending 7 tokens into a stored block adopts those tokens after a restart, with the no-cache output."""
    _run_and_close(tiny_checkpoint, tmp_path)
    llm = _engine(tiny_checkpoint, str(tmp_path), prompt_cache_preload="64M")
    ids = llm.tokenizer.encode(PROMPTS[0])
    block_size = llm.engine.kv.block_size
    prompt = ids[:(len(ids) // block_size - 1) * block_size + 7]  # ends 7 tokens into the last stored block
    plain = _engine(tiny_checkpoint, enable_prefix_caching=False)
    expected = plain.generate([prompt], GREEDY)[0].token_ids
    result = llm.generate([prompt], GREEDY)[0]
    assert result.token_ids == expected
    assert llm.engine.kv.counters.partial_hit_tokens == 6  # the last prompt token always runs
    assert result.num_cached_tokens == len(prompt) - 1
    llm.engine.close()


def test_files_of_every_kind_share_one_budget_and_keep_their_kind(tmp_path):
    """Sliding blocks and state snapshots are files of their own kind in the same directory: one LRU and
    budget over all, each kind found again by a restart and preloaded only as its own kind."""
    from conveyor.engine.disk_store import SUFFIXES

    store = DiskStore(str(tmp_path), _tag(), budget_bytes=None)
    size = store.write(1, (1,), b"a" * 1000)
    store.write(2, (2,), b"b" * 1000, kind="window")
    store.write(3, (), b"c" * 1000, kind="state")
    assert store.path(2).endswith(SUFFIXES["window"]) and store.path(3).endswith(SUFFIXES["state"])
    again = DiskStore(str(tmp_path), _tag(), budget_bytes=2 * size + 100)  # a restart, with room for two
    assert again.keys() == [2, 3] and not os.path.exists(store.path(1))  # the oldest went, whatever its kind
    assert again.recent_keys(10) == [] and again.recent_keys(10, "window") == [2]
    assert again.read(3, ()) == b"c" * 1000 and again.read(2, (2,)) == b"b" * 1000
