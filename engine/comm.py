"""Every collective zero issues, and the ledger that counts them.

This is the only module that calls torch.distributed collectives. Each call records how many
elements and bytes it moved per rank, in the paper's units (ZeRO, section 7): a reduce-scatter of
a buffer of n elements counts n, an all-gather into a buffer of n elements counts n, and an
all-reduce of n elements counts 2n (it is a reduce-scatter followed by an all-gather). Summed over
one optimizer step this gives 2 Psi for stages 0-2.

A Communicator with world size 1 performs the same operations locally (copies) without any
process group, so single-process runs take exactly the code path of multi-rank runs; nothing
crosses a network then, so nothing is counted.
"""

import logging
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

logger = logging.getLogger("zero")


@dataclass
class OpTotals:
    """Totals for one collective kind: calls, elements (paper units), bytes per rank, and
    seconds from launch to completion (only while timing is on, see Communicator.timing)."""

    calls: int = 0
    elements: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass
class CommLedger:
    """Per-step counters of collective traffic. `last_step` holds the previous optimizer step."""

    current: dict[str, OpTotals] = field(default_factory=dict)
    last_step: dict[str, OpTotals] = field(default_factory=dict)
    # While timing is on: seconds the caller waited for each collective kind in this step (a
    # synchronous collective's whole call, an asynchronous one's launch and wait()), i.e. the
    # communication that did not overlap compute (monitor.py, [Note: step-time breakdown]).
    waited: dict[str, float] = field(default_factory=dict)

    def record(self, op: str, elements: int, element_size: int) -> None:
        """Count one collective of `elements` (paper units) of `element_size` bytes each."""
        totals = self.current.setdefault(op, OpTotals())
        totals.calls += 1
        totals.elements += elements
        totals.bytes += elements * element_size

    def add_time(self, op: str, seconds: float, waited: float = 0.0) -> None:
        """Add the launch-to-completion and the waited seconds of one collective of kind `op`."""
        self.current.setdefault(op, OpTotals()).seconds += seconds
        self.waited[op] = self.waited.get(op, 0.0) + waited

    def end_step(self) -> None:
        """Close the optimizer step: its totals move to `last_step`, counting restarts at 0."""
        self.last_step, self.current = self.current, {}
        self.waited = {}


class Handle:
    """The pair of an asynchronous collective: `wait()` finishes it (idempotent)."""

    def __init__(self, work=None, on_done=None):
        self._work = work
        self._on_done = on_done  # timing: on_done(wait_start) once the collective has finished

    def wait(self) -> None:
        start = time.perf_counter()
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._on_done is not None:
            self._on_done(start)
            self._on_done = None


