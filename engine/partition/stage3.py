"""ZeRO stage 3: parameters live only as shards and are gathered per fetch unit (paper, 5.3).

[Note: fetch units]
choose_units() walks the module tree from the root: a module whose parameters (its whole subtree)
number at most `threshold` elements, whose class is listed in stage3_module_classes, or that has
no children becomes one unit; a larger module recurses into its children, and its own direct
parameters form a unit of their own. Each unit's parameters are laid out together (FlatLayout
closes a bucket at every unit boundary), so gathering a unit is one all-gather per bucket.

[Note: parameter lifecycle]
A unit is SHARDED (each rank holds its 1/N slice; the module's parameters are 0-element
placeholders) or GATHERED (full parameters in a transient buffer). It is gathered by a forward
pre-hook, released by the forward hook, gathered again when the first gradient reaches its
outputs (a multi-grad hook registered during forward). In backward a trainable bucket is
released once every parameter of it has its gradient (the gradient is then in the
reduce-scatter buffer), and the unit's frozen buckets once its backward is over ([Note: frozen
weights in backward]). A forward that runs inside backward (an activation-checkpoint
recomputation) keeps its units gathered (its saved tensors are used at once, and backward
releases the units) and is not recorded as forward order. An in-place write to a gathered
parameter that a release would lose raises instead (_check_not_modified). A parameter used
outside its unit's forward (a tied lm_head weight, `h @ embed.weight.T` in a parent's forward) is
caught by UsageGuard, a TorchFunctionMode active during the outermost forward of any module of the
model: the root's (engine(...), engine.module(...), each step of generate()) or a submodule's
called on its own (generate() runs an encoder-decoder's encoder directly, whose embedding is
tied to `shared.weight`). It gathers the parameter's unit on the spot; a unit with trainable
parameters is pinned, so it stays gathered until the end of backward (of the outermost
forward, when none follows), where their gradients arrive; a frozen one goes with its own
forward's release, or with the end of the outermost forward or of backward. Gathering stays
per fetch unit. Reading a placeholder's dtype, device or requires_grad gathers nothing, and a
parametrization's no-op set_() is not a write ([Note: parametrized parameters]). Every batch
of all-gathers is checked across ranks first (comm.Agreement): a rank that runs a module
another rank skips makes every rank raise before the collectives differ (see docs/stages.md).

[Note: generation]
A forward without a backward to come (no grad, or eval mode) ends as engine(...) in eval mode
does: every unit is released and its order is kept for the next forward's prefetch, so each
step of generate() prefetches what the last step ran. Each step all-gathers every unit, so the
ranks must run the same number of steps: transformers' synced_gpus=True keeps a rank that has
finished running forwards until every rank has. A forward inside transformers' decoding loop with
synced_gpus=False (its default, unless it sees DeepSpeed's HfDeepSpeedConfig) that would
all-gather raises on every rank before its first all-gather, instead of leaving the ranks that
finish later waiting for the others (unsynced_generation); engine.generate() passes
synced_gpus=True. The loop's synced_gpus is read from the caller's frames, which is all that
says a forward belongs to it.

[Note: saved weights]
Layers save their weights for backward (a linear layer saves a view of its weight), and a saved
view would keep the whole gathered buffer alive from the unit's forward to its backward, so a
released unit would free nothing. During engine(...) saved-tensor hooks replace a saved tensor
that lies in a gathered buffer with a reference (bucket, offset, shape, strides); backward's
unpack gathers the unit again if needed and hands out the same view of the new buffer. Inside a
checkpointed region the checkpoint's own hooks apply instead (they save nothing). The hooks are
active in engine.backward too, so a reentrant checkpoint's recomputation, whose forward runs
inside backward with no hooks of its own, saves weights by reference as well: a unit released
before such a weight is used is gathered again instead of handing backward a placeholder. (A
non-reentrant recomputation saves through torch's hooks; see [Note: frozen weights in
backward].) Buffers are never freed in place, so a view that anyone else keeps stays valid (it
just keeps its memory).
"""

import contextlib
import enum
import logging
import sys
import weakref
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

from ..comm import Intent, describe_intent
from .ds_params import ZeroParamStatus, describe, set_status, set_tensor
from .init import full_numel, tensors_in
from .shared import bucket_values, check_params, collective_failure, host_copy

logger = logging.getLogger("zero")

# Modules made one fetch unit whatever their size (zero.utils.set_z3_leaf_modules).
_LEAF_MODULES: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def mark_leaf(module: torch.nn.Module) -> None:
    """Make `module` one fetch unit whatever its size (zero.utils.set_z3_leaf_modules)."""
    _LEAF_MODULES.add(module)


def is_leaf(module: torch.nn.Module) -> bool:
    """True for a module marked by zero.utils.set_z3_leaf_modules."""
    return module in _LEAF_MODULES


class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"  # all-gather in flight (prefetch)
    GATHERED = "gathered"


# DeepSpeed's ds_status of a unit's parameters in each state ([Note: attributes are views] in
# ds_params.py).
_PARAM_STATUS = {
    UnitState.SHARDED: ZeroParamStatus.NOT_AVAILABLE,
    UnitState.GATHERING: ZeroParamStatus.INFLIGHT,
    UnitState.GATHERED: ZeroParamStatus.AVAILABLE,
}


@dataclass
class Unit:
    """A fetch unit: a module and the trainable parameters gathered together for it.

    `state` changes only through to_gathering(), to_gathered() and to_sharded(), which check
    the state they start from and set DeepSpeed's ds_status of the unit's parameters to match;
    bucket_released() marks the parameters of one bucket released while the unit stays
    GATHERED (backward releases a trainable bucket once its gradients are in)."""

    index: int
    name: str
    module: torch.nn.Module
    buckets: list = field(default_factory=list)
    state: UnitState = UnitState.SHARDED
    pinned: bool = False  # gathered until the end of backward (used outside its forward)
    persistent: bool = False  # small parameters: gathered after every step, never released
    holds: int = 0  # open zero.GatheredParameters / state_dict() holds: never released then
    calls: int = 0  # observed calls (forward, reentrant recomputation) whose backward is not done
    untracked: bool = False  # completion cannot be observed ([Note: end of a unit's backward])
    backward: bool = False  # some call of this micro-batch has a backward (_has_backward)
    check: object = None  # comm.PendingCheck of its all-gather in flight, if predicted

    @property
    def frozen(self) -> bool:
        """Only frozen parameters: no gradients, so no rank has a backward for it."""
        return all(b.master is None for b in self.buckets)

    def to_gathering(self) -> None:
        """SHARDED -> GATHERING: the all-gathers of its buckets are launched."""
        self._move(UnitState.SHARDED, UnitState.GATHERING)

    def to_gathered(self) -> None:
        """GATHERING -> GATHERED: they finished; its parameters hold their full values."""
        self._move(UnitState.GATHERING, UnitState.GATHERED)

    def to_sharded(self) -> None:
        """GATHERED -> SHARDED: its buckets are released; its parameters are placeholders."""
        self._move(UnitState.GATHERED, UnitState.SHARDED)

    def bucket_released(self, bucket) -> None:
        """One of its buckets was released, the unit staying GATHERED until the rest go."""
        set_status(bucket.params, ZeroParamStatus.NOT_AVAILABLE)

    def _move(self, start: UnitState, end: UnitState) -> None:
        assert self.state is start, (self.name, self.state, end)
        self.state = end
        for bucket in self.buckets:
            set_status(bucket.params, _PARAM_STATUS[end])


