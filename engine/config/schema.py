"""Configuration schema and loader: DeepSpeed-compatible JSON / hjson / YAML files -> ``Config``.

A user's DeepSpeed config file loads unchanged with the same meaning: every block is one
pydantic model whose field names are DeepSpeed's key names, defaults follow DeepSpeed
(0.16-0.19 source), unknown keys at any level are errors with a "did you mean" hint, and
cross-field rules are checked once, when the config is built, never mid-training.

Units: like DeepSpeed, every bucket size, prefetch size and persistence threshold in
``zero_optimization`` counts ELEMENTS (numbers of parameter values), not bytes. The only
byte-sized key is ``aio.block_size``.

Loading (``load_config``) runs these steps, in order:
  1. read the source (path to .json/.hjson/.yaml/.yml, a mapping, or an existing ``Config``);
     YAML reads 1e-3 as a float, like JSON. One walk over the data refuses a key given twice
     in one mapping, keys that are not strings, nesting deeper than 100 levels and non-finite
     numbers anywhere (see [Note: what the checking walk refuses]);
  2. map deprecated DeepSpeed names to their current ones (each with a ``FutureWarning``), and
     DeepSpeed's unprefixed names of the stage3_ keys to the prefixed ones;
  3. replace ``"auto"`` values from ``auto_values`` (Hugging Face style configs); an "auto"
     bucket size or threshold nothing fills takes its default, said in one info line;
  4. validate against the schema (one ``ConfigError`` naming the dotted key on failure;
     keys whose non-default value would change what is trained and that zero does not
     implement, ZeRO++ / MiCS, torch_autocast, AutoTP, weight_quantization and the like, are
     errors unless at their defaults);
  5. derive the batch triple for the data-parallel world size;
  6. warn once per accepted-but-unsupported block (amp, pipeline, ...).

The result is immutable: models are frozen, free-form dicts (optimizer and scheduler params)
are read-only mappings and lists are tuples.
"""

import functools
import json
import logging
import math
import os
import re
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, Literal

import hjson
import torch
import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from ..errors import did_you_mean

logger = logging.getLogger("zero")

__all__ = [
    "ConfigError",
    "Config",
    "load_config",
    "settings_without_effect",
    "ZeroConfig",
    "FP16Config",
    "BF16Config",
    "DataTypesConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "ActivationCheckpointingConfig",
    "CommsLoggerConfig",
    "FlopsProfilerConfig",
    "MonitorConfig",
    "WandbConfig",
    "CometConfig",
    "TorchAutocastConfig",
    "TensorParallelConfig",
    "CheckpointConfig",
    "AioConfig",
]


class ConfigError(ValueError):
    """A problem with user-supplied configuration.

    The message names the dotted key (e.g. ``zero_optimization.reduce_bucket_size``), the bad
    value and how to fix it, and starts with the file name when the config came from a file.
    """


# ---------------------------------------------------------------------------------------------
# Value types
# ---------------------------------------------------------------------------------------------


# Every count and size is used as a torch int64 (tensor sizes, offsets, step counters).
_INT64_MAX = 2**63 - 1


