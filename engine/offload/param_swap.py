"""ZeRO-Infinity's parameter offload to NVMe at stage 3: parameter shards in files.

Rajbhandari et al., "ZeRO-Infinity" (arXiv 2104.07857), section 5; DeepSpeed keys
zero_optimization.offload_param {device: "nvme", nvme_path, buffer_count, buffer_size,
max_in_cpu, pin_memory} and the aio block.

[Note: parameter shards on nvme]
At stage 3 a rank keeps of every bucket (trainable and frozen) only its shard, param_shard:
(shard_numel,) elements of the compute dtype. With offload_param.device "nvme" the first shards
(in construction order: trainable buckets, then frozen ones), up to max_in_cpu elements, stay in
host memory as with device "cpu"; every other shard lives in one file of the run's
SwapDirectory, and bucket.param_shard is a 0-element placeholder except while the shard is
resident in a host buffer:

    ON_DISK --start_read--> READING --acquire--> RESIDENT --release--> ON_DISK
    ON_DISK ----------------acquire-----------> RESIDENT --release(write)--> WRITING --> ON_DISK

The pool holds `buffer_count` aligned host buffers (page-locked with pin_memory on CUDA) of
min(buffer_size, the largest swapped shard) elements; a shard larger than buffer_size is an
error at initialize naming offload_param.buffer_size (the layout caps buckets so that only a
single parameter larger than buffer_size * world size can make one). The gatherer reads the
shards of the units that come next in its recorded order into free buffers (read ahead,
gatherer.ParamGatherer._read_ahead); a bucket's all-gather takes its shard with acquire() (waiting
for the read, or reading now) and gives the buffer back once the all-gather has finished. A
shard needed when no buffer is free takes, in this order: a buffer whose write finished, a new
one (up to buffer_count), one whose write is waited for, the read ahead furthest away; failing
all (one unit of more buckets than buffers), a temporary buffer, counted in extra_buffers.
After an optimizer step refresh_params() writes every updated shard (overlapping writes as far
as the buffers go) and flush() waits for all of them before step() returns, so a checkpoint or
a kill never sees a half-written shard. Read-aheads left at the end of backward are dropped
(their values are about to change). Every read is checked against the crc32 recorded when the
shard was written ([Note: swap file checksums] in nvme.py): a shard the disk changed raises
SwapCorruptionError in acquire(), before the all-gather sends it to any rank. Everything else
that reads or writes a shard (zero.utils, GatheredParameters, checkpoints, Hugging Face import
and export) does it inside resident().
"""

from __future__ import annotations

import contextlib
import enum
from collections import deque
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..config import AioConfig, ConfigError
from ..errors import listed
from .nvme import SwapStore, check_nvme_path, padded_bytes

KEY = "zero_optimization.offload_param"


@dataclass(frozen=True)
class ParamOffload:
    """Where stage-3 parameter shards live with offload_param.device "nvme", from the config.

    nvme_path, buffer_count, buffer_size (elements), max_in_cpu (elements), pin_memory
    [offload_param.*]; aio: the config's aio block.
    """

    nvme_path_key: ClassVar[str] = f"{KEY}.nvme_path"
    nvme_path: str
    buffer_count: int = 5
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000
    pin_memory: bool = False
    aio: AioConfig = AioConfig()

    @classmethod
    def from_config(cls, config) -> ParamOffload | None:
        block = config.zero.offload_param
        if block is None or block.device != "nvme":
            return None
        return cls(
            nvme_path=block.nvme_path,
            buffer_count=block.buffer_count,
            buffer_size=block.buffer_size,
            max_in_cpu=block.max_in_cpu,
            pin_memory=block.pin_memory,
            aio=config.aio,
        )


