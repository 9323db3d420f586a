"""Every collective zero issues, and the ledger that counts them.

This is the only module that calls torch.distributed collectives. Each call records how many
elements and bytes it moved per rank, in the paper's units (ZeRO, section 7): a reduce-scatter of
a buffer of n elements counts n, an all-gather into a buffer of n elements counts n, and an
all-reduce of n elements counts 2n (it is a reduce-scatter followed by an all-gather). Summed over
one optimizer step this gives 2 Psi for stages 0-2.

A Communicator with world size 1 performs the same operations locally (copies) without any
process group, so single-process runs take exactly the code path of multi-rank runs; nothing
crosses a network then, so nothing is counted.

The module's last section is DeepSpeed's deepspeed.comm for training scripts (`from zero import
comm as dist`): thin wrappers over torch.distributed whose traffic is the script's, not counted.
"""

import datetime
import enum
import gc
import logging
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as _c10d

logger = logging.getLogger("zero")


# torch 2.6 names these all_gather_into_tensor and reduce_scatter_tensor; newer torch calls them
# *_single and warns on the old names.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


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
    # Elements stage 3 did not all-gather in backward because their unit stayed gathered from its
    # forward ([Note: reuse distance] in partition/stage3.py): this step's, and the previous step's.
    kept: int = 0
    last_kept: int = 0
    # Elements stage 3 all-gathered for frozen parameters (not in Psi, which counts trainable
    # ones): this step's, and the previous step's. `kept` counts trainable units' elements only.
    frozen: int = 0
    last_frozen: int = 0

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
        self.last_kept, self.kept = self.kept, 0
        self.last_frozen, self.frozen = self.frozen, 0
        self.waited = {}


def wait_blocks_host(backend: str, on_cuda: bool) -> bool:
    """Whether waiting for a collective blocks the calling thread until every peer joined it.
    Only NCCL on CUDA tensors waits without blocking (the current stream waits instead); gloo
    blocks, on CUDA tensors too (it stages them through host memory on its worker threads), as
    when two ranks share one GPU over gloo."""
    return not (on_cuda and backend == "nccl")


class Handle:
    """The pair of an asynchronous collective: `wait()` finishes it (idempotent)."""

    def __init__(self, work=None, on_done=None, blocks_host=True):
        self._work = work
        self._on_done = on_done  # timing: on_done(wait_start) once the collective has finished
        # wait() blocks the calling thread (gloo on host tensors); NCCL's wait only makes the
        # current CUDA stream wait for the collective.
        self.blocks_host = blocks_host

    def done(self) -> bool:
        """True once the collective has finished (never blocks)."""
        return self._work is None or self._work.is_completed()

    def wait(self) -> None:
        start = time.perf_counter()
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._on_done is not None:
            self._on_done(start)
            self._on_done = None


class _Exchange:
    """The works of one gloo collective, waited together: the point-to-point sends and receives
    of an exchange ([Note: gloo exchanges]), whose `finish` (a reduce-scatter's sum) runs once they
    are done, or gloo's own work. Has the two methods Handle uses of torch's Work. A watched one
    ([Note: watched reduce-scatters]) is waited by the watcher thread; wait() then waits for
    that thread."""

    def __init__(self, works: list, finish=None):
        self._works = works
        self._finish = finish
        self._settled = None  # watched: set by the watcher once every work was waited
        self._error = None  # watched: what the watcher's wait raised

    def is_completed(self) -> bool:
        if self._settled is not None:
            return self._settled.is_set()
        return all(work.is_completed() for work in self._works)

    def wait(self) -> None:
        if self._settled is not None:
            self._settled.wait()
            if self._error is not None:
                raise self._error
        else:
            for work in self._works:
                work.wait()
        if self._finish is not None:
            self._finish()
            self._finish = None

    def settle(self) -> None:
        """Wait for every work (the watcher thread calls it; torch's wait releases the GIL)."""
        try:
            for work in self._works:
                work.wait()
        except BaseException as error:  # handed to the thread that waits for the exchange
            self._error = error
        finally:
            self._settled.set()


