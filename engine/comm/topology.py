"""Node topology: which global ranks share a node, and the per-rank split of a collective's
volume into intra-node and inter-node traffic. Imports nothing of zero.comm.

[Note: where a rank's node comes from]
In order of precedence:
1. ZERO_RANKS_PER_NODE=g (zero's own variable, for tests that simulate nodes on one machine and
   for clusters whose launcher sets nothing below): global rank r lives on node r // g.
2. GROUP_RANK (torchrun, zrun) or NODE_RANK (zrun, Lightning, many SLURM scripts): the node
   index each rank reports. The ranks of a group exchange it once through the rendezvous store
   (no collective on the accelerator, no process group), so nodes of different sizes are right.
3. Nothing set: the group is taken to be on one node (a single-machine run), and every byte
   counts as intra-node.
The launcher's LOCAL_WORLD_SIZE alone does not say which ranks share a node when nodes differ in
size, so it is only used through GROUP_RANK / NODE_RANK (which zrun and torchrun set beside it).

[Note: intra- and inter-node volume]
The ledger counts a collective in the paper's units (ZeRO section 7): an all-gather into or a
reduce-scatter of a buffer of V elements counts V per rank, an all-reduce of V elements 2V. Of
those V elements, 1/n is the slice that belongs to each of the group's n ranks. A rank's volume
is split by where the rank its slice comes from (all-gather) or goes to (reduce-scatter) lives:

    inter = V * (n - n_local) / n,   intra = V - inter,

where n_local counts the group's ranks on this rank's node, itself included (its own slice is
counted as intra-node: it never leaves the node). This is the data a rank must exchange with
other nodes whatever the algorithm (it is exactly what a direct exchange, zero's gloo path,
moves); a ring or a tree routes it differently but cannot avoid bringing it across the node
boundary. An all-reduce is a reduce-scatter plus an all-gather, so the same fraction applies to
its 2V, and so does a broadcast (V per rank). Examples, 2 nodes of 2 ranks: an all-gather over
all 4 ranks of a Psi-element buffer counts Psi/2 inter-node and Psi/2 intra-node; over the 2
ranks of one node, Psi intra-node; over 2 ranks on different nodes (a MiCS replica group), Psi/2
inter-node. Integer division rounds the inter-node part down (buffers zero lays out are padded
to a multiple of n, so its collectives split exactly).
"""

import os
import socket
from dataclasses import dataclass

import torch.distributed as dist

ENV_RANKS_PER_NODE = "ZERO_RANKS_PER_NODE"


@dataclass(frozen=True)
class Topology:
    """The node of each global rank of a group: `nodes[global_rank]` -> node index (0, 1, ...
    in order of first appearance), and the variable it was read from (`source`)."""

    nodes: dict
    source: str

    def node_of(self, global_rank: int) -> int:
        return self.nodes[global_rank]

    def local_count(self, ranks, global_rank: int) -> int:
        """How many of `ranks` (global ranks) live on `global_rank`'s node, itself included."""
        node = self.nodes.get(global_rank, 0)
        return sum(1 for r in ranks if self.nodes.get(r, 0) == node)

    def spans_nodes(self, ranks) -> bool:
        return len({self.nodes.get(r, 0) for r in ranks}) > 1

    def ranks_per_node(self, ranks) -> int | None:
        """How many of the global ranks `ranks` each node holds, when they lie node by node with
        the same number on every node, as hierarchical collectives need (qgZ, MiCS's two-level
        gather); None otherwise. Not a collective."""
        nodes = [self.nodes.get(r, 0) for r in ranks]
        order = list(dict.fromkeys(nodes))  # the nodes, in the order of their first rank
        local = len(ranks) // len(order)
        if nodes != [node for node in order for _ in range(local)]:
            return None
        return local

    @property
    def num_nodes(self) -> int:
        return len(set(self.nodes.values()))


def single_node(ranks) -> Topology:
    """Every rank of `ranks` on one node (nothing crosses nodes)."""
    return Topology({r: 0 for r in ranks}, "one node")


def inter_node_elements(elements: int, group_size: int, local_count: int) -> int:
    """The inter-node part of a collective's per-rank volume `elements` (paper units) over a
    group of `group_size` ranks, `local_count` of them on this rank's node: elements * (n -
    n_local) // n ([Note: intra- and inter-node volume]). Not a collective."""
    if group_size <= 1:
        return 0
    return elements * (group_size - local_count) // group_size


def _ranks_per_node_from_env() -> int | None:
    raw = os.environ.get(ENV_RANKS_PER_NODE)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(
            f"environment variable {ENV_RANKS_PER_NODE}={raw!r} must be a whole number of ranks "
            "per node (>= 1); unset it to take the nodes from GROUP_RANK / NODE_RANK"
        )
    return value


def _node_key() -> tuple[str | None, str]:
    for name in ("GROUP_RANK", "NODE_RANK"):
        if os.environ.get(name, "") != "":
            return os.environ[name], name
    return None, ""


def read_topology(ranks: list[int], global_rank: int, store=None) -> Topology:
    """The nodes of the global ranks `ranks` (this rank, `global_rank`, among them), read from
    the launch environment ([Note: where a rank's node comes from]). With GROUP_RANK or
    NODE_RANK set, every rank of `ranks` must call it (they exchange their node through the
    rendezvous `store`, torch.distributed's default store when None; blocks until all have
    written, up to the store's timeout). Raises ValueError for a malformed ZERO_RANKS_PER_NODE."""
    ranks = list(ranks)
    per_node = _ranks_per_node_from_env()
    if per_node is not None:
        return Topology({r: r // per_node for r in ranks}, f"{ENV_RANKS_PER_NODE}={per_node}")
    key, name = _node_key()
    if key is None or len(ranks) == 1:
        return single_node(ranks)
    if store is None:
        store = dist.distributed_c10d._get_default_store()
    # The host name tells apart a node index reused by two separately started launchers.
    return Topology(
        exchange_nodes(ranks, global_rank, f"{key}@{socket.gethostname()}", store), name
    )


def exchange_nodes(ranks: list[int], global_rank: int, node_key: str, store) -> dict:
    """{global rank: node index} for `ranks`, from the `node_key` each rank of them writes into
    `store` (a torch.distributed Store); equal keys are one node, numbered in rank order. Every
    rank of `ranks` must call it; blocks until all have written (the store's timeout)."""
    group_name = f"{'-'.join(map(str, ranks[:4]))}/{len(ranks)}"
    prefix = dist.PrefixStore(f"zero-topology/{group_name}/", store)
    prefix.set(str(global_rank), node_key)
    keys = [str(r) for r in ranks]
    try:
        values = prefix.multi_get(keys)  # one round trip (torch >= 2.5, most stores)
    except (AttributeError, NotImplementedError):
        values = [prefix.get(key) for key in keys]
    index: dict[bytes, int] = {}
    return {r: index.setdefault(bytes(v), len(index)) for r, v in zip(ranks, values)}
