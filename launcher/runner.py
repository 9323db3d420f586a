"""Runners: start the processes of a job (one agent per node, or the ssh clients, pdsh, srun or
mpirun that start them) and wait for the job.

zrun watches every process it started: the first one that exits non-zero makes zrun stop the
others and its code becomes zrun's; SIGINT/SIGTERM/SIGHUP to zrun stop them all. A process whose
stdin is the agent's channel (ssh, pdsh) is stopped by closing that stdin: the remote agent sees
EOF, ends its ranks and exits, and its ssh client exits with the agent's code. Other processes
(local agents, srun, mpirun) get SIGTERM, which srun and mpirun pass on to the agents.
"""

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import psutil

from .rendezvous import ElasticJob
from .world import NodeSpec, WorldLayout, is_local_host

_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# An elastic job that succeeded: how long nodes still running (waiting to join) may take.
_ELASTIC_FINISH_GRACE_S = 30.0
# Extra time an agent gets, beyond its ranks' SIGTERM->SIGKILL grace, to sweep and exit.
_AGENT_EXIT_MARGIN_S = 5.0
_POLL_INTERVAL_S = 0.05


@dataclass(frozen=True)
class JobSpec:
    """What every rank runs and how the agents treat it (the zrun flags after the layout).

    ``env`` holds the variables every rank gets on top of its node's environment (see
    environment.job_environment).
    """

    script: str
    script_args: tuple[str, ...]
    run_id: str
    module: bool = False
    no_python: bool = False
    no_local_rank: bool = False
    log_dir: str | None = None
    shutdown_timeout: int = 5
    verbose: bool = False
    env: dict[str, str] = field(default_factory=dict)
    nnodes: str | None = None  # elastic node range MIN:MAX
    max_restarts: int = 0
    rdzv_conf: str = ""
    zrun_store: bool = False  # zrun hosts the elastic rendezvous store

    @property
    def elastic(self) -> bool:
        """A dynamic (c10d) rendezvous: a node range or restarts ([Note: elastic rendezvous])."""
        return self.nnodes is not None or self.max_restarts > 0


@dataclass(frozen=True)
class Launch:
    """One process zrun starts: its name in messages, command, environment (None: zrun's) and
    whether its stdin is the channel that keeps the remote agents alive."""

    name: str
    command: list[str]
    env: dict[str, str] | None = None
    stdin_channel: bool = False


def job_flags(job: JobSpec) -> list[str]:
    """The agent flags every node shares: run id, shutdown timeout, log dir and script kind."""
    flags = ["--run_id", job.run_id, "--shutdown_timeout", str(job.shutdown_timeout)]
    if job.log_dir:
        flags += ["--log_dir", os.path.abspath(job.log_dir)]
    for flag in ("module", "no_python", "no_local_rank", "verbose", "zrun_store"):
        if getattr(job, flag):
            flags.append(f"--{flag}")
    if job.nnodes is not None:
        flags += ["--nnodes", job.nnodes]
    if job.max_restarts:
        flags += ["--max_restarts", str(job.max_restarts)]
    if job.rdzv_conf:
        flags += ["--rdzv_conf", job.rdzv_conf]
    return flags


def local_address_flags(layout: WorldLayout, node: NodeSpec, job: JobSpec) -> list[str]:
    """Elastic, started by zrun: --local_addr for a node on zrun's machine, the address zrun's
    store is reached at (a name such as 'localhost' would not reach it from another node);
    other nodes use their host name. A node started by hand (--no_ssh) names itself (agent.py)."""
    if job.elastic and job.zrun_store and is_local_host(node.host):
        return ["--local_addr", layout.master_addr]
    return []


def agent_command(layout: WorldLayout, node: NodeSpec, job: JobSpec) -> list[str]:
    """The command line that starts ``node``'s agent on this machine, as a child of zrun."""
    command = [sys.executable, "-u", "-m", "zero.launcher.agent"]
    command += ["--node_rank", str(node.node_rank), "--num_nodes", str(layout.num_nodes)]
    command += ["--nproc_per_node", str(node.num_slots), "--node_name", node.host]
    command += ["--master_addr", layout.master_addr, "--master_port", str(layout.master_port)]
    command += ["--parent_pid", str(os.getpid())]
    command += local_address_flags(layout, node, job)
    if node.slot_ids != tuple(range(node.num_slots)):
        command += ["--device_ids", ",".join(str(s) for s in node.slot_ids)]
    return [*command, *job_flags(job), job.script, *job.script_args]


def local_launches(
    layout: WorldLayout, job: JobSpec, nodes: tuple[NodeSpec, ...] | None = None
) -> list[Launch]:
    """One agent subprocess per node of ``nodes`` (default: every node of the layout)."""
    env = {**os.environ, **job.env}
    return [
        Launch(f"node {node.node_rank} '{node.host}'", agent_command(layout, node, job), env)
        for node in (layout.nodes if nodes is None else nodes)
    ]


