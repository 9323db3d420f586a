"""Engine: wires config, communicator, flat layout, sharded optimizer and lr scheduler together.

The training loop a DeepSpeed user knows:

    loss = engine(batch)      # forward on the low-precision parameters
    engine.backward(loss)     # loss * loss_scale / gradient_accumulation_steps, then autograd
    engine.step()             # every micro-batch; updates at the accumulation boundary

The engine's phase moves IDLE -> FORWARD -> BACKWARD -> IDLE (step). Calling backward twice for one
micro-batch is an error: the gradients of the second call would be added after the reduction of
the first (sum the losses and call backward once). Two DeepSpeed styles end a micro-batch without
engine.step(): a backward inside engine.no_sync(), and one after
engine.set_gradient_accumulation_boundary(False); the next backward then starts the next
micro-batch.
"""

import contextlib
import enum
import gc
import logging
import os
import zlib

import torch
import torch.distributed as dist

from .accelerator import Accelerator
from .comm import Communicator, Intent
from .compiler import compile_model, refuse_compiled_model
from .errors import listed
from .monitor import StepMonitor, ThroughputTimer, summary_writer_class
from .offload import nvme, param_swap
from .optim import build_optimizer, resolve_optimizer
from .optim.lr_schedules import build_scheduler
from .optim.precision import LossScaler
from .partition import gathered, zeropp
from .partition.flat import FlatLayout
from .partition.hierarchy import num_shards, partition_groups
from .partition.init import (
    full_numel,
    full_shape,
    guard_load_state_dict,
    is_partitioned,
    name_full_size,
    refuse_meta,
    take_full,
)
from .partition.shared import changed_parameter
from .partition.stage3 import (
    FrozenShards,
    ParamGatherer,
    UnitState,
    choose_units,
    is_leaf,
    mark_leaf,
    persistent_unit,
    unmanaged_parameter,
)
from .partition.stages import (
    NoOptimizer,
    ReduceSettings,
    ZeroOptimizer,
    check_optimizer,
    trained_by,
)
from .planning.budget import bucket_settings, fetch_settings
from .planning.memory import state_bytes_per_element

logger = logging.getLogger("zero")


def _on_cpu(block):
    """An offload_optimizer / offload_param block when its device is "cpu", else None."""
    return block if block is not None and block.device == "cpu" else None


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


