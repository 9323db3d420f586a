"""DeepSpeed schedules: lr sequences against closed forms, state round trip, per-group, errors.

The expected values are computed here from DeepSpeed's documented formulas (t is the index of
the last applied optimizer step, -1 right after construction), independently of the module.
"""

import json
import math

import pytest
import torch

from zero.lr_schedules import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupLR,
    build_scheduler,
    supported_scheduler_types,
)


def _sgd(lr=0.5, groups=1, momentum=0.9):
    params = [{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(groups)]
    return torch.optim.SGD(params, lr=lr, momentum=momentum)


def _adam(lr=0.5, groups=1):
    params = [{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(groups)]
    return torch.optim.Adam(params, lr=lr, betas=(0.9, 0.999))


def _lrs_by_step(scheduler, optimizer, last_t):
    """{t: [group lrs]} for t = -1 (construction) .. last_t, read from the param groups."""
    seen = {-1: [g["lr"] for g in optimizer.param_groups]}
    for t in range(last_t + 1):
        scheduler.step()
        seen[t] = [g["lr"] for g in optimizer.param_groups]
    return seen


def _warmup_gamma(t, w, kind):
    w = max(2, w)
    if t >= w:
        return 1.0
    return math.log(t + 1) / math.log(w) if kind == "log" else t / w


# ---- WarmupLR / WarmupDecayLR -----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr(kind):
    lo, hi, w = 0.01, 0.1, 10
    opt = _sgd()
    sched = build_scheduler(
        "WarmupLR",
        {"warmup_min_lr": lo, "warmup_max_lr": hi, "warmup_num_steps": w, "warmup_type": kind},
        opt,
    )
    seen = _lrs_by_step(sched, opt, 40)
    assert seen[-1] == [lo]
    for t in (0, 1, 3, 9, 10, 11, 40):
        assert seen[t][0] == pytest.approx(lo + (hi - lo) * _warmup_gamma(t, w, kind), abs=1e-15)
    assert seen[40] == [pytest.approx(hi)]
    assert sched.get_last_lr() == seen[40] == sched.get_lr()


def test_warmup_lr_defaults_and_clamp_of_one_step():
    opt = _sgd()
    sched = build_scheduler("WarmupLR", {}, opt)
    assert (sched.warmup_num_steps, sched.warmup_type) == (1000, "log")
    sched.step(999)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * math.log(1000) / math.log(1000))
    # warmup_num_steps 1 behaves as 2 (DeepSpeed's clamp keeps ln(W) > 0).
    sched = WarmupLR(_sgd(), warmup_num_steps=1, warmup_type="log")
    seen = _lrs_by_step(sched, sched.optimizer, 2)
    assert seen[0] == [0.0] and seen[1] == [pytest.approx(1e-3)] and seen[2] == [1e-3]


def test_warmup_decay_lr():
    lo, hi, w, total = 0.0, 0.1, 10, 30
    opt = _sgd()
    sched = build_scheduler(
        "WarmupDecayLR",
        {
            "warmup_max_lr": hi,
            "warmup_num_steps": w,
            "total_num_steps": total,
            "warmup_type": "linear",
        },
        opt,
    )
    seen = _lrs_by_step(sched, opt, 45)

    def expected(t):
        if t < 0:
            return lo
        gamma = t / w if t < w else max(0.0, (total - t) / max(1, total - w))
        return lo + (hi - lo) * gamma

    for t in (-1, 0, 5, 9, 10, 11, 20, 29, 30, 45):
        assert seen[t][0] == pytest.approx(expected(t), abs=1e-15), t
    assert seen[20] == [pytest.approx(0.05)] and seen[30] == [0.0] and seen[45] == [0.0]


# ---- WarmupCosineLR ---------------------------------------------------------------------------


def test_warmup_cosine_lr_scales_each_groups_initial_lr():
    w, total, r0, rmin = 10, 30, 0.1, 0.01
    opt = _adam()
    opt.param_groups.append({**opt.param_groups[0], "params": [], "lr": 2.0})
    sched = build_scheduler(
        "WarmupCosineLR",
        {
            "total_num_steps": total,
            "warmup_num_steps": w,
            "warmup_min_ratio": r0,
            "cos_min_ratio": rmin,
        },
        opt,
    )
    seen = _lrs_by_step(sched, opt, 60)

    def ratio(t):
        if t < 0:
            return 0.0
        if t < w:
            return r0 + (1 - r0) * math.log(t + 1) / math.log(w)
        progress = min(1.0, (t - w + 1) / (total - w))
        return rmin + (1 - rmin) * 0.5 * (1 + math.cos(math.pi * progress))

    for t in (-1, 0, 1, 9, 10, 19, 28, 29, 30, 60):
        assert seen[t] == [pytest.approx(0.5 * ratio(t)), pytest.approx(2.0 * ratio(t))], t
    assert seen[0] == [pytest.approx(0.05), pytest.approx(0.2)]
    # After total_num_steps the ratio stays at cos_min_ratio instead of rising again.
    assert seen[60] == [pytest.approx(0.5 * rmin), pytest.approx(2.0 * rmin)]


# ---- OneCycle ---------------------------------------------------------------------------------


def test_one_cycle_asymmetric_lr_and_sgd_momentum():
    opt = _sgd(momentum=0.0)
    sched = build_scheduler(
        "OneCycle",
        {
            "cycle_min_lr": 0.01,
            "cycle_max_lr": 0.1,
            "cycle_first_step_size": 4,
            "cycle_second_step_size": 6,
            "cycle_min_mom": 0.8,
            "cycle_max_mom": 0.9,
        },
        opt,
    )
    lrs, moms = {}, {}
    for t in range(-1, 14):
        if t >= 0:
            sched.step()
        lrs[t], moms[t] = opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"]
    # Position s in the cycle: b = t + 1 steps taken; up over 4 steps, down over 6.
    for t, s in {-1: 0, 1: 0.5, 3: 1, 4: 5 / 6, 6: 0.5, 8: 1 / 6, 9: 0}.items():
        assert lrs[t] == pytest.approx(0.01 + 0.09 * s), t
        assert moms[t] == pytest.approx(0.9 - 0.1 * s), t
    # Past the cycle without decay: min lr, max momentum.
    assert lrs[13] == 0.01 and moms[13] == 0.9


def test_one_cycle_stairs():
    opt = _sgd()
    sched = OneCycle(
        opt,
        cycle_min_lr=0.0,
        cycle_max_lr=1.0,
        cycle_first_step_size=4,
        cycle_second_step_size=6,
        cycle_first_stair_count=2,
        cycle_second_stair_count=3,
    )
    seen = _lrs_by_step(sched, opt, 9)
    # Up half: floor(b * 2 / 4) / 2. Down half: floor((10 - b) * 3 / 6) / 3.
    expected = {0: 0.0, 1: 0.5, 2: 0.5, 3: 1.0, 4: 2 / 3, 5: 2 / 3, 6: 1 / 3, 8: 0.0}
    for t, lr in expected.items():
        assert seen[t] == [pytest.approx(lr)], t


def test_one_cycle_decay_and_adam_betas():
    opt = _adam()
    sched = build_scheduler(
        "OneCycle",
        {
            "cycle_min_lr": 0.02,
            "cycle_max_lr": 0.2,
            "cycle_first_step_size": 2,
            "decay_step_size": 2,
            "decay_lr_rate": 0.5,
            "decay_mom_rate": 0.01,
        },
        opt,
    )
    assert opt.param_groups[0]["betas"] == (pytest.approx(0.9), 0.999)
    sched.step(1)  # the peak: b = 2 = first step size
    assert opt.param_groups[0]["lr"] == pytest.approx(0.2)
    assert opt.param_groups[0]["betas"] == (pytest.approx(0.8), 0.999)
    for t in (4, 5, 9):
        sched.step(t)
        d = t - 4 + 1  # steps into the decay phase (cycle is 4 steps)
        assert opt.param_groups[0]["lr"] == pytest.approx(0.02 / (1 + 0.5 * d / 2))
        beta1, beta2 = opt.param_groups[0]["betas"]
        assert beta1 == pytest.approx(0.9 * (1 + 0.01 * d / 2)) and beta2 == 0.999
    assert sched.get_mom() == [pytest.approx(0.9 * (1 + 0.01 * 6 / 2))]


def test_one_cycle_momentum_off_or_unsupported():
    opt = _adam()
    OneCycle(opt, 0.1, 1.0, cycle_momentum=False).step(3)
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)
    ada = torch.optim.Adagrad([torch.nn.Parameter(torch.zeros(2))])
    with pytest.warns(UserWarning, match="cycle_momentum"):
        sched = OneCycle(ada, 0.1, 1.0)
    assert sched.get_mom() is None


