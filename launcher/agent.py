"""Per-node agent: starts one process per slot of this node, watches them, ends them together.

Run as ``python -m zero.launcher.agent [options] script [script args]``; zrun starts one per node.
Process management is torch.distributed's elastic agent (``elastic_launch``) with a static
rendezvous on MASTER_ADDR:MASTER_PORT (node rank 0 serves the store) and no restarts. It sets
RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and MASTER_PORT for each
rank; this module adds NODE_RANK, OMP_NUM_THREADS and CUDA_VISIBLE_DEVICES (--device_ids).

[Note: no process left behind]
The elastic agent starts each rank in its own session and, on the first failure or a signal,
sends SIGTERM to the process group of every rank still running, then SIGKILL after
--shutdown_timeout seconds. Two cases escape that: children of a rank that already exited (they
are orphans, no longer in a group the agent signals) and processes a rank moved to a new session.
So the agent makes itself a child subreaper (Linux): every orphan of the job is re-parented to
the agent, and after the job the agent kills whatever descendants remain. The agent also ends the
job when its parent zrun disappears (--parent_pid, local nodes) or when the channel it was
started over closes (remote nodes): --exit_on_stdin_eof (ssh, pdsh: zrun keeps the ssh client's
stdin open for the whole job, so EOF means zrun or its ssh client is gone) and --exit_on_hangup
(any runner: the reader of the agent's stdout/stderr pipe, sshd or srun's step daemon, is gone).
The ranks get /dev/null as stdin, so only the agent holds the channel.

[Note: elastic rendezvous]
With --nnodes MIN:MAX (or --max_restarts > 0) the rendezvous is torch's dynamic one on the c10d
backend: a TCPStore at MASTER_ADDR:MASTER_PORT holds its state. zrun, which outlives every node,
hosts that store and every agent joins it as a client (--zrun_store: is_host false), so the loss
of any node, node 0 included, leaves the rendezvous in place. When a rank fails (its own error,
or a peer on a lost node), each surviving agent stops its ranks and joins the next round; the
round completes with the nodes present (at least MIN, within last_call_timeout once MIN have
joined; a lost node's entry expires after keep_alive_interval x keep_alive_max_attempt), node
ranks and world size are assigned anew, and the ranks start again with
TORCHELASTIC_RESTART_COUNT one higher, at most --max_restarts times. A node that joins a running
job (up to MAX) makes the running nodes restart so that the next round admits it. Each round's
rank-0 node serves the ranks' own store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a fresh
MASTER_ADDR:MASTER_PORT per round, so no round uses a store of a node that is gone). When the
ranks succeed the agent records it in zrun's store, which is how zrun tells a finished job from
a lost node under runners that report one exit code for all nodes (pdsh, srun).
"""

import argparse
import contextlib
import ctypes
import logging
import os
import select
import shutil
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import psutil
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import (  # noqa: F401 (registers the backends)
    c10d_rendezvous_backend,
    static_tcp_rendezvous,
)
from torch.distributed.elastic.utils import macros
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from .rendezvous import node_range, rendezvous_options, succeeded_key
from .world import parse_nodes

