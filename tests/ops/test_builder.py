"""Op builders: the cross-process cache, missing tools, the fallback, zero-report."""

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from zero.ops import CPUAdam, OpBuildError
from zero.ops import builder as builder_module
from zero.ops.builder import BuildState, CPUAdamBuilder, SimdLevel, get_builder, simd_level
from zero.ops.report import main as report_main

# The first test to use the cpu_adam_op fixture builds the op (1-3 minutes on 2 cores).
pytestmark = pytest.mark.timeout(900)


def test_second_process_reuses_the_cached_build(cpu_adam_op):
    builder = get_builder("cpu_adam")
    library = builder.library_path()
    before = library.stat().st_mtime_ns
    # The child finds the build cached, imports it without ninja (PATH holds only python's
    # directory, so a rebuild would fail loudly) and runs a step.
    script = textwrap.dedent(
        """
        import torch
        from zero.ops.builder import get_builder
        builder = get_builder("cpu_adam")
        print(builder.state().value)
        module = builder.load()
        p, g, m, v = torch.ones(9), torch.ones(9), torch.zeros(9), torch.zeros(9)
        module.adam_step(p, g, m, v, 1, 0.1, 0.9, 0.999, 1e-8, 0.0, True, True)
        print(builder.state().value, module.simd_path(), round(p[0].item(), 4))
        """
    )
    env = dict(os.environ, PATH=os.path.dirname(sys.executable))
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["cached", "loaded", cpu_adam_op.simd_path(), "0.9"]
    assert library.stat().st_mtime_ns == before


def test_cache_key_names_op_torch_and_simd(cpu_adam_op):
    builder = get_builder("cpu_adam")
    key = builder.build_key()
    assert key.startswith("cpu_adam-torch") and key.endswith(simd_level().value)
    assert torch.__version__.replace("+", "_") in key
    stamp = json.loads((builder.build_dir() / "zero_build.json").read_text())
    assert stamp["fingerprint"] == builder.fingerprint()


def test_stale_stamp_means_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("ZERO_OPS_CACHE", str(tmp_path))
    builder = CPUAdamBuilder()
    builder.build_dir().mkdir(parents=True)
    builder.library_path().write_bytes(b"")
    (builder.build_dir() / "zero_build.json").write_text(json.dumps({"fingerprint": "old"}))
    assert builder.state() == BuildState.NOT_BUILT


def _no_toolchain(monkeypatch, tmp_path):
    # An empty cache and a PATH without ninja or a compiler.
    monkeypatch.setenv("ZERO_OPS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)


def test_missing_tools_are_named(tmp_path, monkeypatch):
    _no_toolchain(monkeypatch, tmp_path)
    builder = CPUAdamBuilder()
    with pytest.raises(OpBuildError, match="ninja") as info:
        builder.load()
    assert "C++ compiler 'c++'" in str(info.value)
    assert builder.state() == BuildState.FAILED


def test_fallback_warns_once_and_matches_torch(tmp_path, monkeypatch):
    _no_toolchain(monkeypatch, tmp_path)
    monkeypatch.setitem(builder_module._BUILDERS, "cpu_adam", CPUAdamBuilder())
    params = [torch.nn.Parameter(torch.randn(50)) for _ in range(2)]
    with pytest.warns(RuntimeWarning, match="pure-PyTorch fallback") as record:
        optimizers = [CPUAdam([p], weight_decay=0.01) for p in params]
    assert len(record) == 1
    assert not any(opt.uses_op for opt in optimizers)
    with pytest.raises(OpBuildError, match="ninja"):
        CPUAdam([params[0]], use_op=True)
    ref_param = torch.nn.Parameter(params[0].detach().clone())
    ref = torch.optim.AdamW([ref_param], weight_decay=0.01, foreach=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(5):
            params[0].grad = torch.randn(50)
            ref_param.grad = params[0].grad.clone()
            optimizers[0].step()
            ref.step()
    torch.testing.assert_close(params[0].detach(), ref_param.detach(), rtol=1e-6, atol=1e-7)


def test_simd_override(monkeypatch):
    monkeypatch.setenv("ZERO_CPU_SIMD", "scalar")
    assert simd_level() == SimdLevel.SCALAR
    assert CPUAdamBuilder().build_key().endswith("-scalar")
    monkeypatch.setenv("ZERO_CPU_SIMD", "sse9")
    with pytest.raises(ValueError, match="avx512, avx2, scalar"):
        simd_level()


def test_unknown_op_lists_the_ops():
    with pytest.raises(ValueError, match="cpu_adam, fused_adam"):
        get_builder("cpu_adamw")


def test_zero_report(capsys):
    assert report_main([]) == 0
    out = capsys.readouterr().out
    for needle in ("cpu_adam:", "fused_adam:", "state:", "cache:", "torch:", "simd level:"):
        assert needle in out


def test_fused_adam_cache_is_keyed_by_the_gpu_architectures(monkeypatch):
    # A build for sm_90 (H200) has no kernel for sm_80: a cache shared by machines with other
    # GPUs must not hand it over. Needs no CUDA: the key is computed from the arch list.
    builder = get_builder("fused_adam")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    hopper = builder.build_key()
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;8.6+PTX")
    ampere = builder.build_key()
    assert hopper.endswith("-cuda12.8-sm9_0") and ampere.endswith("-cuda12.8-sm8_0_8_6_PTX")
    assert hopper != ampere