def choose_units(
    model: torch.nn.Module,
    threshold: int,
    class_names=(),
    persist_below: int = 0,
    persist_total: int = sys.maxsize,
) -> tuple[list, dict]:
    """Split `model` into fetch units. Returns (units, unit index by id(param)) for non-empty
    parameters, trainable and frozen; a parameter shared by several modules belongs to the first
    unit that reaches it in module order. Parameters with fewer than `persist_below` elements
    (stage3_param_persistence_threshold) form one persistent unit that stays gathered, taken in
    module order while their total stays within `persist_total` elements
    (stage3_model_persistence_threshold)."""
    units: list[Unit] = []
    unit_of: dict[int, int] = {}
    small, total = [], 0
    for param in model.parameters():
        numel = full_numel(param)
        if 0 < numel < persist_below and total + numel <= persist_total:
            small.append(param)
            total += numel
    if small:
        units.append(Unit(0, "<persistent>", model, persistent=True))
        unit_of.update({id(p): 0 for p in small})

    def numel(module):
        return sum(full_numel(p) for p in module.parameters())

    def add(name, module, params):
        fresh = [p for p in params if full_numel(p) and id(p) not in unit_of]
        if fresh:
            for param in fresh:
                unit_of[id(param)] = len(units)
            units.append(Unit(len(units), name or "<root>", module))

    def visit(name, module):
        children = list(module.named_children())
        whole = not children or numel(module) <= threshold
        if whole or type(module).__name__ in class_names or is_leaf(module):
            add(name, module, module.parameters())
            return
        add(name, module, module.parameters(recurse=False))
        for child_name, child in children:
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", model)
    return units, unit_of


def persistent_unit(units: list) -> int | None:
    """The index of the persistent unit among choose_units()'s units, or None."""
    return next((u.index for u in units if u.persistent), None)


