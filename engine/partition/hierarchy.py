"""Hierarchical partitioning: the process groups MiCS and ZeRO++'s hpZ partition over.

[Note: MiCS]
MiCS (Zhang et al., arXiv 2205.00119; DeepSpeed's zero_optimization.mics_shard_size) partitions
the model states within shard groups of s = mics_shard_size consecutive data-parallel ranks
(ranks i*s .. i*s+s-1) and replicates them across the N/s groups. Data-parallel rank r owns
shard r mod s of every bucket (FlatLayout.shard_of). Parameter all-gathers and gradient
reduce-scatters run over the shard group; at the gradient accumulation boundary every owned
gradient shard is all-reduced over the replica group (the N/s ranks that own the same shard,
ranks j, j+s, j+2s, ...), so each shard holds the sum over all N ranks and the step divides by
N, as without MiCS. With s = ranks per node, every all-gather and reduce-scatter stays inside a
node and only the replica all-reduce crosses nodes. DeepSpeed offers MiCS at stage 3 only; the
same groups serve stages 1 and 2 here (optimizer states, and gradients at stage 2, partitioned
within the shard group).
Per optimizer step, per rank, in the paper's units (Psi = parameter count, G = gradient
accumulation steps, R = N/s replicas): the shard group moves what ZeRO moves at N = s (stage 1:
2 Psi; stage 2: (G + 1) Psi; stage 3: 3 G Psi without reuse), and the replica all-reduce 2 Psi/s,
of which (R - 1)/R crosses nodes when each replica lives on another node.
With mics_hierarchical_params_gather and a shard group that spans k nodes of l ranks (s = k * l,
numbered node by node), the parameter all-gathers (stage 3's, and the all-gather of the updated
parameters at stages 1 and 2) run in two levels, across nodes among the ranks with the same local
index, then within each node ([Note: two-level all-gather] in comm/two_level.py): the same
result bit for bit, and per gather of V elements V (k - 1) / s elements cross nodes per rank
instead of V (k - 1) / k. DeepSpeed applies it at stage 3 only. A shard group within one node,
or one rank per node, gathers flat (there is nothing to split).
Checkpoints: the ranks of the first shard group (r < s) write the shards; the other replicas hold
the same values and write only their per-rank state (checkpoint/ownership.py). The files are
keyed by ownership ranges, so a MiCS checkpoint loads at any world size and with or without MiCS.

[Note: hpZ]
ZeRO++'s hierarchical partitioning (Wang et al., arXiv 2306.10209, section 3.2; DeepSpeed's
zero_optimization.zero_hpz_partition_size = k, stage 3): the primary partition stays over all N
ranks, and each rank also keeps a secondary copy of the parameters partitioned over its group of
k consecutive ranks (ranks i*k .. i*k+k-1, a node when k = ranks per node): 1/k of each unit,
taken from the forward all-gather's result. The backward all-gather of a unit then reads the
secondary shards over the k-rank group only (gatherer.py, ParamGatherer). Per step the forward
all-gather and the reduce-scatter still move Psi each over all N ranks; the backward Psi stays
within the node. The secondary copy costs Psi/k elements of the compute dtype per rank (2 Psi/k
bytes in bf16), kept from the first forward on (engine.model_state_bytes()["secondary_params"]).
A secondary shard is valid from its unit's forward all-gather to the end of that micro-batch's
backward; a gather outside that window uses the primary shards.
"""

import logging
from dataclasses import dataclass

import torch

from ..comm import Communicator, Handle
from ..comm.two_level import TwoLevelGather, TwoLevelHandle

logger = logging.getLogger("zero")


@dataclass(frozen=True)
class PartitionGroups:
    """Where one engine partitions. `shard`: the group parameters, gradients and optimizer
    states are partitioned over (the data-parallel group, or a MiCS shard group). `replica`: MiCS
    only, the ranks owning the same shard in the other shard groups, over which the reduced
    gradient shards are all-reduced at the accumulation boundary. `secondary`: hpZ only, the
    group of zero_hpz_partition_size ranks the backward all-gathers run over. `two_level`:
    MiCS with mics_hierarchical_params_gather over a shard group spanning nodes, the two-level
    parameter all-gather ([Note: MiCS])."""

    shard: Communicator
    replica: Communicator | None = None
    secondary: Communicator | None = None
    two_level: TwoLevelGather | None = None

    def all_gather_params(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
    ) -> Handle | TwoLevelHandle:
        """All-gather parameter shards over the shard group: `input` (n elements, this rank's
        shard) into `output` (shard.world_size * n elements, the same dtype and device), in two
        levels where `two_level` is set, else flat; the same result either way. Collective over
        the shard group (every rank calls it in the same order); async_op: wait() the handle."""
        if self.two_level is not None:
            return self.two_level.all_gather(output, input, async_op)
        return self.shard.all_gather(output, input, async_op)

    @property
    def first_replica(self) -> bool:
        """True on the ranks of the first shard group (the ranks that write checkpoint shards
        and add their gradient squares into the global norm)."""
        return self.replica is None or self.replica.rank == 0


def num_shards(zero_config, world_size: int) -> int:
    """How many ranks split each bucket: 1 at stage 0, mics_shard_size with MiCS, else the
    data-parallel world size. Not a collective."""
    if zero_config.stage == 0:
        return 1
    return zero_config.mics_shard_size if zero_config.mics_shard_size > 0 else world_size


