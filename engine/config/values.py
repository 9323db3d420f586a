"""Value types of config fields, and ``_Block``, the base of every config block.

Owns how one raw value becomes a field's value: whole numbers written as 5e8 or "5e8" (counts,
ELEMENT sizes, byte sizes, the ZeRO stage), numbers that refuse true/false, dtype and offload
device spellings, free-form dicts frozen read-only (and thawed back for messages and dumps).
Imports nothing from zero.
"""

import enum
import functools
import math
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, PlainSerializer

# Every count and size is used as a torch int64 (tensor sizes, offsets, step counters).
_INT64_MAX = 2**63 - 1


def _to_whole(value: Any, *, minimum: int, what: str, maximum: int = _INT64_MAX) -> int:
    """Coerce JSON numbers such as 5e8 (a float) or YAML's "5e8" (a string) to an int."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"expected {what}")
    if isinstance(value, str):
        # A quoted "5e8" (our YAML loader reads an unquoted 5e8 as a float, like JSON).
        text = value.strip()
        try:
            value = int(text) if text.lstrip("+-").isdigit() else float(text)
        except ValueError:
            raise ValueError(f"expected {what}, not a string") from None
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"expected {what}; {value} is not a whole number")
        value = int(value)
    if value < minimum:
        bound = "positive" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"must be {bound} ({what})")
    if value > maximum:
        bound = "2**63 - 1, the largest int64" if maximum == _INT64_MAX else str(maximum)
        raise ValueError(f"must be at most {bound} ({what})")
    return value


def _whole(minimum: int, what: str, maximum: int = _INT64_MAX) -> Any:
    check = functools.partial(_to_whole, minimum=minimum, what=what, maximum=maximum)
    return Annotated[int, BeforeValidator(check)]


_ELEMENTS = "a whole number of elements; DeepSpeed sizes count elements, not bytes"
Elements = _whole(1, _ELEMENTS)
ElementsOrZero = _whole(0, _ELEMENTS)
Count = _whole(1, "a whole number")
CountOrZero = _whole(0, "a whole number")
Bytes = _whole(1, "a whole number of bytes")


def _not_bool(value: Any) -> Any:
    # pydantic reads true as 1.0: gradient_clipping: true would clip at 1.0 without a word.
    if isinstance(value, bool):
        raise ValueError("expected a number, not true or false")
    return value


Number = Annotated[float, BeforeValidator(_not_bool)]


def _to_stage(value: Any) -> int:
    stage = _to_whole(value, minimum=0, what="a ZeRO stage 0, 1, 2 or 3")
    if stage > 3:
        raise ValueError(
            "ZeRO stage must be one of 0, 1, 2, 3 (0: plain data parallel, 1: shard optimizer "
            "states, 2: also gradients, 3: also parameters)"
        )
    return stage


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return MappingProxyType({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


# A free-form, read-only dict (validated elsewhere, e.g. by the optimizer registry).
FrozenDict = Annotated[Mapping[str, Any], AfterValidator(_freeze), PlainSerializer(_thaw)]


def _lower(value: Any) -> Any:
    if value is None:
        return "none"
    return value.lower() if isinstance(value, str) else value


class OffloadDeviceEnum(str, enum.Enum):
    """Where offloaded state lives: DeepSpeed's deepspeed.runtime.zero.offload_config enum.

    A str enum, so a block's ``device`` (kept as the plain string "none", "cpu" or "nvme")
    compares equal to it: ``config.zero.offload_param.device == OffloadDeviceEnum.cpu``.
    """

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


OffloadDevice = Annotated[Literal["none", "cpu", "nvme"], BeforeValidator(_lower)]


# hjson reads JSON's bare Infinity as text up to the end of its line, so a line written by
# json.dump, `"steps_per_print": Infinity,`, arrives as "Infinity," (the next line parses as usual).
INFINITY_TEXT = ("Infinity", "Infinity,")


def is_plus_infinity(value: Any) -> bool:
    """float +inf (a mapping, YAML's .inf, a literal such as 1e400) or hjson's Infinity text."""
    if isinstance(value, str):
        return value in INFINITY_TEXT
    return isinstance(value, float) and math.isinf(value) and value > 0


def _steps_or_never(value: Any) -> int | None:
    """steps_per_print: a positive whole number, or +infinity (None here), which means never.

    Accelerate writes float("inf") into every config it hands to DeepSpeed to silence its step
    log (DeepSpeed's modulo then never reaches 0). null is refused: DeepSpeed fails on it at the
    first step, and it does not say which of "never" or "the default" is meant.
    """
    if is_plus_infinity(value):
        return None
    if value is None:
        raise ValueError(
            "expected a whole number of steps; write a positive number, or Infinity to never print"
        )
    return _to_whole(value, minimum=1, what="a whole number of steps, or Infinity for never")


StepsOrNever = Annotated[int | None, BeforeValidator(_steps_or_never)]
HalfOrFull = Literal["fp32", "fp16", "bf16"]


_DTYPE_NAMES = {
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
}


def _dtype_name(value: Any) -> Any:
    # DeepSpeed reads a dtype as any of its spellings (bfloat16, torch.float16, half, ...).
    return _DTYPE_NAMES.get(value.lower(), value) if isinstance(value, str) else value


AnyDtype = Annotated[HalfOrFull, BeforeValidator(_dtype_name)]


class _Block(BaseModel):
    """Base of every config block: immutable, unknown keys are errors, floats are finite.

    ``allow_inf_nan=False`` refuses the strings "inf" / "nan" that pydantic would otherwise read
    into a float field; non-finite numbers themselves never get this far (``_checked`` in
    parse.py).
    """

    model_config = ConfigDict(
        extra="forbid", frozen=True, validate_default=False, allow_inf_nan=False
    )


def _capitalize(value: Any) -> Any:
    return value.capitalize() if isinstance(value, str) else value


def _upper(value: Any) -> Any:
    return value.upper() if isinstance(value, str) else value


_SIZE = re.compile(r"^\s*([0-9.eE+]+)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'80G', '80GiB', '80GB' (all 2**30-based), '1T' or a plain byte count -> bytes.

    Raises ValueError for anything else.
    """
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"memory size {text!r}: give bytes or a number with K/M/G/T, e.g. 80G")
    power = " KMGT".index(match.group(2).upper() or " ")
    return int(float(match.group(1)) * 1024**power)
