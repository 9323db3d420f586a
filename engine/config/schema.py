"""The configuration schema: one pydantic model per DeepSpeed block, and ``Config``, the whole file.

A user's DeepSpeed config file loads unchanged with the same meaning: every block is one
pydantic model whose field names are DeepSpeed's key names, defaults follow DeepSpeed
(0.16-0.19 source), unknown keys at any level are errors with a "did you mean" hint, and
cross-field rules are checked once, when the config is built, never mid-training.
``zero_optimization``'s block lives in zero_optimization.py, the value types in values.py.

Units: like DeepSpeed, every bucket size, prefetch size and persistence threshold in
``zero_optimization`` counts ELEMENTS (numbers of parameter values), not bytes. The only
byte-sized key is ``aio.block_size``.

The result is immutable: models are frozen, free-form dicts (optimizer and scheduler params)
are read-only mappings and lists are tuples.
"""

from collections.abc import Mapping
from typing import Annotated, Any, Literal

import torch
from pydantic import BeforeValidator, Field, PrivateAttr, field_validator, model_validator

from . import subsystems
from .autotuning import AutotuningConfig
from .errors import _cross, _not_implemented, _refused, _show
from .values import (
    AnyDtype,
    Bytes,
    Count,
    CountOrZero,
    FrozenDict,
    HalfOrFull,
    Number,
    StepsOrNever,
    _Block,
    _capitalize,
    _freeze,
    _lower,
    _upper,
    _whole,
)
from .zero_optimization import ZeroConfig

__all__ = [
    "Config",
    "FP16Config",
    "BF16Config",
    "DataTypesConfig",
    "OptimizerConfig",
    "SchedulerConfig",
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
    "CompileConfig",
]


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
    """DeepSpeed ``flops_profiler``: the FLOPs profiler's report at one step
    (profiling/flops_profiler.py; docs/observability.md)."""

    enabled: bool = Field(False, description="Profile FLOPs, latency and parameters.")
    recompute_fwd_factor: Number = Field(
        0.0,
        ge=0,
        description="Forward passes recomputed in backward (activation checkpointing: 1.0).",
    )
    profile_step: CountOrZero = Field(
        1,
        description="Profile the step that starts after this many optimizer steps (1: after "
        "one warm-up step).",
    )
    module_depth: _whole(-1, "a depth, or -1 for all") = Field(
        -1, description="Depths listed in the aggregated profile; -1 means all."
    )
    top_modules: Count = Field(1, description="Modules listed per depth.")
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
    save_dir: str | None = Field(
        None,
        description="zero's own: directory of the periodic checkpoints (save_interval_steps, "
        "save_interval_minutes) and of auto_resume.",
    )
    save_interval_steps: Count | None = Field(
        None, description="zero's own: save a checkpoint to save_dir every this many steps."
    )
    save_interval_minutes: Number | None = Field(
        None,
        gt=0,
        description="zero's own: save a checkpoint to save_dir at the first step after this "
        "many minutes (rank 0's clock) since the last one.",
    )
    async_save: bool = Field(
        True,
        description="zero's own: periodic checkpoints copy the state to host memory and write "
        "it in a background thread; false writes before step() returns.",
    )
    auto_resume: bool = Field(
        False,
        description="zero's own: zero.initialize loads save_dir's `latest` checkpoint when "
        "there is one (a restarted elastic job resumes at its new world size).",
    )

    @model_validator(mode="after")
    def _check_periodic(self) -> "CheckpointConfig":
        wanted = [
            key
            for key in ("save_interval_steps", "save_interval_minutes", "auto_resume")
            if getattr(self, key)
        ]
        if wanted and self.save_dir is None:
            raise _cross(
                f"checkpoint.{wanted[0]} is set but checkpoint.save_dir is not; give "
                'checkpoint.save_dir (e.g. "save_dir": "checkpoints").'
            )
        return self


