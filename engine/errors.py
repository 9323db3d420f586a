"""Error helpers shared by every user-facing check (config, launcher, optimizer registry)."""

import difflib
from collections.abc import Iterable


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """Return " Did you mean 'x'?" for the closest candidate, or "" when nothing is close.

    Used to end error messages about unknown keys, option names and registry entries.
    """
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" Did you mean '{matches[0]}'?" if matches else ""


def listed(names: list, shown: int = 8) -> str:
    """The first `shown` names as a list, and how many more: a model's worth of keys in an error
    message is not one line."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{names[:shown]}{more}"
