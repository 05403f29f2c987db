"""What scripts/kernel-levels.sh decides without compiling a kernel: which levels repeat native's
build, the compile-check cache, and the shared build cache's key and recorded build times."""

import os
import stat

import pytest

from conveyor.kernels import build, checks, cli

NATIVE_AVX2 = {"__AVX2__": "1", "__FMA__": "1", "__F16C__": "1", "__x86_64__": "1", "__BYTE_ORDER__": "__ORDER_LITTLE_ENDIAN__"}


def _macros(monkeypatch, table):
    monkeypatch.setattr(checks, "predefined_macros", lambda arch, cxx="c++": table[arch])


def test_the_macros_are_read_from_the_sources_directives(tmp_path):
    (tmp_path / "k.cpp").write_text("#if defined(__NEW_ISA__) && FOO  // __IN_A_COMMENT__\n#endif\n"
                                    "int __not_a_directive__;\n#ifdef __aarch64__\n#endif\n")
    found = checks.kernel_macros(tmp_path)
    assert {"__NEW_ISA__", "__aarch64__"} <= found and not {"__IN_A_COMMENT__", "__not_a_directive__"} & found
    assert set(build.X86_FEATURE_MACROS) <= found
    assert {"__AVX512F__", "__AVXVNNI__", "__AMX_INT8__", "__ARM_NEON", "__BYTE_ORDER__"} <= checks.kernel_macros()


def test_a_level_is_native_when_only_macros_no_kernel_reads_differ(monkeypatch):
    # -march=znver2 adds __SHA__, __ADX__ and its own tuning over x86-64-v3: the kernels read none of them.
    _macros(monkeypatch, {"native": {**NATIVE_AVX2, "__SHA__": "1", "__tune_znver2__": "1", "__znver2": "1"},
                          "x86-64-v3": {**NATIVE_AVX2, "__tune_k8__": "1"},
                          "x86-64": {"__x86_64__": "1", "__BYTE_ORDER__": "__ORDER_LITTLE_ENDIAN__"},
                          "alderlake": {**NATIVE_AVX2, "__AVXVNNI__": "1"},
                          "big": {**NATIVE_AVX2, "__BYTE_ORDER__": "__ORDER_BIG_ENDIAN__"}})
    assert checks.same_build_as_native("x86-64-v3")
    assert not checks.same_build_as_native("x86-64")
    assert checks.macro_differences("alderlake") == {"__AVXVNNI__": ("1", None)}
    assert checks.macro_differences("big") == {"__BYTE_ORDER__": ("__ORDER_BIG_ENDIAN__", "__ORDER_LITTLE_ENDIAN__")}
    assert cli.main(["--same-as-native", "x86-64-v3"]) == 0
    assert cli.main(["--same-as-native", "x86-64"]) == 1
    assert cli.main(["--same-as-native", "x86-64-v3", "--torch-capability", "no-such-capability"]) == 1


@pytest.mark.skipif(not build.is_x86(), reason="x86 levels")
def test_on_this_cpu_the_levels_are_decided_by_its_flags():
    """The real compiler: baseline x86-64 never repeats native here; x86-64-v3 does exactly when the CPU
    has AVX2 and FMA but nothing else a kernel branches on (AVX-512, AVX-VNNI, AMX)."""
    flags = build.cpu_features()
    assert not checks.same_build_as_native("x86-64") or "sse4_2" not in flags
    extra = {"avx512f", "avx_vnni", "avx512_vnni", "amx_tile"} & flags
    if {"avx2", "fma", "f16c", "bmi2"} <= flags and not extra:
        assert checks.same_build_as_native("x86-64-v3")
    elif extra:
        assert not checks.same_build_as_native("x86-64-v3")


