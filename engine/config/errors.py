"""How config problems are reported: ``ConfigError`` and the text of its messages.

Owns the exception every loading step raises, how a value is shown in a message (``_show``),
the pydantic errors the blocks' validators raise for cross-field rules and for DeepSpeed values
zero does not implement (``_cross``; ``_refused``, ``_not_implemented``: a
``ConfigNotImplementedError``), and the translation of pydantic's ``ValidationError`` into
one message naming each dotted key, the bad value, the field's description and a "did you mean"
hint (``_describe``).
"""

import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from ..errors import did_you_mean
from .values import _thaw


class ConfigError(ValueError):
    """A problem with user-supplied configuration.

    The message names the dotted key (e.g. ``zero_optimization.reduce_bucket_size``), the bad
    value and how to fix it, and starts with the file name when the config came from a file.
    """


class ConfigNotImplementedError(ConfigError, NotImplementedError):
    """A valid DeepSpeed setting that zero does not implement and that would change what is
    trained if ignored (ZeRO++, torch_autocast, ...): both a
    ``ConfigError`` and a ``NotImplementedError``. Raised when every problem found is one."""


def _show(value: Any, limit: int = 200) -> str:
    """``value`` as JSON (repr if it is not JSON), cut to ``limit`` characters."""
    try:
        text = json.dumps(_thaw(value))
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _cross(message: str) -> PydanticCustomError:
    """A cross-field rule violation; the message already names every dotted key involved."""
    return PydanticCustomError("cross_field", message)


_NOT_IMPLEMENTED = "not_implemented"  # the pydantic error type of _not_implemented


def _not_implemented(message: str) -> PydanticCustomError:
    """A valid setting zero does not implement (ConfigNotImplementedError); the message names
    every dotted key involved and the fix."""
    return PydanticCustomError(_NOT_IMPLEMENTED, message)


def _refused(key: str, value: Any, why: str, default: Any) -> PydanticCustomError:
    """A DeepSpeed key set to a value zero does not implement, where ignoring it would change what
    the run is: one message naming the key, the value, why, and the fix."""
    return _not_implemented(
        f"{key} = {_show(value)}: {why} Remove the key or set it to the default "
        f"({key.rsplit('.', 1)[-1]}: {_show(default)})."
    )


def _walk(
    schema: type[BaseModel], loc: tuple[Any, ...]
) -> tuple[type[BaseModel] | None, FieldInfo | None]:
    """Follow ``loc`` through ``schema`` (the top-level model, ``Config``): (model holding the last
    key, that key's FieldInfo)."""
    model: type[BaseModel] | None = schema
    info: FieldInfo | None = None
    for i, part in enumerate(loc):
        if model is None or part not in model.model_fields:
            return (model if i == len(loc) - 1 else None), None
        info = model.model_fields[part]
        if i == len(loc) - 1:
            return model, info
        model = _model_of(info.annotation)
    return model, info


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _describe_one(error: Mapping[str, Any], schema: type[BaseModel]) -> str:
    loc = tuple(error["loc"])
    key = ".".join(str(p) for p in loc)
    kind = error["type"]
    if kind in ("cross_field", _NOT_IMPLEMENTED):
        return error["msg"]
    if kind == "extra_forbidden":
        model, _ = _walk(schema, loc)
        names = list(model.model_fields) if model is not None else []
        hint = did_you_mean(str(loc[-1]), names)
        if not hint and names:
            hint = " Valid keys here: " + ", ".join(names) + "."
        return f"unknown key '{key}'.{hint}"
    if kind == "missing":
        _, info = _walk(schema, loc)
        about = f" ({info.description})" if info is not None and info.description else ""
        return f"missing key '{key}'{about}; add it."
    reason = str(error["msg"])
    if reason.startswith("Value error, "):
        reason = reason[len("Value error, ") :]
    _, info = _walk(schema, loc)
    about = f" ('{loc[-1]}': {info.description})" if info is not None and info.description else ""
    return f"invalid value for '{key}': {_show(error.get('input'))}. {reason.rstrip('.')}.{about}"


def _describe(err: ValidationError, where: str, schema: type[BaseModel]) -> str:
    """One message for all problems pydantic found validating ``schema`` (``Config``), without
    pydantic's raw dump."""
    problems = [_describe_one(e, schema) for e in err.errors()]
    if len(problems) == 1:
        return where + problems[0]
    listed = "\n".join(f"  - {p}" for p in problems)
    return f"{where}{len(problems)} problems:\n{listed}"


def _config_error(err: ValidationError, where: str, schema: type[BaseModel]) -> ConfigError:
    """The ConfigError for ``err``: a ConfigNotImplementedError when every problem is a valid
    setting zero does not implement, so callers may tell "unsupported" from "wrong"."""
    unsupported = all(e["type"] == _NOT_IMPLEMENTED for e in err.errors())
    kind = ConfigNotImplementedError if unsupported else ConfigError
    return kind(_describe(err, where, schema))
