"""DeepSpeed's `deepspeed` launcher command under zero-as-deepspeed: its flags mapped onto zrun.

    deepspeed [--hostfile H] [--include S | --exclude S] [--num_nodes N] [--num_gpus G]
              [--master_addr A] [--master_port P] [--launcher pdsh|openmpi|slurm] ...
              script.py [script args]

doorway/bin/deepspeed runs main(); it parses DeepSpeed's flags (deepspeed.launcher.runner,
DeepSpeed 0.19.8), translates them into zrun's (docs/launcher.md) and runs zrun in this process.
A DeepSpeed flag zrun has no counterpart for is refused with exit code 2 and one line naming it,
never ignored when it would change the run.

What differs from DeepSpeed's own launcher:
- --enable_each_rank_log DIR becomes zrun's --log_dir DIR: rank R writes DIR/rankR.log (DeepSpeed
  names the files <timestamp>_rank<R>.log).
- --save_pid writes /tmp/<pid>.deepspeed holding this process's pid, which ends the whole job on
  SIGTERM (DeepSpeed's file holds the pid of its per-node launch process); removed at exit.
- ~/.deepspeed_env and ./.deepspeed_env (name from DS_ENV_FILE) set variables on every rank of a
  multi-node job, as DeepSpeed's do, after zrun's .zero_env files.
- --log_level debug shows the elastic agent's log (zrun --verbose); other levels and --quiet keep
  zrun's output, which is errors only.
- --autotuning tune|run is zrun's (docs/tuning.md): the same autotuning block, but the planner
  drops the candidates it predicts will not fit before any runs, and the results directory
  holds zero's table and plot beside DeepSpeed's ds_config_optimal.json.
"""

import argparse
import os
import sys

from ..launcher import main as zrun_main
from ..launcher.cli import build_parser as zrun_parser
from ..launcher.cli import resource_pool
from ..launcher.environment import read_env_file
from ..launcher.hostfile import DEFAULT_HOSTFILE
from .deepspeed import DEEPSPEED_ENVIRONMENT_NAME

