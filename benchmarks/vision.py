"""Images through the server (issue #42): conveyor against llama-server on the same GGUF + mmproj files.

Usage:
  python benchmarks/vision.py --llama-server PATH [--shape gemma3-4b|qwen3.5-2b] [--models-dir DIR] [--concurrency 16]
                              [--json benchmarks/results/vision_xeon_amx.json] [--only conveyor|llama-server]

Files (written once under --models-dir, not in the repo), random weights in the shapes of Gemma 3 4B:
  gemma3-4b-shape-Q4_K_M.gguf   the text tower (hidden 2560, 34 layers, 8 / 4 heads of 256, FFN 10240, sliding
                                window 1024 on 5 of every 6 layers, linear rope scaling 8 on the others) in Q4_K_M's
                                mix (Q6_K token embedding, attn_v and ffn_down; Q4_K the rest), random blocks, with
                                the real Gemma 3 tokenizer and chat template copied from the gemma3-270m package
  mmproj-gemma3-4b-shape-f16.gguf  SigLIP-so400m at 896 px (patch 14, 27 layers, width 1152, FFN 4304) and Gemma 3's
                                projector (4x4 average pool to 256 tokens, RMSNorm, 1152 -> 2560), as llama.cpp's
                                converter writes them (F16 matrices; F32 embeddings, norms and biases)

`--shape qwen3.5-2b`: the Qwen3.5-2B-shaped text GGUF (Q4_K_M) and its mmproj as benchmarks/vision_qwen35_files.py
writes them (the mmproj by llama.cpp's own converter).

Measurements, each server alone on the machine, greedy, OpenAI chat requests with the image as a PNG data URL:
  one         one request with a fresh image: time to its first token (TTFT)
  concurrent  N requests at once, each its own image, 16 tokens each: wall time, images per second, mean TTFT
  same image  a first request on one image, then N at once about that image (each its own question): their mean
              TTFT, against the same N on a server without the image prefix cache (conveyor --no-vlm-prefix-cache)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import gguf
import httpx
import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from quantized import copy_tokenizer, machine  # noqa: E402  (a sibling script)
from server_process import ServerProcess, free_port  # noqa: E402

from conveyor.testing import gemma3_270m_path, random_blocks  # noqa: E402

Q4_K, Q6_K = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K
TEXT = dict(hidden=2560, layers=34, heads=8, kv_heads=4, head_dim=256, ffn=10240, window=1024, ctx=8192)
VISION = dict(image=896, patch=14, layers=27, width=1152, ffn=4304, heads=16, tokens=256)
TEXT_FILE, MMPROJ_FILE = "gemma3-4b-shape-Q4_K_M.gguf", "mmproj-gemma3-4b-shape-f16.gguf"
QUESTIONS = ["What is in this picture?", "Describe the colours.", "Is there a person?", "What shape dominates?",
             "Count the objects.", "Where was it taken?", "Is it day or night?", "What is the mood?"]


def write_text_model(path: Path, seed: int = 0) -> None:
    """The Gemma 3 4B-shaped text tower in Q4_K_M's mix (random blocks, unit norms), the real tokenizer."""
    rng = np.random.default_rng(seed)
    t = TEXT
    donor = gguf.GGUFReader(gemma3_270m_path())
    vocab = len(donor.fields["tokenizer.ggml.tokens"].data)
    tmp = path.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), "gemma3")
    w.add_name(path.stem)
    w.add_context_length(t["ctx"])
    w.add_embedding_length(t["hidden"])
    w.add_block_count(t["layers"])
    w.add_feed_forward_length(t["ffn"])
    w.add_head_count(t["heads"])
    w.add_head_count_kv(t["kv_heads"])
    w.add_key_length(t["head_dim"])
    w.add_value_length(t["head_dim"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0)
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(8.0)
    w.add_sliding_window(t["window"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    copy_tokenizer(w, donor)

    def matrix(name: str, rows: int, cols: int) -> None:
        qtype = Q6_K if name.endswith(("token_embd.weight", ".attn_v.weight", ".ffn_down.weight")) else Q4_K
        w.add_tensor(name, random_blocks(rows, cols, qtype, rng, 0.02), raw_dtype=qtype)

    def norm(name: str, size: int) -> None:  # the converter stores Gemma's 1 + w: ones are unit scales
        w.add_tensor(name, np.ones(size, np.float32))

    hidden, q, kv = t["hidden"], t["heads"] * t["head_dim"], t["kv_heads"] * t["head_dim"]
    matrix("token_embd.weight", vocab, hidden)
    for i in range(t["layers"]):
        p = f"blk.{i}."
        for name in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            norm(p + name + ".weight", hidden)
        norm(p + "attn_q_norm.weight", t["head_dim"])
        norm(p + "attn_k_norm.weight", t["head_dim"])
        matrix(p + "attn_q.weight", q, hidden)
        matrix(p + "attn_k.weight", kv, hidden)
        matrix(p + "attn_v.weight", kv, hidden)
        matrix(p + "attn_output.weight", hidden, q)
        matrix(p + "ffn_gate.weight", t["ffn"], hidden)
        matrix(p + "ffn_up.weight", t["ffn"], hidden)
        matrix(p + "ffn_down.weight", hidden, t["ffn"])
    norm("output_norm.weight", hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(path)


def write_mmproj(path: Path, seed: int = 1) -> None:
    """SigLIP-so400m + Gemma 3's projector under llama.cpp's converter names and types (Gemma3VisionModel)."""
    rng = np.random.default_rng(seed)
    v = VISION
    width, patches = v["width"], (v["image"] // v["patch"]) ** 2

    def normal(*shape: int, dtype=np.float16) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(dtype)

    tmp = path.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), "clip")
    w.add_string("clip.projector_type", "gemma3")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_uint32("clip.vision.image_size", v["image"])
    w.add_uint32("clip.vision.patch_size", v["patch"])
    w.add_uint32("clip.vision.embedding_length", width)
    w.add_uint32("clip.vision.feed_forward_length", v["ffn"])
    w.add_uint32("clip.vision.block_count", v["layers"])
    w.add_uint32("clip.vision.projection_dim", TEXT["hidden"])
    w.add_uint32("clip.vision.attention.head_count", v["heads"])
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    w.add_bool("clip.use_gelu", True)
    w.add_tensor("v.patch_embd.weight", normal(width, 3, v["patch"], v["patch"], dtype=np.float32))
    w.add_tensor("v.patch_embd.bias", np.zeros(width, np.float32))
    w.add_tensor("v.position_embd.weight", normal(patches, width, dtype=np.float32))
    for i in range(v["layers"]):
        p = f"v.blk.{i}."
        for name in ("ln1", "ln2"):
            w.add_tensor(p + name + ".weight", np.ones(width, np.float32))
            w.add_tensor(p + name + ".bias", np.zeros(width, np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            w.add_tensor(p + name + ".weight", normal(width, width))
            w.add_tensor(p + name + ".bias", np.zeros(width, np.float32))
        w.add_tensor(p + "ffn_up.weight", normal(v["ffn"], width))
        w.add_tensor(p + "ffn_up.bias", np.zeros(v["ffn"], np.float32))
        w.add_tensor(p + "ffn_down.weight", normal(width, v["ffn"]))
        w.add_tensor(p + "ffn_down.bias", np.zeros(width, np.float32))
    w.add_tensor("v.post_ln.weight", np.ones(width, np.float32))
    w.add_tensor("v.post_ln.bias", np.zeros(width, np.float32))
    w.add_tensor("mm.soft_emb_norm.weight", np.ones(width, np.float32))  # stored as 1 + w, w = 0
    w.add_tensor("mm.input_projection.weight", normal(width, TEXT["hidden"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(path)


def ensure_files(folder: Path) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    text, mmproj = folder / TEXT_FILE, folder / MMPROJ_FILE
    if not text.exists():
        write_text_model(text)
    if not mmproj.exists():
        write_mmproj(mmproj)
    return text, mmproj


def image_url(seed: int) -> str:
    """A 640x480 PNG with shapes and noise (each seed its own picture), as a data URL."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:480, 0:640]
    base = np.stack([(x * (1 + seed % 3)) % 256, (y * (2 + seed % 5)) % 256, ((x + y) * (seed % 7 + 1)) % 256], -1)
    pixels = np.clip(base + rng.integers(-20, 20, base.shape), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


class Server(ServerProcess):
    def __init__(self, kind: str, text: Path, mmproj: Path, concurrency: int, binary: str | None, log: Path,
                 extra: list[str] | None = None) -> None:
        port = free_port()
        ctx = concurrency * 1024
        if kind == "conveyor":
            cmd = [sys.executable, "-m", "conveyor.cli", "serve", "--model", str(text), "--mmproj", str(mmproj),
                   "--port", str(port), "--parallel", str(concurrency), "--ctx-size", str(ctx), "--no-webui",
                   "--speculative-ngram", "0", *(extra or [])]
        else:
            cmd = [binary, "-m", str(text), "--mmproj", str(mmproj), "--port", str(port), "-np", str(concurrency),
                   "-c", str(ctx), "--threads", str(os.cpu_count()), "--no-webui", *(extra or [])]
        super().__init__(cmd, port, log, env={**os.environ, "CONVEYOR_REQUIRE_KERNELS": "1"}, name=kind)


async def ask(client: httpx.AsyncClient, url: str, image: str, question: str, max_tokens: int) -> dict:
    """One streamed greedy chat about `image`: its TTFT, end time and text."""
    body = {"model": "m", "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                      {"type": "text", "text": question}]}]}
    start, first, text = time.perf_counter(), None, []
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=3600) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{reply.status_code}: {(await reply.aread())[:300]!r}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            delta = choices[0].get("delta", {}).get("content") if choices else None
            if delta:
                first = first or time.perf_counter()
                text.append(delta)
    end = time.perf_counter()
    return {"ttft": (first or end) - start, "end": end - start, "text": "".join(text)}


async def measure(server: Server, concurrency: int, seed_base: int, same_image_only: bool = False,
                  same_image: bool = True) -> dict:
    result = {}
    async with httpx.AsyncClient() as client:
        await ask(client, server.url, image_url(seed_base), "Warm up.", 2)  # kernels, the tower's first run
        if not same_image_only:
            one = await ask(client, server.url, image_url(seed_base + 1), QUESTIONS[0], 1)
            start = time.perf_counter()
            many = await asyncio.gather(*(ask(client, server.url, image_url(seed_base + 10 + i),
                                              QUESTIONS[i % len(QUESTIONS)], 16) for i in range(concurrency)))
            wall = time.perf_counter() - start
            result["one_ttft_s"] = one["ttft"]
            result["concurrent"] = {"n": concurrency, "wall_s": wall, "images_per_s": concurrency / wall,
                                    "mean_ttft_s": statistics.mean(r["ttft"] for r in many)}
        if not same_image:
            return result
        shared = image_url(seed_base + 100)
        first = await ask(client, server.url, shared, QUESTIONS[0], 1)
        same = await asyncio.gather(*(ask(client, server.url, shared, f"{QUESTIONS[i % len(QUESTIONS)]} ({i})", 1)
                                      for i in range(concurrency)))
    result["same_image"] = {"first_ttft_s": first["ttft"], "mean_ttft_s": statistics.mean(r["ttft"] for r in same)}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=("gemma3-4b", "qwen3.5-2b"), default="gemma3-4b",
                   help="the files: Gemma 3 4B's shape (written here) or Qwen3.5-2B's (benchmarks/vision_qwen35_files.py)")
    p.add_argument("--models-dir", type=Path, help="default /tmp/vision-bench (Gemma 3), /tmp/vision-bench-qwen35")
    p.add_argument("--llama-server", help="the llama-server binary (built with mtmd: benchmarks/quantized.py)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--only", choices=("conveyor", "llama-server"))
    p.add_argument("--json", type=Path, help="default benchmarks/results/vision_xeon_amx.json (Gemma 3), "
                                              "vision_qwen35_xeon_amx.json")
    p.add_argument("--no-llama-server-same-image", action="store_true",
                   help="skip llama-server's same-image part (its bar is against conveyor without the cache; "
                        "at C=16 llama-server spends ~12 min on it)")
    args = p.parse_args()
    qwen = args.shape == "qwen3.5-2b"
    args.models_dir = args.models_dir or Path("/tmp/vision-bench-qwen35" if qwen else "/tmp/vision-bench")
    args.json = args.json or ROOT / "benchmarks/results" / ("vision_qwen35_xeon_amx.json" if qwen
                                                            else "vision_xeon_amx.json")
    if qwen:  # the mmproj comes from llama.cpp's own converter: the llama-server binary's source tree
        from vision_qwen35_files import ensure_files as ensure_qwen35_files
        if not args.llama_server:
            raise SystemExit("--shape qwen3.5-2b needs --llama-server (its llama.cpp tree converts the mmproj)")
        text, mmproj = ensure_qwen35_files(args.models_dir, Path(args.llama_server).resolve().parents[2])
    else:
        text, mmproj = ensure_files(args.models_dir)
    runs = {}
    if args.only and args.json.exists():  # one side now, the other's runs kept from an earlier --only
        earlier = json.loads(args.json.read_text())
        if earlier.get("shape", "gemma3-4b") == args.shape:
            runs = {k: v for k, v in earlier["runs"].items() if not k.startswith(args.only)}
    kinds = [args.only] if args.only else ["conveyor", "llama-server"]
    for kind in kinds:
        variants = [("", [])] + ([("no_prefix_cache", ["--no-vlm-prefix-cache"])] if kind == "conveyor" else [])
        for suffix, extra in variants:
            name = kind + (f"_{suffix}" if suffix else "")
            server = Server(kind, text, mmproj, args.concurrency, args.llama_server, args.models_dir / f"{name}.log",
                            extra)
            try:
                same = not (kind == "llama-server" and args.no_llama_server_same_image)
                runs[name] = asyncio.run(measure(server, args.concurrency, seed_base=0, same_image_only=bool(suffix),
                                                 same_image=same))
            finally:
                server.stop()
            print(name, json.dumps(runs[name]), flush=True)
    result = {"machine": machine(), "python": platform.python_version(), "shape": args.shape,
              "files": [str(text), str(mmproj)],
              "runs": runs}
    if "conveyor" in runs and "llama-server" in runs:
        ours, theirs = runs["conveyor"], runs["llama-server"]
        result["ratios"] = {"one_ttft": theirs["one_ttft_s"] / ours["one_ttft_s"],
                            "concurrent_throughput": ours["concurrent"]["images_per_s"]
                            / theirs["concurrent"]["images_per_s"]}
    if "conveyor_no_prefix_cache" in runs:
        result.setdefault("ratios", {})["same_image_mean_ttft_vs_no_cache"] = (
            runs["conveyor_no_prefix_cache"]["same_image"]["mean_ttft_s"] / runs["conveyor"]["same_image"]["mean_ttft_s"])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    print(json.dumps(result.get("ratios", {}), indent=1))


if __name__ == "__main__":
    main()