_PR_SET_CHILD_SUBREAPER = 36
# Where the elastic agent logs, and what, when it ends a rank still running (torch 2.1 on; where
# the message differs, ExitClock falls back to exit times).
_ELASTIC_PROCESSES_LOGGER = "torch.distributed.elastic.multiprocessing.api"
_CLOSING_SIGNAL_MESSAGE = "Sending process %s closing signal %s"
_HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@dataclass(frozen=True)
class RankFailure:
    """The first rank of this node that failed: its ranks, the node, and its exit code."""

    rank: int
    local_rank: int
    node_rank: int
    node_name: str
    exit_code: int
    stopped: tuple[int, ...] = ()  # ranks of this node stopped (SIGSTOP) when it exited

    def describe(self) -> str:
        """One line for the console, e.g. 'rank 1 (local_rank 1 on node 0 'localhost') exited
        with code 7'; a rank killed by a signal is reported with the signal's name."""
        where = f"rank {self.rank} (local_rank {self.local_rank} on node {self.node_rank} "
        where += f"'{self.node_name}')"
        if self.exit_code < 0:
            what = f"{where} was killed by {signal.Signals(-self.exit_code).name}"
        else:
            what = f"{where} exited with code {self.exit_code}"
        if self.stopped:
            what += (
                f"; rank(s) {list(self.stopped)} had been stopped (SIGSTOP, a debugger) and "
                "stopped answering"
            )
        return what

    @property
    def process_exit_code(self) -> int:
        """The code zrun exits with: the rank's code, or 128 + signal number (the shell's rule)."""
        return 128 - self.exit_code if self.exit_code < 0 else self.exit_code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m zero.launcher.agent",
        description="zero per-node agent: start one process per slot of this node.",
        allow_abbrev=False,
    )
    parser.add_argument("--node_rank", type=int, default=None, help="this node's rank, default 0")
    parser.add_argument("--nodes", default=None, help="whole layout 'host:0,1@host2:0,1'")
    parser.add_argument("--node_rank_env", default=None, help="variable holding the node rank")
    parser.add_argument("--node_name_env", default=None, help="variable holding a --nodes host")
    parser.add_argument("--num_nodes", type=int, default=1, help="number of nodes in the job")
    parser.add_argument("--nproc_per_node", type=int, default=1, help="ranks on this node")
    parser.add_argument("--master_addr", default="127.0.0.1", help="rendezvous host (node 0)")
    parser.add_argument("--master_port", type=int, default=29500, help="rendezvous TCP port")
    parser.add_argument("--node_name", default=socket.gethostname(), help="name in messages")
    parser.add_argument("--device_ids", default=None, help="CUDA_VISIBLE_DEVICES for the ranks")
    parser.add_argument("--run_id", default="zrun", help="rendezvous id shared by all nodes")
    parser.add_argument("--log_dir", default=None, help="write rank R's output to rankR.log")
    parser.add_argument("--shutdown_timeout", type=int, default=5, help="SIGTERM->SIGKILL, s")
    parser.add_argument("--rdzv_timeout", type=int, default=600, help="wait for nodes, s")
    parser.add_argument("--module", action="store_true", help="run script as 'python -m'")
    parser.add_argument("--no_python", action="store_true", help="run script as an executable")
    parser.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank")
    parser.add_argument("--parent_pid", type=int, default=None, help="exit when it is gone")
    parser.add_argument("--exit_on_stdin_eof", action="store_true", help="stdin is the channel")
    parser.add_argument("--exit_on_hangup", action="store_true", help="exit when stdout closes")
    parser.add_argument("--verbose", action="store_true", help="show the elastic agent's log")
    parser.add_argument("--nnodes", default=None, help="MIN:MAX: elastic, c10d rendezvous")
    parser.add_argument("--max_restarts", type=int, default=0, help="restarts of the ranks")
    parser.add_argument("--rdzv_conf", default="", help="c10d rendezvous options 'k=v,k2=v2'")
    parser.add_argument("--local_addr", default=None, help="address other nodes reach this at")
    parser.add_argument(
        "--zrun_store", action="store_true", help="zrun hosts the c10d store; report success"
    )
    parser.add_argument("script", help="training script, module or executable")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="passed to the script")
    return parser


def resolve_node(args: argparse.Namespace) -> None:
    """Fill node_rank, num_nodes, nproc_per_node, device_ids and node_name from --nodes and the
    node rank (--node_rank, or read from --node_rank_env, or this node's name looked up from
    --node_name_env). Without --nodes only the node rank is resolved.

    Raises:
        ValueError: the variable is unset or not an integer, the name is not in --nodes, or the
            node rank is outside the layout.
    """
    if args.node_rank is None and args.node_rank_env:
        raw = os.environ.get(args.node_rank_env, "")
        if not raw.isdigit():
            raise ValueError(f"--node_rank_env {args.node_rank_env}={raw!r} is not a node rank")
        args.node_rank = int(raw)
    nodes = parse_nodes(args.nodes) if args.nodes else None
    if args.node_rank is None and args.node_name_env and nodes:
        name = os.environ.get(args.node_name_env, "")
        hosts = [node.host for node in nodes]
        if name not in hosts:
            raise ValueError(f"{args.node_name_env}={name!r} is not one of the nodes {hosts}")
        args.node_rank = hosts.index(name)
    if args.node_rank is None:
        args.node_rank = 0
    if nodes is None:
        return
    if not 0 <= args.node_rank < len(nodes):
        raise ValueError(f"node rank {args.node_rank} is outside 0..{len(nodes) - 1}")
    node = nodes[args.node_rank]
    args.num_nodes, args.nproc_per_node, args.node_name = len(nodes), node.num_slots, node.host
    if node.slot_ids != tuple(range(node.num_slots)):
        args.device_ids = ",".join(str(s) for s in node.slot_ids)


