"""The backend object: resolved once, honest about what it guarantees, and a torch fallback that serves."""

import json
import subprocess
import sys

import pytest
import torch

from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams
from conveyor.kernels import KernelSettings, KernelsRequiredError, resolve_backend
from conveyor.kernels import build


def test_torch_fallback_says_invariance_and_speculation_are_off(tiny_checkpoint, caplog):
    llm = LLM(checkpoint=tiny_checkpoint, parallel=2, disable_kernel=True)
    backend = llm.engine.backend
    assert backend.name == "torch" and not backend.batch_invariant and not backend.speculation
    assert llm.engine.scheduler.config.speculative_ngram == 0
    assert llm.engine.kernel_report() == {"backend": "torch", "arch": None, "batch_invariant": False,
                                          "speculation": False}
    assert "batch invariance is OFF" in caplog.text
    out = llm.generate(["still serves"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4


@pytest.mark.batch_invariant
def test_kernel_backend_is_batch_invariant_and_speculates(tiny_checkpoint):
    llm = LLM(checkpoint=tiny_checkpoint, parallel=2)
    backend = llm.engine.backend
    if backend.name == "torch":
        pytest.skip(f"no C++ kernels here: {backend.errors}")
    assert backend.batch_invariant and backend.speculation and llm.engine.scheduler.config.speculative_ngram > 0
    assert backend.name in ("amx", "avx512_bf16", "avx512", "avx2", "neon", "generic")
    # Every layer got the same object: nothing looks its kernels up per call.
    assert all(getattr(m, "ops", backend) is backend for m in llm.engine.runner.model.modules())


def test_off_cpu_backend_is_not_invariant():
    backend = resolve_backend("cuda" if torch.cuda.is_available() else "meta")
    assert not backend.batch_invariant and not backend.speculation and backend.arch is None


def test_a_level_the_cpu_lacks_is_refused_not_loaded():
    """A shared home directory must never hand a CPU a library built for features it lacks."""
    wanted = "sapphirerapids"  # AMX, AVX512-FP16...: refused unless this CPU has all of it
    missing = build.missing_features(wanted)
    if not missing:
        pytest.skip("this CPU runs sapphirerapids code")
    result = build.load_kernel("gemm", wanted)
    assert result.module is None and "lacks" in result.error
    with pytest.raises(KernelsRequiredError, match="lacks"):
        resolve_backend("cpu", settings=KernelSettings(arch=wanted, require=True))


def test_extension_names_are_keyed_by_arch_and_cpu():
    assert build.extension_name("gemm", "x86-64-v3") != build.extension_name("gemm", "native")
    assert build.extension_name("gemm", "x86-64-v3").startswith("conveyor_gemm_x86_64_v3_")


def test_extension_names_are_keyed_by_source_not_by_checkout(tmp_path, monkeypatch):
    # Every checkout (and venv) with the same sources and torch shares one build; an edit gets its own.
    here = build.extension_name("gemm", "native")
    other = tmp_path / "elsewhere" / "csrc"
    other.mkdir(parents=True)
    for f in build.CSRC.iterdir():
        if f.suffix in (".cpp", ".h"):
            (other / f.name).write_bytes(f.read_bytes())
    monkeypatch.setattr(build, "CSRC", other)
    assert build.extension_name("gemm", "native") == here
    (other / "gemm.cpp").write_text((other / "gemm.cpp").read_text() + "\n// edited\n")
    edited = build.extension_name("gemm", "native")
    assert edited != here
    (other / "vec_math.h").write_text((other / "vec_math.h").read_text() + "\n// edited\n")  # a header, too
    assert build.extension_name("gemm", "native") not in (here, edited)
    assert build.extension_name("attention", "native") != build.extension_name("gemm", "native")


def test_first_error_picks_the_compiler_error():
    log = ("Error building extension 'x':\n[1/2] c++ -c gemm.cpp\nFAILED: gemm.o\n"
           "gemm.cpp:157:7: error: 'conveyor_amx' has not been declared\n  157 | ...\n")
    assert build.first_error(log) == "gemm.cpp:157:7: error: 'conveyor_amx' has not been declared"


def test_conveyor_env_reports_the_backend():
    out = subprocess.run([sys.executable, "-m", "conveyor.cli", "env", "--json"], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    info = json.loads(out.stdout)
    assert info["conveyor"]["backend"] and "batch_invariant" in info["conveyor"]
    assert info["torch"]["version"] == torch.__version__ and info["cpu"]["machine"]
    if info["quantized_kernel"] is not None:  # the decode walks' prefetch hint, for bug reports and benchmarks
        assert info["quantized_decode_prefetch"] in ("prefetchnta", "prefetcht1", "prefetcht0", "none")
