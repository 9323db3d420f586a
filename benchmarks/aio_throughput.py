r"""Sequential write and read throughput of zero.ops.aio.AsyncFileIO beside `dd`.

    python benchmarks/aio_throughput.py --size_mb 1024 --dir $TMPDIR --repeats 3

For every backend available here (io_uring, aio, threads, python) and O_DIRECT off and on (on
only where the directory supports it): write one aligned buffer of --size_mb MiB to a new file
in --dir as one request (cut into --block_size pieces, --queue_depth in flight per thread,
--threads threads), then fsync, then drop the file's cached pages (posix_fadvise DONTNEED) and
read it back as one request. The write time includes the fsync, as dd's conv=fsync does, so
buffered writes are not timed into the page cache only. Beside them, the same directory with dd:

    dd if=/dev/zero of=FILE bs=1M count=SIZE_MB oflag=direct conv=fsync
    dd if=FILE of=/dev/null bs=1M iflag=direct

Rows take turns per repetition (so drift of a shared machine hits them alike); the table gives
the median GB/s (1e9 bytes per second) over --repeats. Every read is checked against the data
written. A measurement script, not a test: nothing here asserts on time.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from _common import evict

from zero.ops.aio import AsyncFileIO, available_backends, direct_io_supported


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size_mb", type=int, default=1024, help="file size in MiB")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="directory for the files")
    parser.add_argument("--block_size", type=int, default=1 << 20, help="bytes per piece")
    parser.add_argument("--queue_depth", type=int, default=8, help="pieces in flight per thread")
    parser.add_argument("--threads", type=int, default=1, help="I/O threads")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; the median is shown")
    return parser.parse_args()


def _time_op(args, backend, direct, data, back, path) -> tuple[float, float]:
    io = AsyncFileIO(args.block_size, args.queue_depth, args.threads, direct, backend)
    nbytes = data.numel()
    try:
        file = io.open(path, nbytes)
        evict(path)  # fallocate's zeroed pages are not part of the write
        start = time.perf_counter()
        file.write(data).wait()
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        write_s = time.perf_counter() - start
        evict(path)
        back.zero_()
        start = time.perf_counter()
        file.read(back).wait()
        read_s = time.perf_counter() - start
        file.close(unlink=True)
    finally:
        io.close()
    if not torch.equal(back, data):
        raise RuntimeError(f"{backend} direct={direct}: read back differs from what was written")
    return nbytes / write_s / 1e9, nbytes / read_s / 1e9


def _time_dd(size_mb: int, path: str) -> tuple[float, float]:
    nbytes = size_mb << 20
    write = ["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={size_mb}", "oflag=direct",
             "conv=fsync"]  # fmt: skip
    read = ["dd", f"if={path}", "of=/dev/null", "bs=1M", "iflag=direct"]
    try:
        speeds = []
        for command in (write, read):
            start = time.perf_counter()
            subprocess.run(command, check=True, capture_output=True)
            speeds.append(nbytes / (time.perf_counter() - start) / 1e9)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return speeds[0], speeds[1]


def main() -> int:
    args = _parse()
    directory = os.path.abspath(args.dir)
    direct_ok = direct_io_supported(directory)
    rows = [(backend, direct) for backend in available_backends() for direct in (False, True)]
    rows = [(backend, direct) for backend, direct in rows if direct_ok or not direct]
    nbytes = args.size_mb << 20
    data = AsyncFileIO(backend="python").empty(nbytes, torch.uint8)
    data.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    back = AsyncFileIO(backend="python").empty(nbytes, torch.uint8)
    path = os.path.join(directory, f"zero_aio_bench_{os.getpid()}")
    results: dict[tuple, list[tuple[float, float]]] = {}
    for _ in range(args.repeats):
        for backend, direct in rows:
            results.setdefault((backend, direct), []).append(
                _time_op(args, backend, direct, data, back, path)
            )
        if direct_ok:
            results.setdefault(("dd", True), []).append(_time_dd(args.size_mb, path))
    print(
        f"{args.size_mb} MiB in {directory} (O_DIRECT supported: {direct_ok}), block_size "
        f"{args.block_size}, queue_depth {args.queue_depth}, threads {args.threads}, median of "
        f"{args.repeats}\n"
    )
    print("| tool | backend | O_DIRECT | write GB/s (with fsync) | read GB/s (cold) |")
    print("| --- | --- | --- | --- | --- |")
    for (backend, direct), samples in results.items():
        tool = "dd bs=1M" if backend == "dd" else "AsyncFileIO"
        write = statistics.median(s[0] for s in samples)
        read = statistics.median(s[1] for s in samples)
        shown = "-" if backend == "dd" else backend
        print(f"| {tool} | {shown} | {'on' if direct else 'off'} | {write:.2f} | {read:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
