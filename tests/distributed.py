"""Run a function on N gloo ranks (CPU processes) and collect per-rank results.

Starting a rank from a fresh interpreter costs a few seconds (importing torch, torch._dynamo on
the first optimizer, zero, and transformers where a test uses it), so ranks are forked from a
server process that imported those once (multiprocessing's forkserver). Importing runs none of
zero's code that keeps state, so every rank still starts from a fresh zero; the test module is
imported by every rank. Tests still start a group once and sweep their cases inside it: each
group pays for the gloo rendezvous and zero's first initialize.
"""

import contextlib
import multiprocessing as mp
import os
import pickle
import queue as queue_module
import socket
import time
import traceback


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Imported once by the fork server, before it forks any rank (a module that is not installed is
# skipped). Read from the environment at import: nothing of zero's, DS_ENV_FILE only in
# zero.integrations.deepspeed, which is not among these.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "zero.engine.engine",
    "transformers.modeling_utils",
]


# Set in a rank by abandon_group().
_ABANDONED = "ZERO_TEST_GROUP_ABANDONED"


def abandon_group() -> None:
    """Mark this rank's process group as unusable: after a RankMismatchError a rank may hold
    collectives its peers never issued, and the closing barrier would wait until run_ranks kills
    the rank (10 s). The rank then ends, once its result is sent, without barrier or teardown."""
    os.environ[_ABANDONED] = "1"


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _child(fn, rank, world_size, port, args, queue, environ):
    # A forked rank inherits the server's environment, as of the server's start: give it the
    # caller's, as a spawned process would get (a test may have set a variable since).
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    ok = False
    try:
        # Plain pickle copies tensors; the queue's own reducer would share them by file
        # descriptor, which dies with this process.
        message = (rank, True, pickle.dumps(fn(*args)))
        ok = True
    except BaseException:
        message = (rank, False, traceback.format_exc())
    # The whole result is in the pipe before the teardown, which can abort this process
    # (torch's gloo teardown, rarely): run_ranks, holding the pipe's write end itself, would
    # wait forever for the rest of a result cut short.
    queue.put(message)
    queue.close()
    queue.join_thread()
    if os.environ.get(_ABANDONED) == "1":
        os._exit(0)
    if dist.is_initialized():
        if ok:
            dist.barrier()  # no rank closes its sockets while a peer still talks to it
        dist.destroy_process_group()


def _dead_without_result(procs, results) -> bool:
    return any(r not in results and p.exitcode is not None for r, p in enumerate(procs))


def _raise_missing(procs, results, timeout):
    for rank, proc in enumerate(procs):
        if rank not in results and proc.exitcode is not None:
            raise RuntimeError(f"rank {rank} exited with code {proc.exitcode} without a result")
    missing = sorted(set(range(len(procs))) - set(results))
    raise RuntimeError(f"ranks {missing} did not finish within {timeout} s")


def run_ranks(fn, world_size: int, *args, timeout: float = 240.0) -> list:
    """Call fn(*args) on `world_size` new ranks with RANK/WORLD_SIZE/MASTER_* set.

    fn must be a module-level function; it may call zero.initialize (which creates the gloo group)
    any number of times. Returns the results ordered by rank. Raises RuntimeError with the failing
    rank's traceback, when a rank exits without a result, or on timeout; every rank is
    terminated either way.
    """
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [
        ctx.Process(
            target=_child, args=(fn, r, world_size, port, args, queue, environ), daemon=True
        )
        for r in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            try:
                rank, ok, value = queue.get(timeout=1.0)
            except queue_module.Empty:
                # A rank may have exited just after queueing its result: look once more (its
                # result is all in the pipe once it exited: _child sends it before anything else).
                if _dead_without_result(procs, results) or time.monotonic() > deadline:
                    try:
                        rank, ok, value = queue.get(timeout=1.0)
                    except queue_module.Empty:
                        _raise_missing(procs, results, timeout)
                else:
                    continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        failed = len(results) < world_size
        for proc in procs:
            if failed and proc.is_alive():
                proc.kill()  # peers of a failed rank may wait in a collective forever
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return [results[r] for r in range(world_size)]


def full_params(engine) -> dict:
    """name -> a copy of every parameter's full value (a collective at stage 3: every rank)."""
    import zero

    with zero.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


@contextlib.contextmanager
def one_thread():
    """Run a single-process reference on one thread, as each spawned rank runs (_child): a
    multi-threaded CPU kernel may sum in another order and round differently."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