def _to_whole(value: Any, *, minimum: int, what: str, maximum: int = _INT64_MAX) -> int:
    """Coerce JSON numbers such as 5e8 (a float) or YAML's "5e8" (a string) to an int."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"expected {what}")
    if isinstance(value, str):
        # A quoted "5e8" (our YAML loader reads an unquoted 5e8 as a float, like JSON).
        text = value.strip()
        try:
            value = int(text) if text.lstrip("+-").isdigit() else float(text)
        except ValueError:
            raise ValueError(f"expected {what}, not a string") from None
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"expected {what}; {value} is not a whole number")
        value = int(value)
    if value < minimum:
        bound = "positive" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"must be {bound} ({what})")
    if value > maximum:
        bound = "2**63 - 1, the largest int64" if maximum == _INT64_MAX else str(maximum)
        raise ValueError(f"must be at most {bound} ({what})")
    return value


def _whole(minimum: int, what: str, maximum: int = _INT64_MAX) -> Any:
    check = functools.partial(_to_whole, minimum=minimum, what=what, maximum=maximum)
    return Annotated[int, BeforeValidator(check)]


_ELEMENTS = "a whole number of elements; DeepSpeed sizes count elements, not bytes"
Elements = _whole(1, _ELEMENTS)
ElementsOrZero = _whole(0, _ELEMENTS)
Count = _whole(1, "a whole number")
CountOrZero = _whole(0, "a whole number")
Bytes = _whole(1, "a whole number of bytes")


def _not_bool(value: Any) -> Any:
    # pydantic reads true as 1.0: gradient_clipping: true would clip at 1.0 without a word.
    if isinstance(value, bool):
        raise ValueError("expected a number, not true or false")
    return value


Number = Annotated[float, BeforeValidator(_not_bool)]


def _to_stage(value: Any) -> int:
    stage = _to_whole(value, minimum=0, what="a ZeRO stage 0, 1, 2 or 3")
    if stage > 3:
        raise ValueError(
            "ZeRO stage must be one of 0, 1, 2, 3 (0: plain data parallel, 1: shard optimizer "
            "states, 2: also gradients, 3: also parameters)"
        )
    return stage


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return MappingProxyType({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


# A free-form, read-only dict (validated elsewhere, e.g. by the optimizer registry).
FrozenDict = Annotated[Mapping[str, Any], AfterValidator(_freeze), PlainSerializer(_thaw)]


def _lower(value: Any) -> Any:
    if value is None:
        return "none"
    return value.lower() if isinstance(value, str) else value


OffloadDevice = Annotated[Literal["none", "cpu", "nvme"], BeforeValidator(_lower)]
HalfOrFull = Literal["fp32", "fp16", "bf16"]


def _cross(message: str) -> PydanticCustomError:
    """A cross-field rule violation; the message already names every dotted key involved."""
    return PydanticCustomError("cross_field", message)


def _refused(key: str, value: Any, why: str, default: Any) -> PydanticCustomError:
    """A DeepSpeed key set to a value zero does not implement, where ignoring it would change what
    the run is: one message naming the key, the value, why, and the fix."""
    return _cross(
        f"{key} = {_show(value)}: {why} Remove the key or set it to the default "
        f"({key.rsplit('.', 1)[-1]}: {_show(default)})."
    )


_DTYPE_NAMES = {
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
}


def _dtype_name(value: Any) -> Any:
    # DeepSpeed reads a dtype as any of its spellings (bfloat16, torch.float16, half, ...).
    return _DTYPE_NAMES.get(value.lower(), value) if isinstance(value, str) else value


AnyDtype = Annotated[HalfOrFull, BeforeValidator(_dtype_name)]


class _Block(BaseModel):
    """Base of every config block: immutable, unknown keys are errors, floats are finite.

    ``allow_inf_nan=False`` refuses the strings "inf" / "nan" that pydantic would otherwise read
    into a float field; non-finite numbers themselves never get this far (``_checked``).
    """

    model_config = ConfigDict(
        extra="forbid", frozen=True, validate_default=False, allow_inf_nan=False
    )


# ---------------------------------------------------------------------------------------------
# Blocks
# ---------------------------------------------------------------------------------------------


class OptimizerConfig(_Block):
    """DeepSpeed ``optimizer``: registry name plus constructor params.

    DeepSpeed's ``"Adam"`` means AdamW (decoupled weight decay) unless ``params.adam_w_mode``
    is false; ``params`` is checked by the optimizer registry, not here.
    """

    type: str = Field(
        description="Optimizer name (DeepSpeed optimizer.type): Adam, AdamW, SGD, else an "
        "element-wise torch.optim class name (Adagrad, RMSprop, Adamax, ...)."
    )
    params: FrozenDict = Field(
        default_factory=dict,
        description="Keyword arguments of the optimizer (lr, betas, eps, weight_decay, ...).",
    )
    legacy_fusion: bool = Field(
        False, description="DeepSpeed optimizer.legacy_fusion; accepted for compatibility."
    )


class SchedulerConfig(_Block):
    """DeepSpeed ``scheduler``: registry name plus params, checked by the scheduler registry."""

    type: str = Field(
        description="Scheduler name (DeepSpeed scheduler.type): WarmupLR, WarmupDecayLR, "
        "WarmupCosineLR, OneCycle, LRRangeTest."
    )
    params: FrozenDict = Field(
        default_factory=dict, description="Keyword arguments of the scheduler."
    )


class FP16Config(_Block):
    """DeepSpeed ``fp16``: float16 compute with loss scaling."""

    enabled: bool = Field(False, description="Train in float16 with loss scaling.")
    auto_cast: bool = Field(False, description="Cast floating-point inputs to float16.")
    loss_scale: Number = Field(
        0.0, ge=0, description="Static loss scale; 0 selects dynamic loss scaling."
    )
    initial_scale_power: _whole(0, "a power of two", maximum=63) = Field(
        16,
        description="Dynamic scaling starts at 2**initial_scale_power, at most 2**63: float16 "
        "overflows above 65504 (about 2**16), so a higher start only skips steps while the "
        "scale halves down, and 63 already allows 47 halvings (2**1024 is not even a float).",
    )
    loss_scale_window: Count = Field(
        1000, description="Overflow-free steps before the dynamic scale is doubled."
    )
    hysteresis: Count = Field(
        2, description="Overflows tolerated before the dynamic scale is halved."
    )
    consecutive_hysteresis: bool = Field(
        False, description="Refill hysteresis after every overflow-free step."
    )
    min_loss_scale: Number = Field(1.0, gt=0, description="Lower bound of the dynamic scale.")
    fp16_master_weights_and_grads: bool = Field(
        False, description="Keep master weights and gradients in float16 (needs fp16.enabled)."
    )


class BF16Config(_Block):
    """DeepSpeed ``bf16`` (old name ``bfloat16``): bfloat16 compute, no loss scaling."""

    enabled: bool = Field(False, description="Train in bfloat16.")
    immediate_grad_update: bool = Field(
        False, description="Apply each gradient to the fp32 accumulator as soon as it is ready."
    )
    check_grad_overflow: bool = Field(
        True,
        description="Skip optimizer steps whose gradients are not finite (inf or NaN), as fp16 "
        "does; false applies them.",
    )
    bf16_master_weights_and_grads: bool = Field(
        False, description="Keep master weights and gradients in bfloat16 instead of fp32."
    )
    bf16_optimizer_states: bool = Field(
        False, description="Keep optimizer states in bfloat16 (with bf16 master weights)."
    )

    @model_validator(mode="after")
    def _refuse_bf16_master(self) -> "BF16Config":
        # Master weights, gradients or optimizer states in bfloat16 change every update's
        # rounding: training them in fp32 instead would not be the run the config describes.
        for key in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
            if getattr(self, key):
                raise _refused(
                    f"bf16.{key}",
                    True,
                    "zero keeps fp32 master weights, gradients and optimizer states with bf16 "
                    "(fp16.fp16_master_weights_and_grads is the 2-byte option it has, for fp16).",
                    False,
                )
        return self


class DataTypesConfig(_Block):
    """DeepSpeed ``data_types``."""

    grad_accum_dtype: HalfOrFull | None = Field(
        None,
        description="Data type of gradient accumulation across micro-batches; null means fp32.",
    )
    param_dtype: AnyDtype | None = Field(
        None,
        description="Data type of the model's parameters; must be the compute dtype (fp16, bf16 "
        "or fp32 as enabled); null follows it.",
    )
    buffer_dtype: AnyDtype | None = Field(
        None,
        description="Data type of the model's floating-point buffers; null or the compute dtype "
        "(zero casts buffers to it).",
    )
    keep_in_fp32_modules: tuple[str, ...] | None = Field(
        None,
        description='Modules whose buffers stay fp32 under fp16/bf16: DeepSpeed\'s "auto" (its '
        "default, read as null) or an empty list; zero casts every buffer to the compute dtype.",
    )

    @field_validator("keep_in_fp32_modules", mode="after")
    @classmethod
    def _refuse_fp32_modules(cls, value: Any) -> Any:
        if value:
            raise _refused(
                "data_types.keep_in_fp32_modules",
                value,
                "zero casts every floating-point buffer to the compute dtype and keeps no "
                "module's buffers in fp32.",
                "auto",
            )
        return value


class OffloadOptimizerConfig(_Block):
    """DeepSpeed ``zero_optimization.offload_optimizer`` (ZeRO-Offload / ZeRO-Infinity)."""

    device: OffloadDevice = Field(
        "none", description="Where optimizer states live: none (accelerator), cpu or nvme."
    )
    nvme_path: str | None = Field(None, description="Directory for nvme offload files.")
    buffer_count: Count = Field(4, description="Number of I/O buffers for nvme offload.")
    pin_memory: bool = Field(False, description="Use page-locked CPU memory.")
    pipeline_read: bool = Field(False, description="Overlap nvme reads with compute.")
    pipeline_write: bool = Field(False, description="Overlap nvme writes with compute.")
    fast_init: bool = Field(False, description="Fast optimizer initialization on nvme.")
    ratio: Number = Field(
        1.0, gt=0, le=1, description="Fraction of optimizer states offloaded (0 < ratio <= 1)."
    )
    super_offload: bool = Field(
        False, description="DeepSpeed's SuperOffload optimizer path (superchips); no effect."
    )
    cpuadam_cores_perc: Number = Field(
        0.8, ge=0, le=1, description="Share of CPU cores DeepSpeed's CPU Adam uses; no effect."
    )


class OffloadParamConfig(_Block):
    """DeepSpeed ``zero_optimization.offload_param`` (stage 3 only). Sizes are in elements."""

    device: OffloadDevice = Field(
        "none", description="Where parameter shards live: none (accelerator), cpu or nvme."
    )
    nvme_path: str | None = Field(None, description="Directory for nvme offload files.")
    buffer_count: Count = Field(5, description="Number of buffers for nvme parameter reads.")
    buffer_size: Elements = Field(
        100_000_000, description="Size of each nvme parameter buffer, in elements."
    )
    max_in_cpu: ElementsOrZero = Field(
        1_000_000_000, description="Elements kept in CPU memory when offloading to nvme."
    )
    pin_memory: bool = Field(False, description="Use page-locked CPU memory.")


class LeafModuleConfig(_Block):
    """DeepSpeed ``zero_optimization.leaf_module``: modules stage 3 fetches as one unit."""

    classes: tuple[str, ...] = Field((), description="Module class names.")
    names: tuple[str, ...] = Field((), description="Module names.")
    name_suffixes: tuple[str, ...] = Field((), description="Module name suffixes.")


# ZeRO++ (arXiv 2306.10209) and MiCS (arXiv 2205.00119) keys: accepted at their defaults, which
# switch the features off, so DeepSpeed files that spell the defaults out still load.
_ZERO_PLUS_PLUS_KEYS = (
    "zero_hpz_partition_size",
    "zero_quantized_weights",
    "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients",
    "mics_shard_size",
    "mics_hierarchical_params_gather",
)


class ZeroConfig(_Block):
    """DeepSpeed ``zero_optimization``. Every size here counts elements, not bytes.

    ``overlap_comm`` is resolved at load time: true for stage 3, false otherwise, unless given.
    ZeRO++ / MiCS keys other than their defaults are errors: zero does not implement them.
    """

    stage: Annotated[int, BeforeValidator(_to_stage)] = Field(
        0, description="ZeRO stage: 0 data parallel, 1 optimizer states, 2 +gradients, 3 +params."
    )
    contiguous_gradients: bool = Field(
        True, description="Copy gradients into a contiguous buffer as they are produced."
    )
    reduce_scatter: bool = Field(
        True, description="Average gradients with reduce-scatter instead of all-reduce."
    )
    reduce_bucket_size: Elements = Field(
        500_000_000, description="Elements reduced at once (gradient bucket size)."
    )
    allgather_partitions: bool = Field(
        True, description="All-gather updated partitions instead of broadcasting them."
    )
    allgather_bucket_size: Elements = Field(
        500_000_000, description="Elements all-gathered at once after the optimizer step."
    )
    overlap_comm: bool | None = Field(
        None,
        validate_default=True,
        description="Overlap gradient reduction with backward; default: true for stage 3.",
    )
    load_from_fp32_weights: bool = Field(
        True, description="Restore fp32 master weights from the checkpoint, not from 16-bit ones."
    )
    elastic_checkpoint: bool = Field(
        False, description="Allow loading optimizer checkpoints saved with another world size."
    )
    offload_optimizer: OffloadOptimizerConfig | None = Field(
        None, description="Optimizer-state offload (ZeRO-Offload); stages 1-3."
    )
    offload_param: OffloadParamConfig | None = Field(
        None, description="Parameter offload (ZeRO-Infinity); stage 3 only."
    )
    sub_group_size: Elements = Field(
        1_000_000_000, description="Elements per optimizer sub-group step (stage 3)."
    )
    stage3_prefetch_bucket_size: ElementsOrZero = Field(
        50_000_000, description="Elements of parameters prefetched ahead of use; 0 disables."
    )
    stage3_param_persistence_threshold: ElementsOrZero = Field(
        100_000, description="Parameters with fewer elements stay unpartitioned."
    )
    stage3_model_persistence_threshold: ElementsOrZero = Field(
        sys.maxsize, description="Cap on total elements of persistent parameters (unlimited)."
    )
    stage3_max_live_parameters: ElementsOrZero = Field(
        1_000_000_000, description="Max elements of gathered parameters alive at once."
    )
    stage3_max_reuse_distance: ElementsOrZero = Field(
        1_000_000_000,
        description="Keep a parameter gathered if it is reused within this many elements.",
    )
    stage3_gather_16bit_weights_on_model_save: bool = Field(
        False, description="Gather full 16-bit weights when the model is saved."
    )
    stage3_module_granularity_threshold: ElementsOrZero = Field(
        0, description="Modules below this many elements are fetched as one unit; 0 disables."
    )
    stage3_module_classes: tuple[str, ...] | None = Field(
        None,
        description="zero's own override: module class names used as stage-3 fetch units.",
    )
    ignore_unused_parameters: bool = Field(
        True, description="Do not fail when some parameters get no gradient."
    )
    round_robin_gradients: bool = Field(
        False, description="Round-robin gradient copies across ranks (offload)."
    )
    zero_hpz_partition_size: Count = Field(
        1, description="ZeRO++ hierarchical partition size (secondary parameter shards)."
    )
    zero_quantized_weights: bool = Field(False, description="ZeRO++ quantized weight all-gather.")
    zero_quantized_nontrainable_weights: bool = Field(
        False, description="ZeRO++ keep non-trainable weights quantized."
    )
    zero_quantized_gradients: bool = Field(
        False, description="ZeRO++ quantized gradient reduce-scatter."
    )
    mics_shard_size: _whole(-1, "a number of ranks, or -1") = Field(
        -1, description="MiCS shard group size; -1 disables MiCS."
    )
    mics_hierarchical_params_gather: bool = Field(
        False, description="MiCS hierarchical all-gather."
    )
    # DeepSpeed implementation switches: how its own kernels and collectives run, not what is
    # trained. Accepted and validated so DeepSpeed files load; zero has no such switch.
    use_multi_rank_bucket_allreduce: bool = Field(
        True, description="DeepSpeed: all-reduce a gradient bucket over several ranks at once."
    )
    compute_grad_norm: bool = Field(
        True, description="DeepSpeed: compute the global gradient norm at stages 1-2."
    )
    stage3_use_all_reduce_for_fetch_params: bool = Field(
        False, description="DeepSpeed: fetch stage-3 parameters with all-reduce, not all-gather."
    )
    stage3_allgather_sequential: bool = Field(
        False, description="DeepSpeed: all-gather stage-3 parameters one by one, not bucketed."
    )
    legacy_stage1: bool = Field(False, description="DeepSpeed: its old stage-1 implementation.")
    parameter_alignment: bool = Field(
        False, description="DeepSpeed: pad flat buffers so each parameter is 16-byte aligned."
    )
    memory_efficient_linear: bool = Field(
        True, description="DeepSpeed: its memory-efficient Linear at stage 3."
    )
    pipeline_loading_checkpoint: bool = Field(
        False, description="DeepSpeed: load stage-3 checkpoints in pipeline mode."
    )
    override_module_apply: bool = Field(
        True, description="DeepSpeed: wrap nn.Module.apply to gather stage-3 parameters."
    )
    log_trace_cache_warnings: bool = Field(
        False, description="DeepSpeed: log its stage-3 trace cache invalidations."
    )
    enable_sanity_checks: bool = Field(False, description="DeepSpeed: its internal checks.")
    save_muon_momentum_buffer_in_memory: bool = Field(
        False, description="DeepSpeed: keep Muon momentum in memory under nvme offload."
    )
    # Acted on (engine.py, _leaf_classes and _mark_leaf_names), unlike the switches above.
    leaf_module: LeafModuleConfig | None = Field(
        None,
        description="Modules fetched as one stage-3 unit: classes (added to "
        "stage3_module_classes), module names and name suffixes.",
    )
    zenflow: FrozenDict | None = Field(
        None, description="ZenFlow (stale updates of less important gradients); refused."
    )

    @field_validator("overlap_comm", mode="after")
    @classmethod
    def _default_overlap(cls, value: bool | None, info: ValidationInfo) -> bool:
        # DeepSpeed's default depends on the stage: stage 3 always wants prefetch overlap.
        if value is None:
            return info.data.get("stage") == 3
        return value

    @model_validator(mode="after")
    def _refuse_zero_plus_plus(self) -> "ZeroConfig":
        # Quantized or hierarchical collectives change the numerics and the communication
        # pattern: a run that ignored them would not be the run the config describes.
        fields = type(self).model_fields
        changed = [k for k in _ZERO_PLUS_PLUS_KEYS if getattr(self, k) != fields[k].default]
        if not changed:
            return self
        given = ", ".join(f"zero_optimization.{k} = {_show(getattr(self, k))}" for k in changed)
        defaults = ", ".join(f"{k}: {_show(fields[k].default)}" for k in changed)
        raise _cross(
            f"{given}: zero does not implement ZeRO++ / MiCS (quantized weights or gradients, "
            "hierarchical or MiCS-sharded communication). Remove the key"
            f"{'s' if len(changed) > 1 else ''} or set {'them' if len(changed) > 1 else 'it'} "
            f"to the default ({defaults}); zero then trains with full-precision collectives "
            "over the whole data-parallel group."
        )

    @model_validator(mode="after")
    def _refuse_zenflow(self) -> "ZeroConfig":
        if self.zenflow is not None:
            raise _cross(
                f"zero_optimization.zenflow = {_show(self.zenflow)}: zero does not implement "
                "ZenFlow, which updates the less important gradient columns late; training "
                "without it would not be the run the config describes. Remove the key (or set "
                "it to null)."
            )
        return self

    @model_validator(mode="after")
    def _check_offload(self) -> "ZeroConfig":
        opt, par = self.offload_optimizer, self.offload_param
        if par is not None and par.device != "none" and self.stage != 3:
            raise _cross(
                f"zero_optimization.offload_param.device '{par.device}' needs "
                f"zero_optimization.stage 3 (got {self.stage}); set stage 3 or remove it."
            )
        if opt is not None and opt.device != "none" and self.stage == 0:
            raise _cross(
                f"zero_optimization.offload_optimizer.device '{opt.device}' needs "
                "zero_optimization.stage 1, 2 or 3 (got 0)."
            )
        for name, block in (("offload_optimizer", opt), ("offload_param", par)):
            if block is not None and block.device == "nvme" and not block.nvme_path:
                raise _cross(
                    f"zero_optimization.{name}.device is 'nvme' but "
                    f"zero_optimization.{name}.nvme_path is not set; give a directory."
                )
        return self


class ActivationCheckpointingConfig(_Block):
    """DeepSpeed ``activation_checkpointing`` (ZeRO-R: Pa, Pa+cpu, MD)."""

    partition_activations: bool = Field(
        False, description="Partition checkpointed activations across model-parallel ranks (Pa)."
    )
    cpu_checkpointing: bool = Field(
        False, description="Offload partitioned activation checkpoints to CPU (Pa+cpu)."
    )
    contiguous_memory_optimization: bool = Field(
        False, description="Copy checkpoints into a pre-allocated contiguous buffer (MD)."
    )
    number_checkpoints: Count | None = Field(
        None, description="Number of checkpoints, sizes the contiguous buffer."
    )
    synchronize_checkpoint_boundary: bool = Field(
        False, description="Synchronize the device at each checkpoint boundary."
    )
    profile: bool = Field(False, description="Time checkpoint forward and recompute.")


class CommsLoggerConfig(_Block):
    """DeepSpeed ``comms_logger``: per-collective counts, sizes and times."""

    enabled: bool = Field(False, description="Log collectives.")
    verbose: bool = Field(False, description="Print every collective as it happens.")
    prof_all: bool = Field(True, description="Profile every collective.")
    debug: bool = Field(False, description="Add the caller's name to each record.")
    prof_ops: tuple[str, ...] = Field(
        (), description="Collective names to profile when prof_all is false."
    )


class FlopsProfilerConfig(_Block):
    """DeepSpeed ``flops_profiler``."""

    enabled: bool = Field(False, description="Profile FLOPs, latency and parameters.")
    recompute_fwd_factor: Number = Field(
        0.0, ge=0, description="Extra forward passes due to activation recomputation."
    )
    profile_step: Count = Field(1, description="Training step to profile.")
    module_depth: _whole(-1, "a depth, or -1 for all") = Field(
        -1, description="Depth of the per-module report; -1 means all."
    )
    top_modules: Count = Field(1, description="Number of top modules listed.")
    detailed: bool = Field(True, description="Print the per-module breakdown.")
    output_file: str | None = Field(None, description="Write the report here (default stdout).")


class MonitorConfig(_Block):
    """DeepSpeed ``tensorboard`` / ``csv_monitor``: where scalar logs are written."""

    enabled: bool = Field(False, description="Write this monitor's logs.")
    output_path: str = Field("", description="Output directory ('' = current directory).")
    job_name: str = Field("zero_job", description="Sub-directory / run name.")


class WandbConfig(_Block):
    """DeepSpeed ``wandb``."""

    enabled: bool = Field(False, description="Log to Weights & Biases.")
    project: str = Field("zero", description="W&B project.")
    team: str | None = Field(None, description="W&B team (entity).")
    group: str | None = Field(None, description="W&B run group.")
    output_path: str = Field("", description="Local directory for W&B files.")
    job_name: str | None = Field(None, description="W&B run name.")


class CometConfig(_Block):
    """DeepSpeed ``comet``: the Comet ML monitor (zero does not log to Comet)."""

    enabled: bool = Field(False, description="Log to Comet.")
    samples_log_interval: Count = Field(100, description="Samples between two metric uploads.")
    project: str | None = Field(None, description="Comet project.")
    workspace: str | None = Field(None, description="Comet workspace.")
    api_key: str | None = Field(None, description="Comet API key.")
    experiment_name: str | None = Field(None, description="Comet experiment name.")
    experiment_key: str | None = Field(None, description="Key of the Comet experiment.")
    online: bool | None = Field(None, description="Log to the Comet server (else offline).")
    mode: Literal["get", "create", "get_or_create"] | None = Field(
        None, description="How the experiment starts: get, create or get_or_create."
    )


class ThroughputTimerConfig(_Block):
    """DeepSpeed ``timers.throughput``."""

    enabled: bool = Field(True, description="DeepSpeed's throughput timer.")
    synchronized: bool = Field(True, description="Synchronize the device before reading it.")


class TimersConfig(_Block):
    """DeepSpeed ``timers``."""

    throughput: ThroughputTimerConfig = Field(
        default_factory=ThroughputTimerConfig, description="DeepSpeed's throughput timer."
    )


class TorchAutocastConfig(_Block):
    """DeepSpeed ``torch_autocast``: torch.autocast around forward with fp32 weights (refused)."""

    enabled: bool = Field(False, description="Run forward under torch.autocast.")
    dtype: AnyDtype | None = Field(None, description="Autocast data type.")
    lower_precision_safe_modules: tuple[str, ...] | None = Field(
        None, description="Module classes whose parameters are cast to the autocast dtype."
    )

    @model_validator(mode="after")
    def _refuse_enabled(self) -> "TorchAutocastConfig":
        # fp32 weights with 16-bit autocast compute is a third precision mode, neither zero's
        # fp32 training nor its fp16/bf16 (16-bit weights, fp32 master copy).
        if self.enabled:
            raise _refused(
                "torch_autocast.enabled",
                True,
                "zero does not run forward under torch.autocast; training without it would "
                "compute in fp32 instead of the autocast dtype. For 16-bit compute use "
                "bf16.enabled or fp16.enabled.",
                False,
            )
        return self


class TensorParallelConfig(_Block):
    """DeepSpeed ``tensor_parallel``: AutoTP training (refused when it shards the model)."""

    autotp_size: CountOrZero = Field(
        0, description="AutoTP tensor-parallel size; 0 or 1 leaves the model whole."
    )
    tp_overlap_comm: bool = Field(False, description="Overlap AutoTP communication.")
    vocab_parallel_lm_head: bool | None = Field(
        None, description="Shard the language-model head over the vocabulary."
    )
    vocab_parallel_ce_backend: Literal["torch", "liger"] = Field(
        "torch", description="Cross-entropy kernel for a vocabulary-parallel head."
    )
    tp: FrozenDict = Field(
        default_factory=dict, description="Inner tensor-parallel settings (tp_size, ...)."
    )
    injection_policy_tuple: tuple[Any, ...] | None = Field(
        None, description="Module injection policy."
    )
    partition_config: FrozenDict | None = Field(None, description="Custom layer partitioning.")
    preset_model: str | None = Field(None, description="Preset partitioning for a known model.")
    keep_module_on_host: bool = Field(False, description="Keep module weights on the host.")
    kernel_inject: bool = Field(False, description="Inject DeepSpeed inference kernels.")

    @model_validator(mode="after")
    def _refuse_autotp(self) -> "TensorParallelConfig":
        tp_size = self.tp.get("tp_size", 1)
        if self.autotp_size > 1 or (isinstance(tp_size, int) and tp_size > 1):
            key, value = (
                ("autotp_size", self.autotp_size) if self.autotp_size > 1 else ("tp", self.tp)
            )
            raise _refused(
                f"tensor_parallel.{key}",
                value,
                "zero does not shard a model automatically (AutoTP); ignoring it would train "
                "every layer whole on each rank, a different data-parallel layout. Build the "
                "model from zero.tensor_parallel's layers and pass an mpu instead.",
                0 if key == "autotp_size" else {},
            )
        return self


def _capitalize(value: Any) -> Any:
    return value.capitalize() if isinstance(value, str) else value


def _upper(value: Any) -> Any:
    return value.upper() if isinstance(value, str) else value


class ParallelWriteConfig(_Block):
    """DeepSpeed ``checkpoint.parallel_write``."""

    pipeline_stage: bool = Field(
        False, description="DeepSpeed: pipeline stages write their checkpoint files in parallel."
    )


class CheckpointWriterConfig(_Block):
    """DeepSpeed ``checkpoint.writer``: its checkpoint writer engine (zero writes its own way)."""

    type: Annotated[Literal["MOCK", "PYTHON", "FAST"], BeforeValidator(_upper)] = Field(
        "FAST", description="DeepSpeed writer: MOCK, PYTHON or FAST."
    )
    io_buffer_size: Bytes = Field(64 * 1024**2, description="Writer I/O buffer, in bytes.")
    io_buffer_double: bool = Field(True, description="Double-buffer writes.")
    io_multiplier: Count = Field(1, description="Writer I/O multiplier.")
    show_statistics: bool = Field(False, description="Print write statistics.")
    data_parallel: Annotated[
        Literal["REPLICA", "SOCKET", "MACHINE"] | None, BeforeValidator(_upper)
    ] = Field(None, description="Which ranks write: REPLICA, SOCKET or MACHINE.")
    decoupled: bool = Field(False, description="Write from a separate process.")


class CheckpointConfig(_Block):
    """DeepSpeed ``checkpoint``."""

    tag_validation: Annotated[Literal["Warn", "Ignore", "Fail"], BeforeValidator(_capitalize)] = (
        Field("Warn", description="Check that all ranks save the same tag: Warn, Ignore or Fail.")
    )
    load_universal: bool = Field(False, description="Load a universal (resharded) checkpoint.")
    use_node_local_storage: bool = Field(
        False, description="Each node writes to its own local storage."
    )
    verify_checksums: bool = Field(
        True,
        description="On load, check the crc32 meta.json records for each file before reading "
        "it (one extra read, about 0.2 s per GB per core); false skips it for huge checkpoints.",
    )
    parallel_write: ParallelWriteConfig | None = Field(
        None, description="DeepSpeed: parallel checkpoint writes by pipeline stage."
    )
    checkpoint_serialization: bool = Field(
        True, description="DeepSpeed: torch.save's zipfile serialization."
    )
    writer: CheckpointWriterConfig | None = Field(
        None, description="DeepSpeed's checkpoint writer engine."
    )


class AioConfig(_Block):
    """DeepSpeed ``aio``: asynchronous I/O for nvme offload. ``block_size`` is in bytes."""

    block_size: Bytes = Field(1_048_576, description="I/O block size in bytes.")
    queue_depth: Count = Field(8, description="I/O queue depth.")
    intra_op_parallelism: Count = Field(1, description="I/O threads per operation.")
    single_submit: bool = Field(False, description="Submit requests one at a time.")
    overlap_events: bool = Field(True, description="Overlap submission and completion.")
    use_gds: bool = Field(False, description="Use GPUDirect Storage.")


# Blocks of DeepSpeed subsystems zero does not implement: accepted as free dicts so existing
# files load, with one warning when a block says "enabled": true.
UNSUPPORTED_BLOCKS = (
    "amp",
    "elasticity",
    "autotuning",
    "compression_training",
    "data_efficiency",
    "pipeline",
    "sparse_attention",
    "curriculum_learning",
    "progressive_layer_drop",
    "eigenvalue",
    "hybrid_engine",
    "compile",
)

_UNSUPPORTED_DESCRIPTION = "DeepSpeed subsystem not supported by zero; accepted and ignored."


class Config(_Block):
    """The whole validated, immutable training configuration (DeepSpeed key names).

    Build it with ``load_config``; after that the three batch keys are ints satisfying
    ``train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps *
    world_size``. Read blocks as attributes, e.g. ``config.zero.stage``.
    """

    train_batch_size: Count | None = Field(
        None, description="Global batch per optimizer step = micro * gas * world size."
    )
    train_micro_batch_size_per_gpu: Count | None = Field(
        None, description="Samples per rank per forward/backward (micro-batch)."
    )
    gradient_accumulation_steps: Count | None = Field(
        None, description="Micro-batches accumulated before each optimizer step."
    )
    gradient_clipping: Number = Field(
        1.0, ge=0, description="Clip the global gradient L2 norm to this value; 0 disables."
    )
    steps_per_print: Count = Field(10, description="Log progress every this many steps.")
    agreement_timeout: Number = Field(
        300.0,
        gt=0,
        description="zero's own: seconds a rank waits at a checked collective (stage-3 "
        "all-gathers, end of backward, collective methods such as save_checkpoint) for the "
        "other ranks before every rank stops with an error naming the missing ranks.",
    )
    wall_clock_breakdown: bool = Field(
        False, description="Time forward, backward and step separately."
    )
    memory_breakdown: bool = Field(False, description="Log memory use at each phase.")
    prescale_gradients: bool = Field(
        False, description="Divide gradients by the world size before reduction, not after."
    )
    gradient_predivide_factor: Number = Field(
        1.0, gt=0, description="Divide gradients by this before reduction, the rest after."
    )
    communication_data_type: HalfOrFull | None = Field(
        None, description="Data type of gradient reduction; null follows the compute dtype."
    )
    sparse_gradients: bool = Field(False, description="Reduce embedding gradients as sparse.")
    dataloader_drop_last: bool = Field(False, description="Drop the last incomplete batch.")
    zero_allow_untested_optimizer: bool = Field(
        False, description="Allow client optimizers not tested with ZeRO."
    )
    zero_force_ds_cpu_optimizer: bool = Field(
        True, description="With CPU offload, require the native CPU Adam."
    )
    managed_gradient_accumulation: bool = Field(
        True,
        description="The engine counts micro-batches and steps at the boundary; false (each "
        "step() updates) is refused.",
    )
    gradient_allreduce_op: Annotated[Literal["mean", "sum"], BeforeValidator(_lower)] = Field(
        "mean", description="Average gradients over ranks; sum is refused."
    )
    dump_state: bool = Field(False, description="DeepSpeed: print its state after initialize.")
    disable_allgather: bool = Field(
        False, description="DeepSpeed: broadcast updated partitions instead of all-gathering."
    )
    disable_python_gc: bool = Field(
        False, description="DeepSpeed: turn off Python's garbage collector during training."
    )
    seq_parallel_communication_data_type: AnyDtype = Field(
        "fp32", description="DeepSpeed: data type of sequence-parallel communication."
    )
    vocabulary_size: Count | None = Field(
        None, description="DeepSpeed: warn when not a multiple of 8 (tensor cores)."
    )
    use_data_before_expert_parallelism: bool = Field(
        False, description="DeepSpeed: data-parallel groups before expert-parallel ones (MoE)."
    )
    log_level: str | None = Field(None, description="DeepSpeed: level of its own logger.")
    optimizer: OptimizerConfig | None = Field(
        None, description="Optimizer type and params; absent when the client passes one."
    )
    scheduler: SchedulerConfig | None = Field(
        None, description="LR scheduler type and params; optional."
    )
    fp16: FP16Config = Field(default_factory=FP16Config, description="float16 training.")
    bf16: BF16Config = Field(default_factory=BF16Config, description="bfloat16 training.")
    data_types: DataTypesConfig = Field(
        default_factory=DataTypesConfig, description="Gradient accumulation data type."
    )
    zero_optimization: ZeroConfig = Field(
        default_factory=ZeroConfig, description="ZeRO stage and its buckets, offload, stage 3."
    )
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig, description="ZeRO-R activation settings."
    )
    comms_logger: CommsLoggerConfig = Field(
        default_factory=CommsLoggerConfig, description="Collective communication log."
    )
    flops_profiler: FlopsProfilerConfig = Field(
        default_factory=FlopsProfilerConfig, description="FLOPs profiler."
    )
    tensorboard: MonitorConfig = Field(
        default_factory=MonitorConfig, description="TensorBoard scalar logs."
    )
    csv_monitor: MonitorConfig = Field(default_factory=MonitorConfig, description="CSV logs.")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Weights & Biases logs.")
    comet: CometConfig = Field(default_factory=CometConfig, description="Comet ML logs.")
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Checkpoint save/load options."
    )
    aio: AioConfig = Field(default_factory=AioConfig, description="Async I/O for nvme offload.")
    timers: TimersConfig = Field(
        default_factory=TimersConfig, description="DeepSpeed's throughput timer."
    )
    torch_autocast: TorchAutocastConfig = Field(
        default_factory=TorchAutocastConfig, description="torch.autocast with fp32 weights."
    )
    tensor_parallel: TensorParallelConfig = Field(
        default_factory=TensorParallelConfig, description="AutoTP tensor parallelism."
    )
    weight_quantization: FrozenDict | None = Field(
        None, description="Quantized weights (DeepSpeed's default: enabled when given)."
    )
    expert_parallel: FrozenDict | None = Field(
        None, description="AutoEP expert parallelism for MoE models."
    )
    datastates_ckpt: FrozenDict | None = Field(
        None, description="DeepSpeed: DataStates asynchronous checkpointing engine."
    )
    amp: FrozenDict | None = Field(None, description=_UNSUPPORTED_DESCRIPTION)
    elasticity: FrozenDict | None = Field(None, description=_UNSUPPORTED_DESCRIPTION)
    autotuning: FrozenDict | None = Field(None, description=_UNSUPPORTED_DESCRIPTION)
    compression_training: FrozenDict | None = Field(None, description=_UNSUPPORTED_DESCRIPTION)
    data_efficiency: FrozenDict | None = Field(None, description=_UNSUPPORTED_DESCRIPTION)
    pipeline: FrozenDict | None = Field(None, description=_UNSUPPORTED_DESCRIPTION)
    sparse_attention: FrozenDict | None = Field(None, description=_UNSUPPORTED_DESCRIPTION)
    curriculum_learning: FrozenDict | None = Field(None, description=_UNSUPPORTED_DESCRIPTION)
    progressive_layer_drop: FrozenDict | None = Field(None, description=_UNSUPPORTED_DESCRIPTION)
    eigenvalue: FrozenDict | None = Field(None, description=_UNSUPPORTED_DESCRIPTION)
    hybrid_engine: FrozenDict | None = Field(None, description=_UNSUPPORTED_DESCRIPTION)
    compile: FrozenDict | None = Field(None, description=_UNSUPPORTED_DESCRIPTION)

    # The mapping this config was validated from (after deprecated names and "auto" were
    # resolved, before batch derivation), so it can be re-validated for another world size.
    _source: Mapping[str, Any] | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _refuse_changed_runs(self) -> "Config":
        # Keys whose non-default value makes DeepSpeed train something else than zero would.
        if not self.managed_gradient_accumulation:
            raise _refused(
                "managed_gradient_accumulation",
                False,
                "zero steps the optimizer at the gradient accumulation boundary only "
                "(gradient_accumulation_steps); each step() would not apply an update.",
                True,
            )
        if self.gradient_allreduce_op != "mean":
            raise _refused(
                "gradient_allreduce_op",
                self.gradient_allreduce_op,
                "zero averages gradients over the data-parallel ranks; summing them makes each "
                "update world-size times larger.",
                "mean",
            )
        quant = self.weight_quantization
        if quant is not None and quant.get("enabled", True) is not False:
            raise _cross(
                f"weight_quantization = {_show(quant)}: zero does not quantize weights; "
                "training in full precision would not be the run the config describes. Remove "
                'the block or set "enabled": false.'
            )
        expert = self.expert_parallel
        if expert is not None and expert.get("enabled", False) is not False:
            raise _cross(
                f"expert_parallel = {_show(expert)}: zero does not shard experts over ranks "
                "(AutoEP); ignoring it would replicate every expert, a different layout. "
                'Remove the block or set "enabled": false.'
            )
        return self

    @model_validator(mode="after")
    def _check_precision(self) -> "Config":
        if self.fp16.enabled and self.bf16.enabled:
            raise _cross(
                "fp16.enabled and bf16.enabled are both true; enable at most one "
                "(fp16 uses loss scaling, bf16 does not)."
            )
        if self.fp16.fp16_master_weights_and_grads and not self.fp16.enabled:
            raise _cross(
                "fp16.fp16_master_weights_and_grads is true but fp16.enabled is false; "
                "enable fp16 or remove the key."
            )
        accum = self.data_types.grad_accum_dtype
        compute = "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"
        if accum not in (None, "fp32", compute):
            allowed = (
                "'fp32'" if compute == "fp32" else f"'fp32' or '{compute}' (the compute dtype)"
            )
            raise _cross(
                f"data_types.grad_accum_dtype '{accum}' does not fit {compute} training; "
                f"use {allowed}."
            )
        for key in ("param_dtype", "buffer_dtype"):
            given = getattr(self.data_types, key)
            if given not in (None, compute):
                raise _cross(
                    f"data_types.{key} '{given}' does not fit {compute} training: zero keeps "
                    f"parameters and floating-point buffers in the compute dtype. Use "
                    f"'{compute}' or remove the key."
                )
        return self

    @property
    def zero(self) -> ZeroConfig:
        """The ``zero_optimization`` block, so code reads ``config.zero.stage``."""
        return self.zero_optimization

    @property
    def compute_dtype(self) -> torch.dtype:
        """torch.float16 with fp16.enabled, torch.bfloat16 with bf16.enabled, else float32."""
        if self.fp16.enabled:
            return torch.float16
        if self.bf16.enabled:
            return torch.bfloat16
        return torch.float32

    @property
    def grad_accum_dtype(self) -> torch.dtype:
        """torch dtype of ``data_types.grad_accum_dtype``; torch.float32 when unset."""
        return _DTYPES[self.data_types.grad_accum_dtype or "fp32"]

    @property
    def loss_scaling_dynamic(self) -> bool:
        """True when fp16 is enabled with ``loss_scale`` 0 (dynamic loss scaling)."""
        return self.fp16.enabled and self.fp16.loss_scale == 0

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as a JSON-serializable dict (checkpoint metadata, logs)."""
        return self.model_dump(mode="json")


