"""Process groups zero makes for itself: OwnGroup (outside torch's registry), the side groups
shared by sibling Communicators and Agreements over the same ranks, the rendezvous store where
agreements record arrivals, and new_group for model parallelism (ZeRO-R). Imports nothing of
zero.comm.
"""

import datetime
import weakref

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as _c10d

# Process groups zero creates beside the data-parallel group: creating one is collective and
# costs sockets, so engines over the same ranks share them, as long as the default group they
# were made under is the current one. That group is held by a weak reference: a strong one
# would keep it alive after destroy_process_group(), and its gloo worker threads, still
# running when the interpreter shuts down, then abort the finished process when they free a
# collective's tensors ("terminate called without an active exception").
_SIDE_GROUPS: dict[tuple, tuple[weakref.ref, "OwnGroup"]] = {}


def _side_group(purpose: str, ranks: list[int], backend, timeout_s) -> "OwnGroup":
    default = dist.distributed_c10d._get_default_group()
    key = (purpose, tuple(ranks), timeout_s)
    if key not in _SIDE_GROUPS or _SIDE_GROUPS[key][0]() is not default:
        _SIDE_GROUPS[key] = weakref.ref(default), OwnGroup(purpose, ranks, backend, timeout_s)
    return _SIDE_GROUPS[key][1]


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
        self.ranks = list(ranks)
        self.method_calls: dict[str, int] = {}  # Agreement.enter's count per method
        self.agreements = 0  # Agreements (engines) created over this group
        rank, size = ranks.index(dist.get_rank()), len(ranks)
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
        work = self.backend._allgather_base(output, input, _c10d.AllgatherOptions())
        return work if async_op else work.wait()

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        work = self.backend._reduce_scatter_base(output, input, dist.ReduceScatterOptions())
        return work if async_op else work.wait()


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
