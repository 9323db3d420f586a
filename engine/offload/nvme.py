"""ZeRO-Infinity's optimizer offload to NVMe, and partial optimizer offload (ratio < 1).

Rajbhandari et al., "ZeRO-Infinity: Breaking the GPU Memory Wall for Extreme Scale Deep
Learning" (arXiv 2104.07857), section 5; DeepSpeed keys zero_optimization.offload_optimizer
{device: "nvme", nvme_path, buffer_count, pin_memory, ratio} and the aio block.

[Note: placement]
Each bucket's owned shard is one optimizer sub-group. OptimizerOffload.placement() puts the first
buckets, up to (1 - ratio) of the rank's owned elements, on the device (master weights and
optimizer state resident there, stepped by a device optimizer), and the rest on the host ("cpu":
ZeRO-Offload's host master and gradient copy) or in files ("nvme"). With ratio 1 everything is
offloaded. With device nvme the layout caps a bucket at sub_group_size elements per rank
(Engine), so a sub-group is at most sub_group_size elements unless one parameter is larger.

[Note: sub-groups on nvme]
An nvme bucket's fp32 master and each per-element optimizer state tensor (Adam's exp_avg,
exp_avg_sq; whatever an element-wise optimizer keeps) live in one file each under the run's
SwapDirectory; in memory the master is a 0-element placeholder tensor (the optimizer's key for
its state) and so is every per-element state value. A step walks the nvme buckets in order with
`buffer_count` host buffer sets (slots): bucket i+slots-1 is read into a free slot while bucket
i is stepped, and bucket i's writes run while later buckets are read and stepped; a slot is
reused only after its writes finished. Stepping binds the placeholder and the state entries to
the slot's buffers (Tensor.data), runs the optimizer on that one master, copies the updated
value into the low-precision parameter shard, starts the writes and unbinds. State the optimizer
creates on its first step (or a checkpoint load brings) is copied into the slot and gets a file.
Every write has finished when step() returns, so a checkpoint or a kill never sees a half-written
sub-group that a later read trusts: the files belong to this run only and are never read again
by another.

[Note: swap file checksums]
A disk that returns other bytes than were written (a failing drive, controller or cable, a
filesystem bug, another process writing there) must never reach the weights: 16 flipped bytes
of an Adam moment turn the step's update into 1e35. SwapStore.write records the crc32 of the
bytes it writes (computed while the write runs, from the same buffer, which does not change
until the write is done), and every read is checked when it is waited for, before anyone uses
the buffer. A mismatch raises SwapCorruptionError on the rank that read it, naming the file,
what it holds and what to do; from then on the store refuses every read and write, because the
step that failed may have stepped some sub-groups and not others: no later step, checkpoint or
zero.utils call may see this run's state again. The other ranks learn of it at their next
collective with this rank: its process ends with the error, and their collective (or agreement
check) fails at once on the closed connections. The checksums live in memory only: the files
are never read by another run ([Note: swap directory lifetime]). Cost: one crc32 pass (zlib,
per 4 MiB piece, on up to torch.get_num_threads() threads) over every buffer written and read,
about 3 GB/s per core (docs/reliability.md has the measured figures); a write's pass overlaps
the write itself, a read's the reads started after it.

[Note: swap directory lifetime]
Files live in `<nvme_path>/zero-<pid>-<time>-<random>-rank<r>/`, created fresh (mkdir fails on
anything already there) with an `owner.json` naming host, pid and process start time. close()
(Engine.close, garbage collection of the engine, interpreter exit) removes it. A run killed
with SIGKILL leaves it behind; no run ever opens another's directory, and a run that starts in
the same nvme_path removes those whose owner process is gone from this host.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import re
import secrets
import shutil
import socket
import time
import weakref
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..comm import ranks_on_this_node
from ..config import AioConfig, ConfigError
from ..errors import listed

ALIGN_BYTES = 4096
# Free space asked for beyond the files' bytes, once per directory (filesystem metadata).
SPACE_MARGIN_BYTES = 16 << 20
_DIR_RE = re.compile(r"zero-(\d+)-[0-9a-f]+-[0-9a-f]+-rank(\d+)")
_OWNER = "owner.json"
_FILE_RE = re.compile(r"b\d+\.[A-Za-z0-9_]+\.swp")


@dataclass(frozen=True)
class OptimizerOffload:
    """Where the optimizer's master weights and state live, derived once from the config.

    device: "cpu" or "nvme" [offload_optimizer.device]; ratio: the fraction of this rank's owned
    elements offloaded, the rest (the first buckets) stays on the device [offload_optimizer.
    ratio]; pin_memory: page-lock host buffers (CUDA only) [offload_optimizer.pin_memory];
    nvme_path, buffer_count [offload_optimizer.*]; aio: the config's aio block (block_size in
    bytes, queue_depth, intra_op_parallelism).
    """

    nvme_path_key: ClassVar[str] = "zero_optimization.offload_optimizer.nvme_path"
    device: str
    ratio: float = 1.0
    pin_memory: bool = False
    nvme_path: str | None = None
    buffer_count: int = 4
    aio: AioConfig = AioConfig()

    @classmethod
    def from_config(cls, config) -> OptimizerOffload | None:
        """The policy when offload_optimizer sends state to nvme or offloads only a part
        (ratio < 1); None for no offload and for a whole cpu offload (ZeroOptimizer's own
        path)."""
        block = config.zero.offload_optimizer
        if block is None or block.device == "none":
            return None
        if block.device == "cpu" and block.ratio >= 1:
            return None
        return cls(
            device=block.device,
            ratio=float(block.ratio),
            pin_memory=block.pin_memory,
            nvme_path=block.nvme_path,
            buffer_count=block.buffer_count,
            aio=config.aio,
        )

    def placement(self, shard_numels: list[int]) -> list[str]:
        """Per bucket, "device" or self.device ([Note: placement]): a bucket stays on the
        device while its middle falls within the first (1 - ratio) of the owned elements."""
        keep = (1.0 - self.ratio) * sum(shard_numels)
        out, before = [], 0
        for numel in shard_numels:
            out.append("device" if before + numel / 2 <= keep else self.device)
            before += numel
        return out


def sub_group_bucket_numel(config, num_shards: int, reduce_numel: int | None = None) -> int:
    """The layout's bucket size in elements: `reduce_numel` (default reduce_bucket_size),
    capped with nvme so that each rank's shard of a bucket (one sub-group) holds at most
    sub_group_size elements, and with offload_param nvme at most offload_param.buffer_size
    elements."""
    zero_cfg = config.zero
    numel = reduce_numel or zero_cfg.reduce_bucket_size
    block = zero_cfg.offload_optimizer
    if block is not None and block.device == "nvme":
        numel = min(numel, zero_cfg.sub_group_size * num_shards)
    param = zero_cfg.offload_param  # stage-3 shards on nvme: each fits one buffer_size buffer
    if param is not None and param.device == "nvme":
        numel = min(numel, param.buffer_size * num_shards)
    return numel


# ----- checks before anything is allocated ------------------------------------------------
def padded_bytes(numel: int, element_size: int = 4) -> int:
    """Bytes of a swap file holding `numel` elements: rounded up to ALIGN_BYTES (direct I/O)."""
    return -(-numel * element_size // ALIGN_BYTES) * ALIGN_BYTES


def check_before_allocating(
    config, optimizer, trainable_numel: int, num_shards: int, rank: int
) -> tuple[str, str, int] | None:
    """Raise before the model is touched: ConfigError naming offload_optimizer.nvme_path when
    it is missing, not a directory or not writable; NotImplementedError for an optimizer that
    creates state at construction (Adagrad), whose state would be made for placeholders.
    Returns (key, nvme_path, bytes this rank will write there: fp32 master + 2 state tensors
    per owned offloaded element) for check_free_space; None without nvme. trainable_numel:
    elements zero lays out (all ranks)."""
    policy = OptimizerOffload.from_config(config)
    if policy is None or policy.device != "nvme":
        return None
    if len(optimizer.state) > 0:
        raise NotImplementedError(
            f"rank {rank}: optimizer {type(optimizer).__name__} creates its state at "
            "construction, which zero_optimization.offload_optimizer.device 'nvme' cannot "
            "place in files; use Adam/AdamW/SGD or device 'cpu'"
        )
    per_rank = math.ceil(trainable_numel * policy.ratio / num_shards) + 1024 * num_shards
    key = "zero_optimization.offload_optimizer.nvme_path"
    check_nvme_path(key, policy.nvme_path, rank)
    return key, policy.nvme_path, 3 * padded_bytes(per_rank)


def check_nvme_path(key: str, path: str | None, rank: int) -> None:
    """Raise ConfigError naming `key` unless `path` is an existing, writable directory."""
    if not path or not os.path.isdir(path):
        what = "does not exist" if not path or not os.path.exists(path) else "is not a directory"
        raise ConfigError(
            f"{key} {path!r} {what} (rank {rank}); create the directory on a fast local disk "
            "or fix the path"
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{key} {path!r} is not writable by this process (rank {rank}); pick a directory "
            "it can create files in"
        )


def check_free_space(needs: list, rank: int) -> None:
    """Raise ConfigError naming the keys when a directory lacks the free space that every rank
    on this host will write there. needs: (key, path, bytes per rank) from the
    check_before_allocating of nvme.py and param_swap.py (None entries skipped); needs on one
    directory (optimizer and parameters sharing nvme_path) add up, times the ranks on this host
    ($LOCAL_WORLD_SIZE, set by zrun and torchrun; they all run this config), plus
    SPACE_MARGIN_BYTES."""
    ranks = ranks_on_this_node()
    by_dir: dict[str, tuple[list[str], int]] = {}
    for key, path, need in filter(None, needs):
        keys, total = by_dir.get(os.path.realpath(path), ([], 0))
        by_dir[os.path.realpath(path)] = (keys + [key], total + need)
    for path, (keys, per_rank) in by_dir.items():
        need = per_rank * ranks + SPACE_MARGIN_BYTES
        free = shutil.disk_usage(path).free
        if free < need:
            raise ConfigError(
                f"{' and '.join(keys)} {path!r} has {free / 2**30:.2f} GiB free, but the "
                f"{ranks} rank(s) on this host will write {need / 2**30:.2f} GiB there "
                f"({per_rank / 2**30:.2f} GiB each, rank {rank} among them); free space, use "
                "another disk, or offload less (zero_optimization.offload_optimizer.ratio)"
            )


# ----- the run's directory ----------------------------------------------------------------
def _process_start(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
        return None


def remove_stale(root: str) -> list[str]:
    """Remove swap directories under `root` left by runs on this host whose process is gone
    (a killed run), holding only swap files; returns the removed paths. Never raises."""
    removed = []
    host = socket.gethostname()
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        path = os.path.join(root, name)
        if not _DIR_RE.fullmatch(name) or os.path.islink(path) or not os.path.isdir(path):
            continue
        try:
            with open(os.path.join(path, _OWNER)) as handle:
                owner = json.load(handle)
            files = os.listdir(path)
        except (OSError, ValueError):
            continue
        if owner.get("host") != host:
            continue  # another machine's run on shared storage: it may be alive
        started = _process_start(int(owner.get("pid", -1)))
        if started is not None and abs(started - float(owner.get("started", 0))) < 1.0:
            continue  # still running
        if all(f == _OWNER or _FILE_RE.fullmatch(f) for f in files):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class SwapDirectory:
    """This run's directory of swap files for one rank ([Note: swap directory lifetime])."""

    def __init__(self, root: str, rank: int):
        remove_stale(root)
        run = f"{os.getpid()}-{time.time_ns():x}-{secrets.token_hex(4)}"
        self.path = os.path.join(root, f"zero-{run}-rank{rank}")
        os.mkdir(self.path, 0o700)
        owner = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": _process_start(os.getpid()) or 0.0,
        }
        with open(os.path.join(self.path, _OWNER), "x") as handle:
            json.dump(owner, handle)

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)


