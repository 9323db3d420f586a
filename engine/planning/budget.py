"""Settings chosen from the memory a rank may use: stage 3's fetch limits, stages 1-2's bucket
sizes ([Note: memory-aware fetch policy], [Note: bucket sizes from memory]).

[Note: memory-aware fetch policy]
Stage 3 gathers parameters per fetch unit. Four DeepSpeed keys bound how many are gathered at
once: the unit size (stage3_module_granularity_threshold; zero's default is reduce_bucket_size,
500M elements), stage3_prefetch_bucket_size (50M), stage3_max_live_parameters (1e9) and
stage3_max_reuse_distance (1e9). DeepSpeed's defaults assume room to spare: for a model below
half a billion elements they gather it whole and keep it gathered from forward into backward,
so a rank holds the whole model in the compute dtype, the very thing stage 3 exists to avoid.

At zero.initialize the engine measures the headroom of each rank (headroom_bytes: free device
memory on CUDA; on the host the least of available memory, RLIMIT_DATA less the private memory
in use, and the cgroup's memory.max less its usage, the shared ones divided among the node's
$LOCAL_WORLD_SIZE ranks), takes the smallest over the ranks (so every
rank makes the same choice: the units decide the collectives), and adds back what the engine will
free (whole parameters it partitions) less the model states it will allocate (the paper's
formula for the stage, planning/memory.py). A quarter of what is left (GATHERED_FRACTION) is
the budget for gathered parameters; the rest is left for activations, the gradients of the units
in backward, reduce-scatter buffers, the optimizer's temporaries and the allocator. (With half,
benchmarks/largest_model.py trained 41-43 layers from run to run, 43 fails in step 2's
all-gather; with a quarter 43 in one run and 44 in single trials, FSDP2 44.)

- When the whole model in the compute dtype fits the budget, DeepSpeed's defaults stay: memory
  is plentiful and gathering more at once is faster (fewer, larger collectives).
- Otherwise the budget L (elements) becomes stage3_max_live_parameters, units hold at most L / 4
  elements (a module larger than that is split into its children; one that cannot be split is a
  unit of its own and L grows to hold two of them), prefetch looks L / 2 ahead and nothing is
  kept gathered for reuse (stage3_max_reuse_distance 0): the hand-tuned settings that let
  benchmarks/largest_model.py reach 0.85 of the paper's bound, derived from the budget.

A key the config sets explicitly always wins over the policy, and the choice is logged with its
figures. stage3_fetch_budget set to a number of bytes replaces the measured budget.
"""

import os
import resource
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from ..comm import ranks_on_this_node
from ..partition.init import full_numel, is_partitioned
from .memory import ModelStateSpec, model_state_formula

# The fraction of the budget left over (after model states) that gathered parameters may use.
GATHERED_FRACTION = 0.25


def _size(nbytes: float) -> str:
    """Bytes for the log: MiB, or KiB below one MiB."""
    if abs(nbytes) < 2**20:
        return f"{nbytes / 2**10:,.1f} KiB"
    return f"{nbytes / 2**20:,.0f} MiB"


def _figures(headroom: int, bound_by: str, pending: int, budget: int, use: str) -> str:
    if bound_by == "stage3_fetch_budget":
        return f"stage3_fetch_budget gives {_size(budget)} for {use}"
    states = (
        f"less {_size(pending)} of model states still to allocate"
        if pending >= 0
        else f"plus {_size(-pending)} the engine frees (whole parameters it partitions)"
    )
    return (
        f"headroom {_size(headroom)} ({bound_by}) {states}, {GATHERED_FRACTION:.0%} for {use}: "
        f"{_size(budget)}"
    )


@dataclass(frozen=True)
class FetchSettings:
    """Stage 3's fetch limits, in elements (see [Note: memory-aware fetch policy])."""

    unit_numel: int  # a module with at most this many elements is fetched whole
    prefetch_numel: int  # stage3_prefetch_bucket_size
    max_live_numel: int  # stage3_max_live_parameters
    max_reuse_numel: int  # stage3_max_reuse_distance
    reason: str  # one sentence for the log


def _private_bytes() -> int:
    """VmData of this process: its private writable memory, what RLIMIT_DATA counts."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmData:"):
            return int(line.split()[1]) * 1024
    return 0


def _cgroup_room() -> int | None:
    """memory.max less memory.current of this process's cgroup (v2), None without a limit."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return None


