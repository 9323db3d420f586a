"""Process groups zero makes for itself: OwnGroup (outside torch's registry), the side groups
shared by sibling Communicators and Agreements over the same ranks, the rendezvous store where
agreements record arrivals, and new_group for model parallelism (ZeRO-R). Imports nothing of
zero.comm.
"""

import atexit
import datetime
import os
import weakref

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as _c10d

# Process groups zero creates beside the data-parallel group: creating one is collective and
# costs sockets, so engines over the same ranks share them, as long as the default group they
# were made under is the current one. That group is held by a weak reference: a strong one
# would keep it alive after destroy_process_group() ([Note: threads at exit]).
_SIDE_GROUPS: dict[tuple, tuple[weakref.ref, "OwnGroup"]] = {}
_closed_at_exit = False  # close_side_groups is registered with atexit


def _side_group(purpose: str, ranks: list[int], backend, timeout_s) -> "OwnGroup":
    global _closed_at_exit
    default = dist.distributed_c10d._get_default_group()
    key = (purpose, tuple(ranks), timeout_s)
    if key not in _SIDE_GROUPS or _SIDE_GROUPS[key][0]() is not default:
        if not _closed_at_exit:
            atexit.register(close_side_groups)
            _closed_at_exit = True
        _SIDE_GROUPS[key] = weakref.ref(default), OwnGroup(purpose, ranks, backend, timeout_s)
    return _SIDE_GROUPS[key][1]


def close_side_groups() -> None:
    """Destroy every side group (OwnGroup.close): zero.comm.destroy_process_group calls it once
    every rank is done, and interpreter exit (atexit) for a script that ends without it. A
    collective still in flight is waited for (it fails at the group's timeout if a peer never
    joins it). Not a collective.

    [Note: threads at exit]
    A gloo process group runs worker threads, and a worker frees the tensors of the collective
    it ran once the caller's wait() has returned, a moment later. A tensor whose Python object
    the caller dropped meanwhile (an agreement check's buffers, a temporary) needs the GIL to
    be freed; once the interpreter has begun to shut down, taking the GIL ends the thread
    (pthread_exit) inside a destructor, and the process aborts after its work is done:
    "terminate called without an active exception" (1 launch in about 50 of a 2-rank stage-3
    job on a loaded machine). So no thread of zero's may outlive the interpreter: its side
    groups are destroyed here, which joins their workers while Python still runs; the reduce-
    scatter watcher stops (watcher.stop_watcher); and the default group is made after
    torch.distributed.nn is imported (launch.py), so that torch's destroy_process_group really
    destroys it and joins its threads too."""
    # A forked child holds copies of its parent's groups, whose threads it does not have.
    mine = [key for key, (_, group) in _SIDE_GROUPS.items() if group.pid == os.getpid()]
    for key in mine:
        _SIDE_GROUPS.pop(key)[1].close()


class OwnGroup:
    """A process group over `ranks` (global ranks, this rank among them) that zero creates for
    itself, outside torch's registry of groups: torch names the groups it creates by how many
    exist on the creating rank, so a group created later on some ranks only (an engine over a
    data-parallel subgroup while other ranks idle) would get different names on different
    ranks and never connect. This one meets in the rendezvous store under a name made of
    `purpose` and the ranks. Backend: `backend`, else the default group's. Only its members
    construct it (collective among them)."""

    def __init__(self, purpose: str, ranks: list[int], backend=None, timeout_s=None):
        store = dist.PrefixStore(
            f"zero-group/{purpose}/{'-'.join(map(str, ranks))}/{timeout_s}/",
            dist.distributed_c10d._get_default_store(),
        )
        timeout = (
            dist.constants.default_pg_timeout
            if timeout_s is None
            else datetime.timedelta(seconds=timeout_s)
        )
        self.purpose = purpose
        self.pid = os.getpid()
        self.global_rank = dist.get_rank()
        self.ranks = list(ranks)
        self.method_calls: dict[str, int] = {}  # Agreement.enter's count per method
        self.agreements = 0  # Agreements (engines) created over this group
        self.heartbeat = None  # liveness.Heartbeat of the agreement group, stopped by close()
        rank, size = ranks.index(self.global_rank), len(ranks)
        backend = backend or dist.get_backend()
        self.backend_name = str(backend)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = False
            options._timeout = timeout
            self.backend = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            self.backend = dist.ProcessGroupGloo(store, rank, size, timeout=timeout)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        work = self._open()._allgather_base(output, input, _c10d.AllgatherOptions())
        return work if async_op else work.wait()

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        work = self._open()._reduce_scatter_base(output, input, dist.ReduceScatterOptions())
        return work if async_op else work.wait()

    def all_reduce(self, tensor: torch.Tensor, op, async_op: bool = False):
        options = dist.AllreduceOptions()
        options.reduceOp = op
        work = self._open().allreduce([tensor], options)
        return work if async_op else work.wait()

    def _open(self):
        if self.backend is None:
            raise RuntimeError(
                f"rank {self.global_rank}: zero's '{self.purpose}' process group over ranks "
                f"{self.ranks} was destroyed by zero.comm.destroy_process_group(); an engine "
                "cannot communicate after it: build a new one with zero.initialize"
            )
        return self.backend

    def close(self) -> None:
        """Destroy the process group now: its collectives in flight finish (or fail at its
        timeout) and its worker threads end before this returns ([Note: threads at exit]).
        Idempotent; a collective on it afterwards raises RuntimeError."""
        if self.heartbeat is not None:
            self.heartbeat.stop()
        backend, self.backend = self.backend, None
        if backend is not None and self.backend_name == "nccl":
            backend.shutdown()  # as torch.distributed.destroy_process_group does for its groups
        # The last reference: the destructor waits for the work queue and joins the threads,
        # with the GIL released, so a thread that frees a tensor of Python's can take it.
        del backend


def _agreement_store(ranks: list[int]):
    """The rendezvous store, where ranks record the collective methods they entered (None when
    torch does not expose it)."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
    return dist.PrefixStore(f"zero-agreement/{ranks[0]}-{len(ranks)}/", store)


# Model parallelism (ZeRO-R): model_parallel/mpu.py makes its groups with this.
def new_group(ranks: list[int]):
    """A process group over `ranks` (ranks of the default group), for a Communicator.

    Collective over the default group: every rank must call it, with the same `ranks`, in the
    same order of calls, including ranks that are not members (torch.distributed's rule).
    """
    return dist.new_group(sorted(ranks))
