"""Step log, wall-clock timers, CSV and TensorBoard monitors, the comms report's flag, and (on
2 ranks, one spawn) the stage-3 expectation with persistent parameters, a pinned unit and
gradient accumulation, a frozen layer's traffic kept out of Psi, and the step-time breakdown."""

import csv
import importlib.util
import logging

import pytest
import torch
from distributed import run_ranks

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
    assert all(last["timers"][k] > 0 for k in ("forward", "backward", "optimizer"))
    # One rank: no collectives, so no waiting to split out.
    assert last["timers"]["reduce"] == last["timers"]["all_gather"] == 0
    with open(tmp_path / "run" / "Train_Samples_train_loss.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "Train/Samples/train_loss"]
    assert [int(r[0]) for r in rows[1:]] == [4, 8, 12]  # global samples


@pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is not None, reason="tensorboard is installed"
)
@pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is not None, reason="tensorboard is installed"
)
def test_tensorboard_missing_names_the_package(tmp_path, stage3_runs):
    with pytest.raises(ImportError, match="pip install tensorboard"):
        _engine(tensorboard={"enabled": True, "output_path": str(tmp_path)})
    for run in stage3_runs:  # on 2 ranks: each rank raises it at zero.initialize
        assert "pip install tensorboard" in run[4], run[4]


def test_comms_report_flags_deviation():
    step = {"reduce_scatter": OpTotals(1, 1000, 2000, 0.5), "all_gather": OpTotals(1, 1000, 2000)}
    text, deviates = comms_report(step, 1000, 2, 1, 0)
    assert not deviates and "total 2.0000 Psi" in text and "expected 2 Psi" in text
    text, deviates = comms_report(step, 1000, 3, 1, 0)
    assert deviates and "DEVIATION" in text
    _, deviates = comms_report(step, 1000, 2, 2, 0)  # stage 2, GAS 2 expects 3 Psi
    assert deviates


def test_comms_report_counts_persistent_parameters():
    # 100 parameters, 10 persistent, GAS 2: 90 * 3 * 2 + 10 * (2 + 1) = 570 elements.
    step = {"reduce_scatter": OpTotals(2, 200, 800), "all_gather": OpTotals(4, 370, 1480)}
    text, deviates = comms_report(step, 100, 3, 2, 0, persistent=10)
    assert not deviates and "expected 5.7 Psi" in text and "10 persistent" in text, text
    assert comms_report(step, 100, 3, 2, 0)[1]  # without them the expectation is 6 Psi


def test_comms_report_counts_units_kept_for_backward():
    # Stage 3, GAS 1, 100 parameters, 60 of them kept gathered from forward to backward:
    # 300 - 60 = 240 elements (all-gather 140, reduce-scatter 100).
    step = {"reduce_scatter": OpTotals(1, 100, 400), "all_gather": OpTotals(2, 140, 560)}
    text, deviates = comms_report(step, 100, 3, 1, 0, kept=60)
    assert not deviates and "expected 2.4 Psi" in text and "60 kept for backward" in text, text
    assert comms_report(step, 100, 3, 1, 0)[1]


class TiedNet(torch.nn.Module):
    """Two fetch units and small biases; `embed.weight` is used again outside embed's forward
    (as a tied lm_head is), which pins its unit until the end of backward."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(16, 32)
        self.mid = torch.nn.Linear(32, 32)

    def forward(self, x):
        return self.mid(torch.relu(self.embed(x))) @ self.embed.weight


class FrozenMiddle(torch.nn.Module):
    """A frozen layer between two trainable ones: backward all-gathers its weight again for
    the gradient of its input, traffic that is not in Psi (Psi counts trainable parameters)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(16, 32)
        self.frozen = torch.nn.Linear(32, 32)
        self.mid = torch.nn.Linear(32, 32)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.mid(torch.relu(self.frozen(self.embed(x))))