class JobRunner:
    """Starts the launches, waits for the job, and stops everything on a failure or a signal.

    ``report_failures``: print which launch failed (remote runners; a local agent already
    reports the failed rank itself).
    """

    def __init__(
        self,
        launches: list[Launch],
        shutdown_timeout: int,
        report_failures: bool,
        elastic: ElasticJob | None = None,
    ):
        self.launches = launches
        self.shutdown_timeout = shutdown_timeout
        self.report_failures = report_failures
        self.elastic = elastic
        self._procs: list[subprocess.Popen] = []
        self._received_signal: int | None = None

    def run(self) -> int:
        """Start every launch and wait; returns zrun's exit code (0, the first failed launch's
        code, or 128 + N after zrun received signal N)."""
        previous = {s: signal.signal(s, self._on_signal) for s in _FORWARDED_SIGNALS}
        try:
            for launch in self.launches:
                # Own session: a terminal's Ctrl-C reaches zrun only, which then stops the
                # others in order instead of every process getting SIGINT at once.
                stdin = subprocess.PIPE if launch.stdin_channel else None
                proc = subprocess.Popen(
                    launch.command, env=launch.env, stdin=stdin, start_new_session=True
                )
                self._procs.append(proc)
            return self._wait()
        finally:
            self._stop_all()
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _on_signal(self, signum: int, _frame) -> None:
        if self._received_signal is None:
            name = signal.Signals(signum).name
            print(f"zrun: received {name}, stopping all ranks", file=sys.stderr, flush=True)
        self._received_signal = signum
        self._ask_to_stop()

    def _ask_to_stop(self) -> None:
        for proc in self._procs:
            if proc.poll() is not None:
                continue
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            else:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)

    def _wait(self) -> int:
        if self.elastic is not None:
            return self._wait_elastic()
        while True:
            if self._received_signal is not None:
                return 128 + self._received_signal
            codes = [proc.poll() for proc in self._procs]
            failed = next((i for i, c in enumerate(codes) if c not in (None, 0)), None)
            if failed is not None:
                code = codes[failed]
                if self.report_failures:
                    name = self.launches[failed].name
                    print(f"zrun: {name} failed (code {code}), stopping the job", file=sys.stderr)
                return 128 - code if code < 0 else code
            if all(code == 0 for code in codes):
                return 0
            time.sleep(_POLL_INTERVAL_S)

    def _wait_elastic(self) -> int:
        """An elastic job goes on while any launch runs; a launch that fails is reported (a
        node left) but stops nothing. The job succeeded once an agent reported success in
        zrun's store (pdsh and srun report one code for all nodes, so their codes cannot tell);
        launches still running then (a node waiting to join) are stopped after
        _ELASTIC_FINISH_GRACE_S. Without a success, the first failed launch's code."""
        reported: set[int] = set()
        finished_at = None
        while True:
            if self._received_signal is not None:
                return 128 + self._received_signal
            codes = [proc.poll() for proc in self._procs]
            for index, code in enumerate(codes):
                if code not in (None, 0) and index not in reported:
                    reported.add(index)
                    self._report_left(index, code)
            succeeded = self.elastic.succeeded()
            if all(code is not None for code in codes):
                if succeeded or all(code == 0 for code in codes):
                    return 0
                code = codes[min(reported)]
                return 128 - code if code < 0 else code
            if succeeded and finished_at is None:
                finished_at = time.monotonic()
            if finished_at is not None and time.monotonic() - finished_at > _ELASTIC_FINISH_GRACE_S:
                return 0
            time.sleep(_POLL_INTERVAL_S)

    def _report_left(self, index: int, code: int) -> None:
        running = sum(proc.poll() is None for proc in self._procs)
        name = self.launches[index].name
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"code {code}"
        if running:
            message = (
                f"{name} left the job ({how}); the other nodes go on (elastic: --nnodes "
                f"{self.elastic.node_range}, --max_restarts {self.elastic.max_restarts})"
            )
        elif self.elastic.succeeded():
            # pdsh and srun exit with one code for all their nodes: a node lost on the way
            # makes it non-zero although the survivors finished (the agent reports success
            # before it exits, so the store already tells).
            message = f"{name} ended ({how}): a node was lost on the way; the job succeeded"
        else:
            message = f"{name} failed ({how})"
        print(f"zrun: {message}", file=sys.stderr, flush=True)

    def _stop_all(self) -> None:
        """Ask every process still running to stop; kill one and its whole tree if it hangs."""
        self._ask_to_stop()
        deadline = time.monotonic() + self.shutdown_timeout + _AGENT_EXIT_MARGIN_S
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_tree(proc.pid)
                proc.wait()


def _kill_tree(pid: int) -> None:
    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
