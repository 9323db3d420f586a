"""The checkpoint format: what a checkpoint directory holds, and what meta.json may say.

Layout of one checkpoint, `save_dir/<tag>/`:

    meta.json               rank 0: format, config, world size, stage, parameter names/shapes,
                            the ranges each rank holds, counters, loss scaler, lr scheduler,
                            optimizer hyper-parameters, client_state, file sizes and crc32s
    rank<r>.safetensors     rank r: its owned fp32 master weights and optimizer moments, one
                            1-D tensor per (param group, kind), plus its RNG states and its
                            data loader's state ([Note: per-rank state])
    module.safetensors      rank 0: what ZeRO does not partition (frozen parameters, unless
                            the save left them out, and buffers)

and `save_dir/latest` names the newest tag. No pickle is involved: tensors go through
safetensors, everything else is JSON.

Owns: FORMAT and the file names, CheckpointError, what a tag may be, the meta.json schema and
the JSON form of the values in it, and the safetensors dtype tables. Which elements each rank
file holds is in ownership.py; how the files are written and published is in files.py.
"""

import hashlib
import json
import math
import os
import random
from typing import Annotated

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)

FORMAT = "zero-checkpoint/1"
META, MODULE_FILE, LATEST = "meta.json", "module.safetensors", "latest"
# File names are limited to 255 bytes (NAME_MAX); a save writes into `<tag>.tmp` first.
MAX_TAG_BYTES = 255 - len(".tmp")


class CheckpointError(ValueError):
    """A checkpoint cannot be written or read; the message names the file and the key."""


def rank_file(rank: int) -> str:
    return f"rank{rank}.safetensors"


def _check_tag(tag) -> None:
    """A tag is a plain directory name that cannot collide with zero's own files and leaves
    room for the '.tmp' suffix within the 255-byte file-name limit."""
    if not isinstance(tag, str):
        raise CheckpointError(f"checkpoint tag {tag!r} is a {type(tag).__name__}, not a str")
    reserved = tag in (".", "..", LATEST) or tag.endswith((".tmp", ".old"))
    blank = tag != tag.strip() or any(not c.isprintable() for c in tag)  # `latest` is stripped
    if not tag or reserved or blank or "/" in tag or os.sep in tag:
        raise CheckpointError(
            f"checkpoint tag {tag!r} is not a plain directory name (no '/', no leading or "
            f"trailing space, no control character, not '.', '..' or '{LATEST}', not ending in "
            "'.tmp' or '.old')"
        )
    try:
        size = len(tag.encode("utf-8"))
    except UnicodeEncodeError:
        raise CheckpointError(f"checkpoint tag {tag!r} is not encodable as UTF-8") from None
    if size > MAX_TAG_BYTES:
        raise CheckpointError(
            f"checkpoint tag {tag[:32]!r}... is {size} bytes long in UTF-8; at most "
            f"{MAX_TAG_BYTES} are allowed (file names have at most 255 bytes and a save adds "
            "'.tmp'); pass a shorter tag"
        )


def optimizer_name(optimizer) -> str:
    """The algorithm an optimizer runs, as recorded in meta.json: zero's CPUAdam and FusedAdam
    (what offload and the CUDA path put in place of the config's Adam/AdamW) count as "Adam" or
    "AdamW" by their mode, so a checkpoint resumes with offload switched on or off."""
    name = type(optimizer).__name__
    if name in ("CPUAdam", "FusedAdam"):
        return "AdamW" if optimizer.param_groups[0]["adamw_mode"] else "Adam"
    return name


# [Note: frozen parameters left out]
# save_checkpoint(exclude_frozen_parameters=True) (DeepSpeed's keyword; the Hugging Face Trainer
# passes it for peft models) writes no frozen parameter (requires_grad=False) into
# module.safetensors and lists their names in meta.json's `excluded_frozen`: a LoRA run's
# checkpoint then holds the adapters, not the base model (which, at stage 3, is also not
# all-gathered for the save). Loading such a checkpoint keeps the model's current value of each
# listed parameter (the pretrained weights it was built with) when that parameter is frozen in
# the loading model too, with or without load_module_strict, and logs which ones it kept. A
# listed name that the loading model trains, or a frozen parameter missing from a checkpoint
# that does not list it, stays a "missing keys" CheckpointError (with load_module_strict=True;
# strict=False keeps current values for missing frozen parameters and buffers, as before).