class ParamGatherer:
    """Gathers and releases units' parameters, prefetches, installs the module hooks.

    [Note: prefetch]
    The order in which units run forward is recorded during each step and used in the next: when
    a unit is fetched, the units that followed it last time (preceded it, in backward) are
    all-gathered asynchronously, up to `prefetch_numel` elements ahead
    (stage3_prefetch_bucket_size) and never above `max_live_numel` gathered elements
    (stage3_max_live_parameters). A step that runs units in another order stops prefetching at
    the first surprise and is recorded as the new order. Every rank records the same order, so
    prefetch all-gathers are issued in the same order everywhere. Collective throughout.

    [Note: reuse distance]
    A unit that runs forward in a training engine(...) call (grad enabled, module in train mode,
    not a recomputation inside backward) stays gathered after its forward when, in the recorded
    order, fewer than `max_reuse_numel` elements (stage3_max_reuse_distance; 0: never) are
    gathered between its last forward and its backward: twice the elements of the units that
    ran forward after it (their forward, then their backward). Its backward then all-gathers it
    no second time, and it is released as any unit, when its backward is over. DeepSpeed's
    default (1e9) keeps every unit of a model below half a billion elements gathered into
    backward (stage 3 moves 2 Psi instead of 3 Psi), the last units of a larger one. The decision
    depends only on the recorded order (each of its gathers agreed across ranks), the unit and
    the call, so ranks running the same forward keep the same units; a rank whose forward left
    the order gathers or skips what the others do not, and the agreement check of its next
    all-gather, or of the end of backward, stops every rank. A training forward first releases
    what an earlier forward kept for a backward that never came (release_kept): a rank that
    skipped its backward then all-gathers while the others end theirs, and every rank stops
    before stepping. step() releases a unit kept by a forward that no backward followed
    (refresh_gathered), so no forward reads pre-step values.
    """

    def __init__(
        self,
        root,
        units,
        comm,
        compute_dtype,
        device,
        prefetch_numel=0,
        max_live_numel=None,
        max_reuse_numel=0,
    ):
        self.root = root  # the model the units were chosen from
        self.units = units
        self.comm = comm
        self.compute_dtype = compute_dtype
        self.device = torch.device(device)  # where gathered parameters live
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.max_reuse_numel = max_reuse_numel
        self.keeping = False  # inside a training engine(...) call ([Note: reuse distance])
        self._reuse: dict[int, int] = {}  # unit index -> elements gathered until its backward
        self._kept: set[int] = set()  # units kept gathered for backward, not yet fetched there
        self.prefetch_hits = 0  # fetches that found their unit already being gathered
        self.busy = False  # inside our own ops: UsageGuard must not react to them
        self.buckets = []  # every bucket attached, trainable and frozen
        self._unit_of_param: dict[int, Unit] = {}
        self._gathered_storage: dict[int, object] = {}  # gathered buffer's data_ptr -> bucket
        self._hooks = []
        # multi-grad hooks on forward graphs not yet run ([Note: graph hooks and the engine's
        # lifetime]); weak: a graph dropped without backward takes its hook along
        self._grad_hooks: weakref.WeakSet = weakref.WeakSet()
        self._guard = None  # the UsageGuard of the outermost forward under way
        self._forward_depth = 0  # module forwards under way, nested (0: none)
        self._generation_synced = None  # synced_gpus of the decoding loop running; None: none
        self.gathered_contexts = 0  # open zero.GatheredParameters over this model's parameters
        self._told_placeholders = False  # state_dict_units logged its placeholders once
        self._order: list[int] = []  # unit indices in forward order, from the last step
        self._trace: list[int] = []  # this step's forward order
        self._cursor = {"forward": 0, "backward": 0}
        self.agreement = None  # comm.Agreement: gathers are checked across ranks first
        self._launched: list[tuple] = []  # this micro-batch's batches of all-gathers
        self._last_launched: list[tuple] = []  # the last micro-batch's ([Note: predicted...])
        self.on_unit_done = None  # callback(unit): its backward is complete on this rank
        self.param_swap = None  # zero.param_swap.ParamSwap: shards in nvme files
        self._read_cursor = {"forward": 0, "backward": 0}
        # hpZ ([Note: hpZ] in hierarchy.py): the secondary group, and per bucket (by id) its
        # secondary shard, whether it holds the current values, and gathers that will fill it.
        self.secondary = None
        self._secondary: dict[int, torch.Tensor] = {}
        self._secondary_valid: set[int] = set()
        self._filling_secondary: set[int] = set()
        # qwZ: partition/zeropp.QuantizedWeights, or None ([Note: quantized weights (qwZ)])
        self.quantized = None
        # MiCS's two-level all-gather over `comm` (comm.two_level.TwoLevelGather), or None
        # ([Note: MiCS] in hierarchy.py)
        self.two_level = None
        self._exact_gathers = False  # inside hold(): gathers are never quantized

    @contextlib.contextmanager
    def _own_ops(self):
        self.busy = True
        try:
            yield
        finally:
            self.busy = False

    def attach(self, buckets) -> None:
        """Bind each bucket (trainable and frozen) to its unit (bucket.layout.unit), release every
        parameter, gather the persistent unit and hook the others' modules."""
        self.buckets = list(buckets)
        for bucket in buckets:
            unit = self.units[bucket.layout.unit]
            unit.buckets.append(bucket)
            for param in bucket.params:
                self._unit_of_param[id(param)] = unit
            with self._own_ops():
                self._release_bucket(bucket)
        self._describe_params()
        for unit in self.units:
            if unit.persistent:
                self.fetch(unit)
                continue
            module = unit.module
            self._hooks.append(
                module.register_forward_pre_hook(self._pre_forward(unit), with_kwargs=True)
            )
            self._hooks.append(
                module.register_forward_hook(self._post_forward(unit), with_kwargs=True)
            )
        # The guard starts before any unit's pre-hook and ends after its release, in the forward
        # of any module that holds parameters (one without any uses none of ours).
        for module in self.root.modules():
            if next(module.parameters(), None) is None:
                continue
            self._hooks.append(module.register_forward_pre_hook(self._enter_guard, prepend=True))
            self._hooks.append(module.register_forward_hook(self._exit_guard, always_call=True))

    def _describe_params(self) -> None:
        """DeepSpeed's attributes on every parameter of the model (ds_params.py), units all
        SHARDED: ds_id, ds_shape, ds_numel, ds_status NOT_AVAILABLE, and ds_tensor, a 1-D view
        of the part of the bucket's shard that holds the parameter's elements this rank owns.

        [Note: ds_tensor at stage 3]
        DeepSpeed gives every rank ceil(numel / N) elements of each parameter, zero padded.
        zero shards buckets, not parameters: rank r owns the r-th 1/N of each bucket, so it owns
        a contiguous run of each parameter that may hold any number of its elements, none
        included; ds_tensor is that run (the ranks' runs, in rank order, are the flattened
        parameter, without padding), in the compute dtype, where the shard lives (host memory
        under offload_param "cpu"; with "nvme", a shard kept in a file gives a 0-element view,
        as DeepSpeed's ds_tensor is empty while swapped out). It is the shard itself, not a copy:
        the optimizer step updates it in place. A parameter with no elements is not
        partitioned: ds_status AVAILABLE, ds_tensor its own empty data."""
        for bucket in self.buckets:
            begin, end = bucket.layout.owned_range(self.comm.rank)
            for slot, param in zip(bucket.layout.slots, bucket.params):
                describe(param, slot.shape)
                lo, hi = max(begin, slot.offset), min(end, slot.offset + slot.numel)
                set_tensor(param, bucket.param_shard[lo - begin : max(lo, hi) - begin])
            set_status(bucket.params, ZeroParamStatus.NOT_AVAILABLE)
        for param in self.root.parameters():
            if self.unit_of(param) is None and param.numel() == 0:
                describe(param, param.shape)
                set_tensor(param, param.detach())
                set_status([param], ZeroParamStatus.AVAILABLE)

    def _enter_guard(self, module, args) -> None:
        """A module's forward begins. The outermost one (the root's, whether engine(...) called
        it or the script did: engine.module(...), each step of Hugging Face's generate(); or a
        submodule's called on its own, as generate() calls an encoder) starts UsageGuard, so a
        tied weight used outside its unit's forward is gathered either way ([Note: parameter
        lifecycle]), and reads whether it runs in a decoding loop ([Note: generation])."""
        if "parametrizations" in module._modules:
            self._accept_parametrized(module)
        self._forward_depth += 1
        if self._forward_depth > 1:
            return
        self._guard = UsageGuard(self)
        self._guard.__enter__()
        if self.comm.world_size > 1 and not torch.is_grad_enabled() and not _in_backward():
            self._generation_synced = _decoding_loop_synced()

    def _exit_guard(self, module, args, output) -> None:
        """The outermost forward ended (or raised): the guard stops. Without a backward to come
        (no grad, or eval mode) the units it pinned are released, and when no earlier forward
        waits for its backward either, the forward ends as engine(...) in eval mode does
        (release_all: [Note: generation])."""
        self._forward_depth -= 1
        if self._forward_depth > 0 or self._guard is None:
            return
        guard, self._guard = self._guard, None
        guard.__exit__(None, None, None)
        self._generation_synced = None
        if (torch.is_grad_enabled() and module.training) or _in_backward():
            return
        for unit in self.units:
            if unit.pinned:
                self.release(unit, force=True)
        waiting = self._kept or any(u.calls or u.backward for u in self.units)
        if not waiting:
            self.release_all()

    def _pre_forward(self, unit: Unit):
        def hook(module, args, kwargs):
            if _in_backward():  # a recomputation: not part of the forward order
                self.fetch(unit)
                if torch.is_grad_enabled() and self._saving_by_reference():
                    # a reentrant checkpoint's: backward runs through what it builds
                    self._watch_backward(unit, _inputs_requiring_grad(args, kwargs))
                return
            self._trace.append(unit.index)
            self.fetch(unit, "forward")
            if torch.is_grad_enabled():
                inputs = _inputs_requiring_grad(args, kwargs)
                unit.backward = unit.backward or _has_backward(unit, inputs)
                self._watch_backward(unit, inputs)

        return hook

    def _watch_backward(self, unit: Unit, inputs: list) -> None:
        """[Note: end of a unit's backward]
        Once the gradients of a call's inputs are computed, that call's backward is done:
        autograd runs AccumulateGrad nodes before any other ready node, so every gradient the
        call gives the unit's parameters has arrived. When the last call of the micro-batch is
        done the unit is complete: parameters without a gradient (an expert that got no
        tokens on this rank) count as zero, its buckets are reduce-scattered and it is released
        at the same point of backward on every rank, whatever the data routed where. A call
        with a leaf among its inputs (whose AccumulateGrad has the same priority as the
        parameters') cannot tell when the parameters' gradients are in, and a call without
        inputs that require grad has no such point: the unit then completes as its gradients
        arrive or at the end of backward. The leaf's gradient still marks the end of the
        call's backward for its frozen weights ([Note: frozen weights in backward])."""
        if not inputs:
            unit.untracked = True
            return
        if not (unit.frozen or all(t.grad_fn is not None for t in inputs)):
            unit.untracked = True
        unit.calls += 1
        self._on_grads(inputs, lambda: self._call_done(unit), "all")

    def _on_grads(self, tensors: list, callback, mode: str) -> None:
        """Call callback() in backward once the gradients of `tensors` are computed (mode "all":
        every one backward computes; "any": the first), then remove the hook.

        [Note: graph hooks and the engine's lifetime]
        torch keeps a multi-grad hook on the graph's nodes, and in mode "all" the hook's closure
        holds those nodes: a reference cycle through C++ that the cycle collector frees one
        node per collection, so the graph, and through `callback` this gatherer with every
        bucket and shard, outlived the engine by as many collections as the model has units
        (a leak per zero.initialize / close cycle). Each hook removes itself once it ran, and
        close() removes those of a forward whose backward never came, so a graph the script
        keeps (its last loss) holds nothing of the engine."""
        handle = None

        def run(grads):
            handle.remove()
            callback()

        handle = torch.autograd.graph.register_multi_grad_hook(tensors, run, mode=mode)
        self._grad_hooks.add(handle)

    def close(self) -> None:
        """Remove every hook this gatherer added to the model and to forward graphs
        (Engine.close). Not a collective."""
        for handle in [*self._hooks, *self._grad_hooks]:
            handle.remove()
        self._hooks.clear()
        self._grad_hooks.clear()

    def _call_done(self, unit: Unit) -> None:
        unit.calls -= 1
        if unit.calls or unit.pinned or unit.persistent or unit.holds:
            return
        if unit.untracked:  # the trainable buckets complete as their gradients arrive
            self._release_frozen_when_done(unit)
            return
        if self.on_unit_done is not None:
            self.on_unit_done(unit)
        self.release(unit)

    def _post_forward(self, unit: Unit):
        def hook(module, args, kwargs, output):
            tensors = list(tensors_in(output))
            constant = any(t.is_floating_point() and not t.requires_grad for t in tensors)
            if constant and torch.is_grad_enabled() and not _in_backward():
                output = self._keep_in_backward(unit, _inputs_requiring_grad(args, kwargs), output)
                tensors = list(tensors_in(output))
            outputs = [t for t in tensors if t.requires_grad]
            inputs = _inputs_requiring_grad(args, kwargs)
            if outputs and torch.is_grad_enabled() and _has_backward(unit, inputs):
                self._on_grads(outputs, lambda: self.fetch(unit, "backward"), "any")
            if _in_backward():  # a recomputation's saved tensors are about to be used
                return output
            if self._keeps(unit):
                self._kept.add(unit.index)
            else:
                self.release(unit)
            return output

        return hook

    def _keeps(self, unit: Unit) -> bool:
        """Whether `unit`, at the end of a forward call, stays gathered for its backward ([Note:
        reuse distance])."""
        if not (self.keeping and unit.backward and torch.is_grad_enabled()):
            return False
        return self._reuse.get(unit.index, self.max_reuse_numel) < self.max_reuse_numel

    def _keep_in_backward(self, unit: Unit, inputs: list, output):
        """A floating-point output that does not require grad on this rank (a mixture-of-experts
        block none of whose experts got a token here returns zeros, beside router logits that
        may not reach the loss) would skip the unit's backward all-gather, and the backward of
        the units that computed its inputs, that ranks where it does require grad make. Such
        outputs are returned through an identity that depends on the call's inputs and gives
        them zero gradients, so every rank runs the same units' backward in the same order (the
        values are those without it)."""
        if unit.frozen:
            return output
        anchors = inputs or [torch.zeros((), requires_grad=True)]

        def keep(tensor):
            return tensor if tensor.requires_grad else _KeepInBackward.apply(tensor, *anchors)

        with self._own_ops():
            return _map_floats(output, keep)

    def fetch(self, unit: Unit, direction: str | None = None) -> None:
        """Make `unit` GATHERED (waiting for a prefetch in flight), and prefetch what followed it
        last time in `direction` ("forward" or "backward"; None: no prefetch). The all-gathers
        this starts are checked across ranks first (one Agreement.check for all of them)."""
        launch = [unit] if unit.state is UnitState.SHARDED else []
        if unit.state is UnitState.GATHERING:
            self.prefetch_hits += 1
        if direction == "backward" and unit.index in self._kept:
            self._kept.discard(unit.index)
            self.comm.ledger.kept += _unit_numel(unit, trainable=True)
        if direction is not None and self.prefetch_numel > 0:
            launch += self._prefetch_plan(unit, direction, launch)
        if launch and self._generation_synced is False:
            raise unsynced_generation(self.comm.rank, self.comm.world_size, launch[0])
        with self._own_ops():  # the gathers would overwrite what the script put there
            for bucket in (b for upcoming in launch for b in upcoming.buckets):
                check_params(bucket, self.compute_dtype, self.comm.rank)
        if launch:
            pending = self._agree_on(tuple(u.index for u in launch))
            backward = direction == "backward" or _in_backward()
            for upcoming in launch:
                self._start_gather(upcoming, backward)
                upcoming.check = pending
        if direction is not None and self.param_swap is not None:
            self._read_ahead(unit, direction)
        if unit.state is UnitState.GATHERING:
            if unit.check is not None:
                unit.check.finish()  # before using (or waiting for) what was gathered
                unit.check = None
            with self._own_ops():
                for bucket in unit.buckets:
                    try:
                        _finish_gather_bucket(bucket)
                    except RuntimeError as error:
                        what = f"the all-gather of unit '{unit.name}'"
                        raise collective_failure(self.comm.rank, what, error) from error
                    if self.param_swap is not None:
                        self.param_swap.release(bucket)  # the all-gather has read the shard
                    self._keep_secondary(bucket)
            unit.to_gathered()

    def _read_ahead(self, unit: Unit, direction: str) -> None:
        """Start reading from nvme the parameter shards of the units that followed `unit`
        last time (preceded it, in backward), into free buffers, in that order ([Note:
        parameter shards on nvme] in engine/offload/param_swap.py). Local: no collective."""
        order = self._order if direction == "forward" else self._order[::-1]
        try:
            position = order.index(unit.index, self._read_cursor[direction])
        except ValueError:
            return
        self._read_cursor[direction] = position + 1
        for index in order[position + 1 :]:
            upcoming = self.units[index]
            if upcoming.state is not UnitState.SHARDED:
                continue
            if direction == "backward" and not upcoming.backward:
                continue
            for bucket in upcoming.buckets:
                if not self.param_swap.start_read(bucket):
                    return  # no free buffer

    def _agree_on(self, indices: tuple):
        """Check a batch of all-gathers across ranks. [Note: predicted batches] A batch equal
        to the one launched at the same position of the last micro-batch (every rank knows the
        same history: each batch of it was agreed) is checked while its all-gathers run, and
        the check is finished before the first of them is used; any other batch is checked
        before it is launched. A rank whose batch differs from the prediction therefore never
        launches it, and the ranks that launched the predicted one learn of the difference
        before they wait for it, so differing all-gathers never run. Returns the check in
        flight, or None."""
        position = len(self._launched)
        self._launched.append(indices)
        if self.agreement is None:
            return None
        predicted = position < len(self._last_launched) and self._last_launched[position] == indices
        if predicted and len(indices) <= self.agreement.SLOTS - 3:
            return self.agreement.start(Intent.GATHER, indices)
        self.agreement.check(Intent.GATHER, indices)
        return None

    def _start_gather(self, unit: Unit, backward: bool = False) -> None:
        with self._own_ops():
            for bucket in unit.buckets:
                self._start_gather_bucket(bucket, unit, backward)
        unit.to_gathering()

    def _start_gather_bucket(self, bucket, unit: Unit, backward: bool = False) -> None:
        """All-gather the bucket into a fresh buffer on the device; an offloaded (host) shard is
        copied there first (asynchronously when pinned). hpZ: in `backward`, from the secondary
        shards over the secondary group when they hold the current values; otherwise from the
        primary shards, and the secondary shard is refilled from the result. MiCS with
        mics_hierarchical_params_gather: in two levels (`two_level`, [Note: MiCS] in
        hierarchy.py); qwZ's quantized gathers stay flat."""
        buffer = torch.empty(
            bucket.layout.padded_numel, dtype=self.compute_dtype, device=self.device
        )
        if self.secondary is not None and backward and id(bucket) in self._secondary_valid:
            bucket.pending = self.secondary.all_gather(
                buffer, self._secondary[id(bucket)], async_op=True
            )
            self._count_frozen(bucket, buffer)
            bucket.param_buffer = buffer
            self._gathered_storage[buffer.untyped_storage().data_ptr()] = bucket
            return
        if self.secondary is not None:
            self._filling_secondary.add(id(bucket))
        shard = bucket.param_shard
        if self.param_swap is not None and self.param_swap.swapped(bucket):
            shard = self.param_swap.acquire(bucket)  # released when the all-gather finished
        if shard.device != self.device:
            shard = shard.to(self.device, non_blocking=shard.is_pinned())
        if self._quantizes(bucket, unit):
            bucket.pending = self.quantized.all_gather(self.comm, buffer, shard)
        elif self.two_level is not None:
            bucket.pending = self.two_level.all_gather(buffer, shard, async_op=True)
        else:
            bucket.pending = self.comm.all_gather(buffer, shard, async_op=True)
        self._count_frozen(bucket, buffer)
        bucket.param_buffer = buffer
        self._gathered_storage[buffer.untyped_storage().data_ptr()] = bucket

    def _quantizes(self, bucket, unit: Unit) -> bool:
        """qwZ: whether this gather of `bucket` is quantized ([Note: quantized weights (qwZ)]
        in zeropp.py): not for the persistent unit nor inside hold()."""
        if self.quantized is None or unit.persistent or self._exact_gathers:
            return False
        return self.quantized.applies(bucket)

    def _count_frozen(self, bucket, buffer) -> None:
        if bucket.master is None and self.comm.world_size > 1:  # frozen: not in Psi
            self.comm.ledger.frozen += buffer.numel()

    def _keep_secondary(self, bucket) -> None:
        """hpZ: after a primary all-gather landed, keep this rank's 1/k slice of the bucket
        (k = the secondary group's size) as its secondary shard ([Note: hpZ] in hierarchy.py).
        The slice's buffer is made once and reused. Not a collective."""
        if id(bucket) not in self._filling_secondary:
            return
        self._filling_secondary.discard(id(bucket))
        size = bucket.layout.padded_numel // self.secondary.world_size
        begin = self.secondary.rank * size
        kept = self._secondary.get(id(bucket))
        if kept is None:
            kept = self._secondary[id(bucket)] = torch.empty(
                size, dtype=self.compute_dtype, device=self.device
            )
        kept.copy_(bucket.param_buffer[begin : begin + size])
        self._secondary_valid.add(id(bucket))

    def secondary_bytes(self) -> int:
        """hpZ: bytes of this rank's secondary parameter shards (0 without hpZ, and before the
        first forward). Not a collective."""
        return sum(t.numel() * t.element_size() for t in self._secondary.values())

    def _release_bucket(self, bucket) -> None:
        if bucket.param_buffer is not None:
            check_params(bucket, self.compute_dtype, self.comm.rank)
            self._check_not_modified(bucket)
            self._gathered_storage.pop(bucket.param_buffer.untyped_storage().data_ptr(), None)
        placeholder = torch.empty(0, dtype=bucket.param_shard.dtype, device=self.device)
        for param in bucket.params:
            param.data = placeholder
        bucket.param_buffer = None

    def _check_not_modified(self, bucket) -> None:
        """Raise if a gathered parameter was written in place since it was gathered (or since a
        zero.GatheredParameters modification was published): releasing it would lose the write,
        which never reaches the shards and fp32 master weights."""
        for param, version in zip(bucket.params, bucket.versions):
            if param._version != version:
                unit = self.units[bucket.layout.unit]
                names = (n for n, p in unit.module.named_parameters() if p is param)
                raise RuntimeError(
                    f"rank {self.comm.rank}: parameter '{next(names, '?')}' of unit "
                    f"'{unit.name}' was modified in place while gathered: during a forward "
                    "(nn.Embedding(max_norm=...) renormalizes rows in place), by "
                    "load_state_dict(), or under zero.GatheredParameters without modifier_rank. "
                    "Under ZeRO stage 3 the gathered copy never reaches the shards and fp32 "
                    "master weights, so the change would be lost; make it outside forward under "
                    "zero.GatheredParameters(params, modifier_rank=0), or use stage 0-2"
                )

    def saved_weights(self):
        """Saved-tensor hooks for engine(...): see [Note: saved weights]. Hooks the caller
        installed around engine(...) (torch.autograd.graph.save_on_cpu) still handle every other
        saved tensor."""
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        outer_pack, outer_unpack = outer or (None, None)

        def pack(tensor):
            saved = self._pack(tensor)
            if saved is not tensor:
                return saved
            if outer_pack is not None:
                return _OuterSaved(outer_pack(tensor))
            # Not the tensor itself: an output saved by its own node would hold that node
            # through its grad_fn, a cycle through C++ the collector never frees (the graph of
            # a forward without backward would stay). Torch saves such outputs without grad_fn.
            return tensor.detach()

        def unpack(saved):
            if isinstance(saved, _OuterSaved):
                return outer_unpack(saved.value)
            return self._unpack(saved)

        pack.gatherer = self  # see _saving_by_reference
        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _saving_by_reference(self) -> bool:
        """True when tensors saved now go through saved_weights()'s hooks. Inside backward that
        means a reentrant checkpoint's recomputation, whose graph a nested backward runs; torch's
        non-reentrant recomputation saves through its own hooks, and its graph never runs."""
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        return top is not None and getattr(top[0], "gatherer", None) is self

    def _pack(self, tensor):
        if tensor.layout is not torch.strided or tensor.device != self.device:
            return tensor
        bucket = self._gathered_storage.get(tensor.untyped_storage().data_ptr())
        if bucket is None or tensor.dtype != bucket.param_buffer.dtype:
            return tensor
        offset, shape, stride = tensor.storage_offset(), tensor.shape, tensor.stride()
        return _SavedWeight(bucket, offset, shape, stride, bucket.generation)

    def _unpack(self, saved):
        if not isinstance(saved, _SavedWeight):
            return saved
        bucket = saved.bucket
        if saved.generation != bucket.generation:
            raise self._stale(saved)
        if bucket.param_buffer is None or bucket.pending is not None:
            unit = self.units[bucket.layout.unit]
            if bucket.param_buffer is None and unit.state is not UnitState.SHARDED:
                # Released after its gradients arrived, yet a use without gradient needs it.
                self.release(unit, force=True)
            self.fetch(unit)
        return bucket.param_buffer.as_strided(saved.shape, saved.stride, saved.offset)

    def _stale(self, saved) -> RuntimeError:
        """The error for a weight saved before its shard was written ([Note: stale graphs] in
        stages.py), in torch's words for a plain model, naming the parameter."""
        slots = saved.bucket.layout.slots
        name = next((s.name for s in slots if s.offset <= saved.offset < s.offset + s.numel), "?")
        return RuntimeError(
            f"rank {self.comm.rank}: one of the variables needed for gradient computation has "
            f"been modified by an inplace operation: parameter '{name}' was updated (by "
            "engine.step() or a checkpoint load) after the forward that saved it for this "
            "backward. A loss computed before engine.step() cannot be backpropagated after it, "
            "with retain_graph=True neither (torch refuses it for a plain model too); compute "
            "the loss again after the step"
        )

    def _prefetch_plan(self, unit: Unit, direction: str, launching: list) -> list:
        """The units to all-gather ahead of use after fetching `unit` (see [Note: prefetch]).
        The plan depends only on the recorded order and on which units are gathered, both the
        same on every rank."""
        order = self._order if direction == "forward" else self._order[::-1]
        cursor = self._cursor[direction]
        try:
            position = order.index(unit.index, cursor)
        except ValueError:
            self._cursor[direction] = len(order)  # the order changed: no more guesses this step
            return []
        self._cursor[direction] = position + 1
        planned = {u.index for u in launching}

        def state(u):
            return UnitState.GATHERING if u.index in planned else u.state

        # Units already in flight count against the look-ahead, so at most prefetch_numel
        # elements are prefetched and not yet used, however many fetches come in between.
        budget = self.prefetch_numel
        live = sum(_unit_numel(u) for u in self.units if state(u) is not UnitState.SHARDED)
        plan = []
        for index in order[position + 1 :]:
            upcoming = self.units[index]
            if direction == "backward" and not upcoming.backward:
                continue
            size = _unit_numel(upcoming)
            if state(upcoming) is UnitState.GATHERING:
                budget -= size
            if state(upcoming) is not UnitState.SHARDED:
                continue
            too_many = self.max_live_numel is not None and live + size > self.max_live_numel
            if size > budget or too_many:
                break
            plan.append(upcoming)
            planned.add(index)
            budget -= size
            live += size
        return plan

    def release(self, unit: Unit, force: bool = False) -> None:
        """Free the unit's gathered parameters, unless it is persistent, held (hold()) or, without
        `force`, pinned until the end of backward."""
        if unit.persistent or unit.holds or (unit.pinned and not force):
            return
        if unit.state is UnitState.GATHERING:
            self.fetch(unit)  # a prefetch in flight must land before its buffer is freed
        if unit.state is UnitState.GATHERED:
            with self._own_ops():
                for bucket in unit.buckets:
                    self._release_bucket(bucket)
            unit.to_sharded()
        unit.pinned = False
        self._kept.discard(unit.index)

    def release_bucket_after_backward(self, bucket) -> None:
        """All gradients of the trainable bucket arrived, so backward uses its parameters no more:
        release it, and the unit's frozen buckets once they are not needed either."""
        unit = self.units[bucket.layout.unit]
        if unit.pinned or unit.persistent or unit.holds:
            return
        with self._own_ops():
            self._release_bucket(bucket)
        unit.bucket_released(bucket)
        self._release_frozen_when_done(unit)

    def _release_frozen_when_done(self, unit: Unit) -> None:
        """[Note: frozen weights in backward]
        A frozen weight has no gradient that says its backward is done, and backward may need
        it after every trainable parameter of its unit has its gradient (LoRA: the adapters'
        gradients arrive before the frozen norm in front of them is differentiated). It is
        normally saved as a reference into its bucket ([Note: saved weights]), but an
        activation-checkpoint recomputation inside backward saves it as the parameter itself
        (torch's non-reentrant checkpoint keeps tensors that do not require grad as they are),
        so a release would leave backward a 0-element placeholder. The frozen buckets are
        therefore released only when the unit's backward is over: every trainable bucket has
        all its gradients and every observed call of the unit has the gradients of its inputs
        ([Note: end of a unit's backward]); a call that could not be observed (no input
        requires grad) needs none. Otherwise they go at the end of backward."""
        trainable_done = all(b.param_buffer is None for b in unit.buckets if b.master is not None)
        if unit.calls or not trainable_done or unit.state is not UnitState.GATHERED:
            return
        with self._own_ops():
            for bucket in unit.buckets:
                self._release_bucket(bucket)
        unit.to_sharded()

    def hold(self, units) -> None:
        """Gather `units` (in index order) and keep them gathered until unhold(): for
        zero.GatheredParameters and module.state_dict(). Holds nest. Collective."""
        self._exact_gathers = True  # qwZ: what a script reads or saves is the real weight
        try:
            for unit in sorted(units, key=lambda u: u.index):
                self.fetch(unit)
                unit.holds += 1
        finally:
            self._exact_gathers = False

    def unhold(self, units) -> None:
        """End one hold() of each of `units`; a unit no longer held is released."""
        for unit in units:
            unit.holds -= 1
            assert unit.holds >= 0, unit.name
            self.release(unit, force=True)

    def release_all(self) -> None:
        """End of backward, or of a forward without backward: release every unit but the
        persistent one, and keep this step's forward order for the next step's prefetch."""
        for unit in self.units:
            self.release(unit, force=True)
            unit.calls, unit.untracked, unit.backward = 0, False, False
        if self._trace:
            self._order, self._trace = self._trace, []
            self._reuse = self._reuse_distances()
        self._cursor = {"forward": 0, "backward": 0}
        self._read_cursor = {"forward": 0, "backward": 0}
        if self.param_swap is not None:
            self.param_swap.drop_read_ahead()  # the step is about to change the shards
        if self._launched:  # a second call in a row keeps the history (engine(...) in eval)
            self._last_launched, self._launched = self._launched, []
        self._secondary_valid.clear()  # hpZ: the next forward refills them ([Note: hpZ])

    def release_kept(self) -> None:
        """Release the units a training forward kept for a backward that has not come (another
        training forward came first). Each training forward then all-gathers, and agrees on,
        every unit it runs, so a rank that skipped a backward (`if not loss.isfinite():
        continue` on one rank) is caught at its next forward, before any rank steps ([Note:
        reuse distance]). Collective only through the units' later gathers."""
        for index in sorted(self._kept):
            self.release(self.units[index])

    def _reuse_distances(self) -> dict[int, int]:
        """Per unit of the recorded order: the elements gathered between its last forward and
        its backward, twice those of the units that ran forward after it ([Note: reuse
        distance])."""
        distances, after = {}, 0
        for index in reversed(self._order):
            distances.setdefault(index, 2 * after)
            after += _unit_numel(self.units[index])
        return distances

    def forget_writes(self) -> None:
        """Accept in-place writes to gathered parameters without an error: a checkpoint load is
        about to replace their values from the shards."""
        for bucket in self.buckets:
            if bucket.param_buffer is not None:
                bucket.versions = [param._version for param in bucket.params]

    def refresh_gathered(self) -> None:
        """The shards changed (an optimizer step, zero.load_pretrained): gather the persistent
        unit's new values, and release any other unit still gathered, whose values are stale
        (a forward through engine.module between backward and step leaves its prefetched units
        gathered); the next forward gathers them anew. release() keeps units held by
        GatheredParameters. Collective."""
        self._secondary_valid.clear()  # hpZ: the shards changed
        for unit in self.units:
            if not unit.persistent:
                if unit.state is not UnitState.SHARDED:
                    self.release(unit, force=True)
                continue
            with self._own_ops():
                for bucket in unit.buckets:
                    self._release_bucket(bucket)
            unit.to_sharded()
            self.fetch(unit)

    def unit_of(self, param) -> Unit | None:
        return self._unit_of_param.get(id(param))

    def _accept_parametrized(self, module) -> None:
        """[Note: parametrized parameters]
        torch.nn.utils.parametrize.register_parametrization calls param.set_(param) on the
        parameter it moves into `module.parametrizations` (peft's LoRA on a parameter, such as
        stacked experts' 3-D weights, registers one around every forward of the module). That
        raises the version counter without changing a value, and set_ bypasses torch function
        modes, so the write check (_check_not_modified) is told here instead: when `module`'s
        forward begins, a gathered parameter under a parametrization that still views its
        place in the gathered buffer takes its current version as its gathered value's. A
        set_() to other storage (a right_inverse that computes new values) is not accepted
        and raises at release as any lost write does."""
        with self._own_ops():
            for parametrization in module.parametrizations.values():
                self._accept_versions(parametrization._parameters.values())

    def _accept_versions(self, params) -> None:
        for param in params:
            unit = self.unit_of(param) if param is not None else None
            if unit is None or unit.state is not UnitState.GATHERED:
                continue
            for bucket in unit.buckets:
                for index, (slot, held) in enumerate(zip(bucket.layout.slots, bucket.params)):
                    if held is param and _views_slot(param, bucket, slot):
                        bucket.versions[index] = param._version

    def state_dict_units(self, params) -> tuple[list, bool]:
        """(units, gathers) for a state_dict() over `params`: the units it holds while it runs,
        and whether holding them all-gathers (a collective). Inside an open
        zero.GatheredParameters over this model's parameters it holds only the units already
        gathered and gathers nothing, so one rank may call it alone (DeepSpeed's idiom:
        GatheredParameters over a peft adapter's parameters, then save_pretrained on rank 0):
        the other partitioned parameters then appear as their 0-element placeholders, as
        DeepSpeed's state_dict() gives them."""
        units = self.units_of(params)
        if not self.gathered_contexts:
            return units, any(u.state is not UnitState.GATHERED for u in units)
        gathered = [u for u in units if u.state is UnitState.GATHERED]
        if len(gathered) < len(units) and not self._told_placeholders:
            self._told_placeholders = True
            left = next(u for u in units if u.state is not UnitState.GATHERED)
            logger.info(
                "state_dict() inside zero.GatheredParameters gathers nothing (one rank may call "
                "it alone): the parameters of %d fetch units it does not hold (e.g. '%s') appear "
                "as 0-element placeholders, as under DeepSpeed; hold them too for their values",
                len(units) - len(gathered),
                left.name,
            )
        return gathered, False

    def units_of(self, params) -> list:
        """The units holding `params` (parameters zero does not lay out are skipped), each once."""
        found = {id(u): u for p in params if (u := self.unit_of(p)) is not None}
        return list(found.values())

    def describe(self, kind: int, ident: int) -> str:
        """Words for an intent another rank sent (comm.Agreement)."""
        if kind == Intent.GATHER and 0 <= ident < len(self.units):
            unit = self.units[ident]
            numel = _unit_numel(unit)
            return (
                f"all-gathers stage-3 unit '{unit.name}' ({type(unit.module).__name__}, "
                f"{numel:,} elements)"
            )
        return describe_intent(kind, ident)

    def hint(self, a: tuple, b: tuple) -> str:
        """The fix for two ranks' differing intents `a`, `b` ((kind, ident) each) when a
        module chooses its children by data (a mixture of experts); "" otherwise."""
        gathered = [
            self.units[ident]
            for kind, ident in (a, b)
            if kind == Intent.GATHER and ident is not None and 0 <= ident < len(self.units)
        ]
        chooser = _chooser(self.root, gathered)
        if chooser is None:
            return ""
        name, module = chooser
        cls = type(module).__name__
        return (
            f"'{name}' ({cls}) runs different children on different ranks, as a mixture of "
            f"experts routes tokens by data: make it one fetch unit with "
            f'"stage3_module_classes": ["{cls}"] in zero_optimization, or call '
            f"zero.utils.set_z3_leaf_modules(model, [{cls}]) before zero.initialize. If the "
            "branch is not meant to differ, make it the same on every rank (see docs/stages.md)."
        )


