"""Config in, parts out: what zero.initialize builds around a model before it trains.

`build()` checks everything that can be refused (the model, the optimizer and its param groups,
the scheduler, nvme room, the ranks' agreement on model and config) before it touches the model,
then lays the model out and returns the parts the Engine wires together (`Parts`). Each part is
built by its own subpackage: the flat layout and ZeroOptimizer (partition/stages.py), stage 3's
fetch units, ParamGatherer and FrozenShards (partition/), bucket sizes and the fetch policy
(planning/budget.py), offload (offload/), the lr scheduler (optim/), the loss scaler
(optim/precision.py), periodic checkpoints (checkpoint/periodic.py), the step monitor
(monitor.py). A failed build leaves the model as it found it (guards.ModelSnapshot).
"""

import dataclasses
import logging

import torch

from ..comm import Intent
from ..monitor import StepMonitor, ThroughputTimer, summary_writer_class
from ..offload import nvme, param_swap
from ..optim import build_optimizer, resolve_optimizer
from ..optim.lr_schedules import build_scheduler
from ..optim.precision import LossScaler
from ..partition import gathered, zeropp
from ..partition.flat import FlatLayout
from ..partition.frozen_shards import FrozenShards
from ..partition.gatherer import ParamGatherer
from ..partition.hierarchy import num_shards, partition_groups
from ..partition.init import full_numel, is_partitioned, name_full_size, refuse_meta, take_full
from ..partition.stages import NoOptimizer, ReduceSettings, ZeroOptimizer, check_optimizer
from ..partition.state_dict_gather import StateDictGather
from ..partition.units import choose_units, persistent_unit
from ..planning.budget import bucket_settings, fetch_settings
from ..planning.memory import state_bytes_per_element
from . import guards

logger = logging.getLogger("zero")


@dataclasses.dataclass
class Parts:
    """What an Engine holds. `gatherer`, `frozen` and `state_dict_gather` exist at stage 3 only;
    `whole_frozen` (name, parameter) below stage 3 (frozen parameters kept whole, outside the
    layout); `periodic` when checkpoint.save_interval_* is set; `added_hooks` lists every hook
    the build added to the model (Engine.close removes them)."""

    optimizer: ZeroOptimizer
    lr_scheduler: object
    scaler: LossScaler
    gatherer: ParamGatherer | None
    frozen: FrozenShards | None
    whole_frozen: list
    fetch: object
    bucket_sizes: object
    partition_groups: object
    state_dict_gather: StateDictGather | None
    periodic: object
    monitor: StepMonitor
    tput_timer: ThroughputTimer
    added_hooks: list


def build(model, config, comm, accelerator, optimizer, model_parameters, lr_scheduler, mpu):
    """The Engine's parts for `model` (zero.initialize's arguments). Collective: every rank
    calls it with the same model and config. Raises what zero.initialize documents (ValueError,
    TypeError, NotImplementedError for bad input; RankMismatchError when the ranks' models or
    configs differ), before the model changes."""
    return _Builder(model, config, comm, accelerator, mpu).build(
        optimizer, model_parameters, lr_scheduler
    )