# ---- LRRangeTest ------------------------------------------------------------------------------


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test(staircase):
    lo, size, rate = 1e-3, 4, 2.0
    opt = _sgd()
    sched = build_scheduler(
        "LRRangeTest",
        {
            "lr_range_test_min_lr": lo,
            "lr_range_test_step_size": size,
            "lr_range_test_step_rate": rate,
            "lr_range_test_staircase": staircase,
        },
        opt,
    )
    seen = _lrs_by_step(sched, opt, 20)
    for t in (-1, 0, 2, 3, 7, 20):
        interval = (t + 1) / size
        if staircase:
            interval = math.floor(interval)
        assert seen[t] == [pytest.approx(lo * (1 + rate * interval))], t


# ---- per-group lists, step(t), tensor lr ------------------------------------------------------


def test_per_group_lists():
    opt = _sgd(groups=2)
    sched = build_scheduler(
        "WarmupLR",
        {
            "warmup_min_lr": [0.0, 0.1],
            "warmup_max_lr": [1.0, 0.2],
            "warmup_num_steps": 4,
            "warmup_type": "linear",
        },
        opt,
    )
    sched.step(1)
    assert sched.get_last_lr() == [pytest.approx(0.25), pytest.approx(0.125)]
    opt = _sgd(groups=2)
    sched = OneCycle(opt, [0.0, 0.1], [1.0, 0.3], cycle_first_step_size=2)
    sched.step(0)
    assert sched.get_last_lr() == [pytest.approx(0.5), pytest.approx(0.2)]
    sched = LRRangeTest(_sgd(groups=2), lr_range_test_min_lr=[1.0, 2.0], lr_range_test_step_size=1)
    assert sched.get_last_lr() == [1.0, 2.0]