_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------

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


def load_config(
    source: "str | os.PathLike[str] | Mapping[str, Any] | Config",
    *,
    world_size: int = 1,
    auto_values: Mapping[str, Any] | None = None,
    notes: list[str] | None = None,
) -> Config:
    """Load, validate and resolve a DeepSpeed-style config.

    Args:
        source: path to a .json (read with hjson, so comments work), .hjson, .yaml or .yml file;
            a mapping; or an existing ``Config``, which is re-validated for ``world_size``.
        world_size: data-parallel world size used to derive the batch triple.
        auto_values: values for ``"auto"`` entries, by dotted key (e.g.
            ``{"train_micro_batch_size_per_gpu": 8, "optimizer.params.lr": 1e-3}``); a
            ``"hidden_size"`` entry fills "auto" reduce_bucket_size (h*h),
            stage3_prefetch_bucket_size (0.9*h*h) and stage3_param_persistence_threshold (10*h).
            An "auto" bucket size or threshold in zero_optimization that nothing fills takes
            the field's default (see [Note: "auto" that takes the default]).
        notes: when given, the info lines about how the config was resolved (the "auto"
            entries that took defaults; at most one line) are appended here instead of being
            logged to the "zero" logger, so a caller without a log handler yet (zero.initialize)
            can log them once it has one.

    Returns:
        An immutable ``Config`` whose three batch keys are ints.

    Raises:
        ConfigError: missing, unreadable, non-UTF-8 or unparsable file, non-finite number or
            nesting deeper than 100 levels anywhere, unknown key, invalid value, broken cross-field
            rule, unresolved "auto", ZeRO++ / MiCS keys set to anything but their defaults
            (not implemented), or a batch triple that does not fit ``world_size``. The message
            names the dotted key, the value and the fix (and the file, if any).

    Warns:
        FutureWarning for each deprecated DeepSpeed name; UserWarning for enabled blocks of
        subsystems zero does not support.
    """
    found: list[str] = []
    if isinstance(source, Config):
        where = "config: "
        data = _thaw(source._source or source.model_dump(exclude_unset=True))
    else:
        where, data = _read_source(source)
        data = _map_deprecated(data, where)
        if auto_values is not None and not isinstance(auto_values, Mapping):
            raise ConfigError(
                "auto_values must be a mapping of dotted keys to values, got "
                f"{type(auto_values).__name__}."
            )
        data = _resolve_auto(data, auto_values or {}, where, found)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be a positive int, got {world_size!r}.")
    try:
        config = Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_describe(err, where)) from None
    train, micro, gas = _derive_batch(
        config.train_batch_size,
        config.train_micro_batch_size_per_gpu,
        config.gradient_accumulation_steps,
        world_size,
        where,
    )
    config = config.model_copy(
        update={
            "train_batch_size": train,
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": gas,
        }
    )
    config._source = _freeze(data)
    if not isinstance(source, Config):  # the first load already warned
        _warn_unsupported(config, where)
    if notes is not None:
        notes.extend(found)
    else:
        for line in found:
            logger.info(line)
    return config


