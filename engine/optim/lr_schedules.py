"""Learning-rate schedules: DeepSpeed's ``scheduler {type, params}`` config block.

The five DeepSpeed schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)
with DeepSpeed's names, parameters, defaults and formulas, written from their documented math;
any torch.optim.lr_scheduler class is accepted by name as a fallback.

[Note: iteration counting]
Every schedule is a pure function of ``last_batch_iteration`` (t), the index of the last
applied optimizer step; t = -1 before the first one. The constructor writes the lr for
t = -1 into every param group (DeepSpeed does the same), so the first optimizer step runs at
that lr; each ``step()`` then advances t by one and writes the lr for the new t. The engine
calls ``step()`` once per applied optimizer step and never on steps skipped for fp16
overflow, so t counts applied updates. Because the lr is a function of t alone, the state
dict is just t (plus the base lrs WarmupCosineLR scales) and loading it re-applies the lr.

Formulas are in docs/optimizers.md; deviations from DeepSpeed are listed there.
"""

import inspect
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import did_you_mean
from .optimizers import as_params, check_params, did_you_mean_any_case

WARMUP_TYPES = ("log", "linear")


# ---------------------------------------------------------------------------------------------
# value checks (every message names the config key scheduler.params.<name>)


def _key(name: str) -> str:
    return f"scheduler.params.{name}"


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{_key(name)} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{_key(name)} must be >= {minimum}, got {value}")
    return value


def _check_float(name: str, value: Any, minimum: float | None = None, maximum=None) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{_key(name)} must be a finite number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{_key(name)} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{_key(name)} must be <= {maximum}, got {value}")
    return float(value)


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{_key(name)} must be true or false, got {value!r}")
    return value


def _check_warmup_type(value: Any) -> str:
    if value not in WARMUP_TYPES:
        raise ValueError(
            f"{_key('warmup_type')} must be one of {', '.join(WARMUP_TYPES)}, got {value!r}."
            f"{did_you_mean(str(value), WARMUP_TYPES)}"
        )
    return value


def _per_group(name: str, value: Any, num_groups: int, minimum=0.0, maximum=None) -> list[float]:
    """A scalar (same for every param group) or a list with one value per param group."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != num_groups:
            raise ValueError(
                f"{_key(name)} has {len(value)} values but the optimizer has {num_groups} "
                f"param groups; give one value per group or a single number"
            )
        return [_check_float(name, v, minimum, maximum) for v in value]
    return [_check_float(name, value, minimum, maximum)] * num_groups


def _warmup_fraction(t: int, warmup_num_steps: int, warmup_type: str) -> float:
    """0 at t = 0 rising to 1 at t = warmup_num_steps: ln(t+1)/ln(W) or t/W."""
    if warmup_type == "log":
        return math.log(t + 1) / math.log(warmup_num_steps)
    return t / warmup_num_steps


# ---------------------------------------------------------------------------------------------
# schedules


class _Schedule:
    """Shared mechanics: the iteration counter, writing lrs into param groups, state dict.

    Subclasses define ``_lrs_at(t) -> list[float]`` (one lr per param group) and call
    ``self._apply()`` at the end of their constructor.
    """

    def __init__(self, optimizer: Any, last_batch_iteration: int):
        if not isinstance(getattr(optimizer, "param_groups", None), list):
            raise TypeError(
                f"a scheduler needs an optimizer with a param_groups list, got "
                f"{type(optimizer).__name__}"
            )
        self.optimizer = optimizer
        self.last_batch_iteration = _check_int("last_batch_iteration", last_batch_iteration, -1)
        self._last_lr: list[float] = []

    @property
    def num_groups(self) -> int:
        return len(self.optimizer.param_groups)

    def _lrs_at(self, t: int) -> list[float]:
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        """The lr of each param group at ``last_batch_iteration``."""
        return self._lrs_at(self.last_batch_iteration)

    def get_last_lr(self) -> list[float]:
        """The lrs most recently written into the param groups (by construction or step())."""
        return list(self._last_lr)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to ``last_batch_iteration`` (default: one past the current) and apply its lr."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = _check_int("last_batch_iteration", last_batch_iteration, -1)
        self._apply()

    def _apply(self) -> None:
        self._last_lr = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            # A tensor lr (capturable/fused optimizers) is updated in place so graphs that
            # captured it see the new value.
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable state: {"last_batch_iteration": t} (DeepSpeed's layout)."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore t and write its lr into the param groups. Accepts DeepSpeed checkpoints."""
        if "last_batch_iteration" not in state:
            raise ValueError(
                f"scheduler state dict lacks 'last_batch_iteration' (keys: {sorted(state)})"
            )
        self.last_batch_iteration = _check_int(
            "last_batch_iteration", state["last_batch_iteration"], -1
        )
        self._apply()


