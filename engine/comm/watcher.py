"""The exchange watcher: one daemon thread per process that waits for gloo's asynchronous
reduce-scatters, so a Handle's done() turns true without its caller waiting ([Note: watched
reduce-scatters]). Owns _Exchange, the works of one gloo collective waited together; the
Communicator (communicator.py) launches them. Imports nothing of zero.
"""

import os
import queue
import threading


class _Exchange:
    """The works of one gloo collective, waited together: the point-to-point sends and receives
    of an exchange ([Note: gloo exchanges] in communicator.py), whose `finish` (a reduce-scatter's
    sum) runs once they are done, or gloo's own work. Has the two methods Handle uses of torch's
    Work. A watched one ([Note: watched reduce-scatters]) is waited by the watcher thread; wait()
    then waits for that thread."""

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
