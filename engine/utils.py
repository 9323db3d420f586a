"""zero.utils: DeepSpeed's deepspeed.utils helpers: stage-3 leaf modules, sharded state,
logging (`logger`, `log_dist`) and `zero.utils.zero_to_fp32` (deepspeed.utils.zero_to_fp32).

A leaf module is gathered and released as one stage-3 fetch unit whatever its size, so the
children it picks by data (the experts of a mixture of experts, which receive different tokens
on different ranks) never make ranks issue different all-gathers. Mark leaves before
zero.initialize (the fetch units are chosen there):

    zero.utils.set_z3_leaf_modules(model, [MixtralSparseMoeBlock])
    engine, *_ = zero.initialize(model=model, config="configs/zero3.json")

`set_z3_leaf_modules_by_name` and `set_z3_leaf_modules_by_suffix` mark modules by their
`named_modules()` names instead; `zero_optimization.stage3_module_classes` and
`zero_optimization.leaf_module` (in the config) do the same.

It also holds DeepSpeed's helpers for reading and writing a trained parameter's sharded state
(docs/checkpoints.md, "Reading and writing sharded state"): the fp32 master weight, the reduced
gradient and the optimizer state, whole (`safe_get_full_*`, `safe_set_full_*`; the getters
all-gather at stages 1-3) or this rank's owned part (`safe_get_local_*`, `safe_set_local_*`).

[Note: where a parameter's state lives]
A trained parameter has a slot (offset, numel, shape) in one bucket of zero's flat buffers
(partition/flat.py); rank r owns the slice `layout.owned_range(r)` of every bucket (stage 0: all of
it). The bucket's `master` (fp32), `grad_shard` (the sum over ranks of loss-scaled gradients, in
data_types.grad_accum_dtype; the getters return fp32) and the optimizer state of `master` are shaped
like that owned slice, so one helper serves every full getter: all-gather the bucket-shaped shard
into the padded bucket, cut out the slot. A rank's local part is the slot's overlap with its owned
slice (possibly empty).
"""

import logging
import sys
import zlib
from typing import NamedTuple

import torch
import torch.distributed as dist

from .checkpoint import zero_to_fp32
from .partition import gathered
from .partition.units import _LEAF_MODULES, is_leaf

# `from zero.utils.zero_to_fp32 import ...` (DeepSpeed: deepspeed.utils.zero_to_fp32) finds the
# module checkpoint/zero_to_fp32.py, as `import os.path` finds posixpath: zero.utils is one module,
# so the submodule name is registered here, and the import system looks it up in sys.modules.
sys.modules[f"{__name__}.zero_to_fp32"] = zero_to_fp32

# zero's logger (DeepSpeed's deepspeed.utils.logger): every zero module logs through it.
logger = logging.getLogger("zero")


def log_dist(message, ranks=None, level=logging.INFO) -> None:
    """Log `message` with the prefix "[Rank R] " through zero's logger on the ranks listed in
    `ranks`: a list of global ranks, or [-1] for every rank; with None (or an empty list) no
    rank logs once a process group exists. Without a process group the message is always
    logged, as "[Rank -1] ...". DeepSpeed's deepspeed.utils.log_dist. Not a collective."""
    started = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if started else -1
    ranks = list(ranks or [])
    if started and not (ranks and (ranks[0] == -1 or rank in ranks)):
        return
    logger.log(level, "[Rank %d] %s", rank, message)


def _qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _matches(module: torch.nn.Module, classes) -> bool:
    """An instance of a class in `classes`, or of a class named by a string there: its own
    name (MixtralSparseMoeBlock) or its fully qualified one
    (transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock), as DeepSpeed matches."""
    kind = type(module)
    for c in classes:
        if isinstance(c, str):
            if c in (kind.__name__, _qualified_name(kind)):
                return True
        elif isinstance(module, c):
            return True
    return False