class WarmupLR(_Schedule):
    """Warm up from warmup_min_lr to warmup_max_lr over warmup_num_steps, then hold.

    lr(t) = min + (max - min) * g(t), g(t) = ln(t+1)/ln(W) ("log") or t/W ("linear") for
    t < W, else 1, where W = max(2, warmup_num_steps) (DeepSpeed's clamp, so ln(W) > 0).
    Before the first step (t = -1) lr = min. min/max may be per-group lists.
    """

    def __init__(
        self,
        optimizer: Any,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] = 1e-3,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ):
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = _per_group("warmup_min_lr", warmup_min_lr, self.num_groups)
        self.max_lrs = _per_group("warmup_max_lr", warmup_max_lr, self.num_groups)
        self.warmup_num_steps = _check_int("warmup_num_steps", warmup_num_steps, 1)
        self.warmup_type = _check_warmup_type(warmup_type)
        self._apply()

    def _gamma(self, t: int) -> float:
        w = max(2, self.warmup_num_steps)
        return _warmup_fraction(t, w, self.warmup_type) if t < w else 1.0

    def _lrs_at(self, t: int) -> list[float]:
        if t < 0:
            return list(self.min_lrs)
        gamma = self._gamma(t)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at total_num_steps.

    After warmup: g(t) = max(0, (T - t) / max(1, T - W)), T = total_num_steps,
    W = max(2, warmup_num_steps). total_num_steps must be >= warmup_num_steps.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] = 1e-3,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ):
        # Set before WarmupLR.__init__, whose final _apply() already uses this _gamma.
        self.total_num_steps = _check_total(total_num_steps, warmup_num_steps)
        super().__init__(
            optimizer,
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
            last_batch_iteration,
        )

    def _gamma(self, t: int) -> float:
        w = max(2, self.warmup_num_steps)
        if t < w:
            return _warmup_fraction(t, w, self.warmup_type)
        return max(0.0, (self.total_num_steps - t) / max(1, self.total_num_steps - w))


def _check_total(total_num_steps: Any, warmup_num_steps: Any) -> int:
    total = _check_int("total_num_steps", total_num_steps, 1)
    warmup = _check_int("warmup_num_steps", warmup_num_steps, 1)
    if total < warmup:
        raise ValueError(
            f"{_key('total_num_steps')} ({total}) must be >= {_key('warmup_num_steps')} "
            f"({warmup}): the schedule would end before warmup does"
        )
    return total