def rank_command(args: argparse.Namespace, local_rank_arg: str) -> list[str]:
    """The command line of one rank; ``local_rank_arg`` (a macro the elastic agent substitutes)
    goes right after the script, where DeepSpeed's launcher puts --local_rank."""
    if args.no_python:
        command = [args.script]
    elif args.module:
        command = [sys.executable, "-u", "-m", args.script]
    else:
        command = [sys.executable, "-u", args.script]
    if not args.no_local_rank:
        command.append(f"--local_rank={local_rank_arg}")
    command += args.script_args
    if args.log_dir:
        # The shell replaces itself with the rank (exec), so no process is added; it only sends
        # stdout and stderr of rank $RANK into one file, which elastic's log redirection cannot.
        redirect = 'exec "$@" >"$0/rank$RANK.log" 2>&1'
        command = ["/bin/sh", "-c", redirect, args.log_dir, *command]
    return command


def configure_environment(args: argparse.Namespace) -> None:
    """Set the variables every rank of this node inherits (the user's own values win for OMP).
    Elastic: no NODE_RANK (each rendezvous round assigns node ranks anew: GROUP_RANK)."""
    if is_elastic(args):
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # [Note: elastic rendezvous]
    else:
        os.environ["NODE_RANK"] = str(args.node_rank)
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(omp_num_threads(args.nproc_per_node))
    if args.device_ids is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = args.device_ids