def _fake_compiler(path, rc=0, stderr=""):
    """A compiler that answers --version / -dumpmachine and 'compiles' with exit status rc."""
    path.write_text("#!/bin/sh\ncase \"$1\" in --version) echo 'fakecc 1.0';; -dumpmachine) echo x86_64-linux-gnu;;\n"
                    f"*) echo '{stderr}' >&2; exit {rc};; esac\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.fixture
def csrc_copy(tmp_path, monkeypatch):
    """A copy of the kernel sources as build.CSRC and an empty extensions root (caches included)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    copy = tmp_path / "csrc"
    copy.mkdir()
    for f in build.CSRC.iterdir():
        if f.suffix in (".cpp", ".h"):
            (copy / f.name).write_bytes(f.read_bytes())
    monkeypatch.setattr(build, "CSRC", copy)
    monkeypatch.setattr(checks, "CSRC", copy)
    return copy


def test_the_compile_check_key_follows_sources_headers_flags_and_compiler(csrc_copy, tmp_path):
    cxx = _fake_compiler(tmp_path / "cc")
    key = checks.compile_check_key("qgemm", "sapphirerapids", cxx)
    assert checks.compile_check_key("qgemm", "sapphirerapids", cxx) == key
    assert checks.compile_check_key("qgemm", "alderlake", cxx) != key
    assert checks.compile_check_key("gemm", "sapphirerapids", cxx) != key
    (csrc_copy / "qgemm.cpp").write_text((csrc_copy / "qgemm.cpp").read_text() + "\n// edited\n")
    edited = checks.compile_check_key("qgemm", "sapphirerapids", cxx)
    assert edited != key
    (csrc_copy / "isa.h").write_text((csrc_copy / "isa.h").read_text() + "\n// edited\n")
    assert checks.compile_check_key("qgemm", "sapphirerapids", cxx) not in (key, edited)
    other = tmp_path / "cc2"
    other.write_text((tmp_path / "cc").read_text().replace("fakecc 1.0", "fakecc 2.0"))
    other.chmod(0o755)
    checks.compiler_id.cache_clear()
    assert checks.compile_check_key("gemm", "x86-64", cxx) != checks.compile_check_key("gemm", "x86-64", str(other))


def test_a_compile_check_success_is_cached_and_a_failure_is_not(csrc_copy, tmp_path):
    ok, bad = _fake_compiler(tmp_path / "ok"), _fake_compiler(tmp_path / "bad", 1, "gemm.cpp:3:1: error: boom")
    first = checks.compile_checks([(ok, "sapphirerapids")], kernels=("gemm", "attention"))
    assert [(r.error, r.cached) for r in first] == [(None, False), (None, False)]
    again = checks.compile_checks([(ok, "sapphirerapids")], kernels=("gemm", "attention"))
    assert all(r.cached and r.error is None for r in again)
    (csrc_copy / "gemm.cpp").write_text((csrc_copy / "gemm.cpp").read_text() + "\n// edited\n")
    edited = {r.kernel: r.cached for r in checks.compile_checks([(ok, "sapphirerapids")], kernels=("gemm", "attention"))}
    assert edited == {"gemm": False, "attention": True}
    assert not checks.compile_checks([(ok, "sapphirerapids")], kernels=("gemm",), use_cache=False)[0].cached
    for _ in range(2):
        (failed,) = checks.compile_checks([(bad, "sapphirerapids")], kernels=("gemm",))
        assert failed.error == "gemm.cpp:3:1: error: boom" and not failed.cached
    (missing,) = checks.compile_checks([(str(tmp_path / "no-such-cc"), "x86-64")], kernels=("gemm",))
    assert missing.error and not missing.cached


# x86-64-v2: a level no test run loads into this process (the level runs load x86-64-v3 and x86-64).
def test_the_build_estimate_is_the_last_build_measured_here(csrc_copy, caplog):
    per_kernel, source = build.estimated_cpu_s_per_kernel("x86-64-v2")
    assert (per_kernel, source) == (build.ESTIMATED_BUILD_CPU_S / len(build.KERNELS), "estimated")
    build._record_build_time("x86-64-v2", 5, 100.0, 61.0)
    assert build.estimated_cpu_s_per_kernel("x86-64-v2") == (20.0, "measured here")
    assert build.estimated_cpu_s_per_kernel("x86-64")[1] == "estimated"
    caplog.set_level("INFO", logger="conveyor.kernels.build")
    assert build._announce_build("x86-64-v2") == set(build.KERNELS)
    cpus = max(1, min(len(build.KERNELS), os.cpu_count() or 1))
    (message,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiling")]
    assert f"about {100 / cpus:.0f} s on {cpus} CPU(s) (measured here)" in message


def test_a_finished_build_is_found_by_its_marker_not_by_a_half_written_library(csrc_copy):
    name = build.extension_name("gemm", "x86-64-v2")
    directory = build.cache_directory(name)
    (directory / f"{name}.so").write_bytes(b"")  # a link killed mid-way: no marker, so a rebuild
    assert build._import_built(name, directory) is None
    assert "gemm" in build._announce_build("x86-64-v2")
    (directory / build.BUILT_MARKER).write_text("{}")
    assert "gemm" not in build._announce_build("x86-64-v2")
