"""Configs that DeepSpeed's own tools write load with DeepSpeed's meaning: Accelerate's
steps_per_print = inf, DeepSpeed-Chat's configs (offload_param below stage 3, "bfloat16",
hybrid_engine), and DeepSpeed's config objects for scripts (DeepSpeedConfig, OffloadDeviceEnum)."""

import json
import math
import warnings

import pytest

from zero.config import (
    ConfigError,
    ConfigNotImplementedError,
    DeepSpeedConfig,
    OffloadDeviceEnum,
    load_config,
)

MICRO = {"train_micro_batch_size_per_gpu": 4}
INF = float("inf")


def load(extra: dict, **kwargs):
    return load_config({**MICRO, **extra}, **kwargs)


def error_of(extra: dict) -> str:
    with pytest.raises(ConfigError) as info:
        load(extra)
    return str(info.value)


# ---- steps_per_print: Accelerate writes float("inf") (never print) ----------------------------


def test_steps_per_print_infinity_means_never(tmp_path):
    config = load({"steps_per_print": INF})
    assert config.steps_per_print is None  # the monitor's "never"
    assert load_config(config).steps_per_print is None  # re-validated for another world size
    assert config.to_dict()["steps_per_print"] is None
    assert DeepSpeedConfig({**MICRO, "steps_per_print": INF}).steps_per_print == math.inf
    # files: JSON written by json.dump (hjson reads its Infinity as text, comma included on a
    # line that is not the last), YAML's .inf
    for last in (False, True):
        items = {**MICRO, "steps_per_print": INF} if last else {"steps_per_print": INF, **MICRO}
        path = tmp_path / f"c{last}.json"
        path.write_text(json.dumps(items, indent=2))
        assert load_config(path).steps_per_print is None
    path = tmp_path / "c.yaml"
    path.write_text("train_micro_batch_size_per_gpu: 4\nsteps_per_print: .inf\n")
    assert load_config(path).steps_per_print is None
    # a misspelled key is still an unknown key, with the nearest name
    assert "Did you mean 'steps_per_print'" in error_of({"steps_per_prnt": 10})