class FrozenShards:
    """Stage 3: frozen parameters, partitioned like trainable ones (paper, 5.3: every parameter
    lives as a 1/N shard) but without gradients, master weights or optimizer state.

    They are laid out per fetch unit in their own FlatLayout (same bucket and padding rules) and
    gathered and released with their unit. `buckets` hold `param_shard` ((shard_numel,), compute
    dtype) and, while gathered, `param_buffer`; `master` is None. Collective construction.
    """

    def __init__(
        self,
        named,
        bucket_numel: int,
        comm,
        unit_of: dict,
        dtype: torch.dtype,
        offload: bool = False,
        pin_memory: bool = False,
        param_swap=None,
    ):
        from .flat import FlatLayout

        self.comm = comm
        self.param_swap = param_swap  # zero.param_swap.ParamSwap: shards in nvme files
        self.device = named[0][1].device  # the compute device, where gathering happens
        self.layout = FlatLayout([named], bucket_numel, comm.world_size, unit_of)
        by_name = dict(named)
        self.buckets = []
        self._place: dict[int, tuple] = {}
        for layout in self.layout.buckets:
            bucket = _FrozenBucket(layout, [by_name[slot.name] for slot in layout.slots])
            full = bucket_values(layout, bucket.params, dtype, self.device)
            for slot, param in zip(layout.slots, bucket.params):
                self._place[id(param)] = (bucket, slot)
            begin, end = layout.owned_range(comm.rank)
            bucket.param_shard = full[begin:end].clone()
            if param_swap is not None:  # offload_param.device "nvme"
                param_swap.adopt(bucket, bucket.param_shard)
            elif offload and self.device.type != "cpu":  # offload_param: the shard on the host
                bucket.param_shard = host_copy(bucket.param_shard, pin_memory)
            self.buckets.append(bucket)

    def full_shape(self, param) -> tuple | None:
        """The shape of a partitioned frozen parameter, None for any other tensor."""
        place = self._place.get(id(param))
        return None if place is None else place[1].shape

    def full_values(self, dst: int = 0) -> dict[int, torch.Tensor]:
        """id(param) -> full value on the host, on rank `dst` (empty elsewhere). All-gathers one
        bucket at a time. Collective."""
        values = {}
        for bucket in self.buckets:
            with self._resident(bucket):
                shard = bucket.param_shard.to(self.device)
                full = torch.empty(
                    bucket.layout.padded_numel, dtype=shard.dtype, device=self.device
                )
                self.comm.all_gather(full, shard)
            if self.comm.rank == dst:
                for slot, param in zip(bucket.layout.slots, bucket.params):
                    piece = full[slot.offset : slot.offset + slot.numel]
                    values[id(param)] = piece.view(slot.shape).cpu().clone()
        return values

    def write(self, param, value: torch.Tensor) -> None:
        """Store the owned part of `value` (the full parameter) in this rank's shard."""
        bucket, slot = self._place[id(param)]
        begin, end = bucket.layout.owned_range(self.comm.rank)
        lo, hi = max(begin, slot.offset), min(end, slot.offset + slot.numel)
        if lo < hi:
            with self._resident(bucket, write=True):
                flat = value.reshape(-1).to(bucket.param_shard.dtype)
                bucket.param_shard[lo - begin : hi - begin].copy_(
                    flat[lo - slot.offset : hi - slot.offset]
                )

    def _resident(self, bucket, write: bool = False):
        if self.param_swap is None:
            return contextlib.nullcontext()
        return self.param_swap.resident(bucket, write)