class _ExchangeWatcher:
    """[Note: watched reduce-scatters]
    gloo's works (its own reduce-scatter and the point-to-point sends and receives of an
    exchange) report is_completed() False until someone waits for them, even long after the data
    arrived. A caller that only reaps finished reduce-scatters (stage 3 never blocks on one
    during backward, [Note: two groups at stage 3] in partition/stages.py) therefore reaped none:
    every bucket's full-size gradient staging buffer (and an exchange's receive buffer) stayed
    alive until the end of backward, 1.5x the whole gradient on a 30-layer GPT. One daemon
    thread per process waits for the asynchronous gloo reduce-scatters in launch order and
    marks each done, so done() tells the truth and a bucket's buffers go as soon as its
    reduction is over. Only reduce-scatters are watched, in launch order: the thread's wait for
    one depends only on peers joining a collective this rank already launched, never on this
    rank's next step, so it cannot deadlock (an all-gather waited behind a reduce-scatter
    blocked on a peer could). The sum of an exchange still runs in the caller's thread."""

    def __init__(self):
        self.pid = os.getpid()
        self._queue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="zero-reduce-watcher", daemon=True)
        self._thread.start()

    def watch(self, exchange: _Exchange) -> _Exchange:
        exchange._settled = threading.Event()
        self._queue.put(exchange)
        return exchange

    def _run(self) -> None:
        while True:
            self._queue.get().settle()


_WATCHER: _ExchangeWatcher | None = None


def _watcher() -> _ExchangeWatcher:
    """The process's watcher thread (made again in a forked child, which has no threads)."""
    global _WATCHER
    if _WATCHER is None or _WATCHER.pid != os.getpid():
        _WATCHER = _ExchangeWatcher()
    return _WATCHER


def _started(exchange: _Exchange, async_op: bool) -> "_Exchange | None":
    """What launching a collective returns: its work when asynchronous, else None, finished."""
    if async_op:
        return exchange
    exchange.wait()
    return None


# The smallest per-peer slice, in bytes, that a gloo reduce-scatter or all-gather sends as a
# point-to-point exchange ([Note: gloo exchanges]); smaller ones use gloo's collectives.
_EXCHANGE_MIN_BYTES = 2 << 20

