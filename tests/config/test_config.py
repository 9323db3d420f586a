"""Tests for zero.config: loading, validation messages, batch derivation, "auto", deprecations."""

import json
import logging
import warnings
from pathlib import Path

import pydantic
import pytest
import torch

from zero.config import Config, ConfigError, load_config, settings_without_effect

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.json"))
MICRO = {"train_micro_batch_size_per_gpu": 4}


def load(extra: dict, **kwargs) -> Config:
    return load_config({**MICRO, **extra}, **kwargs)


def error_of(extra: dict, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load(extra, **kwargs)
    return str(info.value)


# ---- sources ---------------------------------------------------------------------------------


def test_json_with_comments(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(
        '{\n  // micro-batch per rank\n  "train_micro_batch_size_per_gpu": 8,\n'
        '  # hash comment\n  "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8,},\n}\n'
    )
    config = load_config(path, world_size=2)
    assert config.train_batch_size == 16
    assert config.zero.stage == 2
    assert config.zero.reduce_bucket_size == 500_000_000
    assert isinstance(config.zero.reduce_bucket_size, int)


def test_hjson_file(tmp_path):
    path = tmp_path / "c.hjson"
    path.write_text("{\n  train_batch_size: 12\n  fp16: {enabled: true}\n}\n")
    config = load_config(str(path), world_size=3)
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu) == (12, 4)
    assert config.compute_dtype is torch.float16


def test_yaml_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "train_micro_batch_size_per_gpu: 2\ngradient_accumulation_steps: 3\n"
        "zero_optimization:\n  stage: 1\n  reduce_bucket_size: 5e8  # a string in YAML 1.1\n"
    )
    config = load_config(path)
    assert config.train_batch_size == 6
    assert config.zero.reduce_bucket_size == 500_000_000


@pytest.mark.parametrize(
    "name, text, key",
    [
        (
            "dup.json",
            '{"train_micro_batch_size_per_gpu": 4, "train_micro_batch_size_per_gpu": 8}',
            "'train_micro_batch_size_per_gpu'",
        ),
        (
            "dup.hjson",
            "{train_micro_batch_size_per_gpu: 4, zero_optimization: {stage: 1, stage: 2}}",
            "'zero_optimization.stage'",
        ),
        (
            "dup.json",
            '{"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", '
            '"params": {"lr": 0.1, "lr": 0.2}}}',
            "'optimizer.params.lr'",
        ),
        (
            "dup.yaml",
            "train_micro_batch_size_per_gpu: 4\nzero_optimization:\n  stage: 1\n  stage: 2\n",
            "'zero_optimization.stage'",
        ),
        ("dup.yml", "train_batch_size: 8\ntrain_batch_size: 16\n", "'train_batch_size'"),
    ],
)
def test_duplicate_keys_are_errors_naming_key_and_file(tmp_path, name, text, key):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert name in message
    assert f"key {key} is given more than once" in message


@pytest.mark.parametrize(
    "text, key",
    [
        ("train_micro_batch_size_per_gpu: 010\n", "train_micro_batch_size_per_gpu: 010"),
        ("train_micro_batch_size_per_gpu: 4\ngradient_accumulation_steps: 1:30\n", "1:30"),
        ("train_micro_batch_size_per_gpu: 0b11\n", "0b11"),
        ("train_micro_batch_size_per_gpu: 4\nsteps_per_print: 1_000\n", "steps_per_print"),
        ("train_micro_batch_size_per_gpu: 4\noptimizer: {params: {lr: 1:30.5}}\n", "params.lr"),
    ],
)
def test_yaml_1_1_numbers_are_refused(tmp_path, text, key):
    # YAML 1.1 reads 010 as 8 and 1:30 as 90; YAML 1.2 and JSON do not (issue 42).
    message = file_error(tmp_path, "c.yaml", text)
    assert key in message and "YAML 1.1" in message


def test_yaml_numbers_follow_yaml_1_2(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "train_micro_batch_size_per_gpu: 0x10\ngradient_accumulation_steps: 0o10\n"
        "steps_per_print: 10\noptimizer: {type: SGD, params: {lr: .5, momentum: 1., "
        "weight_decay: '010'}}\n"
    )
    config = load_config(path)
    assert (config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == (16, 8)
    assert dict(config.optimizer.params) == {"lr": 0.5, "momentum": 1.0, "weight_decay": "010"}


def test_yaml_merge_key_may_be_overridden(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "train_micro_batch_size_per_gpu: 4\nzero_optimization:\n  stage: 3\n"
        "  offload_optimizer: &off {device: cpu, pin_memory: false}\n"
        "  offload_param:\n    <<: *off\n    pin_memory: true\n"
    )
    zero = load_config(path).zero
    assert (zero.offload_param.device, zero.offload_param.pin_memory) == ("cpu", True)


def test_yaml_exponent_without_dot_is_a_float(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "train_micro_batch_size_per_gpu: 4\n"
        "optimizer:\n  type: AdamW\n  params: {lr: 1e-3, eps: 1.0e-8, weight_decay: -2E+4}\n"
        "zero_optimization: {stage: 2, reduce_bucket_size: 5e8, allgather_bucket_size: '5e8'}\n"
    )
    config = load_config(path)
    params = dict(config.optimizer.params)
    assert params == {"lr": 1e-3, "eps": 1e-8, "weight_decay": -2e4}
    assert all(type(v) is float for v in params.values())
    assert config.zero.reduce_bucket_size == 500_000_000
    assert config.zero.allgather_bucket_size == 500_000_000


def test_dict_is_not_mutated():
    source = {**MICRO, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    before = json.dumps(source, sort_keys=True)
    load_config(source, auto_values={"optimizer.params.lr": 0.1})
    assert json.dumps(source, sort_keys=True) == before


def test_missing_file_names_it(tmp_path):
    path = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match="nope.json"):
        load_config(path)


@pytest.mark.parametrize(
    "name, text",
    [("bad.json", '{\n  "a": 1,\n  "b" 2\n}'), ("bad.yaml", "a: 1\nb: [1,\n")],
)
def test_parse_error_names_file_and_line(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert name in str(info.value)
    assert "line" in str(info.value)


def test_file_errors_start_with_file_name(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stag": 1}}')
    with pytest.raises(ConfigError, match=r"c\.json.*zero_optimization\.stag"):
        load_config(path)


def test_top_level_must_be_mapping(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(path)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
@pytest.mark.parametrize("world_size", [1, 2])
def test_shipped_configs_load(path, world_size):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = load_config(path, world_size=world_size)
    assert config.train_batch_size == 16 * world_size
    assert config.optimizer.type == "AdamW"
    assert config.scheduler.type == "WarmupLR"
    assert config.zero.reduce_bucket_size == 20_000_000
    json.dumps(config.to_dict())


def test_shipped_configs_cover_every_stage_and_dtype():
    names = {p.name for p in CONFIGS}
    assert {"zero0.json", "zero1.json", "zero2.json", "zero3.json"} <= names
    assert load_config(CONFIGS[0].parent / "zero2_bf16.json").compute_dtype is torch.bfloat16
    fp16 = load_config(CONFIGS[0].parent / "zero2_fp16.json")
    assert fp16.compute_dtype is torch.float16 and fp16.loss_scaling_dynamic


# ---- batch derivation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "given, world_size, expected",
    [
        ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4}, 3, (24, 4, 2)),
        ({"train_batch_size": 24, "gradient_accumulation_steps": 2}, 3, (24, 4, 2)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 3, (24, 4, 2)),
        ({"train_batch_size": 24}, 3, (24, 8, 1)),
        ({"train_micro_batch_size_per_gpu": 4}, 3, (12, 4, 1)),
        (
            {
                "train_batch_size": 24,
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 2,
            },
            3,
            (24, 4, 2),
        ),
        ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}, 1, (8, 2, 4)),
    ],
)
def test_batch_derivation(given, world_size, expected):
    config = load_config(given, world_size=world_size)
    got = (
        config.train_batch_size,
        config.train_micro_batch_size_per_gpu,
        config.gradient_accumulation_steps,
    )
    assert got == expected
    assert all(isinstance(v, int) for v in got)