class Engine(torch.nn.Module):
    """A model trained with ZeRO stage 0, 1, 2 or 3 over one data-parallel group, or, built
    without an optimizer, run for forward, evaluation and generation only (ZeRO-Inference,
    [Note: ZeRO-Inference] in partition/stages.py; `inference_only`).

    Constructed by zero.initialize (every rank, collectively); `mpu` is a Megatron-style
    model-parallel unit when the model is tensor-parallel. `module` is the user's model, whose
    trainable parameters now view zero's flat low-precision buffers. As DeepSpeed's engine, an
    attribute the engine lacks is looked up on `module` (__getattr__), and destroy() detaches
    the engine from the model.
    """

    def __init__(
        self,
        model,
        config,
        comm: Communicator,
        accelerator: Accelerator,
        optimizer=None,
        model_parameters=None,
        lr_scheduler=None,
        mpu=None,
    ):
        super().__init__()
        self._destroyed = False  # close() / destroy() ran: training calls raise
        self._compiled = None  # engine.compile()'s compiler.Compiled
        self._listing_state = False  # stage 3: state_dict() lists entries without gathering
        self.config = config
        self.comm = comm
        self.accelerator = accelerator
        self.module = model
        refuse_meta(model, comm.rank)  # e.g. built under torch.device("meta"), never loaded
        refuse_compiled_model(model, config.zero.stage, comm.rank)  # engine.compile() instead
        _refuse_trained(model, comm.rank)  # laid out by another engine that was not closed
        _refuse_placeholders(model, comm.rank)  # laid out by another stage-3 engine
        _mark_leaf_names(model, config.zero)  # before the fingerprint, which counts leaves
        # Validate the optimizer and its param groups before any collective or device move.
        client_optimizer = optimizer is not None
        _check_one_source(config, optimizer, lr_scheduler)
        optimizer, lr_scheduler = self._optimizer_or_none(optimizer, model_parameters, lr_scheduler)
        trains = not isinstance(optimizer, NoOptimizer)
        named_groups = self._named_groups(optimizer, client_optimizer) if trains else []
        optimizer_files = None  # no optimizer: offload_optimizer places nothing
        if trains:
            optimizer_files = nvme.check_before_allocating(
                config,
                optimizer,
                sum(full_numel(p) for named in named_groups for _, p in named),
                self._num_shards(),
                comm.rank,
            )
        param_files = param_swap.check_before_allocating(
            config, [full_numel(p) for p in model.parameters()], self._num_shards(), comm.rank
        )
        nvme.check_free_space([optimizer_files, param_files], comm.rank)
        if config.tensorboard.enabled:
            summary_writer_class()  # rank 0 writes; every rank fails alike without the package
        # Before the first collective: every rank built the same model with the same config.
        agreement = comm.start_agreement(config.agreement_timeout)
        if agreement is not None:
            doing = "builds its engine (zero.initialize)"
            agreement.check(Intent.LAYOUT, (_fingerprint(model, config, optimizer),), doing)
        # A scheduler that cannot be built (a misspelled parameter) fails before the model is
        # touched; it drives the param groups' lr, which zero keeps.
        self.lr_scheduler = self._build_scheduler(lr_scheduler, optimizer) if trains else None
        if trains:
            check_optimizer(optimizer)
        snapshot = ModelSnapshot(model)
        try:
            self._build(named_groups, optimizer, agreement, mpu)
        except BaseException:
            snapshot.restore()  # a failed zero.initialize leaves the model as it found it
            raise
        self._added_hooks = snapshot.added_hooks()  # what close() removes

    def _build(self, named_groups, optimizer, agreement, mpu) -> None:
        """Lay the model out and attach zero to it (the part of construction that changes the
        model: parameter storage, hooks, device)."""
        config, comm, accelerator = self.config, self.comm, self.accelerator
        self.module.to(device=accelerator.device)  # keeps Parameter objects: groups stay valid
        if config.zero.stage < 3:
            self._materialize_frozen(named_groups)
        self._broadcast_module()
        self.scaler = LossScaler.from_config(config)
        trains = not isinstance(optimizer, NoOptimizer)
        state_bytes = (state_bytes_per_element(optimizer) or 8) if trains else 0
        units, unit_of = self._fetch_units(trains, state_bytes)
        self.bucket_sizes = self._bucket_sizes(trains, state_bytes)
        # MiCS shard / replica groups, hpZ's secondary group (partition/hierarchy.py)
        groups = self.partition_groups = partition_groups(comm, config.zero)
        self.optimizer = ZeroOptimizer(
            named_groups,
            optimizer,
            FlatLayout(
                named_groups,
                nvme.sub_group_bucket_numel(
                    config, self._num_shards(), self.bucket_sizes.reduce_numel
                ),
                self._num_shards(),
                unit_of,
                persistent_unit(units),
            ),
            self._reduce_settings(mpu, trains),
            comm,
            self.scaler,
            config.compute_dtype,
            groups,
        )
        self.gatherer = None
        self.frozen = None  # stage 3: FrozenShards, the partitioned frozen parameters
        if config.zero.stage == 3:
            frozen = self._frozen_named(named_groups)
            if frozen:
                self.frozen = FrozenShards(
                    frozen,
                    nvme.sub_group_bucket_numel(config, self._num_shards()),
                    groups.shard,
                    unit_of,
                    config.compute_dtype,
                    self._offload_param is not None,
                    self._offload_param is not None and self._offload_param.pin_memory,
                    param_swap=self.optimizer.param_swap,
                )
            self.gatherer = ParamGatherer(
                self.module,
                units,
                groups.shard,
                config.compute_dtype,
                accelerator.device,
                prefetch_numel=self.fetch.prefetch_numel,
                max_live_numel=self.fetch.max_live_numel,
                max_reuse_numel=self.fetch.max_reuse_numel,
            )
            self.gatherer.param_swap = self.optimizer.param_swap
            self.gatherer.secondary = groups.secondary
            self.gatherer.two_level = groups.two_level
            self.gatherer.attach(
                self.optimizer.buckets + (self.frozen.buckets if self.frozen else [])
            )
            for bucket in self.gatherer.buckets:
                for slot, param in zip(bucket.layout.slots, bucket.params):
                    # DeepSpeed's names for a partitioned parameter's full size, which scripts
                    # read (`p.ds_numel if hasattr(p, "ds_numel") else p.numel()`)
                    name_full_size(param, slot.shape)
            # Gradients get a process group of their own; an engine without an optimizer has none
            reduce_comm = groups.shard
            if self.optimizer.trains:
                reduce_comm = groups.shard.sibling("reduce-scatter", config.agreement_timeout)
            self.optimizer.attach_gatherer(self.gatherer, reduce_comm)
            if agreement is not None:
                self.gatherer.agreement = agreement
                agreement.describe = self.gatherer.describe
                agreement.hint = self.gatherer.hint
            self._state_dict_holds: list[list] = []
            for module in self.module.modules():
                # state_dict() of the model or of any submodule returns full tensors; torch
                # tags these hooks with attributes, which bound methods cannot take
                module.register_state_dict_pre_hook(
                    lambda *args: self._gather_for_state_dict(*args)
                )
                module.register_state_dict_post_hook(
                    lambda *args: self._release_after_state_dict(*args)
                )
                guard_load_state_dict(module)
        self._quantize_collectives()
        gathered.register(self.optimizer)
        # below stage 3 frozen parameters stay whole, outside the layout (Engine._check_params)
        self._whole_frozen = self._frozen_named(named_groups) if config.zero.stage < 3 else []
        self.phase = Phase.IDLE
        self._no_sync = False  # inside engine.no_sync()
        self._boundary = None  # set_gradient_accumulation_boundary's value; None: count
        self._step_optional = False  # the last backward needs no engine.step() before the next
        self._counted = True  # the last backward's micro-batch counts toward accumulation
        self._reduced = False  # the last backward reduced gradients
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self._step_applied = False
        # checkpoint.save_interval_* (checkpoint/periodic.py); None when not configured.
        from .checkpoint.periodic import PeriodicCheckpointer

        self.periodic = PeriodicCheckpointer.from_config(config)
        self._cast_rest(config.compute_dtype)
        # ----- observability (engine/monitor.py, planning/memory.py; docs/observability.md) -----
        # Construction traffic (broadcast of rank 0's weights, the stage-3 persistent unit's
        # first all-gather) is no step's.
        comm.ledger.end_step()
        self.monitor = StepMonitor(config, comm.rank, self.optimizer.layout.numel, self.device)
        logs = config.comms_logger
        if logs.enabled:
            comm.enable_timing(() if logs.prof_all else logs.prof_ops, logs.verbose)
        self.monitor.attach(comm)  # wall_clock_breakdown: reduce / all_gather from step 1
        # DeepSpeed's engine.tput_timer: started by each training forward, stopped by step();
        # zero's own step line reports samples/s, so the timer logs only when a script asks.
        self.tput_timer = ThroughputTimer(
            config.timers.throughput,
            batch_size=config.train_batch_size,
            steps_per_output=config.steps_per_print,
        )
        # ----- end observability -----

    # ----- construction -------------------------------------------------------------------
    def _fetch_units(self, trains: bool, state_bytes: int):
        """Stage 3: the fetch units (partition/stage3.py) and id(param) -> unit, sized by the
        fetch policy (self.fetch, [Note: memory-aware fetch policy] in
        planning/budget.py); else none. Collective at stage 3."""
        zero_cfg = self.config.zero
        self.fetch = None
        if zero_cfg.stage != 3:
            return [], None
        self.fetch = fetch_settings(
            self.module, self.config, self.comm, self.accelerator.device, trains, state_bytes
        )
        logger.info("zero.initialize: stage 3 fetch settings: %s", self.fetch.reason)
        return choose_units(
            self.module,
            self.fetch.unit_numel,
            _leaf_classes(zero_cfg),
            zero_cfg.stage3_param_persistence_threshold,
            zero_cfg.stage3_model_persistence_threshold,
        )

    def _bucket_sizes(self, trains: bool, state_bytes: int):
        """Stages 1-2: reduce and all-gather bucket sizes, from the memory a rank may use where
        the config leaves them unset ([Note: bucket sizes from memory] in planning/budget.py).
        Collective at stages 1-2 with an optimizer."""
        sizes = bucket_settings(
            self.module, self.config, self.comm, self.accelerator.device, trains, state_bytes
        )
        if self.config.zero.stage in (1, 2) and trains:
            logger.info("zero.initialize: bucket sizes: %s", sizes.reason)
        return sizes

    def _num_shards(self) -> int:
        return num_shards(self.config.zero, self.comm.world_size)

    def _quantize_collectives(self) -> None:
        """ZeRO++ qwZ and qgZ (partition/zeropp.py) from zero_optimization's
        zero_quantized_weights, zero_quantized_nontrainable_weights and
        zero_quantized_gradients, with zero.ops.quantize as the codec. Collective with qgZ
        (every rank makes its node's and its inter-node group)."""
        zero_cfg = self.config.zero
        weights = zero_cfg.zero_quantized_weights or zero_cfg.zero_quantized_nontrainable_weights
        if not (weights or zero_cfg.zero_quantized_gradients):
            return
        from zero.ops import quantize as codec

        if self.gatherer is not None:
            self.gatherer.quantized = zeropp.quantized_weights(zero_cfg, codec)
        if self.optimizer.trains:
            self.optimizer.quantized_reduce = zeropp.quantized_gradients(
                zero_cfg, self.optimizer.reduce_comm, codec, self.config.agreement_timeout
            )

    def _model_parallel_norm(self, mpu):
        """With tensor parallelism, the gradient norm counts each model-parallel slice and each
        replicated parameter once (zero.mpu, [Note: gradient norm with model parallelism])."""
        if mpu is None:
            return None
        from .model_parallel.mpu import ModelParallelNorm, model_parallel_comm
        from .model_parallel.tensor_parallel import partitioned_parameter_names

        mp_comm = model_parallel_comm(mpu)
        if mp_comm.world_size == 1:
            return None
        return ModelParallelNorm(mp_comm, partitioned_parameter_names(self.module))

    def _reduce_settings(self, mpu, trains: bool) -> ReduceSettings:
        comm_dtype = self.config.communication_data_type
        dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
        split = nvme.OptimizerOffload.from_config(self.config)  # nvme, or ratio < 1
        return ReduceSettings(
            stage=self.config.zero.stage,
            reduce_dtype=dtypes[comm_dtype] if comm_dtype else self.config.compute_dtype,
            allgather_numel=self.bucket_sizes.allgather_numel,
            clip=self.config.gradient_clipping,
            overflow_check=self.config.fp16.enabled
            or (self.config.bf16.enabled and self.config.bf16.check_grad_overflow),
            model_parallel=self._model_parallel_norm(mpu),
            offload=trains and self._offload_optimizer is not None and split is None,
            pin_memory=bool(self._offload_optimizer and self._offload_optimizer.pin_memory),
            split=split if trains else None,
            param_nvme=param_swap.ParamOffload.from_config(self.config),
            offload_param=self._offload_param is not None,
            pin_param=bool(self._offload_param and self._offload_param.pin_memory),
            accum_dtype=self.config.grad_accum_dtype,
            average_over_ranks=self.config.gradient_allreduce_op == "mean",
        )

    @property
    def _offload_optimizer(self):
        """The offload_optimizer block when it offloads to the CPU, else None."""
        return _on_cpu(self.config.zero.offload_optimizer)

    @property
    def _offload_param(self):
        """The offload_param block when it offloads parameter shards to the CPU, else None."""
        return _on_cpu(self.config.zero.offload_param)

    @property
    def inference_only(self) -> bool:
        """True for an engine built without an optimizer (ZeRO-Inference: forward, evaluation
        and generation; backward() and step() raise), see _optimizer_or_none."""
        return not self.optimizer.trains

    def _optimizer_or_none(self, optimizer, model_parameters, lr_scheduler):
        """(optimizer, lr_scheduler) the engine trains with: the client's or the config's; or,
        as DeepSpeed builds its inference engine whenever deepspeed.initialize gets no
        optimizer, (NoOptimizer, None) when there is none ([Note: ZeRO-Inference] in
        partition/stages.py): no optimizer= and no 'optimizer' block, or no parameter of the
        model requires grad (an optimizer= or block given then is not used and the log says
        so: DeepSpeed would build it over parameters that never change). Raises ValueError for
        an lr_scheduler= without any optimizer."""
        model = type(self.module).__name__
        trainable = any(p.requires_grad and full_numel(p) > 0 for p in self.module.parameters())
        if optimizer is None and self.config.optimizer is None:
            if lr_scheduler is not None:
                raise ValueError(
                    "zero.initialize got lr_scheduler= but no optimizer (no optimizer= and no "
                    "'optimizer' block in the config): a scheduler drives an optimizer's lr; "
                    "pass the optimizer too, or drop lr_scheduler= to build an engine for "
                    "forward and evaluation only"
                )
            reason = "zero.initialize got no optimizer= and the config has no 'optimizer' block"
            fix = "to train, give the config an 'optimizer' block or pass optimizer="
        elif not trainable:
            reason = f"no parameter of {model} requires grad"
            fix = "to train, set requires_grad=True on the parameters to train before initialize"
            # A warning for an optimizer the script built; a config block reused for a frozen
            # model (TRL's reference model) is the expected case.
            log = logger.warning if optimizer is not None else logger.info
            given = "optimizer=" if optimizer is not None else "the config's 'optimizer' block"
            unused = f"{given}{' (nor lr_scheduler=)' if lr_scheduler is not None else ''}"
            log("zero.initialize: %s, so %s is not used", reason, unused)
        else:
            return optimizer or self._config_optimizer(model_parameters), lr_scheduler
        self._log_without_optimizer(reason, model_parameters)
        return NoOptimizer(reason, fix, self.comm.rank), None

    def _log_without_optimizer(self, reason: str, model_parameters) -> None:
        """Say that the engine is built without an optimizer, and which settings that leaves
        without effect."""
        if model_parameters is not None:
            logger.warning("zero.initialize: model_parameters= is not used without an optimizer")
        blocks = (
            ("scheduler", self.config.scheduler),
            ("zero_optimization.offload_optimizer", self.config.zero.offload_optimizer),
        )
        unused = [key for key, block in blocks if block is not None]
        logger.info(
            "zero.initialize: no optimizer (%s): ZeRO-Inference engine at stage %d for forward, "
            "evaluation and generation, holding the parameters only (no gradients, fp32 master "
            "weights or optimizer state; backward() and step() raise)%s",
            reason,
            self.config.zero.stage,
            f"; without effect: {', '.join(unused)}" if unused else "",
        )

    def _config_optimizer(self, model_parameters):
        params = model_parameters
        if params is None:
            params = [p for p in self.module.parameters() if p.requires_grad]
        params = _check_groups_disjoint(params, self.module)
        spec = self.config.optimizer
        offload = self.config.zero.offload_optimizer
        if offload is not None and offload.device != "none":  # cpu or nvme: the host Adam
            cls, kwargs = resolve_optimizer(spec.type, spec.params)
            if cls in (torch.optim.Adam, torch.optim.AdamW):
                return _cpu_adam(params, cls, kwargs)
        return build_optimizer(spec.type, spec.params, params)

    def _named_groups(self, optimizer, client_optimizer: bool):
        """Per optimizer param group, the (name, param) pairs zero lays out and trains."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        seen, groups = set(), []
        for group in optimizer.param_groups:
            named = []
            for param in group["params"]:
                if id(param) not in names:
                    raise ValueError(
                        "the optimizer holds a tensor that is not a parameter of the model "
                        f"(shape {tuple(param.shape)}); build it over model.parameters()"
                    )
                if param.requires_grad and full_numel(param) > 0 and id(param) not in seen:
                    named.append((names[id(param)], param))
                    seen.add(id(param))
            groups.append(named)
        missing = [
            n
            for n, p in self.module.named_parameters()
            if p.requires_grad and full_numel(p) > 0 and id(p) not in seen
        ]
        if missing:
            source = (
                "the optimizer passed to zero.initialize"
                if client_optimizer
                else "model_parameters"
            )
            raise ValueError(
                f"parameters {missing[:5]} require grad but are in no param group of {source}; "
                "add them to a group or set requires_grad=False"
            )
        return groups

    def _frozen_named(self, named_groups) -> list:
        """(name, param) for every non-empty parameter no param group trains, each once."""
        trained = {id(p) for named in named_groups for _, p in named}
        seen, frozen = set(), []
        for name, param in self.module.named_parameters():
            if full_numel(param) and id(param) not in trained and id(param) not in seen:
                seen.add(id(param))
                frozen.append((name, param))
        return frozen

    def _materialize_frozen(self, named_groups) -> None:
        """Stages 0-2 keep frozen parameters whole: gather those that zero.Init partitioned.
        Collective."""
        for _, param in self._frozen_named(named_groups):
            if is_partitioned(param):
                param.data = take_full(param).to(param.device)

    def _build_scheduler(self, lr_scheduler, optimizer):
        if lr_scheduler is not None:
            return (
                lr_scheduler(optimizer)
                if callable(lr_scheduler) and not hasattr(lr_scheduler, "step")
                else lr_scheduler
            )
        if self.config.scheduler is None:
            return None
        return build_scheduler(self.config.scheduler.type, self.config.scheduler.params, optimizer)

    def _broadcast_module(self) -> None:
        """Start every rank from rank 0's parameters and buffers (full precision, before the
        flat buffers and fp32 master weights are built from them). Collective."""
        if self.comm.world_size > 1:
            for tensor in [*self.module.parameters(), *self.module.buffers()]:
                if not is_partitioned(tensor):  # zero.Init broadcast those when it built them
                    self.comm.broadcast(tensor.data, src=0)

    def _cast_rest(self, dtype: torch.dtype) -> None:
        """Cast what zero does not lay out (frozen or empty parameters, floating-point buffers) to
        the compute dtype, as DeepSpeed's module.half()/bfloat16() does."""
        for tensor in [*self.module.parameters(), *self.module.buffers()]:
            if tensor.is_floating_point() and tensor.dtype != dtype:
                tensor.data = tensor.data.to(dtype)

    # ----- training loop ------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        """Run the model. With fp16.auto_cast, floating-point tensor arguments are cast to fp16.

        Raises RuntimeError, before the model runs, when a parameter's tensor, dtype or
        requires_grad changed after zero.initialize ([Note: parameters changed behind the
        engine's back] in partition/shared.py), and for a training forward after a backward that
        raised, until engine.zero_grad() ([Note: a failed backward] in partition/stages.py)."""
        self._refuse_destroyed("forward")
        self._check_params()
        if self.config.fp16.enabled and self.config.fp16.auto_cast:
            args, kwargs = _cast_floats((args, kwargs), torch.float16)
        # an engine without an optimizer (ZeRO-Inference) has no backward to keep units for
        training = self.optimizer.trains and torch.is_grad_enabled() and self.module.training
        if training:
            self._refuse_failed("engine(...) (a training forward)")
        if self.phase is Phase.IDLE and training:
            self.phase = Phase.FORWARD
        if training:
            self.tput_timer.start()
        timer = self.monitor.timer("forward") if training else contextlib.nullcontext()
        if self.gatherer is None:
            with timer:
                return self.module(*args, **kwargs)
        if training:
            self.gatherer.release_kept()  # kept by a forward whose backward never came
        self.gatherer.keeping = training  # units may stay gathered for backward
        try:
            with timer, self.gatherer.saved_weights():
                output = self.module(*args, **kwargs)
        except RuntimeError as error:
            if "saved tensor hooks" not in str(error):
                raise
            raise RuntimeError(
                f"rank {self.comm.rank}: {error} Under ZeRO stage 3 engine(...) runs the model "
                "with saved-tensor hooks (they let a released unit's weights be freed until "
                "backward), so torch.func transforms cannot run inside the model's forward; run "
                "them outside engine(...) or use stage 0-2"
            ) from error
        finally:
            self.gatherer.keeping = False
        if not training:
            self.gatherer.release_all()  # no backward follows: release pinned units now
        return output

    def backward(
        self,
        loss: torch.Tensor,
        retain_graph: bool = False,
        scale_wrt_gas: bool = True,
        allreduce_gradients: bool = True,
        release_loss: bool = False,
    ) -> torch.Tensor:
        """Backpropagate loss * loss_scale / gradient_accumulation_steps and reduce gradients;
        DeepSpeed's engine.backward. scale_wrt_gas=False leaves out the division by
        gradient_accumulation_steps (the script scaled the loss itself). allreduce_gradients and
        release_loss are accepted for DeepSpeed's signature: zero always reduces at the
        boundary (use no_sync() to skip a reduction) and keeps no reference to the loss.

        Collective: every rank calls it once per micro-batch. Raises RuntimeError when called twice
        for one micro-batch without engine.step() in between, and on an engine built without an
        optimizer (ZeRO-Inference; DeepSpeed asserts "must provide optimizer during init in
        order to use backward"), naming why it has none; when a parameter changed behind the
        engine's back (as forward); torch's in-place modification error for a loss computed
        before the last engine.step() ([Note: stale graphs] in partition/stages.py). After a
        backward that raised, every training call raises until engine.zero_grad() drops the
        step's gradients ([Note: a failed backward] in partition/stages.py).
        """
        del allreduce_gradients, release_loss
        self._refuse_destroyed("backward")
        self._refuse_without_optimizer("engine.backward()")
        self._refuse_failed("engine.backward()")
        self._check_params()
        if self.phase is Phase.BACKWARD:
            if not self._step_optional:
                raise RuntimeError(
                    f"rank {self.comm.rank}: engine.backward() called twice for one micro-batch; "
                    "call engine.step() after each backward (sum the losses to backpropagate "
                    "several)"
                )
            self._end_micro_batch()
        self.phase = Phase.BACKWARD
        self._step_optional = self._no_sync or self._boundary is False
        self._counted = not self._no_sync  # DeepSpeed: no_sync's micro-batches do not count
        scale = self.scaler.scale
        if scale_wrt_gas:
            scale /= self.config.gradient_accumulation_steps
        self._reduced = self.is_gradient_accumulation_boundary() and not self._no_sync
        self.optimizer.start_backward(reduce=self._reduced)
        self.monitor.record_loss(loss)
        # Stage 3: a reentrant activation-checkpoint recomputation runs its forward inside this
        # backward; zero's saved-tensor hooks make it save gathered weights by reference too
        # ([Note: saved weights] in engine/partition/stage3.py).
        saved = self.gatherer.saved_weights() if self.gatherer else contextlib.nullcontext()
        with self.monitor.timer("backward"), saved:
            try:
                (loss * scale).backward(retain_graph=retain_graph)
                self.optimizer.finish_backward()
            except BaseException as error:
                explained = _stale_graph_error(error, self.comm.rank)
                # no collectives: ranks may be elsewhere; zero_grad() recovers
                self.optimizer.abandon_backward(explained or error)
                self.phase, self._step_optional = Phase.IDLE, False
                if explained is not None:
                    raise explained from error
                raise
        return loss

    def step(self, lr_kwargs: dict | None = None) -> None:
        """Finish a micro-batch; at the accumulation boundary update parameters (collective).

        At the boundary: unscale, check overflow (fp16, bf16), clip to gradient_clipping, step the
        optimizer on the owned shards, all-gather parameters, step the lr scheduler (not on a
        skipped step) with `lr_kwargs` as its keyword arguments (DeepSpeed's, e.g. Megatron's
        {"increment": n}), and broadcast rank 0's floating-point buffers. Raises RuntimeError on
        an engine built without an optimizer (ZeRO-Inference), as backward() does.
        """
        self._refuse_destroyed("step")
        self._refuse_without_optimizer("engine.step()")
        self._refuse_failed("engine.step()")
        if self._no_sync:
            raise RuntimeError(
                f"rank {self.comm.rank}: engine.step() inside engine.no_sync(); leave the "
                "context first (its gradients are reduced by the first backward after it)"
            )
        if self.phase is not Phase.BACKWARD:
            raise RuntimeError(
                f"rank {self.comm.rank}: engine.step() called without engine.backward() for this "
                "micro-batch"
            )
        boundary = self.is_gradient_accumulation_boundary()
        if boundary and not self._reduced and self.config.zero.stage < 2:
            raise RuntimeError(
                f"rank {self.comm.rank}: engine.step() at a gradient accumulation boundary, but "
                "the last backward did not reduce gradients (it ran inside engine.no_sync() or "
                "before set_gradient_accumulation_boundary(True)); run the last micro-batch's "
                "forward and backward outside no_sync, after setting the boundary"
            )
        self._step_applied = False
        if boundary:
            self._check_no_unmanaged_gradients()
            with self.monitor.timer("step"):
                self._step_applied = self.optimizer.step()
            if self._step_applied:
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step(**(lr_kwargs or {}))
            else:
                self.skipped_steps += 1
            self._sync_buffers()
            self.global_steps += 1
            self.global_samples += self.config.train_batch_size
            self.comm.ledger.end_step()
            self.monitor.on_step(self)
        self.tput_timer.stop(global_step=boundary, report_speed=False)
        self._end_micro_batch()
        if boundary and self.periodic is not None:
            # once the micro-batch is counted: the checkpoint records the boundary it is at
            self.periodic.after_step(self)

    def _end_micro_batch(self) -> None:
        if self._counted:
            self.micro_steps += 1
        self._step_optional = False
        self.phase = Phase.IDLE

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally, without reducing them, for the backwards inside;
        DeepSpeed's engine.no_sync (DDP's meaning: the first backward after the context reduces
        the sum). Only stages 0 and 1, whose ranks keep full gradients: stages 2 and 3 reduce
        every micro-batch to partition them, so there it raises RuntimeError (as DeepSpeed).
        Inside: engine.step() raises, and micro-batches are not counted toward
        gradient_accumulation_steps; each backward ends its micro-batch without a step. Not a
        collective; every rank must use it around the same micro-batches."""
        self._refuse_destroyed("no_sync")
        stage = self.config.zero.stage
        if stage >= 2:
            raise RuntimeError(
                f"engine.no_sync() cannot run under ZeRO stage {stage}: it partitions gradients "
                "by reducing them in every backward; use gradient_accumulation_steps (or "
                "set_gradient_accumulation_boundary), or stage 0 or 1"
            )
        if self._no_sync:
            raise RuntimeError("engine.no_sync() contexts do not nest")
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Say whether the next micro-batches end a gradient accumulation, overriding the
        count of gradient_accumulation_steps; DeepSpeed's method of this name. With False, each
        backward ends its micro-batch without engine.step(); set True before the last
        micro-batch's forward, then backward and step() apply the update; None returns to the
        count. The loss is still divided by gradient_accumulation_steps from the config. Every
        rank must set the same values (the reduction at the boundary is collective). Raises
        TypeError for anything but True, False or None."""
        if is_boundary is not None and not isinstance(is_boundary, bool):
            raise TypeError(
                "set_gradient_accumulation_boundary takes True, False or None (back to counting "
                f"gradient_accumulation_steps), not {is_boundary!r}"
            )
        self._boundary = is_boundary

    def allreduce_gradients(self, bucket_size: int = 500_000_000) -> None:
        """DeepSpeed's engine.allreduce_gradients(bucket_size): reduce the micro-batch's gradients
        over the data-parallel ranks. zero reduces them inside engine.backward() (stages 2-3
        every micro-batch, stages 0-1 at the accumulation boundary; [Note: gradient lifetime]
        in partition/stages.py), so after a backward there is nothing left to reduce and this
        returns without communicating: a DeepSpeed script that calls it after backward trains
        as it did there, and no gradient is reduced twice. `bucket_size` (elements, DeepSpeed's
        default 5e8) must be a positive int; zero's buckets follow
        zero_optimization.reduce_bucket_size instead.

        Not a collective in zero. Raises RuntimeError without a backward for the current
        micro-batch (there is no gradient to reduce), inside engine.no_sync() (the first
        backward after the context reduces the accumulated gradients), and after destroy();
        TypeError / ValueError for a bucket_size that is not a positive int."""
        self._refuse_destroyed("allreduce_gradients")
        self._refuse_without_optimizer("engine.allreduce_gradients()")
        if isinstance(bucket_size, bool) or not isinstance(bucket_size, int):
            raise TypeError(f"allreduce_gradients: bucket_size={bucket_size!r} is not an int")
        if bucket_size <= 0:
            raise ValueError(
                f"allreduce_gradients: bucket_size={bucket_size} must be a positive number of "
                "elements"
            )
        if self._no_sync:
            raise RuntimeError(
                f"rank {self.comm.rank}: engine.allreduce_gradients() inside engine.no_sync(); "
                "zero reduces the gradients accumulated there in the first backward after the "
                "context: leave the context instead"
            )
        if self.phase is not Phase.BACKWARD:
            raise RuntimeError(
                f"rank {self.comm.rank}: engine.allreduce_gradients() called without "
                "engine.backward() for this micro-batch; call it after backward (where zero "
                "has already reduced the gradients), or drop the call"
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """DeepSpeed's engine.zero_grad(): clear the .grad of the model's parameters. Under zero
        they hold none (gradients go into zero's buckets during backward, [Note: gradient
        lifetime] in partition/stages.py), so this never drops gradients accumulated over the
        micro-batches of a step; zero clears those itself after the optimizer step. Not a
        collective, except after an engine.backward() that raised: then it drops every gradient
        of the optimizer step (the micro-batches before the failed one too, as torch's
        zero_grad() would) and training may go on with the next forward; every rank must call
        it, and every rank raises RankMismatchError when the ranks' failed backwards launched
        different reductions ([Note: a failed backward] in partition/stages.py)."""
        super().zero_grad(set_to_none=set_to_none)
        if not self._destroyed:
            self.optimizer.zero_grad(set_to_none)

    def _check_no_unmanaged_gradients(self) -> None:
        """A parameter with a .grad at the step is one zero does not manage (its hook would have
        taken the gradient): added to the module after initialize. Stage 3 refuses it earlier,
        at its first use in engine(...)."""
        for param in self.module.parameters():
            if param.grad is not None and param.numel() > 0:
                raise unmanaged_parameter(self.comm.rank, param, self.module)

    def _check_params(self) -> None:
        """RuntimeError naming a parameter whose tensor, dtype or requires_grad changed after
        zero.initialize ([Note: parameters changed behind the engine's back] in
        partition/shared.py): the laid-out ones (ZeroOptimizer.check_params) and, below stage
        3, the frozen ones kept whole, which must stay frozen. Not a collective."""
        self.optimizer.check_params()
        if not self.optimizer.trains:
            return  # nothing trains: requires_grad changes nothing
        for name, param in self._whole_frozen:
            if param.requires_grad:
                dtype = self.config.compute_dtype
                raise changed_parameter(self.comm.rank, name, param, dtype, False, True)

    def _refuse_failed(self, method: str) -> None:
        """RuntimeError for a training call after an engine.backward() that raised, until
        zero_grad() drops the step's gradients ([Note: a failed backward])."""
        failed = self.optimizer.failed_backward
        if failed is not None:
            raise RuntimeError(
                f"rank {self.comm.rank}: {method} after an engine.backward() that raised "
                f"({failed}): that backward left this optimizer step's gradients incomplete "
                "(some may already be reduced across ranks), so zero cannot step on them. Call "
                "engine.zero_grad() on every rank to drop them (the micro-batches of this step "
                "before the failed one too), then run forward and backward again"
            )

    def _sync_buffers(self) -> None:
        """Give every rank rank 0's floating-point buffers (BatchNorm running statistics, which
        each rank updates from its own micro-batches), as DDP's broadcast_buffers does: one
        broadcast per dtype. Collective."""
        if self.comm.world_size == 1:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for buffer in self.module.buffers():
            if buffer.is_floating_point() and buffer.numel():
                by_dtype.setdefault(buffer.dtype, []).append(buffer)
        for buffers in by_dtype.values():
            flat = torch.cat([b.reshape(-1) for b in buffers])
            self.comm.broadcast(flat, src=0)
            offset = 0
            for buffer in buffers:
                buffer.copy_(flat[offset : offset + buffer.numel()].view_as(buffer))
                offset += buffer.numel()

    # ----- full weights (stage 3 gathers them) ------------------------------------------
    def _gather_for_state_dict(self, module, prefix, keep_vars) -> None:
        """Stage 3: state_dict() of the model or a submodule holds the units of its parameters
        gathered while it runs, so it returns full tensors (a submodule's call inside its
        parent's finds them gathered). Collective (every rank must call it, as for
        DeepSpeed's save_16bit_model) unless they are gathered already, or inside an open
        zero.GatheredParameters, where one rank may call it alone: it gathers nothing there
        and the parameters that context does not hold appear as 0-element placeholders
        (ParamGatherer.state_dict_units)."""
        if self._listing_state:
            return
        units, gathers = self.gatherer.state_dict_units(module.parameters())
        if gathers:
            if not self.config.zero.stage3_gather_16bit_weights_on_model_save:
                raise RuntimeError(
                    f"rank {self.comm.rank}: under ZeRO stage 3 the module's parameters are "
                    "partitioned; set zero_optimization.stage3_gather_16bit_weights_on_model_save "
                    "to true to gather them for state_dict(), call it inside "
                    "zero.GatheredParameters(model.parameters()), or use zero-to-fp32 on a "
                    "checkpoint"
                )
            self._enter("state_dict() (stage 3)")
        self.gatherer.hold(units)
        self._state_dict_holds.append(units)

    def _release_after_state_dict(self, module, state_dict, prefix, local_metadata) -> None:
        # The returned tensors keep the gathered storage alive; the module goes back to shards
        # (units held by an enclosing zero.GatheredParameters stay gathered).
        if not self._listing_state:
            self.gatherer.unhold(self._state_dict_holds.pop())

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """zero_optimization.stage3_gather_16bit_weights_on_model_save; DeepSpeed's method of
        this name (accelerate asks it before _zero3_consolidated_16bit_state_dict)."""
        return self.config.zero.stage3_gather_16bit_weights_on_model_save

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """The model's full state dict on rank 0, as DeepSpeed's method of this name returns it:
        an OrderedDict of every module.state_dict() key (tied names sharing one tensor) to a
        detached CPU tensor, parameters in the compute dtype (fp32/bf16/fp16: what forward
        uses, not the fp32 master weights), buffers as the model holds them; None on every
        other rank. exclude_frozen_parameters=True leaves out the parameters with
        requires_grad=False (the Hugging Face Trainer passes it for peft models at stage 3).

        Stage 3 streams it tensor by tensor ([Note: streamed 16-bit state dict] in
        checkpoint/full_state.py): no rank's device holds the model, rank 0's host holds it
        once. It does not read stage3_gather_16bit_weights_on_model_save (DeepSpeed's does not
        either: accelerate checks zero_gather_16bit_weights_on_model_save() first). DeepSpeed
        raises ValueError below stage 3; zero returns the same state dict at every stage.

        Collective at stage 3: every rank must call it, with the same
        exclude_frozen_parameters (RankMismatchError otherwise); below stage 3 it communicates
        nothing. Raises RuntimeError after destroy()."""
        from .checkpoint.full_state import full_state_dict

        self._refuse_destroyed("_zero3_consolidated_16bit_state_dict")
        exclude = bool(exclude_frozen_parameters)
        if self.gatherer is not None:  # the stage-3 state dict, gathered: ranks must agree
            self._enter("state_dict() (stage 3)", int(exclude))
        self._listing_state = True  # keys and tensors, not gathered values
        try:
            entries = self.module.state_dict(keep_vars=True)
        finally:
            self._listing_state = False
        return full_state_dict(self, entries, exclude)

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """DeepSpeed's name for the same state dict (it also covers AutoTP, which zero refuses):
        _zero3_consolidated_16bit_state_dict. Collective."""
        return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)

    def empty_partition_cache(self) -> None:
        """DeepSpeed's engine.empty_partition_cache(): at stage 3, release every gathered unit
        that is neither persistent nor held (by zero.GatheredParameters or a state_dict() under
        way), e.g. after generation with engine.module, then give cached device memory back
        (gc.collect, torch.cuda.empty_cache). Between engine(...) and engine.backward() the
        units kept for backward are released too (backward all-gathers them again) and those
        pinned until the end of backward stay. Stages 0-2 gather nothing: no-op.

        Not a collective: releasing frees this rank's buffers (after waiting for a prefetch in
        flight)."""
        if self.gatherer is None or self._destroyed:
            return
        force = self.phase is Phase.IDLE  # no backward is waiting for a pinned unit
        for unit in self.gatherer.units:
            if unit.state is not UnitState.SHARDED:
                self.gatherer.release(unit, force=force)
        gc.collect()
        if self.accelerator.is_cuda:
            torch.cuda.empty_cache()

    def _enter(self, method: str, arguments: int = 0) -> None:
        """Check that every rank calls collective method `method` with equal `arguments` (a
        hash; comm.Agreement.enter)."""
        if self.comm.agreement is not None:
            self.comm.agreement.enter(method, arguments)

    def save_16bit_model(self, save_dir, save_filename: str = "model.safetensors") -> str | None:
        """Write the full model in the compute dtype (fp32/bf16/fp16) as one safetensors file
        from rank 0, every state_dict key included (tied parameters as equal copies).

        Collective: every rank must call it (stage 3 gathers the parameters). Raises
        RuntimeError under stage 3 when stage3_gather_16bit_weights_on_model_save is false.
        Returns the path on rank 0, None elsewhere.
        """
        from safetensors.torch import save_file

        self._refuse_destroyed("save_16bit_model")
        self._enter("save_16bit_model")
        state = self.module.state_dict()
        if self.comm.rank != 0:
            return None
        os.makedirs(save_dir, exist_ok=True)
        # safetensors refuses tensors sharing storage: every name gets its own copy.
        tensors = {name: t.detach().cpu().clone() for name, t in state.items()}
        path = os.path.join(save_dir, save_filename)
        save_file(tensors, path)
        return path

    def save_pretrained(self, save_dir, max_shard_size="5GB", dtype=None) -> str:
        """Write the model in Hugging Face's layout: config.json (from model.config, when the
        model has one) and model.safetensors, or model-0000i-of-0000n.safetensors shards of at
        most max_shard_size each (bytes, or a string such as "5GB" = 5e9 bytes) with
        model.safetensors.index.json; AutoModel*.from_pretrained(save_dir) and
        zero.load_pretrained read it back.

        Values are the fp32 master weights (what training produced), cast to `dtype` when given
        (torch.float32, torch.bfloat16, torch.float16 or "fp32"/"bf16"/"fp16"); frozen
        parameters and floating-point buffers are cast likewise. A tied parameter is saved once,
        under its first name (transformers drops lm_head.weight and ties it again on load).
        At any stage; each tensor is assembled on rank 0 from the ranks' shards and written
        before the next, so rank 0 holds one tensor beyond its training state, never a bucket
        nor the model (checkpoint/hf.py, [Note: export]). Atomic: rank 0 writes
        `save_dir.tmp` and renames it to save_dir; other files already in save_dir (a tokenizer)
        are kept, earlier weights replaced.

        Collective: every rank must call it. Returns save_dir on every rank. Raises ValueError
        for a bad max_shard_size or dtype, NotImplementedError with tensor parallelism; a write
        error on rank 0 is raised there and as CheckpointError on the other ranks.
        """
        from .checkpoint import hf

        self._refuse_destroyed("save_pretrained")
        return hf.save_pretrained(self, save_dir, max_shard_size, dtype)

    # ----- checkpoints (engine/checkpoint/) --------------------------------------------
    def save_checkpoint(
        self,
        save_dir,
        tag=None,
        client_state=None,
        save_latest=True,
        exclude_frozen_parameters=False,
    ) -> str:
        """Write a sharded checkpoint to save_dir/tag (default tag: global_step{N}); DeepSpeed's
        signature.

        Collective: every rank must call it, with the same exclude_frozen_parameters. Each rank
        writes only the fp32 master weights and optimizer state it owns (safetensors); rank 0
        adds meta.json and the unpartitioned tensors. exclude_frozen_parameters=True leaves the
        frozen parameters (requires_grad=False; a peft model's base weights) out and records
        their names in meta.json; loading the checkpoint keeps the model's own values for them
        ([Note: frozen parameters left out] in checkpoint/format.py). The write is atomic:
        `latest` names the new tag only once every file is complete. Each rank also saves its
        random number generators (torch CPU and device, Python, NumPy) and the state of
        engine.training_dataloader when it has state_dict(). Raises CheckpointError (a
        ValueError) on every rank, before anything is written, when client_state is not
        JSON-serializable, and between the micro-batches of a gradient accumulation cycle
        (the accumulated gradients are not saved: save after engine.step() at the boundary);
        RuntimeError after destroy(). Returns the checkpoint directory.
        """
        from . import checkpoint

        self._refuse_destroyed("save_checkpoint")
        exclude = bool(exclude_frozen_parameters)
        shards = self.frozen.buckets if self.frozen is not None else []
        if exclude and any(p.requires_grad for b in shards for p in b.params):
            # Only an engine without an optimizer partitions parameters that require grad
            # outside its optimizer; checkpoint/writer.py gathers these only when it leaves
            # none of them out.
            raise NotImplementedError(
                f"rank {self.comm.rank}: save_checkpoint(exclude_frozen_parameters=True) on a "
                "stage-3 engine built without an optimizer whose parameters require grad; save "
                "without exclude_frozen_parameters (every parameter is then written)"
            )
        self._enter("save_checkpoint", int(exclude))
        self._finish_periodic_save()
        return checkpoint.save(
            self, os.fspath(save_dir), tag, client_state or {}, save_latest, exclude
        )

    def load_checkpoint(
        self,
        load_dir,
        tag=None,
        load_module_strict=True,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
        load_module_only=False,
    ):
        """Load save_dir/tag (default: the tag in `latest`), saved on any world size and stage.

        Collective: every rank must call it; each rank reads only the ranges it owns now.
        Returns (checkpoint directory, client_state). Without `tag`, a load_dir that holds no
        `latest` file (nothing saved yet: a first run of an auto-resuming script) loads nothing
        and returns (None, None) with a warning, as DeepSpeed does; every rank must see the same
        (RankMismatchError otherwise). Raises CheckpointError naming the file and the key for a
        missing or truncated file or a model that does not fit, before any state is modified;
        also for a checkpoint saved without an lr scheduler loaded into an engine with one
        (unless load_lr_scheduler_states=False: the scheduler then keeps its position and the
        lr it set) and for a DeepSpeed checkpoint (the message gives the migration path);
        also between the micro-batches of a gradient accumulation cycle, for a checkpoint an
        older zero saved mid-cycle, and when a save of the same tag replaced it during the load
        (load again). Without load_module_only each rank's generators and data loader resume
        as that rank saved them (docs/checkpoints.md, "Random number generators").

        An engine built without an optimizer (ZeRO-Inference) loads the weights alone, from a
        training checkpoint or its own, whatever load_optimizer_states says (it has no optimizer
        state; DeepSpeed's inference engine loads the weights with load_module_only=True or
        load_optimizer_states=False): see checkpoint/weights.py. Without load_module_only the
        step counters load too.
        """
        from . import checkpoint

        self._refuse_destroyed("load_checkpoint")
        self._finish_periodic_save()
        load_dir = os.fspath(load_dir)
        nothing = tag is None and not os.path.lexists(os.path.join(load_dir, checkpoint.LATEST))
        self._enter("load_checkpoint", int(nothing))
        if nothing:
            deepspeed = checkpoint.deepspeed_checkpoint_files(load_dir)
            logger.warning(
                "load_checkpoint: %s has no '%s' file: nothing was loaded (pass tag= to load a "
                "checkpoint by name)%s",
                load_dir,
                checkpoint.LATEST,
                "; it holds a DeepSpeed checkpoint: "
                + checkpoint.deepspeed_checkpoint_message(load_dir, deepspeed)
                if deepspeed
                else "",
            )
            return None, None
        if not self.optimizer.trains:
            weights_only = (load_dir, tag, load_module_strict, load_module_only)
            return checkpoint.load_weights(self, *weights_only)
        return checkpoint.load(
            self,
            load_dir,
            tag,
            load_module_strict,
            load_optimizer_states,
            load_lr_scheduler_states,
            load_module_only,
        )

    def resume_latest(self, load_dir):
        """Resume from the checkpoint `latest` names in load_dir, saved at any world size, with
        the same global batch (train_batch_size; gradient_accumulation_steps adapts); nothing
        to load (a first run) returns (None, None). What checkpoint.auto_resume does in
        zero.initialize. Collective: every rank must call it. Raises ValueError naming both
        sizes when train_batch_size differs from the checkpoint's, and what load_checkpoint
        raises. See checkpoint/periodic.py resume_latest and docs/checkpoints.md."""
        from .checkpoint.periodic import resume_latest

        self._refuse_destroyed("resume_latest")
        return resume_latest(self, os.fspath(load_dir))

    def _finish_periodic_save(self) -> None:
        # A background periodic save must be published before another save or a load reads
        # or moves `latest` (checkpoint/periodic.py).
        periodic = getattr(self, "periodic", None)  # close() of a half-built engine
        if periodic is not None:
            periodic.wait()

    def close(self) -> None:
        """Detach the engine from the model and release what it holds; DeepSpeed's destroy()
        is the same call. Not a collective; idempotent.

        - removes every hook zero added to the model and its parameters (forward, state_dict
          and gradient hooks) and, at stage 3, to the graphs of forwards whose backward never
          came, so neither the model nor a loss the script keeps refers to the engine, which
          is freed once the script drops it; at stage 3 the load_state_dict guard stays (see
          below);
        - unregisters the parameters, so zero.utils and zero.GatheredParameters never read
          the closed engine's shards;
        - stage 3: releases every gathered unit but the persistent one (and units a
          zero.GatheredParameters still holds);
        - drops gradients accumulated for a step that has not come;
        - removes nvme offload's swap files (garbage collection of the engine and interpreter
          exit do that too) and closes the monitors' files.

        Afterwards forward, backward, step, no_sync, allreduce_gradients, the checkpoint and
        save methods raise RuntimeError; the fp32 master weights and optimizer state are freed
        with the engine and the optimizer zero.initialize returned. Stages 0-2: engine.module
        keeps its current weights (compute dtype) and works as a plain module. Stage 3: its
        parameters stay partitioned (0-element placeholders; their values lived in the
        engine's shards), so save what you need first (save_checkpoint, save_16bit_model,
        _zero3_consolidated_16bit_state_dict); calling the module afterwards raises
        RuntimeError, as does zero.initialize on it."""
        if self._destroyed:
            return
        try:
            self._finish_periodic_save()
        except Exception as error:  # close() does not raise; the previous checkpoint stands
            logger.error("rank %d: %s", self.comm.rank, error)
        self._destroyed = True
        if self._compiled is not None:
            self._compiled.restore()  # the model's own forward again
        keep = ("_load_state_dict_pre_hooks",) if self.gatherer is not None else ()
        for owner, table, key in self._added_hooks:
            if table not in keep:
                getattr(owner, table).pop(key, None)
        if self.gatherer is not None:
            self.gatherer.release_all()
            self.gatherer.close()  # and the hooks on graphs a script may keep (its last loss)
            self.module.register_forward_pre_hook(_refuse_released_forward)
        self.optimizer.clear_gradients()
        self.optimizer.close()
        gathered.unregister(self.optimizer)
        self.monitor.close()

    def destroy(self) -> None:
        """DeepSpeed's engine.destroy(): see close(), which it calls. Not a collective."""
        self.close()

    def compile(
        self,
        backend="inductor",
        compile_kwargs: dict | None = None,
        schedule=None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """torch.compile the model's forward; DeepSpeed's engine.compile (accelerate's dynamo
        plugin calls it). Stages 0-2 compile the whole forward; stage 3 compiles each block's
        forward (a fetch unit holding its own parameters), so gathers and releases run eagerly
        between compiled blocks ([Note: what is compiled] in compiler.py). `backend` (a name or a
        callable) and `compile_kwargs` (mode, fullgraph, dynamic, options) go to torch.compile;
        tracing happens at the next forward. Idempotent: a second call does nothing
        (is_compiled). The config's `compile` block is read (deepcompile selects this same
        compile). Not a collective, but every rank should compile alike (each compiles its own
        graphs in its first forward).

        Raises NotImplementedError for `schedule` (DeepCompile's passes) and for
        compiled_autograd_enabled=True, TypeError for a compile_kwargs key torch.compile does
        not take, RuntimeError after destroy()."""
        self._refuse_destroyed("compile")
        if self._compiled is not None:
            return
        self._compiled = compile_model(
            self.module,
            self.gatherer,
            self.config,
            backend,
            compile_kwargs,
            schedule,
            compiled_autograd_enabled,
            self.comm.rank,
        )

    @property
    def is_compiled(self) -> bool:
        """Whether engine.compile() ran (DeepSpeed's engine.is_compiled)."""
        return self._compiled is not None

    def _refuse_without_optimizer(self, method: str) -> None:
        """RuntimeError naming why a ZeRO-Inference engine has no optimizer, before any
        collective (every rank raises alike)."""
        if not self.optimizer.trains:
            raise self.optimizer.optimizer.refusal(method)

    def _refuse_destroyed(self, method: str) -> None:
        if self._destroyed:
            raise RuntimeError(
                f"rank {self.comm.rank}: engine.{method}() after engine.destroy() (or close()), "
                "which detached the engine from its model and released its buffers; build a "
                "new engine with zero.initialize"
            )

    def generate(self, *args, **kwargs):
        """The model's generate() (Hugging Face's GenerationMixin.generate, peft's, or the
        model's own), called with the same arguments; DeepSpeed's engine reaches it through
        __getattr__. At stage 3 with a data-parallel world size above 1 it passes
        synced_gpus=True unless the caller passed synced_gpus (and the model's generate() takes
        it): every step all-gathers the parameters, so a rank whose sequences finish first must
        keep stepping until every rank has (transformers turns this on by itself only under
        DeepSpeed's HfDeepSpeedConfig). Each rank may pass its own prompts, of its own lengths.
        The module's training mode is left as it is (call engine.eval() first for dropout-free
        generation, as with DeepSpeed).

        Returns what the model's generate() returns (transformers: int64 token ids of shape
        (batch, prompt + generated length), or its ModelOutput). Collective at stage 3 with
        world size > 1: every rank calls it. Raises AttributeError when the model has no
        generate(), RuntimeError after destroy(), and ValueError when synced_gpus=False is
        passed at stage 3 with world size > 1 and the parameters must be all-gathered
        ([Note: generation] in partition/stage3.py)."""
        import inspect

        self._refuse_destroyed("generate")
        generate = getattr(self.module, "generate", None)
        if generate is None:
            raise AttributeError(
                f"'{type(self).__name__}' object has no attribute 'generate', nor has its model "
                f"({type(self.module).__name__})"
            )
        if self.gatherer is not None and self.comm.world_size > 1 and "synced_gpus" not in kwargs:
            try:
                params = inspect.signature(generate).parameters.values()
            except (TypeError, ValueError):  # not introspectable: assume transformers' keywords
                params = [inspect.Parameter("synced_gpus", inspect.Parameter.KEYWORD_ONLY)]
            if any(p.name == "synced_gpus" or p.kind is p.VAR_KEYWORD for p in params):
                kwargs["synced_gpus"] = True
        return generate(*args, **kwargs)

    def __getattr__(self, name: str):
        """DeepSpeed's fallthrough (DeepSpeedEngine.__getattr__): a name that neither the
        engine nor nn.Module's own lookup (parameters, buffers, submodules such as
        engine.module) finds is looked up on the wrapped model, so
        engine.gradient_checkpointing_enable() or engine.generate(...) reach it. The engine's
        own attributes win (engine.config is zero's Config, not the model's config); names the
        engine's class defines (a property that raised AttributeError) and dunder names never
        fall through. Raises AttributeError when the model lacks the name too."""
        try:
            return super().__getattr__(name)
        except AttributeError as error:
            missing = error
        modules = self.__dict__.get("_modules")  # absent early in __init__: no recursion
        module = modules.get("module") if modules is not None else None
        dunder = name.startswith("__") and name.endswith("__")
        if module is None or dunder or hasattr(type(self), name):
            raise missing
        try:
            return getattr(module, name)
        except AttributeError:
            raise AttributeError(
                f"'{type(self).__name__}' object has no attribute '{name}', nor has its model "
                f"({type(module).__name__})"
            ) from None

    # ----- DeepSpeed-compatible queries ---------------------------------------------------
    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the current micro-batch ends a gradient accumulation: the value given to
        set_gradient_accumulation_boundary, else every gradient_accumulation_steps-th."""
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def was_step_applied(self) -> bool:
        return self._step_applied

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """Global L2 gradient norm of the last optimizer step, before clipping (all ranks equal)."""
        norm = self.optimizer.global_grad_norm
        return None if norm is None else float(norm)

    # DeepSpeed's accessors that training scripts call; each reads the config or the comm.
    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        return self.config.zero.stage

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    @property
    def global_rank(self) -> int:
        """Rank in the whole job (torch.distributed's rank; 0 without a process group)."""
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def comm_stats(self) -> dict:
        """Collective traffic of the last optimizer step on this rank: op -> {calls, elements,
        bytes, intra_elements, intra_bytes, inter_elements, inter_bytes}; elements in the paper's
        units (an all-reduce counts twice its size), split into what stays on this rank's node
        and what crosses nodes ([Note: intra- and inter-node volume] in comm/topology.py)."""
        stats = {}
        for op, t in self.comm.ledger.last_step.items():
            intra = {"intra_elements": t.intra_elements, "intra_bytes": t.intra_bytes}
            stats[op] = {**vars(t), **intra}
        if self.comm.timing is None:  # seconds only when comms_logger times collectives
            for totals in stats.values():
                totals.pop("seconds")
        return stats

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds in memory per model-state kind: {"params", "frozen_params",
        "grads", "master", "optimizer_state"}: the trained parameters, the parameters no
        optimizer trains (all of them in an engine built without an optimizer: stage 3 its
        shards, stages 0-2 whole tensors), gradients in data_types.grad_accum_dtype, fp32
        masters, optimizer state; what nvme offload keeps in files counts 0 here, see
        engine.optimizer.nvme_bytes(). With hpZ (zero_hpz_partition_size > 1) also
        "secondary_params": the secondary parameter shards ([Note: hpZ] in
        partition/hierarchy.py), made by the first forward. Not a collective."""
        from .planning.memory import frozen_param_bytes

        held = self.optimizer.model_state_bytes()
        out = {"params": held["params"], "frozen_params": frozen_param_bytes(self), **held}
        if self.gatherer is not None and self.gatherer.secondary is not None:
            out["secondary_params"] = self.gatherer.secondary_bytes()
        return out

    def memory_report(self) -> dict:
        """Bytes this rank holds per model-state category, measured from zero's tensors, next
        to the formula for the configured stage (planning/memory.py). Not a collective; optimizer
        state exists only after the first optimizer step."""
        from .planning.memory import memory_report

        return memory_report(self)


def _check_one_source(config, optimizer, lr_scheduler) -> None:
    """An optimizer (or scheduler) passed to zero.initialize wins over the config's block, as in
    DeepSpeed; say so once (warning) when the block asks for something else, rather than
    ignoring it silently. A block whose type and params match the client optimizer (Hugging
    Face's "auto" filled from it) is not mentioned."""
    if lr_scheduler is not None and config.scheduler is not None:
        logger.warning(
            "zero.initialize got lr_scheduler=, so the config's 'scheduler' block (%s) is "
            "ignored; remove one of them",
            config.scheduler.type,
        )
    if optimizer is None or config.optimizer is None:
        return
    cls, kwargs = resolve_optimizer(config.optimizer.type, config.optimizer.params)
    group = optimizer.param_groups[0]

    def plain(value):
        return list(value) if isinstance(value, (tuple, list)) else value

    differing = [k for k, v in kwargs.items() if k in group and plain(group[k]) != plain(v)]
    if not isinstance(optimizer, cls) or differing:
        what = f"params {differing}" if differing else f"type {config.optimizer.type}"
        logger.warning(
            "zero.initialize got optimizer= (%s), so the config's 'optimizer' block, whose %s "
            "differ from it, is ignored; remove the block (or pass no optimizer=)",
            type(optimizer).__name__,
            what,
        )


class ModelSnapshot:
    """What Engine construction changes on a model, to put back when construction fails: every
    module's and parameter's hook tables (zero adds forward, state_dict and gradient hooks), the
    tensor each parameter holds (zero rebinds parameters to its flat buffers or, at stage 3,
    releases them) and its attributes. Tensors are referenced, not copied.

    A zero.Init parameter's slice is not kept: holding it while the engine lays the parameter out
    would double each rank's share of the model during initialize (the memory a model that does
    not fit cannot spare). Everything that can be refused is checked before construction starts
    (config, optimizer, scheduler); should the layout itself fail for such a model, restore()
    says the model must be built again."""

    def __init__(self, model: torch.nn.Module):
        self.modules = [(m, _hook_tables(m)) for m in model.modules()]
        named = list(model.named_parameters())
        self.hooks = [(p, _hook_tables(p)) for _, p in named]
        self.params = [
            (p, p.data, p.grad, dict(vars(p))) for _, p in named if not is_partitioned(p)
        ]
        self.partitioned = [(n, p) for n, p in named if is_partitioned(p)]

    def restore(self) -> None:
        for owner, tables in self.modules + self.hooks:
            _set_hook_tables(owner, tables)
        for param, data, grad, attributes in self.params:
            param.data, param.grad = data, grad
            vars(param).clear()
            vars(param).update(attributes)
        lost = [name for name, p in self.partitioned if not is_partitioned(p)]
        if lost:
            logger.error(
                "zero.initialize failed after laying out zero.Init parameters %s: build the "
                "model again (under zero.Init) before retrying",
                lost[:5],
            )

    def added_hooks(self) -> list[tuple]:
        """(module or parameter, hook table name, key) of every hook added since the snapshot:
        zero's, once construction succeeded (Engine.close removes them)."""
        added = []
        for owner, tables in self.modules + self.hooks:
            for name in _hook_names(owner):
                before = tables.get(name, {})
                added += [(owner, name, key) for key in getattr(owner, name) if key not in before]
        return added


def _stale_graph_error(error: BaseException, rank: int) -> RuntimeError | None:
    """torch's in-place modification error from a backward, with zero's usual reason for it
    ([Note: stale graphs] in partition/stages.py); None for any other error (and for stage 3's,
    which says it)."""
    text = str(error)
    if not isinstance(error, RuntimeError) or "modified by an inplace operation" not in text:
        return None
    if text.startswith("rank "):
        return None
    return RuntimeError(
        f"rank {rank}: {text} engine.step() (and load_checkpoint) update the parameters in "
        "place, as a torch optimizer does: if this loss was computed before the last "
        "engine.step(), it cannot be backpropagated after it (with retain_graph=True neither); "
        "compute the loss again after the step"
    )


def _refuse_trained(model, rank: int) -> None:
    """ValueError when another engine that was not closed trains parameters of `model` (a
    second zero.initialize on the same model): both would take the same gradients."""
    for name, param in model.named_parameters():
        if trained_by(param) is not None:
            raise ValueError(
                f"rank {rank}: parameter '{name}' of {type(model).__name__} is trained by a zero "
                "engine that was not closed: zero.initialize already laid this model out. A "
                "model belongs to one engine at a time: keep using that engine, or call its "
                "close() (DeepSpeed's destroy()) before zero.initialize again (under ZeRO "
                "stage 3 close() leaves the parameters partitioned: build or load the model "
                "again)"
            )


def _refuse_released_forward(module, args) -> None:
    """Forward pre-hook left on a stage-3 model whose engine was destroyed (Engine.close)."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    raise RuntimeError(
        f"rank {rank}: {type(module).__name__} was partitioned by a ZeRO stage-3 engine that was "
        "destroyed (engine.destroy() or close()): its parameters are 0-element placeholders "
        "and their values went with the engine; load the weights into a new model (from a "
        "checkpoint or a state dict saved before destroy) and train it with a new engine"
    )


def _refuse_placeholders(model, rank: int) -> None:
    """ValueError when parameters of `model` are a stage-3 engine's placeholders (0 elements,
    with the full size in ds_shape): another engine lays the model out, or a destroyed one
    took the values with it."""
    names = [
        name
        for name, param in model.named_parameters()
        if param.numel() == 0 and full_numel(param) > 0 and not is_partitioned(param)
    ]
    if names:
        raise ValueError(
            f"rank {rank}: parameters {listed(names)} of {type(model).__name__} are partitioned "
            "by a ZeRO stage-3 engine (0-element placeholders): a model can belong to one live "
            "engine, and a destroyed one took their values; build the model again (or load its "
            "weights) before zero.initialize"
        )


_TENSOR_HOOKS = ("_post_accumulate_grad_hooks", "_backward_hooks")


def _hook_names(obj) -> list[str]:
    if isinstance(obj, torch.Tensor):  # kept outside the instance __dict__, None until used
        return [name for name in _TENSOR_HOOKS if isinstance(getattr(obj, name, None), dict)]
    return [k for k, v in vars(obj).items() if "hook" in k and isinstance(v, dict)]


def _hook_tables(obj) -> dict:
    """Copies of the hook dictionaries torch keeps on a module (_forward_hooks,
    _state_dict_pre_hooks, ...) or a tensor (_post_accumulate_grad_hooks, ...)."""
    return {name: dict(getattr(obj, name)) for name in _hook_names(obj)}


def _set_hook_tables(obj, tables: dict) -> None:
    """Put back `tables` in place (a hook handle's remove() deletes from the same objects)."""
    for name in _hook_names(obj):
        table = getattr(obj, name)
        table.clear()
        table.update(tables.get(name, {}))


def _fingerprint(model, config, optimizer) -> int:
    """32-bit hash of what every rank must have alike before the first collective: the
    parameters' and buffers' names, full shapes, dtypes and requires_grad, the leaf modules
    (zero.utils.set_z3_leaf_modules), the config keys that shape the layout, and what would
    make the ranks' updates differ without any collective noticing: the micro-batch size, the
    clipping, the scheduler block and the optimizer's type and hyper-parameters per param
    group (those of plain types: an object's repr may hold its address)."""
    params = [
        (n, tuple(full_shape(p)), str(p.dtype), p.requires_grad)
        for n, p in model.named_parameters()
    ]
    buffers = [(n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers()]
    leaves = [n for n, m in model.named_modules() if is_leaf(m)]
    zero_cfg = config.zero
    keys = (
        zero_cfg.stage,
        zero_cfg.reduce_bucket_size,
        zero_cfg.stage3_module_granularity_threshold,
        _leaf_classes(zero_cfg),
        zero_cfg.stage3_param_persistence_threshold,
        zero_cfg.stage3_model_persistence_threshold,
        str(config.compute_dtype),
        config.gradient_accumulation_steps,
        config.train_micro_batch_size_per_gpu,
        config.gradient_clipping,
        repr(config.scheduler),
    )
    plain = (int, float, bool, str, type(None))

    def hyper(value):
        if isinstance(value, (tuple, list)):
            return all(hyper(v) for v in value)
        return isinstance(value, plain)

    groups = [
        sorted((k, v) for k, v in group.items() if k != "params" and hyper(v))
        for group in optimizer.param_groups
    ]
    update = (type(optimizer).__name__, groups)
    return zlib.crc32(repr((params, buffers, leaves, keys, update)).encode())


def _leaf_classes(zero_cfg) -> tuple:
    """Module class names stage 3 fetches as one unit: stage3_module_classes and DeepSpeed's
    leaf_module.classes (its names and name_suffixes: _mark_leaf_names)."""
    leaf = zero_cfg.leaf_module
    return tuple(zero_cfg.stage3_module_classes or ()) + (leaf.classes if leaf else ())


def _mark_leaf_names(model, zero_cfg) -> None:
    """leaf_module.names / name_suffixes: mark those modules as stage-3 leaves; ValueError
    naming a name that matches no module (a misspelling would leave experts as units)."""
    leaf = zero_cfg.leaf_module
    if leaf is None or zero_cfg.stage != 3:
        return
    named = list(model.named_modules())
    ways = (
        ("names", leaf.names, str.__eq__, "named"),
        ("name_suffixes", leaf.name_suffixes, str.endswith, "named with the suffix"),
    )
    for key, wanted, matches, said in ways:
        for text in wanted:
            found = [m for n, m in named if matches(n, text)]
            if not found:
                raise ValueError(
                    f"zero_optimization.leaf_module.{key}: no module of {type(model).__name__} "
                    f"is {said} '{text}'"
                )
            for module in found:
                mark_leaf(module)


def _check_groups_disjoint(params, module):
    """model_parameters as a list (a generator is read once here): ValueError naming the first
    parameter that two param groups both hold (torch's own error names neither)."""
    params = list(params)
    if not params or not isinstance(params[0], dict):
        return params
    names = {id(p): n for n, p in module.named_parameters()}
    first_group: dict[int, int] = {}
    for index, group in enumerate(params):
        held = group.get("params", [])
        held = [held] if isinstance(held, torch.Tensor) else list(held)
        params[index] = {**group, "params": held}
        for param in held:
            earlier = first_group.setdefault(id(param), index)
            if earlier != index:
                name = names.get(id(param), f"of shape {tuple(param.shape)}")
                raise ValueError(
                    f"model_parameters: parameter '{name}' is in param groups {earlier} and "
                    f"{index}; each parameter belongs to one group"
                )
    return params


def _cpu_adam(params, cls, kwargs):
    """ZeRO-Offload: the config's Adam/AdamW as zero.ops.CPUAdam (C++ SIMD, same numerics)."""
    from zero.ops import CPUAdam

    supported = {"lr", "betas", "eps", "weight_decay"}
    unsupported = {k: v for k, v in kwargs.items() if k not in supported and v not in (None, False)}
    if unsupported:
        key = next(iter(unsupported))
        raise ValueError(
            f"optimizer.params.{key}={unsupported[key]!r} is not supported with "
            "zero_optimization.offload_optimizer (the CPU Adam); remove it"
        )
    options = {k: v for k, v in kwargs.items() if k in supported}
    return CPUAdam(params, adamw_mode=cls is torch.optim.AdamW, **options)


def _cast_floats(obj, dtype):
    if torch.is_tensor(obj):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_floats(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast_floats(v, dtype) for k, v in obj.items()}
    return obj
