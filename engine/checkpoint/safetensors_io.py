"""Hugging Face's safetensors checkpoint layout, read in parts and written as a stream.

A checkpoint is one `model.safetensors`, or shards `model-0000i-of-0000n.safetensors` with
`model.safetensors.index.json` ({"metadata": {"total_size": bytes}, "weight_map": {name: file}}).

SafetensorsReader reads any range of elements of one tensor with positioned reads of exactly its
bytes (the header gives every tensor's offsets), counting the bytes it reads; it maps nothing.

ShardedWriter writes the format itself (the safetensors package writes whole dicts only): an
8-byte little-endian header length, a JSON header {name: {"dtype", "shape", "data_offsets"}} with
"__metadata__" {"format": "pt"} padded with spaces to a multiple of 8 bytes, then every tensor's
bytes in header order. The entries (name, shape, dtype) are fixed up front, so each file's header
is written when the file is opened and the values follow one at a time: the writer holds no
tensor. The files are checked by safetensors' reader in tests/checkpoint/test_hf_pretrained.py.
"""

import json
import math
import os
import re
import struct
import sys

import torch

from .format import SAFETENSORS_DTYPES, CheckpointError

SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
_SHARD = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")


_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'5GB' -> 5 * 10**9 bytes; plain integers are bytes. Raises ValueError naming the value."""
    value = text.strip().upper()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if value.endswith(unit):
            number = value[: -len(unit)].strip()
            try:
                return int(float(number) * _UNITS[unit])
            except ValueError:
                break
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"--max_shard_size {text!r}: expected bytes such as 500MB or 2GB"
        ) from None


def is_weights_file(name: str) -> bool:
    """A file name of the weights of an HF safetensors checkpoint (single, shard or index)."""
    return name == INDEX_FILE or _SHARD.fullmatch(name) is not None


# The JSON header's largest size, in bytes (safetensors' own reader refuses larger ones).
HEADER_LIMIT = 100 * 2**20
_DTYPE_OF_NAME = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        _DTYPE_OF_NAME[_name] = getattr(torch, _attr)


def read_header(file: str) -> tuple[int, dict]:
    """The header of one safetensors file: (byte offset of its data, {name: (dtype, shape,
    begin, end)}) with [begin, end) the tensor's bytes relative to that offset. Checks that the
    header is at most HEADER_LIMIT bytes of JSON, every dtype is known, and every tensor's bytes
    lie inside the file and match its shape; raises CheckpointError naming the file and the
    tensor. Reads the header only."""
    length, size, header = _json_header(file)
    data_start, entries = 8 + length, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPE_OF_NAME[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as error:
            raise CheckpointError(
                f"{file}: tensor '{name}' has an unreadable header entry ({error!r}): "
                "dtype, shape and data_offsets are needed, with a dtype of "
                f"{sorted(_DTYPE_OF_NAME)}"
            ) from None
        nbytes = math.prod(shape) * dtype.itemsize
        if min(shape, default=0) < 0 or not 0 <= begin <= end <= size - data_start:
            raise CheckpointError(f"{file}: tensor '{name}' lies outside the file (truncated?)")
        if end - begin != nbytes:
            raise CheckpointError(
                f"{file}: tensor '{name}' holds {end - begin} bytes; shape {list(shape)} of "
                f"{entry['dtype']} needs {nbytes}"
            )
        entries[str(name)] = (dtype, shape, begin, end)
    return data_start, entries


def read_metadata(file: str) -> dict:
    """The "__metadata__" mapping (str -> str) of one safetensors file's header ({} when it has
    none). Raises CheckpointError naming the file. Reads the header only."""
    metadata = _json_header(file)[2].get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{file}: its header's __metadata__ is not a mapping")
    return metadata


def _json_header(file: str) -> tuple[int, int, dict]:
    """(header length, file size, the header as JSON: a mapping); CheckpointError otherwise."""
    try:
        with open(file, "rb") as handle:
            prefix = handle.read(8)
            size = os.fstat(handle.fileno()).st_size
            if len(prefix) < 8:
                raise CheckpointError(f"{file}: not a safetensors file (under 8 bytes)")
            (length,) = struct.unpack("<Q", prefix)
            if length > min(HEADER_LIMIT, size - 8):
                raise CheckpointError(
                    f"{file}: not a safetensors file (its header claims {length} bytes; the "
                    f"file has {size}, and headers are at most {HEADER_LIMIT})"
                )
            header = json.loads(handle.read(length))
    except OSError as error:
        raise CheckpointError(f"{file}: cannot be read ({error})") from None
    except ValueError as error:
        raise CheckpointError(f"{file}: not a safetensors file ({error})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: not a safetensors file (its header is not a mapping)")
    return length, size, header


class SafetensorsReader:
    """The tensors of an HF safetensors checkpoint: a directory with model.safetensors or
    model.safetensors.index.json and its shards, a .safetensors file, or an index file.

    Every file's header is read when constructed (names, dtypes, shapes and byte offsets) and
    every name the index lists is checked. read() then reads exactly the bytes of the elements
    asked for (positioned reads): no file is mapped, so a rank that reads its 1/N slices holds
    those and nothing else, and RLIMIT_DATA or a cgroup limit never sees a whole file.
    `keys`: the tensor names; `file_of`: name -> file. Raises CheckpointError naming the file
    and the key.
    """

    def __init__(self, path):
        if sys.byteorder != "little":
            raise NotImplementedError("reading safetensors on a big-endian host")
        self.path = os.fspath(path)
        self._files: dict[str, object] = {}  # file -> open handle (unbuffered)
        self._headers: dict[str, tuple[int, dict]] = {}  # file -> read_header(file)
        self.file_of = self._weight_map()
        self.keys = list(self.file_of)
        self.bytes_read = 0  # bytes read by read() so far
        self.largest_read = 0  # bytes of the largest single read

    def _weight_map(self) -> dict[str, str]:
        path = self.path
        if os.path.isdir(path):
            index, single = os.path.join(path, INDEX_FILE), os.path.join(path, SINGLE_FILE)
            if os.path.isfile(index):
                return self._read_index(index)
            if os.path.isfile(single):
                return dict.fromkeys(sorted(self._header(single)), single)
            raise CheckpointError(
                f"{path} holds neither {SINGLE_FILE} nor {INDEX_FILE}: zero reads Hugging Face "
                "safetensors checkpoints (not pytorch_model.bin); save_pretrained writes them"
            )
        if path.endswith(".json"):
            return self._read_index(path)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} does not exist")
        return dict.fromkeys(sorted(self._header(path)), path)

    def _read_index(self, index: str) -> dict[str, str]:
        try:
            with open(index) as handle:
                weight_map = json.load(handle)["weight_map"]
            files = {str(k): os.path.join(os.path.dirname(index), v) for k, v in weight_map.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise CheckpointError(f"{index}: not a safetensors index ({error})") from None
        for key, file in files.items():
            if key not in self._header(file):
                raise CheckpointError(f"{file}: tensor '{key}' that {index} lists is missing")
        return files

    def _header(self, file: str) -> dict:
        """{name: (dtype, shape, begin, end)} of a file."""
        if file not in self._headers:
            if not os.path.isfile(file):
                raise CheckpointError(f"{file} is missing")
            self._headers[file] = read_header(file)
        return self._headers[file][1]

    def shape(self, key: str) -> tuple:
        return self._header(self.file_of[key])[key][1]

    def dtype(self, key: str) -> torch.dtype:
        return self._header(self.file_of[key])[key][0]

    def read(self, key: str, begin: int, end: int) -> torch.Tensor:
        """Elements [begin, end) of the flattened tensor `key`: (end - begin,) in the file's
        dtype, on the host, read from the file and nothing around them."""
        value = torch.empty(end - begin, dtype=self.dtype(key))
        self.read_into(key, begin, value)
        return value

    def read_into(self, key: str, begin: int, out: torch.Tensor) -> None:
        """Elements [begin, begin + out.numel()) of the flattened tensor `key` straight into
        `out` (1-D, contiguous, on the host, of the file's dtype; a slice of a larger tensor
        works): no buffer in between. Raises CheckpointError for a file that ends early."""
        file = self.file_of[key]
        data_start = self._headers[file][0]
        dtype, _, offset, _ = self._header(file)[key]
        assert out.dtype == dtype and out.is_contiguous() and out.device.type == "cpu", out
        size = out.numel() * dtype.itemsize
        if size:
            if file not in self._files:
                self._files[file] = open(file, "rb", buffering=0)  # noqa: SIM115 (closed by close())
            handle = self._files[file]
            handle.seek(data_start + offset + begin * dtype.itemsize)
            view, done = memoryview(out.view(torch.uint8).numpy()), 0
            while done < size:
                count = handle.readinto(view[done:])
                if not count:
                    raise CheckpointError(f"{file}: tensor '{key}' ends early (truncated?)")
                done += count
        self.bytes_read += size
        self.largest_read = max(self.largest_read, size)

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files.clear()


class ShardedWriter:
    """Writes tensors, in the order of `entries` ([(name, shape, dtype)]), into safetensors
    files of at most `max_shard_bytes` each (a larger tensor gets a file of its own; None: one
    file), in `directory`: `file_name` when one file holds everything, else
    <stem>-0000i-of-0000n.safetensors (stem: file_name without .safetensors) and `index_name`
    ({"metadata": {"total_size": bytes}, "weight_map": {name: file}}). The defaults are Hugging
    Face's names: model.safetensors, model-0000i-of-0000n.safetensors,
    model.safetensors.index.json. Every writer of safetensors outside a checkpoint's own files
    is this one: save_pretrained, zero-to-fp32, save_consolidated.

    write(name, value) takes the next entry's value (any device; cast to the entry's dtype) and
    writes its bytes at once, so the writer holds no tensor and the caller holds one at a time;
    close() finishes and returns the file names written (index last). Raises ValueError for a
    value out of order or of the wrong shape, NotImplementedError for a dtype safetensors has no
    name for.
    """

    def __init__(
        self,
        directory: str,
        entries: list,
        max_shard_bytes: int | None,
        file_name: str = SINGLE_FILE,
        index_name: str | None = None,
    ):
        if sys.byteorder != "little":
            raise NotImplementedError("writing safetensors on a big-endian host")
        for name, _, dtype in entries:
            if dtype not in SAFETENSORS_DTYPES:
                raise NotImplementedError(f"'{name}': dtype {dtype} cannot be saved as safetensors")
        self.directory = directory
        self.groups = _split(entries, max_shard_bytes)
        n = len(self.groups)
        stem = file_name.removesuffix(".safetensors")
        self.names = [file_name] if n == 1 else [_shard_name(stem, i, n) for i in range(n)]
        self.index_name = index_name or f"{file_name}.index.json"
        self._queue = [(i, e) for i, group in enumerate(self.groups) for e in group]
        self._next = 0
        self._open_index = -1
        self._handle = None

    def write(self, name: str, value: torch.Tensor) -> None:
        if self._next >= len(self._queue) or self._queue[self._next][1][0] != name:
            expected = self._queue[self._next][1][0] if self._next < len(self._queue) else None
            raise ValueError(f"ShardedWriter: got '{name}', expected '{expected}'")
        index, (_, shape, dtype) = self._queue[self._next]
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"'{name}' has shape {tuple(value.shape)}, expected {tuple(shape)}")
        self._open_until(index)
        data = value.detach().to("cpu", dtype).contiguous().reshape(-1)
        if data.numel():
            self._handle.write(data.view(torch.uint8).numpy().data)
        self._next += 1

    def close(self) -> list[str]:
        if self._next != len(self._queue):
            raise ValueError(f"ShardedWriter: {len(self._queue) - self._next} tensors not written")
        self._open_until(len(self.groups) - 1)
        self._close_file()
        if len(self.groups) > 1:
            weight_map = {e[0]: self.names[i] for i, group in enumerate(self.groups) for e in group}
            total = sum(_nbytes(e) for group in self.groups for e in group)
            weight_map = dict(sorted(weight_map.items()))
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            path = os.path.join(self.directory, self.index_name)
            with open(path, "w") as handle:
                json.dump(index, handle, indent=2)
                handle.flush()
                os.fsync(handle.fileno())
            return [*self.names, self.index_name]
        return list(self.names)

    def _open_until(self, index: int) -> None:
        """Finish the open file and open (header written) the files up to `index`."""
        while self._open_index < index:
            self._close_file()
            self._open_index += 1
            path = os.path.join(self.directory, self.names[self._open_index])
            self._handle = open(path, "wb")  # noqa: SIM115 (open across write() calls)
            self._handle.write(_header(self.groups[self._open_index]))

    def _close_file(self) -> None:
        if self._handle is not None:
            self._handle.flush()
            os.fsync(self._handle.fileno())
            self._handle.close()
            self._handle = None


def _nbytes(entry) -> int:
    _, shape, dtype = entry
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _split(entries: list, max_bytes: int | None) -> list[list]:
    """Consecutive groups of at most max_bytes (a larger entry alone; None: one group); at
    least one group."""
    groups, size = [[]], 0
    for entry in entries:
        nbytes = _nbytes(entry)
        if groups[-1] and max_bytes is not None and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += nbytes
    return groups


def _shard_name(stem: str, i: int, n: int) -> str:
    return f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors"


def _header(entries: list) -> bytes:
    header = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry in entries:
        name, shape, dtype = entry
        end = offset + _nbytes(entry)
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, end],
        }
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw
