"""zrun's command line: flags compatible with DeepSpeed's launcher and torchrun's common ones."""

import argparse
import os

from .hostfile import (
    DEFAULT_HOSTFILE,
    MAX_SLOTS_PER_HOST,
    ResourcePool,
    parse_hostfile,
    select_resources,
)
from .nodelist import expand_nodelist
from .remote import LAUNCHERS

DEFAULT_MASTER_PORT = 29500


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zrun",
        description="Start a zero training job: one process per slot on every selected host.",
        epilog="Everything after the script is passed to it unchanged. See docs/launcher.md.",
        allow_abbrev=False,
    )
    add = parser.add_argument
    add(
        "-H",
        "--hostfile",
        default=None,
        help=f"lines 'hostname slots=N'; default {DEFAULT_HOSTFILE} if it exists",
    )
    add("-i", "--include", default=None, help="hosts/slots to use, e.g. 'host1:0,1@host2'")
    add("-e", "--exclude", default=None, help="hosts/slots to leave out, same format")
    add("--num_nodes", type=int, default=None, help="use the first N hosts of the hostfile")
    add(
        "--num_gpus",
        "--nproc_per_node",
        dest="num_gpus",
        type=int,
        default=None,
        help="processes per node (default: hostfile slots, else one per GPU, else 1)",
    )
    add("--master_addr", default=None, help="rendezvous host (default: node 0)")
    add(
        "--master_port",
        type=int,
        default=DEFAULT_MASTER_PORT,
        help=f"rendezvous TCP port (default {DEFAULT_MASTER_PORT}; 0 picks a free port)",
    )
    add(
        "--launcher",
        choices=LAUNCHERS,
        default="ssh",
        help="how to start the agents of a multi-node job (default ssh)",
    )
    add(
        "--launcher_args",
        default="",
        help="extra words for ssh/pdsh/srun/mpirun, one string split like a shell would",
    )
    add("--ssh_port", type=int, default=None, help="ssh port on every ssh call (default: ssh's)")
    add(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a variable on every rank (repeatable; wins over .zero_env)",
    )
    add("--force_multi", action="store_true", help="use --launcher even if all hosts are local")
    add(
        "--no_ssh_check",
        action="store_true",
        help="ssh/pdsh: do not check that every host answers over ssh before starting",
    )
    add("--no_ssh", action="store_true", help="start only this node's agent (with --node_rank)")
    add("--node_rank", type=int, default=None, help="with --no_ssh: this node's rank")
    add("--log_dir", default=None, help="write each rank's stdout+stderr to LOG_DIR/rankR.log")
    add("-m", "--module", action="store_true", help="run the script as 'python -m MODULE'")
    add("--no_python", action="store_true", help="run the script as an executable")
    add("--no_local_rank", action="store_true", help="do not pass --local_rank=N to the script")
    add(
        "--shutdown_timeout",
        type=int,
        default=5,
        help="seconds between SIGTERM and SIGKILL when ending ranks (default 5)",
    )
    add("--verbose", action="store_true", help="show the elastic agent's own log")
    add(
        "--nnodes",
        default=None,
        metavar="MIN:MAX",
        help="elastic: go on with MIN..MAX nodes (c10d rendezvous hosted by zrun); "
        "N alone is --num_nodes N",
    )
    add(
        "--max_restarts",
        type=int,
        default=0,
        help="restart the ranks (from the last checkpoint) up to N times after a failure; "
        "elastic (default 0: the first failure ends the job)",
    )
    add(
        "--rdzv_conf",
        default="",
        metavar="K=V,...",
        help="elastic rendezvous options (torchrun's): join_timeout, last_call_timeout, "
        "keep_alive_interval, keep_alive_max_attempt, close_timeout, read_timeout",
    )
    add("--rdzv_id", default=None, help="elastic: rendezvous id (default: a fresh one per zrun)")
    add(
        "--autotuning",
        choices=("tune", "run"),
        default=None,
        help="tune: find the fastest stage, offload, micro-batch and bucket size (short trials "
        "of the script, planner-pruned; docs/tuning.md); run: tune, then start the job with it",
    )
    add("script", help="training script (or module with -m, or executable with --no_python)")
    add("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def resource_pool(args: argparse.Namespace) -> ResourcePool:
    """The hosts and slots the job uses, from the hostfile or this machine.

    Without a hostfile (neither --hostfile nor an existing /job/hostfile) the pool is this
    machine with --num_gpus slots, or one slot per visible CUDA device, or 1 slot without CUDA.

    Raises:
        FileNotFoundError: --hostfile names a file that does not exist.
        ValueError: --hostfile names a directory, a malformed hostfile, --num_gpus above
            MAX_SLOTS_PER_HOST, or an invalid selection (see select_resources).
    """
    if args.num_gpus is not None and args.num_gpus > MAX_SLOTS_PER_HOST:
        # Checked before any slot list is built: list(range(huge)) overflows or exhausts memory.
        raise ValueError(f"--num_gpus must be <= {MAX_SLOTS_PER_HOST}, got {args.num_gpus}")
    hostfile = args.hostfile
    if hostfile is None and os.path.isfile(DEFAULT_HOSTFILE):
        hostfile = DEFAULT_HOSTFILE
    if hostfile is not None:
        pool = {host: list(range(n)) for host, n in parse_hostfile(hostfile).items()}
        source = f"the hostfile '{hostfile}'"
        return select_resources(
            pool, args.include, args.exclude, args.num_nodes, args.num_gpus, source
        )
    if args.launcher == "slurm" and "SLURM_JOB_NODELIST" in os.environ:
        return _slurm_pool(args)
    if args.no_ssh and args.num_nodes is not None:
        return _numbered_pool(args)
    if args.num_nodes not in (None, 1):
        raise ValueError(f"--num_nodes {args.num_nodes} needs a --hostfile listing the nodes")
    if args.num_gpus is not None and args.num_gpus <= 0:
        raise ValueError(f"--num_gpus must be > 0, got {args.num_gpus}")
    num_slots = args.num_gpus or local_device_count()
    pool = {"localhost": list(range(num_slots))}
    source = f"this machine (no hostfile given: 'localhost' with {num_slots} slot(s))"
    return select_resources(pool, args.include, args.exclude, source=source)


def local_device_count() -> int:
    """Visible CUDA devices on this machine, or 1 (one CPU process) without CUDA."""
    import torch  # imported only here: zrun itself does not need torch otherwise

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def _slurm_pool(args: argparse.Namespace) -> ResourcePool:
    # The allocation's nodes, in SLURM's order, with --num_gpus (else this node's) slots each.
    num_slots = args.num_gpus or local_device_count()
    hosts = expand_nodelist(os.environ["SLURM_JOB_NODELIST"])
    pool = {host: list(range(num_slots)) for host in hosts}
    source = "the SLURM allocation (SLURM_JOB_NODELIST)"
    return select_resources(pool, args.include, args.exclude, args.num_nodes, source=source)


def _numbered_pool(args: argparse.Namespace) -> ResourcePool:
    # torchrun's style: --num_nodes N --num_gpus G --node_rank K --master_addr HOST, no hostfile.
    if args.num_nodes < 1:
        raise ValueError(f"--num_nodes must be >= 1, got {args.num_nodes}")
    if args.num_nodes > 1 and args.master_addr is None:
        raise ValueError("--no_ssh with --num_nodes > 1 needs --master_addr (node 0's address)")
    num_slots = args.num_gpus or local_device_count()
    if args.num_nodes == 1:
        return {"localhost": list(range(num_slots))}
    return {f"node{i}": list(range(num_slots)) for i in range(args.num_nodes)}