def _remove_directory(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


# Open swap stores, closed at interpreter exit (weakly held: a collected engine closed its own).
_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_live() -> None:
    for store in list(_LIVE):
        store.close()


class SwapCorruptionError(RuntimeError):
    """A swap file read back other bytes than were written to it (its crc32 differs): the disk
    or filesystem under nvme_path changed it ([Note: swap file checksums]). Raised on the rank
    that read it, before the value is used."""


# A file's checksum is the crc32 of each of its pieces of this many bytes, computed on up to
# torch.get_num_threads() threads (zlib releases the GIL): ~3 GB/s per core.
_PIECE_BYTES = 4 << 20
_crc_pools: dict[int, ThreadPoolExecutor] = {}  # by thread count (normally one)


def _checksum(tensor: torch.Tensor) -> tuple[int, ...]:
    """crc32 of each _PIECE_BYTES piece of a contiguous CPU tensor's bytes, in order."""
    data = tensor.detach().view(torch.uint8).numpy()
    pieces = [data[i : i + _PIECE_BYTES] for i in range(0, len(data), _PIECE_BYTES)] or [data]
    threads = min(torch.get_num_threads(), len(pieces))
    if threads <= 1:
        return tuple(map(zlib.crc32, pieces))
    if threads not in _crc_pools:
        _crc_pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="zero-crc32")
    return tuple(_crc_pools[threads].map(zlib.crc32, pieces))


