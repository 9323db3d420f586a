"""The launch environment: the rank layout a launcher set (RANK, WORLD_SIZE, LOCAL_RANK, or
mpirun's and srun's equivalents) and the default process group made from it (env://
rendezvous). Imports nothing of zero.comm.
"""

import os
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class LaunchEnv:
    """Rank layout read from the launcher's environment (torchrun's variable names)."""

    rank: int
    local_rank: int
    world_size: int


def read_launch_env(default_port: int = 29500) -> LaunchEnv | None:
    """Read the rank layout a launcher set; None when not started by a launcher.

    The first set of variables present wins: RANK, WORLD_SIZE, LOCAL_RANK (zrun, torchrun);
    OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK (``mpirun python train.py``); SLURM_PROCID,
    SLURM_NTASKS, SLURM_LOCALID (``srun python train.py``). For the last two, unset rendezvous
    variables are filled in os.environ for the env:// rendezvous: MASTER_ADDR with the first host
    of SLURM_JOB_NODELIST (SLURM only; ``scontrol show hostnames`` when available), MASTER_PORT
    with `default_port`.

    Raises ValueError naming the variable when one is set but malformed or inconsistent.
    """
    sources = (
        ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
        ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    )
    names = next((n for n in sources if n[0] in os.environ or n[1] in os.environ), None)
    if names is None:
        return None
    rank_name, size_name, local_name = names
    values = {}
    for name in names:
        raw = os.environ.get(name, "0" if name == local_name else None)
        if raw is None:
            raise ValueError(
                f"environment variable {name} is not set but {rank_name}/{size_name} are"
            )
        try:
            values[name] = int(raw)
        except ValueError:
            raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None
    if not 0 <= values[rank_name] < values[size_name]:
        raise ValueError(
            f"{rank_name}={values[rank_name]} is outside 0..{size_name}-1={values[size_name] - 1}"
        )
    if rank_name != "RANK":
        if "MASTER_ADDR" not in os.environ and "SLURM_JOB_NODELIST" in os.environ:
            from zero.launcher.nodelist import first_host  # only SLURM jobs need the parser

            os.environ["MASTER_ADDR"] = first_host(os.environ["SLURM_JOB_NODELIST"])
        os.environ.setdefault("MASTER_PORT", str(default_port))
    return LaunchEnv(values[rank_name], values[local_name], values[size_name])


def ranks_on_this_node() -> int:
    """How many ranks run on this node: $LOCAL_WORLD_SIZE (set by zrun and torchrun), 1 when
    it is unset or empty. For what the ranks of a node share (host memory, a local disk). Raises
    ValueError naming the variable when it is not a positive integer."""
    raw = os.environ.get("LOCAL_WORLD_SIZE", "")
    if raw == "":
        return 1
    try:
        ranks = int(raw)
    except ValueError:
        ranks = 0
    if ranks < 1:
        raise ValueError(f"environment variable LOCAL_WORLD_SIZE={raw!r} is not a positive integer")
    return ranks


def init_process_group(backend: str, env: LaunchEnv, **options) -> None:
    """Initialize the default process group from MASTER_ADDR/MASTER_PORT (env:// rendezvous);
    `options` go to torch.distributed.init_process_group (timeout).

    Every rank must call it. Does nothing when a default group already exists.
    """
    if dist.is_initialized():
        return
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise ValueError(
                f"environment variable {name} is not set; start the job with zrun or torchrun, "
                "or set MASTER_ADDR and MASTER_PORT"
            )
    before_default_group()
    dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, **options)


def before_default_group() -> None:
    """Call before making the default process group. torch.distributed.nn's functions take
    `group=group.WORLD` as a default argument, evaluated when the module is imported (the
    first optimizer imports it, through torch._dynamo): imported while a default group exists,
    they would keep that group, and its gloo threads, alive after destroy_process_group
    ([Note: threads at exit] in groups.py). Imported first, they hold None."""
    import torch.distributed.nn  # noqa: F401
