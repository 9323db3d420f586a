"""The two-level all-gather: across nodes first, then within each node (MiCS's hierarchical
parameter gather, DeepSpeed's zero_optimization.mics_hierarchical_params_gather).

[Note: two-level all-gather]
MiCS (Zhang et al., arXiv 2205.00119, section 3.3 "hierarchical communication") gathers over a
shard group of s = k * l ranks that spans k nodes of l ranks each, numbered node by node: group
rank r is (node j, local index i) with r = j * l + i. A flat all-gather of a buffer of V elements
(shards of n = V / s elements) brings each rank the (k - 1) * l * n elements held on the other
nodes, so every rank of a node fetches the same remote data once more. Two levels fetch it once
per node:
1. Inter-node: an all-gather over the k ranks with local index i (one per node, `inter`) of this
   rank's shard: it receives the shards (j', i) for every node j', k * n elements into a staging
   buffer, and places them at their slots (j' * l + i) * n of the output.
2. Intra-node: for each node j', an all-gather over the l ranks of this node (`intra`) of the
   slot (j' * l + i) into the output's j'-th chunk of l * n elements (in place): the shards
   (j', i') for every local index i'.
The output is the flat all-gather's, bit for bit (only bytes move, nothing is summed). Per rank,
per gather, the ledger counts the paper's V elements as a flat all-gather does: k * n in step 1,
of which (k - 1) * n = V (k - 1) / s cross nodes (the flat gather: V (k - 1) / k, l times as
much), and k * (l - 1) * n = V - k * n in step 2, within the node (each chunk's own slot came in
step 1 and is not counted again). The staging buffer holds V / l elements until step 2 starts.

Order: step 2 needs step 1's data, so it is launched when the gather's handle is waited for
(after step 1 finished; on NCCL the current stream then waits for step 1, and step 2's
collectives are ordered after the copy). The groups' collectives must be launched in the same
order on every rank whatever order the handles are waited in, so a gather's wait first launches
step 2 of every gather launched before it and not yet waited (launch order, which every rank
shares). On NCCL, step 2 therefore overlaps no compute; step 1 does.
"""

from collections import deque

import torch

from .communicator import Communicator, Handle


class TwoLevelGather:
    """All-gathers over a group of inter.world_size nodes x intra.world_size ranks, in two levels
    ([Note: two-level all-gather]). `intra`: the group's ranks on this rank's node (intra.rank =
    local index i); `inter`: the group's ranks with local index i, one per node in node order
    (inter.rank = node j). Both count into the ledger of the group they were made from."""

    def __init__(self, intra: Communicator, inter: Communicator):
        if intra.world_size < 2 or inter.world_size < 2:
            raise ValueError(
                f"rank {intra.rank}: a two-level all-gather needs at least 2 nodes of at least 2 "
                f"ranks, got {inter.world_size} node(s) x {intra.world_size} rank(s); use the "
                "flat all-gather"
            )
        self.intra = intra
        self.inter = inter
        self._queued: deque[TwoLevelHandle] = deque()  # step 1 launched, step 2 not yet

    @property
    def world_size(self) -> int:
        return self.inter.world_size * self.intra.world_size

    @property
    def rank(self) -> int:
        """This rank in the whole group: node * ranks per node + local index."""
        return self.inter.rank * self.intra.world_size + self.intra.rank

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
    ) -> "TwoLevelHandle":
        """Concatenate every rank's `input` (n elements) into `output` (world_size * n elements,
        contiguous, input's dtype and device), group rank r's input at [r * n, (r + 1) * n): the
        result of Communicator.all_gather over the whole group. `input` may be this rank's own
        slice of `output`. With async_op the returned handle's wait() finishes both levels;
        `input` must stay unchanged until then. Collective over both groups: every rank calls it
        in the same order. Raises ValueError for sizes, TypeError for a non-contiguous output."""
        n = input.numel()
        if output.numel() != self.world_size * n:
            raise ValueError(
                f"rank {self.rank}: two-level all-gather needs an output of world_size * "
                f"input.numel() = {self.world_size} * {n} elements, got {output.numel()}"
            )
        if not output.is_contiguous():
            raise TypeError(
                f"rank {self.rank}: the two-level all-gather's output must be contiguous"
            )
        staging = torch.empty(self.inter.world_size * n, dtype=output.dtype, device=output.device)
        first = self.inter.all_gather(staging, input.reshape(-1), async_op=True)
        handle = TwoLevelHandle(self, output.view(-1), staging, input, first)
        self._queued.append(handle)
        if not async_op:
            handle.wait()
        return handle

    def _launch_second_through(self, handle: "TwoLevelHandle") -> None:
        """Launch step 2 of every queued gather up to `handle`, in launch order."""
        while handle.second is None:
            self._queued.popleft()._launch_second()


class TwoLevelHandle:
    """The pair of `TwoLevelGather.all_gather`: wait() finishes both levels (idempotent)."""

    def __init__(self, owner, output, staging, input, first: Handle):
        self._owner = owner
        self._output = output
        self._staging = staging
        self._input = input  # read by step 1 until it finished
        self._first = first
        self.second: list[Handle] | None = None  # step 2's all-gathers, once launched
        self.blocks_host = first.blocks_host

    def done(self) -> bool:
        """True once both levels finished (never blocks; False until step 2 was launched)."""
        return self.second is not None and all(h.done() for h in self.second)

    def _launch_second(self) -> None:
        intra, nodes = self._owner.intra, self._owner.inter.world_size
        local, n = intra.world_size, self._staging.numel() // nodes
        self._first.wait()
        chunks = self._output.view(nodes, local, n)
        chunks[:, intra.rank].copy_(self._staging.view(nodes, n))
        self._staging = self._input = None
        self.second = [
            intra.all_gather(
                chunks[node].view(-1),
                chunks[node, intra.rank],
                async_op=True,
                counted=(local - 1) * n,
            )
            for node in range(nodes)
        ]

    def wait(self) -> None:
        if self.second is None:
            self._owner._launch_second_through(self)
        for handle in self.second:
            handle.wait()