@pytest.mark.parametrize(
    "extra, key",
    [
        ({"steps_per_print": -INF}, "steps_per_print"),
        ({"steps_per_print": math.nan}, "steps_per_print"),
        ({"steps_per_print": "-Infinity"}, "steps_per_print"),
        ({"steps_per_print": None}, "steps_per_print"),
        ({"gradient_clipping": INF}, "gradient_clipping"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": INF}}}, "optimizer.params.lr"),
        ({"fp16": {"enabled": True, "loss_scale_window": INF}}, "fp16.loss_scale_window"),
        ({"tensorboard": {"steps_per_print": INF}}, "tensorboard.steps_per_print"),
    ],
)
def test_other_non_finite_values_stay_errors(extra, key):
    message = error_of(extra)
    assert key in message


# ---- offload_param below stage 3: ignored, as DeepSpeed does, with one warning ----------------


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_offload_param_below_stage_3_is_ignored_with_one_warning(stage):
    zero = {"stage": stage, "offload_param": {"device": "cpu", "pin_memory": True}}
    with pytest.warns(UserWarning, match=r"zero_optimization\.offload_param") as caught:
        config = load({"zero_optimization": zero})
    assert len([w for w in caught if "offload_param" in str(w.message)]) == 1
    assert f"stage {stage}" in str(caught[0].message)
    assert config.zero.offload_param is None  # the engine sees no parameter offload
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = load_config(config, world_size=2)  # the first load already warned
    assert again.zero.offload_param is None and again.train_batch_size == 8


def test_offload_param_ignored_below_stage_3_whatever_it_holds():
    # nvme without a path (DeepSpeed checks nothing there), the deprecated cpu_offload_param
    with pytest.warns(UserWarning, match="offload_param"):
        config = load({"zero_optimization": {"stage": 2, "offload_param": {"device": "nvme"}}})
    assert config.zero.offload_param is None
    with pytest.warns(UserWarning, match="offload_param"), pytest.warns(FutureWarning):
        config = load({"zero_optimization": {"stage": 1, "cpu_offload_param": True}})
    assert config.zero.offload_param is None
    # still checked: unknown keys inside it, and everything at stage 3
    assert "Did you mean 'pin_memory'" in error_of(
        {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu", "pin_mem": True}}}
    )
    assert "nvme_path" in error_of(
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}
    )
    message = error_of({"zero_optimization": {"stage": 2, "offload_parm": {"device": "cpu"}}})
    assert "zero_optimization.offload_parm" in message and "offload_param" in message
    # a block that asks for nothing is kept without a word; stage 3 keeps its offload
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = load({"zero_optimization": {"stage": 2, "offload_param": {"device": "none"}}})
        assert config.zero.offload_param.device == "none"
        config = load({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})
        assert config.zero.offload_param.device == "cpu"


# ---- whole configs as DeepSpeed-Chat writes them (dschat/utils/ds_utils.py) ---------------------


def deepspeed_chat_train(stage: int, offload: bool, dtype: str = "bf16") -> dict:
    device = "cpu" if offload else "none"
    zero = {
        "stage": stage,
        "overlap_comm": True,
        "offload_param": {"device": device},
        "offload_optimizer": {"device": device},
        "stage3_param_persistence_threshold": 1e4,
        "stage3_max_live_parameters": 3e7,
        "stage3_prefetch_bucket_size": 3e7,
        "memory_efficient_linear": False,
    }
    precision = (
        ("bfloat16", {"enabled": True})
        if dtype == "bf16"
        else ("fp16", {"enabled": True, "loss_scale_window": 100})
    )
    return {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10,
        "zero_optimization": zero,
        precision[0]: precision[1],
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "hybrid_engine": {
            "enabled": False,
            "max_out_tokens": 512,
            "inference_tp_size": 1,
            "release_inference_cache": False,
            "pin_parameters": True,
            "tp_gather_partition_size": 8,
        },
        "tensorboard": {
            "enabled": False,
            "output_path": "step1_tensorboard/ds_tensorboard_logs/",
            "job_name": "step1_model_tensorboard",
        },
    }


def deepspeed_chat_eval(stage: int, offload: bool) -> dict:
    return {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10,
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 1e4,
            "offload_param": {"device": "cpu" if offload else "none"},
            "memory_efficient_linear": False,
        },
        "fp16": {"enabled": True},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
    }


def test_deepspeed_chat_configs_load():
    ignored = r"offload_param \(device 'cpu'\) is ignored"
    with pytest.warns(UserWarning, match=ignored), pytest.warns(FutureWarning, match="bfloat16"):
        config = load_config(deepspeed_chat_train(2, offload=True), world_size=2)
    assert config.zero.offload_param is None
    assert config.zero.offload_optimizer.device == "cpu"
    assert config.bf16.enabled and config.gradient_accumulation_steps == 4
    assert config.zero.stage3_max_live_parameters == 30_000_000
    assert config.hybrid_engine["max_out_tokens"] == 512
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # "bfloat16" is DeepSpeed's old name
        config = load_config(deepspeed_chat_train(3, offload=True), world_size=8)
    assert config.zero.offload_param.device == "cpu" and config.gradient_accumulation_steps == 1
    config = load_config(deepspeed_chat_train(2, offload=False, dtype="fp16"), world_size=2)
    assert config.fp16.loss_scale_window == 100 and config.zero.offload_param.device == "none"
    with pytest.warns(UserWarning, match="stage 0"):
        config = load_config(deepspeed_chat_eval(0, offload=True), world_size=2)
    assert config.zero.offload_param is None and config.fp16.enabled


def test_accelerate_style_config_loads():
    # What Accelerate hands DeepSpeed: its own keys filled in, steps_per_print = inf, and
    # nvme_path: None where the device is not nvme.
    config = load_config(
        {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "steps_per_print": INF,
            "zero_allow_untested_optimizer": True,
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "cpu", "nvme_path": None},
                "offload_param": {"device": "none", "nvme_path": None},
                "stage3_gather_16bit_weights_on_model_save": True,
            },
            "bf16": {"enabled": True},
            "gradient_clipping": 1.0,
        }
    )
    assert config.steps_per_print is None and config.zero.offload_optimizer.device == "cpu"