def settings_without_effect(config: Config, *, model_parallel_world_size: int) -> list[str]:
    """Lines naming what ``config`` asks for that has no effect in this run (empty when none).

    zero.initialize logs them once at INFO (shown on rank 0): settings that are inert because
    of how the run is set up, and switches of DeepSpeed features zero does not have that a user
    would otherwise wait for (wandb, the FLOPs profiler, gradient pre-division).

    Args:
        config: a loaded config.
        model_parallel_world_size: ranks in the model-parallel (tensor-parallel) group; 1
            without model parallelism (no mpu).
    """
    lines = []
    block = config.activation_checkpointing
    if block.partition_activations and model_parallel_world_size == 1:
        # Pa keeps a 1/mp slice of an input that every model-parallel rank holds in full; with
        # mp = 1 the slice is the whole input (activation.py's _KeptInputs skips partitioning).
        lines.append(
            "activation_checkpointing.partition_activations has no effect without model "
            "parallelism (model-parallel world size 1): checkpointed activations are not "
            "replicated across a model-parallel group, so each rank keeps them whole "
            "(cpu_checkpointing and contiguous_memory_optimization still apply). Set it to "
            "false, or pass an mpu whose model-parallel size is above 1."
        )
    if config.wandb.enabled:
        lines.append(
            "wandb.enabled: zero does not log to Weights & Biases; its step metrics go to "
            "tensorboard or csv_monitor (docs/observability.md), or log engine values from the "
            "training script."
        )
    if config.comet.enabled:
        lines.append(
            "comet.enabled: zero does not log to Comet; its step metrics go to tensorboard or "
            "csv_monitor (docs/observability.md), or log engine values from the training script."
        )
    if config.flops_profiler.enabled:
        lines.append(
            "flops_profiler.enabled: zero has no per-module FLOPs profiler; its step line "
            "reports tokens/s and model TFLOP/s every steps_per_print steps."
        )
    if config.aio.use_gds:
        lines.append(
            "aio.use_gds: zero's nvme offload reads and writes through host buffers "
            "(zero.ops.aio), not GPUDirect Storage."
        )
    if config.prescale_gradients or config.gradient_predivide_factor != 1.0:
        lines.append(
            "prescale_gradients / gradient_predivide_factor: zero sums gradients over ranks "
            "and divides once after the reduction, in fp32 or communication_data_type; "
            "these keys do not change that."
        )
    return lines


