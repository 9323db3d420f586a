"""AsyncFileIO (ops/aio.py) on every backend that works here, against the pure-Python reference.

Each backend writes tensors of odd sizes at odd offsets, with O_DIRECT on and off; the file's
bytes must equal the tensor's (read back with plain Python), and the backend and the reference
must read them back equal. The op backends skip, with the reason, where the op aio cannot be
built (or io_uring / kernel AIO is refused in this process).
"""

import errno
import gc
import os
import resource
import signal
import tempfile
import threading
import time
import weakref

import pytest
import torch

from zero.ops import aio
from zero.ops import builder as builder_module
from zero.ops.aio import ALIGNMENT, AsyncFileIO
from zero.ops.builder import AioBuilder, OpBuildError, get_builder

pytestmark = pytest.mark.timeout(300)

BACKENDS = ["io_uring", "aio", "threads", "python"]
SIZES = [1, 4095, 4097, 3 * 1024 * 1024 + 13]
OFFSETS = [0, 1, 4096, 5000]


@pytest.fixture(scope="module")
def aio_op():
    try:
        return get_builder("aio").load()
    except OpBuildError as error:
        pytest.skip(f"op aio cannot be built here: {error}")


def _check_backend(backend, request):
    if backend == "python":
        return
    module = request.getfixturevalue("aio_op")
    if backend == "io_uring" and not module.io_uring_works():
        pytest.skip("io_uring_setup is refused in this process")
    if backend == "aio" and not module.kernel_aio_works():
        pytest.skip("io_setup (kernel AIO) is refused in this process")


@pytest.fixture(params=BACKENDS)
def backend(request):
    _check_backend(request.param, request)
    return request.param


def _random_bytes(numel, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (numel,), dtype=torch.uint8, generator=gen)


def _file_bytes(path, offset, nbytes):
    with open(path, "rb") as file:
        file.seek(offset)
        return file.read(nbytes)


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_round_trip_odd_sizes_and_offsets(backend, direct, tmp_path):
    # Small blocks so a few MB make many pieces; queue_depth 4 and 2 threads in flight.
    io = AsyncFileIO(block_size=64 << 10, queue_depth=4, threads=2, direct=direct, backend=backend)
    ref = AsyncFileIO(block_size=64 << 10, threads=2, direct=direct, backend="python")
    assert io.backend == backend
    for index, (numel, offset) in enumerate((n, o) for n in SIZES for o in OFFSETS):
        source = _random_bytes(numel + 1, seed=index)[1:]  # unaligned memory
        results = []
        for name, engine in (("op", io), ("ref", ref)):
            path = tmp_path / f"{name}{index}"
            file = engine.open(path, offset + numel + 3)
            assert file.direct == direct
            file.write(source, offset).wait()
            aligned = engine.empty(numel, torch.uint8)
            unaligned = torch.zeros(numel + 3, dtype=torch.uint8)
            first, second = file.read(aligned, offset), file.read(unaligned[3:], offset)
            first.wait(), second.wait()
            assert torch.equal(aligned, source) and torch.equal(unaligned[3:], source)
            file.close()
            results.append(path.read_bytes())
            os.unlink(path)
        assert results[0] == results[1]
        assert results[0][offset : offset + numel] == source.numpy().tobytes()
    io.close()
    ref.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_dtypes_and_unaligned_views(backend, dtype, tmp_path):
    with AsyncFileIO(backend=backend, block_size=1 << 16, queue_depth=3) as io:
        full = torch.randn(300_001).to(dtype) if dtype.is_floating_point else None
        if full is None:
            full = torch.randint(-128, 128, (300_001,), dtype=dtype)
        view = full[1:]  # one element off the allocation's alignment
        nbytes = view.numel() * view.element_size()
        file = io.open(tmp_path / "t", nbytes + ALIGNMENT)
        file.write(view, ALIGNMENT).wait()
        out = torch.zeros(view.numel() + 1, dtype=dtype)[1:]
        file.read(out, ALIGNMENT).wait()
        assert torch.equal(out, view)
        pinned = io.empty(view.numel(), dtype)
        file.read(pinned, ALIGNMENT).wait()
        assert torch.equal(pinned, view)


