"""The exchange watcher: one daemon thread per process that waits for gloo's asynchronous
reduce-scatters, so a Handle's done() turns true without its caller waiting ([Note: watched
reduce-scatters]). Owns _Exchange, the works of one gloo collective waited together; the
Communicator (communicator.py) launches them. Imports nothing of zero.
"""

import atexit
import os
import queue
import threading
import weakref


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
        self._last = lambda: None  # weak: the exchange handed over last (settled in order)
        self._thread = threading.Thread(target=self._run, name="zero-reduce-watcher", daemon=True)
        self._thread.start()

    def watch(self, exchange: _Exchange) -> _Exchange:
        exchange._settled = threading.Event()
        self._last = weakref.ref(exchange)
        self._queue.put(exchange)
        return exchange

    def _run(self) -> None:
        while (exchange := self._queue.get()) is not None:
            exchange.settle()
            del exchange  # no reference left to its buffers while the thread waits

    def stop(self) -> bool:
        """End the thread when it has nothing to wait for (returns True), else leave it (a
        collective a peer has not joined would keep the caller waiting)."""
        last = self._last()
        if last is not None and not last._settled.is_set():
            return False
        self._queue.put(None)
        self._thread.join()
        return True


_WATCHER: _ExchangeWatcher | None = None
_stopped_at_exit = False  # stop_watcher is registered with atexit


def _watcher() -> _ExchangeWatcher:
    """The process's watcher thread (made again in a forked child, which has no threads)."""
    global _WATCHER, _stopped_at_exit
    if _WATCHER is None or _WATCHER.pid != os.getpid():
        if not _stopped_at_exit:
            atexit.register(stop_watcher)
            _stopped_at_exit = True
        _WATCHER = _ExchangeWatcher()
    return _WATCHER


def stop_watcher() -> None:
    """Stop this process's watcher thread when it is idle ([Note: threads at exit] in
    groups.py): zero.comm.destroy_process_group and interpreter exit call it. The next watched
    reduce-scatter starts a new one. Not a collective."""
    global _WATCHER
    if _WATCHER is not None and _WATCHER.pid == os.getpid() and _WATCHER.stop():
        _WATCHER = None


def _started(exchange: _Exchange, async_op: bool) -> "_Exchange | None":
    """What launching a collective returns: its work when asynchronous, else None, finished."""
    if async_op:
        return exchange
    exchange.wait()
    return None