def _read_source(source: Any) -> tuple[str, dict[str, Any]]:
    """Return (message prefix, raw dict) for a path or mapping, checked by ``_checked``."""
    if isinstance(source, Mapping):
        return "config: ", _checked(source, "", "config: ")
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(
            f"config source must be a path, a dict or a Config, got {type(source).__name__}."
        )
    path = Path(source)
    where = f"config file '{path}': "
    suffix = path.suffix.lower()
    if suffix not in (".json", ".hjson", ".yaml", ".yml"):
        raise ConfigError(f"{where}unknown file type '{suffix}'; use .json, .hjson, .yaml or .yml.")
    data = _parse(_read_text(path, where), suffix, where)
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{where}the top level must be a mapping of keys, got {type(data).__name__}."
        )
    return where, _checked(data, "", where)


def _read_text(path: Path, where: str) -> str:
    """The file's text; a ConfigError for a directory, a missing file or bytes not UTF-8."""
    try:
        if path.is_dir():
            raise ConfigError(f"{where}is a directory; give the path of the config file in it.")
        if not path.exists():
            raise ConfigError(f"{where}file not found; check the path.")
        if not path.is_file():
            raise ConfigError(f"{where}is not a regular file; give the path of a config file.")
        raw = path.read_bytes()
    except OSError as err:
        raise ConfigError(
            f"{where}cannot be read ({err.strerror or err}); check the path and its permissions."
        ) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(_not_utf8(raw, err.start, where)) from None


