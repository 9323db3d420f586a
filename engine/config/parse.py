"""Reading a config source into plain, checked data: files, JSON / hjson / YAML, one checking walk.

Owns the step before any key is interpreted: a path (.json, .hjson, .yaml, .yml) or a mapping
becomes a fresh dict of plain dicts and lists, or a ``ConfigError`` naming the file, line or
dotted key. YAML reads 1e-3 as a float, like JSON; a key given twice in one mapping, a key that
is not a string, nesting deeper than 100 levels, non-finite numbers, a file over 256 KiB and more
than 5,000 values (YAML aliases expanded) are refused (see [Note: what the checking walk
refuses], [Note: duplicate keys] and [Note: size limits]).
"""

import math
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import hjson
import yaml

from .errors import ConfigError, _show
from .values import is_plus_infinity


def read_mapping(source: "str | os.PathLike[str] | Mapping[str, Any]") -> dict[str, Any]:
    """The raw mapping of a config file or mapping, before any validation (zrun --autotuning
    reads its search space from lists the schema would refuse). Raises ConfigError for what
    load_config refuses on reading (file type, size, syntax, non-finite numbers)."""
    return _read_source(source)[1]


def _read_source(source: Any) -> tuple[str, dict[str, Any]]:
    """Return (message prefix, raw dict) for a path or mapping, checked by ``_checked``."""
    if isinstance(source, Mapping):
        return "config: ", _checked(source, "", "config: ")
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(
            f"config source must be a path, a dict or a Config, got {type(source).__name__}."
        )
    path = Path(source)
    where = f"config file '{path}': "
    suffix = path.suffix.lower()
    if suffix not in (".json", ".hjson", ".yaml", ".yml"):
        raise ConfigError(f"{where}unknown file type '{suffix}'; use .json, .hjson, .yaml or .yml.")
    data = _parse(_read_text(path, where), suffix, where)
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{where}the top level must be a mapping of keys, got {type(data).__name__}."
        )
    return where, _checked(data, "", where)


# [Note: size limits]
# Every DeepSpeed key together is a few hundred values and a few kilobytes, so a config far
# larger is a mistake or hostile, and reading it must fail at once rather than after minutes:
# the pure-Python parsers read about 1 MiB/s (hjson) and 10,000 values/s (PyYAML), and YAML
# aliases make a small file large (the "billion laughs": nine levels, each a list of nine
# aliases to the one before, expand 500 bytes into 387 million values, which the checking walk
# would copy one by one). So a file is refused above _MAX_FILE_BYTES before it is read, YAML's
# composer counts the values of the document with every alias expanded
# (_YamlLoader.compose_node) and stops past _MAX_VALUES before anything is constructed, and the
# checking walk stops past _MAX_VALUES too (a JSON file, or a Python mapping whose lists share
# one object many times over).
_MAX_FILE_BYTES = 256 << 10  # ~50x the largest real config; hjson reads it in ~0.3 s
_MAX_VALUES = 5_000  # ~25x every DeepSpeed key; PyYAML composes that many in ~0.4 s


class _TooManyValues(Exception):
    """Raised inside the YAML loader past _MAX_VALUES (not a YAMLError / ValueError, so _parse
    tells it apart from a parse error)."""


def _too_many_values(where: str, key: str = "") -> str:
    at = f" (the walk was at '{key}')" if key else ""
    return (
        f"{where}more than {_MAX_VALUES:,} values (mappings, lists and scalars, YAML aliases "
        f"expanded){at}: a config of every DeepSpeed key has a few hundred. Remove what does "
        "not belong in a config; if aliases repeat a block, write it out once."
    )


def _read_text(path: Path, where: str) -> str:
    """The file's text; a ConfigError for a directory, a missing file, a file over
    _MAX_FILE_BYTES or bytes not UTF-8."""
    try:
        if path.is_dir():
            raise ConfigError(f"{where}is a directory; give the path of the config file in it.")
        if not path.exists():
            raise ConfigError(f"{where}file not found; check the path.")
        if not path.is_file():
            raise ConfigError(f"{where}is not a regular file; give the path of a config file.")
        size = path.stat().st_size
        if size > _MAX_FILE_BYTES:
            raise ConfigError(
                f"{where}{size:,} bytes is more than the {_MAX_FILE_BYTES:,} a config may have "
                "(a config of every DeepSpeed key is a few kilobytes); check that the path "
                "names the config and not a data or checkpoint file."
            )
        with path.open("rb") as handle:
            raw = handle.read(_MAX_FILE_BYTES + 1)
        if len(raw) > _MAX_FILE_BYTES:  # it grew since stat
            raise ConfigError(f"{where}grew past {_MAX_FILE_BYTES:,} bytes while being read.")
    except OSError as err:
        raise ConfigError(
            f"{where}cannot be read ({err.strerror or err}); check the path and its permissions."
        ) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(_not_utf8(raw, err.start, where)) from None