def _check_classes(classes) -> list:
    if isinstance(classes, (str, type)):
        raise TypeError(
            f"leaf_module_classes must be a list of classes or class names, not one {classes!r}; "
            "wrap it in a list"
        )
    classes = list(classes)
    for c in classes:
        if not (isinstance(c, str) or (isinstance(c, type) and issubclass(c, torch.nn.Module))):
            raise TypeError(
                f"leaf module classes must be nn.Module subclasses or class names, not {c!r}"
            )
    return classes


def _set_leaf(module: torch.nn.Module, flag: bool) -> None:
    if flag:
        _LEAF_MODULES.add(module)
    else:
        _LEAF_MODULES.discard(module)


def _flag_classes(model, leaf_module_classes, flag: bool, raise_if_not_found: bool, caller: str):
    classes = _check_classes(leaf_module_classes)
    matched = [m for m in model.modules() if _matches(m, classes)]
    if not matched and raise_if_not_found:
        names = [c if isinstance(c, str) else c.__name__ for c in classes]
        raise ValueError(
            f"{caller}: no module of {type(model).__name__} is a {names}; check the class "
            "names (the short name or the fully qualified one), or pass "
            "raise_if_not_found=False"
        )
    for module in matched:
        _set_leaf(module, flag)
    return matched


def set_z3_leaf_modules(
    model: torch.nn.Module, leaf_module_classes, raise_if_not_found: bool = True
) -> list:
    """Mark every module of `model` that is an instance of one of `leaf_module_classes` as a
    stage-3 leaf (one fetch unit whatever its size). DeepSpeed's
    deepspeed.utils.set_z3_leaf_modules.

    Args:
        model: the model (before zero.initialize, which chooses the fetch units).
        leaf_module_classes: a list of nn.Module subclasses (isinstance, so subclasses match
            too) or class names: the short name ("MixtralSparseMoeBlock") or the fully qualified
            one ("transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock").
        raise_if_not_found: raise when no module matches (a misspelled class would otherwise
            leave the model as it was); False returns an empty list quietly.

    Returns:
        The marked modules, in `model.modules()` order.

    Raises:
        TypeError: an entry that is neither an nn.Module subclass nor a string.
        ValueError: nothing matched and raise_if_not_found.

    Not a collective, but every rank must mark the same modules (zero.initialize checks).
    """
    return _flag_classes(
        model, leaf_module_classes, True, raise_if_not_found, "set_z3_leaf_modules"
    )


def unset_z3_leaf_modules(
    model: torch.nn.Module, leaf_module_classes, raise_if_not_found: bool = True
) -> list:
    """Undo set_z3_leaf_modules for every module of those classes (matched as there); returns
    them all, leaves or not, as DeepSpeed's deepspeed.utils.unset_z3_leaf_modules does.
    Raises ValueError when no module matches and raise_if_not_found."""
    return _flag_classes(
        model, leaf_module_classes, False, raise_if_not_found, "unset_z3_leaf_modules"
    )


def set_z3_leaf_modules_by_name(
    model: torch.nn.Module, module_names, flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list, list]:
    """Mark (flag True) or unmark (False) the modules named in `module_names`, names as
    `model.named_modules()` gives them ("model.layers.0.mlp"; "" is `model` itself).
    DeepSpeed's deepspeed.utils.set_z3_leaf_modules_by_name.

    Returns:
        (modules found, in the order of `module_names`; names that match no module).

    Raises:
        ValueError: some name matches no module and raise_if_not_found (nothing is marked).
    """
    by_name = dict(model.named_modules())
    names = [module_names] if isinstance(module_names, str) else list(module_names)
    missing = [name for name in names if name not in by_name]
    if missing and raise_if_not_found:
        raise ValueError(
            f"set_z3_leaf_modules_by_name: no module of {type(model).__name__} is named "
            f"{missing}; use names from model.named_modules(), or pass raise_if_not_found=False"
        )
    found = [by_name[name] for name in names if name in by_name]
    for module in found:
        _set_leaf(module, flag)
    return found, missing