def test_inconsistent_triple_shows_all_four_numbers():
    given = {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 5,
        "gradient_accumulation_steps": 7,
    }
    with pytest.raises(ConfigError) as info:
        load_config(given, world_size=3)
    message = str(info.value)
    for number in ("32", "5", "7", "3"):
        assert number in message
    assert "train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size" in message


@pytest.mark.parametrize(
    "given",
    [
        {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4},
        {"train_batch_size": 10, "gradient_accumulation_steps": 4},
        {"train_batch_size": 10},
    ],
)
def test_non_divisible_derivation(given):
    with pytest.raises(ConfigError, match="not divisible") as info:
        load_config(given, world_size=3)
    assert "world_size=3" in str(info.value)


@pytest.mark.parametrize("given", [{}, {"gradient_accumulation_steps": 2}])
def test_no_batch_size(given):
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu"):
        load_config(given)


def test_revalidate_existing_config_for_world_size():
    config = load_config({"train_micro_batch_size_per_gpu": 4}, world_size=1)
    assert config.train_batch_size == 4
    assert load_config(config, world_size=3).train_batch_size == 12


def test_bad_world_size():
    with pytest.raises(ConfigError, match="world_size"):
        load_config(MICRO, world_size=0)


# ---- what a bad config gets ------------------------------------------------------------------

INF, NAN = float("inf"), float("nan")
FINITE_FIX = "Write a finite number"


def file_error(tmp_path, name: str, text: "str | bytes") -> str:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert name in message
    return message


@pytest.mark.parametrize(
    "extra, key, shown",
    [
        (
            {"optimizer": {"type": "AdamW", "params": {"lr": INF}}},
            "optimizer.params.lr",
            "Infinity",
        ),
        ({"optimizer": {"type": "AdamW", "params": {"weight_decay": NAN}}}, "weight_decay", "NaN"),
        ({"optimizer": {"type": "SGD", "params": {"momentum": -INF}}}, "momentum", "-Infinity"),
        ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, NAN]}}}, "betas.1", "NaN"),
        (
            {"scheduler": {"type": "OneCycle", "params": {"gamma": INF}}},
            "scheduler.params.gamma",
            "",
        ),
        ({"fp16": {"enabled": True, "loss_scale": INF}}, "fp16.loss_scale", "Infinity"),
        ({"fp16": {"enabled": True, "min_loss_scale": INF}}, "fp16.min_loss_scale", ""),
        ({"gradient_clipping": INF}, "gradient_clipping", "Infinity"),
        ({"flops_profiler": {"recompute_fwd_factor": INF}}, "recompute_fwd_factor", ""),
        ({"amp": {"loss_scale": NAN}}, "amp.loss_scale", "NaN"),  # unsupported, free-form
        ({"optimizer": {"type": "SGD", "params": {"lr": "NaN"}}}, "optimizer.params.lr", '"NaN"'),
    ],
)
def test_non_finite_numbers_are_refused_everywhere(extra, key, shown):
    message = error_of(extra)
    assert "invalid value for '" in message and key in message
    assert shown in message
    assert FINITE_FIX in message


@pytest.mark.parametrize(
    "name, text, key",
    [
        ("c.yaml", "optimizer: {type: SGD, params: {lr: .inf}}\n", "optimizer.params.lr"),
        ("c.yaml", "scheduler: {type: OneCycle, params: {gamma: .nan}}\n", "scheduler.params"),
        ("c.yml", "fp16: {enabled: true, loss_scale: .Inf}\n", "fp16.loss_scale"),
        ("c.json", '{"optimizer": {"type": "SGD", "params": {\n"lr": Infinity\n}}}', "params.lr"),
        ("c.json", '{"optimizer": {"type": "SGD", "params": {\n"lr": NaN\n}}}', "params.lr"),
        ("c.hjson", "{\noptimizer: {type: 'SGD', params: {\nmomentum: -Infinity\n}}}", "momentum"),
        ("c.json", '{"zero_optimization": {"reduce_bucket_size": 1e400}}', "reduce_bucket_size"),
        ("c.hjson", "{\nzero_optimization: {reduce_bucket_size: 1e400}\n}", "reduce_bucket_size"),
        ("c.yaml", "zero_optimization: {reduce_bucket_size: 1e400}\n", "reduce_bucket_size"),
        ("c.json", '{"optimizer": {"type": "SGD", "params": {"lr": -1e400}}}', "params.lr"),
    ],
)
def test_non_finite_numbers_in_files_name_file_and_key(tmp_path, name, text, key):
    if name.endswith((".yaml", ".yml")):
        text = "train_micro_batch_size_per_gpu: 4\n" + text
    else:
        text = '{"train_micro_batch_size_per_gpu": 4,\n' + text[1:]
    message = file_error(tmp_path, name, text)
    assert key in message
    assert FINITE_FIX in message