def _stage3_ledger():
    messages = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("zero").addHandler(handler)
    logging.getLogger("zero").setLevel(logging.INFO)
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "steps_per_print": 1,
        "wall_clock_breakdown": True,
        "comms_logger": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": 1100,
            "stage3_param_persistence_threshold": 40,  # the biases (32 + 32 elements)
        },
    }
    try:  # every rank refuses it before any collective, not rank 0 alone (it writes)
        board = {"enabled": True, "output_path": "/nonexistent"}
        zero.initialize(model=TiedNet(), config={**config, "tensorboard": board})
        no_tensorboard = None
    except ImportError as error:
        no_tensorboard = str(error)
    engine, _, _, _ = zero.initialize(model=TiedNet(), config=config)

    def micro_batch():
        engine.backward(engine(torch.randn(2, 16)).square().mean())

    reports = []
    for step in range(3):
        for _ in range(2):
            micro_batch()
            if step == 2:  # a real deviation: one all-reduce of Psi elements (2 Psi) too many
                engine.comm.all_reduce(torch.zeros(engine.monitor.psi))
            engine.step()
        reports.append(engine.monitor.last["timers"])
    steps = [m for m in messages if m.startswith("step=")]
    totals = [m.splitlines()[-1] for m in messages if m.startswith("comms rank")]
    frozen = {}
    for reuse in (0, 10**9):
        messages.clear()
        config["zero_optimization"]["stage3_max_reuse_distance"] = reuse
        engine, _, _, _ = zero.initialize(model=FrozenMiddle(), config=config)
        for _ in range(4):
            micro_batch()
            engine.step()
        frozen[reuse] = [m.splitlines()[-1] for m in messages if m.startswith("comms rank")]
    return steps, totals, reports, frozen, no_tensorboard


@pytest.fixture(scope="module")
def stage3_runs():
    return run_ranks(_stage3_ledger, 2, timeout=120)


def test_stage3_persistent_and_pinned_not_flagged(stage3_runs):
    steps, totals, _, _, _ = stage3_runs[0]
    # 1600 parameters, 64 of them persistent: 1536 * 6 + 64 * 3 = 9408 elements = 5.88 Psi,
    # less the units kept gathered from each forward to its backward (the default
    # stage3_max_reuse_distance keeps all of this small model's): 2 * 1536, 3.96 Psi.
    expected = "expected 3.96 Psi (stage 3, gradient accumulation 2, 64 persistent, 3,072 kept"
    assert expected in totals[1], totals[1]
    assert "DEVIATION" not in totals[1], totals[1]
    assert "DEVIATION" in totals[2], totals[2]


def test_frozen_parameters_traffic_named_apart_from_psi(stage3_runs):
    frozen = stage3_runs[0][3]
    # Psi = 1600 trainable (embed 544, mid 1056), 64 of them persistent (their biases). The
    # frozen weight (1024) is gathered in forward and again in backward for its input's
    # gradient (twice per micro-batch, 2 micro-batches), its bias (persistent) after the step.
    expected = {
        0: "total 5.8800 Psi (Psi=1,600) + 4,128 elements of frozen parameters; expected 5.88",
        # Kept from forward to backward: the trainable weights (512 + 1024) per micro-batch and
        # the frozen weight, which backward then does not gather again.
        10**9: "total 3.9600 Psi (Psi=1,600) + 2,080 elements of frozen parameters; expected 3.96",
    }
    for reuse, text in expected.items():
        assert text in frozen[reuse][-1], frozen[reuse][-1]
        assert not any("DEVIATION" in line for line in frozen[reuse]), frozen[reuse]


def test_step_log_splits_reduce_and_all_gather(stage3_runs):
    for _, _, timers, _, _ in stage3_runs:
        # From the second step on the waiting is split out (the first step binds the ledger).
        for figures in timers[1:]:
            assert set(figures) == {"forward", "backward", "reduce", "all_gather", "optimizer"}
            assert figures["reduce"] > 0 and figures["all_gather"] > 0, figures
            assert min(figures.values()) >= 0, figures  # compute = phase time - its waiting
    line = stage3_runs[0][0][-1]
    for key in ("forward_ms=", "backward_ms=", "reduce_ms=", "all_gather_ms=", "optimizer_ms="):
        assert key in line, line
