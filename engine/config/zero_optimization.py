"""DeepSpeed's ``zero_optimization`` block: ``ZeroConfig`` and its offload and leaf-module blocks.

Every bucket size, prefetch size and persistence threshold here counts ELEMENTS, not bytes.
Also owns the ZeRO++ / MiCS keys: MiCS (mics_shard_size) and hpZ (zero_hpz_partition_size) are
implemented (partition/hierarchy.py), and so are the quantized ones, qwZ and qgZ
(partition/zeropp.py). ZenFlow is refused.
"""

import sys
from typing import Annotated, Any

from pydantic import (
    BeforeValidator,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .errors import _cross, _not_implemented, _show
from .values import (
    Count,
    Elements,
    ElementsOrZero,
    FrozenDict,
    Number,
    OffloadDevice,
    _Block,
    _to_stage,
    _to_whole,
    _whole,
)

__all__ = ["ZeroConfig", "OffloadOptimizerConfig", "OffloadParamConfig"]


def _auto_or_bytes(value: Any) -> int | str:
    if value == "auto":
        return value
    return _to_whole(value, minimum=1, what='"auto" or a whole number of bytes')


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
    """DeepSpeed ``zero_optimization.offload_param`` (stage 3 only; below stage 3 load_config
    drops it with a warning, as DeepSpeed ignores it). Sizes are in elements."""

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


def _one_or_many(value: Any) -> Any:
    # DeepSpeed reads a single string in leaf_module as a list of one.
    return [value] if isinstance(value, str) else value


_Names = Annotated[tuple[str, ...], BeforeValidator(_one_or_many)]


class LeafModuleConfig(_Block):
    """DeepSpeed ``zero_optimization.leaf_module``: modules stage 3 fetches as one unit."""

    classes: _Names = Field((), description="Module class names (a list, or one string).")
    names: _Names = Field((), description="Module names (a list, or one string).")
    name_suffixes: _Names = Field((), description="Module name suffixes (a list, or one string).")


class ZeroConfig(_Block):
    """DeepSpeed ``zero_optimization``. Every size here counts elements, not bytes.

    ``overlap_comm`` is resolved at load time: true for stage 3, false otherwise, unless given.
    MiCS (``mics_shard_size``, stages 1-3) and hpZ (``zero_hpz_partition_size``, stage 3) are
    implemented, and so are the quantized ZeRO++ keys (qwZ: stage 3; qgZ: stages 2 and 3).
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
        None,
        description="Parameter offload (ZeRO-Infinity); stage 3 only, ignored (with a warning) "
        "below it.",
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
    stage3_fetch_budget: Annotated[int | str, BeforeValidator(_auto_or_bytes)] = Field(
        "auto",
        description="zero's own key: bytes that stage 3's gathered parameters may take per rank; "
        "'auto' measures the rank's free memory at initialize. Below the whole model, it sets "
        "the unit size, prefetch, max live and reuse keys the config leaves unset.",
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
        1,
        description="ZeRO++ hpZ (stage 3): ranks per secondary parameter partition (usually the "
        "ranks per node); backward all-gathers stay within that group. 1 disables.",
    )
    zero_quantized_weights: bool = Field(
        False,
        description="ZeRO++ qwZ (stage 3): parameter all-gathers as block-wise int8, "
        "dequantized into the compute dtype on arrival; master weights stay exact.",
    )
    zero_quantized_nontrainable_weights: bool = Field(
        False,
        description="ZeRO++ qwZ for frozen parameters only (stage 3): their all-gathers as "
        "block-wise int8. Unlike DeepSpeed, their shards stay in the compute dtype in memory.",
    )
    zero_quantized_gradients: bool = Field(
        False,
        description="ZeRO++ qgZ (stages 2-3): gradient reduce-scatter as block-wise int4 "
        "all-to-alls within each node, then across nodes.",
    )
    mics_shard_size: _whole(-1, "a number of ranks, or -1") = Field(
        -1,
        description="MiCS (stages 1-3): partition model states within groups of this many "
        "consecutive ranks and replicate them across groups; must divide the data-parallel world "
        "size. -1 disables MiCS.",
    )
    mics_hierarchical_params_gather: bool = Field(
        False,
        description="MiCS: all-gather parameters of a shard group that spans nodes in two "
        "levels, across nodes among the ranks with the same local index, then within each node "
        "(the same result; 1/l of the inter-node traffic, l = the group's ranks per node). "
        "Shard groups within one node gather flat.",
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
    # Acted on (engine/guards.py, leaf_classes and mark_leaf_names), unlike the switches above.
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
    def _check_quantized(self) -> "ZeroConfig":
        # ZeRO++ qwZ / qgZ (partition/zeropp.py): where a key would change nothing, refuse it,
        # since a run that ignored it would not be the run the config describes.
        for key in ("zero_quantized_weights", "zero_quantized_nontrainable_weights"):
            if getattr(self, key) and self.stage != 3:
                raise _cross(
                    f"zero_optimization.{key} = true needs zero_optimization.stage 3 (got "
                    f"{self.stage}): qwZ quantizes stage 3's parameter all-gathers, and stages "
                    "0-2 gather no parameters. Set stage 3, or remove the key."
                )
        if self.zero_quantized_gradients and self.stage < 2:
            raise _cross(
                "zero_optimization.zero_quantized_gradients = true needs zero_optimization.stage "
                f"2 or 3 (got {self.stage}): qgZ replaces the reduce-scatter of gradients that "
                "stages 2 and 3 run every micro-batch. Set stage 2 or 3, or remove the key."
            )
        return self

    @model_validator(mode="after")
    def _check_hierarchical(self) -> "ZeroConfig":
        # DeepSpeed's rules: hpZ partitions stage 3's parameters; MiCS needs a partitioned stage.
        if self.mics_shard_size == 0:
            raise _cross(
                "zero_optimization.mics_shard_size = 0: give a number of ranks (>= 1) that "
                "divides the data-parallel world size, or -1 to disable MiCS."
            )
        if self.mics_shard_size > 0 and self.stage == 0:
            raise _cross(
                f"zero_optimization.mics_shard_size = {self.mics_shard_size} needs "
                "zero_optimization.stage 1, 2 or 3 (got 0): stage 0 partitions nothing."
            )
        if self.zero_hpz_partition_size > 1 and self.stage != 3:
            raise _cross(
                f"zero_optimization.zero_hpz_partition_size = {self.zero_hpz_partition_size} "
                f"needs zero_optimization.stage 3 (got {self.stage}): hpZ keeps a secondary "
                "partition of stage 3's parameters. Set stage 3, or remove the key."
            )
        if self.mics_shard_size > 0 and self.zero_hpz_partition_size > 1:
            raise _not_implemented(
                f"zero_optimization.mics_shard_size = {self.mics_shard_size} with "
                f"zero_optimization.zero_hpz_partition_size = {self.zero_hpz_partition_size}: "
                "zero does not combine MiCS and hpZ (with MiCS shard groups of one node, the "
                "backward all-gather stays in the node already). Remove one of the keys."
            )
        if self.mics_hierarchical_params_gather and self.mics_shard_size < 1:
            raise _cross(
                "zero_optimization.mics_hierarchical_params_gather = true needs "
                "zero_optimization.mics_shard_size (MiCS); set it, or remove the key."
            )
        return self

    @model_validator(mode="after")
    def _refuse_zenflow(self) -> "ZeroConfig":
        if self.zenflow is not None:
            raise _not_implemented(
                f"zero_optimization.zenflow = {_show(self.zenflow)}: zero does not implement "
                "ZenFlow, which updates the less important gradient columns late; training "
                "without it would not be the run the config describes. Remove the key (or set "
                "it to null)."
            )
        return self

    @model_validator(mode="after")
    def _check_offload(self) -> "ZeroConfig":
        # offload_param below stage 3 is not checked here: DeepSpeed ignores the block there, and
        # so does load_config, with a warning (deepspeed_keys.py, _ignore_param_offload).
        opt, par = self.offload_optimizer, self.offload_param
        if opt is not None and opt.device != "none" and self.stage == 0:
            raise _cross(
                f"zero_optimization.offload_optimizer.device '{opt.device}' needs "
                "zero_optimization.stage 1, 2 or 3 (got 0)."
            )
        blocks = [("offload_optimizer", opt)] + (
            [("offload_param", par)] if self.stage == 3 else []
        )
        for name, block in blocks:
            if block is not None and block.device == "nvme" and not block.nvme_path:
                raise _cross(
                    f"zero_optimization.{name}.device is 'nvme' but "
                    f"zero_optimization.{name}.nvme_path is not set; give a directory."
                )
        return self
