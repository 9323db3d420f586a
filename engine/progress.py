"""Progress bars for long loops: a tqdm bar on rank 0 when a terminal is attached, nothing else.

Under CI, SLURM or a launcher that pipes output, stderr is not a terminal: a bar would only fill
the log with carriage returns, so it is off and the callers' own log lines are the record. The
decision lives here so training, checkpoint save/load and consolidation behave the same.
"""

import contextlib
import logging
import sys

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm


def bar_enabled(rank: int = 0, stream=None) -> bool:
    """True on rank 0 when `stream` (default sys.stderr, where tqdm writes) is a terminal."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return rank == 0 and callable(isatty) and isatty()


def progress(iterable=None, desc: str = "", total: int | None = None, rank: int = 0, **kwargs):
    """tqdm over `iterable` (or a manual bar when it is None, advanced with update()); disabled,
    a plain pass-through without any output, unless bar_enabled(rank). `kwargs` go to tqdm
    (unit, leave, ...); bars of inner loops default to leave=False so they vanish when done."""
    kwargs.setdefault("leave", False)
    kwargs.setdefault("dynamic_ncols", True)
    return tqdm(iterable, desc=desc, total=total, disable=not bar_enabled(rank), **kwargs)


def redirect_logs(enabled: bool):
    """While a bar is shown (`enabled`), the "zero" logger's console lines (the engine's step
    log) are written through tqdm so they do not break the bar; otherwise nothing changes."""
    if not enabled:
        return contextlib.nullcontext()
    return logging_redirect_tqdm(loggers=[logging.getLogger("zero")])