def _not_utf8(raw: bytes, start: int, where: str) -> str:
    """Name the line, column and byte offset of the first byte that is not UTF-8."""
    line_start = raw.rfind(b"\n", 0, start) + 1
    line = raw.count(b"\n", 0, start) + 1
    column = len(raw[line_start:start].decode("utf-8")) + 1  # valid: the error is the first
    bom = raw[:2] in (b"\xff\xfe", b"\xfe\xff")
    why = " (it starts with a UTF-16 byte order mark)" if bom else ""
    return (
        f"{where}not UTF-8{why}: byte 0x{raw[start]:02x} at line {line}, column {column} "
        f"(byte offset {start}) cannot be decoded. Save the file as UTF-8."
    )


def _parse(text: str, suffix: str, where: str) -> Any:
    """Parse JSON / hjson / YAML text; every parser failure becomes a ConfigError."""
    try:
        if suffix in (".yaml", ".yml"):
            return yaml.load(text, Loader=_YamlLoader)  # a SafeLoader subclass: no objects
        return hjson.loads(text, object_pairs_hook=_mapping_from_pairs, parse_float=_hjson_float)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(f"{where}YAML parse error{line}: {problem}.") from None
    except hjson.HjsonDecodeError as err:
        # hjson reads a bare word up to the end of the line, brackets included.
        hint = ""
        if re.search(r"[:,\[]\s*-?(Infinity|NaN)\b", text):
            hint = " (Infinity and NaN are not accepted anywhere; write a finite number)"
        raise ConfigError(
            f"{where}parse error at line {err.lineno}, column {err.colno}: {err.msg}{hint}."
        ) from None
    except RecursionError:
        raise ConfigError(_too_deep(where, "")) from None
    except ValueError as err:
        # int() of more than 4300 digits, or a YAML date that does not exist (2020-13-45).
        reason = str(err).split(";")[0]
        raise ConfigError(
            f"{where}a value cannot be read: {reason}. Correct it (a number fits in 19 digits, "
            "a YAML date must exist) or quote it to keep it as text."
        ) from None