def set_z3_leaf_modules_by_suffix(
    model: torch.nn.Module, module_name_suffixes, flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list, list]:
    """Mark (flag True) or unmark (False) every module whose `model.named_modules()` name ends
    with one of `module_name_suffixes` ("mlp" matches "model.layers.0.mlp" and every other
    layer's). DeepSpeed's deepspeed.utils.set_z3_leaf_modules_by_suffix.

    Returns:
        (modules matched, each once, in the order of the suffixes; suffixes that match none).

    Raises:
        ValueError: some suffix matches no module and raise_if_not_found (nothing is marked).
    """
    named = list(model.named_modules())
    suffixes = (
        [module_name_suffixes]
        if isinstance(module_name_suffixes, str)
        else list(module_name_suffixes)
    )
    found: dict[int, torch.nn.Module] = {}
    missing = []
    for suffix in suffixes:
        hits = [module for name, module in named if name.endswith(suffix)]
        if not hits:
            missing.append(suffix)
        for module in hits:
            found.setdefault(id(module), module)
    if missing and raise_if_not_found:
        raise ValueError(
            f"set_z3_leaf_modules_by_suffix: no module name of {type(model).__name__} ends with "
            f"{missing}; use suffixes of names from model.named_modules(), or pass "
            "raise_if_not_found=False"
        )
    for module in found.values():
        _set_leaf(module, flag)
    return list(found.values()), missing


def get_z3_leaf_modules(model: torch.nn.Module) -> list:
    """The modules of `model` marked as stage-3 leaves, in module order."""
    return [m for m in model.modules() if is_leaf(m)]


def z3_leaf_module(model: torch.nn.Module) -> bool:
    """True when `model` itself is marked as a stage-3 leaf."""
    return is_leaf(model)


# ----- sharded state (DeepSpeed's safe_get_full_* / safe_set_full_* / *_local_*) ---------------
class _Target(NamedTuple):
    """Where a trained parameter lives: its ZeroOptimizer, bucket and slot."""

    optimizer: object
    bucket: object
    slot: object

    @property
    def rank(self) -> int:
        return self.optimizer.comm.rank

    @property
    def device(self) -> torch.device:
        """The compute device (the gradient shard's; the master is on the host with offload)."""
        return self.bucket.grad_device


def _target(param, caller: str) -> _Target:
    """The trained parameter's place; ValueError for a frozen parameter or one no engine trains."""
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"zero.utils.{caller}: expected a parameter, not {type(param).__name__}")
    optimizer = gathered.owner(param)
    place = optimizer.locate(param) if optimizer is not None else None
    if place is not None:
        bucket, index = place
        return _Target(optimizer, bucket, bucket.layout.slots[index])
    where = f"rank {_rank(optimizer)}: "
    what = _describe(param, optimizer)
    if not param.requires_grad:
        raise ValueError(
            f"{where}zero.utils.{caller}: {what} is frozen (requires_grad=False): zero keeps no "
            "fp32 master weight, gradient or optimizer state for it; read its value with "
            "zero.GatheredParameters(param)"
        )
    raise ValueError(
        f"{where}zero.utils.{caller}: {what} is not trained by any engine: pass a parameter "
        "(with elements) of the model given to zero.initialize, after zero.initialize"
    )


def _rank(optimizer) -> int:
    if optimizer is not None:
        return optimizer.comm.rank
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _describe(param, optimizer) -> str:
    """'parameter NAME' where zero knows the name (stage 3 lays out frozen ones too), else the
    shape."""
    buckets = optimizer.gatherer.buckets if optimizer is not None and optimizer.gatherer else []
    for bucket in buckets:
        for slot, other in zip(bucket.layout.slots, bucket.params):
            if other is param:
                return f"parameter '{slot.name}'"
    return f"the parameter of shape {tuple(param.shape)}"