class WarmupCosineLR(_Schedule):
    """Warm up a ratio of each group's initial lr, then cosine-decay it to cos_min_ratio.

    lr(t) = base_lr * r(t), base_lr = the group's lr when the scheduler is built.
    t < 0:  r = 0 (DeepSpeed's value before the first step).
    t < W:  r = warmup_min_ratio + (1 - warmup_min_ratio) * g(t), g as in WarmupLR.
    else:   p = min(1, (t - W + 1) / max(1, T - W)),
            r = max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2).
    W = max(2, warmup_num_steps), T = total_num_steps. Ratios may be per-group lists.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_ratio: float | list[float] = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float | list[float] = 1e-4,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ):
        super().__init__(optimizer, last_batch_iteration)
        n = self.num_groups
        self.total_num_steps = _check_total(total_num_steps, warmup_num_steps)
        self.warmup_num_steps = _check_int("warmup_num_steps", warmup_num_steps, 1)
        self.warmup_min_ratios = _per_group("warmup_min_ratio", warmup_min_ratio, n, 0.0, 1.0)
        self.cos_min_ratios = _per_group("cos_min_ratio", cos_min_ratio, n, 0.0, 1.0)
        self.warmup_type = _check_warmup_type(warmup_type)
        self.base_lrs = [float(group["lr"]) for group in self.optimizer.param_groups]
        self._apply()

    def _ratio(self, t: int, warmup_min_ratio: float, cos_min_ratio: float) -> float:
        if t < 0:
            return 0.0
        w = max(2, self.warmup_num_steps)
        if t < w:
            g = _warmup_fraction(t, w, self.warmup_type)
            return warmup_min_ratio + (1.0 - warmup_min_ratio) * g
        progress = min(1.0, (t - w + 1) / max(1, self.total_num_steps - w))
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * cosine)

    def _lrs_at(self, t: int) -> list[float]:
        return [
            base * self._ratio(t, lo, floor)
            for base, lo, floor in zip(self.base_lrs, self.warmup_min_ratios, self.cos_min_ratios)
        ]

    def state_dict(self) -> dict[str, Any]:
        """{"last_batch_iteration": t, "base_lrs": [...]}: the lrs the ratios multiply."""
        return {**super().state_dict(), "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore t (and base_lrs when present: DeepSpeed checkpoints lack them)."""
        if "base_lrs" in state:
            base_lrs = [float(lr) for lr in state["base_lrs"]]
            if len(base_lrs) != self.num_groups:
                raise ValueError(
                    f"scheduler state dict has {len(base_lrs)} base_lrs but the optimizer has "
                    f"{self.num_groups} param groups"
                )
            self.base_lrs = base_lrs
        super().load_state_dict(state)