# Tags of the exchanges' point-to-point messages start here, above any a script plausibly
# uses for its own send/recv on the same group (torch's default tag is 0).
_EXCHANGE_TAG_BASE = 1 << 24


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
        self.agreement: Agreement | None = None  # set by start_agreement()
        self._siblings: list[Communicator] = []
        self._backend: str | None = None
        self._exchanges = 0  # [Note: gloo exchanges]: the tag of the next one

    def sibling(self, purpose: str, timeout_s: float | None = None) -> "Communicator":
        """A Communicator over the same ranks on a process group of its own (same backend),
        counting into this one's ledger, for collectives whose order relative to this group's
        may differ between ranks (stage 3's gradient reduce-scatters, [Note: two groups at
        stage 3] in partition/stages.py). It supports reduce_scatter() only. Collective over the
        group's ranks at the first call for `purpose`; cached after. `timeout_s`: how long a
        collective waits for the other ranks (default torch's)."""
        if self.world_size == 1:
            group = None
        else:
            group = _side_group(purpose, self._global_ranks(), None, timeout_s)
        other = Communicator(group, self.rank, self.world_size)
        other.ledger = self.ledger
        self._siblings.append(other)
        return other

    def start_agreement(self, timeout_s: float) -> "Agreement | None":
        """Check, before zero's collectives, that every rank is about to do the same thing
        (see [Note: agreement across ranks]). Collective at the first call per timeout."""
        if self.world_size > 1 and self.agreement is None:
            self.agreement = Agreement(self._global_ranks(), self.rank, timeout_s)
        return self.agreement

    def _global_ranks(self) -> list[int]:
        if self.group is None:
            return list(range(dist.get_world_size()))
        return dist.get_process_group_ranks(self.group)

    def enable_timing(self, ops=(), verbose: bool = False) -> None:
        """Time collectives named in `ops` (all when empty) into the ledger's `seconds`, and
        every collective's waiting into `ledger.waited`."""
        self.timing = frozenset(ops)
        self.verbose = verbose
        for other in self._siblings:
            other.timing, other.verbose = self.timing, verbose

    @property
    def backend(self) -> str:
        """The backend of this group's collectives ("nccl", "gloo"); "" without a group."""
        if self._backend is None:
            if isinstance(self.group, OwnGroup):
                self._backend = self.group.backend_name
            elif self.world_size > 1:
                self._backend = str(dist.get_backend(self.group))
            else:
                self._backend = ""
        return self._backend

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
            return Handle(launch(), blocks_host=wait_blocks_host(self.backend, tensor.is_cuda))
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

        handle = Handle(work, on_done=done, blocks_host=True)  # done() synchronizes
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
        if self._exchanges_on(input):
            launch = lambda: self._exchange_reduce_scatter(output, input, async_op)  # noqa: E731
        elif isinstance(self.group, OwnGroup):
            launch = lambda: self.group.reduce_scatter(output, input, async_op)  # noqa: E731
        else:
            launch = lambda: _reduce_scatter_single(  # noqa: E731
                output, input, group=self.group, async_op=async_op
            )
        if async_op and self.backend == "gloo" and not input.is_cuda:
            launch = self._watched(launch)
        return self._run("reduce_scatter", input, launch, async_op)

    def _watched(self, launch):
        """launch, with the work it returns waited for by the watcher thread ([Note: watched
        reduce-scatters])."""

        def start():
            work = launch()
            exchange = work if isinstance(work, _Exchange) else _Exchange([work])
            return _watcher().watch(exchange)

        return start

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
        if self._exchanges_on(output):
            launch = lambda: self._exchange_all_gather(output, input, async_op)  # noqa: E731
        else:
            launch = lambda: _all_gather_single(  # noqa: E731
                output, input, group=self.group, async_op=async_op
            )
        return self._run("all_gather", output, launch, async_op)

    # [Note: gloo exchanges]
    # gloo's reduce-scatter and all-gather stage through extra copies and run 3-4x slower than
    # its all-reduce of the same buffer (10.8M fp32 elements, 2 ranks: all-reduce 37 ms,
    # reduce-scatter 102 ms, all-gather 70 ms), which would make stages 1-3 pay more for half
    # the traffic. On gloo with host tensors zero therefore runs them as direct exchanges: every
    # rank posts, at once, a send of each peer's slice to that peer and a receive of each
    # peer's contribution (24 and 16 ms for the same buffer). The elements each rank sends are
    # the paper's: (N - 1)/N of the buffer, as a ring's. Each message costs a round trip before
    # its data moves, so below _EXCHANGE_MIN_BYTES per peer slice gloo's own are faster (2 ranks,
    # back to back: 500K-element buffers 3.5 ms exchanged vs 2.7 ms; 2M-element 4.6 vs 10 ms).
    # A reduce-scatter receives into a transient buffer of (N - 1) slices and sums when waited
    # for: this rank's slice first, then the peers' in rank order (a fixed order, so reruns are
    # bitwise equal). The messages of one exchange share a tag, one per exchange (ranks issue
    # zero's collectives in the same order), so concurrent exchanges never match each other's
    # messages. A handle must be waited for before its tensors are dropped (zero always does).
    # NCCL keeps its own collectives.
    def _exchanges_on(self, tensor: torch.Tensor) -> bool:
        slice_bytes = tensor.numel() // self.world_size * tensor.element_size()
        return self.backend == "gloo" and not tensor.is_cuda and slice_bytes >= _EXCHANGE_MIN_BYTES

    def _peer_group(self):
        """The torch ProcessGroup whose send/recv take this group's ranks."""
        if isinstance(self.group, OwnGroup):
            return self.group.backend
        return self.group if self.group is not None else _c10d._get_default_group()

    def _next_tag(self) -> int:
        self._exchanges = (self._exchanges + 1) % (1 << 20)
        return _EXCHANGE_TAG_BASE + self._exchanges

    def _exchange_reduce_scatter(self, output, input, async_op: bool):
        group, tag, n = self._peer_group(), self._next_tag(), output.numel()
        peers = [p for p in range(self.world_size) if p != self.rank]
        received = torch.empty((len(peers), n), dtype=input.dtype, device=input.device)
        # Receives are posted before sends, so no send waits for a receive not yet posted.
        works = [group.recv([received[i]], peer, tag) for i, peer in enumerate(peers)]
        works += [group.send([input[peer * n : (peer + 1) * n]], peer, tag) for peer in peers]
        own = input[self.rank * n : (self.rank + 1) * n]

        def finish() -> None:
            if output.data_ptr() != own.data_ptr():
                output.copy_(own)
            for row in received:
                output.add_(row)

        return _started(_Exchange(works, finish), async_op)

    def _exchange_all_gather(self, output, input, async_op: bool):
        group, tag, n = self._peer_group(), self._next_tag(), input.numel()
        own = output[self.rank * n : (self.rank + 1) * n]
        if own.data_ptr() != input.data_ptr():
            own.copy_(input)
        peers = [p for p in range(self.world_size) if p != self.rank]
        works = [group.recv([output[peer * n : (peer + 1) * n]], peer, tag) for peer in peers]
        works += [group.send([input], peer, tag) for peer in peers]
        return _started(_Exchange(works), async_op)

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