def test_leaf_module_entries_may_be_one_string():
    config = load(
        {"zero_optimization": {"stage": 3, "leaf_module": {"classes": "MixtralSparseMoeBlock"}}}
    )
    assert config.zero.leaf_module.classes == ("MixtralSparseMoeBlock",)


# ---- DeepSpeedConfig and OffloadDeviceEnum (deepspeed.runtime.config / zero.offload_config) ----


class _Mpu:
    def get_data_parallel_world_size(self):
        return 2


def test_deepspeed_config_reads_dicts_and_files(tmp_path):
    source = {
        "train_batch_size": 16,
        "gradient_accumulation_steps": 2,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
    }
    ds = DeepSpeedConfig(source, mpu=_Mpu())
    assert (ds.world_size, ds.global_rank) == (2, 0)
    assert (ds.train_batch_size, ds.train_micro_batch_size_per_gpu) == (16, 4)
    assert ds.gradient_accumulation_steps == 2
    assert (ds.zero_optimization_stage, ds.zero_enabled) == (3, True)
    assert (ds.fp16_enabled, ds.bfloat16_enabled) == (False, True)
    assert ds.bfloat16_config.enabled and not ds.float16_config.enabled
    assert ds.zero_config.stage == 3 and ds.steps_per_print == 10
    assert (ds.optimizer_name, ds.optimizer_params) == ("adam", {"lr": 1e-4})
    assert (ds.scheduler_name, ds.scheduler_params) == ("WarmupLR", {"warmup_num_steps": 10})
    assert ds._param_dict is source
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 3, "fp16": {"enabled": True}}))
    ds = DeepSpeedConfig(str(path))
    assert (ds.train_batch_size, ds.world_size, ds.zero_enabled) == (3, 1, False)
    assert ds.fp16_enabled and ds._param_dict["fp16"] == {"enabled": True}
    with pytest.raises(AttributeError, match="elasticity_enabled"):
        _ = ds.elasticity_enabled
    with pytest.raises(ConfigError, match="train_batch_size"):
        DeepSpeedConfig({"train_batch_size": 3}, mpu=_Mpu())
    with pytest.raises(NotImplementedError, match="mesh_device"):
        DeepSpeedConfig(source, mesh_device=object())


def test_offload_devices_compare_to_deepspeeds_enum():
    assert [e.value for e in OffloadDeviceEnum] == ["none", "cpu", "nvme"]
    zero = {
        "stage": 3,
        "offload_optimizer": {"device": OffloadDeviceEnum.cpu},
        "offload_param": {"device": OffloadDeviceEnum.nvme, "nvme_path": "/tmp"},
    }
    config = load({"zero_optimization": zero})
    assert config.zero.offload_optimizer.device == OffloadDeviceEnum.cpu
    assert config.zero.offload_param.device == OffloadDeviceEnum.nvme
    assert config.zero.offload_param.device in (OffloadDeviceEnum.cpu, OffloadDeviceEnum.nvme)
    assert type(config.zero.offload_param.device) is str  # messages and dumps stay plain


# ---- keys that change numerics, valid in DeepSpeed, not implemented: NotImplementedError -------


@pytest.mark.parametrize(
    "extra, key",
    [
        ({"torch_autocast": {"enabled": True}}, "torch_autocast.enabled"),
        ({"weight_quantization": {"enabled": True}}, "weight_quantization"),
    ],
)
def test_unimplemented_settings_raise_not_implemented_naming_the_key(extra, key):
    with pytest.raises(ConfigNotImplementedError) as info:
        load(extra)
    assert isinstance(info.value, NotImplementedError) and isinstance(info.value, ConfigError)
    assert key in str(info.value) and "Remove" in str(info.value)
    assert load({"gradient_allreduce_op": "MEAN"}).gradient_allreduce_op == "mean"
    assert load({"gradient_allreduce_op": "SUM"}).gradient_allreduce_op == "sum"
    # a wrong value is not "unsupported": a plain ConfigError
    with pytest.raises(ConfigError) as info:
        load({"gradient_allreduce_op": "max"})
    assert not isinstance(info.value, NotImplementedError)
