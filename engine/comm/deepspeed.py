"""DeepSpeed's deepspeed.comm for training scripts (`from zero import comm as dist`).

Thin wrappers over torch.distributed under DeepSpeed's names. They are the script's own
traffic: none of them is counted in an engine's ledger (engine.comm_stats() counts zero's
collectives only). destroy_process_group ends a run cleanly ([Note: a clean exit]);
init_distributed is DeepSpeed's deepspeed.init_distributed.
"""

import datetime
import gc
import logging
import os

import torch
import torch.distributed as dist

from .agreement import Intent, RankMismatchError, _current_agreements
from .communicator import _all_gather_single, _reduce_scatter_single
from .groups import close_side_groups
from .launch import before_default_group, init_process_group, read_launch_env
from .watcher import stop_watcher

logger = logging.getLogger("zero")


ReduceOp = dist.ReduceOp


def is_available() -> bool:
    """True when this torch build has torch.distributed."""
    return dist.is_available()


def is_initialized() -> bool:
    """True once a default process group exists (zero.init_distributed, zero.initialize under a
    launcher, or torch.distributed.init_process_group)."""
    return dist.is_available() and dist.is_initialized()


def _require(name: str) -> None:
    if not is_initialized():
        raise RuntimeError(
            f"zero.comm.{name}: torch.distributed is not initialized; call "
            "zero.init_distributed() first (it also works without a launcher: one rank)"
        )


def get_rank(group=None) -> int:
    """This process's rank in `group` (default: every rank). Raises RuntimeError before
    initialization."""
    _require("get_rank")
    return dist.get_rank(group)


def get_world_size(group=None) -> int:
    """Number of ranks in `group` (default: every rank). Raises RuntimeError before
    initialization."""
    _require("get_world_size")
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """This process's rank on its node, from the launcher's environment (LOCAL_RANK, or mpirun's
    and srun's equivalents); 0 without a launcher. Needs no process group."""
    launch = read_launch_env()
    return launch.local_rank if launch is not None else 0


def get_global_rank(group, group_rank: int) -> int:
    """The global rank of `group`'s rank `group_rank`."""
    _require("get_global_rank")
    return dist.get_global_rank(group, group_rank)


def barrier(group=None, async_op: bool = False, device_ids=None):
    """Wait until every rank of `group` arrives. Collective."""
    _require("barrier")
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    """Reduce `tensor` over `group` in place (sum by default). Collective."""
    _require("all_reduce")
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    """Copy `tensor` from global rank `src` to every rank of `group`, in place. Collective."""
    _require("broadcast")
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def all_gather(tensor_list: list, tensor: torch.Tensor, group=None, async_op: bool = False):
    """tensor_list[r] receives rank r's `tensor` (world size entries, each shaped like
    `tensor`). Collective."""
    _require("all_gather")
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op: bool = False):
    """Concatenate every rank's `input_tensor` (n elements) into `output_tensor` (world size *
    n elements), in rank order. Collective."""
    _require("all_gather_into_tensor")
    return _all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter(output, input_list: list, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce input_list[r] over the ranks into rank r's `output` (world size entries, each
    shaped like `output`). Collective."""
    _require("reduce_scatter")
    return dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor, input_tensor, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce `input_tensor` (world size * n elements) over the ranks; rank r receives slice r
    (n elements) in `output_tensor`. Collective."""
    _require("reduce_scatter_tensor")
    return _reduce_scatter_single(
        output_tensor, input_tensor, op=op, group=group, async_op=async_op
    )


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce `tensor` over `group` into global rank `dst`'s `tensor`. Collective."""
    _require("reduce")
    return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def gather(tensor: torch.Tensor, gather_list=None, dst: int = 0, group=None, async_op=False):
    """Global rank `dst` receives every rank's `tensor` in `gather_list`. Collective."""
    _require("gather")
    return dist.gather(tensor, gather_list, dst=dst, group=group, async_op=async_op)


def scatter(tensor: torch.Tensor, scatter_list=None, src: int = 0, group=None, async_op=False):
    """Rank r receives scatter_list[r] of global rank `src` in `tensor`. Collective."""
    _require("scatter")
    return dist.scatter(tensor, scatter_list, src=src, group=group, async_op=async_op)


def all_to_all_single(
    output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False
):
    """Split `input` by rank, exchange, concatenate into `output` (torch's all_to_all_single).
    Collective."""
    _require("all_to_all_single")
    return dist.all_to_all_single(
        output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op
    )


def all_gather_object(object_list: list, obj, group=None) -> None:
    """object_list[r] receives rank r's picklable `obj` (torch pickles it: only for trusted
    peers). Collective."""
    _require("all_gather_object")
    dist.all_gather_object(object_list, obj, group=group)


def broadcast_object_list(object_list: list, src: int = 0, group=None) -> None:
    """Every rank's `object_list` becomes global rank `src`'s (pickled by torch). Collective."""
    _require("broadcast_object_list")
    dist.broadcast_object_list(object_list, src=src, group=group)


