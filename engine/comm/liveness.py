"""Liveness: a rank that stops answering ends the job within the agreement timeout, named.

[Note: a rank that stops answering]
A rank whose process is stopped (SIGSTOP, a debugger, a node swapped out) holds no socket
closed and raises nothing: its peers wait inside a data collective (a gradient reduce-scatter,
a parameter all-gather) whose timeout is the process group's (gloo: 30 minutes), and the
launcher, seeing no exit, blames nobody or the rank that finally gives up. So every rank of
an agreement group runs a Heartbeat: a daemon thread that adds 1 to its own counter in the
rendezvous store every `period` seconds and reads the counter of the next rank of the group
(a ring: each rank is watched by exactly one other, O(world size) store operations per period
in all). A stopped process stops its thread too, so when the watched counter has not moved for
agreement_timeout seconds, the watcher writes one line naming that rank to stderr and ends its
own process (os._exit: its main thread may be blocked in a collective that cannot be
interrupted); the launcher then ends the job, or restarts it, and names the stopped rank
(launcher/agent.py). A rank that leaves normally (its group closed) first marks itself done, so
it is never reported. A store operation on a store whose host is stopped (rank 0's process,
under env://) never returns, whatever the client's timeout: so every operation runs in a
short-lived thread of its own and is given up after agreement_timeout, which ends this rank
naming the store and its host.
A busy rank keeps beating: its thread needs only the GIL now and then.
"""

import contextlib
import datetime
import os
import sys
import threading
import time

import torch.distributed as dist

_MAX_PERIOD_S = 5.0


class Heartbeat:
    """Beats for `rank` (a global rank) in `store` and watches the next rank of `ranks`; see
    [Note: a rank that stops answering]. stop() ends it (and marks this rank done). Not a
    collective; starting one on some ranks only leaves those unwatched."""

    def __init__(self, store, ranks: list[int], rank: int, timeout_s: float):
        self.store, self.where = _own_client(store, timeout_s)
        self.rank, self.timeout_s, self.ranks = rank, timeout_s, list(ranks)
        position = ranks.index(rank)
        self.peer = ranks[(position + 1) % len(ranks)]
        self.period = min(_MAX_PERIOD_S, timeout_s / 5)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zero-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Mark this rank done (its peer stops watching it) and end the thread."""
        if self._stop.is_set():
            return
        self._stop.set()
        # The store's host may be gone or stopped already: then nobody is left to watch us.
        _timed(lambda: self.store.add(f"done/{self.rank}", 1), self.period)
        self._thread.join(timeout=self.period + 1)

    def silent_ranks(self) -> list[int]:
        """The other ranks whose counter does not move within one period (and that did not
        leave normally): for a timeout's message. Waits one period; [] when the store fails."""
        others = [r for r in self.ranks if r != self.rank]

        def read():
            return [
                (self.store.add(f"beat/{r}", 0), self.store.add(f"done/{r}", 0)) for r in others
            ]

        before = _timed(read, self.timeout_s)
        time.sleep(self.period * 1.5)
        after = _timed(read, self.timeout_s)
        if before is None or after is None:
            return []
        return [r for r, a, b in zip(others, before, after) if a == b and not b[1]]

    def _run(self) -> None:
        seen, since = None, time.monotonic()
        while not self._stop.wait(self.period):
            found = _timed(self._beat, self.timeout_s)
            if self._stop.is_set():
                return
            if found is None:
                _end(self.rank, f"the rendezvous store at {self.where}", self.timeout_s)
            beats, done = found
            if beats == seen and done:
                return  # the peer left normally
            now = time.monotonic()
            if beats != seen:
                seen, since = beats, now
            elif now - since > self.timeout_s:
                _end(self.rank, f"rank {self.peer}", self.timeout_s)

    def _beat(self) -> tuple[int, int]:
        """Add 1 to this rank's counter; the peer's counter and whether it left."""
        self.store.add(f"beat/{self.rank}", 1)
        return self.store.add(f"beat/{self.peer}", 0), self.store.add(f"done/{self.peer}", 0)


def _timed(call, timeout_s: float):
    """call()'s result, or None when it raised or did not return within timeout_s (it goes on
    in a daemon thread, which the process's end takes with it)."""
    out = []

    def run():
        with contextlib.suppress(Exception):
            out.append(call())

    thread = threading.Thread(target=run, name="zero-heartbeat-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return out[0] if out else None


def _own_client(store, timeout_s: float):
    """(a client of the default TCPStore of its own, its "host:port"), so that a heartbeat never
    queues behind another thread's store operation; `store` itself when the default store is no
    TCPStore."""
    try:
        base = dist.distributed_c10d._get_default_store()
        while isinstance(base, dist.PrefixStore):
            base = base.underlying_store
        if not isinstance(base, dist.TCPStore):
            return store, "the job's rendezvous"
        client = dist.TCPStore(
            base.host,
            base.port,
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
        where = f"{base.host}:{base.port} (under env://, rank 0's process serves it)"
        return dist.PrefixStore("zero-heartbeat/", client), where
    except Exception:  # a store torch does not expose
        return store, "the job's rendezvous"


def _end(rank: int, who: str, timeout_s: float | None) -> None:
    """Say which rank stopped answering, then end this process ([Note: a rank that stops
    answering])."""
    how_long = f" for over {timeout_s:g} s (agreement_timeout)" if timeout_s is not None else ""
    print(
        f"[zero rank {rank}] rank {rank}: {who} stopped answering{how_long}: its process is "
        "stopped (SIGSTOP, a debugger), hung with the interpreter locked, or its node is "
        f"unreachable. Ending rank {rank} so that the launcher ends or restarts the job (a rank "
        "waiting in a collective cannot be woken); find out why that rank stopped, or raise "
        "agreement_timeout if it only pauses",
        file=sys.stderr,
        flush=True,
    )
    os._exit(1)