class AioConfig(_Block):
    """DeepSpeed ``aio``: asynchronous I/O for nvme offload. ``block_size`` is in bytes."""

    block_size: Bytes = Field(1_048_576, description="I/O block size in bytes.")
    queue_depth: Count = Field(8, description="I/O queue depth.")
    intra_op_parallelism: Count = Field(1, description="I/O threads per operation.")
    single_submit: bool = Field(False, description="Submit requests one at a time.")
    overlap_events: bool = Field(True, description="Overlap submission and completion.")
    use_gds: bool = Field(False, description="Use GPUDirect Storage.")


_COMPILE_PASSES = ("z1", "z3", "autosp", "autotp")


class CompileConfig(_Block):
    """DeepSpeed ``compile`` (deepspeed/compile/config.py): what engine.compile() does. zero
    compiles the forward itself (stage 3: each block, between eager gathers and releases; see
    engine/compiler.py), whether or not ``deepcompile`` is set; DeepCompile's offload passes and
    its AutoSP / AutoTP passes are refused, its tuning and debugging keys have no effect."""

    deepcompile: bool = Field(
        False, description="DeepCompile; in zero, engine.compile() runs zero's own compile."
    )
    free_activation: bool = Field(False, description="DeepCompile: free activations eagerly.")
    free_activation_threshold: Count = Field(
        10 * 1024 * 1024, description="DeepCompile: bytes from which activations are freed."
    )
    offload_activation: bool = Field(
        False, description="DeepCompile: offload saved activations to host (refused)."
    )
    offload_activation_pin_memory: bool = Field(
        True, description="DeepCompile: pin the host buffers of offloaded activations."
    )
    offload_opt_states: bool = Field(
        False, description="DeepCompile: offload optimizer states between steps (refused)."
    )
    double_buffer: bool = Field(True, description="DeepCompile: double-buffered all-gathers.")
    symmetric_memory: bool = Field(False, description="DeepCompile: symmetric memory buffers.")
    debug_log: bool = Field(False, description="DeepCompile: dump its graphs.")
    offload_parameters: bool = Field(
        False, description="DeepCompile: offload parameters to host (refused)."
    )
    sync_before_reduce: bool = Field(False, description="DeepCompile: sync before reduce.")
    sync_after_reduce: bool = Field(False, description="DeepCompile: sync after reduce.")
    sync_before_allgather: bool = Field(False, description="DeepCompile: sync before all-gather.")
    sync_after_allgather: bool = Field(False, description="DeepCompile: sync after all-gather.")
    keep_int_input_tensors: bool = Field(
        True, description="DeepCompile: keep int inputs' values when profiling."
    )
    keep_all_input_tensors: bool = Field(
        False, description="DeepCompile: keep all inputs' values when profiling."
    )
    passes: tuple[Literal[_COMPILE_PASSES], ...] | None = Field(
        None, description="DeepCompile passes: z1 and z3 are zero's ZeRO; autosp, autotp refused."
    )

    @model_validator(mode="after")
    def _refuse_deepcompile_passes(self) -> "CompileConfig":
        alternatives = {
            "offload_activation": "activation_checkpointing.cpu_checkpointing",
            "offload_opt_states": "zero_optimization.offload_optimizer",
            "offload_parameters": "zero_optimization.offload_param (stage 3)",
        }
        for key, instead in alternatives.items():
            if getattr(self, key):
                raise _refused(
                    f"compile.{key}",
                    True,
                    f"DeepCompile's offload pass is not implemented in zero; use {instead}.",
                    False,
                )
        parallel = [p for p in self.passes or () if p in ("autosp", "autotp")]
        if parallel:
            raise _not_implemented(
                f"compile.passes = {_show(list(self.passes))}: zero has no sequence- or "
                f"tensor-parallel compile pass ({', '.join(parallel)}); remove them (z1 and z3 "
                "are zero's ZeRO stages, set by zero_optimization.stage)."
            )
        return self

    def keys_without_effect(self) -> list[str]:
        """The DeepCompile tuning and debugging keys set to a non-default value (zero's compile
        reads none of them)."""
        fields = type(self).model_fields.items()
        read = ("deepcompile", "passes")
        return sorted(k for k, f in fields if k not in read and getattr(self, k) != f.default)