# DeepSpeed's deepspeed.launcher.runner.DEEPSPEED_ENVIRONMENT_PATHS: home, then the working dir.
DEEPSPEED_ENVIRONMENT_PATHS = (os.path.expanduser("~"), ".")
PID_FILE_DIR = "/tmp"
# DeepSpeed's --launcher values zrun has a runner for (zrun's names are the same).
LAUNCHERS = ("pdsh", "openmpi", "slurm")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def build_parser() -> argparse.ArgumentParser:
    """DeepSpeed's launcher flags with DeepSpeed's defaults (deepspeed.launcher.runner)."""
    parser = argparse.ArgumentParser(
        prog="deepspeed",
        description="DeepSpeed's launcher command, run by zero's zrun (zero-as-deepspeed).",
        epilog="Flags zrun has no counterpart for are refused. See docs/launcher.md and "
        "docs/migrating-from-deepspeed.md.",
    )
    add = parser.add_argument
    add("-H", "--hostfile", default=None, help=f"hostfile (default {DEFAULT_HOSTFILE} if present)")
    add("-i", "--include", default="", help="hosts/slots to use, e.g. 'worker-0@worker-1:0,2'")
    add("-e", "--exclude", default="", help="hosts/slots to leave out, same format")
    add("--num_nodes", type=int, default=-1, help="use the first N hosts of the hostfile")
    add("--min_elastic_nodes", type=int, default=-1, help="refused (elastic training)")
    add("--max_elastic_nodes", type=int, default=-1, help="refused (elastic training)")
    add("--num_gpus", "--num_accelerators", type=int, default=-1, help="ranks per node")
    add("--master_port", type=int, default=None, help="rendezvous TCP port (default 29500)")
    add("--master_addr", default="", help="rendezvous host (default: node 0)")
    add("--node_rank", type=int, default=-1, help="with --no_ssh: this node's rank")
    add("--launcher", default="pdsh", help="multi-node runner: pdsh (default), openmpi, slurm")
    add("--launcher_args", default="", help="extra words for pdsh / mpirun / srun")
    add("--module", action="store_true", help="run the script as 'python -m MODULE'")
    add("--no_python", action="store_true", help="run the script as an executable")
    add("--no_local_rank", action="store_true", help="do not pass --local_rank=N to the script")
    add("--no_ssh", action="store_true", help="start only this node (with --node_rank)")
    add("--no_ssh_check", action="store_true", help="skip the check that hosts answer over ssh")
    add("--force_multi", action="store_true", help="use --launcher even for one node")
    add("--save_pid", action="store_true", help=f"write {PID_FILE_DIR}/<pid>.deepspeed")
    add("--enable_each_rank_log", default="None", help="write rank R's output to DIR/rankR.log")
    add("--autotuning", default="", choices=["tune", "run"], help="zrun --autotuning (tuning.md)")
    add("--elastic_training", action="store_true", help="refused (fixed set of nodes)")
    add("--bind_cores_to_rank", action="store_true", help="refused (zrun does not bind cores)")
    add("--bind_core_list", default=None, help="refused (zrun does not bind cores)")
    add("--ssh_port", type=int, default=None, help="ssh port on every ssh call")
    add("--venv_script", default=None, help="refused (remote nodes use this Python)")
    add("--log_level", default="info", choices=LOG_LEVELS, help="debug: the agent's log too")
    add("-q", "--quiet", action="store_true", help="accepted (zrun prints errors only)")
    add("user_script", help="training script (or module with --module)")
    add("user_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def refuse_unsupported(args: argparse.Namespace) -> None:
    """Raises NotImplementedError naming the first DeepSpeed flag zrun cannot honour."""
    if args.elastic_training:
        raise NotImplementedError(
            "--elastic_training: zrun runs a fixed set of nodes; start the job without it "
            "(and without --min_elastic_nodes / --max_elastic_nodes)"
        )
    if args.bind_cores_to_rank or args.bind_core_list is not None:
        raise NotImplementedError(
            "--bind_cores_to_rank / --bind_core_list: zrun does not bind ranks to cores (it "
            "sets OMP_NUM_THREADS to the usable cores / ranks per node); drop the flag, or bind "
            "inside the command (numactl with --no_python)"
        )
    if args.venv_script is not None:
        raise NotImplementedError(
            f"--venv_script {args.venv_script}: zrun does not source a script on each node; it "
            f"starts remote ranks with this Python ({sys.executable}) in this directory, so "
            "install zero at the same path on every node and pass variables with "
            f"{DEEPSPEED_ENVIRONMENT_NAME} or zrun's .zero_env"
        )


def _common_flags(args: argparse.Namespace) -> list[str]:
    # Every flag whose meaning does not depend on the number of nodes.
    # Passed only when given: zrun's default is DeepSpeed's 29500, and `--autotuning` gives each
    # trial a free port when no port was named.
    flags = [] if args.master_port is None else ["--master_port", str(args.master_port)]
    for flag, value in (
        ("--hostfile", args.hostfile),
        ("--include", args.include),
        ("--exclude", args.exclude),
        ("--master_addr", args.master_addr),
        ("--launcher_args", args.launcher_args),
    ):
        if value:
            flags += [flag, value]
    if args.num_nodes > 0:  # DeepSpeed: 0 and -1 both mean every host
        flags += ["--num_nodes", str(args.num_nodes)]
    if args.num_gpus > 0:
        flags += ["--num_gpus", str(args.num_gpus)]
    if args.no_ssh:  # DeepSpeed reads --node_rank with --no_ssh only, and needs it there
        if args.node_rank < 0:
            raise ValueError("--no_ssh needs --node_rank K, this node's rank (0 for the first)")
        flags += ["--node_rank", str(args.node_rank)]
    if args.ssh_port is not None:
        flags += ["--ssh_port", str(args.ssh_port)]
    if args.enable_each_rank_log != "None":
        if os.path.isfile(args.enable_each_rank_log):
            raise ValueError(
                f"--enable_each_rank_log {args.enable_each_rank_log} is a file; give a directory"
            )
        flags += ["--log_dir", args.enable_each_rank_log]
    switches = ("module", "no_python", "no_local_rank", "no_ssh", "no_ssh_check", "force_multi")
    flags += [f"--{name}" for name in switches if getattr(args, name)]
    if args.log_level == "debug" and not args.quiet:
        flags.append("--verbose")
    if args.autotuning:
        flags += ["--autotuning", args.autotuning]
    return flags


def is_multi_node(args: argparse.Namespace, common_flags: list[str]) -> bool:
    """Whether DeepSpeed would start this job through --launcher: a hostfile (given, or
    /job/hostfile) whose selection has more than one host, or --force_multi; never with
    --no_ssh. Without a hostfile DeepSpeed runs on this machine only. A hostfile or selection
    zrun rejects counts as one node here; zrun then reports it."""
    if args.no_ssh:
        return False
    if args.force_multi:
        return True
    if args.hostfile is None and not os.path.isfile(DEFAULT_HOSTFILE):
        return False
    zrun_args = zrun_parser().parse_args([*common_flags, args.user_script])
    try:
        return len(resource_pool(zrun_args)) > 1
    except (ValueError, FileNotFoundError):
        return False


def deepspeed_env_flags() -> list[str]:
    """`--env KEY=VALUE` for each line of the files DIR/DEEPSPEED_ENVIRONMENT_NAME, DIR in
    DEEPSPEED_ENVIRONMENT_PATHS (later files win). Raises ValueError naming the file and line
    of a malformed line."""
    flags = []
    for directory in DEEPSPEED_ENVIRONMENT_PATHS:
        path = os.path.join(directory, DEEPSPEED_ENVIRONMENT_NAME)
        if os.path.isfile(path):
            for key, value in read_env_file(path).items():
                flags += ["--env", f"{key}={value}"]
    return flags


def zrun_argv(args: argparse.Namespace) -> list[str]:
    """zrun's command line for DeepSpeed's parsed `args`.

    Raises:
        NotImplementedError: a DeepSpeed flag zrun cannot honour (refuse_unsupported), or a
            multi-node job with a --launcher zrun has no runner for (mvapich, mpich, impi).
        ValueError: --no_ssh without --node_rank; --enable_each_rank_log names a file; a
            malformed .deepspeed_env line.
    """
    refuse_unsupported(args)
    flags = _common_flags(args)
    if is_multi_node(args, flags):
        launcher = args.launcher.lower()  # DeepSpeed's names are case-insensitive
        if launcher not in LAUNCHERS:
            raise NotImplementedError(
                f"--launcher {args.launcher}: DeepSpeed's launchers zrun provides are "
                f"{', '.join(LAUNCHERS)}; use one of those, or plain ssh by running zrun "
                "itself (zrun --launcher ssh)"
            )
        flags += ["--launcher", launcher, *deepspeed_env_flags()]
    return [*flags, args.user_script, *args.user_args]


def main(argv: list[str] | None = None) -> int:
    """Run DeepSpeed's launcher command line `argv` (default sys.argv[1:]) with zrun; returns
    zrun's exit code (the first failed rank's code), or 2 with one line on stderr for a flag
    zrun cannot honour or a usage error."""
    args = build_parser().parse_args(argv)
    try:
        command = zrun_argv(args)
    except (NotImplementedError, ValueError) as error:
        print(f"deepspeed (zero-as-deepspeed): error: {error}", file=sys.stderr)
        return 2
    if not args.save_pid:
        return zrun_main(command)
    pid_file = os.path.join(PID_FILE_DIR, f"{os.getpid()}.deepspeed")
    with open(pid_file, "w") as handle:
        handle.write(str(os.getpid()))
    try:
        return zrun_main(command)
    finally:
        os.remove(pid_file)


if __name__ == "__main__":
    sys.exit(main())
