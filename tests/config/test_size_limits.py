"""Config sources far larger than any real config fail at once, naming the file and the limit
([Note: size limits] in engine/config/parse.py): a YAML alias bomb, a file over 256 KiB, more
than 5,000 values in a file or a mapping (a Python one whose lists share one object too), and
zero.Init's own reading of a config file."""

import pytest
import yaml

import zero
from zero.config import ConfigError, load_config
from zero.config.parse import _MAX_FILE_BYTES, _MAX_VALUES


def alias_bomb(levels: int = 9) -> str:
    """The "billion laughs": each level a list of nine aliases to the one before (9**levels
    strings from about 500 bytes)."""
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "train_micro_batch_size_per_gpu: 1\n" + "\n".join(lines) + "\n"


def merge_bomb(levels: int = 9) -> str:
    """The same with merge keys: each mapping merges nine copies of the one before."""
    lines = ["a0: &a0 {x: 1, y: 2}"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} {{<<: [" + ", ".join([f"*a{i - 1}"] * 9) + "]}")
    return "train_micro_batch_size_per_gpu: 1\n" + "\n".join(lines) + "\n"


def error_of(path) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return str(info.value)


@pytest.mark.parametrize(
    "name, text",
    [
        ("bomb.yaml", alias_bomb()),
        ("merge.yaml", merge_bomb()),
        ("many.yaml", "amp:\n" + "".join(f"  k{i}: {i}\n" for i in range(_MAX_VALUES))),
        ("many.json", '{"amp": [' + ", ".join(["[]"] * _MAX_VALUES) + "]}"),
        ("many.hjson", "{amp: {" + "\n".join(f"k{i}: {i}" for i in range(_MAX_VALUES)) + "}}"),
    ],
)
def test_too_many_values_name_the_file_and_the_limit(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    message = error_of(path)
    assert message.startswith(f"config file '{path}': more than 5,000 values"), message


def test_an_alias_bomb_stops_the_yaml_composer(tmp_path, monkeypatch):
    """The bomb never reaches construction: nothing 387 million strings long is built."""
    constructed = []
    real = yaml.SafeLoader.construct_document
    monkeypatch.setattr(
        yaml.SafeLoader, "construct_document", lambda self, node: constructed.append(1)
    )
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb())
    assert "more than 5,000 values" in error_of(path)
    assert constructed == []
    monkeypatch.setattr(yaml.SafeLoader, "construct_document", real)
    path.write_text(alias_bomb(levels=3))  # 729 strings: aliases within the limit still work
    with pytest.raises(ConfigError, match="unknown key 'a0'"):
        load_config(path)


def test_a_shared_list_in_a_mapping_counts_every_time_it_appears():
    bomb: list = ["lol"] * 9
    for _ in range(8):
        bomb = [bomb] * 9
    with pytest.raises(ConfigError, match=r"^config: more than 5,000 values .*'amp\.x\."):
        load_config({"train_micro_batch_size_per_gpu": 1, "amp": {"x": bomb}})


def test_a_file_over_the_size_limit_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "huge.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 1, "x": "' + "a" * _MAX_FILE_BYTES + '"}')
    message = error_of(path)
    assert f"more than the {_MAX_FILE_BYTES:,} a config may have" in message
    assert message.startswith(f"config file '{path}': ")


def test_zero_init_reads_its_config_file_with_the_same_limits(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb())
    with (
        pytest.raises(ConfigError, match="more than 5,000 values"),
        zero.Init(config_dict_or_path=str(path)),
    ):
        pass
