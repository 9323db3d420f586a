"""A meta.json far larger than its checkpoint's tensor files is refused before it is parsed
([Note: meta.json size bound] in engine/checkpoint/reader.py); a real one loads."""

import json
import shutil
from pathlib import Path

import pytest

from zero.checkpoint import CheckpointError
from zero.checkpoint.reader import _META_BASE_BYTES, read_meta

SAVED = Path(__file__).parent / "data" / "zero-0.1.0" / "stage2" / "step2"


def test_a_meta_json_far_larger_than_its_tensor_files_fails_before_parsing(tmp_path):
    path = tmp_path / "step2"
    shutil.copytree(SAVED, path)
    meta = json.loads((path / "meta.json").read_text())
    assert read_meta(str(path))["tag"] == "step2"
    limit = _META_BASE_BYTES + sum(f.stat().st_size for f in path.glob("*.safetensors"))
    # a client_state of 130,000 keys, schema-valid: 5 million (75 MiB) take minutes to validate
    keys = ",".join(f'"k{i}":0' for i in range(limit // 8))
    text = json.dumps(meta).replace('"client_state": {}', '"client_state": {' + keys + "}")
    (path / "meta.json").write_text(text)
    with pytest.raises(CheckpointError) as info:
        read_meta(str(path))
    assert str(info.value).startswith(f"{path / 'meta.json'}: more than {limit:,} bytes")
    assert "load another checkpoint" in str(info.value)


def test_a_client_state_too_large_to_load_is_refused_when_saved():
    from zero.checkpoint.writer import CLIENT_STATE_BYTES, _check_json_size

    _check_json_size({"losses": [0.5] * 1000}, "client_state")
    with pytest.raises(CheckpointError, match="write large data to a file of your own"):
        _check_json_size({"ids": list(range(CLIENT_STATE_BYTES // 4))}, "client_state")
    assert CLIENT_STATE_BYTES <= _META_BASE_BYTES // 2