def test_step_to_explicit_iteration_and_tensor_lr():
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=torch.tensor(0.5))
    lr_tensor = opt.param_groups[0]["lr"]
    sched = WarmupLR(opt, warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear")
    sched.step(last_batch_iteration=5)
    assert opt.param_groups[0]["lr"] is lr_tensor
    assert float(lr_tensor) == pytest.approx(0.05)
    assert sched.last_batch_iteration == 5


# ---- state dict -------------------------------------------------------------------------------

_CASES = [
    ("WarmupLR", {"warmup_max_lr": 0.1, "warmup_num_steps": 10}),
    ("WarmupDecayLR", {"warmup_num_steps": 5, "total_num_steps": 20}),
    ("WarmupCosineLR", {"warmup_num_steps": 5, "total_num_steps": 20, "warmup_min_ratio": 0.1}),
    (
        "OneCycle",
        {
            "cycle_min_lr": 0.01,
            "cycle_max_lr": 0.1,
            "cycle_first_step_size": 5,
            "decay_step_size": 1,
            "decay_lr_rate": 0.1,
        },
    ),
    ("LRRangeTest", {"lr_range_test_step_size": 3, "lr_range_test_staircase": True}),
]


@pytest.mark.parametrize("name, params", _CASES)
def test_state_dict_round_trip_continues_identically(name, params):
    opt_a = _adam()
    sched_a = build_scheduler(name, params, opt_a)
    for _ in range(7):
        sched_a.step()
    state = json.loads(json.dumps(sched_a.state_dict()))
    opt_b = _adam(lr=123.0 if name != "WarmupCosineLR" else 0.5)
    sched_b = build_scheduler(name, params, opt_b)
    sched_b.load_state_dict(state)
    assert [g["lr"] for g in opt_b.param_groups] == [g["lr"] for g in opt_a.param_groups]
    assert opt_b.param_groups[0]["betas"] == opt_a.param_groups[0]["betas"]
    for _ in range(20):
        sched_a.step()
        sched_b.step()
        assert sched_b.get_last_lr() == sched_a.get_last_lr()
        assert opt_b.param_groups[0]["lr"] == opt_a.param_groups[0]["lr"]


def test_cosine_state_restores_base_lrs_and_accepts_deepspeed_layout():
    sched = WarmupCosineLR(_sgd(lr=0.5), total_num_steps=20, warmup_num_steps=5)
    sched.step(6)
    state = sched.state_dict()
    assert state == {"last_batch_iteration": 6, "base_lrs": [0.5]}
    other = WarmupCosineLR(_sgd(lr=9.0), total_num_steps=20, warmup_num_steps=5)
    other.load_state_dict(state)
    assert other.get_last_lr() == sched.get_last_lr()
    other.load_state_dict({"last_batch_iteration": 6})  # a DeepSpeed checkpoint
    assert other.last_batch_iteration == 6
    with pytest.raises(ValueError, match="last_batch_iteration"):
        other.load_state_dict({"step": 3})


# ---- registry and errors ----------------------------------------------------------------------


def test_case_insensitive_and_torch_fallback():
    assert type(build_scheduler("warmuplr", {}, _sgd())) is WarmupLR
    assert type(build_scheduler("ONECYCLE", {"cycle_min_lr": 0, "cycle_max_lr": 1}, _sgd())) is (
        OneCycle
    )
    opt = _sgd(lr=1.0)
    sched = build_scheduler("StepLR", {"step_size": 2, "gamma": 0.5}, opt)
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR)
    for _ in range(4):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.25)
    assert "StepLR" in supported_scheduler_types()
    assert "ReduceLROnPlateau" not in supported_scheduler_types()


