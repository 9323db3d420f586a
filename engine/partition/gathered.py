"""zero.GatheredParameters: full parameters for reading or for a modification on one rank.

DeepSpeed's `deepspeed.zero.GatheredParameters(params, modifier_rank=None)`:

    with zero.GatheredParameters(model.embed.weight, modifier_rank=0):
        if rank == 0:
            model.embed.weight[3].zero_()        # the change reaches every rank on exit

On enter, the parameters' stage-3 units are all-gathered (stages 0-2 hold full parameters
already). On exit with `modifier_rank` set, the full values of that rank are broadcast and written
into every rank's owned slices (the low-precision shard and the fp32 master weights, so the next
optimizer step starts from them); then stage-3 units are released. Collective: every rank of the
data-parallel group enters and leaves the context together with the same parameters.

[Note: changes without modifier_rank]
Without modifier_rank nothing is published, yet at stages 1-2 in fp32 each rank's owned slice of
a parameter is its master weights' memory: a change one rank makes in place stays, in the
master slice that rank owns, and reaches every rank at the next step, while the rest of the
change is lost (half an edit, for good). At stage 0 every rank keeps its own change, so the
replicas drift apart; at stage 3 the gathered copy is dropped. So on exit every rank says
whether it changed a parameter of the context in place (its version counter moved; one
agreement check), and when any rank did, every rank raises RuntimeError naming the count and
the fix (modifier_rank), the same at every stage and precision. A training step inside the
block rewrites every parameter itself; the check is then skipped.
"""

import weakref
import zlib

import torch

from .init import hold, is_partitioned, unhold
from .units import UnitState

# id(param) -> the ZeroOptimizer that lays it out (weak, so engines can be garbage collected).
_OWNER: dict[int, weakref.ref] = {}


def register(optimizer) -> None:
    """Record which ZeroOptimizer owns each laid-out parameter, trainable or (stage 3) frozen
    (called by the Engine)."""
    ref = weakref.ref(optimizer)
    for bucket in laid_out_buckets(optimizer):
        for param in bucket.params:
            _OWNER[id(param)] = ref


def unregister(optimizer) -> None:
    """Forget the parameters `optimizer` lays out (Engine.close): zero.utils and
    GatheredParameters then treat them as a plain model's, never reading a closed engine's
    shards."""
    for bucket in laid_out_buckets(optimizer):
        for param in bucket.params:
            ref = _OWNER.get(id(param))
            if ref is not None and ref() is optimizer:
                del _OWNER[id(param)]


def owner(param):
    """The ZeroOptimizer that lays out `param` (trainable, or a stage-3 frozen parameter), or
    None when no live engine does (zero.utils reads shards through it)."""
    ref = _OWNER.get(id(param))
    return None if ref is None else ref()


def laid_out_buckets(optimizer) -> list:
    """Every bucket of a ZeroOptimizer: trainable, and at stage 3 frozen ones too."""
    return optimizer.gatherer.buckets if optimizer.gatherer is not None else optimizer.buckets


class GatheredParameters:
    """Context manager; params: one parameter or an iterable of them. Parameters zero does not
    partition (frozen ones below stage 3, or of a model without an engine) pass through
    unchanged. Parameters of a model built under zero.Init and not yet given to
    zero.initialize are gathered too, also inside an open zero.Init context (in a module's
    __init__), and stay gathered until the outermost context on them exits, where they are
    partitioned again from modifier_rank's full values (an inner context's modifier_rank when
    the outermost one's is None; rank 0's when none is set). Inner contexts on them communicate
    nothing, so rank 0 alone may open one (see [Note: held parameters] in init.py). Contexts
    nest: a unit stays gathered until the outermost one exits. Parameters of several engines
    in one process (a trained model beside a reference model or an EMA copy) are gathered by
    each engine that lays them out, engine by engine in the order of their first parameter.

    Inside the context, state_dict() of a stage-3 engine's model (or of any of its modules)
    communicates nothing, so one rank may call it alone, as in DeepSpeed's idiom for saving a
    peft adapter (GatheredParameters over the adapter's parameters on every rank, then
    model.save_pretrained() on rank 0): the parameters gathered here have their full values and
    the other partitioned parameters appear as their 0-element placeholders, as under DeepSpeed.

    Raises ValueError for a modifier_rank outside the data-parallel group.
    """

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None, enabled=True):
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in params if p is not None]
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._entered = []  # per engine: (optimizer, its params, held units or None, versions)
        self._init_params = []  # zero.Init parameters gathered by this context

    def _by_owner(self) -> list:
        """[(optimizer, params)] for each live engine laying out any of the parameters, in the
        order of their first parameter: the same on every rank, so every rank enters the
        engines' collectives in the same order (several engines in one process: a trained
        model beside a reference or EMA copy)."""
        groups: dict[int, tuple] = {}
        for param in self.params:
            optimizer = owner(param)
            if optimizer is not None:
                groups.setdefault(id(optimizer), (optimizer, []))[1].append(param)
        return list(groups.values())

    def __enter__(self):
        if not self.enabled:
            return self
        self._enter_init_params()
        for optimizer, params in self._by_owner():
            self._check_modifier(optimizer.comm.world_size)
            units = _enter_engine(optimizer, params)
            self._entered.append((optimizer, params, units, _versions(optimizer, params)))
        return self

    def __exit__(self, *exc):
        if not self.enabled:
            return False
        unhold(self._init_params, self.modifier_rank)
        entered, self._entered = self._entered, []
        try:
            for optimizer, params, _, versions in entered:
                if self.modifier_rank is not None:
                    method = "zero.GatheredParameters (exit, modifier_rank broadcast)"
                    _enter(optimizer, method, params, self.modifier_rank)
                    with torch.no_grad():
                        _publish_modification(optimizer, params, self.modifier_rank)
                elif exc[0] is None:  # no collective on an error path
                    _refuse_changes(optimizer, params, versions)
        finally:
            for optimizer, _, units, _ in entered:
                if units is not None:
                    optimizer.gatherer.gathered_contexts -= 1
                    optimizer.gatherer.unhold(units)
        return False

    def _check_modifier(self, world: int) -> None:
        if self.modifier_rank is not None and not 0 <= self.modifier_rank < world:
            raise ValueError(f"modifier_rank={self.modifier_rank} is outside 0..{world - 1}")

    def _enter_init_params(self) -> None:
        """Hold the zero.Init parameters (built partitioned, no engine yet), gathered or not:
        one an open zero.Init context gathered for construction code is held too, so that the
        context does not release it inside this block. Collective."""
        partitioned = [p for p in self.params if is_partitioned(p)]
        self._init_params = list({id(p): p for p in partitioned}.values())
        if self._init_params:
            self._check_modifier(self._init_params[0].zero_shard.comm.world_size)
        hold(self._init_params)


