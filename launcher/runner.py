"""Runners: start the per-node agent on every node of a world layout and wait for the job.

For now only nodes that are this machine are supported (``LocalRunner``: the agent is a
subprocess of zrun). Multi-node runners (ssh, pdsh, SLURM srun, mpirun) will build the same
agent command and start it remotely; the agent ends its ranks when its channel closes.
"""

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import psutil

from .world import NodeSpec, WorldLayout, is_local_host

_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# Extra time an agent gets, beyond its ranks' SIGTERM->SIGKILL grace, to sweep and exit.
_AGENT_EXIT_MARGIN_S = 5.0
_POLL_INTERVAL_S = 0.05


@dataclass(frozen=True)
class JobSpec:
    """What every rank runs and how the agents treat it (the zrun flags after the layout)."""

    script: str
    script_args: tuple[str, ...]
    run_id: str
    module: bool = False
    no_python: bool = False
    no_local_rank: bool = False
    log_dir: str | None = None
    shutdown_timeout: int = 5
    verbose: bool = False


def agent_command(layout: WorldLayout, node: NodeSpec, job: JobSpec) -> list[str]:
    """The command line that starts ``node``'s agent (``python -m zero.launcher.agent``)."""
    command = [sys.executable, "-u", "-m", "zero.launcher.agent"]
    command += ["--node_rank", str(node.node_rank), "--num_nodes", str(layout.num_nodes)]
    command += ["--nproc_per_node", str(node.num_slots), "--node_name", node.host]
    command += ["--master_addr", layout.master_addr, "--master_port", str(layout.master_port)]
    command += ["--run_id", job.run_id, "--shutdown_timeout", str(job.shutdown_timeout)]
    if is_local_host(node.host):
        command += ["--parent_pid", str(os.getpid())]
    if node.slot_ids != tuple(range(node.num_slots)):
        command += ["--device_ids", ",".join(str(s) for s in node.slot_ids)]
    if job.log_dir:
        command += ["--log_dir", os.path.abspath(job.log_dir)]
    for flag in ("module", "no_python", "no_local_rank", "verbose"):
        if getattr(job, flag):
            command.append(f"--{flag}")
    return [*command, job.script, *job.script_args]


def check_local_only(layout: WorldLayout) -> None:
    """Raises NotImplementedError naming the first host that is not this machine."""
    for node in layout.nodes:
        if not is_local_host(node.host):
            raise NotImplementedError(
                f"host '{node.host}' (node {node.node_rank}) is not this machine, and multi-node "
                "runners (ssh, pdsh, slurm, mpirun) are not available yet; use hosts that are "
                "this machine (localhost, 127.x, its hostname or IPs)"
            )


class LocalRunner:
    """Runs each node's agent as a subprocess of zrun; every node must be this machine.

    zrun forwards SIGINT/SIGTERM/SIGHUP to the agents as SIGTERM; the first agent that exits
    non-zero makes zrun stop the others, and its code becomes zrun's.
    """

    def __init__(self, layout: WorldLayout, job: JobSpec):
        check_local_only(layout)
        self.layout = layout
        self.job = job
        self._agents: list[subprocess.Popen] = []
        self._received_signal: int | None = None

    def run(self) -> int:
        """Start every agent and wait for the job; returns zrun's exit code (0, the first failed
        node's code, or 128 + N after zrun received signal N)."""
        previous = {s: signal.signal(s, self._on_signal) for s in _FORWARDED_SIGNALS}
        try:
            for node in self.layout.nodes:
                # Own session: a terminal's Ctrl-C reaches zrun only, which then stops the
                # agents in order instead of every process getting SIGINT at once.
                command = agent_command(self.layout, node, self.job)
                self._agents.append(subprocess.Popen(command, start_new_session=True))
            return self._wait()
        finally:
            self._stop_agents()
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _on_signal(self, signum: int, _frame) -> None:
        if self._received_signal is None:
            name = signal.Signals(signum).name
            print(f"zrun: received {name}, stopping all ranks", file=sys.stderr, flush=True)
        self._received_signal = signum
        self._signal_agents(signal.SIGTERM)

    def _signal_agents(self, signum: int) -> None:
        for agent in self._agents:
            if agent.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    agent.send_signal(signum)

    def _wait(self) -> int:
        while True:
            if self._received_signal is not None:
                return 128 + self._received_signal
            codes = [agent.poll() for agent in self._agents]
            failed = next((c for c in codes if c not in (None, 0)), None)
            if failed is not None:
                return 128 - failed if failed < 0 else failed
            if all(code == 0 for code in codes):
                return 0
            time.sleep(_POLL_INTERVAL_S)

    def _stop_agents(self) -> None:
        """SIGTERM the agents still running; kill an agent and its whole tree if it hangs."""
        self._signal_agents(signal.SIGTERM)
        deadline = time.monotonic() + self.job.shutdown_timeout + _AGENT_EXIT_MARGIN_S
        for agent in self._agents:
            try:
                agent.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_tree(agent.pid)
                agent.wait()


def _kill_tree(pid: int) -> None:
    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
