"""The Communicator: every collective zero issues for the engine, counted in its ledger.

Each call records in its CommLedger (ledger.py) how many elements and bytes it moved per rank, in
the paper's units (ZeRO, section 7): a reduce-scatter of a buffer of n elements counts n, an
all-gather into a buffer of n elements counts n, and an all-reduce of n elements counts 2n (it is
a reduce-scatter followed by an all-gather). Summed over one optimizer step this gives 2 Psi for
stages 0-2. Each count is split into intra-node and inter-node parts by the group's Topology
([Note: intra- and inter-node volume] in topology.py).

A Communicator with world size 1 performs the same operations locally (copies) without any
process group, so single-process runs take exactly the code path of multi-rank runs; nothing
crosses a network then, so nothing is counted.

Outside zero.comm nothing calls torch.distributed collectives. Inside it, this module issues the
engine's; the others are agreement.py's small checks (on an OwnGroup of groups.py) and a training
script's own, through deepspeed.py, neither counted.
"""

import logging
import time

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as _c10d

from .agreement import Agreement
from .groups import OwnGroup, _side_group
from .ledger import CommLedger
from .topology import Topology, inter_node_elements, read_topology, single_node
from .watcher import _Exchange, _started, _watcher

logger = logging.getLogger("zero")


# torch 2.6 names these all_gather_into_tensor and reduce_scatter_tensor; newer torch calls them
# *_single and warns on the old names.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def wait_blocks_host(backend: str, on_cuda: bool) -> bool:
    """Whether waiting for a collective blocks the calling thread until every peer joined it.
    Only NCCL on CUDA tensors waits without blocking (the current stream waits instead); gloo
    blocks, on CUDA tensors too (it stages them through host memory on its worker threads), as
    when two ranks share one GPU over gloo."""
    return not (on_cuda and backend == "nccl")


class Handle:
    """The pair of an asynchronous collective: `wait()` finishes it (idempotent)."""

    def __init__(self, work=None, on_done=None, blocks_host=True):
        self._work = work
        self._on_done = on_done  # timing: on_done(wait_start) once the collective has finished
        # wait() blocks the calling thread (gloo on host tensors); NCCL's wait only makes the
        # current CUDA stream wait for the collective.
        self.blocks_host = blocks_host

    def done(self) -> bool:
        """True once the collective has finished (never blocks)."""
        return self._work is None or self._work.is_completed()

    def wait(self) -> None:
        start = time.perf_counter()
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._on_done is not None:
            self._on_done(start)
            self._on_done = None


# The smallest per-peer slice, in bytes, that a gloo reduce-scatter or all-gather sends as a
# point-to-point exchange ([Note: gloo exchanges]); smaller ones use gloo's collectives.
_EXCHANGE_MIN_BYTES = 2 << 20

# Tags of the exchanges' point-to-point messages start here, above any a script plausibly
# uses for its own send/recv on the same group (torch's default tag is 0).
_EXCHANGE_TAG_BASE = 1 << 24