def test_many_requests_in_flight(backend, tmp_path):
    count, numel = 64, 10_007
    with AsyncFileIO(backend=backend, block_size=ALIGNMENT, queue_depth=8, threads=2) as io:
        file = io.open(tmp_path / "many", count * numel)
        sources = [_random_bytes(numel, seed=i) for i in range(count)]
        writes = [file.write(src, i * numel) for i, src in enumerate(sources)]  # shared blocks
        io.wait_all()
        assert all(request.done() for request in writes)
        outs = [torch.empty(numel, dtype=torch.uint8) for _ in range(count)]
        reads = [file.read(out, i * numel) for i, out in enumerate(outs)]
        for request in reads:
            request.wait()
        assert all(torch.equal(out, src) for out, src in zip(outs, sources))


def test_read_past_end_of_file_names_the_file(backend, tmp_path):
    with AsyncFileIO(backend=backend) as io:
        file = io.open(tmp_path / "short", 100)
        request = file.read(torch.empty(40, dtype=torch.uint8), 90)
        with pytest.raises(OSError) as info:
            request.wait()
        assert info.value.errno == errno.EIO and info.value.filename == str(tmp_path / "short")
        assert "offset 90" in str(info.value) and "40 bytes" in str(info.value)
        with pytest.raises(OSError):  # the same error again
            request.wait()
        # An error nobody waited for comes out of close().
        file.read(torch.empty(8, dtype=torch.uint8), 200)
        with pytest.raises(OSError, match="short read"):
            file.close()


def test_write_error_carries_errno_and_path(backend, tmp_path):
    # RLIMIT_FSIZE makes a write past the limit fail with EFBIG (SIGXFSZ ignored).
    with AsyncFileIO(backend=backend) as io:
        file = io.open(tmp_path / "big", 4096)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
        try:
            request = file.write(torch.ones(8192, dtype=torch.uint8), 2 << 20)
            with pytest.raises(OSError) as info:
                request.wait()
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, handler)
        assert info.value.errno == errno.EFBIG
        assert info.value.filename == str(tmp_path / "big")
        assert "offset 2097152" in str(info.value)


def test_open_existing_file_is_an_error(tmp_path):
    (tmp_path / "there").write_bytes(b"keep")
    with AsyncFileIO(backend="python") as io, pytest.raises(FileExistsError):
        io.open(tmp_path / "there", 10)
    assert (tmp_path / "there").read_bytes() == b"keep"


def test_read_only_directory_is_an_error():
    directory = tempfile.mkdtemp()  # under /tmp: other users may traverse it once it is 0555
    os.chmod(directory, 0o555)
    path = os.path.join(directory, "f")
    io = AsyncFileIO(backend="python")
    try:
        if os.geteuid() != 0:
            with pytest.raises(PermissionError) as info:
                io.open(path, 10)
            assert info.value.filename == path
            return
        # root writes anywhere: try as nobody in a forked child.
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                os.setgid(65534)
                os.setuid(65534)
                io.open(path, 10)
                code = 1
            except PermissionError as error:
                code = 0 if error.filename == path else 2
            finally:
                os._exit(code)
        assert os.waitpid(pid, 0)[1] == 0
        assert not os.path.exists(path)
    finally:
        io.close()
        os.chmod(directory, 0o755)
        os.rmdir(directory)


def test_close_waits_for_requests(backend, tmp_path):
    data = _random_bytes(16 * 1024 * 1024, seed=5)
    io = AsyncFileIO(backend=backend, block_size=1 << 18)
    file = io.open(tmp_path / "c", data.numel())
    request = file.write(data)
    file.close()
    assert request.done()
    assert _file_bytes(tmp_path / "c", 0, data.numel()) == data.numpy().tobytes()
    io.close()


