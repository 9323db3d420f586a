"""ParamGatherer: stage 3's all-gathers and releases of fetch units, their prefetch, and the
checks that every rank gathers the same units (paper, 5.3). Its module hooks are in
unit_hooks.py, its saved-tensor hooks in saved_weights.py; the units themselves, and the story of
their parameters ([Note: parameter lifecycle]), in units.py.
"""

import contextlib
import logging
import weakref

import torch

from ..comm import Intent, describe_intent
from .ds_params import ZeroParamStatus, describe, set_status, set_tensor
from .saved_weights import SavedWeights
from .shared import check_params, collective_failure
from .unit_hooks import UnitHooks, in_backward
from .units import Unit, UnitState, data_chooser, unit_numel
from .usage_guard import unsynced_generation

logger = logging.getLogger("zero")


class ParamGatherer(UnitHooks, SavedWeights):
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
        # saved_weights() scopes open, innermost last: (caller's hooks, pack, unpack); and per
        # module forward under way, the hooks _enter_saving put on (None: none)
        self._scopes: list[tuple] = []
        self._saving: list = []
        # multi-grad hooks on forward graphs not yet run ([Note: graph hooks and the engine's
        # lifetime] in unit_hooks.py); weak: a graph dropped without backward takes its hook along
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
        self._install_hooks()
        self._install_saving_hooks()

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

    def fetch(self, unit: Unit, direction: str | None = None) -> None:
        """Make `unit` GATHERED (waiting for a prefetch in flight), and prefetch what followed it
        last time in `direction` ("forward" or "backward"; None: no prefetch). The all-gathers
        this starts are checked across ranks first (one Agreement.check for all of them)."""
        launch = [unit] if unit.state is UnitState.SHARDED else []
        if unit.state is UnitState.GATHERING:
            self.prefetch_hits += 1
        if direction == "backward" and unit.index in self._kept:
            self._kept.discard(unit.index)
            self.comm.ledger.kept += unit_numel(unit, trainable=True)
        if direction is not None and self.prefetch_numel > 0:
            launch += self._prefetch_plan(unit, direction, launch)
        if launch and self._generation_synced is False:
            raise unsynced_generation(self.comm.rank, self.comm.world_size, launch[0])
        with self._own_ops():  # the gathers would overwrite what the script put there
            for bucket in (b for upcoming in launch for b in upcoming.buckets):
                check_params(bucket, self.compute_dtype, self.comm.rank)
        if launch:
            pending = self._agree_on(tuple(u.index for u in launch))
            backward = direction == "backward" or in_backward()
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
        live = sum(unit_numel(u) for u in self.units if state(u) is not UnitState.SHARDED)
        plan = []
        for index in order[position + 1 :]:
            upcoming = self.units[index]
            if direction == "backward" and not upcoming.backward:
                continue
            size = unit_numel(upcoming)
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
        normally saved as a reference into its bucket ([Note: saved weights] in
        saved_weights.py), but an activation-checkpoint recomputation inside backward saves it
        as the parameter itself (torch's non-reentrant checkpoint keeps tensors that do not
        require grad as they are), so a release would leave backward a 0-element placeholder.
        The frozen buckets are therefore released only when the unit's backward is over: every
        trainable bucket has all its gradients and every observed call of the unit has the
        gradients of its inputs ([Note: end of a unit's backward] in unit_hooks.py); a call
        that could not be observed (no input requires grad) needs none. Otherwise they go at
        the end of backward."""
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
            after += unit_numel(self.units[index])
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

    def state_dict_units(self, params, placeholders: bool = False) -> tuple[list, bool]:
        """(units, gathers) for a state_dict() over `params`: the units it holds while it runs,
        and whether holding them all-gathers (a collective). Inside an open
        zero.GatheredParameters over this model's parameters, or with `placeholders` (a program
        that came in through the doorway: DeepSpeed's state_dict() never gathers), it holds only
        the units already gathered and gathers nothing, so one rank may call it alone
        (DeepSpeed's idioms: GatheredParameters over a peft adapter's parameters, then
        save_pretrained on rank 0; DeepSpeed-Chat's save_hf_format on rank 0): the other
        partitioned parameters then appear as their 0-element placeholders, as DeepSpeed's
        state_dict() gives them. Under the doorway that is said once as a warning."""
        units = self.units_of(params)
        if not self.gathered_contexts and not placeholders:
            return units, any(u.state is not UnitState.GATHERED for u in units)
        gathered = [u for u in units if u.state is UnitState.GATHERED]
        if len(gathered) < len(units) and not self._told_placeholders:
            self._told_placeholders = True
            left = next(u for u in units if u.state is not UnitState.GATHERED)
            if placeholders and not self.gathered_contexts:
                logger.warning(
                    "rank %d: state_dict() of a ZeRO stage-3 model under the DeepSpeed doorway "
                    "returns the parameters of %d fetch units (e.g. '%s') as 0-element "
                    "placeholders, as DeepSpeed does: a file written from it holds no weights. "
                    "Save with engine.save_16bit_model(dir) or save_pretrained(dir) on every "
                    "rank, or call state_dict() inside deepspeed.zero.GatheredParameters("
                    "model.parameters()) (said once)",
                    self.comm.rank,
                    len(units) - len(gathered),
                    left.name,
                )
            else:
                logger.info(
                    "state_dict() inside zero.GatheredParameters gathers nothing (one rank may "
                    "call it alone): the parameters of %d fetch units it does not hold (e.g. "
                    "'%s') appear as 0-element placeholders, as under DeepSpeed; hold them too "
                    "for their values",
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
            numel = unit_numel(unit)
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
        chooser = data_chooser(self.root, gathered)
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


def _finish_gather_bucket(bucket) -> None:
    bucket.pending.wait()
    bucket.pending = None
    for slot, param in zip(bucket.layout.slots, bucket.params):
        param.data = bucket.param_buffer[slot.offset : slot.offset + slot.numel].view(slot.shape)
    bucket.versions = [param._version for param in bucket.params]  # see _check_not_modified()