class _FrozenBucket:
    def __init__(self, layout, params):
        self.layout = layout
        self.params = params
        self.param_shard = None
        self.param_buffer = None
        self.pending = None
        self.versions = []  # parameters' version counters when last gathered
        self.generation = 0  # values written into the shard ([Note: stale graphs], stages.py)
        self.master = None


def _chooser(root: torch.nn.Module, units: list) -> tuple | None:
    """(name, module) of the module that, by the look of it, picks some of `units` by data: the
    deepest ancestor of either unit that holds the unit's branch in a ModuleList / ModuleDict of
    several modules of one class (experts); else the closest common ancestor of two units that
    is neither the root nor a ModuleList / ModuleDict. None when there is none."""
    modules = dict(root.named_modules())
    containers = (torch.nn.ModuleList, torch.nn.ModuleDict)
    paths = [u.name.split(".") for u in units if u.module is not root]
    best = None  # (depth, name)
    for parts in paths:
        for depth in range(len(parts) - 1, 0, -1):
            owner, child = modules[".".join(parts[:depth])], modules[".".join(parts[: depth + 1])]
            kinds = {type(m) for m in child.children()} if isinstance(child, containers) else ()
            if len(kinds) == 1 and len(child) > 1 and not isinstance(owner, containers):
                if best is None or depth > best[0]:
                    best = depth, ".".join(parts[:depth])
                break
    if best is not None:
        return best[1], modules[best[1]]
    if len(paths) == 2:
        common = []
        for x, y in zip(*paths):
            if x != y:
                break
            common.append(x)
        while common and isinstance(modules[".".join(common)], containers):
            common = common[:-1]
        if common and common != paths[0] and common != paths[1]:
            return ".".join(common), modules[".".join(common)]
    return None


