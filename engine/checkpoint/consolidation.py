"""Consolidation: a checkpoint's full tensors in one process, whatever world size saved it.

Owns: ConsolidatedReader (one full tensor at a time), consolidate (a full fp32 state dict),
consolidated_names, write_consolidated (a checkpoint into safetensors files, one tensor at a
time) and save_consolidated (a state dict into the same files). zero_to_fp32.py (the
zero-to-fp32 CLI) and hf.py (checkpoint_to_pretrained) build on it.

[Note: consolidation in bounded memory]
A rank file holds, per param group and state kind, the flat ranges of group coordinates its
rank owned ([Note: world-size independent coordinates] in ownership.py). ConsolidatedReader.read
allocates one full tensor and fills it with positioned reads of exactly the bytes of each
piece that overlaps it (SafetensorsReader.read_into; the headers give the byte offsets): no file
is mapped, so neither the checkpoint's file pages nor a second copy of the tensor count against
the process. Writers take each tensor as it is read (ShardedWriter writes its bytes at once)
and drop it before the next, so zero-to-fp32, write_consolidated and checkpoint_to_pretrained
hold one tensor at a time: at most 1.5x the largest tensor (the tensor and its cast, for a
16-bit frozen parameter in fp32 or an fp32 one exported in 16 bits) plus a fixed overhead,
whatever the model's size. consolidate() returns the whole state dict, so it holds the model
once, plus one tensor.
"""

import bisect
import os

import torch

from ..progress import progress
from .format import META, MODULE_FILE, SAFETENSORS_DTYPES, CheckpointError, rank_file
from .ownership import _numel
from .reader import read_meta, resolve
from .safetensors_io import SafetensorsReader, ShardedWriter
from .validation import verify_checksums, verify_layout


class _Pieces:
    """The pieces of each param group's flat vector of one state kind in the rank files, read
    with positioned reads ([Note: consolidation in bounded memory]). No file stays open
    between reads. Checked when built: every group is held exactly once, and every piece's
    tensor is in its rank file with the right dtype and length (each rank file's header is
    read), so a writer fed by read_into fails before it writes anything, not halfway. Raises
    CheckpointError."""

    def __init__(self, path: str, meta: dict, kind: str):
        self.path, self.kind, self._readers = path, kind, {}
        self._pieces: dict[int, list[tuple[int, int, str, str]]] = {}
        for rank, groups in meta["ranks"].items():
            for group, ranges in groups.items():
                for index, (lo, hi) in enumerate(ranges):
                    if lo < hi:
                        key = f"group{group}.{kind}.{index}"
                        self._pieces.setdefault(int(group), []).append((lo, hi, rank, key))
        for pieces in self._pieces.values():
            pieces.sort()
        self._starts = {group: [p[0] for p in pieces] for group, pieces in self._pieces.items()}
        for group, params in enumerate(meta["groups"]):
            self._check(group, sum(_numel(p["shape"]) for p in params))

    def _check(self, group: int, numel: int) -> None:
        held = 0
        for lo, hi, rank, key in self._pieces.get(group, []):
            if lo != held:
                break
            self._reader(rank, key, hi - lo)
            held = hi
        if held != numel:
            raise CheckpointError(
                f"{os.path.join(self.path, META)}: the rank files do not hold param group "
                f"{group}'s '{self.kind}' elements [0, {numel}) exactly once (a gap or an "
                f"overlap at element {held}): the checkpoint is damaged; load another one"
            )

    def read_into(self, group: int, begin: int, out: torch.Tensor) -> None:
        """Fill `out` (1-D fp32) with elements [begin, begin + out.numel()) of `group`. Raises
        CheckpointError when a piece's tensor is missing or not fp32 of its range's length, or
        when elements are not held by any rank file."""
        end, covered, used = begin + out.numel(), 0, []
        pieces = self._pieces.get(group, [])
        first = max(bisect.bisect_right(self._starts.get(group, []), begin) - 1, 0)
        try:
            for lo, hi, rank, key in pieces[first:]:
                if lo >= end:
                    break
                a, b = max(lo, begin), min(hi, end)
                if a < b:
                    reader = self._reader(rank, key, hi - lo)
                    used.append(reader)
                    reader.read_into(key, a - lo, out[a - begin : b - begin])
                    covered += b - a
        finally:
            for reader in used:
                reader.close()
        if covered != end - begin:
            raise CheckpointError(
                f"{self.path}: group {group} elements [{begin}, {end}) of the saved state are "
                "not held by any rank file"
            )

    def _reader(self, rank: str, key: str, numel: int) -> SafetensorsReader:
        file = rank_file(int(rank))
        if file not in self._readers:
            self._readers[file] = SafetensorsReader(os.path.join(self.path, file))
        reader = self._readers[file]
        found = None
        if key in reader.file_of:
            found = (SAFETENSORS_DTYPES.get(reader.dtype(key)), list(reader.shape(key)))
        if found != ("F32", [numel]):
            found = "missing" if found is None else f"{found[0]} {found[1]}"
            raise CheckpointError(
                f"{os.path.join(self.path, file)}: tensor '{key}' is {found}, expected F32 "
                f"[{numel}]"
            )
        return reader


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
    tensor, padding removed; master weights bitwise the saved fp32 values) read only the bytes
    the tensor needs, with no file mapped ([Note: consolidation in bounded memory]), so a caller
    that writes each tensor before reading the next holds one tensor, never the model. Raises
    CheckpointError.
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
        verify_layout(path, meta, meta["files"])
        self.path, self.state, self.ties = path, state, dict(meta["ties"])
        self.frozen = None if meta.get("frozen") is None else set(meta["frozen"])
        self._pieces = _Pieces(path, meta, state)
        self._trained: dict[str, tuple] = {}  # name -> (group, offset in group coordinates)
        self._shapes: dict[str, tuple] = {}
        for group, params in enumerate(meta["groups"]):
            offset = 0
            for p in params:
                self._trained[p["name"]] = (group, offset)
                self._shapes[p["name"]] = tuple(p["shape"])
                offset += _numel(p["shape"])
        self._module = None
        if state == "master":
            self._module = SafetensorsReader(os.path.join(path, MODULE_FILE))
            for name in self._module.keys:
                self._shapes[name] = self._module.shape(name)
        self.names = list(self._shapes)

    def __contains__(self, name: str) -> bool:
        return name in self._shapes

    def shape(self, name: str) -> tuple:
        return self._shapes[name]

    def dtype(self, name: str) -> torch.dtype:
        if name in self._trained:
            return torch.float32
        saved = self._module.dtype(name)
        return torch.float32 if saved.is_floating_point else saved

    def read(self, name: str) -> torch.Tensor:
        shape = self._shapes[name]
        if name in self._trained:
            group, offset = self._trained[name]
            value = torch.empty(_numel(shape), dtype=torch.float32)
            self._pieces.read_into(group, offset, value)
            return value.view(shape)
        try:
            value = self._module.read(name, 0, _numel(shape)).view(shape)
        finally:
            self._module.close()
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


