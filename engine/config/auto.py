"""Resolution of "auto" values and of the batch-size triple.

Owns the Hugging Face style "auto" entries (filled from ``auto_values``, the model's hidden
size, or a ``zero_optimization`` field's default; see [Note: "auto" that takes the default])
and the derivation of train_batch_size = train_micro_batch_size_per_gpu *
gradient_accumulation_steps * world_size from the keys given.
"""

from collections.abc import Mapping
from typing import Any

from .errors import ConfigError, _show
from .parse import _checked
from .zero_optimization import ZeroConfig

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_AUTO = "auto"
# Hugging Face fills these "auto" sizes from the model's hidden size h.
_FROM_HIDDEN_SIZE = {
    "zero_optimization.reduce_bucket_size": lambda h: h * h,
    "zero_optimization.stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "zero_optimization.stage3_param_persistence_threshold": lambda h: 10 * h,
}
# [Note: "auto" that takes the default]
# Bucket sizes and thresholds only trade memory for speed: any value trains the same numbers.
# An "auto" in one of them that nothing fills (no auto_values entry, no hidden size) takes the
# field's default, as DeepSpeed does for every "auto" inside zero_optimization, and load_config
# says so in one info line. So does stage3_gather_16bit_weights_on_model_save, which Accelerate
# fills with its default false (stage 3's state_dict() and save_16bit_model then raise, naming
# the key). Everything else (lr, batch sizes, clipping, fp16/bf16, the stage, offload devices)
# changes what is trained, so an unfilled "auto" there stays an error.
# DeepSpeed keys whose default is the word "auto" itself: read as null, zero's spelling of it.
_AUTO_IS_NULL = ("data_types.keep_in_fp32_modules",)
# zero's own keys whose value may be the word "auto" itself.
_AUTO_IS_VALUE = ("zero_optimization.stage3_fetch_budget",)
# Stage 3's fetch keys and the bucket sizes: an "auto" nothing fills is left unset, so that
# zero.initialize chooses it from the memory a rank may use (planning/budget.py: [Note:
# memory-aware fetch policy], [Note: bucket sizes from memory]), where DeepSpeed would take its
# default.
_AUTO_IS_POLICY = (
    "reduce_bucket_size",
    "allgather_bucket_size",
    "stage3_prefetch_bucket_size",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "stage3_module_granularity_threshold",
)
_AUTO_IS_POLICY_SHORT = {k.removeprefix("stage3_") for k in _AUTO_IS_POLICY}
_UNSET = object()
_AUTO_TAKES_DEFAULT = (
    "reduce_bucket_size",
    "allgather_bucket_size",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_model_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "stage3_module_granularity_threshold",
    "sub_group_size",
    "stage3_gather_16bit_weights_on_model_save",
)


def _resolve_auto(
    data: dict[str, Any], auto_values: Mapping[str, Any], where: str, notes: list[str]
) -> dict:
    """Replace "auto" values from ``auto_values``, the hidden size or the field defaults; fail on
    any left unresolved. Appends one line to ``notes`` naming the defaults taken, if any."""
    hidden = auto_values.get("hidden_size")
    if hidden is not None and (
        isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1
    ):
        raise ConfigError(
            f"auto_values['hidden_size'] must be a positive int (the model's hidden size), "
            f"got {hidden!r}."
        )
    defaulted: dict[str, Any] = {}
    to_policy: list[str] = []  # fetch keys left unset for the fetch policy

    def fill(node: Any, key: str) -> Any:
        if isinstance(node, dict):
            filled = {k: fill(v, f"{key}.{k}" if key else str(k)) for k, v in node.items()}
            return {k: v for k, v in filled.items() if v is not _UNSET}
        if isinstance(node, list):
            return [fill(v, f"{key}.{i}") for i, v in enumerate(node)]
        if not (isinstance(node, str) and node == _AUTO):
            return node
        if key in _AUTO_IS_NULL:
            return None
        if key in _AUTO_IS_VALUE:
            return node
        if key in auto_values:  # checked like the file's own values (an inf lr, say)
            return _checked(auto_values[key], key, where, depth=key.count(".") + 2)
        if key in _FROM_HIDDEN_SIZE and hidden is not None:
            return _FROM_HIDDEN_SIZE[key](hidden)
        name = key.removeprefix("zero_optimization.")
        if key != name and name.removeprefix("stage3_") in _AUTO_IS_POLICY_SHORT:
            to_policy.append(key)
            return _UNSET
        if key != name and name in _AUTO_TAKES_DEFAULT:
            defaulted[key] = ZeroConfig.model_fields[name].default
            return defaulted[key]
        return node

    data = fill(data, "")
    # An "auto" batch key that the concrete ones determine is the same as an absent key.
    if any(k in data and data[k] != _AUTO for k in _BATCH_KEYS):
        for key in _BATCH_KEYS:
            if data.get(key) == _AUTO:
                del data[key]
    left = _auto_keys(data, "")
    if left:
        keys = ", ".join(f"'{k}'" for k in left)
        raise ConfigError(
            f'{where}{keys} {"is" if len(left) == 1 else "are"} "auto" but no value was given. '
            'Write the value in the config (zero.initialize fills "auto" only in '
            "optimizer.params, from an optimizer passed as optimizer=, and in bucket sizes, from "
            "the model's config.hidden_size)."
        )
    if defaulted:
        notes.append(_defaults_taken(defaulted, where))
    if to_policy:
        notes.append(
            f'{where}"auto" entries left to zero.initialize, which chooses them from the memory '
            f"a rank may use (docs/stages.md, Fetch policy): {', '.join(to_policy)}"
        )
    return data