def test_json_infinity_on_one_line_says_why_it_does_not_parse(tmp_path):
    # hjson reads a bare word up to the end of the line, so the closing braces are lost.
    text = (
        '{"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": NaN}}}'
    )
    message = file_error(tmp_path, "c.json", text)
    assert "line 1" in message
    assert "Infinity and NaN are not accepted" in message


def test_infinity_as_text_in_a_float_field_is_refused():
    message = error_of({"fp16": {"enabled": True, "loss_scale": "inf"}})
    assert "fp16.loss_scale" in message and "finite" in message


@pytest.mark.parametrize("power, ok", [(63, True), (64, False), (2000, False)])
def test_initial_scale_power_is_bounded(power, ok):
    extra = {"fp16": {"enabled": True, "initial_scale_power": power}}
    if ok:
        assert load(extra).fp16.initial_scale_power == power
    else:
        message = error_of(extra)
        assert "fp16.initial_scale_power" in message and "at most 63" in message
        assert "65504" in message  # the description says why


@pytest.mark.parametrize(
    "extra, key",
    [
        ({"train_micro_batch_size_per_gpu": 2**63}, "train_micro_batch_size_per_gpu"),
        ({"zero_optimization": {"reduce_bucket_size": 10**100}}, "reduce_bucket_size"),
        ({"zero_optimization": {"reduce_bucket_size": 1e300}}, "reduce_bucket_size"),
        ({"fp16": {"loss_scale_window": 2**64}}, "fp16.loss_scale_window"),
    ],
)
def test_counts_and_sizes_fit_in_int64(extra, key):
    message = error_of(extra)
    assert key in message and "2**63 - 1" in message


@pytest.mark.parametrize(
    "extra, key",
    [
        ({"gradient_clipping": True}, "gradient_clipping"),
        ({"fp16": {"enabled": True, "min_loss_scale": True}}, "fp16.min_loss_scale"),
        ({"fp16": {"loss_scale": False}}, "fp16.loss_scale"),
        ({"agreement_timeout": True}, "agreement_timeout"),
    ],
)
def test_booleans_are_not_numbers(extra, key):
    message = error_of(extra)
    assert key in message and "not true or false" in message


def test_largest_int64_size_loads():
    config = load({"zero_optimization": {"reduce_bucket_size": 2**63 - 1}})
    assert config.zero.reduce_bucket_size == 2**63 - 1


def test_config_path_that_is_a_directory(tmp_path):
    path = tmp_path / "conf.json"
    path.mkdir()
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "conf.json" in str(info.value) and "is a directory" in str(info.value)


def test_unreadable_path_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config(tmp_path / ("x" * 5000 + ".json"))  # name too long for the file system


def nested(levels: int) -> object:
    value: object = 1
    for _ in range(levels):
        value = {"a": value}
    return value


def test_nesting_limit_is_100_levels():
    load({"amp": nested(99)})  # the top-level mapping is level 1, so 100 levels in all
    message = error_of({"amp": nested(100)})
    assert "more than 100 levels deep at 'amp.a.a.a.a.a...'" in message


def test_mapping_that_contains_itself():
    loop: dict = {}
    loop["a"] = loop
    assert "more than 100 levels deep" in error_of({"amp": loop})


@pytest.mark.parametrize(
    "name, text",
    [
        ("deep.json", '{"amp": ' + '{"a": ' * 5000 + "1" + "}" * 5000 + "}"),
        ("deep.json", '{"amp": {"a": ' + "[" * 5000 + "]" * 5000 + "}}"),
        ("deep.hjson", "{amp: " + "{a: " * 5000 + "1" + "}" * 5000 + "}"),
        ("deep.yaml", "amp: " + "{a: " * 5000 + "1" + "}" * 5000 + "\n"),
        ("deep.yaml", "amp: " + "[" * 1000 + "]" * 1000 + "\n"),  # PyYAML scans this slowly
        ("deep.json", '{"amp": ' + '{"a": ' * 150 + "1" + "}" * 150 + "}"),  # past our walk only
        ("loop.yaml", "amp: &loop {a: *loop}\n"),
    ],
)
def test_deep_nesting_in_files_names_file_and_limit(tmp_path, name, text):
    assert "more than 100 levels deep" in file_error(tmp_path, name, text)


@pytest.mark.parametrize(
    "name, raw, where",
    [
        (
            "latin1.json",
            b'{\n  "train_micro_batch_size_per_gpu": 4,\n  "wandb": {"project": "caf\xe9"}\n}',
            "byte 0xe9 at line 3, column 28 (byte offset 68)",
        ),
        (  # the column counts characters: the e-acute before it is two bytes
            "after_utf8.yaml",
            b"train_micro_batch_size_per_gpu: 4\nwandb: {project: \xc3\xa9t\xe9}\n",
            "byte 0xe9 at line 2, column 20 (byte offset 54)",
        ),
        ("utf16.json", '{"train_micro_batch_size_per_gpu": 4}'.encode("utf-16"), "UTF-16"),
    ],
)
def test_file_not_utf8_names_file_line_and_byte(tmp_path, name, raw, where):
    message = file_error(tmp_path, name, raw)
    assert "not UTF-8" in message and where in message
    assert "Save the file as UTF-8" in message


@pytest.mark.parametrize(
    "text, key",
    [
        ("1: 2\n", "key 1 at the top level"),
        ("~: 2\n", "key None at the top level"),
        ("optimizer: {type: SGD, params: {true: 1}}\n", "key True in 'optimizer.params'"),
        ("amp: {2020-01-01: 1}\n", "key datetime.date(2020, 1, 1) in 'amp'"),
    ],
)
def test_yaml_keys_that_are_not_strings(tmp_path, text, key):
    message = file_error(tmp_path, "c.yaml", "train_micro_batch_size_per_gpu: 4\n" + text)
    assert key in message and "not a string" in message and "quote it" in message


