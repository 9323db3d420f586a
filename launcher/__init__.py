"""zero.launcher: ``zrun``, start a job with one process per slot on each selected host.

hostfile.py (hostfile, --include/--exclude) -> world.py (WorldLayout) -> runner.py (local
agents) or remote.py (ssh, pdsh, srun, mpirun; one agent per node) -> agent.py (one process per
slot, torch.distributed's elastic agent). environment.py decides what every rank's environment
gets; nodelist.py reads SLURM node lists; rendezvous.py holds an elastic job's node range,
rendezvous options and the c10d store zrun hosts ([Note: elastic rendezvous] in agent.py).
autotuning/ is `zrun --autotuning tune|run` (docs/tuning.md).
"""

import dataclasses
import os
import shlex
import signal
import socket
import sys
import time

from .cli import build_parser, resource_pool
from .environment import env_file_paths, job_environment
from .remote import RemoteOptions, remote_launches
from .rendezvous import ElasticJob, node_range, rendezvous_options
from .runner import JobRunner, JobSpec, Launch, local_launches
from .world import WorldLayout, build_layout, is_local_host, rendezvous_address

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run zrun with ``argv`` (default sys.argv[1:]); returns the process exit code.

    0 on success (elastic, --nnodes MIN:MAX / --max_restarts: once an agent reported that its
    ranks succeeded, whichever nodes were lost on the way); the first failed rank's exit code
    (128 + N if it was killed by signal N);
    128 + N when zrun itself receives signal N; 2 for a usage error found before anything
    starts (bad flag, hostfile, selection, .zero_env or --env; a host ssh cannot reach), with
    one line on stderr.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if args.autotuning:
        return _autotune(args, argv)
    try:
        check_elastic_flags(args)
        layout = build_layout(resource_pool(args), args.master_addr, args.master_port)
        env = job_environment(dict(os.environ), env_file_paths(), args.env)
        job = JobSpec(
            script=args.script,
            script_args=tuple(args.script_args),
            run_id=args.rdzv_id or _run_id(args),
            module=args.module,
            no_python=args.no_python,
            no_local_rank=args.no_local_rank,
            log_dir=args.log_dir,
            shutdown_timeout=args.shutdown_timeout,
            verbose=args.verbose,
            env=env,
            nnodes=args.nnodes,
            max_restarts=args.max_restarts,
            rdzv_conf=args.rdzv_conf,
            # Elastic only: zrun then hosts the rendezvous store ([Note: elastic rendezvous]).
            zrun_store=not args.no_ssh and (args.nnodes is not None or args.max_restarts > 0),
        )
        if job.elastic:
            layout = elastic_layout(args, layout)
        launches, remote = plan_launches(args, layout, job)
        elastic = _host_store(layout, job) if job.elastic and job.zrun_store else None
    except (ValueError, FileNotFoundError, NotImplementedError) as error:
        print(f"zrun: error: {error}", file=sys.stderr)
        return 2
    runner = JobRunner(launches, args.shutdown_timeout, report_failures=remote, elastic=elastic)
    return runner.run()