class OneCycle(_Schedule):
    """1Cycle (Smith, arXiv 1803.09820): lr up then down over one cycle, then optional decay.

    Cycle of C = S1 + S2 steps (S1 = cycle_first_step_size, S2 = cycle_second_step_size).
    With b = t + 1 and c = b mod C (for t < C):
        s = c / S1 if c <= S1 else (C - c) / S2         (0 -> 1 -> 0)
        with a stair count k > 0 for that half: s = floor(s * k) / k
        lr = min_lr + (max_lr - min_lr) * s,  mom = max_mom - (max_mom - min_mom) * s
    After the cycle (t >= C), with d = t - C + 1:
        lr = min_lr / (1 + decay_lr_rate * d / decay_step_size)
        mom = max_mom * (1 + decay_mom_rate * d / decay_step_size)
    (decay is off, lr = min_lr and mom = max_mom, when decay_step_size or the rate is 0).
    Momentum goes to betas[0] of groups that have betas (Adam family) or to 'momentum'
    (SGD, RMSprop); groups with neither keep theirs.
    """

    def __init__(
        self,
        optimizer: Any,
        cycle_min_lr: float | list[float],
        cycle_max_lr: float | list[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | list[float] = 0.8,
        cycle_max_mom: float | list[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ):
        super().__init__(optimizer, last_batch_iteration)
        n = self.num_groups
        self.min_lrs = _per_group("cycle_min_lr", cycle_min_lr, n)
        self.max_lrs = _per_group("cycle_max_lr", cycle_max_lr, n)
        self.decay_lr_rate = _check_float("decay_lr_rate", decay_lr_rate, 0.0)
        self.first_step_size = _check_int("cycle_first_step_size", cycle_first_step_size, 1)
        self.second_step_size = (
            self.first_step_size
            if cycle_second_step_size is None
            else _check_int("cycle_second_step_size", cycle_second_step_size, 1)
        )
        self.first_stair_count = _check_int("cycle_first_stair_count", cycle_first_stair_count, 0)
        self.second_stair_count = (
            self.first_stair_count
            if cycle_second_stair_count is None
            else _check_int("cycle_second_stair_count", cycle_second_stair_count, 0)
        )
        self.decay_step_size = _check_int("decay_step_size", decay_step_size, 0)
        self.cycle_momentum = _check_bool("cycle_momentum", cycle_momentum)
        self.min_moms = _per_group("cycle_min_mom", cycle_min_mom, n)
        self.max_moms = _per_group("cycle_max_mom", cycle_max_mom, n)
        self.decay_mom_rate = _check_float("decay_mom_rate", decay_mom_rate)
        if self.cycle_momentum and not any(_momentum_key(g) for g in optimizer.param_groups):
            warnings.warn(
                f"scheduler.params.cycle_momentum is ignored: {type(optimizer).__name__} has no "
                f"betas or momentum in its param groups",
                stacklevel=2,
            )
            self.cycle_momentum = False
        self._apply()

    @property
    def total_size(self) -> int:
        return self.first_step_size + self.second_step_size

    def _scale(self, t: int) -> float:
        """Position in the cycle: 0 at its ends, 1 at the peak (after S1 steps)."""
        c = (t + 1) % self.total_size
        if c <= self.first_step_size:
            scale, stairs = c / self.first_step_size, self.first_stair_count
        else:
            scale = (self.total_size - c) / self.second_step_size
            stairs = self.second_stair_count
        if stairs > 0:
            # Quantise from the integer position, not from the float scale, so a stair edge
            # that lands exactly on an integer step is not lost to rounding.
            if c <= self.first_step_size:
                position = c * stairs // self.first_step_size
            else:
                position = (self.total_size - c) * stairs // self.second_step_size
            scale = position / stairs
        return scale

    def _decay_interval(self, t: int) -> float:
        return (t - self.total_size + 1) / self.decay_step_size

    def _lrs_at(self, t: int) -> list[float]:
        if t < self.total_size:
            s = self._scale(t)
            return [lo + (hi - lo) * s for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.decay_step_size == 0 or self.decay_lr_rate == 0:
            return list(self.min_lrs)
        factor = 1.0 + self.decay_lr_rate * self._decay_interval(t)
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list[float] | None:
        """Momentum of each param group at last_batch_iteration; None when not cycled."""
        if not self.cycle_momentum:
            return None
        t = self.last_batch_iteration
        if t < self.total_size:
            s = self._scale(t)
            return [hi - (hi - lo) * s for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.decay_step_size == 0 or self.decay_mom_rate == 0:
            return list(self.max_moms)
        factor = 1.0 + self.decay_mom_rate * self._decay_interval(t)
        return [hi * factor for hi in self.max_moms]

    def _apply(self) -> None:
        super()._apply()
        moms = self.get_mom()
        if moms is None:
            return
        for group, mom in zip(self.optimizer.param_groups, moms):
            key = _momentum_key(group)
            if key == "betas":
                group["betas"] = (mom, *tuple(group["betas"])[1:])
            elif key == "momentum":
                group["momentum"] = mom


def _momentum_key(group: Mapping[str, Any]) -> str | None:
    if "betas" in group:
        return "betas"
    if "momentum" in group:
        return "momentum"
    return None


class LRRangeTest(_Schedule):
    """LR range test: grow the lr from lr_range_test_min_lr to find the largest stable lr.

    lr(t) = min_lr * (1 + step_rate * i), i = (t + 1) / step_size, or floor((t + 1) /
    step_size) with lr_range_test_staircase. min_lr may be a per-group list.
    """

    def __init__(
        self,
        optimizer: Any,
        lr_range_test_min_lr: float | list[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ):
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = _per_group("lr_range_test_min_lr", lr_range_test_min_lr, self.num_groups)
        self.step_size = _check_int("lr_range_test_step_size", lr_range_test_step_size, 1)
        self.step_rate = _check_float("lr_range_test_step_rate", lr_range_test_step_rate, 0.0)
        self.staircase = _check_bool("lr_range_test_staircase", lr_range_test_staircase)
        self._apply()

    def _lrs_at(self, t: int) -> list[float]:
        interval = (t + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [lo * (1.0 + self.step_rate * interval) for lo in self.min_lrs]


# ---------------------------------------------------------------------------------------------
# registry

SCHEDULERS: dict[str, type] = {
    cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)
}

# DeepSpeed's deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES, in its order: the class names of
# its schedules, all five of which zero implements. Accelerate hands a scheduler object to
# initialize(lr_scheduler=...) when type(obj).__name__ is in this list.
VALID_LR_SCHEDULES = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
assert set(VALID_LR_SCHEDULES) == set(SCHEDULERS)

# torch schedulers that cannot run under the engine, with the reason.
_UNSUPPORTED_TORCH_SCHEDULERS = {
    "ReduceLROnPlateau": "it needs a metric in step(), and the engine steps schedulers without one",
}


def _torch_scheduler_classes() -> dict[str, type]:
    base = torch.optim.lr_scheduler.LRScheduler
    classes = {}
    for name in dir(torch.optim.lr_scheduler):
        obj = getattr(torch.optim.lr_scheduler, name)
        public = not name.startswith("_") and obj is not base
        if public and inspect.isclass(obj) and issubclass(obj, base):
            classes[name] = obj
    return classes


def supported_scheduler_types() -> list[str]:
    """zero's DeepSpeed schedules, then the torch.optim.lr_scheduler classes the engine can run."""
    torch_names = sorted(
        n for n in _torch_scheduler_classes() if n not in _UNSUPPORTED_TORCH_SCHEDULERS
    )
    return list(SCHEDULERS) + torch_names


def resolve_scheduler(type_name: str) -> type:
    """scheduler.type (case-insensitive) -> class; zero's schedules win over torch's names."""
    if not isinstance(type_name, str) or not type_name:
        raise ValueError(f"scheduler.type must be a non-empty string, got {type_name!r}")
    lowered = type_name.lower()
    for name, reason in _UNSUPPORTED_TORCH_SCHEDULERS.items():
        if lowered == name.lower():
            raise NotImplementedError(
                f"scheduler type '{type_name}' (config key scheduler.type) is not supported: "
                f"{reason}"
            )
    classes = {**_torch_scheduler_classes(), **SCHEDULERS}
    by_lower = {name.lower(): name for name in supported_scheduler_types()}
    if lowered not in by_lower:
        supported = supported_scheduler_types()
        raise ValueError(
            f"unknown scheduler type '{type_name}' (config key scheduler.type)."
            f"{did_you_mean_any_case(type_name, supported)} Supported: {', '.join(supported)}"
        )
    return classes[by_lower[lowered]]


def build_scheduler(type_name: str, params: Mapping[str, Any] | None, optimizer: Any) -> Any:
    """Build the schedule named by the config block ``scheduler {type, params}``.

    Args:
        type_name: scheduler.type: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle,
            LRRangeTest, or a torch.optim.lr_scheduler class name such as "StepLR"
            (case-insensitive).
        params: scheduler.params with DeepSpeed's names (torch's argument names for torch
            classes); None = defaults.
        optimizer: the optimizer whose param_groups the schedule drives. Writing the lr is
            local to this rank; not a collective.

    The constructor sets each group's lr for step 0 (see the iteration note above).

    Raises:
        ValueError: unknown type or parameter, missing required parameter, or bad value; the
            message names scheduler.type or scheduler.params.<name>.
        NotImplementedError: a torch scheduler the engine cannot drive (ReduceLROnPlateau).
    """
    cls = resolve_scheduler(type_name)
    params = as_params(params, "scheduler.params")
    ours = cls in SCHEDULERS.values()
    # zero's schedules check their own values (they accept per-group lists where the default
    # is a number); torch's are checked against their defaults and annotations here.
    kwargs = check_params(
        cls.__init__, params, "scheduler.params", skip=("self", "optimizer"), check_types=not ours
    )
    if ours:
        return cls(optimizer, **kwargs)
    try:
        return cls(optimizer, **kwargs)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"torch.optim.lr_scheduler.{cls.__name__} rejected scheduler.params {kwargs}: {err}"
        ) from err