class _KeepInBackward(torch.autograd.Function):
    """`tensor`, copied, as a function of `inputs` (tensors that require grad) that gives
    them zero gradients."""

    @staticmethod
    def forward(ctx, tensor, *inputs):
        ctx.specs = [(t.shape, t.dtype, t.device) for t in inputs]
        return tensor.clone()

    @staticmethod
    def backward(ctx, grad):
        zeros = [
            torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.specs
        ]
        return None, *zeros


def _has_backward(unit: Unit, inputs: list) -> bool:
    """Whether a call of `unit` with `inputs` (those that require grad) has a backward: a unit
    of frozen parameters only whose inputs need no gradient computes nothing in backward, even
    when its outputs are made to require grad (transformers' enable_input_require_grads marks
    the frozen embeddings' output so under gradient checkpointing and LoRA), so it is neither
    gathered nor prefetched there. (If backward uses such a weight after all, through a tensor
    the module captured, the saved reference gathers it: [Note: saved weights].)"""
    return bool(inputs) or not unit.frozen


def _inputs_requiring_grad(args, kwargs) -> list:
    return [t for t in (*tensors_in(args), *tensors_in(kwargs)) if t.requires_grad]


def _map_floats(value, fn):
    """`value` (a tensor, or lists, tuples and dicts of them) with fn applied to every
    floating-point tensor; other containers are returned as they are."""
    if isinstance(value, torch.Tensor):
        return fn(value) if value.is_floating_point() else value
    if type(value) in (list, tuple):
        return type(value)(_map_floats(v, fn) for v in value)
    if type(value) is dict:
        return {k: _map_floats(v, fn) for k, v in value.items()}
    return value


