"""DeepSpeed's ``autotuning`` block: what `zrun --autotuning tune|run` searches and how.

The tuner itself is a launcher feature (launcher/autotuning/, docs/tuning.md); the engine reads
only start_profile_step and end_profile_step, and only in a trial the tuner started
(zero.autotuning). Keys and defaults follow DeepSpeed 0.19.8's deepspeed/autotuning/constants.py;
`max_memory_per_rank`, `timeout`, `num_finalists` and `finalist_rounds` are zero's own.
"""

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from .errors import _cross
from .values import Count, CountOrZero, FrozenDict, _Block, parse_size

__all__ = ["AutotuningConfig", "ModelInfoConfig"]


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


def _memory_size(value: Any) -> Any:
    # "80G", "512MiB" or a byte count; read with zero-estimate's rule (2**30-based units).
    if value is None or isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        return parse_size(value)
    raise ValueError(f"{value!r}: give bytes or a size such as '16G'")


class ModelInfoConfig(_Block):
    """DeepSpeed ``autotuning.model_info``: facts about the model that replace what the tuner's
    first child run reports (docs/tuning.md)."""

    profile: bool = Field(
        False, description="DeepSpeed: profile the model first; zero always runs a probe."
    )
    num_params: Count | None = Field(None, description="Trainable parameters (Psi).")
    hidden_size: Count | None = Field(None, description="Hidden size h of the transformer.")
    num_layers: Count | None = Field(None, description="Number of transformer layers L.")


class AutotuningConfig(_Block):
    """DeepSpeed ``autotuning``: the search `zrun --autotuning` runs (docs/tuning.md)."""

    enabled: bool = Field(
        False, description="DeepSpeed's switch; zero tunes whenever zrun has --autotuning."
    )
    fast: bool = Field(
        True,
        description="Tune stage, offload and micro-batch size only; false adds the bucket "
        "sizes 5e7, 5e8 and 1e9 elements (DeepSpeed's tuning space).",
    )
    results_dir: str = Field(
        "autotuning_results",
        min_length=1,
        description="Where the results table, plot and best config (ds_config_optimal.json) go.",
    )
    exps_dir: str = Field(
        "autotuning_exps",
        min_length=1,
        description="One directory per candidate: its config, command and log.",
    )
    overwrite: bool = Field(
        True, description="Run every candidate again; false reuses results found in exps_dir."
    )
    start_profile_step: CountOrZero = Field(
        3, description="Optimizer steps run before the measured window (warm-up)."
    )
    end_profile_step: Count = Field(
        5, description="The measured window ends at this step; the trial then exits."
    )
    metric_path: str | None = Field(
        None, description="DeepSpeed: metrics file; zero's tuner names one per trial."
    )
    metric: Annotated[Literal["throughput", "latency", "flops"], BeforeValidator(_lower)] = Field(
        "throughput", description="What the best config maximizes (latency: minimizes)."
    )
    tuner_type: Annotated[
        Literal["gridsearch", "random", "model_based"], BeforeValidator(_lower)
    ] = Field("gridsearch", description="Order in which candidates are tried.")
    tuner_early_stopping: Count = Field(
        5, description="Stop after this many trials in a row without a better metric."
    )
    tuner_num_trials: Count = Field(50, description="Trials run at most.")
    arg_mappings: FrozenDict | None = Field(
        None,
        description="Config key -> script flag, set per trial (e.g. "
        '"train_micro_batch_size_per_gpu": "--per_device_train_batch_size").',
    )
    model_info: ModelInfoConfig | None = Field(None, description="Facts about the model.")
    model_info_path: str | None = Field(None, description="DeepSpeed: model-info file; unused.")
    mp_size: Count = Field(1, description="Model-parallel size; divides the ranks.")
    max_train_batch_size: Count | None = Field(
        None, description="Largest global batch (samples per optimizer step) tried."
    )
    min_train_batch_size: Count = Field(1, description="Smallest global batch tried.")
    max_train_micro_batch_size_per_gpu: Count = Field(
        1024, description="Largest micro-batch per rank tried."
    )
    min_train_micro_batch_size_per_gpu: Count = Field(
        1, description="Smallest micro-batch per rank tried."
    )
    num_tuning_micro_batch_sizes: Count = Field(
        3, description="Micro-batch sizes tried per stage and offload, min to max."
    )
    max_memory_per_rank: Annotated[int | None, BeforeValidator(_memory_size)] = Field(
        None,
        description="zero: bytes a rank may use ('16G'); candidates predicted above it are "
        "dropped. Default: the device's memory (CPU ranks: host memory / ranks per node).",
    )
    timeout: Count = Field(600, description="zero: seconds a trial may run before it is ended.")
    num_finalists: CountOrZero = Field(
        3,
        description="zero: the best candidates of the search measured again, in "
        "finalist_rounds interleaved rounds with a longer window (twice the search's or 5 s "
        "of steps), the pick by the median; "
        "0 or 1: the search's best stands.",
    )
    finalist_rounds: Count = Field(
        3, description="zero: rounds over the finalists (one trial of each per round)."
    )

    @model_validator(mode="after")
    def _check_ranges(self) -> "AutotuningConfig":
        for key, flag in (self.arg_mappings or {}).items():
            if not isinstance(flag, str) or not flag.startswith("-"):
                raise _cross(
                    f"autotuning.arg_mappings[{key!r}] is {flag!r}; give the script's flag that "
                    'takes the value, e.g. "--per_device_train_batch_size".'
                )
        if self.max_memory_per_rank is not None and self.max_memory_per_rank <= 0:
            raise _cross(
                f"autotuning.max_memory_per_rank {self.max_memory_per_rank} bytes: give the "
                "memory a rank may use, e.g. '16G'."
            )
        if self.end_profile_step <= self.start_profile_step:
            raise _cross(
                f"autotuning.end_profile_step {self.end_profile_step} must exceed "
                f"start_profile_step {self.start_profile_step}: the steps between them are "
                "measured."
            )
        low, high = self.min_train_micro_batch_size_per_gpu, self.max_train_micro_batch_size_per_gpu
        if low > high:
            raise _cross(
                f"autotuning.min_train_micro_batch_size_per_gpu {low} exceeds "
                f"max_train_micro_batch_size_per_gpu {high}; lower the min or raise the max."
            )
        if self.max_train_batch_size is not None and self.max_train_batch_size < (
            self.min_train_batch_size
        ):
            raise _cross(
                f"autotuning.max_train_batch_size {self.max_train_batch_size} is below "
                f"min_train_batch_size {self.min_train_batch_size}."
            )
        return self
