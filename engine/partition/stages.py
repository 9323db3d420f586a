"""The sharded optimizer of ZeRO stages 0, 1 and 2 (paper, section 5.1-5.2).

One code path serves three policies:

| stage | gradient buffer kept across micro-batches | reduction            | when             |
|-------|--------------------------------------------|----------------------|------------------|
| 0     | full                                       | all-reduce, in place | last micro-batch |
| 1     | full                                       | reduce-scatter       | last micro-batch |
| 2     | only the owned shard                       | reduce-scatter       | every micro-batch|

The gradient buffers are in the accumulation dtype [data_types.grad_accum_dtype]: fp32 by
default, or the 2-byte compute dtype (the paper's 2-byte gradients; [Note: 2-byte gradients]).

[Note: gradient lifetime]
A bucket's gradient buffer (the accumulation buffer in stages 0 and 1, the owned reduced shard
in stages 2 and 3) exists from the first gradient of an optimizer step to the end of step(),
not across steps: it is made when the step's first gradient reaches the bucket (stages 0-1) or
when its first reduction lands (stages 2-3, written by the reduce-scatter), and dropped once the
optimizer has used it. No buffer is zero-filled: a parameter's first gradient is copied in,
later ones added, and what no gradient covered is zeroed before the reduction (complete_fill).
So the forward's activations reuse the memory the gradients used, and backward frees
activations while gradients appear: a rank never holds both in full (PyTorch's
optimizer.zero_grad(set_to_none=True) does the same for a plain model).
Bytes per element are the same (model_state_bytes counts the buffers at their size).

In every stage a rank keeps fp32 master weights and optimizer state only for the slices it owns
(stage 0 owns everything), steps the optimizer on them, and all-gathers the updated slices back
into the low-precision parameter buffers (see flat.py for the ownership layout).

[Note: ZeRO-Inference]
An engine built without an optimizer (zero.initialize with no optimizer= and no 'optimizer'
block, or a model none of whose parameters requires grad) trains nothing: its ZeroOptimizer
wraps a NoOptimizer, lays out no bucket and so allocates no gradient buffer, fp32 master weight
or optimizer state. The engine keeps every parameter as a frozen one: whole on every rank at
stages 0-2 (stages 1 and 2 partition only optimizer state and gradients, which do not exist
here, so they hold what stage 0 holds), and as 1/N shards (FrozenShards, frozen_shards.py) at
stage 3, in host memory or nvme files with offload_param. DeepSpeed builds its
DeepSpeedZeRoOffload for stage 3 in this case and refuses stages 1 and 2 ("zero stage N requires
an optimizer").

[Note: launch order]
Gradient hooks mark a bucket ready when every parameter in it has its gradient, but buckets are
launched strictly in index order: a bucket that is ready early waits for its predecessors. Every
rank therefore issues the same collectives in the same order, whatever order autograd produced
gradients in and whichever parameters a rank left unused (their gradients are zero). Buckets still
not launched when backward ends are launched by finish_backward().

[Note: 2-byte gradients]
With grad_accum_dtype bf16/fp16 the accumulation buffer (stages 0, 1) and the reduced shard
(stages 2, 3) are 2-byte, so a rank holds the paper's 2 bytes per gradient element. Micro-batch
gradients are added in that dtype and reduced in it (stages 0 and 1 reduce the accumulation
buffer in place; stages 2 and 3 in communication_data_type, default the compute dtype). Only at
step() is an fp32 copy of each owned shard made (4 bytes per owned element, transient): the
global norm, overflow check, unscaling and clipping run on it and the optimizer reads it as the
fp32 master weights' gradient; it is freed when the step ends. No full-size fp32 gradient exists.

[Note: one fp32 gradient at a time]
With nvme (or partial) optimizer offload and 2-byte gradients, step() never holds the fp32
copies of all owned shards at once (4 bytes per owned element, as much as the fp32 master that
nvme keeps out of memory): the global norm is summed from one transient copy per bucket, each
freed before the next is made, and offload/nvme.py asks ScaledGrads for a bucket's fp32 gradient
(copy, then the same multiplication by the unscale-and-clip factor) only when it steps that
bucket. The values are those of the eager path bit for bit: the same cast, the same norm
summation order, the same multiplication.
"""

import contextlib
import enum
import math
from collections import deque
from dataclasses import dataclass

import torch

from ..comm import Communicator, Handle, Intent
from ..optim import UNSUPPORTED_OPTIMIZERS
from ..optim.precision import LossScaler
from .flat import BucketLayout, FlatLayout
from .hierarchy import PartitionGroups
from .shared import bucket_values, check_params, collective_failure, host_copy

# Stage-2 buckets allowed in flight before the oldest is waited for; bounds transient gradient
# memory to a few buckets (the paper's constant-size buffers) while keeping overlap.
MAX_BUCKETS_IN_FLIGHT = 2


def _unstepped(state: dict) -> bool:
    """True for per-parameter state an optimizer creates before its first step (step == 0)."""
    return "step" in state and float(state["step"]) == 0


class ScaledGrads:
    """Per bucket, the (shard_numel,) fp32 unscaled, clipped owned gradient, made when indexed:
    a fresh fp32 copy of the 2-byte grad_shard times `factor` ([Note: one fp32 gradient at a
    time]). Each index is read once; the caller drops the tensor when its bucket is stepped."""

    def __init__(self, buckets: list, factor: float):
        self.buckets = buckets
        self.factor = factor

    def __len__(self) -> int:
        return len(self.buckets)

    def __getitem__(self, index: int) -> torch.Tensor:
        shard = self.buckets[index].reduced_grad()
        assert shard.dtype != torch.float32, "ScaledGrads would scale an fp32 shard in place"
        return shard.to(torch.float32).mul_(self.factor)