class _OutOfRange(float):
    """hjson's float for a literal beyond the float range, such as 1e400: infinity."""

    # hjson turns integral floats below 1e10 into ints by testing int(value) == value, and
    # int(inf) raises OverflowError. Here int() gives 0, so the test fails, the value stays
    # infinity and _checked names its key like any other non-finite number.
    def __int__(self) -> int:
        return 0


def _hjson_float(text: str) -> float:
    value = float(text)
    return value if math.isfinite(value) else _OutOfRange(value)


# [Note: what the checking walk refuses]
# _checked copies the parsed data once, before anything else looks at it, and refuses:
# - a key given twice in one mapping (see [Note: duplicate keys]);
# - a key that is not a string (YAML reads unquoted 1, true, null as int, bool, None);
# - nesting deeper than _MAX_DEPTH: every later step (deprecated names, "auto", pydantic,
#   freezing) recurses, and a mapping that contains itself (a YAML alias, a dict built in
#   Python) would recurse without end. DeepSpeed keys nest at most 3 levels deep;
# - non-finite numbers anywhere, free-form blocks (optimizer.params, scheduler.params, the
#   unsupported subsystems) included: an inf or NaN lr, momentum or loss scale does not fail,
#   it silently ruins or skips every step. hjson reads JSON's Infinity / -Infinity / NaN as
#   text, so those exact strings count as the numbers they spell.
_MAX_DEPTH = 100
_NON_FINITE_TEXT = ("Infinity", "-Infinity", "NaN")