def _unit_numel(unit: Unit, trainable: bool = False) -> int:
    """Elements of the unit's buckets, padded; of its trainable buckets only when `trainable`."""
    return sum(b.layout.padded_numel for b in unit.buckets if not trainable or b.master is not None)


class UsageGuard(TorchFunctionMode):
    """Gathers the unit of a released parameter that an op uses outside the unit's own forward
    (tied weights, a parent's direct use of a child's weight, a parametrization evaluated by
    the module around it) and pins it when it holds trainable parameters (their gradients reach
    it in backward); reading a placeholder's dtype, device or requires_grad gathers nothing.
    Refuses a parameter zero does not manage (a module attached after zero.initialize, or one
    outside the engine's module): its gradient would never be reduced nor its value updated."""

    def __init__(self, gatherer: ParamGatherer):
        super().__init__()
        self.gatherer = gatherer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.gatherer.busy:
            return func(*args, **kwargs)
        if id(getattr(func, "__self__", func)) in _METADATA:
            return func(*args, **kwargs)  # a placeholder has the parameter's dtype, device, ...
        for value in (*args, *kwargs.values()):
            if not isinstance(value, torch.nn.Parameter):
                continue
            unit = self.gatherer.unit_of(value)
            if unit is None and value.numel() > 0:
                raise unmanaged_parameter(self.gatherer.comm.rank, value, self.gatherer.root)
            if unit is not None and value.numel() == 0:
                self.gatherer.fetch(unit)
                # A trainable parameter's gradient reaches its unit in backward; a frozen unit
                # goes with its own forward's release, the end of a forward without backward,
                # or the end of backward ([Note: parameter lifecycle]).
                unit.pinned = unit.pinned or not unit.frozen
        return func(*args, **kwargs)