# ----- agreement across ranks ----------------------------------------------------------------
class Intent(enum.IntEnum):
    """What a rank is about to do, as exchanged by Agreement.check()."""

    LAYOUT = 1  # initialize: idents = (fingerprint of the model, config and layout,)
    GATHER = 2  # stage 3: idents = the fetch units about to be all-gathered, in order
    END_BACKWARD = 3  # the last collectives of a micro-batch's backward
    METHOD = 4  # a collective method: idents = (index in METHODS, hash of its arguments)
    STEP = 5  # engine.step() at the accumulation boundary (gradient norm, optimizer step)
    FINISH = 6  # zero.comm.destroy_process_group(): this rank makes no more collectives


# Collective methods, each checked on entry (Agreement.enter) so that one called on some ranks
# only ends in an error on every rank instead of a hang.
METHODS = (
    "save_checkpoint",
    "load_checkpoint",
    "save_16bit_model",
    "state_dict() (stage 3)",
    "zero.GatheredParameters (enter)",
    "zero.GatheredParameters (exit, modifier_rank broadcast)",
    "save_pretrained",
    "load_pretrained",
    "zero.utils.safe_get_full_* (an all-gather of one parameter)",
    "zero.utils.safe_set_full_* (every rank passes the same value)",
)


class RankMismatchError(RuntimeError):
    """Ranks disagreed about the next collective, or some did not arrive in time. Raised on
    every rank of the group."""