def _checked(node: Any, key: str, where: str, depth: int = 1) -> Any:
    """Deep copy into plain dicts and lists (never aliasing the input), checked as it goes.

    ``key`` is the dotted key of ``node`` ("" for the top level), ``depth`` the number of
    mappings and lists around it plus one. Raises ConfigError naming the key; see
    [Note: what the checking walk refuses].
    """
    if isinstance(node, (Mapping, list, tuple)) and depth > _MAX_DEPTH:
        raise ConfigError(_too_deep(where, key))
    if isinstance(node, _Duplicated):
        raise ConfigError(
            f"{where}key '{_join(key, node.key)}' is given more than once; keep one (the "
            "parser would silently use the last value)."
        )
    if isinstance(node, Mapping):
        for name in node:
            if not isinstance(name, str):
                raise ConfigError(
                    f"{where}key {name!r} {f'in {key!r}' if key else 'at the top level'} is "
                    f"not a string but {type(name).__name__}; quote it (YAML reads unquoted 1, "
                    "true and null as a number, a boolean and null)."
                )
        return {k: _checked(v, _join(key, k), where, depth + 1) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [_checked(v, _join(key, i), where, depth + 1) for i, v in enumerate(node)]
    huge = isinstance(node, int) and not isinstance(node, bool) and abs(node) > _FLOAT_MAX
    if (
        huge
        or (isinstance(node, float) and not math.isfinite(node))
        or (isinstance(node, str) and node in _NON_FINITE_TEXT)
    ):
        raise ConfigError(
            f"{where}invalid value for '{key}': {_show(node)}. Non-finite numbers (inf, -inf, "
            "NaN) are refused everywhere in a config: an infinite or NaN learning rate, "
            "momentum or loss scale ruins or skips every step. Write a finite number (a "
            "literal beyond about 1.8e308, such as 1e400, also reads as infinity)."
        )
    return node


# An integer beyond the largest float: as an lr or eps it overflows inside the optimizer's first
# step, so it counts as non-finite.
_FLOAT_MAX = sys.float_info.max


def _join(key: str, part: Any) -> str:
    return f"{key}.{part}" if key else str(part)


def _too_deep(where: str, key: str) -> str:
    parts = key.split(".")
    at = f" at '{'.'.join(parts[:6])}{'...' if len(parts) > 6 else ''}'" if key else ""
    return (
        f"{where}values nest more than {_MAX_DEPTH} levels deep{at} (or a mapping contains "
        "itself, e.g. through a YAML alias). DeepSpeed keys nest at most 3 levels "
        "(zero_optimization.offload_optimizer.device); flatten or remove that value."
    )


# [Note: duplicate keys]
# JSON, hjson and YAML parsers keep the last of two equal keys without a word, so a config
# that sets train_micro_batch_size_per_gpu twice trains with whichever came last. The parsers
# build each mapping bottom-up, before its parent exists, so they cannot know the dotted path;
# instead a mapping with a repeated key is built as a _Duplicated dict remembering the key, and
# _checked names it with its dotted path as it walks the finished tree.


class _Duplicated(dict):
    """A parsed mapping in which ``key`` appeared more than once (last value kept)."""

    def __init__(self, pairs: Any, key: Any) -> None:
        super().__init__(pairs)
        self.key = key


def _mapping_from_pairs(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """hjson's object_pairs_hook: a dict, or a _Duplicated one when a key repeats."""
    seen: set[Any] = set()
    for key, _ in pairs:
        if key in seen:
            return _Duplicated(pairs, key)
        seen.add(key)
    return dict(pairs)


class _YamlLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader with YAML 1.2 style floats and repeated keys detected.

    YAML 1.1 (PyYAML) reads ``1e-3`` and ``5e8`` as strings because its float pattern needs a
    dot and a signed exponent; JSON and YAML 1.2 read them as numbers. DeepSpeed configs are
    written with JSON in mind, so every number in exponent notation here is a float: lr and
    sizes alike.
    """

    def construct_yaml_map(self, node: yaml.MappingNode) -> Any:
        # Explicit keys only: "<<" merge keys may legitimately be overridden.
        seen: set[tuple[str, str]] = set()
        repeated = None
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != _YAML_MERGE_TAG:
                if (key_node.tag, key_node.value) in seen and repeated is None:
                    repeated = key_node.value
                seen.add((key_node.tag, key_node.value))
        data: dict[Any, Any] = {} if repeated is None else _Duplicated((), repeated)
        yield data
        data.update(self.construct_mapping(node))


_YAML_MERGE_TAG = "tag:yaml.org,2002:merge"
_YamlLoader.add_constructor("tag:yaml.org,2002:map", _YamlLoader.construct_yaml_map)
_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+|[-+]?\.[0-9][0-9_]*[eE][-+]?[0-9]+)$"
    ),
    list("-+.0123456789"),
)


def _caller_stacklevel() -> int:
    """Stack level of the first frame outside this module, so warnings point at user code."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename == __file__:
        frame, level = frame.f_back, level + 1
    return level


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

    def fill(node: Any, key: str) -> Any:
        if isinstance(node, dict):
            return {k: fill(v, f"{key}.{k}" if key else str(k)) for k, v in node.items()}
        if isinstance(node, list):
            return [fill(v, f"{key}.{i}") for i, v in enumerate(node)]
        if not (isinstance(node, str) and node == _AUTO):
            return node
        if key in _AUTO_IS_NULL:
            return None
        if key in auto_values:  # checked like the file's own values (an inf lr, say)
            return _checked(auto_values[key], key, where, depth=key.count(".") + 2)
        if key in _FROM_HIDDEN_SIZE and hidden is not None:
            return _FROM_HIDDEN_SIZE[key](hidden)
        name = key.removeprefix("zero_optimization.")
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
        return [key] if isinstance(node, str) and node == _AUTO else []
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


def _warn_unsupported(config: Config, where: str) -> None:
    for name in UNSUPPORTED_BLOCKS:
        block = getattr(config, name)
        if block is not None and block.get("enabled") is True:
            warnings.warn(
                f"{where}'{name}' is enabled, but zero does not support this DeepSpeed "
                "subsystem; the block is accepted and ignored.",
                UserWarning,
                stacklevel=_caller_stacklevel(),
            )


# ---------------------------------------------------------------------------------------------
# Error messages
# ---------------------------------------------------------------------------------------------


def _show(value: Any, limit: int = 200) -> str:
    """``value`` as JSON (repr if it is not JSON), cut to ``limit`` characters."""
    try:
        text = json.dumps(_thaw(value))
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _walk(loc: tuple[Any, ...]) -> tuple[type[BaseModel] | None, FieldInfo | None]:
    """Follow ``loc`` through the schema: (model holding the last key, that key's FieldInfo)."""
    model: type[BaseModel] | None = Config
    info: FieldInfo | None = None
    for i, part in enumerate(loc):
        if model is None or part not in model.model_fields:
            return (model if i == len(loc) - 1 else None), None
        info = model.model_fields[part]
        if i == len(loc) - 1:
            return model, info
        model = _model_of(info.annotation)
    return model, info


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _describe_one(error: Mapping[str, Any]) -> str:
    loc = tuple(error["loc"])
    key = ".".join(str(p) for p in loc)
    kind = error["type"]
    if kind == "cross_field":
        return error["msg"]
    if kind == "extra_forbidden":
        model, _ = _walk(loc)
        names = list(model.model_fields) if model is not None else []
        hint = did_you_mean(str(loc[-1]), names)
        if not hint and names:
            hint = " Valid keys here: " + ", ".join(names) + "."
        return f"unknown key '{key}'.{hint}"
    if kind == "missing":
        _, info = _walk(loc)
        about = f" ({info.description})" if info is not None and info.description else ""
        return f"missing key '{key}'{about}; add it."
    reason = str(error["msg"])
    if reason.startswith("Value error, "):
        reason = reason[len("Value error, ") :]
    _, info = _walk(loc)
    about = f" ('{loc[-1]}': {info.description})" if info is not None and info.description else ""
    return f"invalid value for '{key}': {_show(error.get('input'))}. {reason.rstrip('.')}.{about}"


def _describe(err: ValidationError, where: str) -> str:
    """One message for all problems pydantic found, without pydantic's raw dump."""
    problems = [_describe_one(e) for e in err.errors()]
    if len(problems) == 1:
        return where + problems[0]
    listed = "\n".join(f"  - {p}" for p in problems)
    return f"{where}{len(problems)} problems:\n{listed}"
