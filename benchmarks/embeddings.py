"""Embedding throughput: conveyor vs llama-server --embeddings on the same Q8_0 GGUF, and vs
sentence-transformers' encode on the same weights in fp32 (issue #41).

The model is Qwen3-Embedding-0.6B's shape with random weights (28 layers, hidden 1024, 16 query / 8 KV heads
of 128, MLP 3072; last-token pooling, normalised), saved as sentence-transformers saves it, with SmolLM2's
tokenizer standing in for Qwen's (a 49k instead of a 151k vocabulary: the embedding table is a lookup, so the
compute per token is the same). llama.cpp's own converter turns it into the Q8_0 GGUF both servers load (it
writes `qwen3.pooling_type` = last from the sentence-transformers files).

The texts are ~200-token passages of the Python standard library's docstrings. Each server gets them as
`--clients` concurrent clients posting `--batch` texts per /v1/embeddings request, as a RAG indexer does.

`--kind minilm` writes all-MiniLM-L6-v2's shape instead (a BERT: 6 layers, hidden 384, mean pooling) with a
30,522-piece WordPiece vocabulary made from the same docstrings.

  python benchmarks/embeddings.py --write /work/bench-models/qwen3-embedding-shape   # HF dir + Q8_0 GGUF
  python benchmarks/embeddings.py --dir /work/bench-models/qwen3-embedding-shape --texts 1000 \
      --out benchmarks/results/embeddings_qwen3_06b_xeon_amx.json
  python benchmarks/embeddings.py --write /work/bench-models/minilm-shape --kind minilm
  python benchmarks/embeddings.py --dir /work/bench-models/minilm-shape --texts 1000
  python benchmarks/embeddings.py --dir /work/bench-models/qwen3-embedding-shape --itl   # chats during a burst
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import itertools
import json
import os
import pkgutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantized import _free_port, _stop, _wait_healthy, machine  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CHAT_TOKENS = 256  # each --itl chat's length: the streams start a new one when one ends
QWEN3_EMBEDDING_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                           num_key_value_heads=8, head_dim=128, max_position_embeddings=32768, rope_theta=1000000.0,
                           tie_word_embeddings=True, rms_norm_eps=1e-6)


def write_model(out: Path, llama_src: Path, converter_libs: Path) -> None:
    """The HF directory (fp32 safetensors + sentence-transformers files) and its Q8_0 GGUF."""
    import torch
    import transformers

    from conveyor.testing import smollm_tokenizer

    hf = out / "hf"
    tokenizer = smollm_tokenizer()
    config = transformers.Qwen3Config(vocab_size=tokenizer.vocab_size, **QWEN3_EMBEDDING_06B)
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.02)
    model.save_pretrained(hf)
    tokenizer.backend.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
        "model_max_length": 32768}))
    (hf / "1_Pooling").mkdir(exist_ok=True)
    (hf / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 1024,
                                                             "pooling_mode_lasttoken": True}))
    (hf / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    gguf_path = out / "qwen3-embedding-0.6b-shape-Q8_0.gguf"
    # The converter imports sentencepiece before it falls back to tokenizer.json: it comes from --converter-libs
    # (`pip install --target DIR sentencepiece`), kept out of the project's venv.
    subprocess.run([sys.executable, str(llama_src / "convert_hf_to_gguf.py"), str(hf), "--outtype", "q8_0",
                    "--outfile", str(gguf_path)], check=True,
                   env={**os.environ, "PYTHONPATH": f"{llama_src / 'gguf-py'}:{converter_libs}"})
    print(f"wrote {hf} and {gguf_path}")


MINILM = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
              max_position_embeddings=512, type_vocab_size=2, pad_token_id=0)  # all-MiniLM-L6-v2's shape
# Lets llama.cpp's converter take a WordPiece vocabulary it has no hash for: the hash only names tokenizer.ggml.pre,
# which llama.cpp ignores for `bert` (WPM) vocabularies.
CONVERT_ANY_VOCAB = """import runpy, sys
sys.path[:0] = [{src!r}, {src!r} + "/gguf-py", {libs!r}]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
sys.argv = [{src!r} + "/convert_hf_to_gguf.py", *sys.argv[1:]]
runpy.run_path({src!r} + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def write_minilm(out: Path, llama_src: Path, converter_libs: Path) -> None:
    """all-MiniLM-L6-v2's shape with random weights and a 30,522-piece WordPiece vocabulary made from the standard
    library's docstrings (mean pooling, normalised), and its Q8_0 GGUF."""
    import collections

    import tokenizers
    import torch
    import transformers
    from tokenizers import models, normalizers, pre_tokenizers, processors

    hf = out / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    # bert-base-uncased's layout: [PAD] 0, [unused*], [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103 (the ids
    # llama.cpp assumes for a `bert` vocabulary whose file names no CLS / SEP)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    head = ["[PAD]"] + [f"[unused{i}]" for i in range(99)] + specials[1:]
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789.,;:!?'\"()[]{}<>=+-*/_#@$%&|~`^")
    counts = collections.Counter(w for w in " ".join(_docstring_words(2_000_000)).lower().split() if w.isalpha())
    words = [w for w, _ in counts.most_common() if len(w) > 1][:30522 - len(head) - 2 * len(chars)]
    vocab_list = head + chars + [f"##{c}" for c in chars] + words
    vocab_list += [f"[unused{i}]" for i in range(99, 99 + 30522 - len(vocab_list))]
    tok = tokenizers.Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab_list)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", 101), ("[SEP]", 102)])
    tok.add_special_tokens(specials)
    tok.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512, "pad_token": "[PAD]",
        "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]"}))
    config = transformers.BertConfig(vocab_size=len(vocab_list), **MINILM)
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=False)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "LayerNorm" not in name:
                param.normal_(0, 0.02)
    model.save_pretrained(hf)
    (hf / "1_Pooling").mkdir(exist_ok=True)
    (hf / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 384,
                                                             "pooling_mode_mean_tokens": True}))
    (hf / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    gguf_path = out / "minilm-l6-shape-Q8_0.gguf"
    subprocess.run([sys.executable, "-c", CONVERT_ANY_VOCAB.format(src=str(llama_src), libs=str(converter_libs)),
                    str(hf), "--outtype", "q8_0", "--outfile", str(gguf_path)], check=True)
    print(f"wrote {hf} and {gguf_path}")


def _docstring_words(limit: int) -> list[str]:
    """Words of the standard library's docstrings, up to `limit` of them."""
    words: list[str] = []
    # (the standard library only: some installed packages act on sys.argv when imported)
    for info in sorted(pkgutil.iter_modules(), key=lambda m: m.name):
        if len(words) > limit:
            break
        if (info.name not in sys.stdlib_module_names or info.name.startswith("_")
                or info.name in ("antigravity", "this", "idlelib", "tkinter", "turtle")):
            continue
        try:
            module = importlib.import_module(info.name)
        except Exception:  # noqa: BLE001 (a module that does not import here has no text for us)
            continue
        for _, obj in inspect.getmembers(module):
            doc = inspect.getdoc(obj) if callable(obj) else None
            if doc:
                words += doc.split()
    return words


def passages(count: int, tokens: int) -> list[str]:
    """`count` texts of about `tokens` SmolLM2 tokens each, cut from the standard library's docstrings."""
    from conveyor.testing import smollm_tokenizer

    words = _docstring_words(count * tokens)
    tokenizer = smollm_tokenizer()
    texts, at = [], 0
    step = max(int(tokens * 0.7), 1)  # ~0.7 words per token in English prose with code
    while len(texts) < count:
        text = " ".join(words[at:at + step])
        at = (at + step) % max(len(words) - step, 1)
        ids = tokenizer.encode(text, add_special_tokens=False)[:tokens]
        texts.append(tokenizer.decode(ids))
    return texts


async def _post_all(url: str, model: str, texts: list[str], batch: int, clients: int) -> list[list[float]]:
    vectors: list[list[float] | None] = [None] * len(texts)
    batches = [list(range(i, min(i + batch, len(texts)))) for i in range(0, len(texts), batch)]
    queue: asyncio.Queue = asyncio.Queue()
    for b in batches:
        queue.put_nowait(b)

    async def client() -> None:
        async with httpx.AsyncClient(timeout=3600) as http:
            while not queue.empty():
                indices = queue.get_nowait()
                reply = await http.post(f"{url}/v1/embeddings", json={
                    "model": model, "input": [texts[i] for i in indices], "encoding_format": "float"})
                reply.raise_for_status()
                for item in reply.json()["data"]:
                    vectors[indices[item["index"]]] = item["embedding"]

    await asyncio.gather(*(client() for _ in range(clients)))
    return vectors  # type: ignore[return-value]


def bench_server(name: str, cmd: list[str], url: str, texts: list[str], args, log: Path) -> dict:
    print(f"{name}: {' '.join(cmd)}", flush=True)
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(url, proc, 600)
            asyncio.run(_post_all(url, "m", texts[:args.batch], args.batch, 1))  # warm-up
            start = time.perf_counter()
            vectors = asyncio.run(_post_all(url, "m", texts, args.batch, args.clients))
            seconds = time.perf_counter() - start
        finally:
            _stop(proc)
    return {"server": name, "seconds": seconds, "texts_per_s": len(texts) / seconds, "vectors": vectors,
            "command": " ".join(cmd)}


def bench_sentence_transformers(hf: Path, texts: list[str], args) -> dict:
    """In a child process (its own memory and threads): encode() in fp32, batch --batch."""
    code = f"""
import json, sys, time, torch
from sentence_transformers import SentenceTransformer
torch.set_num_threads({args.threads})
texts = json.load(sys.stdin)
model = SentenceTransformer({str(hf)!r}, device="cpu")
model.encode(texts[:{args.batch}], batch_size={args.batch})
start = time.perf_counter()
vectors = model.encode(texts, batch_size={args.batch}, convert_to_numpy=True)
print(json.dumps({{"seconds": time.perf_counter() - start, "vectors": vectors.tolist()}}))
"""
    print("sentence-transformers: encode() fp32", flush=True)
    done = subprocess.run([sys.executable, "-c", code], input=json.dumps(texts), capture_output=True, text=True,
                          check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {"server": "sentence-transformers (fp32)", "seconds": result["seconds"],
            "texts_per_s": len(texts) / result["seconds"], "vectors": result["vectors"],
            "command": f"SentenceTransformer.encode(batch_size={args.batch}), torch threads {args.threads}"}


async def _chat_until(client: httpx.AsyncClient, url: str, model: str, prompt: str, stop: asyncio.Event,
                      arrivals: list[list[float]]) -> None:
    """Greedy streaming completions of CHAT_TOKENS tokens, one after another until `stop` is set; each one's token
    arrival times are a list in `arrivals`. Chats of a fixed length keep the contexts' spread the same before and
    during the burst (one endless chat would step slower as its context grows, burst or not)."""
    for n in itertools.count():
        body = {"model": model, "prompt": f"{prompt} part {n}.", "max_tokens": CHAT_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True}
        times: list[float] = []
        arrivals.append(times)
        async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=3600) as reply:
            async for line in reply.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    times.append(time.perf_counter())
                if stop.is_set():
                    return


async def measure_chat_itl_during_burst(gguf_path: Path, texts: list[str], args) -> dict:
    """One server with two models: SmolLM2 streams 4 greedy chats at a time; meanwhile the embedder gets `texts`.
    The chats' inter-token gaps before the burst against those during it (p50, p99)."""
    from multi_model import Server
    from quantized import smollm2_path

    smol = smollm2_path()
    # a preset per model (llama-server's INI): the embedder may get its own --threads
    preset = Path("/tmp/bench_embed_itl.ini")
    embedder_threads = f"threads = {args.embedder_threads}\n" if args.embedder_threads else ""
    preset.write_text(f"[{smol.stem}]\nmodel = {smol}\nparallel = 4\nctx-size = 16384\n\n"
                      f"[{gguf_path.stem}]\nmodel = {gguf_path}\nparallel = 4\nctx-size = 16384\n{embedder_threads}")
    share = ["--models-background-share", str(args.background_share)] if args.background_share else []
    server = Server(["--models-preset", str(preset), "--models-max", "2", *share], Path("/tmp/bench_embed_itl.log"))
    try:
        async with httpx.AsyncClient() as client:
            await _post_all(server.url, gguf_path.stem, texts[:4], 4, 1)  # loads the embedder
            stop, streams = asyncio.Event(), [[] for _ in range(4)]
            tasks = [asyncio.ensure_future(_chat_until(client, server.url, smol.stem, f"Story {i}:", stop, arrivals))
                     for i, arrivals in enumerate(streams)]
            await asyncio.sleep(10)  # the 'before' window (after the first tokens)
            t_burst = time.perf_counter()
            await _post_all(server.url, gguf_path.stem, texts, args.batch, args.clients)
            t_done = time.perf_counter()
            stop.set()
            await asyncio.gather(*tasks)
    finally:
        server.stop()

    def gaps(lo: float, hi: float) -> list[float]:  # within one completion (not the wait for the next one's first)
        return [(b - a) * 1000 for chats in streams for s in chats for a, b in zip(s, s[1:]) if lo <= b <= hi]

    before, during = gaps(t_burst - 6, t_burst), gaps(t_burst, t_done)
    q = lambda xs, p: float(np.percentile(xs, p))  # noqa: E731
    return {"burst_s": t_done - t_burst, "texts": len(texts), "texts_per_s": len(texts) / (t_done - t_burst),
            "embedder_threads": args.embedder_threads, "background_share": args.background_share or "default",
            "itl_ms_before": {"p50": q(before, 50), "p99": q(before, 99), "n": len(before)},
            "itl_ms_during": {"p50": q(during, 50), "p99": q(during, 99), "n": len(during)},
            "p99_ratio": q(during, 99) / q(before, 99)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", type=Path, help="write the model (HF dir + Q8_0 GGUF) into this directory and stop")
    p.add_argument("--kind", choices=("qwen3-embedding", "minilm"), default="qwen3-embedding",
                   help="with --write: Qwen3-Embedding-0.6B's shape, or all-MiniLM-L6-v2's (a BERT)")
    p.add_argument("--llama-src", type=Path, default=next(iter(sorted(
        Path("/work/llama-src").glob("llama_cpp_python-*/vendor/llama.cpp"))), None))
    p.add_argument("--converter-libs", type=Path, default=Path("/work/bench-pylibs"),
                   help="a pip --target dir with sentencepiece, for llama.cpp's converter")
    p.add_argument("--dir", type=Path, help="the directory --write made")
    p.add_argument("--texts", type=int, default=1000)
    p.add_argument("--tokens", type=int, default=200, help="tokens per text")
    p.add_argument("--batch", type=int, default=32, help="texts per request")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--parallel", type=int, default=8, help="slots of each server")
    p.add_argument("--llama-server", default="/work/llama-native/bin/llama-server")
    p.add_argument("--runs", default="conveyor,llama-server,sentence-transformers")
    p.add_argument("--itl", action="store_true", help="instead: 4 SmolLM2 chats' inter-token latency while the "
                   "texts are embedded by the same server (two models)")
    p.add_argument("--embedder-threads", type=int, default=0,
                   help="with --itl: the embedder's own --threads (0: the default, every core)")
    p.add_argument("--background-share", type=float, default=0,
                   help="with --itl: the server's --models-background-share (0: its default)")
    p.add_argument("--out", help="JSON results (vectors left out)")
    args = p.parse_args()
    if args.write:
        writer = write_minilm if args.kind == "minilm" else write_model
        writer(args.write, args.llama_src, args.converter_libs)
        return
    gguf_path = next(args.dir.glob("*-Q8_0.gguf"))
    texts = passages(args.texts, args.tokens)
    if args.itl:
        result = asyncio.run(measure_chat_itl_during_burst(gguf_path, texts, args))
        print(json.dumps(result, indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps({"machine": machine(), **result}, indent=1))
        return
    results = []
    for run in args.runs.split(","):
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        if run == "conveyor":
            cmd = [sys.executable, "-m", "conveyor.cli", "serve", "--model", str(gguf_path), "--parallel",
                   str(args.parallel), "--host", "127.0.0.1", "--port", str(port)]
            results.append(bench_server(run, cmd, url, texts, args, Path("/tmp/bench_embed_conveyor.log")))
        elif run == "llama-server":
            cmd = [args.llama_server, "-m", str(gguf_path), "--embeddings", "-np", str(args.parallel), "-c",
                   str(args.parallel * 512), "-b", "2048", "-ub", "2048", "-t", str(args.threads), "--host",
                   "127.0.0.1", "--port", str(port)]
            results.append(bench_server(run, cmd, url, texts, args, Path("/tmp/bench_embed_llama.log")))
        else:
            results.append(bench_sentence_transformers(args.dir / "hf", texts, args))
        print(f"  {results[-1]['texts_per_s']:.2f} texts/s ({results[-1]['seconds']:.1f} s)", flush=True)
    reference = np.asarray(results[0]["vectors"], dtype=np.float32)
    for r in results:
        vectors = np.asarray(r.pop("vectors"), dtype=np.float32)
        cos = (vectors * reference).sum(-1) / np.linalg.norm(vectors, axis=-1) / np.linalg.norm(reference, axis=-1)
        r["min_cosine_vs_first"] = float(cos.min())
    lines = [f"machine: {machine()}", f"{len(texts)} texts of ~{args.tokens} tokens, batch {args.batch}, "
             f"{args.clients} clients", "", "| run | s | texts/s | first run's speedup over it | min cosine vs first |", "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['server']} | {r['seconds']:.1f} | {r['texts_per_s']:.2f} | "
                     f"{r['seconds'] / results[0]['seconds']:.2f}x | {r['min_cosine_vs_first']:.4f} |")
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": machine(), "texts": len(texts), "tokens": args.tokens,
                                              "batch": args.batch, "clients": args.clients, "results": results},
                                             indent=1))


if __name__ == "__main__":
    main()