class BucketState(enum.Enum):
    FILLING = "filling"  # gradients of this micro-batch are being copied in
    REDUCING = "reducing"  # collective launched, not yet waited for
    REDUCED = "reduced"  # reduced gradients are in grad_shard


def check_optimizer(optimizer) -> None:
    """Raise NotImplementedError for an optimizer ZeRO cannot shard (it needs whole tensors or a
    closure), ValueError for one that has stepped already (its state belongs to other tensors).
    Called before the model is touched."""
    name = type(optimizer).__name__
    if name in UNSUPPORTED_OPTIMIZERS:
        raise NotImplementedError(
            f"optimizer {name} cannot run under ZeRO: {UNSUPPORTED_OPTIMIZERS[name]}; use an "
            "element-wise optimizer (Adam, AdamW, SGD, Adagrad, ...)"
        )
    if not all(_unstepped(state) for state in optimizer.state.values()):
        raise ValueError(
            "the optimizer passed to zero.initialize already has state (it has stepped); "
            "pass a freshly constructed optimizer"
        )


@dataclass
class ReduceSettings:
    """What the sharded optimizer needs from the config (DeepSpeed key in brackets).

    stage: 0, 1 or 2 [zero_optimization.stage]. reduce_dtype: dtype stage 2 reduces gradients in
    [communication_data_type, default the compute dtype]. accum_dtype: dtype of the gradient buffers
    and shards [data_types.grad_accum_dtype, default fp32]. allgather_numel: the most parameter
    elements all-gathered at once [zero_optimization.allgather_bucket_size]. clip: global-norm
    threshold, 0 disables [gradient_clipping]. overflow_check: skip steps whose gradients are not
    finite (fp16; bf16 with bf16.check_grad_overflow). model_parallel: a
    zero.mpu.ModelParallelNorm when the model is tensor-parallel, so the norm counts every
    model-parallel slice once. offload, pin_memory: keep fp32 master
    weights, their gradient and the optimizer state in (page-locked) host memory and step there
    [zero_optimization.offload_optimizer.device "cpu", .pin_memory] (ZeRO-Offload). offload_param,
    pin_param: stage 3 keeps each parameter shard in (page-locked) host memory and copies it to the
    device for the all-gather [zero_optimization.offload_param.device "cpu", .pin_memory].
    """

    stage: int
    reduce_dtype: torch.dtype
    allgather_numel: int
    clip: float
    overflow_check: bool
    model_parallel: object | None = None
    offload: bool = False
    pin_memory: bool = False
    offload_param: bool = False
    pin_param: bool = False
    accum_dtype: torch.dtype = torch.float32
    # [gradient_allreduce_op] "mean" (True): the step uses the gradient averaged over the
    # data-parallel ranks; "sum" (False): their sum, DeepSpeed's meaning of the key.
    average_over_ranks: bool = True
    # nvme offload or a partial one (ratio < 1): a zero.nvme.OptimizerOffload, and `offload`
    # is False (engine/offload/nvme.py places each bucket and runs the step).
    split: object | None = None
    # stage 3 offload_param.device "nvme": a zero.param_swap.ParamOffload (offload/param_swap.py)
    param_nvme: object | None = None


class Bucket:
    """Runtime buffers of one BucketLayout on this rank.

    param_buffer: (padded_numel,) compute dtype, the storage the model's parameters view.
    master: (shard_numel,) fp32 owned weights the optimizer updates; aliases the owned slice of
        param_buffer when the compute dtype is fp32 (no copy, no cast).
    grad_shard: (shard_numel,) accumulation dtype (fp32 or 2-byte), owned, reduced gradient; a
        view of the accumulation buffer in stages 0 (all of it) and 1 (the owned slice). None
        between steps ([Note: gradient lifetime]).
    accum: (padded_numel,) accumulation dtype, gradient accumulated over micro-batches (stages 0
        and 1 only; None between steps).
    grad_device, grad_dtype: where and in which dtype the gradient buffers are made.
    host_grad: (shard_numel,) fp32 host copy of the unscaled, clipped owned gradient (offload).
    """

    def __init__(self, layout: BucketLayout, params, param_buffer, shard: int, stage: int):
        self.layout = layout
        self.params = params
        self.param_buffer = param_buffer
        self.shard = shard
        begin, end = layout.owned_range(shard)
        # Stages 0-2: a view of the persistent parameter buffer. Stage 3: its own storage; the
        # full buffer exists only while the bucket's unit is gathered (gatherer.py).
        self.param_shard = param_buffer[begin:end]
        self.master = None
        self.host_grad = None  # offload: host copy of grad_shard the host optimizer reads
        self.accum = None
        self.grad_shard = None
        self.grad_device = param_buffer.device
        self.grad_dtype = torch.float32
        self.staging = None  # stages 2-3: this micro-batch's gradients, until reduced
        self.written = [False] * len(params)  # per parameter: has a gradient in the fill buffer
        self.recv = None
        self.handle = Handle()
        self.pending = None  # stage 3: the all-gather of param_buffer in flight (prefetch)
        self.versions = []  # stage 3: the parameters' version counters when last gathered
        self.generation = 0  # stage 3: values written into the shard ([Note: stale graphs])
        self.state = BucketState.FILLING
        self.arrived = [False] * len(params)
        self.num_arrived = 0
        self.complete = False  # stage 3: its unit's backward is done (missing gradients: zero)
        self.stage = stage

    def add_gradient(self, index: int, grad: torch.Tensor, dtype: torch.dtype) -> None:
        """Add parameter `index`'s gradient into the fill buffer: stages 0-1 the accumulation
        buffer (kept over the step's micro-batches), stages 2-3 this micro-batch's staging
        buffer (reduce_dtype `dtype`). A fill buffer is made uninitialized: a parameter's first
        gradient into it is copied, later ones added, and complete_fill() zeroes the rest."""
        target = self._fill_target(dtype)
        slot = self.layout.slots[index]
        view = target[slot.offset : slot.offset + slot.numel]
        if self.written[index]:
            view.add_(grad.reshape(-1))
        else:
            view.copy_(grad.reshape(-1))
            self.written[index] = True

    def _fill_target(self, dtype: torch.dtype) -> torch.Tensor:
        if self.stage < 2:
            if self.accum is None:
                self.accum = self._fresh(self.grad_dtype)
                begin, end = self.layout.owned_range(self.shard) if self.stage == 1 else (0, None)
                self.grad_shard = self.accum[begin:end]  # stage 1 reduce-scatters in place
            return self.accum
        if self.staging is None:
            self.staging = self._fresh(dtype)
        return self.staging

    def _fresh(self, dtype: torch.dtype) -> torch.Tensor:
        # On the gradients' device: with offload_param the parameter shard is on the host.
        self.written = [False] * len(self.params)
        return torch.empty(self.layout.padded_numel, dtype=dtype, device=self.grad_device)

    def complete_fill(self, dtype: torch.dtype) -> torch.Tensor:
        """The fill buffer to reduce, with the padding and the parameters that got no gradient
        zeroed (all of it when none did)."""
        target = self._fill_target(dtype)
        for slot, written in zip(self.layout.slots, self.written):
            if not written:
                target[slot.offset : slot.offset + slot.numel].zero_()
        target[self.layout.numel :].zero_()
        self.written = [True] * len(self.params)
        return target

    def reduced_grad(self) -> torch.Tensor:
        """The (shard_numel,) owned gradient for step(): zeros when no gradient reached the
        bucket since the last step (step() without backward)."""
        if self.stage < 2 and self.accum is None:
            self.complete_fill(self.grad_dtype)
        elif self.grad_shard is None:
            self.grad_shard = torch.zeros(
                self.layout.shard_numel, dtype=self.grad_dtype, device=self.grad_device
            )
        return self.grad_shard

    def drop_gradients(self) -> None:
        """The step used the gradients: free them ([Note: gradient lifetime])."""
        self.accum = self.grad_shard = None

    def reset_arrivals(self) -> None:
        self.arrived = [False] * len(self.params)
        self.num_arrived = 0
        self.complete = False
        self.state = BucketState.FILLING

    @property
    def ready(self) -> bool:
        return self.complete or self.num_arrived == len(self.params)


