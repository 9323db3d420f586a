"""Placeholders: DeepSpeed names zero does not implement, importable, failing when used.

Owns `Placeholder`, the object the doorway serves for a name of DeepSpeed 0.19.8's public
surface (engine/integrations/deepspeed_catalog.json) that zero does not implement. A program
that only imports the name (DeepSpeedExamples' cifar10_deepspeed.py imports deepspeed.moe.utils
and never uses it) runs on; one that uses it stops at that line with one message naming the
DeepSpeed name and where to look (docs/migrating-from-deepspeed.md).

[Note: what counts as using a placeholder]
Calling it (a function call or a class instantiated), reading or setting an attribute, or
subclassing it raises; so does iterating it or using it as a number or a context manager (no
such method exists: Python's TypeError, naming the placeholder's repr). Keeping a reference,
printing it, comparing it by identity, hashing it, `x | None` in an annotation and isinstance /
issubclass checks do not: `isinstance(x, placeholder)` and `issubclass(C, placeholder)` are
False, since no object zero makes is an instance of a class it does not implement (transformers
and Lightning test `isinstance(optimizer, DeepSpeedCPUAdam)`-style before using anything).
Attribute reads raise AttributeError so hasattr() and getattr() with a default stay probes.
"""

import typing

__all__ = ["Placeholder", "is_placeholder"]


class Placeholder:
    """DeepSpeed's `name` (a dotted path, "deepspeed.moe.layer.MoE"), which zero does not
    implement: `message` says so and what to do. Raises NotImplementedError(message) when
    called and TypeError(message) when subclassed; AttributeError(message) for any attribute
    read or write ([Note: what counts as using a placeholder])."""

    __slots__ = ("_name", "_message")

    def __init__(self, name: str, message: str):
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_message", message)

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(self._message)

    def __getattr__(self, attribute: str):
        raise AttributeError(f"{self._message} (reading .{attribute})")

    def __setattr__(self, attribute: str, value) -> None:
        raise AttributeError(f"{self._message} (setting .{attribute})")

    def __mro_entries__(self, bases):
        raise TypeError(f"{self._message} (a class cannot derive from it)")

    def __instancecheck__(self, instance) -> bool:
        return False

    def __subclasscheck__(self, subclass) -> bool:
        return False

    def __or__(self, other):
        return typing.Union[self, other]  # noqa: UP007 (a placeholder has no | of its own)

    def __ror__(self, other):
        return typing.Union[other, self]  # noqa: UP007

    def __repr__(self) -> str:
        return f"<placeholder for DeepSpeed's {self._name}, which zero does not implement>"

    def __reduce__(self):
        raise TypeError(self._message)


def is_placeholder(value) -> bool:
    """True for a Placeholder (type(value) is checked: isinstance(value, Placeholder) is
    true too, but a placeholder passed as isinstance's second argument answers False)."""
    return type(value) is Placeholder