@pytest.mark.parametrize(
    "name, text",
    [
        ("c.json", '{"train_micro_batch_size_per_gpu": ' + "9" * 5000 + "}"),
        ("c.yaml", "train_micro_batch_size_per_gpu: " + "9" * 5000 + "\n"),
        ("c.yaml", "train_micro_batch_size_per_gpu: 4\nwandb: {project: 2020-13-45}\n"),
    ],
)
def test_values_the_parser_cannot_build(tmp_path, name, text):
    message = file_error(tmp_path, name, text)
    assert "a value cannot be read" in message
    assert "set_int_max_str_digits" not in message  # Python's advice, not a config fix


def test_long_values_are_cut_in_messages():
    message = error_of({"zero_optimization": {"reduce_bucket_size": "9" * 100_000}})
    assert "zero_optimization.reduce_bucket_size" in message
    assert len(message) < 1000 and "(100002 characters)" in message


@pytest.mark.parametrize("hidden", ["768", 768.0, INF, 0, True])
def test_bad_hidden_size_in_auto_values(hidden):
    extra = {"zero_optimization": {"reduce_bucket_size": "auto"}}
    message = error_of(extra, auto_values={"hidden_size": hidden})
    assert "auto_values['hidden_size']" in message


def test_auto_values_must_be_a_mapping():
    with pytest.raises(ConfigError, match="auto_values must be a mapping"):
        load({}, auto_values=[("optimizer.params.lr", 0.1)])


def test_auto_filled_values_are_checked_too():
    extra = {"optimizer": {"type": "SGD", "params": {"lr": "auto"}}}
    message = error_of(extra, auto_values={"optimizer.params.lr": NAN})
    assert "optimizer.params.lr" in message and FINITE_FIX in message


# ---- unknown keys ----------------------------------------------------------------------------


def test_unknown_top_level_key():
    message = error_of({"gradient_clippin": 1.0})
    assert "unknown key 'gradient_clippin'" in message
    assert "Did you mean 'gradient_clipping'?" in message


def test_unknown_nested_key():
    message = error_of({"zero_optimization": {"stag": 2}})
    assert "unknown key 'zero_optimization.stag'" in message
    assert "Did you mean 'stage'?" in message


def test_unknown_deeply_nested_key():
    message = error_of({"zero_optimization": {"stage": 1, "offload_optimizer": {"devise": "cpu"}}})
    assert "zero_optimization.offload_optimizer.devise" in message
    assert "'device'" in message


def test_unknown_key_without_close_match_lists_valid_keys():
    message = error_of({"bf16": {"xyzzy": 1}})
    assert "unknown key 'bf16.xyzzy'" in message
    assert "enabled" in message


def test_one_message_without_pydantic_dump():
    message = error_of({"fp16": {"enabled": "maybe"}, "zero_optimization": {"stage": 9}})
    assert "fp16.enabled" in message and "zero_optimization.stage" in message
    assert "pydantic" not in message and "errors.pydantic.dev" not in message


# ---- invalid values --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, key",
    [
        ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage"),
        ({"zero_optimization": {"stage": -1}}, "zero_optimization.stage"),
        ({"zero_optimization": {"reduce_bucket_size": 0}}, "zero_optimization.reduce_bucket_size"),
        (
            {"zero_optimization": {"reduce_bucket_size": -5}},
            "zero_optimization.reduce_bucket_size",
        ),
        (
            {"zero_optimization": {"reduce_bucket_size": 5.5e2 + 0.25}},
            "zero_optimization.reduce_bucket_size",
        ),
        (
            {"zero_optimization": {"allgather_bucket_size": 0}},
            "zero_optimization.allgather_bucket_size",
        ),
        (
            {"zero_optimization": {"stage3_prefetch_bucket_size": -1}},
            "zero_optimization.stage3_prefetch_bucket_size",
        ),
        (
            {"zero_optimization": {"stage3_param_persistence_threshold": 1.5}},
            "zero_optimization.stage3_param_persistence_threshold",
        ),
        ({"zero_optimization": {"sub_group_size": 0}}, "zero_optimization.sub_group_size"),
        (
            {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "gpu"}}},
            "zero_optimization.offload_optimizer.device",
        ),
        (
            {"zero_optimization": {"stage": 1, "offload_optimizer": {"ratio": 2}}},
            "zero_optimization.offload_optimizer.ratio",
        ),
        ({"gradient_clipping": -1.0}, "gradient_clipping"),
        ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu"),
        ({"gradient_accumulation_steps": 2.5}, "gradient_accumulation_steps"),
        ({"steps_per_print": 0}, "steps_per_print"),
        ({"fp16": {"loss_scale": -1}}, "fp16.loss_scale"),
        ({"fp16": {"hysteresis": 0}}, "fp16.hysteresis"),
        ({"fp16": {"min_loss_scale": 0}}, "fp16.min_loss_scale"),
        ({"data_types": {"grad_accum_dtype": "fp8"}}, "data_types.grad_accum_dtype"),
        ({"communication_data_type": "int8"}, "communication_data_type"),
        ({"checkpoint": {"tag_validation": "Maybe"}}, "checkpoint.tag_validation"),
        ({"optimizer": {"params": {"lr": 1}}}, "optimizer.type"),
        ({"optimizer": {"type": "AdamW", "params": [1]}}, "optimizer.params"),
        ({"zero_optimization": {"stage3_module_classes": ["Block", 3]}}, "stage3_module_classes"),
    ],
)
def test_invalid_value_names_key(extra, key):
    message = error_of(extra)
    assert key in message


def test_invalid_value_message_shows_value_and_fix():
    message = error_of({"zero_optimization": {"stage": 4}})
    assert "4" in message and "0, 1, 2, 3" in message
    message = error_of({"zero_optimization": {"reduce_bucket_size": 0}})
    assert "elements" in message


@pytest.mark.parametrize(
    "extra, keys",
    [
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, ["fp16.enabled", "bf16.enabled"]),
        (
            {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
            ["zero_optimization.offload_optimizer"],
        ),
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
            ["zero_optimization.offload_optimizer.device"],
        ),
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
            ["zero_optimization.offload_param.nvme_path"],
        ),
        (
            {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp16"}},
            ["data_types.grad_accum_dtype"],
        ),
        (
            {"fp16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}},
            ["data_types.grad_accum_dtype"],
        ),
        ({"data_types": {"grad_accum_dtype": "fp16"}}, ["data_types.grad_accum_dtype"]),
        ({"fp16": {"fp16_master_weights_and_grads": True}}, ["fp16.fp16_master_weights_and_grads"]),
    ],
)
def test_cross_field_rules(extra, keys):
    message = error_of(extra)
    for key in keys:
        assert key in message