def test_requests_keep_their_tensor_alive(backend, tmp_path):
    with AsyncFileIO(backend=backend) as io:
        file = io.open(tmp_path / "alive", 1 << 22)
        out = torch.empty(1 << 20, dtype=torch.float32)
        ref = weakref.ref(out)
        request = file.read(out)
        del out
        gc.collect()
        assert ref() is not None
        request.wait()
        del request
        gc.collect()
        assert ref() is None
        # A dropped request still writes the whole tensor.
        source = torch.arange(1 << 20, dtype=torch.float32)
        file.write(source)
        del source
        gc.collect()
        io.wait_all()
        back = torch.empty(1 << 20, dtype=torch.float32)
        file.read(back).wait()
        assert torch.equal(back, torch.arange(1 << 20, dtype=torch.float32))


def test_submission_returns_at_once_and_wait_releases_the_gil(backend, tmp_path):
    data = _random_bytes(64 * 1024 * 1024, seed=2)
    ticks = []
    stop = threading.Event()

    def count():
        while not stop.is_set():
            ticks.append(1)
            time.sleep(0.001)

    with AsyncFileIO(backend=backend, block_size=1 << 20) as io:
        file = io.open(tmp_path / "g", data.numel())
        start = time.perf_counter()
        request = file.write(data)
        submitted = time.perf_counter() - start
        counter = threading.Thread(target=count)
        counter.start()
        request.wait()
        waited = time.perf_counter() - start
        stop.set()
        counter.join()
    assert submitted < waited
    if waited > 0.05:
        assert len(ticks) > 2


def test_direct_probe_and_empty(tmp_path):
    io = AsyncFileIO(backend="python")
    assert io.direct_for(tmp_path) in (True, False)
    assert io.direct_for(tmp_path / "missing") is False
    assert not any(name.startswith(".zero_direct_probe") for name in os.listdir(tmp_path))
    for numel, dtype in ((1, torch.float32), (1025, torch.bfloat16), (0, torch.int8)):
        tensor = io.empty(numel, dtype, pin=True)
        assert tensor.numel() == numel and tensor.dtype == dtype and tensor.is_contiguous()
        assert tensor.data_ptr() % ALIGNMENT == 0
        storage = tensor.untyped_storage()
        room = storage.data_ptr() + storage.nbytes() - tensor.data_ptr()
        assert room >= -(-max(numel * tensor.element_size(), 1) // ALIGNMENT) * ALIGNMENT
    io.close()


def test_zero_bytes_and_bad_input(tmp_path):
    with AsyncFileIO(backend="python") as io:
        file = io.open(tmp_path / "z", 0)
        assert file.write(torch.empty(0)).done()
        with pytest.raises(ValueError, match="contiguous"):
            file.write(torch.ones(4, 4).t())
        with pytest.raises(ValueError, match="offset"):
            file.read(torch.ones(4), -1)
    with pytest.raises(ValueError, match="backend"):
        AsyncFileIO(backend="spdk")
    with pytest.raises(ValueError, match="queue_depth"):
        AsyncFileIO(queue_depth=0)


def test_default_backend_is_the_best_available(aio_op):
    with AsyncFileIO() as io:
        assert io.backend == aio.best_backend() == aio.available_backends()[0]


def test_falls_back_to_python_with_one_warning(monkeypatch, tmp_path):
    class Unbuildable(AioBuilder):
        def is_compatible(self):
            return False, "test: no compiler"

    monkeypatch.setitem(builder_module._BUILDERS, "aio", Unbuildable())
    with pytest.warns(RuntimeWarning, match="no compiler"):
        io = AsyncFileIO()
    assert io.backend == "python"
    io.close()
    with pytest.raises(OpBuildError):
        AsyncFileIO(backend="threads")


def test_backend_choice_where_the_kernel_refuses():
    class Module:
        uring, kernel_aio = True, True

        def io_uring_works(self):
            return self.uring

        def kernel_aio_works(self):
            return self.kernel_aio

    module = Module()
    assert aio._best_op_backend(module, None) == "io_uring"
    module.uring = False  # a sandbox forbidding io_uring_setup
    assert aio._best_op_backend(module, None) == "aio"
    assert aio._best_op_backend(module, False) == "threads"  # AIO blocks without O_DIRECT
    module.kernel_aio = False
    assert aio._best_op_backend(module, True) == "threads"