# Tensor attributes and methods that read no values: a placeholder answers them as the full
# parameter would (same dtype, device, requires_grad, grad_fn), so UsageGuard gathers nothing
# for them. (Its shape differs: reading it gathers.)
_METADATA = frozenset(
    id(vars(torch._C.TensorBase)[name])
    for name in (
        "dtype",
        "device",
        "layout",
        "requires_grad",
        "requires_grad_",
        "is_leaf",
        "grad_fn",  # None for a parameter; register_parameter() reads it
        "is_floating_point",
        "is_complex",
        "is_cuda",
        "is_meta",
        "get_device",
        "element_size",
    )
)


def _decoding_loop_synced() -> bool | None:
    """synced_gpus of the Hugging Face transformers decoding loop (or generate() call) that the
    current forward runs in: the innermost frame of a transformers function with a boolean
    local `synced_gpus` (GenerationMixin._sample, _beam_search, ..., or generate() itself with
    an explicit value); None when there is none ([Note: generation])."""
    frame = sys._getframe(2)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        module = frame.f_globals.get("__name__", "")
        if "synced_gpus" in frame.f_code.co_varnames and module.startswith("transformers."):
            value = frame.f_locals.get("synced_gpus")
            if isinstance(value, bool):
                return value
        frame = frame.f_back
    return None


_MAX_FRAMES = 200  # frames searched for a decoding loop above a forward


def unsynced_generation(rank: int, world_size: int, unit: Unit) -> ValueError:
    """The error for a forward of transformers' decoding loop with synced_gpus=False that
    would all-gather `unit` ([Note: generation])."""
    return ValueError(
        f"rank {rank}: generate() runs with synced_gpus=False under ZeRO stage 3 on "
        f"{world_size} ranks: each step all-gathers the parameters (here unit '{unit.name}'), "
        "so a rank whose sequences finish first would stop taking part while the others wait "
        "for it. Pass synced_gpus=True (engine.generate(...) does by default; transformers turns "
        "it on by itself only under DeepSpeed's HfDeepSpeedConfig), or, if the model fits on "
        "one device, generate inside zero.GatheredParameters(model.parameters())"
    )


def unmanaged_parameter(rank: int, param, root: torch.nn.Module) -> RuntimeError:
    """The error for a parameter used in the model's forward that zero does not lay out."""
    name = next((n for n, p in root.named_parameters() if p is param), None)
    where = (
        f"parameter '{name}' was added to the model after zero.initialize"
        if name is not None
        else f"a parameter of shape {tuple(param.shape)} that is not part of the engine's module"
    )
    return RuntimeError(
        f"rank {rank}: {where} and is used in the model's forward: zero does not manage it, so its "
        "gradient would not be averaged across ranks nor its value updated (nor, under stage 3, "
        "partitioned). Attach every module before zero.initialize (build the engine over the "
        "whole model), or register a constant as a buffer"
    )


def _views_slot(param, bucket, slot) -> bool:
    """Whether `param` is exactly its slot's view of the bucket's gathered buffer."""
    buffer = bucket.param_buffer
    return (
        buffer is not None
        and param.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        and param.storage_offset() == buffer.storage_offset() + slot.offset
        and param.shape == slot.shape
        and param.is_contiguous()
    )


def _finish_gather_bucket(bucket) -> None:
    bucket.pending.wait()
    bucket.pending = None
    for slot, param in zip(bucket.layout.slots, bucket.params):
        param.data = bucket.param_buffer[slot.offset : slot.offset + slot.numel].view(slot.shape)
    bucket.versions = [param._version for param in bucket.params]  # see _check_not_modified()


@dataclass
class _SavedWeight:
    """What backward keeps of a saved tensor that lies in a gathered buffer."""

    bucket: object
    offset: int
    shape: torch.Size
    stride: tuple
    generation: int  # the bucket's generation when saved: a later one means stale values


@dataclass
class _OuterSaved:
    """A saved tensor as the caller's own saved-tensor hooks packed it."""

    value: object


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1
