"""FlatLayout: where every trainable parameter lives in zero's contiguous buffers.

[Note: bucket-aligned ownership]
The trainable parameters of each optimizer param group are packed, in reverse registration order
(roughly the order backward produces their gradients), into buckets of at most `bucket_numel`
elements (a parameter larger than that gets a bucket of its own; parameters are never split).
Each bucket is padded with zeros to a multiple of `num_shards`, and shard r owns the r-th
contiguous 1/num_shards slice of every bucket. Owning a slice of each bucket, rather than one
contiguous 1/N of the whole model, keeps every collective aligned with ownership: a bucket's
gradient is reduce-scattered straight into the owners' slices and its parameters are all-gathered
in place, so the per-step volume is exactly the paper's 2 Psi and buckets overlap with backward.
Stage 0 uses num_shards 1: every rank owns everything.

[Note: units laid out together]
At stage 3 a bucket never spans two fetch units, and the parameters of one unit are moved
together, to the place of its last one (about where backward completes its gradients). In
registration order a unit's parameters are interleaved with those of the persistent unit
(biases and norms below stage3_param_persistence_threshold), and each switch would close a
bucket: a GPT of 6 blocks had 49 buckets, one per weight or bias, and its stage-3 step 73
all-gathers and 49 reduce-scatters (now 3 buckets, 3 and 3). The persistent unit's
parameters, spread over the whole model, stay in place, so each run of them between two other
units is a bucket that backward completes as it passes: buckets are reduced in layout order,
and the persistent unit as one bucket would complete only at the end of backward (the first
layer's norm), holding back every other reduce-scatter, and the gradient staging, until then.
Checkpoints record each group's order and load into any other ([Note: world-size independent
coordinates] in engine/checkpoint/ownership.py).

The layout is pure bookkeeping (no tensors), so checkpoints and tests can reason about it alone.
Shapes are full shapes, also for parameters that zero.Init holds partitioned.
"""

from dataclasses import dataclass, field

import torch

from .init import full_numel, full_shape


@dataclass(frozen=True)
class Slot:
    """One parameter's place: `offset` elements into bucket `bucket`, `numel` elements long."""

    name: str
    shape: tuple[int, ...]
    bucket: int
    offset: int
    numel: int


@dataclass
class BucketLayout:
    """A run of parameters of one param group, padded to a multiple of the number of shards.

    Offsets and sizes are in elements. `start` is the bucket's offset in its group's flat buffer.
    """

    index: int
    group: int
    start: int
    numel: int
    padded_numel: int
    num_shards: int
    unit: int = 0
    slots: list[Slot] = field(default_factory=list)

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.num_shards

    def owned_range(self, shard: int) -> tuple[int, int]:
        """[begin, end) in elements, relative to the bucket start, of the slice shard owns."""
        return shard * self.shard_numel, (shard + 1) * self.shard_numel


class FlatLayout:
    """Bucketed, padded packing of trainable parameters into one flat buffer per param group.

    Args:
        named_groups: per optimizer param group, the (name, parameter) pairs it trains. Frozen and
            zero-element parameters must already be filtered out; each parameter appears once.
        bucket_numel: the most elements a bucket holds (DeepSpeed key reduce_bucket_size).
        num_shards: how many ranks split each bucket (the data-parallel world size, or 1).
        unit_of: stage 3: id(param) -> fetch unit; a bucket never spans two units.
        persistent_unit: stage 3: the persistent unit's index, whose parameters stay in place
            ([Note: units laid out together]).

    Raises ValueError for a non-positive bucket size or shard count.
    """

    def __init__(
        self, named_groups, bucket_numel: int, num_shards: int, unit_of=None, persistent_unit=None
    ):
        if bucket_numel <= 0 or num_shards <= 0:
            raise ValueError(f"bucket_numel={bucket_numel} and num_shards={num_shards} must be > 0")
        self.num_shards = num_shards
        self._unit_of = unit_of or {}
        self._persistent_unit = persistent_unit
        self.buckets: list[BucketLayout] = []
        self.group_numel: list[int] = []
        self._slot_of: dict[int, Slot] = {}
        for group_index, named in enumerate(named_groups):
            self._pack_group(group_index, self._unit_order(reversed(list(named))), bucket_numel)

    def _unit_order(self, named) -> list:
        """[Note: units laid out together] `named` with each fetch unit's parameters moved to
        its last one, except the persistent unit's (stages 0-2, which have no units, keep the
        order)."""
        named = list(named)
        units = [self._unit_of.get(id(param), 0) for _, param in named]
        last = {unit: i for i, unit in enumerate(units)}
        keys = [i if u == self._persistent_unit else last[u] for i, u in enumerate(units)]
        return [named[i] for i in sorted(range(len(named)), key=keys.__getitem__)]

    def _pack_group(self, group: int, named, bucket_numel: int) -> None:
        start = 0
        pending: list[tuple[str, torch.Tensor]] = []
        pending_numel = 0
        for name, param in named:
            unit = self._unit_of.get(id(param), 0)
            new_unit = pending and unit != self._unit_of.get(id(pending[0][1]), 0)
            if pending and (new_unit or pending_numel + full_numel(param) > bucket_numel):
                start = self._close_bucket(group, start, pending)
                pending, pending_numel = [], 0
            pending.append((name, param))
            pending_numel += full_numel(param)
        if pending:
            start = self._close_bucket(group, start, pending)
        self.group_numel.append(start)

    def _close_bucket(self, group: int, start: int, named) -> int:
        index = len(self.buckets)
        numel = sum(full_numel(p) for _, p in named)
        padded = -(-numel // self.num_shards) * self.num_shards
        unit = self._unit_of.get(id(named[0][1]), 0)
        bucket = BucketLayout(index, group, start, numel, padded, self.num_shards, unit)
        offset = 0
        for name, param in named:
            slot = Slot(name, tuple(full_shape(param)), index, offset, full_numel(param))
            bucket.slots.append(slot)
            self._slot_of[id(param)] = slot
            offset += slot.numel
        self.buckets.append(bucket)
        return start + padded

    def shard_of(self, rank: int) -> int:
        """The shard data-parallel rank `rank` owns: rank mod num_shards (its rank without
        MiCS, its rank in its shard group with it, partition/hierarchy.py), or 0 when every
        rank owns everything (stage 0)."""
        return rank % self.num_shards if self.num_shards > 1 else 0

    def slot(self, param: torch.Tensor) -> Slot:
        return self._slot_of[id(param)]

    def group_buckets(self, group: int) -> list[BucketLayout]:
        return [b for b in self.buckets if b.group == group]

    @property
    def num_groups(self) -> int:
        return len(self.group_numel)

    @property
    def numel(self) -> int:
        """Parameter elements laid out, without padding."""
        return sum(b.numel for b in self.buckets)

    @property
    def padded_numel(self) -> int:
        return sum(b.padded_numel for b in self.buckets)