class Agreement:
    """Cross-rank agreement on what each rank does next.

    [Note: agreement across ranks]
    Every rank must issue zero's collectives in the same order with the same sizes. Where that
    depends on the user's code (which stage-3 units a forward runs, whether every rank calls
    save_checkpoint), a rank first says what it is about to do: check() all-gathers a few
    int64 on a gloo process group of its own, with a timeout (`agreement_timeout`): the kind of
    intent, which engine, up to SLOTS - 3 idents (unit indices, a method and a hash of its
    arguments, a fingerprint) and a float64 payload (check_and_sum). Every rank then holds
    every rank's intent; if any differs from rank 0's, every rank raises RankMismatchError
    naming rank 0's intent and the first differing rank's, before any collective that differs
    was issued (a wrong value or a hang never follows).
    The group is separate from the data collectives' so a check never queues behind an
    asynchronous all-gather, and on CUDA it runs on the host without synchronizing the device.
    A rank that does not arrive within the timeout (it skipped a collective method, or it
    exited) makes the others raise, naming the ranks missing from a collective method (each
    rank records its arrival in the rendezvous store) or the method another rank waits in.

    `describe(kind, ident)` and `hint(a, b)` (set by the owner) turn intents into words.
    Collective: every rank of the group calls check() and enter() in the same order.
    """

    SLOTS = 16  # idents per check; longer lists take several checks

    def __init__(self, ranks: list[int], rank: int, timeout_s: float):
        self.rank = rank
        self.world_size = len(ranks)
        self.timeout_s = timeout_s
        self.group = _side_group("agreement", ranks, "gloo", timeout_s)
        self._store = _agreement_store(ranks)
        self._calls = self.group.method_calls  # shared by the engines over these ranks
        # Engines over the same ranks share the data group: which engine issues a collective is
        # part of every intent (engines are built collectively, so the count agrees).
        self.instance = self.group.agreements
        self.group.agreements += 1
        self.describe = describe_intent
        self.hint = lambda a, b: ""
        self.checks = 0  # checks made (for the cost figures in docs/performance.md)
        _AGREEMENTS.add(self)

    def check(self, kind: Intent, idents=(0,), doing: str | None = None, method=None) -> None:
        """Raise RankMismatchError on every rank unless all ranks call check() with the same
        `kind` and `idents` (ints >= 0). Blocks until every rank arrived or the
        timeout passed; `doing` says what this rank is about to do (default: describe()),
        `method` is (name, call number) inside enter(). Collective."""
        idents = list(idents) or [0]
        per_check = self.SLOTS - 3
        for start in range(0, len(idents), per_check):
            self._check_slots(kind, idents[start : start + per_check], doing, method)

    def check_and_sum(self, kind: Intent, value: float) -> float:
        """check(kind), carrying `value`: returns the sum of every rank's value, added in rank
        order in float64 (so bitwise the same on every rank). One collective serves both (the
        optimizer step's agreement and its gradient-norm sum). Collective."""
        return self._check_slots(kind, [0], None, None, value)

    def enter(self, method: str, arguments: int = 0) -> None:
        """Every rank enters collective method `method` (one of METHODS) together, with equal
        `arguments` (a hash of what must agree, such as the parameters it gathers); else every
        rank raises within the timeout, naming the ranks that did not arrive. Collective."""
        calls = self._calls[method] = self._calls.get(method, 0) + 1
        if self._store is not None:
            self._store.set(f"{method}/{calls}/{self.rank}", "1")
            self._store.set(f"at/{self.rank}", f"{method} (call {calls})")
        try:
            doing = f"calls {method} (call {calls})"
            idents = (METHODS.index(method), arguments)
            self.check(Intent.METHOD, idents, doing, (method, calls))
        finally:
            if self._store is not None:
                self._store.delete_key(f"at/{self.rank}")

    def start(self, kind: Intent, idents=(0,)) -> "PendingCheck":
        """check(kind, idents) without waiting (at most SLOTS - 3 idents): the exchange runs
        while the caller does what every agreeing rank also does; finish() waits and raises as
        check() does. Collective."""
        assert len(idents) <= self.SLOTS - 3, len(idents)
        return self._start(kind, list(idents), None, None)

    def _check_slots(self, kind: Intent, idents: list[int], doing, method, value=0.0) -> float:
        return self._start(kind, idents, doing, method, value).finish()

    def _start(self, kind, idents, doing, method, value=0.0) -> "PendingCheck":
        self.checks += 1
        values = [int(kind), self.instance + 1] + [i + 1 for i in idents]
        values += [0] * (self.SLOTS - 1 - len(values))
        mine = torch.tensor([*values, 0], dtype=torch.int64)
        mine[-1:].view(torch.float64).fill_(value)  # the last slot carries a float64 payload
        every = torch.empty(self.world_size * self.SLOTS, dtype=torch.int64)
        doing = doing or self.describe(int(kind), idents[0])
        try:
            work = self.group.all_gather(every, mine, async_op=True)
        except RuntimeError as error:
            raise self._failure(doing, method, error) from error
        return PendingCheck(self, work, every, doing, method)

    def _mismatch(self, row_0: list, other: int, row: list) -> str:
        """The message for rank 0's intent `row_0` against rank `other`'s `row`."""
        head = f"rank {self.rank}: ranks disagree on the next collective:"
        slot = next(j for j in range(self.SLOTS) if row[j] != row_0[j])
        if slot == 1:
            return (
                f"{head} rank 0 uses the engine of its zero.initialize call {row_0[1]}, while "
                f"rank {other} uses that of its call {row[1]}. Every rank must run the same "
                "engine at the same time (for example evaluate an EMA or teacher engine on "
                "every rank, not on some)."
            )
        if row_0[0] == row[0] == Intent.METHOD and slot > 2:
            return (
                f"{head} ranks 0 and {other} call {METHODS[row_0[2] - 1]} with different "
                "arguments (other parameters, state keys or values); every rank must pass the "
                "same ones."
            )
        slot = max(slot, 2)

        def intent(r):
            return r[0], r[slot] - 1 if r[slot] else None

        a, b = intent(row_0), intent(row)
        said_a = self.describe(*a) if a[1] is not None else "does nothing more here"
        said_b = self.describe(*b) if b[1] is not None else "does nothing more here"
        text = f"{head} rank 0 {said_a}, while rank {other} {said_b}."
        return " ".join(p for p in (text, self.hint(a, b) or _default_fix(a, b)) if p)

    def _failure(self, doing: str, method, error) -> RankMismatchError:
        text = str(error)
        if "imed out" not in text and "imeout" not in text:
            return RankMismatchError(
                f"rank {self.rank}: another rank exited or failed while this rank waited for "
                f"the others before it {doing} ({text}); see that rank's error"
            )
        return RankMismatchError(
            f"rank {self.rank}: waited {self.timeout_s:g} s for the other ranks before it "
            f"{doing}: {self._whereabouts(method)} Every rank must make the same collective "
            "calls in the same order; to wait longer, raise the config key agreement_timeout"
        )

    def _whereabouts(self, method) -> str:
        """Who is missing (inside a collective method) or where the others wait, from the
        arrivals enter() records in the rendezvous store."""
        if self._store is None:
            return "some ranks did not arrive."
        if method is not None:
            name, calls = method
            ranks = range(self.world_size)
            missing = [r for r in ranks if not self._store.check([f"{name}/{calls}/{r}"])]
            if missing:
                return f"ranks {missing} did not call {name}."
        elsewhere = []
        for r in range(self.world_size):
            if r != self.rank and self._store.check([f"at/{r}"]):
                where = self._store.get(f"at/{r}").decode()
                elsewhere.append(f"rank {r} waits in {where}, which this rank did not call")
        return ("; ".join(elsewhere) + ".") if elsewhere else "some ranks did not arrive."