def _not_utf8(raw: bytes, start: int, where: str) -> str:
    """Name the line, column and byte offset of the first byte that is not UTF-8."""
    line_start = raw.rfind(b"\n", 0, start) + 1
    line = raw.count(b"\n", 0, start) + 1
    column = len(raw[line_start:start].decode("utf-8")) + 1  # valid: the error is the first
    bom = raw[:2] in (b"\xff\xfe", b"\xfe\xff")
    why = " (it starts with a UTF-16 byte order mark)" if bom else ""
    return (
        f"{where}not UTF-8{why}: byte 0x{raw[start]:02x} at line {line}, column {column} "
        f"(byte offset {start}) cannot be decoded. Save the file as UTF-8."
    )


def _parse(text: str, suffix: str, where: str) -> Any:
    """Parse JSON / hjson / YAML text; every parser failure becomes a ConfigError."""
    try:
        if suffix in (".yaml", ".yml"):
            return yaml.load(text, Loader=_YamlLoader)  # a SafeLoader subclass: no objects
        return hjson.loads(text, object_pairs_hook=_mapping_from_pairs, parse_float=_hjson_float)
    except _TooManyValues:
        raise ConfigError(_too_many_values(where)) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(f"{where}YAML parse error{line}: {problem}.") from None
    except hjson.HjsonDecodeError as err:
        # hjson reads a bare word up to the end of the line, brackets included.
        hint = ""
        if re.search(r"[:,\[]\s*-?(Infinity|NaN)\b", text):
            hint = (
                " (Infinity and NaN are not accepted, except steps_per_print: Infinity with "
                "nothing but a comma after it on its line; write a finite number)"
            )
        raise ConfigError(
            f"{where}parse error at line {err.lineno}, column {err.colno}: {err.msg}{hint}."
        ) from None
    except RecursionError:
        raise ConfigError(_too_deep(where, "")) from None
    except ValueError as err:
        # int() of more than 4300 digits, or a YAML date that does not exist (2020-13-45).
        reason = str(err).split(";")[0]
        raise ConfigError(
            f"{where}a value cannot be read: {reason}. Correct it (a number fits in 19 digits, "
            "a YAML date must exist) or quote it to keep it as text."
        ) from None


class _OutOfRange(float):
    """hjson's float for a literal beyond the float range, such as 1e400: infinity."""

    # hjson turns integral floats below 1e10 into ints by testing int(value) == value, and
    # int(inf) raises OverflowError. Here int() gives 0, so the test fails, the value stays
    # infinity and _checked names its key like any other non-finite number.
    def __int__(self) -> int:
        return 0


def _hjson_float(text: str) -> float:
    value = float(text)
    return value if math.isfinite(value) else _OutOfRange(value)


# [Note: what the checking walk refuses]
# _checked copies the parsed data once, before anything else looks at it, and refuses:
# - a key given twice in one mapping (see [Note: duplicate keys]);
# - a key that is not a string (YAML reads unquoted 1, true, null as int, bool, None);
# - nesting deeper than _MAX_DEPTH: every later step (deprecated names, "auto", pydantic,
#   freezing) recurses, and a mapping that contains itself (a YAML alias, a dict built in
#   Python) would recurse without end. DeepSpeed keys nest at most 3 levels deep;
# - non-finite numbers anywhere, free-form blocks (optimizer.params, scheduler.params, the
#   unsupported subsystems) included: an inf or NaN lr, momentum or loss scale does not fail,
#   it silently ruins or skips every step. hjson reads JSON's Infinity / -Infinity / NaN as
#   text, so those exact strings count as the numbers they spell. The one exception is
#   +infinity at the top-level steps_per_print, which means "never print": Accelerate writes
#   float("inf") there in every config it hands to DeepSpeed (values.py, StepsOrNever).
_MAX_DEPTH = 100
_NON_FINITE_TEXT = ("Infinity", "-Infinity", "NaN")
_INFINITY_MEANS_NEVER = "steps_per_print"