class _CheckedRead:
    """A read in flight whose bytes are checked against the file's crc32 when waited for."""

    def __init__(self, store: SwapStore, key: tuple[int, str], out: torch.Tensor, request):
        self._store = store
        self._key = key
        self._out = out
        self._request = request
        self._error: SwapCorruptionError | None = None

    def done(self) -> bool:
        return self._request.done()

    def wait(self) -> None:
        """Finish the read. Raises OSError as Request.wait, SwapCorruptionError when the bytes
        read differ from those written (again on every later call)."""
        self._request.wait()
        if self._out is not None:
            out, self._out = self._out, None
            self._error = self._store._verify(self._key, out)
        if self._error is not None:
            raise self._error


class SwapStore:
    """The files of one rank's run: one per (bucket index, kind), read and written with
    zero.ops.aio (asynchronous; wait() finishes a request), each checked by crc32 ([Note: swap
    file checksums]). policy: any object with nvme_path, nvme_path_key (the config key naming
    it), pin_memory and aio (OptimizerOffload, ParamOffload)."""

    def __init__(self, policy: OptimizerOffload, rank: int):
        from zero.ops.aio import AsyncFileIO

        self.directory = SwapDirectory(policy.nvme_path, rank)
        self.rank = rank
        self.key = policy.nvme_path_key
        aio = policy.aio
        self.io = AsyncFileIO(
            block_size=aio.block_size,
            queue_depth=aio.queue_depth,
            threads=aio.intra_op_parallelism,
        )
        self.pin = policy.pin_memory and torch.cuda.is_available()
        self.files: dict[tuple[int, str], object] = {}
        self.labels: dict[tuple[int, str], str] = {}  # what each file holds, for errors
        self.checksums: dict[tuple[int, str], tuple[tuple, int]] = {}  # (_checksum, bytes)
        self.corrupt: SwapCorruptionError | None = None  # the first mismatch: no more I/O
        self.bytes_on_disk = 0
        self.closed = False
        self._finalizer = weakref.finalize(self, _remove_directory, self.directory.path)
        _LIVE.add(self)

    def empty(self, numel: int) -> torch.Tensor:
        """(numel,) fp32 host buffer aligned for direct I/O (page-locked with pin_memory)."""
        return self.io.empty(numel, torch.float32, pin=self.pin)

    def read(self, key: tuple[int, str], out: torch.Tensor) -> _CheckedRead:
        """Start reading file `key` whole into `out` (as many bytes as were written). The
        returned request's wait() raises SwapCorruptionError when the bytes differ; so does
        this call once any read of the store found a difference."""
        self._refuse_after_corruption()
        nbytes = out.numel() * out.element_size()
        assert self.checksums[key][1] == nbytes, (self.rank, key, nbytes, self.checksums[key])
        return _CheckedRead(self, key, out, self.files[key].read(out))

    def write(self, key: tuple[int, str], value: torch.Tensor, label: str = ""):
        """Start writing `value` (contiguous CPU tensor, unchanged until the request is done)
        as file `key` whole, and record its crc32. `label` says what the file holds (used in
        errors; taken when the file is created). Returns the request."""
        self._refuse_after_corruption()
        nbytes = value.numel() * value.element_size()
        if key not in self.files:
            name = f"b{key[0]}.{key[1]}.swp"
            self.files[key] = self.io.open(self.directory.file(name), nbytes)
            self.labels[key] = label or f"bucket {key[0]}'s {key[1]}"
            self.bytes_on_disk += nbytes
        request = self.files[key].write(value)
        self.checksums[key] = (_checksum(value), nbytes)  # overlaps the write
        return request

    def _verify(self, key: tuple[int, str], out: torch.Tensor) -> SwapCorruptionError | None:
        want, nbytes = self.checksums[key]
        got = _checksum(out)
        if got == want:
            return None
        piece = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        start = piece * _PIECE_BYTES
        end = min(start + _PIECE_BYTES, nbytes)
        self.corrupt = SwapCorruptionError(
            f"rank {self.rank}: swap file {self.files[key].path} is corrupt: it holds "
            f"{self.labels[key]} ({nbytes:,} bytes), and reading back its bytes "
            f"[{start:,}, {end:,}) gave crc32 {got[piece]:08x} where {want[piece]:08x} was "
            f"written. The disk or filesystem under {self.key} "
            "changed the file after zero wrote it (a failing drive, controller or cable, or "
            "another process writing there); the value was not used. Training stops: check "
            "the drive (dmesg, smartctl), point the nvme_path at a healthy disk, and resume "
            "from the last checkpoint (no checkpoint can hold this value: every swap read is "
            "checked)"
        )
        return self.corrupt

    def _refuse_after_corruption(self) -> None:
        if self.corrupt is not None:
            raise SwapCorruptionError(
                f"rank {self.rank}: this run's swap files are no longer trusted: {self.corrupt}"
            )

    def close(self) -> None:
        """Wait for every request, close and unlink the files, remove the directory."""
        if self.closed:
            return
        self.closed = True
        try:
            self.io.wait_all()
        finally:
            for file in self.files.values():
                file.close(unlink=True)
            self.io.close()
            self._finalizer()