class Communicator:
    """Collectives over one data-parallel group, with traffic counting.

    Every method is a collective: all ranks of the group must call it in the same order with
    tensors of the same size and dtype. `group` None with world_size 1 means no process group.
    """

    def __init__(self, group, rank: int, world_size: int):
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.ledger = CommLedger()
        # [Note: collective timing] None = no timing; else the collective names whose `seconds`
        # are measured (an empty set: all). A collective's `seconds` run from its launch until
        # its wait() returns (for asynchronous ones this includes the compute it overlapped
        # with); on CUDA the wait synchronizes the device so the time is the transfer's, not the
        # launch's. The caller's waiting (ledger.waited, for wall_clock_breakdown) is measured
        # for every collective while timing is on.
        self.timing: frozenset | None = None
        self.verbose = False  # log every collective as it is issued

    def enable_timing(self, ops=(), verbose: bool = False) -> None:
        """Time collectives named in `ops` (all when empty) into the ledger's `seconds`, and
        every collective's waiting into `ledger.waited`."""
        self.timing = frozenset(ops)
        self.verbose = verbose

    def _record(self, op: str, elements: int, tensor: torch.Tensor) -> None:
        if self.world_size > 1:
            self.ledger.record(op, elements, tensor.element_size())
            if self.verbose:
                logger.info(
                    "rank %d: %s of %d elements (%s)", self.rank, op, elements, tensor.dtype
                )

    def _run(self, op: str, tensor: torch.Tensor, launch, async_op: bool) -> Handle:
        """Launch a collective (launch() returns torch's work or None) and time it if asked."""
        if self.timing is None:
            return Handle(launch())
        timed = not self.timing or op in self.timing
        start = time.perf_counter()
        work = launch()
        launching = time.perf_counter() - start  # a synchronous collective runs in here

        def done(wait_start: float) -> None:
            if tensor.is_cuda:
                torch.cuda.synchronize(tensor.device)
            end = time.perf_counter()
            seconds = end - start if timed else 0.0
            self.ledger.add_time(op, seconds, launching + end - wait_start)

        handle = Handle(work, on_done=done)
        if not async_op:
            handle.wait()
        return handle

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False) -> Handle:
        """Sum (op "sum") or maximum (op "max") of `tensor` over the group, in place."""
        self._record("all_reduce", 2 * tensor.numel(), tensor)
        if self.world_size == 1:
            return Handle()
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        return self._run(
            "all_reduce",
            tensor,
            lambda: dist.all_reduce(tensor, reduce_op, group=self.group, async_op=async_op),
            async_op,
        )

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
    ) -> Handle:
        """Sum `input` (world_size * n elements) over ranks; rank r receives slice r in `output`.

        `output` must hold n = input.numel() / world_size elements of input's dtype; it may be
        rank r's own slice of `input` (in-place reduce-scatter, as NCCL and gloo allow).
        """
        assert input.numel() == output.numel() * self.world_size, (input.shape, output.shape)
        self._record("reduce_scatter", input.numel(), input)
        if self.world_size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return Handle()
        return self._run(
            "reduce_scatter",
            input,
            lambda: dist.reduce_scatter_single(output, input, group=self.group, async_op=async_op),
            async_op,
        )

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
    ) -> Handle:
        """Concatenate every rank's `input` (n elements) into `output` (world_size * n elements).

        `input` may be rank r's own slice of `output` (in-place gather, no extra buffer).
        """
        assert output.numel() == input.numel() * self.world_size, (output.shape, input.shape)
        self._record("all_gather", output.numel(), output)
        if self.world_size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return Handle()
        return self._run(
            "all_gather",
            output,
            lambda: dist.all_gather_single(output, input, group=self.group, async_op=async_op),
            async_op,
        )

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Copy `tensor` from group rank `src` to every rank, in place."""
        self._record("broadcast", tensor.numel(), tensor)
        if self.world_size > 1:
            self._run(
                "broadcast",
                tensor,
                lambda: dist.broadcast(tensor, group_src=src, group=self.group),
                False,
            )

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)


# ----- model parallelism (ZeRO-R; used by engine/mpu.py) -----------------------------------
def new_group(ranks: list[int]):
    """A process group over `ranks` (ranks of the default group), for a Communicator.

    Collective over the default group: every rank must call it, with the same `ranks`, in the
    same order of calls, including ranks that are not members (torch.distributed's rule).
    """
    return dist.new_group(sorted(ranks))


# ----- end model parallelism ---------------------------------------------------------------


@dataclass(frozen=True)
class LaunchEnv:
    """Rank layout read from the launcher's environment (torchrun's variable names)."""

    rank: int
    local_rank: int
    world_size: int


def read_launch_env() -> LaunchEnv | None:
    """Read the rank layout a launcher set; None when not started by a launcher.

    The first set of variables present wins: RANK, WORLD_SIZE, LOCAL_RANK (zrun, torchrun);
    OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK (``mpirun python train.py``); SLURM_PROCID,
    SLURM_NTASKS, SLURM_LOCALID (``srun python train.py``). For the last two, unset rendezvous
    variables are filled in os.environ for the env:// rendezvous: MASTER_ADDR with the first host
    of SLURM_JOB_NODELIST (SLURM only; ``scontrol show hostnames`` when available), MASTER_PORT
    with 29500.

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
        os.environ.setdefault("MASTER_PORT", "29500")
    return LaunchEnv(values[rank_name], values[local_name], values[size_name])


def init_process_group(backend: str, env: LaunchEnv) -> None:
    """Initialize the default process group from MASTER_ADDR/MASTER_PORT (env:// rendezvous).

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
    dist.init_process_group(backend, rank=env.rank, world_size=env.world_size)


def data_parallel_comm(mpu=None, group=None) -> Communicator:
    """The Communicator of the data-parallel group: the mpu's, else `group`, else every rank (one
    rank when torch.distributed is not initialized)."""
    if mpu is not None:
        return Communicator(
            mpu.get_data_parallel_group(),
            mpu.get_data_parallel_rank(),
            mpu.get_data_parallel_world_size(),
        )
    if not (dist.is_available() and dist.is_initialized()):
        return Communicator(None, 0, 1)
    if group is not None:
        return Communicator(group, dist.get_rank(group), dist.get_world_size(group))
    return Communicator(None, dist.get_rank(), dist.get_world_size())