class PendingCheck:
    """An Agreement check in flight (Agreement.start)."""

    def __init__(self, agreement: Agreement, work, every: torch.Tensor, doing: str, method):
        self.agreement, self.work, self.every = agreement, work, every
        self.doing, self.method = doing, method

    def finish(self) -> float:
        """Wait; raise RankMismatchError as Agreement.check() does; return the payload's sum.
        Idempotent."""
        if self.work is None:
            return self.total
        agreement = self.agreement
        try:
            self.work.wait()
        except RuntimeError as error:
            raise agreement._failure(self.doing, self.method, error) from error
        every = self.every.view(agreement.world_size, agreement.SLOTS)
        rows = every[:, :-1].tolist()
        other = next((r for r, row in enumerate(rows) if row != rows[0]), None)
        if other is not None:
            raise RankMismatchError(agreement._mismatch(rows[0], other, rows[other]))
        self.work = None
        self.total = sum(every[:, -1:].contiguous().view(torch.float64).view(-1).tolist())
        return self.total


def describe_intent(kind: int, ident: int) -> str:
    """Words for an intent (Intent kind, ident) that need no model."""
    if kind == Intent.METHOD:
        return f"calls {METHODS[ident]}"
    if kind == Intent.END_BACKWARD:
        return "ends a backward (engine.backward)"
    if kind == Intent.STEP:
        return "steps the optimizer (engine.step)"
    if kind == Intent.FINISH:
        return "ends its run (zero.comm.destroy_process_group)"
    if kind == Intent.LAYOUT:
        return f"built a model whose parameters, layout and config hash to {ident:#x}"
    return f"all-gathers stage-3 unit {ident}"


def _default_fix(a, b) -> str:
    kinds = {a[0], b[0]}
    if Intent.FINISH in kinds:
        return (
            "Every rank must make the same calls before it ends: as many micro-batches "
            "(engine.backward) and steps, and the same collective methods. A rank with fewer "
            "batches (an uneven data shard, a `break` or `continue` on some ranks) ends while "
            "the others still train; give every rank the same number of batches (a "
            "DistributedSampler, drop_last)."
        )
    if Intent.LAYOUT in kinds:
        return (
            "Every rank must build the same model (same parameter names, shapes, dtypes and "
            "requires_grad) and pass the same config and optimizer (type and "
            "hyper-parameters) to zero.initialize."
        )
    if Intent.METHOD in kinds:
        return (
            "Collective methods (save_checkpoint, load_checkpoint, save_16bit_model, "
            "state_dict under stage 3, zero.GatheredParameters, zero.utils.safe_get_full_* and "
            "safe_set_full_*) must be called on every rank, not under `if rank == 0`."
        )
    return (
        "Under ZeRO stage 3 every rank must run the same modules in the same order "
        "(see docs/stages.md)."
    )