# [Note: the layout bound to the bytes]
# meta.json says where each tensor lives: the parameters' names, shapes and order in each group
# (which element range is which parameter), the ranges each rank file holds, the tied names and
# the frozen ones. An edit that swaps two ranks' ranges, two same-shape names or the order of
# the parameters breaks no schema rule and no file's crc32, yet loads every value into another
# parameter. So every safetensors file of a checkpoint records, in its header metadata
# (LAYOUT_METADATA), the sha256 of that part of meta.json as the save computed it
# (layout_digest); the load checks it for every file a rank reads, and consolidation for every
# file, before anything is read or changed (validation.verify_layout). An edit of the header
# changes the file's crc32. Checkpoints of versions before the digest have none: nothing to check.
LAYOUT_KEYS = ("world_size", "groups", "ties", "ranks", "frozen", "excluded_frozen")
LAYOUT_METADATA = "zero.layout_sha256"


def layout_digest(meta: dict) -> str:
    """sha256 (64 hex digits) of meta's LAYOUT_KEYS, canonical JSON ([Note: the layout bound to
    the bytes]); a key meta lacks counts as null."""
    layout = {key: meta.get(key) for key in LAYOUT_KEYS}
    text = json.dumps(layout, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


# ----- meta.json schema -----------------------------------------------------------------------
# [Note: meta.json schema] Every key meta.json must have, with its JSON type; read_meta
# (reader.py) checks a file against it before anything else reads it, so a damaged or hand-edited
# file is a CheckpointError naming the key, never a KeyError or a failure halfway through a load.
# Checks that need the running engine (the scheduler's keys, the param groups) are in _verify
# (reader.py).
_Number = Annotated[str, StringConstraints(pattern=r"^(0|[1-9][0-9]*)$")]  # a rank or group


_FileName = Annotated[
    str, StringConstraints(pattern=r"^(module|rank(0|[1-9][0-9]*))\.safetensors$")
]
_Count = Annotated[int, Field(ge=0)]
_Crc32 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{8}$")]


class _Schema(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _SavedParam(_Schema):
    name: str
    shape: list[_Count]


class _ScalarState(_Schema):
    tensor: str | None  # "torch.float32" for a 0-dim tensor, None for a plain value
    value: JsonValue

    @model_validator(mode="after")
    def _tensor_dtype(self):
        if self.tensor is not None:
            if _dtype(self.tensor) is None:
                raise ValueError(f"tensor dtype {self.tensor!r} is not one such as 'torch.float32'")
            if not isinstance(self.value, (int, float)):
                raise ValueError(f"a tensor's value must be a number, not {self.value!r}")
        return self


class _Counters(_Schema):
    global_steps: _Count
    global_samples: _Count
    skipped_steps: _Count
    micro_steps: _Count


class _LossScaler(_Schema):  # precision.LossScaler.state_dict()
    scale: Annotated[float, Field(gt=0, allow_inf_nan=False)]
    hysteresis_left: _Count
    steps_since_change: _Count


class _Meta(_Schema):
    format: str
    tag: str
    config: dict[str, JsonValue]
    world_size: Annotated[int, Field(ge=1)]
    stage: Annotated[int, Field(ge=0, le=3)]
    compute_dtype: str
    groups: list[list[_SavedParam]]
    ties: dict[str, str]
    ranks: dict[
        _Number, dict[_Number, list[Annotated[list[_Count], Field(min_length=2, max_length=2)]]]
    ]
    optimizer: str
    sharded_state: list[str]
    scalar_state: dict[_Number, dict[str, _ScalarState]]
    param_groups: list[dict[str, JsonValue]]
    counters: _Counters
    loss_scaler: _LossScaler
    lr_scheduler: dict[str, JsonValue] | None
    # Rank 0's Python random state, in checkpoints of older versions only: the rank files hold
    # every rank's now ([Note: per-rank state]).
    python_rng: JsonValue = None
    client_state: dict[str, JsonValue]
    files: dict[_FileName, _Count]
    crc32: dict[_FileName, _Crc32] | None = None  # absent in checkpoints of older versions
    frozen: list[str] | None = None  # absent in checkpoints of older versions
    # [Note: frozen parameters left out]; absent unless the save passed exclude_frozen_parameters
    excluded_frozen: list[str] | None = None
    # [Note: saved at an accumulation boundary]; absent in checkpoints of older versions
    at_accumulation_boundary: bool | None = None

    @field_validator("python_rng")
    @classmethod
    def _python_rng(cls, value):
        return value if value is None else _python_state(value)

    @model_validator(mode="after")
    def _consistent(self):
        for rank, groups in self.ranks.items():
            if int(rank) >= self.world_size:
                raise ValueError(f"'ranks' has rank {rank}, but world_size is {self.world_size}")
            if rank_file(int(rank)) not in self.files:
                raise ValueError(f"'files' lacks {rank_file(int(rank))}, which 'ranks' lists")
            for group, ranges in groups.items():
                if int(group) >= len(self.groups):
                    raise ValueError(f"'ranks.{rank}' has group {group}, 'groups' has fewer")
                if any(lo > hi for lo, hi in ranges):
                    raise ValueError(
                        f"'ranks.{rank}.{group}' has a range [begin, end) with end < begin"
                    )
        if MODULE_FILE not in self.files:
            raise ValueError(f"'files' lacks {MODULE_FILE}")
        if self.crc32 is not None and set(self.crc32) != set(self.files):
            raise ValueError("'crc32' must list exactly the files of 'files'")
        return self


# [Note: saved at an accumulation boundary]
# A checkpoint holds no gradient: save refuses to run while the optimizer holds gradients
# accumulated since its last step (between the micro-batches of one gradient accumulation
# cycle, or after the boundary's backward but before engine.step()), and meta.json says
# `"at_accumulation_boundary": true`. Carrying the partial gradient instead would not resume
# bitwise at stages 0-1, whose ranks each hold an unreduced sum of their own micro-batches
# (another world size has other micro-batches). Older versions saved mid-cycle without the
# gradient: a meta.json without the key whose counters.micro_steps is not a multiple of its
# config's gradient_accumulation_steps is refused on load (reader.py).


def holds_gradients(state) -> bool:
    """True while the optimizer holds gradients no step has used ([Note: saved at an
    accumulation boundary]); not a collective."""
    return any(b.accum is not None or b.grad_shard is not None for b in state.optimizer.buckets)


# [Note: per-rank state]
# Besides its shards, each rank file holds what differs between ranks:
#   tensors   rng.torch_cpu         U8, torch.get_rng_state()
#             rng.torch_<device>    U8, the device generator's (CUDA: rng.torch_cuda)
#             data_loader.<n>       the tensors of the data loader's state_dict()
#   metadata  rng                   JSON {"python": random.getstate(), "numpy": NumPy's global
#   (strings)                       RandomState as [name, keys, pos, has_gauss, cached] or null}
#             data_loader           JSON of the data loader's state_dict(), each tensor replaced
#                                   by {"$tensor": "data_loader.<n>"}; absent without one
# ("metadata" is safetensors' __metadata__ header entry, covered by the file's crc32.) Rank r
# loads what rank r saved; reader.py says what a rank that saved nothing gets.
RNG_METADATA, LOADER_METADATA, LOADER_TENSORS = "rng", "data_loader", "data_loader"
_TENSOR_REF = "$tensor"


class _RankRng(_Schema):
    python: JsonValue
    numpy: JsonValue = None

    @field_validator("python")
    @classmethod
    def _python(cls, value):
        return _python_state(value)

    @field_validator("numpy")
    @classmethod
    def _numpy(cls, value):
        return value if value is None else _numpy_state(value)


def _python_state(value):
    """Check a JSON form of random.getstate() on a scratch generator (nothing changes)."""
    try:
        random.Random().setstate(_as_tuple(value))
    except (TypeError, ValueError, OverflowError) as error:
        raise ValueError(f"not a state of Python's random module ({error})") from None
    return value


def _numpy_state(value):
    """Check a JSON form of numpy.random.get_state() on a scratch RandomState, where NumPy is
    installed (without it the state is never applied)."""
    try:
        import numpy
    except ImportError:
        return value
    try:
        numpy.random.RandomState().set_state(numpy_state_tuple(value))
    except (TypeError, ValueError, OverflowError, IndexError) as error:
        raise ValueError(f"not a state of NumPy's RandomState ({error})") from None
    return value


def numpy_state_tuple(value: list) -> tuple:
    """[name, keys, pos, has_gauss, cached] (JSON) -> numpy.random.set_state's tuple."""
    import numpy

    if not isinstance(value, list) or len(value) != 5:
        raise ValueError("expected [name, keys, pos, has_gauss, cached_gaussian]")
    name, keys, *rest = value
    return (name, numpy.asarray(keys, dtype=numpy.uint32), *rest)


def _encode_state(value, prefix: str, where: str) -> tuple:
    """(JSON value, {key: tensor}): a component's state_dict() with each tensor replaced by
    {"$tensor": key} and taken out under `prefix.<n>` ([Note: per-rank state]). Raises
    CheckpointError naming the entry (`where[...]`) that neither JSON nor a tensor holds
    unchanged: tuples, non-string keys, non-finite floats, other objects."""
    tensors: dict = {}

    def encode(item, at: str):
        if torch.is_tensor(item):
            key = f"{prefix}.{len(tensors)}"
            tensors[key] = item.detach().cpu().contiguous().clone()
            return {_TENSOR_REF: key}
        if isinstance(item, dict) and all(isinstance(k, str) for k in item):
            if list(item) != [_TENSOR_REF]:
                return {k: encode(v, f"{at}[{k!r}]") for k, v in item.items()}
        elif isinstance(item, list):
            return [encode(v, f"{at}[{i}]") for i, v in enumerate(item)]
        elif item is None or isinstance(item, (int, str)) or _finite(item):
            return item
        raise CheckpointError(
            f"{at} is {item!r:.80}, which a checkpoint cannot store: it keeps this state as JSON "
            "and tensors (numbers, strings, lists, dicts with string keys other than "
            f"{{{_TENSOR_REF!r}: ...}}, tensors)"
        )

    return encode(value, where), tensors


def _finite(item) -> bool:
    return isinstance(item, float) and math.isfinite(item)  # JSON has no NaN or Infinity


def _decode_state(value, tensors):
    """The inverse of _encode_state; `tensors` maps a key to its tensor (KeyError: missing)."""
    if isinstance(value, dict):
        if list(value) == [_TENSOR_REF]:
            return tensors[value[_TENSOR_REF]]
        return {k: _decode_state(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_state(v, tensors) for v in value]
    return value


def _tensor_refs(value) -> list:
    """The tensor keys an encoded state refers to."""
    if isinstance(value, dict):
        if list(value) == [_TENSOR_REF]:
            return [value[_TENSOR_REF]]
        return [key for v in value.values() for key in _tensor_refs(v)]
    if isinstance(value, list):
        return [key for v in value for key in _tensor_refs(v)]
    return []


def _dtype(name: str) -> torch.dtype | None:
    """The torch dtype written as str(dtype) ("torch.float32"), or None."""
    value = getattr(torch, name[len("torch.") :], None) if name.startswith("torch.") else None
    return value if isinstance(value, torch.dtype) else None


def _schema_error(meta_path: str, error: ValidationError) -> CheckpointError:
    problems = []
    for item in error.errors()[:3]:
        key = ".".join(str(part) for part in item["loc"])
        problems.append(f"key '{key}': {item['msg']}" if key else item["msg"])
    more = f" (and {error.error_count() - 3} more)" if error.error_count() > 3 else ""
    return CheckpointError(f"{meta_path}: {'; '.join(problems)}{more}")


def _as_tuple(value):
    return tuple(_as_tuple(v) for v in value) if isinstance(value, list) else value


def _jsonable(value):
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if torch.is_tensor(value):
        return value.tolist()
    return value


# ----- dtype tables ---------------------------------------------------------------------------
# torch dtype -> safetensors' name for it (the format's spec lists these); also what
# safetensors_io writes.
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
_OTHER_DTYPES = {d: n for d, n in SAFETENSORS_DTYPES.items() if not d.is_floating_point}


def _dtype_fits(saved: str, dtype: torch.dtype) -> bool:
    """A saved tensor of safetensors dtype `saved` may be copied into one of `dtype`: floating
    point into floating point (a run may change its compute dtype), anything else unchanged."""
    if dtype.is_floating_point:
        return saved in _FLOAT_DTYPES
    return _OTHER_DTYPES.get(dtype) == saved