# Blocks of DeepSpeed subsystems zero does not implement (subsystems.py): accepted as free dicts
# so existing files load; switched on, refused or warned ([Note: enabled blocks zero does not
# implement]).
_REFUSED_DESCRIPTION = "DeepSpeed subsystem zero does not implement; refused when enabled."
_WARNED_DESCRIPTION = "DeepSpeed subsystem zero does not implement; ignored (a warning)."


def _value_at(value, path: list[str]):
    for part in path:
        value = value[int(part)] if isinstance(value, (list, tuple)) else value[part]
    return value


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
    steps_per_print: StepsOrNever = Field(
        10,
        description="Log progress every this many steps; Infinity (Accelerate's value) never "
        "logs, read as null.",
    )
    agreement_timeout: Number = Field(
        300.0,
        gt=0,
        description="zero's own: seconds a rank waits at a checked collective (stage-3 "
        "all-gathers, end of backward, collective methods such as save_checkpoint) for the "
        "other ranks before every rank stops with an error naming the missing ranks; a rank "
        "whose process stops answering (SIGSTOP) for this long is named and ends the job.",
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
        "mean",
        description="How the data-parallel ranks' gradients combine: mean averages them, sum "
        "adds them (each update world-size times the averaged one).",
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
    amp: FrozenDict | None = Field(None, description=_REFUSED_DESCRIPTION)
    elasticity: FrozenDict | None = Field(None, description=_REFUSED_DESCRIPTION)
    autotuning: AutotuningConfig | None = Field(
        None, description="zrun --autotuning: the search space and how trials run."
    )
    compression_training: FrozenDict | None = Field(None, description=_REFUSED_DESCRIPTION)
    data_efficiency: FrozenDict | None = Field(None, description=_REFUSED_DESCRIPTION)
    pipeline: FrozenDict | None = Field(None, description=_WARNED_DESCRIPTION)
    sparse_attention: FrozenDict | None = Field(None, description=_WARNED_DESCRIPTION)
    curriculum_learning: FrozenDict | None = Field(None, description=_REFUSED_DESCRIPTION)
    progressive_layer_drop: FrozenDict | None = Field(None, description=_REFUSED_DESCRIPTION)
    eigenvalue: FrozenDict | None = Field(None, description=_WARNED_DESCRIPTION)
    hybrid_engine: FrozenDict | None = Field(None, description=_WARNED_DESCRIPTION)
    compile: CompileConfig | None = Field(
        None, description="engine.compile(): torch.compile settings (DeepSpeed's DeepCompile keys)."
    )

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
        quant = self.weight_quantization
        if quant is not None and quant.get("enabled", True) is not False:
            raise _not_implemented(
                f"weight_quantization = {_show(quant)}: zero does not quantize weights; "
                "training in full precision would not be the run the config describes. Remove "
                'the block or set "enabled": false.'
            )
        expert = self.expert_parallel
        if expert is not None and expert.get("enabled", False) is not False:
            raise _not_implemented(
                f"expert_parallel = {_show(expert)}: zero does not shard experts over ranks "
                "(AutoEP); ignoring it would replicate every expert, a different layout. "
                'Remove the block or set "enabled": false.'
            )
        for name, why in subsystems.REFUSED.items():
            key = subsystems.switch_key(name, getattr(self, name))
            if key is not None:
                value = _value_at(getattr(self, name), key.split(".")[1:])
                raise _not_implemented(f"{key} = {_show(value)}: {why}")
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

    # DeepSpeed's engine.config is the config dict: the Hugging Face Trainer reads
    # engine.config.get("zero_optimization", {}).get("stage"). These read the resolved values
    # under DeepSpeed's key names, without nulls (an absent block stays absent), read-only.
    def _deepspeed_dict(self) -> Mapping[str, Any]:
        return _freeze(self.model_dump(mode="json", exclude_none=True))

    def get(self, key: str, default: Any = None) -> Any:
        """DeepSpeed's dict read: the resolved value of top-level `key`, else `default`."""
        return self._deepspeed_dict().get(key, default)

    def __getitem__(self, key: str) -> Any:
        return self._deepspeed_dict()[key]

    def __contains__(self, key: object) -> bool:
        return key in self._deepspeed_dict()

    def keys(self):
        """DeepSpeed's top-level keys of the resolved config."""
        return self._deepspeed_dict().keys()


_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