def check_before_allocating(
    config, numels: list[int], num_shards: int, rank: int
) -> tuple[str, str, int] | None:
    """Raise before the model is touched: ConfigError naming offload_param.buffer_size when one
    parameter's shard (numel / world size, rounded up) exceeds it, and naming
    offload_param.nvme_path when the directory is missing or not writable (numels: every
    laid-out parameter's element count, all ranks). Returns (key, nvme_path, bytes of this
    rank's shard files) for zero.nvme.check_free_space; None without parameter nvme."""
    policy = ParamOffload.from_config(config)
    if policy is None:
        return None
    largest = -(-max(numels, default=0) // num_shards)
    if largest > policy.buffer_size:
        raise ConfigError(
            f"{KEY}.buffer_size {policy.buffer_size:,} elements is smaller than the shard of "
            f"the largest parameter ({max(numels):,} elements over {num_shards} ranks: "
            f"{largest:,} per rank, rank {rank}); set buffer_size to at least {largest:,}"
        )
    element = torch.empty(0, dtype=config.compute_dtype).element_size()
    per_rank = -(-sum(numels) // num_shards) + 1024 * num_shards
    check_nvme_path(f"{KEY}.nvme_path", policy.nvme_path, rank)
    return f"{KEY}.nvme_path", policy.nvme_path, padded_bytes(per_rank, element)


def bucket_numel_cap(config, num_shards: int) -> int | None:
    """The most elements a bucket may hold so that each rank's shard fits one buffer."""
    policy = ParamOffload.from_config(config)
    return None if policy is None else policy.buffer_size * num_shards


class SwapState(enum.Enum):
    ON_DISK = "on_disk"
    READING = "reading"  # read ahead into a buffer, not yet waited for
    RESIDENT = "resident"  # param_shard is a view of the buffer
    WRITING = "writing"  # the buffer's write is in flight


class _Shard:
    """One swapped bucket's shard: its file key, size and where its value is now."""

    def __init__(self, key: tuple[int, str], numel: int):
        self.key = key
        self.numel = numel
        self.state = SwapState.ON_DISK
        self.buffer: torch.Tensor | None = None
        self.request = None  # the read or write in flight
        self.uses = 0  # acquire() without release()
        self.dirty = False


class ParamSwap:
    """The swapped parameter shards of one rank ([Note: parameter shards on nvme]).

    Args: policy: ParamOffload; rank: this rank (names its directory); dtype: the compute
    dtype. Not a collective; the all-gathers that use the shards are the gatherer's.
    """

    def __init__(self, policy: ParamOffload, rank: int, dtype: torch.dtype):
        self.policy = policy
        self.rank = rank
        self.dtype = dtype
        self.store: SwapStore | None = None
        self.pin = policy.pin_memory and torch.cuda.is_available()
        self.in_cpu = 0  # elements kept in host memory (max_in_cpu)
        self.shards: dict[int, _Shard] = {}  # id(bucket) -> its swapped shard
        self.capacity = 0  # elements of a pool buffer (set at the first one)
        self.pool: list[torch.Tensor] = []
        self.free: list[torch.Tensor] = []
        self.extra_buffers = 0  # temporary buffers taken because the pool was busy
        self.reads = 0  # reads from files (measured by tests and benchmarks)
        self.ahead_hits = 0  # acquires that found their shard read ahead
        self._ahead: deque = deque()  # buckets read ahead, oldest first
        self._writing: deque = deque()  # buckets whose writes are in flight, oldest first

    # ----- construction -------------------------------------------------------------------
    def adopt(self, bucket, values: torch.Tensor) -> None:
        """Take a new bucket's shard values ((shard_numel,), compute dtype): kept in host
        memory while max_in_cpu allows, else written to its file (bucket.param_shard becomes a
        0-element placeholder)."""
        numel = values.numel()
        if self.in_cpu + numel <= self.policy.max_in_cpu:
            self.in_cpu += numel
            host = values.detach().to("cpu", copy=True)
            bucket.param_shard = host.pin_memory() if self.pin else host
            return
        if self.store is None:
            self.store = SwapStore(self.policy, self.rank)
        names = listed([slot.name for slot in bucket.layout.slots], 4)
        label = f"the {self.dtype} parameter shard of {names}"
        shard = _Shard((len(self.shards), "param"), numel)
        self.shards[id(bucket)] = shard
        staging = self.store.io.empty(self._padded(numel), self.dtype, pin=False)
        staging[:numel].copy_(values)
        staging[numel:].zero_()
        self.store.write(shard.key, staging, label).wait()
        bucket.param_shard = self._placeholder()

    def _placeholder(self) -> torch.Tensor:
        return torch.empty(0, dtype=self.dtype)

    def _padded(self, numel: int) -> int:
        element = torch.empty(0, dtype=self.dtype).element_size()
        return padded_bytes(numel, element) // element

    def swapped(self, bucket) -> bool:
        return id(bucket) in self.shards

    @property
    def bytes_on_disk(self) -> int:
        return 0 if self.store is None else self.store.bytes_on_disk

    # ----- buffers ------------------------------------------------------------------------
    def _reap_writes(self, block: bool) -> bool:
        """Give back buffers whose writes finished (the oldest, waiting for it, with `block`)."""
        reaped = False
        while self._writing and (block or self._writing[0].request.done()):
            shard = self._writing.popleft()
            shard.request.wait()
            self._to_disk(shard)
            reaped, block = True, False
        return reaped

    def _to_disk(self, shard: _Shard) -> None:
        buffer, shard.buffer, shard.request = shard.buffer, None, None
        shard.state, shard.dirty = SwapState.ON_DISK, False
        if any(buffer is b for b in self.pool):
            self.free.append(buffer)

    def _new_buffer(self) -> torch.Tensor | None:
        if len(self.pool) >= self.policy.buffer_count:
            return None
        if not self.capacity:
            largest = max(s.numel for s in self.shards.values())
            self.capacity = self._padded(min(self.policy.buffer_size, largest))
        buffer = self.store.io.empty(self.capacity, self.dtype, pin=self.pin)
        self.pool.append(buffer)
        return buffer

    def _free_buffer(self) -> torch.Tensor | None:
        """A pool buffer nobody uses, without waiting for anything; None when there is none."""
        self._reap_writes(block=False)
        return self.free.pop() if self.free else self._new_buffer()

    def _take_buffer(self, numel: int) -> torch.Tensor:
        """A buffer for a shard needed now ([Note: parameter shards on nvme] gives the order)."""
        buffer = self._free_buffer()
        while buffer is None and self._writing:
            self._reap_writes(block=True)
            buffer = self.free.pop() if self.free else None
        if buffer is None and self._ahead:
            shard = self._ahead.pop()  # the read ahead furthest away
            shard.request.wait()
            self._to_disk(shard)
            buffer = self.free.pop()
        if buffer is None:
            self.extra_buffers += 1
            buffer = self.store.io.empty(self._padded(numel), self.dtype, pin=False)
        return buffer

    def _io_view(self, shard: _Shard) -> torch.Tensor:
        return shard.buffer[: self._padded(shard.numel)]

    # ----- reads and writes ---------------------------------------------------------------
    def start_read(self, bucket) -> bool:
        """Read a swapped shard ahead into a free buffer. False when none is free (nothing
        started); True otherwise (also for a shard that is not swapped or not on disk)."""
        shard = self.shards.get(id(bucket))
        if shard is None or shard.state is not SwapState.ON_DISK:
            return True
        buffer = self._free_buffer()
        if buffer is None:
            return False
        shard.buffer, shard.state = buffer, SwapState.READING
        shard.request = self.store.read(shard.key, self._io_view(shard))
        self.reads += 1
        self._ahead.append(shard)
        return True

    def acquire(self, bucket, read: bool = True) -> torch.Tensor:
        """Make a swapped shard resident and return bucket.param_shard, a view of its buffer.
        read=False when the caller overwrites every element (no read from the file)."""
        shard = self.shards[id(bucket)]
        if shard.state is SwapState.WRITING:
            self._writing.remove(shard)
            shard.request.wait()
            shard.request, shard.state = None, SwapState.RESIDENT  # the buffer still holds it
        elif shard.state is SwapState.READING:
            self.ahead_hits += 1
            self._ahead.remove(shard)
            shard.request.wait()
            shard.request, shard.state = None, SwapState.RESIDENT
        elif shard.state is SwapState.ON_DISK:
            shard.buffer = self._take_buffer(shard.numel)
            if read:
                self.store.read(shard.key, self._io_view(shard)).wait()
                self.reads += 1
            shard.state = SwapState.RESIDENT
        shard.uses += 1
        bucket.param_shard = shard.buffer[: shard.numel]
        return bucket.param_shard

    def release(self, bucket, write: bool = False) -> None:
        """End one acquire(); with `write` the shard was changed and is written back. The last
        release starts the write (or frees the buffer) and leaves a placeholder."""
        shard = self.shards.get(id(bucket))
        if shard is None:
            return
        assert shard.uses > 0 and shard.state is SwapState.RESIDENT, (self.rank, shard.key)
        shard.uses -= 1
        shard.dirty = shard.dirty or write
        if shard.uses:
            return
        bucket.param_shard = self._placeholder()
        if not shard.dirty:
            self._to_disk(shard)
            return
        tail = shard.buffer[shard.numel : self._padded(shard.numel)]
        tail.zero_()
        shard.request = self.store.write(shard.key, self._io_view(shard))
        shard.state = SwapState.WRITING
        self._writing.append(shard)

    @contextlib.contextmanager
    def resident(self, bucket, write: bool = False, read: bool = True):
        """Inside, bucket.param_shard holds the shard's value (read=False: to be overwritten
        whole); with `write`, it is written back on a normal exit. Nothing for a shard that is
        not swapped."""
        if id(bucket) not in self.shards:
            yield
            return
        self.acquire(bucket, read)
        ok = False
        try:
            yield
            ok = True
        finally:
            self.release(bucket, write and ok)

    def drop_read_ahead(self) -> None:
        """Give back the buffers of shards read ahead and not used (end of backward)."""
        while self._ahead:
            shard = self._ahead.popleft()
            shard.request.wait()
            self._to_disk(shard)

    def flush(self) -> None:
        """Wait for every write (the end of an optimizer step)."""
        while self._writing:
            self._reap_writes(block=True)

    def close(self) -> None:
        """Remove this run's parameter files (idempotent)."""
        if self.store is not None:
            self.store.close()