def _checked(node: Any, key: str, where: str, depth: int = 1, walked: list | None = None) -> Any:
    """Deep copy into plain dicts and lists (never aliasing the input), checked as it goes.

    ``key`` is the dotted key of ``node`` ("" for the top level), ``depth`` the number of
    mappings and lists around it plus one, ``walked`` a one-element list counting the values
    copied so far (started here when None). Raises ConfigError naming the key; see
    [Note: what the checking walk refuses] and [Note: size limits].
    """
    walked = [0] if walked is None else walked
    walked[0] += 1
    if walked[0] > _MAX_VALUES:
        raise ConfigError(_too_many_values(where, key))
    if isinstance(node, (Mapping, list, tuple)) and depth > _MAX_DEPTH:
        raise ConfigError(_too_deep(where, key))
    if isinstance(node, _Duplicated):
        raise ConfigError(
            f"{where}key '{_join(key, node.key)}' is given more than once; keep one (the "
            "parser would silently use the last value)."
        )
    if isinstance(node, Mapping):
        for name in node:
            if not isinstance(name, str):
                raise ConfigError(
                    f"{where}key {name!r} {f'in {key!r}' if key else 'at the top level'} is "
                    f"not a string but {type(name).__name__}; quote it (YAML reads unquoted 1, "
                    "true and null as a number, a boolean and null)."
                )
        return {k: _checked(v, _join(key, k), where, depth + 1, walked) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [_checked(v, _join(key, i), where, depth + 1, walked) for i, v in enumerate(node)]
    if isinstance(node, _Yaml11Number):
        raise ConfigError(
            f"{where}'{key}: {node}' is a number in YAML 1.1 (010 is octal 8, 1:30 is base-60 "
            "90, 0b11 is 3) but not in YAML 1.2 or JSON; see [Note: YAML numbers]. Write it "
            "as a plain decimal number (no leading zero, underscore or colon), or quote it "
            "to keep it as text."
        )
    huge = isinstance(node, int) and not isinstance(node, bool) and abs(node) > _FLOAT_MAX
    if key == _INFINITY_MEANS_NEVER and is_plus_infinity(node):
        return node
    if (
        huge
        or (isinstance(node, float) and not math.isfinite(node))
        or (isinstance(node, str) and node in _NON_FINITE_TEXT)
    ):
        raise ConfigError(
            f"{where}invalid value for '{key}': {_show(node)}. Non-finite numbers (inf, -inf, "
            "NaN) are refused everywhere in a config, because an infinite or NaN learning rate, "
            "momentum or loss scale ruins or skips every step (the one exception is "
            "steps_per_print: Infinity, which means never print). Write a finite number (a "
            "literal beyond about 1.8e308, such as 1e400, also reads as infinity)."
        )
    return node


# An integer beyond the largest float: as an lr or eps it overflows inside the optimizer's first
# step, so it counts as non-finite.
_FLOAT_MAX = sys.float_info.max


def _join(key: str, part: Any) -> str:
    return f"{key}.{part}" if key else str(part)


def _too_deep(where: str, key: str) -> str:
    parts = key.split(".")
    at = f" at '{'.'.join(parts[:6])}{'...' if len(parts) > 6 else ''}'" if key else ""
    return (
        f"{where}values nest more than {_MAX_DEPTH} levels deep{at} (or a mapping contains "
        "itself, e.g. through a YAML alias). DeepSpeed keys nest at most 3 levels "
        "(zero_optimization.offload_optimizer.device); flatten or remove that value."
    )


# [Note: duplicate keys]
# JSON, hjson and YAML parsers keep the last of two equal keys without a word, so a config
# that sets train_micro_batch_size_per_gpu twice trains with whichever came last. The parsers
# build each mapping bottom-up, before its parent exists, so they cannot know the dotted path;
# instead a mapping with a repeated key is built as a _Duplicated dict remembering the key, and
# _checked names it with its dotted path as it walks the finished tree.


class _Duplicated(dict):
    """A parsed mapping in which ``key`` appeared more than once (last value kept)."""

    def __init__(self, pairs: Any, key: Any) -> None:
        super().__init__(pairs)
        self.key = key


def _mapping_from_pairs(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """hjson's object_pairs_hook: a dict, or a _Duplicated one when a key repeats."""
    seen: set[Any] = set()
    for key, _ in pairs:
        if key in seen:
            return _Duplicated(pairs, key)
        seen.add(key)
    return dict(pairs)


class _YamlLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader with YAML 1.2 numbers and repeated keys detected.

    YAML 1.1 (PyYAML) reads ``1e-3`` and ``5e8`` as strings because its float pattern needs a
    dot and a signed exponent; JSON and YAML 1.2 read them as numbers. DeepSpeed configs are
    written with JSON in mind, so every number in exponent notation here is a float: lr and
    sizes alike. See [Note: YAML numbers] for 010, 1:30 and the other YAML 1.1 numbers.
    """

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._values = 0  # values composed so far, aliases expanded
        self._sizes: dict[int, int] = {}  # id(node) -> its values, aliases expanded

    def compose_node(self, parent: Any, index: Any) -> Any:
        # [Note: size limits]: an alias counts as the whole subtree it repeats.
        before, alias = self._values, self.check_event(yaml.AliasEvent)
        node = super().compose_node(parent, index)
        if alias:
            self._values += self._sizes.get(id(node), 1)  # a node holding itself: the walk
        else:
            self._values += 1
            self._sizes[id(node)] = self._values - before
        if self._values > _MAX_VALUES:
            raise _TooManyValues
        return node

    def construct_yaml_map(self, node: yaml.MappingNode) -> Any:
        # Explicit keys only: "<<" merge keys may legitimately be overridden.
        seen: set[tuple[str, str]] = set()
        repeated = None
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != _YAML_MERGE_TAG:
                if (key_node.tag, key_node.value) in seen and repeated is None:
                    repeated = key_node.value
                seen.add((key_node.tag, key_node.value))
        data: dict[Any, Any] = {} if repeated is None else _Duplicated((), repeated)
        yield data
        data.update(self.construct_mapping(node))


_YAML_MERGE_TAG = "tag:yaml.org,2002:merge"
_YamlLoader.add_constructor("tag:yaml.org,2002:map", _YamlLoader.construct_yaml_map)


# [Note: YAML numbers]
# PyYAML follows YAML 1.1, which reads 010 as 8 (octal), 1:30 as 90 (base 60), 0b11 as 3 and
# 1_000 as 1000, and needs a dot in a float (1e-3 stays text). Here a number follows the YAML
# 1.2 core schema, which JSON configs also follow: decimal integers, 0o octal, 0x hexadecimal,
# floats with or without a dot or exponent, .inf and .nan. A plain scalar that YAML 1.1 reads
# as a number in some other way is refused, naming its key: nobody can tell whether 010 meant
# ten or eight, or 1:30 a time or ninety (JSON refuses a leading zero too). Such a scalar
# becomes a _Yaml11Number, which _checked refuses with its dotted key.
_INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_YAML11_NUMBER_TAG = "tag:zero,2026:yaml-1.1-number"
_INT_12 = re.compile(r"^(?:[-+]?(?:0|[1-9][0-9]*)|0o[0-7]+|0x[0-9a-fA-F]+)$")
_FLOAT_12 = re.compile(
    r"^(?![-+]?0[0-9]+$)(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)
_LEADING_ZERO = re.compile(r"^[-+]?0[0-9]+$")  # 010: octal 8 in YAML 1.1, 10 in YAML 1.2


class _Yaml11Number(str):
    """A plain YAML scalar that YAML 1.1 reads as a number but YAML 1.2 does not (or reads
    as another number); see [Note: YAML numbers]."""


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node)
    if not _INT_12.match(text):  # only an explicit !!int tag gets here unmatched
        raise yaml.constructor.ConstructorError(
            None, None, f"{text!r} is not an integer", node.start_mark
        )
    if text[:2] in ("0o", "0x"):
        return int(text[2:], 8 if text[1] == "o" else 16)
    return int(text, 10)


def _construct_float(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> float:
    text = loader.construct_scalar(node)
    if not _FLOAT_12.match(text):
        raise yaml.constructor.ConstructorError(
            None, None, f"{text!r} is not a float", node.start_mark
        )
    return float(text.lower().replace(".inf", "inf").replace(".nan", "nan"))


def _yaml12_resolvers() -> dict[str, list[Any]]:
    """SafeLoader's implicit resolvers with YAML 1.1's int and float patterns moved behind
    YAML 1.2's and retagged as _YAML11_NUMBER_TAG."""
    resolvers: dict[str, list[Any]] = {}
    first_chars = list("-+.0123456789")
    for char, pairs in yaml.SafeLoader.yaml_implicit_resolvers.items():
        kept = [(t, r) for t, r in pairs if t not in (_INT_TAG, _FLOAT_TAG)]
        if char in first_chars:
            old = [(_YAML11_NUMBER_TAG, r) for t, r in pairs if t in (_INT_TAG, _FLOAT_TAG)]
            old.append((_YAML11_NUMBER_TAG, _LEADING_ZERO))
            kept = [(_INT_TAG, _INT_12), (_FLOAT_TAG, _FLOAT_12), *kept, *old]
        resolvers[char] = kept
    return resolvers


_YamlLoader.yaml_implicit_resolvers = _yaml12_resolvers()
_YamlLoader.add_constructor(_INT_TAG, _construct_int)
_YamlLoader.add_constructor(_FLOAT_TAG, _construct_float)
_YamlLoader.add_constructor(
    _YAML11_NUMBER_TAG, lambda loader, node: _Yaml11Number(loader.construct_scalar(node))
)