def test_grad_accum_dtype_message_lists_each_allowed_value_once():
    message = error_of({"data_types": {"grad_accum_dtype": "bf16"}})
    assert "use 'fp32'." in message
    assert "'fp32' or 'fp32'" not in message
    message = error_of({"fp16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}})
    assert "use 'fp32' or 'fp16' (the compute dtype)" in message


def test_valid_combinations():
    config = load(
        {
            "bf16": {"enabled": True},
            "data_types": {"grad_accum_dtype": "bf16"},
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "nvme", "nvme_path": "/tmp"},
                "offload_optimizer": {"device": "cpu", "pin_memory": True},
            },
        }
    )
    assert config.grad_accum_dtype is torch.bfloat16
    assert config.zero.offload_param.device == "nvme"
    assert load({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}})


# ---- defaults and derived helpers ------------------------------------------------------------


def test_defaults():
    config = load({})
    assert config.gradient_clipping == 1.0
    assert config.steps_per_print == 10
    assert config.zero.stage == 0
    assert config.zero.reduce_bucket_size == 500_000_000
    assert config.zero.allgather_bucket_size == 500_000_000
    assert config.zero.stage3_prefetch_bucket_size == 50_000_000
    assert config.zero.contiguous_gradients and config.zero.reduce_scatter
    assert config.fp16.initial_scale_power == 16 and config.fp16.hysteresis == 2
    assert config.optimizer is None and config.scheduler is None
    assert config.compute_dtype is torch.float32
    assert config.grad_accum_dtype is torch.float32
    assert not config.loss_scaling_dynamic


@pytest.mark.parametrize("stage, expected", [(0, False), (1, False), (2, False), (3, True)])
def test_overlap_comm_default_depends_on_stage(stage, expected):
    assert load({"zero_optimization": {"stage": stage}}).zero.overlap_comm is expected
    given = load({"zero_optimization": {"stage": stage, "overlap_comm": not expected}})
    assert given.zero.overlap_comm is (not expected)


def test_gradient_clipping_zero_disables():
    assert load({"gradient_clipping": 0}).gradient_clipping == 0


def test_precision_helpers():
    fp16 = load({"fp16": {"enabled": True}})
    assert fp16.compute_dtype is torch.float16 and fp16.loss_scaling_dynamic
    static = load({"fp16": {"enabled": True, "loss_scale": 128}})
    assert not static.loss_scaling_dynamic
    bf16 = load({"bf16": {"enabled": True}})
    assert bf16.compute_dtype is torch.bfloat16 and not bf16.loss_scaling_dynamic
    assert load({"data_types": {"grad_accum_dtype": "fp32"}}).grad_accum_dtype is torch.float32


def test_sizes_coerce_to_int():
    zero = load({"zero_optimization": {"reduce_bucket_size": 2e7, "stage": 2.0}}).zero
    assert zero.reduce_bucket_size == 20_000_000 and type(zero.reduce_bucket_size) is int
    assert zero.stage == 2 and type(zero.stage) is int


def test_to_dict_is_json_and_roundtrips():
    config = load(
        {
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95]}},
            "zero_optimization": {"stage": 3, "stage3_module_classes": ["Block"]},
        },
        world_size=2,
    )
    data = json.loads(json.dumps(config.to_dict()))
    assert data["train_batch_size"] == 8
    assert data["optimizer"]["params"]["betas"] == [0.9, 0.95]
    assert data["zero_optimization"]["overlap_comm"] is True
    assert load_config(data, world_size=2).to_dict() == data


def test_immutability():
    config = load({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95]}}})
    with pytest.raises(pydantic.ValidationError):
        config.gradient_clipping = 2.0
    with pytest.raises(pydantic.ValidationError):
        config.zero.stage = 3
    with pytest.raises(TypeError):
        config.optimizer.params["lr"] = 1.0
    assert config.optimizer.params["betas"] == (0.9, 0.95)
    assert dict(config.optimizer.params)["lr"] == 1e-3


# ---- deprecated names ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, old, check",
    [
        (
            {"zero_optimization": {"stage": 2, "cpu_offload": True}},
            "cpu_offload",
            lambda c: c.zero.offload_optimizer.device == "cpu",
        ),
        (
            {"zero_optimization": {"stage": 3, "cpu_offload_param": True}},
            "cpu_offload_param",
            lambda c: c.zero.offload_param.device == "cpu",
        ),
        (
            {
                "zero_optimization": {
                    "stage": 3,
                    "cpu_offload": True,
                    "cpu_offload_param": True,
                    "cpu_offload_use_pin_memory": True,
                }
            },
            "cpu_offload_use_pin_memory",
            lambda c: c.zero.offload_optimizer.pin_memory and c.zero.offload_param.pin_memory,
        ),
        (
            {"zero_optimization": {"stage3_gather_fp16_weights_on_model_save": True}},
            "stage3_gather_fp16_weights_on_model_save",
            lambda c: c.zero.stage3_gather_16bit_weights_on_model_save,
        ),
        ({"bfloat16": {"enabled": True}}, "bfloat16", lambda c: c.bf16.enabled),
        (
            {"zero_optimization": {"stage": 2, "cpu_offload": False}},
            "cpu_offload",
            lambda c: c.zero.offload_optimizer is None,
        ),
    ],
)
def test_deprecated_names(extra, old, check):
    with pytest.warns(FutureWarning) as record:
        config = load(extra)
    assert check(config)
    assert any(f"{old}' is deprecated" in str(w.message) for w in record)


def test_deprecated_and_new_name_together_is_error():
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match="bf16"):
        load({"bfloat16": {"enabled": True}, "bf16": {"enabled": True}})


def test_cpu_offload_false_means_no_offload_and_says_so():
    for value in (False, None):
        with pytest.warns(FutureWarning) as record:
            config = load({"zero_optimization": {"stage": 2, "cpu_offload": value}})
        assert config.zero.offload_optimizer is None
        (message,) = [str(w.message) for w in record]
        assert "means no offload" in message and "'cpu'" not in message


