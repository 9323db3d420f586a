"""Multi-node runners: the commands that start one agent per node over ssh, pdsh, srun or mpirun.

Every builder is a pure function of the layout, the job and the runner options, so the exact
command lines are testable without the tools. Each node's agent gets the whole layout (--nodes)
and finds its own node rank: from the command line (ssh: one command per node), from pdsh's '%n',
from SLURMD_NODENAME (srun) or from OMPI_COMM_WORLD_RANK (mpirun, one process per node).
See [Note: values arrive byte for byte] in environment.py for how variables travel.
"""

import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, replace

from .runner import JobSpec, Launch, job_flags, local_address_flags
from .world import NodeSpec, WorldLayout, format_nodes

LAUNCHERS = ("ssh", "pdsh", "slurm", "openmpi")
_SSH_CHECK_TIMEOUT_S = 30


@dataclass(frozen=True)
class RemoteOptions:
    """How to reach the nodes: --launcher, --ssh_port (None: ssh's own configuration), the
    --launcher_args words, which go to ssh, pdsh, srun or mpirun before the remote command, and
    whether ssh and pdsh check first that every host answers (off with --no_ssh_check)."""

    launcher: str = "ssh"
    ssh_port: int | None = None
    launcher_args: tuple[str, ...] = ()
    ssh_check: bool = True


class _NodeRankToken(str):
    """pdsh replaces '%n' with the node's index; every other '%' of the command is escaped."""


PDSH_NODE_RANK = _NodeRankToken("%n")


def remote_agent_argv(
    layout: WorldLayout, job: JobSpec, node_flags: list[str], channel_flags: list[str]
) -> list[str]:
    """``python -u -m zero.launcher.agent --nodes ... <node_flags> ... script args`` for a remote
    node; ``node_flags`` tell the agent which node it is, ``channel_flags`` what ends it."""
    command = [sys.executable, "-u", "-m", "zero.launcher.agent"]
    command += ["--nodes", format_nodes(layout.nodes), *node_flags]
    command += ["--master_addr", layout.master_addr, "--master_port", str(layout.master_port)]
    command += [*channel_flags, *job_flags(job)]
    return [*command, job.script, *job.script_args]


def remote_shell_command(cwd: str, env: dict[str, str], argv: list[str]) -> str:
    """The one string a remote login shell runs: ``cd DIR && exec env K=V ... argv``.

    Every word is shlex.quote'd, so a POSIX shell (sh, bash, zsh) passes each one through
    unchanged. With a PDSH_NODE_RANK word in ``argv`` (pdsh), that word becomes '%n' and every
    other '%' is doubled, pdsh's escape.
    """
    escape = any(isinstance(word, _NodeRankToken) for word in argv)
    words = ["env", *(f"{k}={v}" for k, v in env.items()), *argv]
    return f"cd {_quote(cwd, escape)} && exec " + " ".join(_quote(w, escape) for w in words)


def _quote(word: str, escape_percent: bool) -> str:
    if isinstance(word, _NodeRankToken):
        return "%n"
    quoted = shlex.quote(word)
    return quoted.replace("%", "%%") if escape_percent else quoted


def ssh_command(host: str, remote_command: str, options: RemoteOptions) -> list[str]:
    """``ssh [-p PORT] [launcher args] HOST REMOTE_COMMAND``; the ssh config still applies."""
    port = ["-p", str(options.ssh_port)] if options.ssh_port is not None else []
    return ["ssh", *port, *options.launcher_args, host, remote_command]


def pdsh_command(hosts: list[str], remote_command: str, options: RemoteOptions) -> list[str]:
    """``pdsh -S -f 1024 -R ssh -w h1,h2 [launcher args] REMOTE_COMMAND`` (-S: pdsh exits with
    the largest remote exit code)."""
    command = ["pdsh", "-S", "-f", "1024", "-R", "ssh", "-w", ",".join(hosts)]
    return [*command, *options.launcher_args, remote_command]


def pdsh_environment(environ: dict[str, str], options: RemoteOptions) -> dict[str, str]:
    """pdsh's own environment: --ssh_port travels in PDSH_SSH_ARGS_APPEND (kept if already set)."""
    result = dict(environ)
    if options.ssh_port is not None:
        extra = f"-p {options.ssh_port}"
        result["PDSH_SSH_ARGS_APPEND"] = f"{environ.get('PDSH_SSH_ARGS_APPEND', '')} {extra}"
        result["PDSH_SSH_ARGS_APPEND"] = result["PDSH_SSH_ARGS_APPEND"].strip()
    return result


