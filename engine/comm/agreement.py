"""Cross-rank agreement: before collectives whose order depends on the user's code, every
rank says what it is about to do, and every rank raises RankMismatchError when any differs or
does not arrive ([Note: agreement across ranks]). Owns Intent, METHODS, Agreement, PendingCheck
and the words for intents and their fixes. Imports groups.py (the agreement's own group).
"""

import enum
import weakref

import torch
import torch.distributed as dist

from .groups import _SIDE_GROUPS, _agreement_store, _side_group
from .liveness import Heartbeat


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
    "engine.zero_grad() after a failed engine.backward()",
    "zero.GatheredParameters (exit, modifier_rank=None)",
)


class RankMismatchError(RuntimeError):
    """Ranks disagreed about the next collective, or some did not arrive in time. Raised on
    every rank of the group."""


# Every Agreement made, while its engine lives: destroy_process_group's last check runs on them.
_AGREEMENTS: "weakref.WeakSet[Agreement]" = weakref.WeakSet()


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

    [Note: the agreement timeout]
    A rank waits `agreement_timeout` seconds (config; 300 by default) for the others. The
    wait is long on purpose: between two checks ranks legitimately drift apart by minutes (rank
    0 alone writing a large file or computing metrics, a slow data loader, a first step that
    compiles), and a shorter default would stop healthy jobs. A rank whose process ended is
    noticed at once instead, through the group's closed connections, and one that made a
    different checked call is met by the others' checks at once. What could leave a rank waiting
    out the timeout in normal use is kept from happening: transformers' decoding loop, whose
    ranks finish at different steps, runs with synced_gpus=True (engine.generate), or raises on
    every rank before its first all-gather when it does not ([Note: generation] in
    partition/usage_guard.py); state_dict() inside zero.GatheredParameters, which one rank calls
    alone to save an adapter, communicates nothing. A check that times out before a stage-3
    all-gather says how a rank leaves such a loop early.

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
        if self._store is not None and self.world_size > 1 and self.group.heartbeat is None:
            # [Note: a rank that stops answering] in liveness.py; one per group, stopped with it
            # (the heartbeat names global ranks: `rank` is this rank's place in `ranks`)
            self.group.heartbeat = Heartbeat(self._store, ranks, ranks[rank], timeout_s)
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

    def enter(self, method: str, arguments: int = 0, value: float = 0.0) -> float:
        """Every rank enters collective method `method` (one of METHODS) together, with equal
        `arguments` (a hash of what must agree, such as the parameters it gathers); else every
        rank raises within the timeout, naming the ranks that did not arrive. Returns the sum
        of every rank's `value` (float64, in rank order), which may differ. Collective."""
        calls = self._calls[method] = self._calls.get(method, 0) + 1
        if self._store is not None:
            self._store.set(f"{method}/{calls}/{self.rank}", "1")
            self._store.set(f"at/{self.rank}", f"{method} (call {calls})")
        try:
            doing = f"calls {method} (call {calls})"
            idents = [METHODS.index(method), arguments]
            return self._check_slots(Intent.METHOD, idents, doing, (method, calls), value)
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
            raise self._failure(doing, method, error, kind) from error
        return PendingCheck(self, work, every, doing, method, kind)

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

    def _failure(self, doing: str, method, error, kind=None) -> RankMismatchError:
        text = str(error)
        if "imed out" not in text and "imeout" not in text:
            return RankMismatchError(
                f"rank {self.rank}: another rank exited or failed while this rank waited for "
                f"the others before it {doing} ({text}); see that rank's error"
            )
        early = ""
        if kind == Intent.GATHER:
            early = (
                " A rank that stopped running forwards before the others (a decoding loop that "
                "ends at each rank's own end of sequence) leaves them waiting here: every rank "
                "must keep running forwards until all have finished, as generate(..., "
                "synced_gpus=True) does (engine.generate passes it)."
            )
        heartbeat = self.group.heartbeat
        silent = heartbeat.silent_ranks() if heartbeat is not None else []
        if silent:  # [Note: a rank that stops answering] in liveness.py
            return RankMismatchError(
                f"rank {self.rank}: waited {self.timeout_s:g} s for the other ranks before it "
                f"{doing}: ranks {silent} stopped answering (their heartbeat does not move): "
                "their processes are stopped (SIGSTOP, a debugger), hung with the interpreter "
                "locked, or their nodes are unreachable; find out why, or raise "
                "agreement_timeout if they only pause"
            )
        return RankMismatchError(
            f"rank {self.rank}: waited {self.timeout_s:g} s for the other ranks before it "
            f"{doing}: {self._whereabouts(method)}{early} Every rank must make the same "
            "collective calls in the same order; to wait longer, raise the config key "
            "agreement_timeout"
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

    def __init__(
        self, agreement: Agreement, work, every: torch.Tensor, doing: str, method, kind=None
    ):
        self.agreement, self.work, self.every = agreement, work, every
        self.doing, self.method, self.kind = doing, method, kind

    def finish(self) -> float:
        """Wait; raise RankMismatchError as Agreement.check() does; return the payload's sum.
        Idempotent."""
        if self.work is None:
            return self.total
        agreement = self.agreement
        try:
            self.work.wait()
        except RuntimeError as error:
            raise agreement._failure(self.doing, self.method, error, self.kind) from error
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
        "(see docs/stages.md); in generation, ranks whose sequences finish at different "
        "steps must keep running forwards until all have (generate(..., synced_gpus=True), "
        "which engine.generate passes)."
    )


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