def _owned(target: _Target) -> tuple[slice, slice]:
    """(slice of the bucket shard, slice of the flattened parameter) of this rank's owned part
    of the parameter; both empty when it owns none of it."""
    bucket, slot = target.bucket, target.slot
    layout = target.optimizer.layout
    begin, end = bucket.layout.owned_range(layout.shard_of(target.rank))
    lo, hi = max(begin, slot.offset), min(end, slot.offset + slot.numel)
    if lo >= hi:
        return slice(0, 0), slice(0, 0)
    return slice(lo - begin, hi - begin), slice(lo - slot.offset, hi - slot.offset)


def _full(target: _Target, shard: torch.Tensor, caller: str, key: str = "") -> torch.Tensor:
    """The parameter's full value (shaped like it, on the compute device, a new tensor) from
    every rank's bucket-shaped `shard` ((shard_numel,), any dtype): one all-gather of the bucket
    over the data-parallel group when the bucket is sharded (collective, checked by _enter),
    none at stage 0. With MiCS the bucket is gathered over the shard group (optimizer.shard_comm,
    partition/hierarchy.py)."""
    optimizer, bucket, slot = target
    shard = shard.to(target.device)
    if optimizer.layout.num_shards == 1:
        full = shard  # stage 0 or world size 1: this rank holds the whole bucket
    else:
        _enter(target, _GET, caller, key)
        full = torch.empty(bucket.layout.padded_numel, dtype=shard.dtype, device=shard.device)
        optimizer.shard_comm.all_gather(full, shard)
    return full[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()


def _local(target: _Target, shard: torch.Tensor) -> torch.Tensor:
    """This rank's owned part of the parameter from its bucket-shaped `shard`: (n,), a copy on
    the compute device."""
    return shard[_owned(target)[0]].to(target.device, copy=True)


def _reduced_grad(target: _Target, caller: str) -> torch.Tensor:
    """(shard_numel,) fp32: the owned gradient shard averaged over ranks, loss scale removed
    (what the optimizer step receives before clipping). RuntimeError outside the window."""
    optimizer = target.optimizer
    if not optimizer.grads_reduced:
        raise RuntimeError(
            f"rank {target.rank}: zero.utils.{caller}('{target.slot.name}') is valid only "
            "between engine.backward() of the micro-batch at the gradient accumulation boundary "
            "and engine.step(): only then are the reduced gradients complete (before, a rank "
            "holds its own partial sums; after, the step has consumed them)"
        )
    # The shard holds the sum over ranks of loss-scaled gradients; step() multiplies the same way.
    # fp32 even when the shard is 2-byte (data_types.grad_accum_dtype bf16/fp16).
    shard = target.bucket.grad_shard.to(torch.float32)
    return shard * optimizer.unscale_factor()


def _state(target: _Target, key: str, caller: str):
    """The optimizer state `key` of the parameter's bucket shard. KeyError naming the keys that
    exist (the same on every rank) when there is no such state."""
    optimizer = target.optimizer.optimizer
    state = optimizer.state.get(target.bucket.master, {})
    if key not in state:
        when = "" if state else " (the first optimizer step creates it)"
        raise KeyError(
            f"rank {target.rank}: zero.utils.{caller}: {type(optimizer).__name__} has no state "
            f"'{key}' for parameter '{target.slot.name}'{when}; it has {sorted(state)}"
        )
    return state[key]


def _is_sharded(target: _Target, value) -> bool:
    """True for per-element state (shaped like the bucket shard), False for a scalar (step)."""
    return torch.is_tensor(value) and value.shape == target.bucket.master.shape


def _as_is(value):
    return value.clone() if torch.is_tensor(value) else value


def _full_value(target: _Target, value, caller: str) -> torch.Tensor:
    """`value` (the full parameter's shape) as (numel,) fp32 on the compute device."""
    if not torch.is_tensor(value):
        raise TypeError(f"zero.utils.{caller}: value must be a tensor, not {type(value).__name__}")
    if tuple(value.shape) != target.slot.shape:
        raise ValueError(
            f"rank {target.rank}: zero.utils.{caller}: value of shape {tuple(value.shape)} for "
            f"parameter '{target.slot.name}' of shape {target.slot.shape}; pass the full value"
        )
    return value.detach().to(device=target.device, dtype=torch.float32).reshape(-1)


def _local_value(target: _Target, value, caller: str) -> torch.Tensor:
    """`value` (this rank's owned part) as (n,) fp32 on the compute device."""
    if not torch.is_tensor(value):
        raise TypeError(f"zero.utils.{caller}: value must be a tensor, not {type(value).__name__}")
    part = _owned(target)[0]
    numel = part.stop - part.start
    if value.numel() != numel:
        raise ValueError(
            f"rank {target.rank}: zero.utils.{caller}: value of {value.numel()} elements for "
            f"parameter '{target.slot.name}', of which this rank owns {numel}; pass what "
            "safe_get_local_fp32_param(param) returns on this rank, changed"
        )
    return value.detach().to(device=target.device, dtype=torch.float32).reshape(-1)


def _enter(target: _Target, method: str, caller: str, key: str, flat=None) -> None:
    """Check that every rank calls `method` (a comm.METHODS entry) now, for the same parameter
    and state key and, for a setter, the same value (a crc32 of its fp32 bytes): otherwise every
    rank raises RankMismatchError before any collective or write. Collective at world size > 1."""
    comm = target.optimizer.comm
    if comm.agreement is None or comm.world_size == 1:
        return
    crc = zlib.crc32(repr((caller, target.slot.name, key)).encode())
    if flat is not None:
        crc = zlib.crc32(flat.cpu().numpy().tobytes(), crc)
    comm.agreement.enter(method, crc)


_GET = "zero.utils.safe_get_full_* (an all-gather of one parameter)"
_SET = "zero.utils.safe_set_full_* (every rank passes the same value)"


def _write_params(target: _Target, owned: torch.Tensor, full: torch.Tensor | None) -> None:
    """Write the low-precision parameter the forward reads: this rank's owned part `owned` into
    its parameter shard and, with `full` (the whole value), the whole parameter where this rank
    holds it (stages 0-2: always, a view of the flat buffer; stage 3: while its unit is
    gathered); stage 3 without `full`: the owned part of the gathered copy."""
    bucket, slot = target.bucket, target.slot
    part = _owned(target)[0]
    bucket.param_shard[part].copy_(owned)
    buffer = bucket.param_buffer
    if buffer is None:
        return
    if bucket.pending is not None:
        bucket.pending.wait()  # a stage-3 prefetch in flight lands before the write
    if full is not None:
        buffer[slot.offset : slot.offset + slot.numel].copy_(full)
    elif target.optimizer.settings.stage == 3:
        begin, _ = bucket.layout.owned_range(target.optimizer.layout.shard_of(target.rank))
        buffer[begin + part.start : begin + part.stop].copy_(owned)


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor:
    """The full fp32 master weight of a trained parameter: a new fp32 tensor shaped like the
    parameter (its full shape at stage 3), on the compute device. DeepSpeed's
    deepspeed.utils.safe_get_full_fp32_param.

    Collective at stages 1-3 (an all-gather over the data-parallel group): every rank must call
    it, for the same parameters in the same order; none at stage 0 or world size 1. Raises
    ValueError for a frozen parameter or one no engine trains.
    """
    target = _target(param, "safe_get_full_fp32_param")
    with target.optimizer.resident(target.bucket):  # nvme: read from its file
        return _full(target, target.bucket.master, "safe_get_full_fp32_param")


def safe_get_full_grad(param: torch.nn.Parameter) -> torch.Tensor:
    """The full reduced gradient of a trained parameter: a new fp32 tensor shaped like the
    parameter, averaged over the data-parallel ranks and micro-batches, loss scale removed;
    what the optimizer step receives before gradient clipping. DeepSpeed's
    deepspeed.utils.safe_get_full_grad.

    Valid between engine.backward() of the micro-batch at the gradient accumulation boundary and
    engine.step(); raises RuntimeError at any other time (on every rank alike, before any
    collective). Collective at stages 1-3 like safe_get_full_fp32_param. Raises ValueError for a
    frozen parameter or one no engine trains.
    """
    target = _target(param, "safe_get_full_grad")
    return _full(target, _reduced_grad(target, "safe_get_full_grad"), "safe_get_full_grad")


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str):
    """The optimizer state `optim_state_key` ("exp_avg", "exp_avg_sq" for Adam) of a trained
    parameter: a new tensor shaped like the parameter, in the state's dtype (fp32); a scalar
    state ("step", shared by the parameter's bucket) is returned as it is (a copy). DeepSpeed's
    deepspeed.utils.safe_get_full_optimizer_state.

    Collective at stages 1-3 for per-element state, like safe_get_full_fp32_param. Raises
    KeyError naming the keys that exist when there is no such state (none before the first
    optimizer step; the same on every rank, before any collective), ValueError for a frozen
    parameter or one no engine trains.
    """
    caller = "safe_get_full_optimizer_state"
    target = _target(param, caller)
    with target.optimizer.resident(target.bucket):
        value = _state(target, optim_state_key, caller)
        if not _is_sharded(target, value):
            return _as_is(value)
        return _full(target, value, "safe_get_full_optimizer_state", optim_state_key)


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set a trained parameter's fp32 master weight to `value` (the full parameter's shape, any
    floating dtype, any device). Each rank writes its owned slice into its master weights, and
    the low-precision parameter the forward reads takes `value` cast to the compute dtype
    (stages 0-2: the whole parameter; stage 3: this rank's parameter shard, and the gathered
    parameter if its unit is gathered now). The next optimizer step starts from it. DeepSpeed's
    deepspeed.utils.safe_set_full_fp32_param.

    Every rank must call it with the same value (world size > 1: an agreement check compares a
    checksum of it; zero.RankMismatchError on every rank when the values differ, nothing
    written). Raises ValueError for a wrong shape, a frozen parameter or one no engine trains.
    """
    caller = "safe_set_full_fp32_param"
    target = _target(param, caller)
    flat = _full_value(target, value, caller)
    _enter(target, _SET, caller, "", flat)
    shard_part, param_part = _owned(target)
    with torch.no_grad(), target.optimizer.resident(target.bucket, write=True):
        target.bucket.master[shard_part].copy_(flat[param_part])
        _write_params(target, flat[param_part], flat)


def safe_set_full_optimizer_state(
    param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str
) -> None:
    """Set a trained parameter's per-element optimizer state `optim_state_key` ("exp_avg",
    "exp_avg_sq") to `value` (the full parameter's shape): each rank writes its owned slice.
    DeepSpeed's deepspeed.utils.safe_set_full_optimizer_state.

    Every rank must call it with the same value (checked as for safe_set_full_fp32_param).
    Raises KeyError when the state does not exist (before the first optimizer step),
    ValueError for a scalar state (it is shared by the parameter's whole bucket), a wrong
    shape, a frozen parameter or one no engine trains.
    """
    caller = "safe_set_full_optimizer_state"
    target = _target(param, caller)
    _writable_state(target, optim_state_key, caller)
    flat = _full_value(target, value, caller)
    _enter(target, _SET, caller, optim_state_key, flat)
    shard_part, param_part = _owned(target)
    with torch.no_grad(), target.optimizer.resident(target.bucket, write=True):
        state = _writable_state(target, optim_state_key, caller)
        state[shard_part].copy_(flat[param_part])


def _writable_state(target: _Target, key: str, caller: str) -> torch.Tensor:
    state = _state(target, key, caller)
    if not _is_sharded(target, state):
        raise ValueError(
            f"rank {target.rank}: zero.utils.{caller}: state '{key}' of parameter "
            f"'{target.slot.name}' is a scalar shared by every parameter of its bucket; only "
            "per-element state (shaped like the parameter) can be set per parameter"
        )
    return state


def safe_get_local_fp32_param(param: torch.nn.Parameter) -> torch.Tensor:
    """This rank's owned part of a trained parameter's fp32 master weight: a new 1-D fp32
    tensor of n elements (0 when this rank owns none of it; the whole parameter, flattened, at
    stage 0 or world size 1) on the compute device; the ranks' parts in rank order make up the
    flattened parameter. Not a collective. DeepSpeed's deepspeed.utils.safe_get_local_fp32_param.
    Raises ValueError for a frozen parameter or one no engine trains."""
    target = _target(param, "safe_get_local_fp32_param")
    with target.optimizer.resident(target.bucket):
        return _local(target, target.bucket.master)


def safe_get_local_grad(param: torch.nn.Parameter) -> torch.Tensor:
    """This rank's owned part of the reduced gradient (as safe_get_full_grad: averaged, loss
    scale removed): a new 1-D fp32 tensor, the part safe_get_local_fp32_param covers. Not a
    collective; valid in safe_get_full_grad's window, RuntimeError outside it. DeepSpeed's
    deepspeed.utils.safe_get_local_grad."""
    target = _target(param, "safe_get_local_grad")
    return _local(target, _reduced_grad(target, "safe_get_local_grad"))


def safe_get_local_optimizer_state(param: torch.nn.Parameter, optim_state_key: str):
    """This rank's owned part of per-element optimizer state: a new 1-D tensor (the part
    safe_get_local_fp32_param covers); a scalar state is returned as it is (a copy). Not a
    collective. Raises KeyError as safe_get_full_optimizer_state. DeepSpeed's
    deepspeed.utils.safe_get_local_optimizer_state."""
    caller = "safe_get_local_optimizer_state"
    target = _target(param, caller)
    with target.optimizer.resident(target.bucket):
        value = _state(target, optim_state_key, caller)
        return _local(target, value) if _is_sharded(target, value) else _as_is(value)


def safe_set_local_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set this rank's owned part of a trained parameter's fp32 master weight to `value` (n
    elements, n = safe_get_local_fp32_param(param).numel()), and the same part of this rank's
    low-precision parameter (cast to the compute dtype). Not a collective; ranks pass
    different values (their own parts). DeepSpeed's deepspeed.utils.safe_set_local_fp32_param.

    What the other ranks see: stages 1 and 2 keep a full copy of the parameter on every rank,
    and the other ranks' copies take this rank's part at the next optimizer step's all-gather
    (which all-gathers the updated masters); until then only this rank's copy has it. Stage 3:
    the next all-gather of the parameter's unit brings it to every rank. Stage 0: every rank
    owns the whole parameter, so every rank must set the same value or the ranks diverge.
    Raises ValueError for a wrong number of elements, a frozen parameter or one no engine
    trains.
    """
    caller = "safe_set_local_fp32_param"
    target = _target(param, caller)
    owned = _local_value(target, value, caller)
    with torch.no_grad(), target.optimizer.resident(target.bucket, write=True):
        target.bucket.master[_owned(target)[0]].copy_(owned)
        _write_params(target, owned, None)


def safe_set_local_optimizer_state(
    param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str
) -> None:
    """Set this rank's owned part of per-element optimizer state `optim_state_key` to `value`
    (n elements, as safe_set_local_fp32_param). Not a collective. DeepSpeed's
    deepspeed.utils.safe_set_local_optimizer_state. Raises KeyError when the state does not
    exist, ValueError for a scalar state, a wrong number of elements, a frozen parameter or
    one no engine trains."""
    caller = "safe_set_local_optimizer_state"
    target = _target(param, caller)
    _writable_state(target, optim_state_key, caller)
    owned = _local_value(target, value, caller)
    with torch.no_grad(), target.optimizer.resident(target.bucket, write=True):
        state = _writable_state(target, optim_state_key, caller)
        state[_owned(target)[0]].copy_(owned)