class _Slot:
    """One set of host buffers (one per kind, `capacity` elements) and its requests in flight."""

    def __init__(self, store: SwapStore, capacity: int):
        self.store = store
        self.capacity = capacity
        self.buffers: dict[str, torch.Tensor] = {}
        self.pending: list = []

    def buffer(self, kind: str) -> torch.Tensor:
        if kind not in self.buffers:
            self.buffers[kind] = self.store.empty(self.capacity)
        return self.buffers[kind]

    def wait(self) -> None:
        """Wait for every request; then raise the first error (OSError, SwapCorruptionError)."""
        pending, self.pending = self.pending, []
        first = None
        for request in pending:
            try:
                request.wait()
            except (OSError, SwapCorruptionError) as error:
                first = first or error
        if first is not None:
            raise first


def _label(bucket, kind: str) -> str:
    """What an optimizer swap file holds, for errors: the kind and the bucket's parameters."""
    what = "the fp32 master weights" if kind == "master" else f"the optimizer state {kind!r}"
    names = [slot.name for slot in bucket.layout.slots]
    return f"{what} of bucket {bucket.layout.index} (parameters {listed(names, 4)})"


def _is_element_state(value, master: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == master.shape


@contextlib.contextmanager
def _only(optimizer, masters: dict[int, list]):
    """Let `optimizer` see only `masters` (param group index -> tensors) during one step."""
    saved = [group["params"] for group in optimizer.param_groups]
    for index, group in enumerate(optimizer.param_groups):
        group["params"] = masters.get(index, [])
    try:
        yield
    finally:
        for group, params in zip(optimizer.param_groups, saved):
            group["params"] = params


def _by_group(buckets) -> dict[int, list]:
    out: dict[int, list] = {}
    for bucket in buckets:
        out.setdefault(bucket.layout.group, []).append(bucket.master)
    return out


class PartialOffload:
    """The optimizer step of ZeroOptimizer when buckets are split between device, host and nvme
    ([Note: placement], [Note: sub-groups on nvme]).

    Args: policy: OptimizerOffload; layout: the FlatLayout; rank: this rank (names its files).
    ZeroOptimizer asks where() each bucket lives while it builds them, hands nvme buckets'
    initial values to adopt(), and calls step() instead of its own optimizer step.
    """

    def __init__(self, policy: OptimizerOffload, layout, rank: int):
        self.policy = policy
        self.where_by_index = policy.placement([b.shard_numel for b in layout.buckets])
        self.store = None
        self.slots: list[_Slot] = []
        self.kinds: dict[int, list[str]] = {}  # nvme bucket index -> kinds with a file
        self._twin = None
        nvme = [b for b, w in zip(layout.buckets, self.where_by_index) if w == "nvme"]
        if nvme:
            self.store = SwapStore(policy, rank)
            capacity = max(padded_bytes(b.shard_numel) // 4 for b in nvme)
            count = max(1, min(policy.buffer_count, len(nvme)))
            self.slots = [_Slot(self.store, capacity) for _ in range(count)]

    def where(self, bucket) -> str:
        """ "device", "cpu" or "nvme"."""
        return self.where_by_index[bucket.layout.index]

    def swapped(self, bucket) -> bool:
        return self.where_by_index[bucket.layout.index] == "nvme"

    def swapped_masters(self, buckets) -> set[int]:
        return {id(b.master) for b in buckets if self.swapped(b)}

    @property
    def bytes_on_disk(self) -> int:
        return 0 if self.store is None else self.store.bytes_on_disk

    # ----- nvme buckets -----------------------------------------------------------------
    def adopt(self, bucket, values: torch.Tensor) -> None:
        """Write an nvme bucket's initial fp32 master (shard_numel,) to its file and make
        bucket.master a 0-element placeholder."""
        slot = self.slots[0]
        slot.wait()
        numel = values.numel()
        buffer = slot.buffer("master")
        buffer[:numel].copy_(values)
        buffer[numel:].zero_()
        key = (bucket.layout.index, "master")
        label = _label(bucket, "master")
        slot.pending = [self.store.write(key, self._io_view(buffer, numel), label)]
        slot.wait()
        self.kinds[bucket.layout.index] = ["master"]
        bucket.master = torch.empty(0, dtype=torch.float32)

    @staticmethod
    def _io_view(buffer: torch.Tensor, numel: int) -> torch.Tensor:
        return buffer[: padded_bytes(numel) // 4]

    def _start_read(self, bucket, slot: _Slot) -> None:
        slot.wait()  # the slot's earlier writes
        index, numel = bucket.layout.index, bucket.layout.shard_numel
        slot.pending = [
            self.store.read((index, kind), self._io_view(slot.buffer(kind), numel))
            for kind in self.kinds[index]
        ]

    def _bind(self, bucket, slot: _Slot, optimizer) -> None:
        numel = bucket.layout.shard_numel
        bucket.master.data = slot.buffer("master")[:numel]
        state = optimizer.state.get(bucket.master)
        for kind in self.kinds[bucket.layout.index][1:]:
            state[kind] = slot.buffer(kind)[:numel]

    def _write_back(self, bucket, slot: _Slot, optimizer) -> None:
        """Copy state the optimizer created or replaced into the slot, start the writes."""
        index, numel = bucket.layout.index, bucket.layout.shard_numel
        kinds = self.kinds[index]
        for kind, value in optimizer.state.get(bucket.master, {}).items():
            if not _is_element_state(value, bucket.master):
                continue
            buffer = slot.buffer(kind)
            if value.data_ptr() != buffer.data_ptr():
                buffer[:numel].copy_(value)
                buffer[numel : padded_bytes(numel) // 4].zero_()
            if kind not in kinds:
                kinds.append(kind)
        slot.pending = [
            self.store.write(
                (index, kind), self._io_view(slot.buffer(kind), numel), _label(bucket, kind)
            )
            for kind in kinds
        ]

    def _unbind(self, bucket, optimizer) -> None:
        bucket.master.grad = None
        bucket.master.data = torch.empty(0, dtype=torch.float32)
        state = optimizer.state.get(bucket.master, {})
        for kind in self.kinds[bucket.layout.index][1:]:
            state[kind] = torch.empty(0, dtype=torch.float32)

    @contextlib.contextmanager
    def resident(self, bucket, optimizer, write: bool = False):
        """Inside, an nvme bucket's master and state are real tensors (views of a host
        buffer); with `write`, what changed is written back and copied into the parameter
        shard on exit. Not for use while a step runs."""
        if not self.swapped(bucket):
            yield
            return
        slot = self.slots[0]
        self._start_read(bucket, slot)
        slot.wait()
        self._bind(bucket, slot, optimizer)
        try:
            yield
            if write:
                bucket.param_shard.copy_(bucket.master)
                self._write_back(bucket, slot, optimizer)
                slot.wait()
        finally:
            self._unbind(bucket, optimizer)

    # ----- the step ---------------------------------------------------------------------
    def step(self, zopt, grads: list[torch.Tensor]) -> None:
        """Step every bucket where it lives, copy updated masters into the parameter shards,
        then zopt.refresh_params() (the all-gather). grads: indexed by bucket, the fp32
        unscaled, clipped owned gradient (a list, or stages.ScaledGrads, which makes each when
        indexed: an nvme bucket's is made when that bucket is stepped and dropped after it).
        Collective (the all-gather)."""
        placed: dict[str, list] = {"device": [], "cpu": [], "nvme": []}
        for index, bucket in enumerate(zopt.buckets):
            placed[self.where(bucket)].append((bucket, index))
        written: set[int] = set()
        if placed["device"]:
            self._step_device(zopt, [(b, grads[i]) for b, i in placed["device"]])
        if placed["cpu"]:
            written |= self._step_host(zopt, [(b, grads[i]) for b, i in placed["cpu"]])
        if placed["nvme"]:
            self._step_nvme(zopt, placed["nvme"], grads)
        zopt.refresh_params(skip_copy=written)

    def _device_optimizer(self, optimizer):
        """The optimizer for device-resident masters: the configured one, or for zero's host
        Adam (CPUAdam) torch's Adam/AdamW sharing its state and following its hyper-parameters."""
        if type(optimizer).__name__ != "CPUAdam":
            return optimizer
        if self._twin is None:
            cls = torch.optim.AdamW if optimizer.param_groups[0]["adamw_mode"] else torch.optim.Adam
            groups = [{"params": [torch.zeros(1)]} for _ in optimizer.param_groups]
            self._twin = cls(groups)
            self._twin.state = optimizer.state
        for twin, group in zip(self._twin.param_groups, optimizer.param_groups):
            for key in ("lr", "betas", "eps", "weight_decay"):
                twin[key] = group[key]
        return self._twin

    def _step_device(self, zopt, pairs) -> None:
        optimizer = self._device_optimizer(zopt.optimizer)
        for bucket, grad in pairs:
            bucket.master.grad = grad
        with _only(optimizer, _by_group(b for b, _ in pairs)):
            optimizer.step()
        if zopt.settings.accum_dtype != torch.float32:
            for bucket, _ in pairs:  # the fp32 copies were transient
                bucket.master.grad = None

    def _fused(self, zopt, buckets) -> dict:
        optimizer = zopt.optimizer
        if not hasattr(optimizer, "step_with_copy") or zopt.compute_dtype == torch.float32:
            return {}
        return {
            b.master: b.param_shard
            for b in buckets
            if b.param_shard.device.type == "cpu" and not zopt.param_swapped(b)
        }

    def _step_host(self, zopt, pairs) -> set[int]:
        for bucket, grad in pairs:
            bucket.host_grad.copy_(grad, non_blocking=bucket.host_grad.is_pinned())
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the host optimizer reads host_grad next
        fused = self._fused(zopt, [b for b, _ in pairs])
        with _only(zopt.optimizer, _by_group(b for b, _ in pairs)):
            if fused:
                zopt.optimizer.step_with_copy(fused)
            else:
                zopt.optimizer.step()
        return set(map(id, fused))

    def _step_nvme(self, zopt, pairs, grads) -> None:
        """pairs: (bucket, its index in grads), in bucket order."""
        optimizer = zopt.optimizer
        count = len(self.slots)
        ahead = count - 1  # buckets read ahead of the one stepped
        for i in range(min(ahead, len(pairs))):
            self._start_read(pairs[i][0], self.slots[i % count])
        try:
            for i, (bucket, index) in enumerate(pairs):
                if ahead == 0:
                    self._start_read(bucket, self.slots[0])
                elif i + ahead < len(pairs):
                    self._start_read(pairs[i + ahead][0], self.slots[(i + ahead) % count])
                slot = self.slots[i % count]
                slot.wait()  # this bucket's reads
                # grads[index] is made here with 2-byte gradients, and freed after the step
                self._step_one(zopt, optimizer, bucket, grads[index], slot)
        except BaseException:
            for slot in self.slots:  # nothing in flight outlives the step; the first error wins
                with contextlib.suppress(OSError, SwapCorruptionError):
                    slot.wait()
            raise
        for slot in self.slots:
            slot.wait()

    def _step_one(self, zopt, optimizer, bucket, grad, slot: _Slot) -> None:
        self._bind(bucket, slot, optimizer)
        try:
            if grad.device.type != "cpu" or not grad.is_contiguous():
                host = slot.buffer("grad")[: grad.numel()]
                host.copy_(grad)
                grad = host
            bucket.master.grad = grad
            fused = self._fused(zopt, [bucket])
            with _only(optimizer, {bucket.layout.group: [bucket.master]}):
                if fused:
                    optimizer.step_with_copy(fused)
                else:
                    optimizer.step()
            if not fused:
                with zopt.param_resident(bucket, write=True, read=False):
                    bucket.param_shard.copy_(bucket.master)
            self._write_back(bucket, slot, optimizer)
        finally:
            self._unbind(bucket, optimizer)

    def close(self) -> None:
        """Remove this run's swap files (idempotent)."""
        if self.store is not None:
            self.store.close()