def srun_command(
    layout: WorldLayout,
    env: dict[str, str],
    argv: list[str],
    options: RemoteOptions,
    elastic: bool = False,
) -> list[str]:
    """``srun`` with one task (one agent) per node of the layout, no shell in between. Elastic:
    a failed task or node does not end the step (--kill-on-bad-exit=0 --no-kill), so the
    agents of the other nodes go on."""
    hosts = ",".join(node.host for node in layout.nodes)
    count = str(layout.num_nodes)
    command = ["srun", "--nodes", count, "--ntasks", count, "--ntasks-per-node", "1"]
    kill = ["--kill-on-bad-exit=0", "--no-kill"] if elastic else ["--kill-on-bad-exit=1"]
    command += ["--nodelist", hosts, *kill, *options.launcher_args]
    return [*command, "env", *(f"{k}={v}" for k, v in env.items()), *argv]


def mpirun_command(
    layout: WorldLayout, env: dict[str, str], argv: list[str], options: RemoteOptions
) -> list[str]:
    """Open MPI's ``mpirun`` with one process (one agent) per node, in layout order, unbound
    (the agent's ranks need every core of the node, not the one mpirun would bind to)."""
    hosts = ",".join(f"{node.host}:1" for node in layout.nodes)
    command = ["mpirun", "-np", str(layout.num_nodes), "--host", hosts]
    command += ["--map-by", "ppr:1:node", "--bind-to", "none"]
    if options.ssh_port is not None:
        command += ["--mca", "plm_rsh_args", f"-p {options.ssh_port}"]
    command += list(options.launcher_args)
    return [*command, "env", *(f"{k}={v}" for k, v in env.items()), *argv]


def remote_launches(layout: WorldLayout, job: JobSpec, options: RemoteOptions) -> list[Launch]:
    """The processes zrun starts for a multi-node job with ``options.launcher``.

    Raises:
        ValueError: an unknown launcher, or (ssh, pdsh, unless options.ssh_check is off) a host
            ssh cannot reach.
    """
    if options.launcher not in LAUNCHERS:
        raise ValueError(f"--launcher must be one of {list(LAUNCHERS)}, got {options.launcher!r}")
    if options.launcher in ("ssh", "pdsh") and options.ssh_check:
        check_ssh_reachable([node.host for node in layout.nodes], options)
    if options.launcher == "ssh":
        return [_ssh_launch(layout, node, job, options) for node in layout.nodes]
    channel = ["--exit_on_hangup"]
    if options.launcher == "pdsh":
        argv = remote_agent_argv(layout, job, ["--node_rank", PDSH_NODE_RANK], channel)
        command = remote_shell_command(os.getcwd(), job.env, argv)
        hosts = [node.host for node in layout.nodes]
        env = pdsh_environment(dict(os.environ), options)
        return [Launch("pdsh", pdsh_command(hosts, command, options), env, stdin_channel=True)]
    if options.launcher == "slurm":
        argv = remote_agent_argv(layout, job, ["--node_name_env", "SLURMD_NODENAME"], channel)
        command = srun_command(layout, job.env, argv, options, elastic=job.elastic)
        return [Launch("srun", command)]
    argv = remote_agent_argv(layout, job, ["--node_rank_env", "OMPI_COMM_WORLD_RANK"], channel)
    return [Launch("mpirun", mpirun_command(layout, job.env, argv, options))]


def _ssh_launch(layout: WorldLayout, node: NodeSpec, job: JobSpec, options: RemoteOptions):
    channel = ["--exit_on_stdin_eof", "--exit_on_hangup"]
    node_flags = ["--node_rank", str(node.node_rank), *local_address_flags(layout, node, job)]
    argv = remote_agent_argv(layout, job, node_flags, channel)
    command = ssh_command(node.host, remote_shell_command(os.getcwd(), job.env, argv), options)
    return Launch(f"node {node.node_rank} '{node.host}'", command, stdin_channel=True)


def check_ssh_reachable(hosts: list[str], options: RemoteOptions) -> None:
    """Run ``ssh ... HOST true`` on every host at once, before anything starts.

    Raises:
        ValueError: naming each host that failed, with ssh's own message.
    """
    if options.launcher == "pdsh":
        # pdsh's words are pdsh flags; the ssh options pdsh uses come from PDSH_SSH_ARGS_APPEND.
        extra = tuple(shlex.split(os.environ.get("PDSH_SSH_ARGS_APPEND", "")))
        options = replace(options, launcher="ssh", launcher_args=extra)
    checks = {}
    for host in dict.fromkeys(hosts):
        command = ssh_command(host, "true", options)
        # After the user's words: for ssh the first value of an option wins, so theirs do.
        command[-2:-2] = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
        checks[host] = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
    failures = []
    for host, proc in checks.items():
        try:
            _, stderr = proc.communicate(timeout=_SSH_CHECK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            stderr = f"no answer within {_SSH_CHECK_TIMEOUT_S} s".encode()
        if proc.returncode != 0:
            message = stderr.decode(errors="replace").strip() or f"exit code {proc.returncode}"
            failures.append(f"'{host}': {message}")
    if failures:
        port = f" -p {options.ssh_port}" if options.ssh_port is not None else ""
        raise ValueError(
            "cannot reach host over ssh (zrun needs key-based login; try "
            f"'ssh{port} HOST true'): " + "; ".join(failures)
        )
