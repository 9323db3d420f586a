"""World layout: the nodes of a job in node-rank order, their slots, and the rendezvous address.

Global ranks are assigned node by node: node k's local rank i is global rank
``sum(num_slots of nodes 0..k-1) + i``, the order torch.distributed's elastic agent uses.
"""

import socket
from dataclasses import dataclass
from functools import cache

import psutil

from .hostfile import ResourcePool


@dataclass(frozen=True)
class NodeSpec:
    """One node of the job: its node rank (GROUP_RANK), host name and slot ids."""

    node_rank: int
    host: str
    slot_ids: tuple[int, ...]

    @property
    def num_slots(self) -> int:
        return len(self.slot_ids)


@dataclass(frozen=True)
class WorldLayout:
    """Every node of the job plus the address rank 0's node serves the rendezvous store on."""

    nodes: tuple[NodeSpec, ...]
    master_addr: str
    master_port: int

    @property
    def world_size(self) -> int:
        return sum(node.num_slots for node in self.nodes)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    def first_rank(self, node: NodeSpec) -> int:
        """Global rank of ``node``'s local rank 0."""
        return sum(n.num_slots for n in self.nodes[: node.node_rank])


def build_layout(pool: ResourcePool, master_addr: str | None, master_port: int) -> WorldLayout:
    """Turn a resource pool into a world layout.

    ``master_addr`` defaults to 127.0.0.1 when every host is this machine, else to the first
    host resolved to an address the other nodes can reach (see master_address). ``master_port``
    0 picks a free port on this machine.

    Raises:
        ValueError: master_port outside 0..65535.
        NotImplementedError: master_port 0 while the master is another machine (a free port can
            only be probed locally).
    """
    if not 0 <= master_port <= 65535:
        raise ValueError(f"--master_port must be in 0..65535, got {master_port}")
    nodes = tuple(
        NodeSpec(node_rank=i, host=host, slot_ids=tuple(slot_ids))
        for i, (host, slot_ids) in enumerate(pool.items())
    )
    if master_addr is None:
        master_addr = master_address([node.host for node in nodes])
    if master_port == 0:
        if not is_local_host(master_addr):
            raise NotImplementedError(
                f"--master_port 0 needs the master on this machine; '{master_addr}' is not"
            )
        master_port = find_free_port()
    return WorldLayout(nodes=nodes, master_addr=master_addr, master_port=master_port)


def master_address(hosts: list[str]) -> str:
    """The rendezvous address for a job on ``hosts`` (node 0 first).

    Every host this machine: 127.0.0.1. Node 0 this machine, others remote: the address this
    machine uses to reach the first remote host (so not a loopback name such as 'localhost').
    Node 0 remote: its IP address as resolved here, or the name itself if it does not resolve
    here (an ssh alias, say; the nodes may still resolve it).
    """
    remote = [host for host in hosts if not is_local_host(host)]
    if not remote:
        return "127.0.0.1"
    if is_local_host(hosts[0]):
        return _source_address_towards(remote[0])
    try:
        return socket.gethostbyname(hosts[0])
    except OSError:
        return hosts[0]


def rendezvous_address(hosts: list[str]) -> str:
    """The address the nodes reach this machine at: 127.0.0.1 when every host is this machine,
    else the address this machine uses to reach the first remote host."""
    remote = [host for host in hosts if not is_local_host(host)]
    return _source_address_towards(remote[0]) if remote else "127.0.0.1"


def _source_address_towards(host: str) -> str:
    # Connecting a UDP socket sends nothing; it only asks the kernel which local address routes
    # to the host, which is the address that host can use to reach us.
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((socket.gethostbyname(host), 9))
            return sock.getsockname()[0]
    except OSError:
        pass
    # The host does not resolve here (an ssh alias, say): any non-loopback IPv4 address.
    for addrs in psutil.net_if_addrs().values():
        for addr in addrs:
            if addr.family == socket.AF_INET and not addr.address.startswith("127."):
                return addr.address
    return socket.gethostname()


def format_nodes(nodes: tuple[NodeSpec, ...]) -> str:
    """Encode nodes for the agent's --nodes flag: ``host:0,1@host2:0,1`` in node-rank order."""
    return "@".join(f"{node.host}:{','.join(str(s) for s in node.slot_ids)}" for node in nodes)


def parse_nodes(spec: str) -> tuple[NodeSpec, ...]:
    """Inverse of format_nodes (a host is split off its slots at the last ':', so IPv6 works).

    Raises:
        ValueError: an entry without slots or with a non-integer slot id.
    """
    nodes = []
    for node_rank, entry in enumerate(spec.split("@")):
        host, _, slots = entry.rpartition(":")
        try:
            slot_ids = tuple(int(s) for s in slots.split(","))
        except ValueError:
            raise ValueError(f"--nodes {spec!r}: bad entry {entry!r}, expected host:0,1") from None
        if not host:
            raise ValueError(f"--nodes {spec!r}: bad entry {entry!r}, expected host:0,1")
        nodes.append(NodeSpec(node_rank=node_rank, host=host, slot_ids=slot_ids))
    return tuple(nodes)


def find_free_port() -> int:
    """A TCP port that is free now (the kernel's pick); another process may still take it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


@cache
def _local_names() -> frozenset[str]:
    names = {"localhost", "::1", socket.gethostname(), socket.getfqdn()}
    names.add(socket.gethostname().split(".")[0])
    for addrs in psutil.net_if_addrs().values():
        names.update(a.address.split("%")[0] for a in addrs if a.family in _INET_FAMILIES)
    return frozenset(n.lower() for n in names)


_INET_FAMILIES = (socket.AF_INET, socket.AF_INET6)


def is_local_host(host: str) -> bool:
    """Whether ``host`` names this machine: localhost, 127.x, ::1, its hostname/FQDN or an IP of
    one of its interfaces (a name that resolves to such an IP counts too)."""
    host = host.lower()
    if host.startswith("127.") or host in _local_names():
        return True
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return False
    return address.startswith("127.") or address in _local_names()