class NoOptimizer:
    """What the ZeroOptimizer of a ZeRO-Inference engine wraps in place of a torch optimizer
    ([Note: ZeRO-Inference]; DeepSpeed's DummyOptim has this part): no param groups, no state.
    step() raises RuntimeError naming why the engine has no optimizer; zero_grad() is a no-op.

    `reason` completes "the engine was built without an optimizer because ..."; `fix` says how
    to get one; `rank` is named in the errors."""

    def __init__(self, reason: str, fix: str, rank: int):
        self.reason = reason
        self.fix = fix
        self.rank = rank
        self.param_groups: list[dict] = []
        self.state: dict = {}
        self.defaults: dict = {}

    def refusal(self, method: str) -> RuntimeError:
        """The error for training method `method` (e.g. "engine.backward()")."""
        return RuntimeError(
            f"rank {self.rank}: {method} needs an optimizer, and this engine was built without one "
            f"({self.reason}): a ZeRO-Inference engine runs forward, evaluation and generation "
            f"only, and holds no gradients, fp32 master weights or optimizer state; {self.fix}"
        )

    def step(self, closure=None):
        raise self.refusal("optimizer.step()")

    def zero_grad(self, set_to_none: bool = True) -> None:
        del set_to_none

    def state_dict(self) -> dict:
        return {"state": {}, "param_groups": []}

    def load_state_dict(self, state: dict) -> None:
        """Accept only the empty state another NoOptimizer saved (ValueError otherwise)."""
        if state.get("state") or state.get("param_groups"):
            raise ValueError(
                "an optimizer state with param groups cannot load into an engine without an "
                f"optimizer ({self.reason}); {self.fix}"
            )