class Communicator:
    """Collectives over one data-parallel group, with traffic counting.

    Every method is a collective: all ranks of the group must call it in the same order with
    tensors of the same size and dtype. `group` None with world_size 1 means no process group.
    """

    def __init__(self, group, rank: int, world_size: int, topology: Topology | None = None):
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.ledger = CommLedger()
        # Which ranks share a node (topology.py); None: one node, nothing counts as inter-node.
        self.topology = topology
        self._local_count: int | None = None  # this rank's group members on its node
        self._node_groups: tuple | None = None  # node_groups(), made at its first call
        # [Note: collective timing] None = no timing; else the collective names whose `seconds`
        # are measured (an empty set: all). A collective's `seconds` run from its launch until
        # its wait() returns (for asynchronous ones this includes the compute it overlapped
        # with); on CUDA the wait synchronizes the device so the time is the transfer's, not the
        # launch's. The caller's waiting (ledger.waited, for wall_clock_breakdown) is measured
        # for every collective while timing is on.
        self.timing: frozenset | None = None
        self.verbose = False  # log every collective as it is issued
        self.agreement: Agreement | None = None  # set by start_agreement()
        self._siblings: list[Communicator] = []
        self._backend: str | None = None
        self._exchanges = 0  # [Note: gloo exchanges]: the tag of the next one

    def sibling(self, purpose: str, timeout_s: float | None = None) -> "Communicator":
        """A Communicator over the same ranks on a process group of its own (same backend),
        counting into this one's ledger, for collectives whose order relative to this group's
        may differ between ranks (stage 3's gradient reduce-scatters, [Note: two groups at
        stage 3] in partition/stages.py). It supports reduce_scatter() only. Collective over the
        group's ranks at the first call for `purpose`; cached after. `timeout_s`: how long a
        collective waits for the other ranks (default torch's)."""
        if self.world_size == 1:
            group = None
        else:
            group = _side_group(purpose, self._global_ranks(), None, timeout_s)
        other = Communicator(group, self.rank, self.world_size, self.topology)
        other.ledger = self.ledger
        self._siblings.append(other)
        return other

    def subgroup(self, purpose: str, members: list[int], timeout_s: float | None = None):
        """A Communicator over `members` (ranks of this group, this rank among them, in the
        order that gives their ranks in the new group) on a process group of its own, counting
        into this one's ledger with the same topology: MiCS's shard and replica groups and
        hpZ's secondary group (partition/hierarchy.py). This Communicator itself when `members`
        is the whole group in order. Collective over `members` at the first call for
        (`purpose`, members); cached after."""
        members = list(members)
        if members == list(range(self.world_size)):
            return self
        global_ranks = self._global_ranks()
        ranks = [global_ranks[m] for m in members]
        group = None if len(members) == 1 else _side_group(purpose, ranks, None, timeout_s)
        other = Communicator(group, members.index(self.rank), len(members), self.topology)
        other.ledger = self.ledger
        other.timing, other.verbose = self.timing, self.verbose
        self._siblings.append(other)
        return other

    def start_agreement(self, timeout_s: float) -> "Agreement | None":
        """Check, before zero's collectives, that every rank is about to do the same thing
        (see [Note: agreement across ranks] in agreement.py). Collective at the first call per
        timeout."""
        if self.world_size > 1 and self.agreement is None:
            self.agreement = Agreement(self._global_ranks(), self.rank, timeout_s)
        return self.agreement

    def node_groups(self, timeout_s: float | None = None) -> tuple["Communicator", "Communicator"]:
        """(intra, inter): Communicators over this group's ranks on this rank's node, and over
        the ranks with this rank's local index on every node (one per node, in node order),
        from `topology` (one node when None), counting into this ledger. For hierarchical
        collectives (ZeRO++'s qgZ). Collective over this group at the first call (every rank
        calls it; each creates the two groups it belongs to); cached after. Raises ValueError,
        naming the node sizes, when the nodes hold different numbers of this group's ranks."""
        if self._node_groups is None:
            ranks = self._global_ranks()
            topology = self.topology or single_node(ranks)
            by_node: dict[int, list[int]] = {}
            for member, rank in enumerate(ranks):
                by_node.setdefault(topology.node_of(rank), []).append(member)
            sizes = {node: len(members) for node, members in by_node.items()}
            if len(set(sizes.values())) > 1:
                raise ValueError(
                    f"rank {self.rank}: the nodes hold different numbers of ranks ({sizes}, from "
                    f"{topology.source}); intra- and inter-node groups need equal nodes: set "
                    "ZERO_RANKS_PER_NODE, or launch the same number of ranks on every node"
                )
            intra = by_node[topology.node_of(ranks[self.rank])]
            local = intra.index(self.rank)
            inter = [by_node[node][local] for node in sorted(by_node)]
            self._node_groups = (
                self.subgroup("intra-node", intra, timeout_s),
                self.subgroup("inter-node", inter, timeout_s),
            )
        return self._node_groups

    def global_ranks(self) -> list[int]:
        """The global ranks of this group, in group-rank order. Not a collective."""
        return self._global_ranks()

    def _global_ranks(self) -> list[int]:
        if isinstance(self.group, OwnGroup):
            return list(self.group.ranks)
        if self.group is None:
            if self.world_size == 1:
                return [dist.get_rank() if dist.is_available() and dist.is_initialized() else 0]
            return list(range(dist.get_world_size()))
        return dist.get_process_group_ranks(self.group)

    def inter_node_elements(self, elements: int) -> int:
        """The part of a collective's per-rank volume `elements` (paper units) over this group
        exchanged with ranks on other nodes: elements * (n - n_local) // n, n the group's size,
        n_local its ranks on this rank's node ([Note: intra- and inter-node volume] in
        topology.py). 0 without a topology or with one rank. Not a collective."""
        if self.topology is None or self.world_size == 1:
            return 0
        if self._local_count is None:
            ranks = self._global_ranks()
            self._local_count = self.topology.local_count(ranks, ranks[self.rank])
        return inter_node_elements(elements, self.world_size, self._local_count)

    def enable_timing(self, ops=(), verbose: bool = False) -> None:
        """Time collectives named in `ops` (all when empty) into the ledger's `seconds`, and
        every collective's waiting into `ledger.waited`; so do its siblings and subgroups, and
        theirs (MiCS's two-level gather groups are subgroups of the shard group)."""
        self.timing = frozenset(ops)
        self.verbose = verbose
        for other in self._siblings:
            other.enable_timing(ops, verbose)

    @property
    def backend(self) -> str:
        """The backend of this group's collectives ("nccl", "gloo"); "" without a group."""
        if self._backend is None:
            if isinstance(self.group, OwnGroup):
                self._backend = self.group.backend_name
            elif self.world_size > 1:
                self._backend = str(dist.get_backend(self.group))
            else:
                self._backend = ""
        return self._backend

    def _record(
        self, op: str, elements: int, tensor: torch.Tensor, quantized: int | None = None
    ) -> None:
        if self.world_size == 1:
            return
        if quantized is None:
            inter = self.inter_node_elements(elements)
            self.ledger.record(op, elements, tensor.element_size(), inter)
        else:
            # ZeRO++: `quantized` values (paper units) travel as `tensor`'s bytes, recorded
            # under `op` ("all_gather_q", "all_to_all_q") so the plain ops' totals stay in
            # elements of the compute dtype.
            elements, nbytes = quantized, tensor.numel() * tensor.element_size()
            inter = self.inter_node_elements(elements)
            self.ledger.record(op, elements, 0, inter, nbytes, self.inter_node_elements(nbytes))
        if self.verbose:
            logger.info("rank %d: %s of %d elements (%s)", self.rank, op, elements, tensor.dtype)

    def _run(self, op: str, tensor: torch.Tensor, launch, async_op: bool) -> Handle:
        """Launch a collective (launch() returns torch's work or None) and time it if asked."""
        if self.timing is None:
            return Handle(launch(), blocks_host=wait_blocks_host(self.backend, tensor.is_cuda))
        timed = not self.timing or op in self.timing
        start = time.perf_counter()
        work = launch()
        launching = time.perf_counter() - start  # a synchronous collective runs in here

        def done(wait_start: float) -> None:
            if tensor.is_cuda:
                torch.cuda.synchronize(tensor.device)
            end = time.perf_counter()
            seconds = end - start if timed else 0.0
            self.ledger.add_time(op, seconds, launching + end - wait_start)

        handle = Handle(work, on_done=done, blocks_host=True)  # done() synchronizes
        if not async_op:
            handle.wait()
        return handle

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False) -> Handle:
        """Sum (op "sum") or maximum (op "max") of `tensor` over the group, in place."""
        self._record("all_reduce", 2 * tensor.numel(), tensor)
        if self.world_size == 1:
            return Handle()
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        if isinstance(self.group, OwnGroup):
            launch = lambda: self.group.all_reduce(tensor, reduce_op, async_op)  # noqa: E731
        else:
            launch = lambda: dist.all_reduce(  # noqa: E731
                tensor, reduce_op, group=self.group, async_op=async_op
            )
        return self._run("all_reduce", tensor, launch, async_op)

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
    ) -> Handle:
        """Sum `input` (world_size * n elements) over ranks; rank r receives slice r in `output`.

        `output` must hold n = input.numel() / world_size elements of input's dtype; it may be
        rank r's own slice of `input` (in-place reduce-scatter, as NCCL and gloo allow).
        """
        assert input.numel() == output.numel() * self.world_size, (input.shape, output.shape)
        self._record("reduce_scatter", input.numel(), input)
        if self.world_size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return Handle()
        if self._exchanges_on(input):
            launch = lambda: self._exchange_reduce_scatter(output, input, async_op)  # noqa: E731
        elif isinstance(self.group, OwnGroup):
            launch = lambda: self.group.reduce_scatter(output, input, async_op)  # noqa: E731
        else:
            launch = lambda: _reduce_scatter_single(  # noqa: E731
                output, input, group=self.group, async_op=async_op
            )
        if async_op and self.backend == "gloo" and not input.is_cuda:
            launch = self._watched(launch)
        return self._run("reduce_scatter", input, launch, async_op)

    def _watched(self, launch):
        """launch, with the work it returns waited for by the watcher thread ([Note: watched
        reduce-scatters] in watcher.py)."""

        def start():
            work = launch()
            exchange = work if isinstance(work, _Exchange) else _Exchange([work])
            return _watcher().watch(exchange)

        return start

    def all_gather(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        async_op: bool = False,
        quantized: int | None = None,
        counted: int | None = None,
    ) -> Handle:
        """Concatenate every rank's `input` (n elements) into `output` (world_size * n elements).

        `input` may be rank r's own slice of `output` (in-place gather, no extra buffer).
        `quantized`: the buffers hold quantized data standing for this many values (ZeRO++
        qwZ, zero.comm.quantized); the ledger records them under "all_gather_q" with output's
        bytes. `counted`: the elements the ledger records instead of output.numel() (the
        second level of a two-level all-gather, [Note: two-level all-gather] in two_level.py).
        """
        assert output.numel() == input.numel() * self.world_size, (output.shape, input.shape)
        op = "all_gather" if quantized is None else "all_gather_q"
        self._record(op, output.numel() if counted is None else counted, output, quantized)
        if self.world_size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return Handle()
        if self._exchanges_on(output):
            launch = lambda: self._exchange_all_gather(output, input, async_op)  # noqa: E731
        elif isinstance(self.group, OwnGroup):
            launch = lambda: self.group.all_gather(output, input, async_op)  # noqa: E731
        else:
            launch = lambda: _all_gather_single(  # noqa: E731
                output, input, group=self.group, async_op=async_op
            )
        return self._run(op, output, launch, async_op)

    # [Note: gloo exchanges]
    # gloo's reduce-scatter and all-gather stage through extra copies and run 3-4x slower than
    # its all-reduce of the same buffer (10.8M fp32 elements, 2 ranks: all-reduce 37 ms,
    # reduce-scatter 102 ms, all-gather 70 ms), which would make stages 1-3 pay more for half
    # the traffic. On gloo with host tensors zero therefore runs them as direct exchanges: every
    # rank posts, at once, a send of each peer's slice to that peer and a receive of each
    # peer's contribution (24 and 16 ms for the same buffer). The elements each rank sends are
    # the paper's: (N - 1)/N of the buffer, as a ring's. Each message costs a round trip before
    # its data moves, so below _EXCHANGE_MIN_BYTES per peer slice gloo's own are faster (2 ranks,
    # back to back: 500K-element buffers 3.5 ms exchanged vs 2.7 ms; 2M-element 4.6 vs 10 ms).
    # A reduce-scatter receives into a transient buffer of (N - 1) slices and sums when waited
    # for: this rank's slice first, then the peers' in rank order (a fixed order, so reruns are
    # bitwise equal). The messages of one exchange share a tag, one per exchange (ranks issue
    # zero's collectives in the same order), so concurrent exchanges never match each other's
    # messages. A handle must be waited for before its tensors are dropped (zero always does).
    # NCCL keeps its own collectives.
    def _exchanges_on(self, tensor: torch.Tensor) -> bool:
        slice_bytes = tensor.numel() // self.world_size * tensor.element_size()
        return self.backend == "gloo" and not tensor.is_cuda and slice_bytes >= _EXCHANGE_MIN_BYTES

    def _peer_group(self):
        """The torch ProcessGroup whose send/recv take this group's ranks."""
        if isinstance(self.group, OwnGroup):
            return self.group._open()
        return self.group if self.group is not None else _c10d._get_default_group()

    def _next_tag(self) -> int:
        self._exchanges = (self._exchanges + 1) % (1 << 20)
        return _EXCHANGE_TAG_BASE + self._exchanges

    def _exchange_reduce_scatter(self, output, input, async_op: bool):
        group, tag, n = self._peer_group(), self._next_tag(), output.numel()
        peers = [p for p in range(self.world_size) if p != self.rank]
        received = torch.empty((len(peers), n), dtype=input.dtype, device=input.device)
        # Receives are posted before sends, so no send waits for a receive not yet posted.
        works = [group.recv([received[i]], peer, tag) for i, peer in enumerate(peers)]
        works += [group.send([input[peer * n : (peer + 1) * n]], peer, tag) for peer in peers]
        own = input[self.rank * n : (self.rank + 1) * n]

        def finish() -> None:
            if output.data_ptr() != own.data_ptr():
                output.copy_(own)
            for row in received:
                output.add_(row)

        return _started(_Exchange(works, finish), async_op)

    def _exchange_all_gather(self, output, input, async_op: bool):
        group, tag, n = self._peer_group(), self._next_tag(), input.numel()
        own = output[self.rank * n : (self.rank + 1) * n]
        if own.data_ptr() != input.data_ptr():
            own.copy_(input)
        peers = [p for p in range(self.world_size) if p != self.rank]
        works = [group.recv([output[peer * n : (peer + 1) * n]], peer, tag) for peer in peers]
        works += [group.send([input], peer, tag) for peer in peers]
        return _started(_Exchange(works), async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Copy `tensor` from group rank `src` to every rank, in place."""
        self._record("broadcast", tensor.numel(), tensor)
        if self.world_size > 1:
            self._run(
                "broadcast",
                tensor,
                lambda: dist.broadcast(tensor, group_src=src, group=self.group),
                False,
            )

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        async_op: bool = False,
        quantized: int | None = None,
    ) -> Handle:
        """Rank r sends slice p of `input` (world_size equal slices, numel divisible by
        world_size) to rank p, which receives it as slice r of `output` (same numel and dtype,
        not overlapping `input`). Counted as input.numel() elements of input's dtype, as a
        reduce-scatter counts its input (ZeRO++ qgZ's exchanges, zero.comm.quantized).
        `quantized`: as for all_gather ("all_to_all_q", input's bytes)."""
        assert output.numel() == input.numel() and input.numel() % self.world_size == 0, (
            output.shape,
            input.shape,
        )
        op = "all_to_all" if quantized is None else "all_to_all_q"
        self._record(op, input.numel(), input, quantized)
        if self.world_size == 1:
            output.copy_(input)
            return Handle()
        if isinstance(self.group, OwnGroup):

            def launch():
                group = self.group._open()
                work = group.alltoall_base(output, input, [], [], dist.AllToAllOptions())
                return work if async_op else work.wait() and None

        else:
            launch = lambda: dist.all_to_all_single(  # noqa: E731
                output, input, group=self.group, async_op=async_op
            )
        return self._run(op, input, launch, async_op)


def data_parallel_comm(mpu=None, group=None) -> Communicator:
    """The Communicator of the data-parallel group: the mpu's, else `group`, else every rank (one
    rank when torch.distributed is not initialized), with the group's node Topology read from
    the launch environment (topology.read_topology: every rank of the group must call this when
    GROUP_RANK or NODE_RANK is set)."""
    if mpu is not None:
        comm = Communicator(
            mpu.get_data_parallel_group(),
            mpu.get_data_parallel_rank(),
            mpu.get_data_parallel_world_size(),
        )
    elif not (dist.is_available() and dist.is_initialized()):
        return Communicator(None, 0, 1, single_node([0]))
    elif group is not None:
        comm = Communicator(group, dist.get_rank(group), dist.get_world_size(group))
    else:
        comm = Communicator(None, dist.get_rank(), dist.get_world_size())
    # Every rank of the group is here (zero.initialize, zero.Init): the nodes are read once.
    comm.topology = read_topology(comm._global_ranks(), dist.get_rank())
    return comm
