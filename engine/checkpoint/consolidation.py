"""Consolidation: a checkpoint's full tensors in one process, whatever world size saved it.

Owns: ConsolidatedReader (one full tensor at a time), consolidate (a full fp32 state dict),
consolidated_names, and save_consolidated (one safetensors file, or shards and an index).
zero_to_fp32.py (the zero-to-fp32 CLI) and hf.py (checkpoint_to_pretrained) build on it.
"""

import os

import torch

from ..progress import progress
from .files import _save_safetensors, _write_json
from .format import _FLOAT_DTYPES, _OTHER_DTYPES, META, MODULE_FILE, CheckpointError
from .ownership import _numel
from .reader import GroupReader, _open, read_meta, resolve
from .validation import verify_checksums


class ConsolidatedReader:
    """A checkpoint's full tensors, read one at a time, without the original world size.

    Args:
        checkpoint_dir: a save_dir (its `latest` is followed, or `tag`) or a checkpoint
            directory itself.
        state: "master" for the weights, or an optimizer state kind such as "exp_avg" (then
            only trained parameters are listed).
        verify: check every file's crc32 recorded in meta.json first (one extra read).

    `names`: every tensor once, trained parameters group by group, then the others (frozen
    parameters, buffers) of module.safetensors; `ties`: alias -> canonical name for the names
    a tied tensor also has (not in `names`); `frozen`: the names in `names` of frozen
    parameters, or None for a checkpoint of a zero version that did not record them.
    `shape(name)`, `dtype(name)` (as read: fp32 for floating point) and `read(name)` (the full
    tensor, padding removed; master weights bitwise the saved fp32 values) read only what the
    tensor needs, so a caller that writes each tensor before reading the next holds one
    tensor, never the model. Raises CheckpointError.
    """

    def __init__(
        self, checkpoint_dir: str, tag: str | None = None, state="master", verify: bool = True
    ):
        if os.path.isfile(os.path.join(checkpoint_dir, META)):
            path = checkpoint_dir
        else:
            path = resolve(checkpoint_dir, tag)
        meta = read_meta(path)
        if verify:
            verify_checksums(path, meta, meta["files"])
        self.path, self.state, self.ties = path, state, dict(meta["ties"])
        self.frozen = None if meta.get("frozen") is None else set(meta["frozen"])
        self._groups = GroupReader(path, meta)
        self._trained: dict[str, tuple] = {}  # name -> (group, offset in group coordinates)
        self._shapes: dict[str, tuple] = {}
        for group, params in enumerate(meta["groups"]):
            offset = 0
            for p in params:
                self._trained[p["name"]] = (group, offset)
                self._shapes[p["name"]] = tuple(p["shape"])
                offset += _numel(p["shape"])
        self._module = _open(path, MODULE_FILE) if state == "master" else None
        self._saved_dtypes: dict[str, str] = {}
        for name in self._module.keys() if self._module is not None else ():
            piece = self._module.get_slice(name)
            self._shapes[name] = tuple(piece.get_shape())
            self._saved_dtypes[name] = piece.get_dtype()
        self.names = list(self._shapes)

    def __contains__(self, name: str) -> bool:
        return name in self._shapes

    def shape(self, name: str) -> tuple:
        return self._shapes[name]

    def dtype(self, name: str) -> torch.dtype:
        saved = self._saved_dtypes.get(name, "F32")
        if saved in _FLOAT_DTYPES:
            return torch.float32
        return next(d for d, n in _OTHER_DTYPES.items() if n == saved)

    def read(self, name: str) -> torch.Tensor:
        if name in self._trained:
            group, offset = self._trained[name]
            numel = _numel(self._shapes[name])
            return self._groups.read(group, self.state, offset, offset + numel).view(
                self._shapes[name]
            )
        value = self._module.get_tensor(name)
        return value.float() if value.is_floating_point() else value


def consolidate(
    checkpoint_dir: str,
    tag: str | None = None,
    state: str = "master",
    verify: bool = True,
    exclude_frozen: bool = False,
) -> dict:
    """Full fp32 state dict of a checkpoint, in one process, without the original world size.

    Arguments as ConsolidatedReader's. Returns name -> tensor for every parameter and buffer of
    the model (tied names included, as equal copies), with padding removed; master weights are
    bitwise the saved fp32 values; frozen parameters and floating-point buffers are cast to
    fp32. `exclude_frozen` leaves frozen parameters out (buffers stay). Raises CheckpointError.
    """
    reader = ConsolidatedReader(checkpoint_dir, tag, state, verify)
    names = consolidated_names(reader, exclude_frozen)
    out = {name: reader.read(name) for name in progress(names, "consolidate", unit="tensor")}
    for alias, canonical in reader.ties.items():
        if canonical in out:
            out[alias] = out[canonical].clone()
    return out


def consolidated_names(reader: ConsolidatedReader, exclude_frozen: bool = False) -> list[str]:
    """reader.names, without the frozen parameters when `exclude_frozen`. Raises CheckpointError
    for exclude_frozen on a checkpoint that does not record which tensors are frozen."""
    if not exclude_frozen:
        return list(reader.names)
    if reader.frozen is None:
        raise CheckpointError(
            f"{os.path.join(reader.path, META)} does not record which parameters are frozen (a "
            "checkpoint of an older zero version): consolidate without excluding them and drop "
            "their names from the state dict, or load and save the checkpoint again"
        )
    return [name for name in reader.names if name not in reader.frozen]


def save_consolidated(state_dict: dict, output: str, max_shard_bytes: int | None = None) -> list:
    """Write a consolidated state dict as one safetensors file, or as several of at most
    max_shard_bytes each plus `<output>.index.json` (name -> file). Returns the files written."""
    tensors = {k: v.contiguous() for k, v in state_dict.items()}
    if not max_shard_bytes:
        _save_safetensors(tensors, output)
        return [output]
    shards, current, size = [], {}, 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += nbytes
    shards.append(current)
    stem = output[: -len(".safetensors")] if output.endswith(".safetensors") else output
    files, index = [], {}
    for i, shard in enumerate(progress(shards, "write", unit="file")):
        file = f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _save_safetensors(shard, file)
        files.append(file)
        index.update({name: os.path.basename(file) for name in shard})
    _write_json(f"{stem}.index.json", {"weight_map": index})
    return files