class ZeroOptimizer:
    """Gradient reduction, clipping, loss-scale handling and the sharded optimizer step.

    Args:
        named_groups: per param group of `optimizer`, the (name, parameter) pairs it trains
            (trainable, non-empty, each parameter once).
        optimizer: a torch.optim.Optimizer built over those groups; its param lists are replaced
            by this rank's fp32 master shards, keeping every hyper-parameter. A NoOptimizer (with
            no named groups) for an engine that does not train ([Note: ZeRO-Inference]).
        layout: the FlatLayout of named_groups.
        settings: ReduceSettings; comm: the data-parallel Communicator; scaler: the LossScaler.
        compute_dtype: dtype of the parameters seen by forward and backward.
        groups: where the states are partitioned (hierarchy.PartitionGroups: MiCS shard and
            replica groups); default: over `comm`.

    Collective: every rank of the data-parallel group constructs it and calls step() together.
    """

    def __init__(
        self,
        named_groups,
        optimizer,
        layout: FlatLayout,
        settings,
        comm,
        scaler,
        compute_dtype,
        groups: PartitionGroups | None = None,
    ):
        self.layout = layout
        self.settings = settings
        self.comm: Communicator = comm
        self.groups = groups if groups is not None else PartitionGroups(comm)
        # Reduce-scatters and all-gathers run over the shard group ([Note: MiCS]); agreement
        # checks, the norm's sum and the averaging over ranks over the whole group (`comm`).
        self.shard_comm: Communicator = self.groups.shard
        self.scaler: LossScaler = scaler
        self.optimizer = optimizer
        self.compute_dtype = compute_dtype
        self.global_grad_norm = None
        self.overflow = False  # DeepSpeed's name: the last step was skipped (accelerate reads it)
        self.gatherer = None  # stage 3: the ParamGatherer, set by attach_gatherer()
        self.reduce_comm: Communicator = self.shard_comm  # gradients' group (attach_gatherer)
        # qgZ (stages 2-3): zeropp.QuantizedGradients over reduce_comm's nodes, set by the engine
        # ([Note: quantized gradients (qgZ)] in zeropp.py)
        self.quantized_reduce = None
        self._accepting_grads = False
        self._reduce_this_micro_batch = False
        self._next_launch = 0
        # "Type: message" of a backward that raised, until drop_failed_backward() recovers
        self.failed_backward: str | None = None
        self._in_flight: deque[Bucket] = deque()
        self._names: dict[int, str] = {}
        self.offloader = None  # nvme / partial offload: engine/offload/nvme.py PartialOffload
        if settings.split is not None:
            from ..offload.nvme import PartialOffload

            self.offloader = PartialOffload(settings.split, layout, comm.rank)
        self.param_swap = None  # stage 3 parameter shards on nvme: engine/offload/param_swap.py
        if settings.param_nvme is not None:
            from ..offload.param_swap import ParamSwap

            self.param_swap = ParamSwap(settings.param_nvme, comm.rank, compute_dtype)
        self.buckets = self._build_buckets(named_groups)
        # id(param) -> (bucket, index in bucket.params): zero.utils finds a parameter's shards
        self._place = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        # The boundary micro-batch's reduced gradients are in the grad shards: from the end of
        # its backward until step() / clear_gradients() (zero.utils.safe_get_full_grad's window).
        self.grads_reduced = False
        self._at_boundary = False
        self._hooks = self._register_hooks()
        self._bind_optimizer()

    # ----- construction -------------------------------------------------------------------
    def _build_buckets(self, named_groups) -> list[Bucket]:
        params_by_name = {}
        for named in named_groups:
            for name, param in named:
                params_by_name[name] = param
                self._names[id(param)] = name
        device = next(iter(params_by_name.values())).device if params_by_name else "cpu"
        shard = self.layout.shard_of(self.comm.rank)
        buckets = []
        for group in range(self.layout.num_groups):
            # Stage 3 keeps no full parameter buffer: each bucket gets a temporary one, dropped
            # once its owned slice is copied out (_init_bucket_state).
            numel = 0 if self.settings.stage == 3 else self.layout.group_numel[group]
            flat = torch.zeros(numel, dtype=self.compute_dtype, device=device)
            for bl in self.layout.group_buckets(group):
                params = [params_by_name[s.name] for s in bl.slots]
                if self.settings.stage == 3:
                    view = torch.empty(bl.padded_numel, dtype=self.compute_dtype, device=device)
                else:
                    view = flat[bl.start : bl.start + bl.padded_numel]
                bucket = Bucket(bl, params, view, shard, self.settings.stage)
                self._init_bucket_state(bucket)
                buckets.append(bucket)
        return buckets

    def _init_bucket_state(self, bucket: Bucket) -> None:
        """Fill the bucket from its parameters, create master and gradient buffers, rebind."""
        layout, device = bucket.layout, bucket.param_buffer.device
        full = bucket_values(layout, bucket.params, torch.float32, device)
        if self.settings.stage != 3:
            bucket.param_buffer.copy_(full)
        begin, end = layout.owned_range(self.layout.shard_of(self.comm.rank))
        if self.settings.stage == 3:
            # Only the owned slice persists; the parameters are released by the gatherer.
            bucket.param_shard = full[begin:end].to(self.compute_dtype, copy=True)
            if self.param_swap is not None:
                self.param_swap.adopt(bucket, bucket.param_shard)
            elif self.settings.offload_param:
                bucket.param_shard = host_copy(bucket.param_shard, self.settings.pin_param)
        where = self._placement(bucket)
        if where == "nvme":
            self.offloader.adopt(bucket, full[begin:end])
        elif where == "cpu":
            bucket.master = host_copy(full[begin:end], self.settings.pin_memory)
            bucket.host_grad = host_copy(torch.zeros(layout.shard_numel), self.settings.pin_memory)
        elif self.compute_dtype == torch.float32 and not self.param_swapped(bucket):
            bucket.master = bucket.param_shard
        else:  # a separate fp32 copy (also for fp32 shards in files: the master stays here)
            bucket.master = full[begin:end].clone()
        del full
        # Stage 1 reduce-scatters in place: the owned slice of the accumulation buffer receives
        # the reduced gradient, so it holds no second gradient buffer. The buffers themselves
        # are made during backward ([Note: gradient lifetime]); step() binds the master's .grad.
        bucket.grad_device, bucket.grad_dtype = device, self.settings.accum_dtype
        if where == "cpu":
            bucket.master.grad = bucket.host_grad
        if self.settings.stage == 3:
            bucket.param_buffer = None
            return
        for slot, param in zip(layout.slots, bucket.params):
            # The parameter becomes a view of zero's buffer: forward reads what all-gather wrote.
            param.data = bucket.param_buffer[slot.offset : slot.offset + slot.numel].view(
                slot.shape
            )
            param.grad = None

    def _placement(self, bucket: Bucket) -> str:
        """Where the bucket's master and optimizer state live: "device", "cpu" or "nvme"."""
        if self.offloader is not None:
            return self.offloader.where(bucket)
        return "cpu" if self.settings.offload else "device"

    def _register_hooks(self) -> list:
        handles = []
        for bucket in self.buckets:
            for index, param in enumerate(bucket.params):
                handles.append(
                    param.register_post_accumulate_grad_hook(_GradHook(self, bucket, index))
                )
        return handles

    def _bind_optimizer(self) -> None:
        """Point the optimizer's param groups at this rank's master shards, keeping every
        hyper-parameter. State that the optimizer created at construction (Adagrad's sum) is
        created again for the shards (check_optimizer refused anything else)."""
        had_state = len(self.optimizer.state) > 0
        for group_index, group in enumerate(self.optimizer.param_groups):
            group["params"] = [b.master for b in self.buckets if b.layout.group == group_index]
        if had_state:
            groups = [dict(g) for g in self.optimizer.param_groups]
            template = type(self.optimizer)(groups, **self.optimizer.defaults)
            self.optimizer.state = template.state

    def attach_gatherer(self, gatherer, reduce_comm: Communicator) -> None:
        """Stage 3: parameters are gathered by `gatherer`; gradients are reduce-scattered over
        `reduce_comm`, a process group of their own (same ranks). [Note: two groups at stage 3]
        Which buckets are complete when depends on the data (an expert that got no tokens on
        one rank completes later there), so on one group a rank's reduce-scatter could meet
        another rank's all-gather. Reduce-scatters keep bucket order on their own group, and a
        rank never blocks on one during backward (only finished ones are reaped), so no rank
        waits for a peer that first needs this rank's next all-gather (on CUDA a wait only
        orders streams and never blocks the host, so the in-flight bound holds there)."""
        self.gatherer = gatherer
        self.reduce_comm = reduce_comm
        gatherer.on_unit_done = self._complete_unit

    def _complete_unit(self, unit) -> None:
        """Every call of `unit` finished its backward on this rank ([Note: end of a unit's
        backward]): its parameters without a gradient count as zero; launch what is ready."""
        for bucket in unit.buckets:
            if bucket.master is not None and bucket.state is BucketState.FILLING:
                bucket.complete = True
        if self._reduce_this_micro_batch:
            self._launch_ready()

    # ----- backward -----------------------------------------------------------------------
    def start_backward(self, reduce: bool) -> None:
        """Begin a micro-batch's backward; `reduce` is true for the last micro-batch before the
        optimizer step (the gradient accumulation boundary), whose gradients stages 0/1 reduce;
        stages 2 and 3 reduce every micro-batch."""
        self._accepting_grads = True
        self._at_boundary = reduce
        self.grads_reduced = False
        self._reduce_this_micro_batch = reduce or self.settings.stage >= 2
        self._next_launch = 0
        for bucket in self.buckets:
            bucket.reset_arrivals()

    def _on_grad(self, bucket: Bucket, index: int, param: torch.Tensor) -> None:
        if param.grad is None:  # a custom autograd.Function gave it None: no gradient
            return
        name = self._names[id(param)]
        if not self._accepting_grads:
            raise RuntimeError(
                f"rank {self.comm.rank}: gradient of parameter '{name}' arrived outside "
                "engine.backward(); call engine.backward(loss) instead of loss.backward()"
            )
        if bucket.state is not BucketState.FILLING:
            raise RuntimeError(
                f"rank {self.comm.rank}: parameter '{name}' received a second gradient after its "
                "bucket was reduced in this backward (a parameter used both inside and outside "
                "a reentrant checkpoint); use non-reentrant activation checkpointing"
            )
        bucket.add_gradient(index, param.grad, self.settings.reduce_dtype)
        param.grad = None
        if not bucket.arrived[index]:
            bucket.arrived[index] = True
            bucket.num_arrived += 1
        if bucket.ready and self.gatherer is not None:
            self.gatherer.release_bucket_after_backward(bucket)
        if self._reduce_this_micro_batch and bucket.ready:
            self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if not (force or bucket.ready):
                return
            self._launch(bucket)
            self._next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        """Start the bucket's reduction (asynchronous; finished by _finish)."""
        bucket.state = BucketState.REDUCING
        source = bucket.complete_fill(self.settings.reduce_dtype)
        if self.settings.stage == 0:
            bucket.handle = self.comm.all_reduce(source, async_op=True)
        elif self.settings.stage == 1:
            bucket.handle = self.shard_comm.reduce_scatter(bucket.grad_shard, source, True)
        else:
            output = torch.empty(
                bucket.layout.shard_numel, dtype=source.dtype, device=source.device
            )
            if bucket.grad_shard is None and source.dtype == bucket.grad_dtype:
                bucket.grad_shard = output  # the step's first reduction: nothing to add to
            else:
                bucket.recv = output
            if self.quantized_reduce is not None:
                bucket.handle = self.quantized_reduce.reduce_scatter(output, source)
            else:
                bucket.handle = self.reduce_comm.reduce_scatter(output, source, async_op=True)
        self._in_flight.append(bucket)
        while self.settings.stage >= 2 and len(self._in_flight) > MAX_BUCKETS_IN_FLIGHT:
            oldest = self._in_flight[0]
            if self.settings.stage == 3 and oldest.handle.blocks_host and not oldest.handle.done():
                break  # [Note: two groups at stage 3]: never block on a peer here
            self._finish(self._in_flight.popleft())

    def _finish(self, bucket: Bucket) -> None:
        try:
            bucket.handle.wait()
        except RuntimeError as error:
            if self.settings.stage != 3:
                raise
            what = f"the gradient reduce-scatter of bucket {bucket.layout.index}"
            raise collective_failure(self.comm.rank, what, error) from error
        if bucket.recv is not None:
            if bucket.grad_shard is None:
                bucket.grad_shard = bucket.recv.to(bucket.grad_dtype)
            else:
                bucket.grad_shard.add_(bucket.recv)
            bucket.recv = None
        bucket.staging = None  # stages 2-3: the full-size gradient is freed once reduced
        bucket.state = BucketState.REDUCED

    def abandon_backward(self, error: BaseException) -> None:
        """A backward raised `error`: stop taking gradients, issue no collective (the error may
        come from ranks that disagree) and remember the failure until drop_failed_backward()
        ([Note: a failed backward])."""
        self._accepting_grads = False
        text = " ".join(str(error).split())
        text = text if len(text) <= 160 else text[:157] + "..."
        self.failed_backward = f"{type(error).__name__}: {text}"

    def drop_failed_backward(self) -> None:
        """[Note: a failed backward]
        A backward that raised part-way (an error in a custom autograd Function, out of memory,
        a stale graph) leaves the optimizer step's gradients incomplete: some parameters' are in
        the buckets, some buckets' reductions are launched and never waited for. Nothing can
        tell the failed micro-batch's share from the earlier micro-batches' (stages 0-1 add
        them in one buffer), so this drops every gradient of the step, as torch's
        optimizer.zero_grad() after a failed backward does, once every rank agrees that it
        launched the same reductions (then it waits for them, so the ranks' collectives stay
        in step); otherwise every rank raises RankMismatchError and the run cannot go on.
        Collective: every rank calls it (engine.zero_grad() or optimizer.zero_grad())."""
        if self.comm.agreement is not None:
            method = "engine.zero_grad() after a failed engine.backward()"
            self.comm.agreement.enter(method, self._next_launch)
        while self._in_flight:
            self._finish(self._in_flight.popleft())
        for bucket in self.buckets:
            bucket.staging = bucket.recv = None
            bucket.reset_arrivals()
        self.clear_gradients()
        self._next_launch = 0
        if self.gatherer is not None:
            self.gatherer.release_all()
        self.failed_backward = None

    def finish_backward(self) -> None:
        """End a micro-batch's backward: launch what is left, in order, and wait for all of it.

        Collective (when gradients are reduced in this micro-batch): every rank must call it.
        """
        self._accepting_grads = False
        if not self._reduce_this_micro_batch:
            return
        self._launch_ready(force=True)
        # The waits below need every rank here. The check runs meanwhile: a rank still
        # gathering, or in a collective method, makes every rank raise (that rank at once, this
        # one when its reductions fail as that rank stops); at stage 3 the reductions' own group
        # times out after agreement_timeout too.
        agreement = self.comm.agreement
        pending = agreement.start(Intent.END_BACKWARD) if agreement is not None else None
        try:
            while self._in_flight:
                self._finish(self._in_flight.popleft())
        except RuntimeError:
            if pending is not None:
                pending.finish()  # ranks that disagree explain the failure
            raise
        if pending is not None:
            pending.finish()
        if self._at_boundary and self.groups.replica is not None:
            self._all_reduce_replicas()
        self.grads_reduced = self._at_boundary
        if self.gatherer is not None:
            self.gatherer.release_all()

    def _all_reduce_replicas(self) -> None:
        """MiCS: sum every owned gradient shard over the replica group, in bucket order, so
        each holds the sum over all data-parallel ranks ([Note: MiCS] in hierarchy.py). Once
        per optimizer step, at the accumulation boundary. Collective over the replica group."""
        for bucket in self.buckets:
            self.groups.replica.all_reduce(bucket.reduced_grad())

    # ----- step ---------------------------------------------------------------------------
    def step(self) -> bool:
        """Unscale, check overflow, clip and update the owned shards; all-gather parameters.

        Returns True when the step was applied, False when skipped (overflow). Collective.
        Records the global gradient norm (before clipping, identical on every rank). Raises
        RuntimeError without an optimizer ([Note: ZeRO-Inference]), before any collective.
        """
        if not self.trains:
            raise self.optimizer.refusal("engine.optimizer.step()")
        if self.comm.agreement is not None and self.layout.num_shards == 1:
            # A rank still in a collective method called between backward and step would
            # otherwise leave this rank waiting in the buffers' broadcast (with shards, the
            # gradient norm's sum is this check, see _global_norm).
            self.comm.agreement.check(Intent.STEP)
        # [Note: one fp32 gradient at a time]
        one_at_a_time = self.offloader is not None and self.settings.accum_dtype != torch.float32
        if one_at_a_time:
            shards = None
            norm_inputs = (self._fp32_grad(b) for b in self.buckets)
        else:
            shards = norm_inputs = [self._fp32_grad(b) for b in self.buckets]
        # The shards hold sum-over-ranks of loss-scaled gradients; averaging, unscaling and
        # clipping are folded into one multiplication.
        unscale = self.unscale_factor()
        norm = self._global_norm(norm_inputs) * unscale
        self.global_grad_norm = norm
        overflow = self.settings.overflow_check and not math.isfinite(norm)
        self.overflow = bool(overflow)
        if not overflow:
            factor = unscale * self._clip_coefficient(norm)
            if one_at_a_time:
                shards = ScaledGrads(self.buckets, factor)
            else:
                for shard in shards:
                    shard.mul_(factor)
            self._optimizer_step(shards)
        self.scaler.update(bool(overflow), self.comm.rank)
        self.clear_gradients()
        return not overflow

    def unscale_factor(self) -> float:
        """The factor from a reduced shard (the sum over ranks of loss-scaled gradients) to the
        gradient the optimizer steps on: 1 / (world size x loss scale), or 1 / loss scale with
        gradient_allreduce_op "sum"."""
        ranks = self.comm.world_size if self.settings.average_over_ranks else 1
        return 1.0 / (ranks * self.scaler.scale)

    @staticmethod
    def _fp32_grad(bucket: Bucket) -> torch.Tensor:
        """(shard_numel,) fp32: the owned reduced gradient itself with fp32 accumulation, else a
        transient fp32 copy of the 2-byte shard ([Note: 2-byte gradients])."""
        shard = bucket.reduced_grad()
        return shard if shard.dtype == torch.float32 else shard.to(torch.float32)

    def _optimizer_step(self, grads: list[torch.Tensor]) -> None:
        """Step on the master shards (on the host with offload) and refresh the parameters.
        grads: per bucket, the (shard_numel,) fp32 unscaled, clipped owned gradient."""
        if self.offloader is not None:
            self.offloader.step(self, grads)
            return
        if not self.settings.offload:
            for bucket, grad in zip(self.buckets, grads):
                bucket.master.grad = grad
            self.optimizer.step()
            for bucket in self.buckets:  # the gradients (or their fp32 copies) go after the step
                bucket.master.grad = None
            self.refresh_params()
            return
        for bucket, grad in zip(self.buckets, grads):
            bucket.host_grad.copy_(grad, non_blocking=bucket.host_grad.is_pinned())
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the host optimizer reads host_grad next
        fused = self._fused_copy_targets()
        if fused:
            # cpu_adam writes the low-precision parameters in the same pass over memory.
            self.optimizer.step_with_copy(fused)
        else:
            self.optimizer.step()
        self.refresh_params(skip_copy=set(map(id, fused)))

    def _fused_copy_targets(self) -> dict:
        """master -> low-precision host parameter shard, when cpu_adam can write it directly."""
        if not hasattr(self.optimizer, "step_with_copy") or self.compute_dtype == torch.float32:
            return {}
        if any(b.param_shard.device.type != "cpu" for b in self.buckets):
            return {}
        # Shards in nvme files are written by refresh_params, one buffer at a time.
        return {b.master: b.param_shard for b in self.buckets if not self.param_swapped(b)}

    def _global_norm(self, shards) -> float:
        """L2 norm over all owned gradient elements of all ranks: the ranks' sums of squares are
        added by the step's agreement check (comm.Agreement.check_and_sum: a rank still in a
        collective method called between backward and step makes every rank raise instead of
        waiting); with model parallelism a second sum over the model-parallel group follows
        (zero.mpu)."""
        device = self.buckets[0].grad_device if self.buckets else "cpu"
        squares = torch.zeros(1, dtype=torch.float32, device=device)
        model_parallel = self.settings.model_parallel
        shard_index = self.layout.shard_of(self.comm.rank)
        # MiCS: every replica holds the same shards; only the first adds its squares to the sum.
        counted = self.groups.first_replica or self.layout.num_shards == 1
        for bucket, shard in zip(self.buckets, shards):
            if counted and model_parallel is None:
                squares += torch.linalg.vector_norm(shard).square()
            elif counted:
                squares += model_parallel.shard_squares(bucket.layout, shard, shard_index)
            del shard  # a transient copy is freed before the next one is made
        if self.layout.num_shards > 1 and self.comm.agreement is not None:
            squares.fill_(self.comm.agreement.check_and_sum(Intent.STEP, float(squares)))
        elif self.layout.num_shards > 1:  # checks switched off (benchmarks/stage3_vs_fsdp.py)
            self.comm.all_reduce(squares)
        if model_parallel is not None:
            model_parallel.finish(squares)
        return float(squares.sqrt())

    def _clip_coefficient(self, norm: float) -> float:
        """gradient_clipping / (norm + 1e-6) when below 1, else 1 (as torch and DeepSpeed)."""
        if self.settings.clip > 0:
            return min(1.0, self.settings.clip / (norm + 1e-6))
        return 1.0

    def refresh_params(self, skip_copy=frozenset()) -> None:
        """Write the owned master slices into the parameter buffers (except masters whose id is in
        skip_copy, already written) and all-gather every bucket, with at most allgather_numel
        elements in flight. Collective."""
        pending: deque[tuple[Handle, int]] = deque()
        in_flight = 0
        if self.offloader is not None:  # nvme masters are not resident: copied when stepped
            skip_copy = set(skip_copy) | self.offloader.swapped_masters(self.buckets)
        for bucket in self.buckets:
            if bucket.master is not bucket.param_shard and id(bucket.master) not in skip_copy:
                with self.param_resident(bucket, write=True, read=False):
                    bucket.param_shard.copy_(bucket.master, non_blocking=bucket.master.is_pinned())
            if self.layout.num_shards == 1 or self.settings.stage == 3:
                continue  # stage 3 gathers parameters when a unit runs
            numel = bucket.layout.padded_numel
            while pending and in_flight + numel > self.settings.allgather_numel:
                handle, size = pending.popleft()
                handle.wait()
                in_flight -= size
            handle = self.groups.all_gather_params(bucket.param_buffer, bucket.param_shard, True)
            pending.append((handle, numel))
            in_flight += numel
        for handle, _ in pending:
            handle.wait()
        if self.param_swap is not None:
            self.param_swap.flush()  # every shard is in its file before step() returns
        self._mark_updated()
        if self.gatherer is not None:
            self.gatherer.refresh_gathered()

    def _mark_updated(self) -> None:
        """[Note: stale graphs]
        torch refuses a backward through a graph whose saved parameters an optimizer step has
        changed since (the step's in-place update raises the parameters' version counters).
        zero writes new values into its buffers, not through the parameters, so it raises their
        version counters itself, and torch's own check raises in such a backward, as for a plain
        model. At stage 3, engine(...) saves weights by reference ([Note: saved weights] in
        saved_weights.py), which torch does not version-check: each trainable bucket also counts the
        writes to its shard (generation), and a reference from before a write raises when
        backward reads it. No device synchronization; O(number of parameters)."""
        trained = [p for bucket in self.buckets for p in bucket.params]
        if trained:
            torch.autograd.graph.increment_version(trained)
        for bucket in self.buckets:
            bucket.generation += 1
            # stage 3: the bump is no write of the script's (ParamGatherer._check_not_modified)
            bucket.versions = [version + 1 for version in bucket.versions]

    def check_params(self) -> None:
        """Raise RuntimeError naming a laid-out parameter (trainable, or a stage-3 frozen one)
        whose tensor, dtype or requires_grad changed after zero.initialize (shared.check_params:
        [Note: parameters changed behind the engine's back]). Not a collective."""
        buckets = self.gatherer.buckets if self.gatherer is not None else self.buckets
        for bucket in buckets:
            check_params(bucket, self.compute_dtype, self.comm.rank, self.trains)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Accepted for training scripts that call optimizer.zero_grad() after engine.step(), as
        with a torch optimizer. It discards nothing: zero accumulates gradients in its own
        buffers over gradient_accumulation_steps micro-batches and clears them itself once the
        optimizer step used them (clearing them between micro-batches would silently drop the
        earlier ones). The model's parameters hold no .grad under zero. After a backward that
        raised it drops the step's gradients instead (drop_failed_backward: a collective
        then)."""
        del set_to_none
        if self.failed_backward is not None:
            self.drop_failed_backward()

    def clear_gradients(self) -> None:
        """Drop the accumulated and reduced gradients (after the optimizer step used them)."""
        for bucket in self.buckets:
            bucket.drop_gradients()
        self.grads_reduced = False

    # ----- introspection ------------------------------------------------------------------
    @property
    def trains(self) -> bool:
        """False for a ZeRO-Inference engine's optimizer, which wraps a NoOptimizer."""
        return not isinstance(self.optimizer, NoOptimizer)

    @property
    def param_groups(self):
        """The wrapped torch optimizer's param groups: every hyper-parameter as given, and
        "params" holding this rank's fp32 master shards (1-D, one per bucket of the group)."""
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        """The wrapped torch optimizer's state, a real dict, as DeepSpeed's ZeRO optimizers
        expose theirs (keyed by their flat fp32 partitions): keyed by this rank's fp32 master
        shards (the tensors in param_groups' "params"), each value the dict of that shard's
        state ("exp_avg", "exp_avg_sq": fp32 tensors shaped like the shard; "step"). Programs
        that iterate it see real tensors (Lightning's teardown moves them to the CPU); a value
        written into it is the state the next step reads. With nvme offload of the optimizer,
        a bucket's state lives in its file outside `resident()`. Not a collective."""
        return self.optimizer.state

    @state.setter
    def state(self, value: dict) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict:
        """The wrapped torch optimizer's default hyper-parameters (torch's Optimizer.defaults)."""
        return self.optimizer.defaults

    def locate(self, param) -> tuple[Bucket, int] | None:
        """(bucket, index in bucket.params) of a parameter this optimizer trains; None for any
        other tensor (frozen, empty, or another model's)."""
        place = self._place.get(id(param))
        return place if place is not None and place[0].params[place[1]] is param else None

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes per rank held for model states, by kind: {"params", "grads", "master",
        "optimizer_state"} -> bytes, measured from the tensors themselves; "grads" is the size of
        the gradient buffers, which exist from a step's first gradient to the end of step()
        ([Note: gradient lifetime]), in the accumulation dtype (2 or 4 bytes per element;
        step()'s transient fp32 copy is not held). Not a collective."""
        param = sum(
            (b.param_shard if self.settings.stage == 3 else b.param_buffer).numel()
            * b.param_shard.element_size()
            for b in self.buckets
        )
        grad = sum(
            (b.layout.padded_numel if self.settings.stage < 2 else b.layout.shard_numel)
            * b.grad_dtype.itemsize
            for b in self.buckets
        )
        master = sum(b.master.numel() * 4 for b in self.buckets if b.master is not b.param_shard)
        state = 0
        for per_param in self.optimizer.state.values():
            for value in per_param.values():
                if torch.is_tensor(value) and value.numel() > 1:
                    state += value.numel() * value.element_size()
        return {"params": param, "grads": grad, "master": master, "optimizer_state": state}

    @contextlib.contextmanager
    def resident(self, bucket, write: bool = False):
        """Context manager for any laid-out bucket (trainable, or stage-3 frozen): inside,
        bucket.param_shard, bucket.master and the master's optimizer state are real tensors even
        when they live in nvme files (offload/param_swap.py, offload/nvme.py); with `write`,
        changes made inside are written back (and an nvme master is copied into the parameter
        shard). Every reader of those tensors outside the step goes through it: checkpoints,
        zero.utils, GatheredParameters, Hugging Face import and export. Not a collective."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.param_resident(bucket, write))
            if self.offloader is not None and bucket.master is not None:
                stack.enter_context(self.offloader.resident(bucket, self.optimizer, write))
            yield

    def param_resident(self, bucket, write: bool = False, read: bool = True):
        """Context manager: bucket.param_shard holds its value inside (read=False: the caller
        overwrites all of it); see ParamSwap.resident."""
        if self.param_swap is None:
            return contextlib.nullcontext()
        return self.param_swap.resident(bucket, write, read)

    def param_swapped(self, bucket) -> bool:
        """True when the bucket's parameter shard lives in an nvme file."""
        return self.param_swap is not None and self.param_swap.swapped(bucket)

    def nvme_bytes(self) -> dict[str, int]:
        """Bytes of this rank's swap files: {"params": parameter shards, "optimizer": fp32
        masters and optimizer state}; on disk, not in memory (model_state_bytes excludes them)."""
        return {
            "params": 0 if self.param_swap is None else self.param_swap.bytes_on_disk,
            "optimizer": 0 if self.offloader is None else self.offloader.bytes_on_disk,
        }

    def close(self) -> None:
        """Release what outlives the process otherwise: nvme swap files (idempotent)."""
        if self.offloader is not None:
            self.offloader.close()
        if self.param_swap is not None:
            self.param_swap.close()

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "loss_scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["loss_scaler"])


class _GradHook:
    """The post-accumulate-grad hook a ZeroOptimizer puts on each parameter it trains: hands
    the gradient to the parameter's bucket. A class rather than a closure, so that trained_by()
    can tell a parameter some live engine trains."""

    def __init__(self, optimizer: ZeroOptimizer, bucket: Bucket, index: int):
        self.optimizer = optimizer
        self.bucket = bucket
        self.index = index

    def __call__(self, param: torch.Tensor) -> None:
        self.optimizer._on_grad(self.bucket, self.index, param)


def trained_by(param: torch.Tensor) -> ZeroOptimizer | None:
    """The ZeroOptimizer whose gradient hook `param` carries: an engine that trains it and
    was not closed (Engine.close removes the hooks); None otherwise."""
    hooks = getattr(param, "_post_accumulate_grad_hooks", None) or {}
    return next((h.optimizer for h in hooks.values() if isinstance(h, _GradHook)), None)
