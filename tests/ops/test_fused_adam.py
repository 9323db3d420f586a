"""fused_adam (multi-tensor CUDA Adam) against the pure-PyTorch reference.

Needs a CUDA build of torch, nvcc and a GPU; each test skips with the reason otherwise. The
compile check needs only nvcc.
"""

import subprocess

import pytest
import torch

from zero.ops import FusedAdam, adam_reference
from zero.ops.builder import CSRC_DIR, find_nvcc, get_builder

SIZES = [0, 1, 7, 17, 65_537, 1_000_003]


@pytest.fixture(scope="module")
def fused_adam_op():
    builder = get_builder("fused_adam")
    ok, reason = builder.is_compatible()
    if not ok:
        pytest.skip(f"fused_adam cannot run here: {reason}")
    return builder.load()


def test_kernel_compiles_with_nvcc(tmp_path):
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    source = CSRC_DIR / "fused_adam.cu"
    result = subprocess.run(
        [nvcc, "-O3", "-std=c++17", "-c", str(source), "-o", str(tmp_path / "fused_adam.o")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("adamw_mode", [False, True], ids=["adam_l2", "adamw"])
def test_fused_adam_matches_reference(fused_adam_op, adamw_mode):
    gen = torch.Generator().manual_seed(0)
    cpu = [torch.randn(n, generator=gen) for n in SIZES]
    params = [torch.nn.Parameter(t.cuda()) for t in cpu]
    outs = {p: torch.empty(p.numel(), dtype=torch.bfloat16, device="cuda") for p in params}
    opt = FusedAdam(params, lr=1e-2, weight_decay=0.1, adamw_mode=adamw_mode)
    moments = [(torch.zeros_like(t), torch.zeros_like(t)) for t in cpu]
    for step in range(1, 21):
        grads = [torch.randn(t.numel(), generator=gen) for t in cpu]
        for p, g in zip(params, grads):
            p.grad = g.cuda()
        opt.step_with_copy(outs)
        for t, g, (m, v) in zip(cpu, grads, moments):
            adam_reference(t, g, m, v, step, 1e-2, 0.9, 0.999, 1e-8, 0.1, True, adamw_mode)
    torch.cuda.synchronize()
    for p, t in zip(params, cpu):
        scale = max(t.abs().max().item(), 1.0) if t.numel() else 1.0
        torch.testing.assert_close(p.detach().cpu(), t, rtol=1e-6, atol=1e-6 * scale)
        assert torch.equal(outs[p], p.detach().to(torch.bfloat16))
