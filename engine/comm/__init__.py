"""zero.comm: every collective zero issues, and DeepSpeed's deepspeed.comm for scripts.

Owns, one module each, lowest first (a module imports only modules listed above it):
    ledger.py        OpTotals, CommLedger: calls, elements and bytes per collective, per step
    watcher.py       the thread that waits for gloo's asynchronous reduce-scatters
    groups.py        process groups zero makes (OwnGroup, side groups, new_group)
    topology.py      which ranks share a node; the intra-/inter-node split of the ledger
    launch.py        the launch environment (RANK, WORLD_SIZE, ...) and the default group
    agreement.py     cross-rank agreement checks (Intent, Agreement, RankMismatchError)
    communicator.py  Communicator, the only caller of torch.distributed collectives for the
                     engine, and Handle, the pair of an asynchronous collective
    two_level.py     the two-level (inter-node, then intra-node) all-gather of MiCS
    deepspeed.py     DeepSpeed's names for scripts: `from zero import comm as dist` (get_rank,
                     all_reduce, ..., destroy_process_group, init_distributed), not counted
May import: zero.config and everything below it, and of the launcher zero.launcher.nodelist.
"""

from .agreement import (
    Agreement,
    Intent,
    PendingCheck,
    RankMismatchError,
    describe_intent,
)
from .communicator import (
    Communicator,
    Handle,
    data_parallel_comm,
    wait_blocks_host,
)
from .deepspeed import (
    ReduceOp,
    all_gather,
    all_gather_into_tensor,
    all_gather_object,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    broadcast_object_list,
    destroy_process_group,
    gather,
    get_backend,
    get_global_rank,
    get_local_rank,
    get_rank,
    get_world_size,
    init_distributed,
    is_available,
    is_initialized,
    monitored_barrier,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    scatter,
    send,
)
from .groups import (
    new_group,
)
from .launch import (
    LaunchEnv,
    init_process_group,
    ranks_on_this_node,
    read_launch_env,
)
from .ledger import (
    CommLedger,
    OpTotals,
)
from .topology import (
    Topology,
    inter_node_elements,
    read_topology,
)

__all__ = [
    "Agreement",
    "CommLedger",
    "Communicator",
    "Handle",
    "Intent",
    "LaunchEnv",
    "OpTotals",
    "PendingCheck",
    "RankMismatchError",
    "ReduceOp",
    "Topology",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "data_parallel_comm",
    "describe_intent",
    "destroy_process_group",
    "gather",
    "get_backend",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "init_process_group",
    "inter_node_elements",
    "is_available",
    "is_initialized",
    "monitored_barrier",
    "new_group",
    "ranks_on_this_node",
    "read_launch_env",
    "read_topology",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "send",
    "wait_blocks_host",
]