def _enter_engine(optimizer, params):
    """Gather and hold the stage-3 units of one engine's `params` (stages 0-2 hold them whole):
    the units held, or None below stage 3. Collective over that engine's group."""
    gatherer = optimizer.gatherer
    if gatherer is None:
        return None
    units = gatherer.units_of(params)
    if any(u.state is not UnitState.GATHERED for u in units):
        _enter(optimizer, "zero.GatheredParameters (enter)", params)
    gatherer.hold(units)
    gatherer.gathered_contexts += 1  # state_dict() inside reads, never gathers
    return units


def _enter(optimizer, method: str, params, modifier_rank=None) -> None:
    """Check that every rank enters `method` (comm.Agreement.enter) for the same buckets (the
    ones a modification is broadcast in) and modifier_rank; nothing at world size 1."""
    if optimizer.comm.agreement is None:
        return
    touched = [i for i, _ in _buckets_holding(optimizer, params)]
    optimizer.comm.agreement.enter(method, zlib.crc32(repr((touched, modifier_rank)).encode()))


def _versions(optimizer, params) -> tuple[list[int], int]:
    """The parameters' version counters and the count of the optimizer's own writes (steps)."""
    writes = sum(b.generation for b in laid_out_buckets(optimizer))
    return [p._version for p in params], writes


def _refuse_changes(optimizer, params, before: tuple[list[int], int]) -> None:
    """[Note: changes without modifier_rank]: RuntimeError on every rank when any rank changed
    one of `params` in place since the context gathered them. Collective (one agreement check;
    nothing at world size 1)."""
    versions, writes = _versions(optimizer, params)
    if writes != before[1]:
        return  # a step inside the block rewrote every parameter
    changed = [i for i, (v, w) in enumerate(zip(versions, before[0])) if v != w]
    count = float(bool(changed))
    if optimizer.comm.agreement is not None:
        method = "zero.GatheredParameters (exit, modifier_rank=None)"
        touched = [i for i, _ in _buckets_holding(optimizer, params)]
        count = optimizer.comm.agreement.enter(method, zlib.crc32(repr(touched).encode()), count)
    if not count:
        return
    for _, bucket in _buckets_holding(optimizer, params):
        if bucket.versions:  # stage 3: the gathered copy is dropped on release, without a 2nd error
            bucket.versions = [param._version for param in bucket.params]
    here = (
        f"this rank changed parameter {changed[0]} of the context (shape "
        f"{list(params[changed[0]].shape)})"
        if changed
        else "this rank changed none"
    )
    raise RuntimeError(
        f"rank {optimizer.comm.rank}: {int(count)} of {optimizer.comm.world_size} ranks changed "
        f"parameters in place inside zero.GatheredParameters without modifier_rank ({here}). "
        "Without modifier_rank nothing is published: at stages 1-2 in fp32 the master weights "
        "now hold part of the change, at stage 0 the ranks' replicas differ, at stage 3 it is "
        "dropped. Make changes under zero.GatheredParameters(params, modifier_rank=0) (rank "
        "0's values reach every rank), then load a checkpoint or redo the change that way"
    )


def _buckets_holding(optimizer, params) -> list:
    """(index, bucket) of the optimizer's buckets that hold any of `params`."""
    ids = {id(p) for p in params}
    buckets = laid_out_buckets(optimizer)
    return [(i, b) for i, b in enumerate(buckets) if any(id(p) in ids for p in b.params)]


def _publish_modification(optimizer, params, src: int) -> None:
    """Broadcast the buckets holding `params` from rank `src` and refresh the owned slices."""
    shard = optimizer.layout.shard_of(optimizer.comm.rank)
    for _, bucket in _buckets_holding(optimizer, params):
        optimizer.comm.broadcast(bucket.param_buffer, src=src)
        begin, end = bucket.layout.owned_range(shard)
        owned = bucket.param_buffer[begin:end]
        with optimizer.resident(bucket, write=True):  # shards and masters in nvme files too
            if bucket.param_shard.data_ptr() != owned.data_ptr():
                bucket.param_shard.copy_(owned)
            if bucket.master is not None and bucket.master is not bucket.param_shard:
                bucket.master.copy_(owned)
        bucket.versions = [param._version for param in bucket.params]  # published: not lost
