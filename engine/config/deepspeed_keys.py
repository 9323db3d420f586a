"""DeepSpeed's renamed and deprecated keys, and the blocks of its subsystems zero does not have.

Owns the rewrite of deprecated DeepSpeed names to current ones in raw data (each with a
``FutureWarning``, DeepSpeed's unprefixed names of the stage3_ keys included), keys DeepSpeed
ignores in some settings (offload_param below stage 3, dropped with one ``UserWarning``) and the
one ``UserWarning`` per enabled block of a subsystem zero ignores (pipeline, hybrid_engine, ...;
subsystems.py says which blocks are refused instead).
Warnings point at the first frame outside zero.config, the caller's code.
"""

import os
import sys
import warnings
from typing import Any

from . import subsystems
from .errors import ConfigError, _show
from .schema import Config


def _caller_stacklevel() -> int:
    """Stack level of the first frame outside this package (zero.config), so warnings point at
    user code: load_config (load.py) calls the functions here that warn."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.dirname(frame.f_code.co_filename) == _PACKAGE_DIR:
        frame, level = frame.f_back, level + 1
    return level


_PACKAGE_DIR = os.path.dirname(__file__)


def _deprecated(old: str, new: str) -> None:
    warnings.warn(
        f"config key '{old}' is deprecated; use '{new}' instead.",
        FutureWarning,
        stacklevel=_caller_stacklevel(),
    )


def _rename(block: dict[str, Any], old: str, new: str, prefix: str, where: str) -> None:
    if old not in block:
        return
    _deprecated(prefix + old, prefix + new)
    if new in block:
        raise ConfigError(
            f"{where}both '{prefix}{old}' (deprecated) and '{prefix}{new}' are given; "
            f"keep only '{prefix}{new}'."
        )
    block[new] = block.pop(old)


# zero_optimization keys DeepSpeed also accepts without their stage3_ prefix.
_STAGE3_FIELD_NAMES = (
    "prefetch_bucket_size",
    "param_persistence_threshold",
    "model_persistence_threshold",
    "max_live_parameters",
    "max_reuse_distance",
    "gather_16bit_weights_on_model_save",
    "module_granularity_threshold",
    "use_all_reduce_for_fetch_params",
    "allgather_sequential",
)


def _map_deprecated(data: dict[str, Any], where: str) -> dict[str, Any]:
    """Rewrite deprecated DeepSpeed names to current ones, warning for each (in place)."""
    _rename(data, "bfloat16", "bf16", "", where)
    zero = data.get("zero_optimization")
    if not isinstance(zero, dict):
        return data
    prefix = "zero_optimization."
    _rename(
        zero,
        "stage3_gather_fp16_weights_on_model_save",
        "stage3_gather_16bit_weights_on_model_save",
        prefix,
        where,
    )
    # DeepSpeed also reads its own field names for the stage3_ keys (populate_by_name).
    for name in _STAGE3_FIELD_NAMES:
        if name in zero:
            if f"stage3_{name}" in zero:
                raise ConfigError(
                    f"{where}both '{prefix}{name}' and '{prefix}stage3_{name}' are given (two "
                    f"names of one DeepSpeed key); keep only '{prefix}stage3_{name}'."
                )
            zero[f"stage3_{name}"] = zero.pop(name)
    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if old not in zero:
            continue
        enabled = zero.pop(old)
        if enabled:
            _deprecated(prefix + old, f"{prefix}{new}.device = 'cpu'")
        else:
            # DeepSpeed reads false (and null) as no offload.
            warnings.warn(
                f"config key '{prefix}{old}' is deprecated; {_show(enabled)} means no offload, "
                f"which is the default: remove the key (or write {prefix}{new}: "
                '{"device": "none"}).',
                FutureWarning,
                stacklevel=_caller_stacklevel(),
            )
        if enabled is not None and not isinstance(enabled, bool):
            raise ConfigError(
                f"{where}invalid value for '{prefix}{old}': {_show(enabled)}. Expected true or "
                f'false; better, write {prefix}{new}: {{"device": "cpu"}}.'
            )
        if new in zero:  # DeepSpeed refuses both names, whatever the old one says
            raise ConfigError(
                f"{where}both '{prefix}{old}' (deprecated) and '{prefix}{new}' are given; "
                f"keep only '{prefix}{new}'."
            )
        if enabled:
            zero[new] = {"device": "cpu"}
    if "cpu_offload_use_pin_memory" in zero:
        pin = zero.pop("cpu_offload_use_pin_memory")
        _deprecated(
            prefix + "cpu_offload_use_pin_memory",
            f"{prefix}offload_optimizer.pin_memory and {prefix}offload_param.pin_memory",
        )
        for name in ("offload_optimizer", "offload_param"):
            if isinstance(zero.get(name), dict):
                zero[name].setdefault("pin_memory", pin)
    return data


def _ignore_param_offload(config: Config, where: str, *, warn: bool) -> Config:
    """``config`` without zero_optimization.offload_param when the stage is below 3.

    DeepSpeed reads offload_param only at stage 3 and ignores it below (DeepSpeed-Chat's
    --offload sets it at every stage), so a config that loads in DeepSpeed loads here with the
    same meaning: parameters stay on the device. With ``warn``, one UserWarning names the key.
    A block whose device is "none" asks for nothing and is kept without a word.
    """
    block = config.zero.offload_param
    if block is None or block.device == "none" or config.zero.stage == 3:
        return config
    if warn:
        warnings.warn(
            f"{where}zero_optimization.offload_param (device '{block.device}') is ignored at "
            f"zero_optimization.stage {config.zero.stage}: parameters are offloaded at stage 3 "
            "only, as in DeepSpeed; they stay on the device. Set stage 3 to offload them, or "
            "remove the block.",
            UserWarning,
            stacklevel=_caller_stacklevel(),
        )
    zero = config.zero.model_copy(update={"offload_param": None})
    return config.model_copy(update={"zero_optimization": zero})


def _warn_unsupported(config: Config, where: str) -> None:
    """One UserWarning per switched-on block that zero ignores (the refused ones never get
    here: Config refused them; [Note: enabled blocks zero does not implement])."""
    for name, why in subsystems.WARNED.items():
        key = subsystems.switch_key(name, getattr(config, name))
        if key is not None:
            warnings.warn(
                f"{where}{key} is true, but zero does not implement DeepSpeed's '{name}': "
                f"{why}. The block is accepted and ignored.",
                UserWarning,
                stacklevel=_caller_stacklevel(),
            )
