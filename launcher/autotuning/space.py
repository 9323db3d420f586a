"""The candidates `zrun --autotuning` tries: stage x offload x micro-batch x bucket size.

[Note: the search space]
Read from the user's config file before validation, so a tuned key may hold a list:
- zero_optimization.stage: a stage, a list, or absent / "all" for 0-3 (DeepSpeed's rule);
- zero_optimization.offload_optimizer.device: a device or a list; absent: "none" and "cpu"
  (offload only at stages 1-3, where zero offloads the optimizer's shards);
- zero_optimization.reduce_bucket_size: a size or a list; absent: zero's default, or with
  autotuning.fast false DeepSpeed's 5e7, 5e8 and 1e9 elements;
- train_micro_batch_size_per_gpu: a list, else num_tuning_micro_batch_sizes sizes from
  min_train_micro_batch_size_per_gpu to max_train_micro_batch_size_per_gpu (powers of two
  between, evenly picked), capped so the global batch stays within min/max_train_batch_size.
gradient_accumulation_steps stays the config's (1 when absent or "auto").
"""

import copy
import dataclasses
import math

from zero.config import AutotuningConfig

STAGES = (0, 1, 2, 3)
DEVICES = ("none", "cpu", "nvme")  # offload_optimizer.device
DEEPSPEED_BUCKETS = (50_000_000, 500_000_000, 1_000_000_000)  # DEFAULT_TUNING_SPACE_ZERO_1..3


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One config to try. bucket: reduce_bucket_size in elements, None for the config's."""

    stage: int
    offload: str
    micro_batch: int
    gradient_accumulation_steps: int
    bucket: int | None = None

    @property
    def name(self) -> str:
        name = f"z{self.stage}_{self.offload}_mbs{self.micro_batch}"
        if self.gradient_accumulation_steps > 1:
            name += f"_gas{self.gradient_accumulation_steps}"
        return name + (f"_b{self.bucket:.0e}".replace("+", "") if self.bucket else "")


def _as_list(value, default: list, what: str, allowed=None) -> list:
    """The values of a tuned key: `default` when absent, "all" or "auto" (a Trainer fills
    "auto" itself); else the value or list given, each a positive integer or, with `allowed`,
    one of those. Raises ValueError naming the key and the value."""
    if value is None or value in ("all", "auto"):
        return list(default)
    values = value if isinstance(value, list) else [value]
    if not values:
        raise ValueError(f"{what} is an empty list; give at least one value or remove it")
    for item in values:
        if allowed is not None:
            ok = item in allowed
        else:
            number = item if isinstance(item, int | float) and not isinstance(item, bool) else 0
            ok = number >= 1 and number == int(number)
        if not ok:
            want = f"one of {list(allowed)}" if allowed is not None else "a positive integer"
            raise ValueError(f"{what}: {item!r} cannot be tried; give {want}")
    return [item if allowed is not None else int(item) for item in values]


def micro_batch_sizes(tuning: AutotuningConfig, data_parallel: int, gas: int) -> list[int]:
    """[Note: the search space]'s micro-batch sizes; raises ValueError when the batch limits
    leave none."""
    low = max(
        tuning.min_train_micro_batch_size_per_gpu,
        math.ceil(tuning.min_train_batch_size / (data_parallel * gas)),
    )
    high = tuning.max_train_micro_batch_size_per_gpu
    if tuning.max_train_batch_size is not None:
        high = min(high, tuning.max_train_batch_size // (data_parallel * gas))
    if high < low:
        raise ValueError(
            f"autotuning: no micro-batch size fits: at least {low} per rank, at most {high} "
            f"({data_parallel} data-parallel ranks x gradient_accumulation_steps {gas}); raise "
            "max_train_batch_size or max_train_micro_batch_size_per_gpu"
        )
    sizes = sorted({low, high, *(2**k for k in range(high.bit_length()) if low < 2**k < high)})
    count = min(tuning.num_tuning_micro_batch_sizes, len(sizes))
    if count == 1:
        return [high]
    picks = {round(i * (len(sizes) - 1) / (count - 1)) for i in range(count)}
    return [sizes[i] for i in sorted(picks)]


def candidates(raw: dict, tuning: AutotuningConfig, data_parallel: int) -> list[Candidate]:
    """Every candidate of `raw` (the user's config mapping), in grid order: stage, offload,
    micro-batch, bucket. Raises ValueError for a tuned key whose value cannot be tried."""
    zero = raw.get("zero_optimization") or {}
    stages = _as_list(zero.get("stage"), STAGES, "zero_optimization.stage", allowed=STAGES)
    offload = zero.get("offload_optimizer") or {}
    devices = _as_list(offload.get("device"), ["none", "cpu"], "offload_optimizer.device", DEVICES)
    buckets = _as_list(
        zero.get("reduce_bucket_size"),
        [None] if tuning.fast else DEEPSPEED_BUCKETS,
        "zero_optimization.reduce_bucket_size",
    )
    gas = raw.get("gradient_accumulation_steps")
    gas = gas if isinstance(gas, int) and not isinstance(gas, bool) else 1
    given = raw.get("train_micro_batch_size_per_gpu")
    if isinstance(given, list):
        sizes = _as_list(given, [], "train_micro_batch_size_per_gpu")
    else:
        sizes = micro_batch_sizes(tuning, data_parallel, gas)
    return [
        Candidate(int(stage), str(device), int(size), gas, None if b is None else int(b))
        for stage in stages
        for device in devices
        if device == "none" or stage > 0
        for size in sizes
        for b in buckets
    ]


def candidate_config(raw: dict, candidate: Candidate) -> dict:
    """The user's config with the candidate's values in place (DeepSpeed's keys); an "auto"
    train_batch_size stays "auto" (the Trainer fills it), a number is dropped (derived)."""
    config = copy.deepcopy(raw)
    zero = dict(config.get("zero_optimization") or {})
    zero["stage"] = candidate.stage
    offload = dict(zero.get("offload_optimizer") or {})
    offload["device"] = candidate.offload
    zero["offload_optimizer"] = offload
    if candidate.bucket is not None:
        zero["reduce_bucket_size"] = candidate.bucket
    elif isinstance(zero.get("reduce_bucket_size"), list):
        del zero["reduce_bucket_size"]
    config["zero_optimization"] = zero
    config["train_micro_batch_size_per_gpu"] = candidate.micro_batch
    config["gradient_accumulation_steps"] = candidate.gradient_accumulation_steps
    if config.get("train_batch_size") != "auto":
        config.pop("train_batch_size", None)
    return config


def without_auto(node):
    """`node` with every "auto" value left out, so the field takes zero's default: the config
    the planner reads (a trial's "auto" values are filled by the script's framework)."""
    if isinstance(node, dict):
        return {k: without_auto(v) for k, v in node.items() if v != "auto"}
    return node