def headroom_bytes(device: torch.device) -> tuple[int, str]:
    """Bytes this rank may still allocate where gathered parameters live (`device`), and what
    bounds it ("cuda free memory", "RLIMIT_DATA", "cgroup memory.max", "available host memory").
    Host memory and a cgroup limit are shared by the ranks of this node: each rank counts its
    share, 1 / $LOCAL_WORLD_SIZE (set by zrun and torchrun; 1 without it); RLIMIT_DATA is
    the process's own. Not a collective."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free + cached, "cuda free memory"
    ranks = ranks_on_this_node()
    share = "" if ranks == 1 else f", 1/{ranks} per rank"
    candidates = [(psutil.virtual_memory().available // ranks, f"available host memory{share}")]
    soft, _ = resource.getrlimit(resource.RLIMIT_DATA)
    if soft != resource.RLIM_INFINITY and os.path.exists("/proc/self/status"):
        candidates.append((soft - _private_bytes(), "RLIMIT_DATA"))
    room = _cgroup_room()
    if room is not None:
        candidates.append((room // ranks, f"cgroup memory.max{share}"))
    return min(candidates)


def choose(
    *,
    headroom: int,
    bound_by: str,
    model_numel: int,
    largest_leaf_numel: int,
    compute_bytes: int,
    pending_bytes: int,
    defaults: FetchSettings,
) -> FetchSettings:
    """The fetch settings for a rank with `headroom` bytes (the least over the ranks) that will
    still allocate `pending_bytes` of model states (negative: it frees more than it allocates),
    for a model of `model_numel` elements whose largest indivisible module holds
    `largest_leaf_numel`, gathered in `compute_bytes` per element. `defaults`: DeepSpeed's
    values (kept when the whole model fits the budget). Pure: no memory is read here."""
    budget = int((headroom - pending_bytes) * GATHERED_FRACTION)
    figures = _figures(headroom, bound_by, pending_bytes, budget, "gathered parameters")
    if model_numel * compute_bytes <= budget:
        return FetchSettings(
            defaults.unit_numel,
            defaults.prefetch_numel,
            defaults.max_live_numel,
            defaults.max_reuse_numel,
            f"{figures}, which holds the whole model ({_size(model_numel * compute_bytes)}): "
            "DeepSpeed's defaults",
        )
    live = max(budget // compute_bytes, 2 * largest_leaf_numel, 1)
    return FetchSettings(
        unit_numel=max(live // 4, 1),
        prefetch_numel=live // 2,
        max_live_numel=live,
        max_reuse_numel=0,
        reason=f"{figures}, less than the whole model ({_size(model_numel * compute_bytes)}): "
        f"units of at most {max(live // 4, 1):,} elements, {live // 2:,} prefetched, "
        f"{live:,} live, no reuse",
    )


def _unique_params(model: torch.nn.Module) -> list:
    return list({id(p): p for p in model.parameters()}.values())


def largest_leaf_numel(model: torch.nn.Module) -> int:
    """Elements of the largest set of parameters stage 3 cannot split: one module's own
    parameters (recurse=False), counted at their full size."""
    return max(
        (sum(full_numel(p) for p in m.parameters(recurse=False)) for m in model.modules()),
        default=0,
    )


def pending_bytes(model, config, trains: bool, state_bytes: int, num_shards: int, device) -> int:
    """Bytes of model states an engine will still allocate on `device` (where gathered
    parameters and gradients live), less what it frees: the formula's per-rank bytes
    (planning/memory.py; the parameter shards and the optimizer's categories count only where
    they stay on `device`: offload moves them to the host, which on a CPU rank is the same
    memory) less the parameters' storage held now (whole parameters, or zero.Init shards, which
    the engine's buffers replace)."""

    params = _unique_params(model)
    trained = [p for p in params if trains and p.requires_grad]
    frozen = [p for p in params if not (trains and p.requires_grad)]
    compute_bytes = torch.empty(0, dtype=config.compute_dtype).element_size()
    spec = ModelStateSpec(
        stage=config.zero.stage,
        numel=sum(full_numel(p) for p in trained),
        num_shards=num_shards,
        compute_bytes=compute_bytes,
        state_bytes=state_bytes,
        offload=config.zero.offload_optimizer is not None,
        grad_bytes=torch.empty(0, dtype=config.grad_accum_dtype).element_size(),
        frozen_numel=sum(full_numel(p) for p in frozen),
    )
    formula = {k: v or 0 for k, v in model_state_formula(spec).items()}
    on_host = set()
    if device.type != "cpu":
        if config.zero.offload_param is not None:
            on_host |= {"params", "frozen_params"}
        if config.zero.offload_optimizer is not None:
            on_host |= {"master", "optimizer_state", "host_grad"}
    allocate = sum(v for k, v in formula.items() if k not in on_host)
    if config.zero.stage < 3:
        on_host.discard("params")  # offload_param acts at stage 3 only
        on_host.discard("frozen_params")
    held = 0
    for p in params:
        numel = full_numel(p) // num_shards if is_partitioned(p) else p.numel()
        if p.device.type == device.type:
            held += numel * p.element_size()
    return allocate - held


