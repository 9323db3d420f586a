"""Step log, wall-clock timers, CSV and TensorBoard monitors, and the comms report's flag."""

import csv
import importlib.util

import pytest
import torch

import zero
from zero.comm import OpTotals
from zero.monitor import comms_report


def _engine(**extra):
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "steps_per_print": 1,
        **extra,
    }
    engine, _, _, _ = zero.initialize(model=torch.nn.Linear(4, 3), config=config)
    return engine


def _train(engine, steps):
    for _ in range(steps * engine.config.gradient_accumulation_steps):
        engine.backward(engine(torch.randn(2, 4)).square().mean())
        engine.step()


def test_step_log_and_csv(tmp_path, zero_log):
    engine = _engine(
        wall_clock_breakdown=True,
        csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "run"},
    )
    engine.monitor.tokens_per_sample = 16
    _train(engine, 3)
    lines = [m for m in zero_log if m.startswith("step=")]
    assert len(lines) == 3
    for key in ("loss=", "samples/s=", "tokens/s=", "TFLOP/s=", "forward_ms=", "mem_MiB="):
        assert key in lines[-1], lines[-1]
    last = engine.monitor.last
    assert last["tokens_per_s"] == pytest.approx(16 * last["samples_per_s"])
    assert last["tflops"] == pytest.approx(6 * 15 * last["tokens_per_s"] / 1e12)
    assert all(last["timers"][k] > 0 for k in ("forward", "backward", "step"))
    with open(tmp_path / "run" / "Train_Samples_train_loss.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "Train/Samples/train_loss"]
    assert [int(r[0]) for r in rows[1:]] == [4, 8, 12]  # global samples


@pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is not None, reason="tensorboard is installed"
)
def test_tensorboard_missing_names_the_package(tmp_path):
    with pytest.raises(ImportError, match="pip install tensorboard"):
        _engine(tensorboard={"enabled": True, "output_path": str(tmp_path)})


def test_comms_report_flags_deviation():
    step = {"reduce_scatter": OpTotals(1, 1000, 2000, 0.5), "all_gather": OpTotals(1, 1000, 2000)}
    text, deviates = comms_report(step, 1000, 2, 1, 0)
    assert not deviates and "total 2.0000 Psi" in text and "expected 2 Psi" in text
    text, deviates = comms_report(step, 1000, 3, 1, 0)
    assert deviates and "DEVIATION" in text
    _, deviates = comms_report(step, 1000, 2, 2, 0)  # stage 2, GAS 2 expects 3 Psi
    assert deviates
