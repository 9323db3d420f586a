"""AsyncFileIO: asynchronous reads and writes between CPU tensors and files (ZeRO-Infinity NVMe).

ZeRO-Infinity (Rajbhandari et al. 2021, "ZeRO-Infinity", section 6.3: the NVMe engine) swaps
optimizer states and parameters to NVMe and overlaps the transfers with compute. This module is
the I/O layer: `AsyncFileIO` owns a backend, `open()` creates a file, and `AsyncFile.read` /
`write` return a `Request` at once; `Request.wait()` finishes it (the start / wait pairs the
swap-buffer code builds on). The knobs are DeepSpeed's `aio` config block: `block_size` (bytes),
`queue_depth`, `intra_op_parallelism` (here `threads`).

Backends, best first (`backend=None` picks the first that works here):
- "io_uring": the compiled op `aio` (ops/csrc/aio.cpp) on io_uring rings set up with raw
  syscalls, one ring per thread with up to `queue_depth` pieces in flight.
- "aio": the same op on Linux kernel AIO (io_setup / io_submit); only O_DIRECT pieces are
  asynchronous in the kernel, so it is chosen only where O_DIRECT is not switched off.
- "threads": the same op, `threads` C++ threads doing pread / pwrite.
- "python": `threads` Python threads doing os.preadv / os.pwrite (the reference every backend
  is tested against; the fallback, after one warning, where the op cannot be built).

[Note: O_DIRECT and alignment]
O_DIRECT skips the page cache (the data does not pass through memory twice, and a swap does not
evict the training process's pages), but the file offset, the length and the memory address of
each transfer must be multiples of the logical block size. `ALIGNMENT` (4096) covers every
common device. A request is cut into a head (up to the first aligned file offset), an aligned
body and a tail (the last partial block); head and tail go through a second, buffered
descriptor of the same file, so a block shared by two requests is only ever written through the
page cache (no read-modify-write of a block another request may be writing) and the kernel keeps
the two paths coherent (a direct transfer writes back and drops cached pages in its range). A
body whose memory address is not aligned (a view such as t[1:]) is copied through an aligned
bounce buffer by the op; the reference sends it through the buffered descriptor instead. `empty()`
allocates tensors whose data and padded size are aligned, so their transfers need neither.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .builder import get_builder

ALIGNMENT = 4096
BACKENDS = ("io_uring", "aio", "threads", "python")
# An error tuple from a backend: (errno, file offset, bytes, bytes done before it). errno
# SHORT_TRANSFER means end of file (a read) or a write that made no progress.
SHORT_TRANSFER = -1

_direct_cache: dict[str, bool] = {}
_direct_lock = threading.Lock()


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def direct_io_supported(directory: str | os.PathLike) -> bool:
    """Whether O_DIRECT works in `directory` (cached per real path for the process).

    Probes by creating a temporary file with O_DIRECT, writing and reading back one aligned
    block, and removing it. False also where the directory is missing or not writable.
    """
    key = os.path.realpath(directory)
    with _direct_lock:
        if key not in _direct_cache:
            _direct_cache[key] = _probe_direct(key)
        return _direct_cache[key]


def _probe_direct(directory: str) -> bool:
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        fd, path = tempfile.mkstemp(prefix=".zero_direct_probe_", dir=directory)
    except OSError:
        return False
    try:
        os.close(fd)
        fd = os.open(path, os.O_RDWR | os.O_DIRECT)
        try:
            block = mmap.mmap(-1, ALIGNMENT)  # anonymous mappings are page aligned
            block.write(b"z" * ALIGNMENT)
            back = mmap.mmap(-1, ALIGNMENT)
            return (
                os.pwrite(fd, block, 0) == ALIGNMENT
                and os.preadv(fd, [back], 0) == ALIGNMENT
                and back[:] == block[:]
            )
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        os.unlink(path)


def aligned_empty(numel: int, dtype: torch.dtype, pin: bool = False) -> torch.Tensor:
    """A 1-D CPU tensor of `numel` elements whose data starts on an ALIGNMENT boundary and whose
    allocation extends to a multiple of ALIGNMENT bytes past that start (so O_DIRECT transfers
    of it need no bounce copy). Pinned (page-locked) when `pin` and CUDA is available.
    """
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    element_size = torch.empty((), dtype=dtype).element_size()
    padded = _round_up(max(numel * element_size, 1), ALIGNMENT)
    pin = pin and torch.cuda.is_available()
    raw = torch.empty(padded + ALIGNMENT, dtype=torch.uint8, pin_memory=pin)
    start = (-raw.data_ptr()) % ALIGNMENT
    return raw[start : start + padded].view(dtype)[:numel]


def _plan(
    address: int, nbytes: int, offset: int, direct: bool, block_size: int
) -> list[tuple[bool, int, int]]:
    """Cut a transfer into pieces (direct, start in the request, length) of <= block_size bytes.

    See [Note: O_DIRECT and alignment]; with `direct` False everything is buffered.
    """
    if not direct:
        segments = [(False, 0, nbytes)]
    else:
        head = min(nbytes, (-offset) % ALIGNMENT)
        body = (nbytes - head) // ALIGNMENT * ALIGNMENT
        body_direct = (address + head) % ALIGNMENT == 0
        tail = nbytes - head - body
        segments = [(False, 0, head), (body_direct, head, body), (False, head + body, tail)]
    pieces = []
    for use_direct, start, length in segments:
        for piece in range(start, start + length, block_size):
            pieces.append((use_direct, piece, min(block_size, start + length - piece)))
    return pieces


def _transfer(fd: int, write: bool, view: memoryview, offset: int) -> tuple | None:
    """pwrite / preadv all of `view` at `offset`, continuing after short counts."""
    done = 0
    while done < len(view):
        try:
            if write:
                count = os.pwrite(fd, view[done:], offset + done)
            else:
                count = os.preadv(fd, [view[done:]], offset + done)
        except OSError as error:
            return (error.errno, offset + done, len(view) - done, done)
        if count == 0:
            return (SHORT_TRANSFER, offset + done, len(view) - done, done)
        done += count
    return None


class _PythonTicket:
    def __init__(self, futures: list[Future]) -> None:
        self._futures = futures

    def done(self) -> bool:
        return all(future.done() for future in self._futures)

    def wait(self) -> tuple | None:
        errors = [future.result() for future in self._futures]
        return next((error for error in errors if error is not None), None)


class _PythonBackend:
    """The reference: `threads` Python threads (os.pread / os.pwrite release the GIL)."""

    name = "python"

    def __init__(self, block_size: int, queue_depth: int, threads: int) -> None:
        self._block_size = block_size
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="zero-aio")

    def submit(
        self, fd_direct: int, fd_buffered: int, write: bool, address: int, nbytes: int,
        offset: int,
    ) -> _PythonTicket:  # fmt: skip
        view = memoryview((ctypes.c_char * max(nbytes, 1)).from_address(address)).cast("B")
        futures = []
        for use_direct, start, length in _plan(
            address, nbytes, offset, fd_direct >= 0, self._block_size
        ):
            fd = fd_direct if use_direct else fd_buffered
            piece = view[start : start + length]
            futures.append(self._pool.submit(_transfer, fd, write, piece, offset + start))
        return _PythonTicket(futures)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class Request:
    """One read or write in flight. Holds its tensor until the transfer is done."""

    def __init__(self, file: AsyncFile, kind: str, tensor, offset: int, nbytes: int, ticket):
        self._file = file
        self._kind = kind
        self._tensor = tensor
        self._offset = offset
        self._nbytes = nbytes
        self._ticket = ticket
        self._error: OSError | None = None
        self._reported = False
        self._finished = ticket is None

    def done(self) -> bool:
        """True once the transfer has finished (successfully or not); never blocks."""
        if not self._finished and self._ticket.done():
            self._finish()
        return self._finished

    def wait(self) -> None:
        """Block (without the GIL) until the transfer is done.

        Raises OSError (errno, the file's path, the failed piece's offset and bytes and the
        request's) on a failed transfer, or errno EIO for a short read (end of file) or a write
        that made no progress. Raises the same error again on every later call.
        """
        if not self._finished:
            self._finish()
        if self._error is not None:
            self._reported = True
            raise self._error

    def _settled(self) -> bool:
        # Done, and nothing left to tell: a failure not yet raised by wait() stays pending so
        # that wait_all / close raise it.
        return self.done() and (self._error is None or self._reported)

    def _finish(self) -> None:
        error = self._ticket.wait()
        self._finished = True
        self._tensor = self._ticket = None
        if error is not None:
            self._error = _os_error(self._file.path, self._kind, self._offset, self._nbytes, error)


def _os_error(path: str, kind: str, offset: int, nbytes: int, error: tuple) -> OSError:
    code, piece_offset, piece_bytes, piece_done = error
    request = f"{kind} of {nbytes} bytes at offset {offset}"
    if code == SHORT_TRANSFER:
        reason = "end of file" if kind == "read" else "no progress"
        message = (
            f"short {kind} ({reason}): {piece_bytes} bytes at offset {piece_offset} "
            f"missing ({request})"
        )
        return OSError(errno.EIO, message, path)
    piece = f"{piece_bytes} bytes at offset {piece_offset}"
    return OSError(code, f"{os.strerror(code)} ({kind} of {piece}; {request})", path)


class AsyncFile:
    """A file opened by `AsyncFileIO.open`: non-blocking reads and writes of CPU tensors."""

    def __init__(self, io: AsyncFileIO, path: str, fd_buffered: int, fd_direct: int) -> None:
        self.path = path
        self.direct = fd_direct >= 0
        self._io = io
        self._fd_buffered = fd_buffered
        self._fd_direct = fd_direct
        self._pending: list[Request] = []
        self._closed = False

    def write(self, tensor: torch.Tensor, offset: int = 0) -> Request:
        """Start writing tensor's bytes (numel * element_size) at byte `offset`; returns at once.

        tensor: a contiguous CPU tensor of any dtype, not changed until the request is done.
        Raises TypeError / ValueError for another tensor or a negative offset.
        """
        return self._submit("write", tensor, offset)

    def read(self, tensor: torch.Tensor, offset: int = 0) -> Request:
        """Start reading numel * element_size bytes at byte `offset` into tensor; returns at once.

        tensor: a contiguous CPU tensor, not to be used until the request is done.
        """
        return self._submit("read", tensor, offset)

    def _submit(self, kind: str, tensor: torch.Tensor, offset: int) -> Request:
        if self._closed:
            raise ValueError(f"{kind} on closed file {self.path}")
        _check_tensor(tensor, offset)
        nbytes = tensor.numel() * tensor.element_size()
        self._pending = [request for request in self._pending if not request._settled()]
        ticket = None
        if nbytes:
            ticket = self._io._backend.submit(
                self._fd_direct, self._fd_buffered, kind == "write", tensor.data_ptr(),
                nbytes, offset,
            )  # fmt: skip
        request = Request(self, kind, tensor, offset, nbytes, ticket)
        self._pending.append(request)
        return request

    def wait_all(self) -> None:
        """Wait for every request of this file.

        Raises, after all are done, the first OSError that no `Request.wait()` has raised yet.
        """
        first = None
        for request in self._pending:
            if request._settled():
                continue
            try:
                request.wait()
            except OSError as error:
                first = first or error
        self._pending = []
        if first is not None:
            raise first

    def close(self, unlink: bool = False) -> None:
        """Wait for this file's requests, close it, and remove it when `unlink`.

        Raises the first failed request's OSError after closing.
        """
        if self._closed:
            return
        try:
            self.wait_all()
        finally:
            self._closed = True
            for fd in (self._fd_direct, self._fd_buffered):
                if fd >= 0:
                    os.close(fd)
            if unlink:
                os.unlink(self.path)
            self._io._forget(self)


def _check_tensor(tensor: torch.Tensor, offset: int) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
        where = getattr(tensor, "device", type(tensor).__name__)
        raise TypeError(f"AsyncFile needs a CPU tensor, got {where}; copy it to the host first")
    if not tensor.is_contiguous():
        raise ValueError("AsyncFile needs a contiguous tensor; call .contiguous() first")
    if not isinstance(offset, int) or offset < 0:
        raise ValueError(f"offset must be a byte offset >= 0, got {offset!r}")


class AsyncFileIO:
    """Asynchronous tensor <-> file I/O (DeepSpeed's `aio` config block).

    Args:
        block_size: bytes per piece a request is cut into (`aio.block_size`); rounded up to a
            multiple of ALIGNMENT.
        queue_depth: pieces in flight per thread (`aio.queue_depth`).
        threads: I/O threads (`aio.intra_op_parallelism`); each owns one ring / AIO context.
        direct: O_DIRECT on (True), off (False), or where the file's directory supports it
            (None, probed once per directory).
        backend: "io_uring", "aio", "threads", "python", or None for the best available.
    Raises ValueError for a non-positive size or count or an unknown backend.
    """

    def __init__(
        self,
        block_size: int = 1 << 20,
        queue_depth: int = 8,
        threads: int = 1,
        direct: bool | None = None,
        backend: str | None = None,
    ) -> None:
        for name, value in (("block_size", block_size), ("queue_depth", queue_depth),
                            ("threads", threads)):  # fmt: skip
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"AsyncFileIO: {name} must be an integer >= 1, got {value!r}")
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"AsyncFileIO: unknown backend {backend!r}; use one of {BACKENDS}")
        self.block_size = _round_up(block_size, ALIGNMENT)
        self.queue_depth = queue_depth
        self.threads = threads
        self.direct = direct
        self._backend = _make_backend(backend, direct, self.block_size, queue_depth, threads)
        self.backend: str = self._backend.name
        self._files: list[AsyncFile] = []
        self._closed = False

    def direct_for(self, directory: str | os.PathLike) -> bool:
        """Whether O_DIRECT works in `directory` (see `direct_io_supported`)."""
        return direct_io_supported(directory)

    def empty(self, numel: int, dtype: torch.dtype, pin: bool = False) -> torch.Tensor:
        """See `aligned_empty`: an aligned, padded 1-D CPU tensor of numel elements."""
        return aligned_empty(numel, dtype, pin)

    def open(self, path: str | os.PathLike, nbytes: int) -> AsyncFile:
        """Create `path` (mode 0600; OSError FileExistsError if it exists), sized to nbytes.

        Space is reserved with fallocate where the filesystem supports it (so a full disk fails
        here, OSError ENOSPC, rather than mid-training), else the file is only truncated to size.
        """
        if self._closed:
            raise ValueError("AsyncFileIO.open after close()")
        path = os.fspath(path)
        use_direct = self.direct
        if use_direct is None:
            use_direct = direct_io_supported(os.path.dirname(os.path.abspath(path)))
        fd_buffered = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fd_direct = -1
        try:
            _reserve(fd_buffered, nbytes)
            if use_direct:
                fd_direct = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
        except OSError as error:
            os.close(fd_buffered)
            os.unlink(path)
            if error.filename is None:
                raise OSError(error.errno, error.strerror, path) from error
            raise
        file = AsyncFile(self, path, fd_buffered, fd_direct)
        self._files.append(file)
        return file

    def wait_all(self) -> None:
        """Wait for every request of every open file; raises the first error after all."""
        first = None
        for file in list(self._files):
            try:
                file.wait_all()
            except OSError as error:
                first = first or error
        if first is not None:
            raise first

    def close(self) -> None:
        """Wait for all requests, close every open file (keeping it on disk) and the backend.

        Raises the first OSError no `Request.wait()` has raised, after closing everything.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.wait_all()
        finally:
            for file in list(self._files):
                file.close()
            self._backend.close()

    def _forget(self, file: AsyncFile) -> None:
        if file in self._files:
            self._files.remove(file)

    def __del__(self) -> None:
        # Requests in flight write into tensors their Request objects keep alive; when the
        # object graph is dropped at once, finalizers run before any of it is cleared (PEP 442),
        # so waiting here keeps the workers from touching freed memory.
        # Errors nobody waited for have no one to go to here.
        with contextlib.suppress(Exception):
            self.close()

    def __enter__(self) -> AsyncFileIO:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _reserve(fd: int, nbytes: int) -> None:
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    os.ftruncate(fd, nbytes)
    if nbytes:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as error:
            if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise


class _OpBackend:
    """The compiled op: `threads` C++ workers on io_uring, kernel AIO or pread / pwrite."""

    def __init__(self, module, name: str, block_size: int, queue_depth: int, threads: int):
        try:
            self._engine = module.Engine(block_size, queue_depth, threads, name)
        except RuntimeError as error:  # io_uring_setup / io_setup refused (a sandbox, a limit)
            raise NotImplementedError(
                f"AsyncFileIO backend {name!r} is not available here: {error}"
            ) from error
        self.name = name
        self.submit = self._engine.submit

    def close(self) -> None:
        self._engine.close()


def _load_op(required: bool):
    builder = get_builder("aio")
    return builder.load() if required else builder.load_or_fallback()


def _best_op_backend(module, direct: bool | None) -> str:
    if module.io_uring_works():
        return "io_uring"
    # Kernel AIO runs only O_DIRECT transfers asynchronously; buffered ones block io_submit.
    if direct is not False and module.kernel_aio_works():
        return "aio"
    return "threads"


def available_backends() -> list[str]:
    """The backends that work in this process, best first ("python" always works).

    Loads (building on first use) the op aio; without it only ["python"], after one warning.
    """
    module = _load_op(required=False)
    if module is None:
        return ["python"]
    names = ["io_uring"] if module.io_uring_works() else []
    if module.kernel_aio_works():
        names.append("aio")
    return names + ["threads", "python"]


def best_backend(direct: bool | None = None) -> str:
    """The backend AsyncFileIO(backend=None, direct=direct) uses here."""
    module = _load_op(required=False)
    return "python" if module is None else _best_op_backend(module, direct)


def _make_backend(backend, direct, block_size, queue_depth, threads):
    if backend == "python":
        return _PythonBackend(block_size, queue_depth, threads)
    module = _load_op(required=backend is not None)
    if module is None:
        return _PythonBackend(block_size, queue_depth, threads)
    name = backend or _best_op_backend(module, direct)
    return _OpBackend(module, name, block_size, queue_depth, threads)