_KEYS = (
    "stage3_module_granularity_threshold",
    "stage3_prefetch_bucket_size",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
)


def _measured(model, config, comm, device, trains: bool, state_bytes: int):
    """(headroom, what bounds it, pending bytes): the least headroom over the ranks (one
    all-reduce; collective) and the model states this rank will still allocate, or
    stage3_fetch_budget's given budget (as the headroom that leaves it, nothing pending)
    without measuring."""
    budget = config.zero.stage3_fetch_budget
    if config.zero.stage == 3 and budget != "auto":
        return int(budget / GATHERED_FRACTION), "stage3_fetch_budget", 0
    headroom, bound_by = headroom_bytes(device)
    least = torch.tensor([-float(headroom)], dtype=torch.float64, device=device)
    comm.all_reduce(least, op="max")  # the least headroom over the ranks
    # MiCS partitions over its shard groups (partition/hierarchy.py num_shards)
    shard_size = config.zero.mics_shard_size
    num_shards = (shard_size if shard_size > 0 else comm.world_size) if config.zero.stage else 1
    pending = pending_bytes(model, config, trains, state_bytes, num_shards, device)
    return int(-least.item()), bound_by, pending


def fetch_settings(model, config, comm, device, trains: bool, state_bytes: int) -> FetchSettings:
    """Stage 3's fetch settings for `model` ([Note: memory-aware fetch policy]): the policy's
    choice for the keys the config leaves unset, the config's values for the others.

    `comm`: the data-parallel Communicator; every rank gets the same settings (the least
    headroom over the ranks decides). `device`: where gathered parameters live. Collective
    when the config leaves any of the four keys unset and stage3_fetch_budget is "auto" (one
    all-reduce of one element)."""
    zero_cfg = config.zero
    given = {key: getattr(zero_cfg, key) for key in _KEYS if key in zero_cfg.model_fields_set}
    defaults = FetchSettings(
        zero_cfg.stage3_module_granularity_threshold or zero_cfg.reduce_bucket_size,
        zero_cfg.stage3_prefetch_bucket_size,
        zero_cfg.stage3_max_live_parameters,
        zero_cfg.stage3_max_reuse_distance,
        "every fetch key is set in the config",
    )
    if len(given) == len(_KEYS):
        return defaults
    headroom, bound_by, pending = _measured(model, config, comm, device, trains, state_bytes)
    chosen = choose(
        headroom=headroom,
        bound_by=bound_by,
        model_numel=sum(full_numel(p) for p in _unique_params(model)),
        largest_leaf_numel=largest_leaf_numel(model),
        compute_bytes=torch.empty(0, dtype=config.compute_dtype).element_size(),
        pending_bytes=pending,
        defaults=defaults,
    )
    keep = given.get("stage3_module_granularity_threshold")
    if keep == 0:  # set to 0 explicitly: DeepSpeed's "disabled", zero's reduce_bucket_size
        keep = zero_cfg.reduce_bucket_size
    unit = keep if keep is not None else chosen.unit_numel
    prefetch = given.get("stage3_prefetch_bucket_size", chosen.prefetch_numel)
    live = given.get("stage3_max_live_parameters", chosen.max_live_numel)
    reuse = given.get("stage3_max_reuse_distance", chosen.max_reuse_numel)
    reason = chosen.reason
    if given:  # the values in effect, which the config's keys changed
        reason += (
            f"; the config sets {', '.join(given)}, so in effect: units of at most {unit:,} "
            f"elements, {prefetch:,} prefetched, {live:,} live, reuse distance {reuse:,}"
        )
    return FetchSettings(unit, prefetch, live, reuse, reason)


