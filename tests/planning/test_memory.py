"""engine.memory_report(): measured bytes per category equal zero's formula, stages 0-3, fp32 and
bf16 (single process: N = 1), and the table printed once with memory_breakdown."""

import pytest
import torch

import zero
from zero.planning.memory import ModelStateSpec, formula_text, model_state_formula


def _engine(stage, dtype, **extra):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.GELU(), torch.nn.Linear(5, 3))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
        **extra,
    }
    if dtype != "fp32":
        config[dtype] = {"enabled": True}
    engine, _, _, _ = zero.initialize(model=model, config=config)
    x = torch.randn(2, 7, dtype=engine.config.compute_dtype)
    engine.backward(engine(x).float().square().mean())
    engine.step()
    return engine


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_measured_equals_formula(dtype):
    for stage in range(4):
        report = _engine(stage, dtype).memory_report()
        assert report["measured"] == report["formula"], (stage, dtype, report)
        assert report["psi"] == 7 * 5 + 5 + 5 * 3 + 3
        expected_master = 0 if dtype == "fp32" else 4 * report["psi"]
        assert report["measured"]["master"] == expected_master
        assert "4-byte" in zero.planning.memory.format_report(report)


def test_formula_reproduces_paper_with_two_byte_gradients():
    psi, n = 64_000, 64
    for stage, paper in [(0, 16 * psi), (1, 4 * psi + 12 * psi // n), (2, 2 * psi + 14 * psi // n)]:
        parts = model_state_formula(ModelStateSpec(stage, psi, 1 if stage == 0 else n))
        # zero keeps fp32 gradients: 2 more bytes per gradient element than the paper.
        grad_elements = psi if stage < 2 else psi // n
        assert sum(parts.values()) == paper + 2 * grad_elements
    assert formula_text(2, 2) == ("2 Psi + 14 Psi/N", "2 Psi + 16 Psi/N")


def test_memory_breakdown_prints_once(zero_log):
    engine = _engine(2, "fp32", memory_breakdown=True)
    engine.backward(engine(torch.randn(2, 7)).square().mean())
    engine.step()
    tables = [m for m in zero_log if "zero memory report" in m]
    assert len(tables) == 1 and "fp32 master weights" in tables[0]