def send(tensor: torch.Tensor, dst: int, group=None, tag: int = 0) -> None:
    """Send `tensor` to global rank `dst` (point to point)."""
    _require("send")
    dist.send(tensor, dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0) -> int:
    """Receive into `tensor` from global rank `src` (any rank when None); returns the sender."""
    _require("recv")
    return dist.recv(tensor, src, group=group, tag=tag)


def monitored_barrier(group=None, timeout=None, wait_all_ranks: bool = False) -> None:
    """A barrier that names the ranks that did not arrive within `timeout` (gloo). Collective."""
    _require("monitored_barrier")
    dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def get_backend(group=None) -> str:
    """The backend of `group` ("gloo", "nccl")."""
    _require("get_backend")
    return str(dist.get_backend(group))


def destroy_process_group(group=None) -> None:
    """Tear down `group` (default: the default group and every other). Collective: every rank
    calls it when done. [Note: a clean exit] For the default group each live engine's agreement
    group checks first that every rank is ending (else RankMismatchError on every rank, naming
    what each was about to do), then a barrier, so no rank exits while peers still talk to it;
    then zero's own groups are destroyed and its reduce-scatter watcher stops, and torch's
    teardown destroys the default group (made by zero: see launch.before_default_group), each
    joining its threads before this returns. No thread of zero's is left to free a tensor while
    the interpreter shuts down, which aborted finished runs ("terminate called without an
    active exception", [Note: threads at exit] in groups.py)."""
    default = group is None and is_initialized()
    if default:
        # A rank still in an engine's collectives (one micro-batch more than this rank ran)
        # would wait in them while this rank waits in the barrier: the engines' agreement
        # groups check first, so every rank raises instead (the others once this rank's
        # sockets close), naming what each rank was about to do. An engine the script dropped
        # may still wait for the cycle collector, at different times on different ranks:
        # collect first, so every rank checks on the same engines.
        gc.collect()
        for agreement in _current_agreements():
            try:
                agreement.check(Intent.FINISH)
            except RankMismatchError:
                dist.destroy_process_group()
                raise
        try:
            dist.barrier()
        except RuntimeError as error:  # a peer's sockets closed: it ended without this call
            rank = dist.get_rank()
            dist.destroy_process_group(group)
            raise RuntimeError(
                f"rank {rank}: another rank stopped before it reached "
                "zero.comm.destroy_process_group(); this rank had finished its work. That rank's "
                "own error says why: often a collective that only some ranks called (a forward, "
                "generate() or step() run on some ranks only, a different number of steps). "
                f"The backend said: {error}"
            ) from error
        stop_watcher()
        close_side_groups()
    if group is None and not is_initialized():
        return  # one process without a process group (zero.initialize made none): nothing to end
    dist.destroy_process_group(group)


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: datetime.timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config=None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Create the default process group; DeepSpeed's deepspeed.init_distributed.

    Where ranks come from, first match: explicit `rank` and `world_size` (with `init_method`, or
    MASTER_ADDR/MASTER_PORT); the launcher's environment (zrun, torchrun: RANK, WORLD_SIZE,
    LOCAL_RANK; ``mpirun`` and ``srun``'s variables when `auto_mpi_discovery`, with MASTER_PORT
    defaulting to `distributed_port`); otherwise a one-rank group in this process, so a script
    run with plain ``python`` works. Backend: `dist_backend`, else nccl with CUDA and gloo
    without. `timeout`: torch.distributed's collective timeout. `config` is accepted for
    DeepSpeed's signature and not read.

    Does nothing when a default group exists. Raises RuntimeError when `dist_init_required` is
    False but none exists, ValueError for malformed launcher variables. Every rank must call it.
    """
    del config  # DeepSpeed reads its comms-logger settings from it; zero's engine does that
    if is_initialized():
        return
    if dist_init_required is False:
        raise RuntimeError(
            "init_distributed(dist_init_required=False) but torch.distributed is not initialized; "
            "drop the argument to let zero initialize it"
        )
    launch = None
    if auto_mpi_discovery or "RANK" in os.environ:
        launch = read_launch_env(default_port=distributed_port)
    if dist_backend is None:
        from ..accelerator import detect_accelerator

        dist_backend = detect_accelerator(launch.local_rank if launch else 0).backend
    options = {} if timeout is None else {"timeout": timeout}
    before_default_group()
    if rank >= 0 and world_size > 0:
        dist.init_process_group(
            dist_backend, init_method=init_method, rank=rank, world_size=world_size, **options
        )
    elif launch is not None:
        init_process_group(dist_backend, launch, **options)
    else:
        dist.init_process_group(
            dist_backend, store=dist.HashStore(), rank=0, world_size=1, **options
        )
    if verbose:
        logger.info(
            "initialized torch.distributed: backend %s, rank %d of %d",
            dist_backend,
            dist.get_rank(),
            dist.get_world_size(),
        )