# Process groups zero creates beside the data-parallel group: creating one is collective and
# costs sockets, so engines over the same ranks share them, as long as the default group they
# were made under is the current one. That group is held by a weak reference: a strong one
# would keep it alive after destroy_process_group(), and its gloo worker threads, still
# running when the interpreter shuts down, then abort the finished process when they free a
# collective's tensors ("terminate called without an active exception").
_SIDE_GROUPS: dict[tuple, tuple[weakref.ref, "OwnGroup"]] = {}
# Every Agreement made, while its engine lives: destroy_process_group's last check runs on them.
_AGREEMENTS: "weakref.WeakSet[Agreement]" = weakref.WeakSet()


def _current_agreements() -> list:
    """One live Agreement per agreement group of the current default group (the first engine's),
    in the order of the groups' ranks, which every member computes alike."""
    default = dist.distributed_c10d._get_default_group()
    current = {id(group) for ref, group in _SIDE_GROUPS.values() if ref() is default}
    first = {}
    for agreement in _AGREEMENTS:
        if id(agreement.group) in current:
            known = first.get(id(agreement.group))
            if known is None or agreement.instance < known.instance:
                first[id(agreement.group)] = agreement
    return sorted(first.values(), key=lambda a: a.group.ranks)


def _side_group(purpose: str, ranks: list[int], backend, timeout_s) -> "OwnGroup":
    default = dist.distributed_c10d._get_default_group()
    key = (purpose, tuple(ranks), timeout_s)
    if key not in _SIDE_GROUPS or _SIDE_GROUPS[key][0]() is not default:
        _SIDE_GROUPS[key] = weakref.ref(default), OwnGroup(purpose, ranks, backend, timeout_s)
    return _SIDE_GROUPS[key][1]


class OwnGroup:
    """A process group over `ranks` (global ranks, this rank among them) that zero creates for
    itself, outside torch's registry of groups: torch names the groups it creates by how many
    exist on the creating rank, so a group created later on some ranks only (an engine over a
    data-parallel subgroup while other ranks idle) would get different names on different
    ranks and never connect. This one meets in the rendezvous store under a name made of
    `purpose` and the ranks. Backend: `backend`, else the default group's. Only its members
    construct it (collective among them)."""

    def __init__(self, purpose: str, ranks: list[int], backend=None, timeout_s=None):
        store = dist.PrefixStore(
            f"zero-group/{purpose}/{'-'.join(map(str, ranks))}/{timeout_s}/",
            dist.distributed_c10d._get_default_store(),
        )
        timeout = (
            dist.constants.default_pg_timeout
            if timeout_s is None
            else datetime.timedelta(seconds=timeout_s)
        )
        self.ranks = list(ranks)
        self.method_calls: dict[str, int] = {}  # Agreement.enter's count per method
        self.agreements = 0  # Agreements (engines) created over this group
        rank, size = ranks.index(dist.get_rank()), len(ranks)
        backend = backend or dist.get_backend()
        self.backend_name = str(backend)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = False
            options._timeout = timeout
            self.backend = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            self.backend = dist.ProcessGroupGloo(store, rank, size, timeout=timeout)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        work = self.backend._allgather_base(output, input, _c10d.AllgatherOptions())
        return work if async_op else work.wait()

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
        work = self.backend._reduce_scatter_base(output, input, dist.ReduceScatterOptions())
        return work if async_op else work.wait()


def _agreement_store(ranks: list[int]):
    """The rendezvous store, where ranks record the collective methods they entered (None when
    torch does not expose it)."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
    return dist.PrefixStore(f"zero-agreement/{ranks[0]}-{len(ranks)}/", store)


# ----- model parallelism (ZeRO-R; used by model_parallel/mpu.py) ----------------------------
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
    dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, **options)


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


# ----- zero.comm as deepspeed.comm ---------------------------------------------------------
# Thin wrappers over torch.distributed under DeepSpeed's deepspeed.comm names, for training
# scripts (`from zero import comm as dist`). They are the script's own traffic: none of them is
# counted in an engine's ledger (engine.comm_stats() counts zero's collectives only).
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
    after torch's teardown the call sleeps 0.2 s without the GIL, so that gloo's worker threads
    finish freeing the collectives' tensors before the interpreter shuts down: a worker that
    frees a Python-owned tensor during shutdown cannot take the GIL and aborts the finished
    process ("terminate called without an active exception"; seen in about 1 run in 8 of a
    2-rank script ending with barrier and destroy)."""
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
    dist.destroy_process_group(group)
    if default:
        time.sleep(0.2)


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