class _Builder:
    def __init__(self, model, config, comm, accelerator, mpu):
        self.model, self.config, self.comm, self.accelerator, self.mpu = (
            model,
            config,
            comm,
            accelerator,
            mpu,
        )
        self.num_shards = num_shards(config.zero, comm.world_size)

    def build(self, optimizer, model_parameters, lr_scheduler) -> Parts:
        model, config, comm = self.model, self.config, self.comm
        refuse_meta(model, comm.rank)  # e.g. built under torch.device("meta"), never loaded
        guards.refuse_foreign_model(model, config.zero.stage, comm.rank)
        guards.mark_leaf_names(model, config.zero)  # before the fingerprint, which counts leaves
        # Validate the optimizer and its param groups before any collective or device move.
        client_optimizer = optimizer is not None
        _check_one_source(config, optimizer, lr_scheduler)
        optimizer, lr_scheduler = self._optimizer_or_none(optimizer, model_parameters, lr_scheduler)
        trains = not isinstance(optimizer, NoOptimizer)
        named_groups = self._named_groups(optimizer, client_optimizer) if trains else []
        self._check_room(optimizer, named_groups, trains)
        if config.tensorboard.enabled:
            summary_writer_class()  # rank 0 writes; every rank fails alike without the package
        # Before the first collective: every rank built the same model with the same config.
        agreement = comm.start_agreement(config.agreement_timeout)
        if agreement is not None:
            doing = "builds its engine (zero.initialize)"
            agreement.check(Intent.LAYOUT, (guards.fingerprint(model, config, optimizer),), doing)
        # A scheduler that cannot be built (a misspelled parameter) fails before the model is
        # touched; it drives the param groups' lr, which zero keeps.
        scheduler = self._build_scheduler(lr_scheduler, optimizer) if trains else None
        if trains:
            check_optimizer(optimizer)
        snapshot = guards.ModelSnapshot(model)
        try:
            parts = self._lay_out(named_groups, optimizer, agreement, scheduler)
        except BaseException:
            snapshot.restore()  # a failed zero.initialize leaves the model as it found it
            raise
        parts.added_hooks = snapshot.added_hooks()
        return parts

    def _check_room(self, optimizer, named_groups, trains: bool) -> None:
        """nvme offload: the swap files' folders exist and have room, before any allocation."""
        config, rank = self.config, self.comm.rank
        optimizer_files = None  # no optimizer: offload_optimizer places nothing
        if trains:
            numel = sum(full_numel(p) for named in named_groups for _, p in named)
            optimizer_files = nvme.check_before_allocating(
                config, optimizer, numel, self.num_shards, rank
            )
        param_files = param_swap.check_before_allocating(
            config, [full_numel(p) for p in self.model.parameters()], self.num_shards, rank
        )
        nvme.check_free_space([optimizer_files, param_files], rank)

    def _lay_out(self, named_groups, optimizer, agreement, scheduler) -> Parts:
        """Lay the model out and attach zero to it (the part of construction that changes the
        model: parameter storage, hooks, device)."""
        config, comm, accelerator = self.config, self.comm, self.accelerator
        self.model.to(device=accelerator.device)  # keeps Parameter objects: groups stay valid
        if config.zero.stage < 3:
            self._materialize_frozen(named_groups)
        self._broadcast_module()
        scaler = LossScaler.from_config(config)
        trains = not isinstance(optimizer, NoOptimizer)
        state_bytes = (state_bytes_per_element(optimizer) or 8) if trains else 0
        fetch, units, unit_of = self._fetch_units(trains, state_bytes)
        bucket_sizes = self._bucket_sizes(trains, state_bytes)
        # MiCS shard / replica groups, hpZ's secondary group (partition/hierarchy.py)
        groups = partition_groups(comm, config.zero)
        layout = FlatLayout(
            named_groups,
            nvme.sub_group_bucket_numel(config, self.num_shards, bucket_sizes.reduce_numel),
            self.num_shards,
            unit_of,
            persistent_unit(units),
        )
        settings = self._reduce_settings(trains, bucket_sizes)
        zero_optimizer = ZeroOptimizer(
            named_groups, optimizer, layout, settings, comm, scaler, config.compute_dtype, groups
        )
        gatherer = frozen = state_dict_gather = None
        if config.zero.stage == 3:
            frozen = self._frozen_shards(named_groups, zero_optimizer, groups, unit_of)
            gatherer = self._gatherer(units, zero_optimizer, frozen, groups, fetch, agreement)
            state_dict_gather = StateDictGather(self.model, gatherer, config, comm)
        self._quantize_collectives(gatherer, zero_optimizer)
        gathered.register(zero_optimizer)
        _cast_rest(self.model, config.compute_dtype)
        # Construction traffic (broadcast of rank 0's weights, the stage-3 persistent unit's
        # first all-gather) is no step's.
        comm.ledger.end_step()
        return Parts(
            optimizer=zero_optimizer,
            lr_scheduler=scheduler,
            scaler=scaler,
            gatherer=gatherer,
            frozen=frozen,
            # below stage 3 frozen parameters stay whole, outside the layout (guards.check_params)
            whole_frozen=self._frozen_named(named_groups) if config.zero.stage < 3 else [],
            fetch=fetch,
            bucket_sizes=bucket_sizes,
            partition_groups=groups,
            state_dict_gather=state_dict_gather,
            periodic=_periodic(config),
            monitor=self._monitor(zero_optimizer),
            # DeepSpeed's engine.tput_timer: started by each training forward, stopped by step();
            # zero's own step line reports samples/s, so the timer logs only when a script asks.
            tput_timer=ThroughputTimer(
                config.timers.throughput,
                batch_size=config.train_batch_size,
                steps_per_output=config.steps_per_print,
            ),
            added_hooks=[],
        )

    def _frozen_shards(self, named_groups, zero_optimizer, groups, unit_of):
        """Stage 3: the partitioned frozen parameters (FrozenShards), or None without any."""
        frozen = self._frozen_named(named_groups)
        if not frozen:
            return None
        offload = _on_cpu(self.config.zero.offload_param)
        return FrozenShards(
            frozen,
            nvme.sub_group_bucket_numel(self.config, self.num_shards),
            groups.shard,
            unit_of,
            self.config.compute_dtype,
            offload is not None,
            offload is not None and offload.pin_memory,
            param_swap=zero_optimizer.param_swap,
        )

    def _gatherer(self, units, zero_optimizer, frozen, groups, fetch, agreement) -> ParamGatherer:
        """Stage 3: the ParamGatherer over the fetch units, attached to the layout's buckets."""
        config = self.config
        gatherer = ParamGatherer(
            self.model,
            units,
            groups.shard,
            config.compute_dtype,
            self.accelerator.device,
            prefetch_numel=fetch.prefetch_numel,
            max_live_numel=fetch.max_live_numel,
            max_reuse_numel=fetch.max_reuse_numel,
        )
        gatherer.param_swap = zero_optimizer.param_swap
        gatherer.secondary = groups.secondary
        gatherer.two_level = groups.two_level
        gatherer.attach(zero_optimizer.buckets + (frozen.buckets if frozen else []))
        for bucket in gatherer.buckets:
            for slot, param in zip(bucket.layout.slots, bucket.params):
                # DeepSpeed's names for a partitioned parameter's full size, which scripts
                # read (`p.ds_numel if hasattr(p, "ds_numel") else p.numel()`)
                name_full_size(param, slot.shape)
        # Gradients get a process group of their own; an engine without an optimizer has none
        reduce_comm = groups.shard
        if zero_optimizer.trains:
            reduce_comm = groups.shard.sibling("reduce-scatter", config.agreement_timeout)
        zero_optimizer.attach_gatherer(gatherer, reduce_comm)
        if agreement is not None:
            gatherer.agreement = agreement
            agreement.describe = gatherer.describe
            agreement.hint = gatherer.hint
        return gatherer

    def _monitor(self, zero_optimizer) -> StepMonitor:
        """The step log, CSV/TensorBoard monitors and comms timing (monitor.py,
        docs/observability.md)."""
        config, comm = self.config, self.comm
        monitor = StepMonitor(
            config, comm.rank, zero_optimizer.layout.numel, self.accelerator.device
        )
        logs = config.comms_logger
        if logs.enabled:
            comm.enable_timing(() if logs.prof_all else logs.prof_ops, logs.verbose)
        monitor.attach(comm)  # wall_clock_breakdown: reduce / all_gather from step 1
        return monitor

    def _fetch_units(self, trains: bool, state_bytes: int):
        """Stage 3: (fetch settings, fetch units, id(param) -> unit), the units sized by the
        fetch policy ([Note: memory-aware fetch policy] in planning/budget.py); else
        (None, [], None). Collective at stage 3."""
        zero_cfg = self.config.zero
        if zero_cfg.stage != 3:
            return None, [], None
        fetch = fetch_settings(
            self.model, self.config, self.comm, self.accelerator.device, trains, state_bytes
        )
        logger.info("zero.initialize: stage 3 fetch settings: %s", fetch.reason)
        units, unit_of = choose_units(
            self.model,
            fetch.unit_numel,
            guards.leaf_classes(zero_cfg),
            zero_cfg.stage3_param_persistence_threshold,
            zero_cfg.stage3_model_persistence_threshold,
        )
        return fetch, units, unit_of

    def _bucket_sizes(self, trains: bool, state_bytes: int):
        """Stages 1-2: reduce and all-gather bucket sizes, from the memory a rank may use where
        the config leaves them unset ([Note: bucket sizes from memory] in planning/budget.py).
        Collective at stages 1-2 with an optimizer."""
        sizes = bucket_settings(
            self.model, self.config, self.comm, self.accelerator.device, trains, state_bytes
        )
        if self.config.zero.stage in (1, 2) and trains:
            logger.info("zero.initialize: bucket sizes: %s", sizes.reason)
        return sizes

    def _quantize_collectives(self, gatherer, zero_optimizer) -> None:
        """ZeRO++ qwZ and qgZ (partition/zeropp.py) from zero_optimization's
        zero_quantized_weights, zero_quantized_nontrainable_weights and
        zero_quantized_gradients, with zero.ops.quantize as the codec. Collective with qgZ
        (every rank makes its node's and its inter-node group)."""
        zero_cfg = self.config.zero
        weights = zero_cfg.zero_quantized_weights or zero_cfg.zero_quantized_nontrainable_weights
        if not (weights or zero_cfg.zero_quantized_gradients):
            return
        from zero.ops import quantize as codec

        if gatherer is not None:
            gatherer.quantized = zeropp.quantized_weights(zero_cfg, codec)
        if zero_optimizer.trains:
            zero_optimizer.quantized_reduce = zeropp.quantized_gradients(
                zero_cfg, zero_optimizer.reduce_comm, codec, self.config.agreement_timeout
            )

    def _model_parallel_norm(self):
        """With tensor parallelism, the gradient norm counts each model-parallel slice and each
        replicated parameter once (zero.mpu, [Note: gradient norm with model parallelism])."""
        if self.mpu is None:
            return None
        from ..model_parallel.mpu import ModelParallelNorm, model_parallel_comm
        from ..model_parallel.tensor_parallel import partitioned_parameter_names

        mp_comm = model_parallel_comm(self.mpu)
        if mp_comm.world_size == 1:
            return None
        return ModelParallelNorm(mp_comm, partitioned_parameter_names(self.model))

    def _reduce_settings(self, trains: bool, bucket_sizes) -> ReduceSettings:
        config = self.config
        comm_dtype = config.communication_data_type
        dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
        split = nvme.OptimizerOffload.from_config(config)  # nvme, or ratio < 1
        offload_optimizer = _on_cpu(config.zero.offload_optimizer)
        offload_param = _on_cpu(config.zero.offload_param)
        return ReduceSettings(
            stage=config.zero.stage,
            reduce_dtype=dtypes[comm_dtype] if comm_dtype else config.compute_dtype,
            allgather_numel=bucket_sizes.allgather_numel,
            clip=config.gradient_clipping,
            overflow_check=config.fp16.enabled
            or (config.bf16.enabled and config.bf16.check_grad_overflow),
            model_parallel=self._model_parallel_norm(),
            offload=trains and offload_optimizer is not None and split is None,
            pin_memory=bool(offload_optimizer and offload_optimizer.pin_memory),
            split=split if trains else None,
            param_nvme=param_swap.ParamOffload.from_config(config),
            offload_param=offload_param is not None,
            pin_param=bool(offload_param and offload_param.pin_memory),
            accum_dtype=config.grad_accum_dtype,
            average_over_ranks=config.gradient_allreduce_op == "mean",
        )

    def _optimizer_or_none(self, optimizer, model_parameters, lr_scheduler):
        """(optimizer, lr_scheduler) the engine trains with: the client's or the config's; or,
        as DeepSpeed builds its inference engine whenever deepspeed.initialize gets no
        optimizer, (NoOptimizer, None) when there is none ([Note: ZeRO-Inference] in
        partition/stages.py): no optimizer= and no 'optimizer' block, or no parameter of the
        model requires grad (an optimizer= or block given then is not used and the log says
        so: DeepSpeed would build it over parameters that never change). Raises ValueError for
        an lr_scheduler= without any optimizer."""
        model = type(self.model).__name__
        trainable = any(p.requires_grad and full_numel(p) > 0 for p in self.model.parameters())
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
            params = [p for p in self.model.parameters() if p.requires_grad]
        params = _check_groups_disjoint(params, self.model)
        spec = self.config.optimizer
        offload = self.config.zero.offload_optimizer
        if offload is not None and offload.device != "none":  # cpu or nvme: the host Adam
            cls, kwargs = resolve_optimizer(spec.type, spec.params)
            if cls in (torch.optim.Adam, torch.optim.AdamW):
                return _cpu_adam(params, cls, kwargs)
        return build_optimizer(spec.type, spec.params, params)

    def _named_groups(self, optimizer, client_optimizer: bool):
        """Per optimizer param group, the (name, param) pairs zero lays out and trains."""
        names = {id(p): n for n, p in self.model.named_parameters()}
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
            for n, p in self.model.named_parameters()
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
        for name, param in self.model.named_parameters():
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
            for tensor in [*self.model.parameters(), *self.model.buffers()]:
                if not is_partitioned(tensor):  # zero.Init broadcast those when it built them
                    self.comm.broadcast(tensor.data, src=0)


def _on_cpu(block):
    """An offload_optimizer / offload_param block when its device is "cpu", else None."""
    return block if block is not None and block.device == "cpu" else None


def _periodic(config):
    """checkpoint.save_interval_* (checkpoint/periodic.py); None when not configured."""
    from ..checkpoint.periodic import PeriodicCheckpointer

    return PeriodicCheckpointer.from_config(config)


def _cast_rest(model, dtype: torch.dtype) -> None:
    """Cast what zero does not lay out (frozen or empty parameters, floating-point buffers) to
    the compute dtype, as DeepSpeed's module.half()/bfloat16() does."""
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.is_floating_point() and tensor.dtype != dtype:
            tensor.data = tensor.data.to(dtype)


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
