"""SafetensorsReader: positioned reads of exactly the elements asked for (no file mapped),
checked against safetensors' own reader; malformed headers and truncated files are refused
with the file and the tensor named."""

import json
import resource
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from zero.checkpoint.format import CheckpointError
from zero.checkpoint.safetensors_io import SafetensorsReader


@pytest.fixture
def saved(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(7, 5, generator=g),
        "b": torch.randn(11, generator=g).to(torch.bfloat16),
        "c": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    return path


def test_reads_exact_element_ranges(saved):
    want = load_file(str(saved))
    reader = SafetensorsReader(saved.parent)
    assert sorted(reader.keys) == sorted(want)
    for key, value in want.items():
        flat = value.reshape(-1)
        assert reader.shape(key) == tuple(value.shape)
        for begin, end in ((0, flat.numel()), (3, min(9, flat.numel())), (0, 0)):
            if end < begin:
                continue
            before = reader.bytes_read
            got = reader.read(key, begin, end)
            assert got.dtype == value.dtype and torch.equal(got, flat[begin:end])
            assert reader.bytes_read - before == (end - begin) * value.element_size()
    reader.close()


def test_malformed_and_truncated_files_are_refused(saved, tmp_path):
    data = saved.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[:-8])
    with pytest.raises(CheckpointError, match="tensor .* outside the file"):
        SafetensorsReader(truncated)
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 2**40) + data[8:])
    with pytest.raises(CheckpointError, match="header claims"):
        SafetensorsReader(huge)
    header = json.loads(data[8 : 8 + length])
    header["a"]["shape"] = [7, 6]
    text = json.dumps(header).encode()
    wrong = tmp_path / "wrong.safetensors"
    wrong.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length :])
    with pytest.raises(CheckpointError, match="'a' holds 140 bytes"):
        SafetensorsReader(wrong)


def test_reads_under_a_data_limit_smaller_than_the_file(tmp_path):
    """A 32 MiB file read in 1 MiB pieces while this process may take only 16 MiB more private
    memory: nothing maps the file (safetensors' safe_open fails to map it here)."""
    from zero.planning.budget import _private_bytes

    path = tmp_path / "big.safetensors"
    save_file({"w": torch.ones(8 * 2**20)}, str(path))
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    reader = SafetensorsReader(path)
    resource.setrlimit(resource.RLIMIT_DATA, (_private_bytes() + 16 * 2**20, hard))
    try:
        total = sum(float(reader.read("w", i, i + 2**18).sum()) for i in range(0, 2**23, 2**18))
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
        reader.close()
    assert total == 8 * 2**20