def _autotune(args, argv: list[str]) -> int:
    from .autotuning import autotune  # imports torch and the planner: only when tuning

    try:
        return autotune(args, argv)
    except (ValueError, FileNotFoundError, NotImplementedError) as error:
        print(f"zrun --autotuning: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the running trial was ended with it (trials.run)
        print("zrun --autotuning: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT


def check_elastic_flags(args) -> None:
    """Check --nnodes, --max_restarts and --rdzv_conf; --nnodes N alone becomes --num_nodes N.

    Raises:
        ValueError: a malformed range or --rdzv_conf, --max_restarts < 0, --nnodes N beside a
            different --num_nodes, MAX below the nodes selected (checked in elastic_layout).
        NotImplementedError: elastic flags with --launcher openmpi (mpirun ends the whole job
            when one of its processes dies, so no node can be lost).
    """
    if args.nnodes is not None and ":" not in args.nnodes:
        count = node_range(args.nnodes, 1)[0]
        if args.num_nodes not in (None, count):
            raise ValueError(f"--nnodes {args.nnodes} and --num_nodes {args.num_nodes} differ")
        args.num_nodes, args.nnodes = count, None
    if args.max_restarts < 0:
        raise ValueError(f"--max_restarts must be >= 0, got {args.max_restarts}")
    if args.nnodes is None and args.max_restarts == 0:
        if args.rdzv_conf:
            raise ValueError(
                "--rdzv_conf needs an elastic job (--nnodes MIN:MAX or --max_restarts)"
            )
        return
    node_range(args.nnodes, 1)
    rendezvous_options(args.rdzv_conf)
    if args.launcher == "openmpi" and not args.no_ssh:
        raise NotImplementedError(
            "--nnodes MIN:MAX and --max_restarts need a runner that lets the other nodes go on "
            "when one is lost; mpirun ends the whole job when any of its processes dies. Use "
            "--launcher ssh, pdsh or slurm, or drop the elastic flags"
        )


def elastic_layout(args, layout: WorldLayout) -> WorldLayout:
    """The layout of an elastic job: its rendezvous address is zrun's machine, which hosts the
    store ([Note: elastic rendezvous] in agent.py), unless --master_addr names another.

    Raises:
        ValueError: the hostfile selects more nodes than the range's MAX.
    """
    _, high = node_range(args.nnodes, layout.num_nodes)
    if layout.num_nodes > high:
        raise ValueError(
            f"--nnodes {args.nnodes}: {layout.num_nodes} nodes are selected, more than MAX "
            f"{high}; raise MAX or select fewer nodes (--num_nodes, --include)"
        )
    if args.master_addr is not None or args.no_ssh:
        return layout
    address = rendezvous_address([node.host for node in layout.nodes])
    return dataclasses.replace(layout, master_addr=address)


def _host_store(layout: WorldLayout, job: JobSpec) -> ElasticJob:
    try:
        elastic = ElasticJob(
            layout.master_port, job.run_id, job.nnodes or str(layout.num_nodes), job.max_restarts
        )
    except RuntimeError as error:
        raise ValueError(
            f"cannot host the elastic rendezvous store on port {layout.master_port} "
            f"(--master_port): {error}"
        ) from None
    low, high = node_range(job.nnodes, layout.num_nodes)
    print(
        f"zrun: elastic job: c10d rendezvous at {layout.master_addr}:{layout.master_port} "
        f"(--rdzv_id {job.run_id}), {low} to {high} nodes, --max_restarts {job.max_restarts}",
        file=sys.stderr,
        flush=True,
    )
    return elastic


def _run_id(args) -> str:
    # The nodes' agents must agree on it: zrun gives one to all of them, but --no_ssh nodes are
    # started separately, so theirs comes from what they share, the rendezvous port.
    if args.no_ssh:
        return f"zrun-no_ssh-{args.master_port}"
    return f"zrun-{os.getpid()}-{int(time.time())}"


def plan_launches(args, layout: WorldLayout, job: JobSpec) -> tuple[list[Launch], bool]:
    """What zrun starts, and whether it is a multi-node runner.

    --no_ssh: only the agent of node --node_rank, here. Otherwise local agents when every host
    is this machine, unless --force_multi or --launcher slurm/openmpi; else --launcher's runner.

    Raises:
        ValueError: --node_rank without --no_ssh or outside the layout, or (remote) see
            remote_launches.
    """
    if args.no_ssh:
        return [_this_node(args, layout, job)], False
    if args.node_rank is not None:
        raise ValueError("--node_rank is only used with --no_ssh (start one node by hand)")
    all_local = all(is_local_host(node.host) for node in layout.nodes)
    if all_local and not args.force_multi and args.launcher in ("ssh", "pdsh"):
        return local_launches(layout, job), False
    launcher_args = tuple(shlex.split(args.launcher_args))
    options = RemoteOptions(args.launcher, args.ssh_port, launcher_args, not args.no_ssh_check)
    return remote_launches(layout, job, options), True


def _this_node(args, layout: WorldLayout, job: JobSpec) -> Launch:
    node_rank = 0 if args.node_rank is None else args.node_rank
    if not 0 <= node_rank < layout.num_nodes:
        raise ValueError(f"--node_rank must be in 0..{layout.num_nodes - 1}, got {node_rank}")
    node = layout.nodes[node_rank]
    if node.host == f"node{node_rank}":
        # A numbered pool (no hostfile): name the node after this machine in messages.
        node = dataclasses.replace(node, host=socket.gethostname())
    return local_launches(layout, job, (node,))[0]