def write_consolidated(
    checkpoint_dir: str,
    output: str,
    tag: str | None = None,
    max_shard_bytes: int | None = None,
    state: str = "master",
    verify: bool = True,
    exclude_frozen: bool = False,
) -> list[str]:
    """Write what consolidate() returns into safetensors files, one tensor at a time: `output`
    (a .safetensors path), or, beyond `max_shard_bytes` bytes (None: never),
    <stem>-0000i-of-0000n.safetensors beside it plus <stem>.index.json (name -> file), stem
    being output without .safetensors. What the zero-to-fp32 command runs.

    Arguments otherwise as consolidate's; tied names are written as copies (read again), so
    load_state_dict(strict=True) takes the result. Holds one tensor at a time, never the model
    ([Note: consolidation in bounded memory]). Returns the paths written (index last). Raises
    CheckpointError for a missing or damaged checkpoint; OSError when a file cannot be written.
    """
    reader = ConsolidatedReader(checkpoint_dir, tag, state, verify)
    names = consolidated_names(reader, exclude_frozen)
    return _stream(reader, names, output, max_shard_bytes)


def _stream(
    reader: ConsolidatedReader,
    names: list[str],
    output: str,
    max_shard_bytes: int | None,
    index_name: str | None = None,
) -> list[str]:
    """write_consolidated's body: `names` of `reader` (and their tied aliases) into `output`, as
    write_consolidated names the files; `index_name` replaces <stem>.index.json. Returns the
    paths written."""
    sources = names + [c for a, c in reader.ties.items() if c in names]
    targets = names + [a for a, c in reader.ties.items() if c in names]
    entries = [(t, reader.shape(s), reader.dtype(s)) for t, s in zip(targets, sources)]
    writer = _writer(output, entries, max_shard_bytes, index_name)
    for (name, _, _), source in zip(progress(entries, "consolidate", unit="tensor"), sources):
        writer.write(name, reader.read(source))
    return [os.path.join(os.path.dirname(output), name) for name in writer.close()]


def save_consolidated(state_dict: dict, output: str, max_shard_bytes: int | None = None) -> list:
    """Write a consolidated state dict (name -> CPU tensor) as write_consolidated writes a
    checkpoint: one safetensors file `output`, or shards of at most max_shard_bytes each plus
    <stem>.index.json. Holds nothing beyond `state_dict` (each tensor's bytes are written as
    they are; a non-contiguous one is copied alone). Returns the paths written (index last)."""
    entries = [(name, tuple(value.shape), value.dtype) for name, value in state_dict.items()]
    writer = _writer(output, entries, max_shard_bytes)
    for name, value in progress(list(state_dict.items()), "write", unit="tensor"):
        writer.write(name, value)
    return [os.path.join(os.path.dirname(output), name) for name in writer.close()]


def _writer(output: str, entries: list, max_shard_bytes, index_name=None) -> ShardedWriter:
    directory, file_name = os.path.split(output)
    stem = file_name.removesuffix(".safetensors")
    index_name = index_name or f"{stem}.index.json"
    return ShardedWriter(directory, entries, max_shard_bytes, file_name, index_name)
