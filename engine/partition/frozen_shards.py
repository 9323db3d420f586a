"""Stage 3's frozen parameters: partitioned into 1/N shards like the trainable ones, gathered and
released with their fetch unit, without gradients, master weights or optimizer state."""

import contextlib

import torch

from .flat import FlatLayout
from .shared import bucket_values, host_copy


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