# [Note: bucket sizes from memory]
# At stages 1-2 the layout's buckets are reduce_bucket_size elements (DeepSpeed's default, 5e8)
# and backward fills a bucket's gradient staging buffer before it is reduce-scattered, with a
# few buckets in flight: for a model below half a billion elements one bucket is the whole
# gradient, which stage 2 exists not to hold. When the config leaves reduce_bucket_size (and
# allgather_bucket_size) unset, bucket_settings keeps DeepSpeed's values if STAGING_BUCKETS
# copies of the whole gradient fit the budget (measured as for stage 3), else makes the
# buckets as large as STAGING_BUCKETS of them fit, at least MIN_BUCKET_NUMEL elements.
STAGING_BUCKETS = 4
MIN_BUCKET_NUMEL = 1 << 16


@dataclass(frozen=True)
class BucketSettings:
    """Stages 1-2's bucket sizes in elements ([Note: bucket sizes from memory])."""

    reduce_numel: int  # reduce_bucket_size: the layout's buckets
    allgather_numel: int  # allgather_bucket_size: the updated parameters' all-gather
    reason: str


def choose_buckets(
    *,
    headroom: int,
    bound_by: str,
    model_numel: int,
    grad_bytes: int,
    pending_bytes: int,
    defaults: BucketSettings,
) -> BucketSettings:
    """Bucket sizes for a rank with `headroom` bytes (the least over the ranks) that will
    still allocate `pending_bytes` of model states, training `model_numel` elements with
    gradients of `grad_bytes` each; `defaults` kept when the whole gradient fits. Pure."""
    budget = int((headroom - pending_bytes) * GATHERED_FRACTION)
    figures = _figures(headroom, bound_by, pending_bytes, budget, "gradient buckets")
    whole = STAGING_BUCKETS * model_numel * grad_bytes
    if whole <= budget:
        return BucketSettings(
            defaults.reduce_numel,
            defaults.allgather_numel,
            f"{figures}, which holds {STAGING_BUCKETS} whole gradients: DeepSpeed's defaults",
        )
    numel = max(budget // (STAGING_BUCKETS * grad_bytes), MIN_BUCKET_NUMEL)
    reduce_numel = min(numel, defaults.reduce_numel)
    allgather_numel = min(numel, defaults.allgather_numel)
    return BucketSettings(
        reduce_numel,
        allgather_numel,
        f"{figures}, less than {STAGING_BUCKETS} whole gradients ({_size(whole)}): "
        f"buckets of {reduce_numel:,} elements",
    )


def bucket_settings(model, config, comm, device, trains: bool, state_bytes: int) -> BucketSettings:
    """Stages 1-2's bucket sizes ([Note: bucket sizes from memory]); the config's values where
    it sets the keys, and at other stages or without an optimizer. Collective when the policy
    measures (one all-reduce of one element)."""
    zero_cfg = config.zero
    defaults = BucketSettings(
        zero_cfg.reduce_bucket_size, zero_cfg.allgather_bucket_size, "set in the config"
    )
    keys = {"reduce_bucket_size", "allgather_bucket_size"}
    if zero_cfg.stage not in (1, 2) or not trains or keys <= zero_cfg.model_fields_set:
        return defaults
    headroom, bound_by, pending = _measured(model, config, comm, device, trains, state_bytes)
    chosen = choose_buckets(
        headroom=headroom,
        bound_by=bound_by,
        model_numel=sum(full_numel(p) for p in _unique_params(model) if p.requires_grad),
        grad_bytes=torch.empty(0, dtype=config.grad_accum_dtype).element_size(),
        pending_bytes=pending,
        defaults=defaults,
    )
    given = keys & zero_cfg.model_fields_set
    return BucketSettings(
        defaults.reduce_numel if "reduce_bucket_size" in given else chosen.reduce_numel,
        defaults.allgather_numel if "allgather_bucket_size" in given else chosen.allgather_numel,
        chosen.reason + (f" (the config sets {', '.join(sorted(given))})" if given else ""),
    )
