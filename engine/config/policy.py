"""What load_config does with a key the schema does not know: the key policy.

Owns `KeyPolicy`, the process's current policy (`use_key_policy`, `current_key_policy`) and
the one warning per ignored key. zero's own API keeps `STRICT`: an unknown key is a ConfigError
with a "did you mean" hint (a typo'd key that changes nothing would otherwise pass without a
word). The DeepSpeed doorway (zero.integrations.deepspeed) installs DeepSpeed's policy, under
which a config DeepSpeed 0.19.8 accepts is accepted: an unknown key outside the blocks
DeepSpeed validates strictly is dropped, with one warning naming the key, the nearest known
key and the fix; inside those blocks it stays an error, as in DeepSpeed.

[Note: why the policy is process-wide]
A DeepSpeed program reaches load_config through many doors (deepspeed.initialize,
DeepSpeedConfig, zero.Init's config, Accelerate's and Transformers' integrations), none of which
can be told which API the program was written for. What says so is the process: under
zero-as-deepspeed, `import deepspeed` installs the doorway, and the doorway sets the policy
once. A program that imports zero itself and never the doorway keeps STRICT.
"""

import warnings
from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import did_you_mean
from .deepspeed_keys import _caller_stacklevel

__all__ = ["STRICT", "KeyPolicy", "current_key_policy", "use_key_policy"]


@dataclass(frozen=True)
class KeyPolicy:
    """How load_config treats keys the schema does not know.

    ignore_unknown: False: every unknown key is a ConfigError (zero's API). True: an unknown
        key is dropped with one UserWarning per dotted key per process, unless it lies in one
        of `strict_blocks`.
    strict_blocks: dotted blocks ("zero_optimization", "timers.throughput") whose unknown keys,
        at any depth below them, stay ConfigErrors when ignore_unknown is True.
    follows: who the policy follows, named in the warning ("DeepSpeed 0.19.8").
    """

    ignore_unknown: bool = False
    strict_blocks: tuple[str, ...] = ()
    follows: str = "zero"

    def ignores(self, loc: tuple) -> bool:
        """Whether the unknown key at `loc` (its path of names, as pydantic gives it: a
        top-level key named "a.b" is ("a.b",), not ("a", "b")) is dropped (True) or an error."""
        if not self.ignore_unknown:
            return False
        block = tuple(str(part) for part in loc[:-1])
        return not any(block[: len(s)] == s for s in self._strict_paths)

    @property
    def _strict_paths(self) -> list[tuple[str, ...]]:
        return [tuple(s.split(".")) for s in self.strict_blocks]


STRICT = KeyPolicy()

_current = STRICT
_warned: set[str] = set()


def use_key_policy(policy: KeyPolicy) -> None:
    """Make `policy` the one load_config uses from now on in this process ([Note: why the
    policy is process-wide]). Not a collective; every rank of a job sets its own."""
    global _current
    if not isinstance(policy, KeyPolicy):
        raise TypeError(f"use_key_policy needs a KeyPolicy, got {type(policy).__name__}")
    _current = policy


def current_key_policy() -> KeyPolicy:
    """The policy load_config uses when it is given none (STRICT unless the doorway set one)."""
    return _current


def warn_ignored(loc: tuple, known: Iterable[str], where: str, policy: KeyPolicy) -> None:
    """One UserWarning per process for the ignored key at `loc` (as in KeyPolicy.ignores),
    naming the nearest of the `known` keys of its block and the fix."""
    key = ".".join(str(part) for part in loc)
    if key in _warned:
        return
    _warned.add(key)
    name = str(loc[-1])
    if "." in name:
        head, _, rest = name.partition(".")
        hint = (
            f" A key whose name holds dots is not the nested key {name}: write it nested "
            f"({head}: {{{rest}: ...}}) for it to count."
        )
    else:
        hint = did_you_mean(name, known)
    warnings.warn(
        f"{where}'{key}' is not a key {policy.follows} reads there: it is ignored, as "
        f"{policy.follows} ignores it.{hint} Remove it, or correct its name if it was meant "
        "to change the run.",
        UserWarning,
        stacklevel=_caller_stacklevel(),
    )