def _defaults_taken(defaulted: Mapping[str, Any], where: str) -> str:
    """The one info line naming the "auto" entries that took zero's defaults, and their values."""
    taken = ", ".join(f"{k}={_show(v)}" for k, v in defaulted.items())
    why = ""
    if any(k in _FROM_HIDDEN_SIZE for k in defaulted):
        why = " (no model hidden size to derive bucket sizes from)"
    return (
        f'{where}"auto" entries took zero\'s defaults{why}: {taken}; write numbers in the '
        "config to choose other values."
    )


def _auto_keys(node: Any, key: str) -> list[str]:
    if isinstance(node, dict):
        items = node.items()
    elif isinstance(node, list):
        items = enumerate(node)
    else:
        auto = isinstance(node, str) and node == _AUTO and key not in _AUTO_IS_VALUE
        return [key] if auto else []
    found: list[str] = []
    for k, v in items:
        found += _auto_keys(v, f"{key}.{k}" if key else str(k))
    return found


def _derive_batch(
    train: int | None, micro: int | None, gas: int | None, world_size: int, where: str
) -> tuple[int, int, int]:
    """Complete (train_batch_size, micro, gas) so that train = micro * gas * world_size."""

    def fail(problem: str, fix: str) -> ConfigError:
        return ConfigError(
            f"{where}{problem}: train_batch_size={train}, train_micro_batch_size_per_gpu={micro}, "
            f"gradient_accumulation_steps={gas}, world_size={world_size}. They must satisfy "
            "train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps "
            f"* world_size; {fix}."
        )

    if train is not None and micro is not None and gas is not None:
        if train != micro * gas * world_size:
            raise fail(
                f"inconsistent batch sizes ({micro} * {gas} * {world_size} = "
                f"{micro * gas * world_size}, not {train})",
                "fix the numbers, or give only two of the three keys to have the third derived",
            )
        return train, micro, gas
    if train is not None:
        if micro is not None:
            known, name = micro, "train_micro_batch_size_per_gpu"
        else:
            gas = 1 if gas is None else gas  # DeepSpeed: only train given -> no accumulation
            known, name = gas, "gradient_accumulation_steps"
        per = known * world_size
        if train % per:
            raise fail(
                f"train_batch_size {train} is not divisible by {name} * world_size = {per}",
                "choose train_batch_size as a multiple of that product",
            )
        return (train, micro, train // per) if micro is not None else (train, train // per, gas)
    if micro is not None:
        gas = 1 if gas is None else gas
        return micro * gas * world_size, micro, gas
    raise ConfigError(
        f"{where}no batch size given: set 'train_micro_batch_size_per_gpu' (samples per rank) "
        "and/or 'train_batch_size' (global); 'gradient_accumulation_steps' alone is not enough."
    )