def partition_groups(comm: Communicator, zero_config, timeout_s=None) -> PartitionGroups:
    """The PartitionGroups of an engine over the data-parallel Communicator `comm`, from
    zero_optimization.mics_shard_size and zero_hpz_partition_size ([Note: MiCS], [Note: hpZ]).

    Collective: every rank of `comm`'s group calls it (each creates the groups it belongs to).
    Raises ValueError, naming the key, the world size and the rank, when a size does not divide
    the data-parallel world size."""
    shard_size = zero_config.mics_shard_size
    hpz_size = zero_config.zero_hpz_partition_size
    world, rank = comm.world_size, comm.rank
    for key, size in (("mics_shard_size", shard_size), ("zero_hpz_partition_size", hpz_size)):
        if size > 1 and world % size:
            raise ValueError(
                f"rank {rank}: "
                f"zero_optimization.{key} = {size} does not divide the data-parallel world size "
                f"{world}; use a divisor of {world} (usually the ranks per node)"
            )
    if zero_config.stage == 0 or (shard_size < 1 and hpz_size <= 1):
        return PartitionGroups(comm)
    if shard_size >= 1:
        first = rank - rank % shard_size
        members = list(range(first, first + shard_size))
        hierarchical = zero_config.mics_hierarchical_params_gather
        _check_nodes(comm, members, "mics_shard_size", hierarchical)
        shard = comm.subgroup("mics-shard", members, timeout_s)
        two_level = _two_level_gather(comm, shard, timeout_s) if hierarchical else None
        members = list(range(rank % shard_size, world, shard_size))
        replica = comm.subgroup("mics-replica", members, timeout_s) if len(members) > 1 else None
        return PartitionGroups(shard, replica=replica, two_level=two_level)
    first = rank - rank % hpz_size
    members = list(range(first, first + hpz_size))
    _check_nodes(comm, members, "zero_hpz_partition_size", False)
    secondary = comm.subgroup("hpz", members, timeout_s)
    return PartitionGroups(comm, secondary=secondary)


def _two_level_gather(comm: Communicator, shard: Communicator, timeout_s=None):
    """MiCS's two-level parameter all-gather over `shard` ([Note: MiCS]), or None where the
    shard group lies within one node or holds one rank per node (the flat gather is then
    already one level). Collective over the shard group (each rank creates its intra- and
    inter-node groups). Raises NotImplementedError on every rank, naming the ranks' nodes, when
    the ranks of any shard group of `comm` are not numbered node by node with the same number
    on every node."""
    if comm.topology is None or shard.world_size == 1:
        return None
    ranks, size = comm.global_ranks(), shard.world_size
    for first in range(0, comm.world_size, size):  # every group: all ranks refuse, or none
        _node_blocks(comm, ranks[first : first + size])
    local = _node_blocks(comm, shard.global_ranks())
    nodes = size // local
    if nodes == 1 or local == 1:
        return None
    # Groups of their own (not shard.node_groups(), whose process groups qgZ's gradient
    # reduction uses over the same ranks, in an order that may differ from the gathers').
    node, index = divmod(shard.rank, local)
    return TwoLevelGather(
        shard.subgroup("mics-gather-intra", [node * local + i for i in range(local)], timeout_s),
        shard.subgroup("mics-gather-inter", [j * local + index for j in range(nodes)], timeout_s),
    )


def _node_blocks(comm: Communicator, ranks: list[int]) -> int:
    """The ranks per node of the global ranks `ranks` when they lie node by node with the same
    number on each node (Topology.ranks_per_node); raises NotImplementedError (the rank, the
    nodes, the fix) else."""
    local = comm.topology.ranks_per_node(ranks)
    if local is None:
        nodes = [comm.topology.nodes.get(r, 0) for r in ranks]
        raise NotImplementedError(
            f"rank {comm.rank}: zero_optimization.mics_hierarchical_params_gather = true with a "
            f"MiCS shard group whose ranks {ranks} lie on nodes {nodes} (from "
            f"{comm.topology.source}): the two-level all-gather needs the same number of the "
            "group's ranks on every node, numbered node by node. Launch ranks node by node "
            "(as zrun and torchrun do), use a shard size that is a multiple of the ranks per "
            "node, or set the key to false."
        )
    return local


def _check_nodes(comm: Communicator, members: list[int], key: str, hierarchical: bool) -> None:
    """A shard group (MiCS) or secondary group (hpZ) that spans nodes still trains correctly,
    but its collectives cross nodes; say so once (rank 0 of the group), naming the parameter
    all-gathers as two-level when `hierarchical` (mics_hierarchical_params_gather)."""
    topology = comm.topology
    if topology is None:
        return
    ranks = comm.global_ranks()
    if topology.spans_nodes([ranks[m] for m in members]) and comm.rank == members[0]:
        logger.warning(
            "zero_optimization.%s = %d: the group of ranks %s spans nodes (from %s), so its "
            "collectives cross nodes%s; a size dividing the ranks per node keeps them inside one",
            key,
            len(members),
            [ranks[m] for m in members],
            topology.source,
            " (its parameter all-gathers in two levels)" if hierarchical else "",
        )
