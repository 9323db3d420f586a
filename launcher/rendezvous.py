"""The elastic rendezvous's settings as zrun and the agents read them, and the store zrun hosts.

No torch import at module level: zrun imports torch only for an elastic job. See [Note: elastic
rendezvous] in agent.py.
"""


def node_range(spec: str | None, num_nodes: int) -> tuple[int, int]:
    """(MIN, MAX) from --nnodes 'MIN:MAX' or 'N'; num_nodes for both without it.

    Raises:
        ValueError: not 'MIN:MAX' or 'N' with 1 <= MIN <= MAX.
    """
    if spec is None:
        return num_nodes, num_nodes
    low, _, high = spec.partition(":")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise ValueError(f"--nnodes must be MIN:MAX or N, e.g. 1:4, got {spec!r}") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"--nnodes {spec!r}: need 1 <= MIN <= MAX")
    return lo, hi


def rendezvous_options(spec: str) -> dict[str, str]:
    """--rdzv_conf 'join_timeout=600,last_call_timeout=30' as a dict (torchrun's format).

    Raises:
        ValueError: an entry without '='.
    """
    options = {}
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        key, sep, value = entry.partition("=")
        if not sep or not key:
            raise ValueError(f"--rdzv_conf entry {entry!r} is not key=value")
        options[key.strip()] = value.strip()
    return options


def succeeded_key(run_id: str) -> str:
    """The key an agent sets in zrun's store when its ranks succeeded."""
    return f"zrun/{run_id}/succeeded"


class ElasticJob:
    """The rendezvous store zrun hosts for an elastic job: a TCPStore server on this machine at
    ``port`` (every interface), alive as long as this object; ``succeeded()`` tells whether an
    agent reported that its ranks succeeded.

    Raises:
        RuntimeError: the port is taken (torch's message).
    """

    def __init__(self, port: int, run_id: str, node_range_text: str, max_restarts: int):
        from torch.distributed import TCPStore

        self.store = TCPStore(
            "0.0.0.0", port, is_master=True, multi_tenant=True, wait_for_workers=False
        )
        self.key = succeeded_key(run_id)
        self.node_range = node_range_text
        self.max_restarts = max_restarts

    def succeeded(self) -> bool:
        return self.store.check([self.key])