def omp_num_threads(nproc_per_node: int) -> int:
    """CPU cores this process may use, divided among the node's ranks, at least 1."""
    try:
        num_cores = len(os.sched_getaffinity(0))
    except AttributeError:
        num_cores = os.cpu_count() or 1
    return max(1, num_cores // max(1, nproc_per_node))


def become_subreaper() -> None:
    """Make orphaned descendants re-parent to this process (Linux only; a no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def kill_descendants(grace_s: float = 1.0) -> None:
    """SIGTERM every remaining descendant of this process, SIGKILL those alive after grace_s."""
    descendants = psutil.Process().children(recursive=True)
    for proc in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _, alive = psutil.wait_procs(descendants, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=grace_s)


def watch_parent(parent_pid: int | None, interval_s: float = 0.5) -> None:
    """Start a daemon thread that sends SIGTERM to this process once it is no longer a child of
    ``parent_pid`` (default: the parent it has now). zrun passes its pid, so that a zrun that died
    while this agent was still importing torch is noticed too."""
    if parent_pid is None:
        parent_pid = os.getppid()

    def _watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        _terminate_self()

    threading.Thread(target=_watch, name="zrun-parent-watch", daemon=True).start()


def watch_stdin_eof() -> None:
    """Start a daemon thread that sends SIGTERM to this process when stdin reaches EOF; the
    ranks get /dev/null as stdin instead, so they neither read the channel nor keep it open."""
    channel = os.dup(0)  # not inherited by the ranks (os.dup makes non-inheritable fds)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)

    def _watch() -> None:
        while os.read(channel, 65536):
            pass
        _terminate_self()

    threading.Thread(target=_watch, name="zrun-stdin-watch", daemon=True).start()


def watch_hangup(interval_ms: int = 500) -> None:
    """Start a daemon thread that sends SIGTERM to this process when the reader of its stdout
    or stderr (a pipe or socket: sshd, srun's step daemon, orted) closes; ttys and files are
    not watched."""
    poller = select.poll()
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            mode = os.fstat(fd).st_mode
            if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
                poller.register(fd, 0)  # no events asked: POLLERR/POLLHUP are always reported

    def _watch() -> None:
        while not poller.poll(interval_ms):
            pass
        _terminate_self()

    threading.Thread(target=_watch, name="zrun-hangup-watch", daemon=True).start()


def _terminate_self() -> None:
    # Repeat: a signal that lands while the elastic agent is still starting can be swallowed
    # by its retry loops; a later one reaches its handler once the ranks run.
    while True:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(2.0)


def _quiet_elastic_logs(verbose: bool) -> None:
    # The elastic agent logs every closing signal and failure table; zrun prints one line instead.
    # Records are still made at WARNING, and dropped: ExitClock reads the closing signals.
    level = logging.INFO if verbose else logging.WARNING
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher")):
            logger = logging.getLogger(name)
            logger.setLevel(level)
            if not verbose:
                logger.addFilter(_drop)


def _drop(_record: logging.LogRecord) -> bool:
    return False


def is_elastic(args: argparse.Namespace) -> bool:
    """Whether the node joins a dynamic (c10d) rendezvous: a node range or restarts."""
    return args.nnodes is not None or args.max_restarts > 0


def _launch_config(args: argparse.Namespace, work_dir: str) -> LaunchConfig:
    if is_elastic(args):
        return _elastic_launch_config(args, work_dir)
    return LaunchConfig(
        min_nodes=args.num_nodes,
        max_nodes=args.num_nodes,
        nproc_per_node=args.nproc_per_node,
        run_id=args.run_id,
        rdzv_backend="static",
        rdzv_endpoint=f"{args.master_addr}:{args.master_port}",
        rdzv_configs={"rank": args.node_rank, "timeout": args.rdzv_timeout},
        max_restarts=0,
        monitor_interval=0.1,
        shutdown_timeout=args.shutdown_timeout,
        # Elastic keeps its per-rank error files here; a default one would outlive the job.
        logs_specs=DefaultLogsSpecs(log_dir=work_dir),
    )


def _elastic_launch_config(args: argparse.Namespace, work_dir: str) -> LaunchConfig:
    # [Note: elastic rendezvous]
    min_nodes, max_nodes = node_range(args.nnodes, args.num_nodes)
    options = {"join_timeout": args.rdzv_timeout, **rendezvous_options(args.rdzv_conf)}
    if args.zrun_store:
        options["is_host"] = False
    return LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=args.nproc_per_node,
        run_id=args.run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=f"{args.master_addr}:{args.master_port}",
        rdzv_configs=options,
        max_restarts=args.max_restarts,
        monitor_interval=0.1,
        local_addr=args.local_addr or _reachable_name(args.node_name),
        shutdown_timeout=args.shutdown_timeout,
        logs_specs=DefaultLogsSpecs(log_dir=work_dir),
    )


def _reachable_name(node_name: str) -> str | None:
    """The node's name as other nodes may reach it (the MASTER_ADDR of a round it leads); None
    for a loopback name, so that torch uses this machine's FQDN."""
    lowered = node_name.lower()
    if lowered in ("localhost", "::1") or lowered.startswith("127."):
        return None
    return node_name


def report_success(args: argparse.Namespace) -> None:
    """Tell zrun (through the store it hosts) that this node's ranks succeeded; a zrun that is
    already gone is no error."""
    from torch.distributed import TCPStore

    with contextlib.suppress(Exception):
        store = TCPStore(
            args.master_addr, args.master_port, is_master=False, timeout=timedelta(seconds=10)
        )
        store.set(succeeded_key(args.run_id), args.node_name)


class ExitClock:
    """When each rank process of this node exited, to the microsecond, which ranks the elastic
    agent ended itself, and which ranks were stopped at each exit. [Note: the rank that failed
    first]

    The elastic agent stamps failures with a time of 1 s resolution and, once one rank fails,
    sends SIGTERM to the others, so a survivor it ended looks as failed as the rank that died
    (rank 1 SIGKILLed from outside, rank 0 then SIGTERMed by the agent: both within a second).
    The agent logs each closing signal it sends, to a rank still running, before sending it: a
    logging filter records those pids, and a rank the agent ended never failed first. Among the
    others the earliest exit failed first (a rank whose collective failed because its peer died
    exits after that peer). A thread finds the agent's children as they start, in every round
    of a job with restarts (each round's ranks are new processes); one thread per child waits
    on a pidfd, which becomes readable when the process exits and stays so once the agent has
    reaped it (waitid from a second thread lost that race on a loaded machine: the agent reaped
    the rank first, and its exit had no time), and records the moment. A rank whose peer stopped
    answering (SIGSTOP, a debugger) exits first, naming it ([Note: a rank that stops answering]
    in engine/comm/liveness.py): so at each exit the other children's state is read too, and
    those stopped then are named beside the rank that exited. Seeing the closing signals, the
    clock also holds the agent to --shutdown_timeout ([Note: the grace after a closing signal])
    and continues a stopped rank once it is ended ([Note: a stopped rank is continued once it
    is ended])."""

    # How often the agent's children are listed (psutil scans /proc): at 5 ms it took 20% of a
    # core for the whole job. A rank lives far longer than this; exits are timed by a waiter.
    _POLL_S = 0.05

    def __init__(self, num_ranks: int, grace_s: float | None = None):
        self.grace_s = grace_s  # --shutdown_timeout: see _kill_after_grace
        self.exited: dict[int, float] = {}  # pid -> time.monotonic() at exit
        self.stopped: set[int] = set()  # pids found stopped when another child exited
        self.ended_by_agent: set[int] = set()  # pids the agent sent a closing signal
        self._num_ranks = num_ranks
        self._children: dict[int, psutil.Process] = {}
        logging.getLogger(_ELASTIC_PROCESSES_LOGGER).addFilter(self._note_closing_signal)
        threading.Thread(target=self._find_children, daemon=True).start()

    def _note_closing_signal(self, record: logging.LogRecord) -> bool:
        """A logging filter that passes every record: records the pid of "Sending process %s
        closing signal %s" (the elastic agent, just before it signals a rank still running)."""
        if record.msg == _CLOSING_SIGNAL_MESSAGE and record.args:
            self.ended_by_agent.add(record.args[0])
            if self.grace_s is not None:
                with contextlib.suppress(psutil.Error):
                    rank = psutil.Process(record.args[0])
                    threading.Thread(
                        target=self._kill_after_grace, args=(rank,), daemon=True
                    ).start()
        return True

    def _kill_after_grace(self, rank: psutil.Process) -> None:
        """[Note: the grace after a closing signal] When a rank fails (and at each restart) the
        elastic agent gives the others its own default of 30 s between SIGTERM and SIGKILL,
        whatever --shutdown_timeout says: only an agent that is itself signalled uses it. So a
        rank the agent ended that still runs grace_s later is killed here, with its process group
        (the agent starts each rank as a session of its own), as the agent would."""
        time.sleep(self.grace_s)
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            # is_running compares creation times: never a later process given the same pid
            if rank.is_running() and rank.status() != psutil.STATUS_ZOMBIE:
                os.killpg(rank.pid, signal.SIGKILL)

    def _find_children(self) -> None:
        me = psutil.Process()
        while True:  # a daemon: every round's ranks are new children
            for child in me.children():
                # psutil.Process compares creation times too: a later round's rank may reuse
                # the pid of an earlier one, whose records are not its own
                if self._children.get(child.pid) != child:
                    self.exited.pop(child.pid, None)
                    self.stopped.discard(child.pid)
                    self.ended_by_agent.discard(child.pid)
                    self._children[child.pid] = child
                    threading.Thread(target=self._wait, args=(child.pid,), daemon=True).start()
            time.sleep(self._POLL_S)

    def _wait(self, pid: int) -> None:
        if not _wait_for_exit(pid):
            return  # reaped before it was watched: its exit time is unknown
        self.exited[pid] = time.monotonic()
        for other, process in list(self._children.items()):
            with contextlib.suppress(psutil.Error):
                if other not in self.exited and process.status() == psutil.STATUS_STOPPED:
                    self.stopped.add(other)
                    threading.Thread(
                        target=self._continue_ended, args=(other,), daemon=True
                    ).start()

    def _continue_ended(self, pid: int) -> None:
        """[Note: a stopped rank is continued once it is ended] The agent ends the other ranks
        with SIGTERM, which a stopped process receives only once continued: the agent waited its
        30 s grace and then SIGKILLed it, in every restart round. Once a SIGTERM is pending for
        `pid`, send it SIGCONT, as a shell's kill does for a stopped job; it then ends at once.
        Never before: a rank stopped while the job goes on stays stopped."""
        while pid not in self.exited:
            pending = _pending_signals(pid)
            if pending is None:
                return  # gone, or no /proc to read
            if pending & (1 << (signal.SIGTERM - 1)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                return
            time.sleep(self._POLL_S)


def _wait_for_exit(pid: int) -> bool:
    """Block until child `pid` has exited, leaving it for the elastic agent to reap; False when
    it was reaped already. A pidfd stays readable once the process is reaped (waitid from a
    second thread raced the agent's reap, and lost on a loaded machine); waitid(WNOWAIT) where
    there is no pidfd (Linux < 5.3, other systems)."""
    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except (AttributeError, OSError):
        try:
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            return False
        return True
    try:
        poller = select.poll()  # not select.select: the descriptor may be 1024 or more
        poller.register(handle, select.POLLIN)
        poller.poll()
    finally:
        os.close(handle)
    return True


def _pending_signals(pid: int) -> int | None:
    """The signals pending for process `pid` (bit N-1 for signal N; Linux's /proc), or None."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            fields = dict(line.split(":", 1) for line in handle if ":" in line)
    except OSError:
        return None
    return int(fields["ShdPnd"], 16) | int(fields["SigPnd"], 16)


def first_failure(error: ChildFailedError, args: argparse.Namespace, clock=None) -> RankFailure:
    """The failure to report from a ChildFailedError ([Note: the rank that failed first]): a
    rank the agent did not end itself before one it did, then the earliest exit on `clock` (an
    ExitClock); without a time, the earliest (1 s resolution) timestamp, then a rank that exited
    on its own before one killed by a signal, then the lowest rank."""
    exited = clock.exited if clock is not None else {}
    stopped = clock.stopped if clock is not None else set()
    ended = clock.ended_by_agent if clock is not None else set()
    rank, failure = min(
        error.failures.items(),
        key=lambda item: (
            item[1].pid in ended,
            exited.get(item[1].pid, float("inf")),
            item[1].timestamp,
            item[1].exitcode < 0,
            item[0],
        ),
    )
    frozen = tuple(sorted(r for r, f in error.failures.items() if f.pid in stopped and r != rank))
    return RankFailure(
        rank, failure.local_rank, args.node_rank, args.node_name, failure.exitcode, frozen
    )


def run_ranks(args: argparse.Namespace, work_dir: str) -> int:
    """Start, watch and end this node's ranks; returns the node's exit code.

    0 when every rank succeeded; the first failed rank's code (128 + N for a rank killed by
    signal N), after a one-line report on stderr; 128 + N when this agent received signal N.
    """
    # first: its filter must see what the next call drops
    clock = ExitClock(args.nproc_per_node, args.shutdown_timeout)
    _quiet_elastic_logs(args.verbose)
    command = rank_command(args, macros.local_rank)
    try:
        elastic_launch(_launch_config(args, work_dir), command[0])(*command[1:])
    except ChildFailedError as error:
        failure = first_failure(error, args, clock)
        print(f"zrun: {failure.describe()}{_restarts_note(args)}", file=sys.stderr, flush=True)
        return failure.process_exit_code
    except SignalException as error:
        return 128 + int(error.sigval)
    if args.zrun_store and is_elastic(args):
        report_success(args)
    return 0


def _restarts_note(args: argparse.Namespace) -> str:
    if not is_elastic(args):
        return ""
    if args.max_restarts == 0:
        return " (--max_restarts 0: no restart)"
    return f" after {args.max_restarts} restart(s), the limit (--max_restarts {args.max_restarts})"


def _raise_signal_exception(signum: int, _frame) -> None:
    raise SignalException(f"agent received {signal.Signals(signum).name}", signal.Signals(signum))


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m zero.launcher.agent``; returns the node's exit code.

    Raises:
        ValueError: --nproc_per_node or --num_nodes < 1, a malformed --nnodes, --max_restarts
            < 0, a node rank that cannot be resolved
            (see resolve_node), or --log_dir that cannot be created.
    """
    args = build_parser().parse_args(argv)
    resolve_node(args)
    if args.nproc_per_node < 1 or args.num_nodes < 1:
        raise ValueError(
            f"--nproc_per_node and --num_nodes must be >= 1, got {args.nproc_per_node} "
            f"and {args.num_nodes}"
        )
    node_range(args.nnodes, args.num_nodes)  # a bad range fails before anything starts
    if args.max_restarts < 0:
        raise ValueError(f"--max_restarts must be >= 0, got {args.max_restarts}")
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
    work_dir = tempfile.mkdtemp(prefix="zrun-agent-")
    try:
        # Until the elastic agent installs its own handlers, a signal must still stop the launch.
        for signum in _HANDLED_SIGNALS:
            signal.signal(signum, _raise_signal_exception)
        configure_environment(args)
        become_subreaper()
        if args.exit_on_stdin_eof:
            watch_stdin_eof()
        if args.exit_on_hangup:
            watch_hangup()
        watch_parent(args.parent_pid)
        return run_ranks(args, work_dir)
    except SignalException as error:
        return 128 + int(error.sigval)
    except Exception as error:
        print(f"zrun: node {args.node_rank} '{args.node_name}': {error}", file=sys.stderr)
        if args.verbose:
            raise
        return 1
    finally:
        # A second Ctrl-C must not cut the sweep short and leave processes behind.
        for signum in _HANDLED_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        kill_descendants()
        shutil.rmtree(work_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