def test_unknown_type():
    with pytest.raises(ValueError) as err:
        build_scheduler("WarmupLr2", {}, _sgd())
    msg = str(err.value)
    assert "scheduler.type" in msg and "Did you mean 'WarmupLR'?" in msg
    with pytest.raises(NotImplementedError, match="ReduceLROnPlateau"):
        build_scheduler("ReduceLROnPlateau", {}, _sgd())


@pytest.mark.parametrize(
    "name, params, key",
    [
        ("WarmupLR", {"warmup_num_step": 5}, "scheduler.params.warmup_num_step"),
        ("WarmupLR", {"warmup_num_steps": -5}, "scheduler.params.warmup_num_steps"),
        ("WarmupLR", {"warmup_num_steps": 0}, "scheduler.params.warmup_num_steps"),
        ("WarmupLR", {"warmup_num_steps": 2.5}, "scheduler.params.warmup_num_steps"),
        ("WarmupLR", {"warmup_max_lr": "auto"}, "scheduler.params.warmup_max_lr"),
        ("WarmupLR", {"warmup_min_lr": -0.1}, "scheduler.params.warmup_min_lr"),
        ("WarmupLR", {"warmup_type": "cosine"}, "scheduler.params.warmup_type"),
        ("WarmupLR", {"warmup_max_lr": [0.1, 0.2]}, "scheduler.params.warmup_max_lr"),
        ("WarmupLR", {"last_batch_iteration": -2}, "scheduler.params.last_batch_iteration"),
        ("WarmupDecayLR", {}, "scheduler.params.total_num_steps"),
        ("WarmupDecayLR", {"total_num_steps": 10}, "scheduler.params.total_num_steps"),
        ("WarmupCosineLR", {"total_num_steps": 10}, "scheduler.params.total_num_steps"),
        (
            "WarmupCosineLR",
            {"total_num_steps": 9999, "cos_min_ratio": 2.0},
            "scheduler.params.cos_min_ratio",
        ),
        ("OneCycle", {"cycle_max_lr": 1.0}, "scheduler.params.cycle_min_lr"),
        (
            "OneCycle",
            {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_first_step_size": 0},
            "scheduler.params.cycle_first_step_size",
        ),
        (
            "OneCycle",
            {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "decay_step_size": -1},
            "scheduler.params.decay_step_size",
        ),
        (
            "OneCycle",
            {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0, "cycle_momentum": "yes"},
            "scheduler.params.cycle_momentum",
        ),
        (
            "LRRangeTest",
            {"lr_range_test_step_size": -3},
            "scheduler.params.lr_range_test_step_size",
        ),
        ("LRRangeTest", {"lr_range_test_staircase": 1}, "scheduler.params.lr_range_test_staircase"),
        ("StepLR", {}, "scheduler.params.step_size"),
        ("StepLR", {"step_size": 2, "gama": 0.1}, "scheduler.params.gama"),
        ("StepLR", {"step_size": "auto"}, "scheduler.params.step_size"),
        ("StepLR", {"step_size": 2, "gamma": "x"}, "scheduler.params.gamma"),
    ],
)
def test_errors_name_the_key(name, params, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        build_scheduler(name, params, _sgd())


def test_unknown_param_suggests():
    with pytest.raises(ValueError, match="Did you mean 'warmup_num_steps'"):
        build_scheduler("WarmupLR", {"warmup_num_step": 5}, _sgd())
    with pytest.raises(ValueError, match="Did you mean 'linear'"):
        build_scheduler("WarmupLR", {"warmup_type": "lineer"}, _sgd())


def test_needs_param_groups():
    with pytest.raises(TypeError, match="param_groups"):
        WarmupLR(object())