def test_cpu_offload_true_still_offloads_to_cpu():
    with pytest.warns(FutureWarning, match="offload_optimizer.device = 'cpu'"):
        config = load({"zero_optimization": {"stage": 2, "cpu_offload": True}})
    assert config.zero.offload_optimizer.device == "cpu"


@pytest.mark.parametrize("value", [True, False])
def test_cpu_offload_with_offload_optimizer_is_an_error_either_way(value):
    """DeepSpeed refuses the deprecated and the new name together, whatever the old one says."""
    zero_block = {"stage": 2, "cpu_offload": value, "offload_optimizer": {"device": "none"}}
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match="keep only"):
        load({"zero_optimization": zero_block})
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match="keep only"):
        load({"zero_optimization": {"stage": 3, "cpu_offload_param": value, "offload_param": {}}})


def test_stage3_keys_under_deepspeed_field_names():
    config = load({"zero_optimization": {"stage": 3, "max_live_parameters": 7}})
    assert config.zero.stage3_max_live_parameters == 7
    message = error_of(
        {"zero_optimization": {"prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 2}}
    )
    assert "keep only 'zero_optimization.stage3_prefetch_bucket_size'" in message


# Every DeepSpeed 0.19.8 key zero refused before, at DeepSpeed's default (or a value that leaves
# the feature off), in one config.
DEEPSPEED_DEFAULTS = {
    "zero_optimization": {
        "stage": 3,
        "memory_efficient_linear": True,
        "use_multi_rank_bucket_allreduce": True,
        "stage3_use_all_reduce_for_fetch_params": False,
        "stage3_allgather_sequential": False,
        "log_trace_cache_warnings": False,
        "override_module_apply": True,
        "legacy_stage1": False,
        "compute_grad_norm": True,
        "parameter_alignment": False,
        "pipeline_loading_checkpoint": False,
        "enable_sanity_checks": False,
        "save_muon_momentum_buffer_in_memory": False,
        "leaf_module": {"classes": [], "names": [], "name_suffixes": []},
        "zenflow": None,
        "offload_optimizer": {"device": "none", "super_offload": False, "cpuadam_cores_perc": 0.8},
    },
    "bf16": {
        "enabled": True,
        "check_grad_overflow": True,
        "bf16_master_weights_and_grads": False,
        "bf16_optimizer_states": False,
    },
    "data_types": {"param_dtype": "bf16", "buffer_dtype": None, "keep_in_fp32_modules": "auto"},
    "torch_autocast": {"enabled": False, "dtype": "bfloat16", "lower_precision_safe_modules": []},
    "dump_state": False,
    "disable_allgather": False,
    "disable_python_gc": False,
    "seq_parallel_communication_data_type": "fp32",
    "managed_gradient_accumulation": True,
    "gradient_allreduce_op": "mean",
    "vocabulary_size": None,
    "use_data_before_expert_parallelism": False,
    "log_level": None,
    "weight_quantization": {"enabled": False, "num_bits": 8},
    "expert_parallel": {"enabled": False, "autoep_size": 1},
    "comet": {"enabled": False, "samples_log_interval": 100, "project": None, "mode": None},
    "tensor_parallel": {"autotp_size": 0, "tp_overlap_comm": False, "tp": {"tp_size": 1}},
    "timers": {"throughput": {"enabled": True, "synchronized": True}},
    "datastates_ckpt": None,
    "checkpoint": {
        "tag_validation": "Warn",
        "parallel_write": {"pipeline_stage": False},
        "checkpoint_serialization": True,
        "writer": {"type": "fast", "io_buffer_size": 64 * 1024**2, "data_parallel": None},
    },
}


def test_deepspeed_keys_at_their_defaults_load_quietly():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = load(DEEPSPEED_DEFAULTS)
    assert config.zero.memory_efficient_linear and config.bf16.check_grad_overflow
    assert config.checkpoint.parallel_write.pipeline_stage is False
    assert config.checkpoint.writer.type == "FAST"
    assert config.tensor_parallel.autotp_size == 0 and not config.comet.enabled
    assert load({}).bf16.check_grad_overflow  # DeepSpeed's default is true
    assert settings_without_effect(config, model_parallel_world_size=1) == []


REFUSED = [
    ({"torch_autocast": {"enabled": True}}, "torch_autocast.enabled = true", "enabled: false"),
    (
        {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
        "bf16.bf16_master_weights_and_grads = true",
        "bf16_master_weights_and_grads: false",
    ),
    (
        {"bf16": {"enabled": True, "bf16_optimizer_states": True}},
        "bf16.bf16_optimizer_states = true",
        "bf16_optimizer_states: false",
    ),
    ({"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel.autotp_size = 2", "autotp_size: 0"),
    ({"tensor_parallel": {"tp": {"tp_size": 4}}}, "tensor_parallel.tp = {", "tp: {}"),
    ({"weight_quantization": {"num_bits": 8}}, "weight_quantization = {", '"enabled": false'),
    ({"expert_parallel": {"enabled": True}}, "expert_parallel = {", '"enabled": false'),
    (
        {"zero_optimization": {"zenflow": {"topk_ratio": 0.1}}},
        "zero_optimization.zenflow = {",
        "Remove the key",
    ),
    (
        {"managed_gradient_accumulation": False},
        "managed_gradient_accumulation = false",
        "managed_gradient_accumulation: true",
    ),
    (
        {"data_types": {"keep_in_fp32_modules": ["norm"]}},
        'data_types.keep_in_fp32_modules = ["norm"]',
        'keep_in_fp32_modules: "auto"',
    ),
    ({"data_types": {"param_dtype": "bf16"}}, "data_types.param_dtype 'bf16'", "Use 'fp32'"),
    (
        {"bf16": {"enabled": True}, "data_types": {"buffer_dtype": "fp32"}},
        "data_types.buffer_dtype 'fp32'",
        "Use 'bf16'",
    ),
]


@pytest.mark.parametrize("extra, named, fix", REFUSED, ids=[r[1].split(" ")[0] for r in REFUSED])
def test_keys_that_would_change_the_run_are_refused(extra, named, fix):
    message = error_of(extra)
    assert named in message and fix in message
    assert message.count("\n") == 0  # one problem, one message


# [Note: enabled blocks zero does not implement] (config/subsystems.py), as docs/config.md's
# table says: block -> (switched on, words of the fix).
REFUSED_BLOCKS = {
    "amp": ({"enabled": True, "opt_level": "O2"}, "Use fp16.enabled"),
    "elasticity": ({"enabled": True, "max_train_batch_size": 64}, "leave gradient_accumulation"),
    "compression_training": (
        {"sparse_pruning": {"shared_parameters": {"enabled": True}}},
        "would train uncompressed",
    ),
    "data_efficiency": ({"enabled": True}, "sample or route data in the training script"),
    "curriculum_learning": ({"enabled": True}, "shorten sequences in the script's data loader"),
    "progressive_layer_drop": ({"enabled": True, "theta": 0.5}, "no layer would be dropped"),
}
WARNED_BLOCKS = {
    "pipeline": "PipelineModule",
    "sparse_attention": "deepspeed.ops.sparse_attention",
    "eigenvalue": "Hessian eigenvalues",
    "hybrid_engine": "engine.generate()",
}


@pytest.mark.parametrize("name", REFUSED_BLOCKS)
def test_enabled_block_that_would_change_training_is_refused(name):
    from zero.config import ConfigNotImplementedError

    block, fix = REFUSED_BLOCKS[name]
    with pytest.raises(ConfigNotImplementedError) as info:
        load({name: block})
    message = str(info.value)
    key = "sparse_pruning.shared_parameters.enabled" if name == "compression_training" else name
    assert f"{name}.enabled = true" in message or f"{name}.{key} = true" in message, message
    assert fix in message and message.count("\n") == 0
    off = {"enabled": False} if name != "compression_training" else {"sparse_pruning": {}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # switched off: loads without a word
        assert load({name: off})[name] == off


@pytest.mark.parametrize("name", WARNED_BLOCKS)
def test_enabled_block_that_only_observes_warns_once(name):
    with pytest.warns(UserWarning, match=f"{name}.enabled is true") as record:
        config = load({name: {"enabled": True, "stages": 2}})
    messages = [str(w.message) for w in record if name in str(w.message)]
    assert len(messages) == 1 and WARNED_BLOCKS[name] in messages[0], messages
    assert "accepted and ignored" in messages[0] and config[name]["stages"] == 2


def test_zero_plus_plus_quantized_keys_need_the_stages_they_change():
    # qwZ quantizes stage 3's parameter all-gathers; qgZ the gradient reduce-scatter of 2 and 3.
    for key in ("zero_quantized_weights", "zero_quantized_nontrainable_weights"):
        message = error_of({"zero_optimization": {"stage": 2, key: True}})
        assert f"zero_optimization.{key} = true needs zero_optimization.stage 3" in message
    message = error_of({"zero_optimization": {"stage": 1, "zero_quantized_gradients": True}})
    assert "zero_quantized_gradients = true needs zero_optimization.stage 2 or 3" in message
    keys = ("zero_quantized_weights", "zero_quantized_nontrainable_weights")
    block = dict.fromkeys(keys + ("zero_quantized_gradients",), True)
    config = load({"zero_optimization": {"stage": 3, **block}})
    assert config.zero.zero_quantized_weights and config.zero.zero_quantized_gradients
    config = load({"zero_optimization": {"stage": 2, "zero_quantized_gradients": True}})
    assert config.zero.zero_quantized_gradients


def test_zero_plus_plus_keys_at_defaults_load_quietly():
    defaults = {"stage": 3, "zero_hpz_partition_size": 1, "zero_quantized_weights": False}
    defaults.update(
        zero_quantized_nontrainable_weights=False,
        zero_quantized_gradients=False,
        mics_shard_size=-1,
        mics_hierarchical_params_gather=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = load({"zero_optimization": defaults})
    assert config.zero.mics_shard_size == -1 and not config.zero.zero_quantized_weights


# ---- "auto" ----------------------------------------------------------------------------------


def test_auto_values_fill_dotted_keys():
    config = load_config(
        {
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": 2,
            "gradient_clipping": "auto",
            "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
            "fp16": {"enabled": "auto"},
        },
        world_size=2,
        auto_values={
            "train_micro_batch_size_per_gpu": 8,
            "optimizer.params.lr": 1e-3,
            "gradient_clipping": 0.5,
            "fp16.enabled": False,
        },
    )
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu) == (32, 8)
    assert config.optimizer.params["lr"] == 1e-3
    assert config.gradient_clipping == 0.5
    assert not config.fp16.enabled


def test_auto_sizes_from_hidden_size():
    zero = load_config(
        {
            **MICRO,
            "zero_optimization": {
                "stage": 3,
                "reduce_bucket_size": "auto",
                "stage3_prefetch_bucket_size": "auto",
                "stage3_param_persistence_threshold": "auto",
            },
        },
        auto_values={"hidden_size": 768},
    ).zero
    assert zero.reduce_bucket_size == 768 * 768
    assert zero.stage3_prefetch_bucket_size == int(0.9 * 768 * 768)
    assert zero.stage3_param_persistence_threshold == 7680


def test_auto_batch_key_derivable_counts_as_absent():
    config = load_config(
        {
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2,
        },
        world_size=3,
    )
    assert config.train_batch_size == 24


@pytest.mark.parametrize(
    "source, key",
    [
        (
            {**MICRO, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}},
            "optimizer.params.lr",
        ),
        ({"train_micro_batch_size_per_gpu": "auto"}, "train_micro_batch_size_per_gpu"),
        ({**MICRO, "gradient_clipping": "auto"}, "gradient_clipping"),
        ({**MICRO, "fp16": {"enabled": "auto"}}, "fp16.enabled"),
        ({**MICRO, "bf16": {"enabled": "auto"}}, "bf16.enabled"),
        ({**MICRO, "zero_optimization": {"stage": "auto"}}, "zero_optimization.stage"),
        (
            {**MICRO, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "auto"}}},
            "zero_optimization.offload_optimizer.device",
        ),
        (
            {**MICRO, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}},
            "scheduler.params.warmup_max_lr",
        ),
    ],
)
def test_unresolved_auto_is_error(source, key):
    with pytest.raises(ConfigError) as info:
        load_config(source)
    message = str(info.value)
    assert f"'{key}'" in message and "zero.initialize" in message


# Hugging Face's ds_config_zero3.json with the sizes it (or Accelerate) fills set to "auto".
HF_AUTO_SIZES = {
    "stage": 3,
    "reduce_bucket_size": "auto",
    "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto",
    "allgather_bucket_size": "auto",
    "sub_group_size": "auto",
    "stage3_max_live_parameters": "auto",
    "stage3_max_reuse_distance": "auto",
    "stage3_gather_16bit_weights_on_model_save": "auto",
}


def test_auto_sizes_without_hidden_size_take_defaults_in_one_line(zero_log):
    zero = load({"zero_optimization": HF_AUTO_SIZES}).zero
    fields = type(zero).model_fields
    fetch_keys = ("stage3_prefetch_bucket_size", "stage3_max_live_parameters")
    fetch_keys += ("stage3_max_reuse_distance", "stage3_module_granularity_threshold")
    fetch_keys += ("reduce_bucket_size", "allgather_bucket_size")
    auto = [k for k in HF_AUTO_SIZES if k != "stage"]
    for key in auto:
        assert getattr(zero, key) == fields[key].default, key
    assert zero.reduce_bucket_size == 500_000_000 and zero.stage3_prefetch_bucket_size == 50_000_000
    # stage 3's fetch keys stay unset: the fetch policy chooses them at zero.initialize
    assert not set(fetch_keys) & zero.model_fields_set
    defaults, policy = zero_log
    assert "no model hidden size" in defaults
    for key in auto:
        if key in fetch_keys:
            assert f"zero_optimization.{key}" in policy and key not in defaults
        else:
            assert f"zero_optimization.{key}={json.dumps(fields[key].default)}" in defaults


def test_auto_defaults_with_hidden_size_fill_the_rest(zero_log):
    zero = load(
        {"zero_optimization": {"reduce_bucket_size": "auto", "stage3_max_live_parameters": "auto"}},
        auto_values={"hidden_size": 64},
    ).zero
    assert zero.reduce_bucket_size == 64 * 64
    assert zero.stage3_max_live_parameters == 1_000_000_000  # unset: the fetch policy's
    assert "stage3_max_live_parameters" not in zero.model_fields_set
    assert len(zero_log) == 1
    assert "left to zero.initialize" in zero_log[0] and "stage3_max_live_parameters" in zero_log[0]
    assert "reduce_bucket_size" not in zero_log[0] and "hidden size" not in zero_log[0]


def test_auto_defaults_line_goes_to_notes_when_asked(zero_log):
    notes = []
    load({"zero_optimization": {"sub_group_size": "auto"}}, notes=notes)
    assert zero_log == []
    assert len(notes) == 1 and "zero_optimization.sub_group_size=1000000000" in notes[0]


def test_auto_lr_beside_auto_sizes_still_fails_naming_lr(zero_log):
    source = {
        **MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        "zero_optimization": {"reduce_bucket_size": "auto"},
    }
    with pytest.raises(ConfigError, match=r"'optimizer\.params\.lr' is \"auto\""):
        load_config(source)
    assert zero_log == []


# ---- lines zero.initialize says once ---------------------------------------------------------


@pytest.fixture
def bare_zero_logger():
    """The "zero" logger as a fresh process has it: no handler (so initialize adds its own),
    level unset, propagating (so pytest attaches no capture handler to it either)."""
    logger = logging.getLogger("zero")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    logger.handlers.clear()
    logger.setLevel(logging.NOTSET)
    logger.propagate = True
    yield logger
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


def tiny_config(**extra) -> dict:
    return {**MICRO, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **extra}


def test_initialize_shows_the_auto_defaults_line_at_rank_0(bare_zero_logger, capsys):
    import zero

    cfg = tiny_config(zero_optimization={"stage": 2, "reduce_bucket_size": "auto"})
    engine, _, _, _ = zero.initialize(model=torch.nn.Linear(3, 3), config=cfg)
    assert engine.config.zero.reduce_bucket_size == 500_000_000  # unset: memory is plentiful
    assert engine.bucket_sizes.reduce_numel == 500_000_000
    err = capsys.readouterr().err.splitlines()
    lines = [line for line in err if '"auto"' in line]
    assert len(lines) == 1
    assert lines[0].startswith("[zero rank 0] ")
    assert "left to zero.initialize" in lines[0] and "reduce_bucket_size" in lines[0]
    assert any("bucket sizes: headroom" in line for line in err)


def test_partition_activations_without_model_parallelism_says_so_once(zero_log):
    import zero
    from zero import checkpointing

    cfg = tiny_config(activation_checkpointing={"partition_activations": True})
    try:
        zero.initialize(model=torch.nn.Linear(3, 3), config=cfg)
    finally:
        checkpointing.configure(None)  # back to defaults for the rest of this process
    lines = [m for m in zero_log if "partition_activations" in m]
    assert len(lines) == 1
    assert "no effect without model parallelism" in lines[0]


def test_settings_without_effect_only_without_model_parallelism():
    config = load({"activation_checkpointing": {"partition_activations": True}})
    assert len(settings_without_effect(config, model_parallel_world_size=1)) == 1
    assert settings_without_effect(config, model_parallel_world_size=2) == []
    assert settings_without_effect(load({}), model_parallel_world_size=1) == []


@pytest.mark.parametrize(
    "block, words",
    [
        ({"wandb": {"enabled": True}}, "does not log to Weights & Biases"),
        ({"comet": {"enabled": True}}, "does not log to Comet"),
        ({"prescale_gradients": True}, "divides once after the reduction"),
        ({"gradient_predivide_factor": 2.0}, "divides once after the reduction"),
        ({"aio": {"use_gds": True}}, "not GPUDirect Storage"),
    ],
)
def test_features_zero_does_not_have_are_said_once(block, words):
    lines = settings_without_effect(load(block), model_parallel_world_size=1)
    assert len(lines) == 1 and words in lines[0]


def test_integers_beyond_float_range_are_non_finite():
    """10**400 as an lr passed initialize and raised OverflowError inside the first step."""
    with pytest.raises(ConfigError, match=r"invalid value for 'optimizer\.params\.lr'"):
        load({"optimizer": {"type": "AdamW", "params": {"lr": 10**400}}})
    assert load({"optimizer": {"type": "AdamW", "params": {"lr": 10**300}}})  # a float still
