"""Unknown config keys: errors under zero's own API (STRICT), dropped with one warning each under
DeepSpeed's policy (the doorway's), except in the blocks DeepSpeed 0.19.8 validates strictly."""

import json
import os
import subprocess
import warnings

import pytest

from zero.config import (
    STRICT,
    ConfigError,
    KeyPolicy,
    current_key_policy,
    load_config,
    use_key_policy,
)
from zero.config import policy as policy_module
from zero.integrations.deepspeed import DEEPSPEED_STRICT_BLOCKS

DEEPSPEED = KeyPolicy(
    ignore_unknown=True, strict_blocks=DEEPSPEED_STRICT_BLOCKS, follows="DeepSpeed 0.19.8"
)

BASE = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}

# Keys real DeepSpeed programs pass that DeepSpeed 0.19.8 ignores.
IGNORED_BY_DEEPSPEED = {
    # TRL's DPO reference model: top-level keys whose names hold dots
    "zero_optimization.reduce_bucket_size": {"zero_optimization.reduce_bucket_size": 4096},
    # Lightning's default aio block
    "aio.thread_count": {"aio": {"thread_count": 1}},
    # a typo at the top level (DeepSpeed reads top-level keys from a plain dict)
    "gradient_clippin": {"gradient_clippin": 1.0},
    "activation_checkpointing.cpu_checkpoint": {
        "activation_checkpointing": {"cpu_checkpoint": True}
    },
    "timers.wall_clock": {"timers": {"wall_clock": True}},
}

# Unknown keys inside blocks DeepSpeed validates with extra="forbid": errors on DeepSpeed too.
REFUSED_BY_DEEPSPEED = {
    "zero_optimization.reduce_bucket_sise": {"zero_optimization": {"reduce_bucket_sise": 1}},
    "zero_optimization.offload_optimizer.devic": {
        "zero_optimization": {"stage": 2, "offload_optimizer": {"devic": "cpu"}}
    },
    "bf16.enable": {"bf16": {"enable": True}},
    "fp16.loss_scal": {"fp16": {"loss_scal": 0}},
    "timers.throughput.enable": {"timers": {"throughput": {"enable": True}}},
    "tensorboard.enable": {"tensorboard": {"enable": True}},
    "comms_logger.enable": {"comms_logger": {"enable": True}},
    "tensor_parallel.autotp_sise": {"tensor_parallel": {"autotp_sise": 1}},
}


def config_with(extra: dict) -> dict:
    config = {**BASE, **extra}
    if "zero_optimization" in extra:
        config["zero_optimization"] = {**BASE["zero_optimization"], **extra["zero_optimization"]}
    return config


@pytest.fixture
def deepspeed_policy():
    before = current_key_policy()
    policy_module._warned.clear()
    use_key_policy(DEEPSPEED)
    yield
    use_key_policy(before)
    policy_module._warned.clear()


@pytest.mark.parametrize("key", sorted({**IGNORED_BY_DEEPSPEED, **REFUSED_BY_DEEPSPEED}))
def test_zero_api_refuses_every_unknown_key(key):
    assert current_key_policy() is STRICT
    extra = {**IGNORED_BY_DEEPSPEED, **REFUSED_BY_DEEPSPEED}[key]
    with pytest.raises(ConfigError, match=f"unknown key '{key}'"):
        load_config(config_with(extra))


def test_deepspeed_policy_drops_what_deepspeed_ignores_with_one_warning_each(deepspeed_policy):
    config = dict(BASE)
    for extra in IGNORED_BY_DEEPSPEED.values():
        config.update(extra)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_config(config)
        again = load_config(config)  # a second load (a reference model) warns no more
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(messages) == len(IGNORED_BY_DEEPSPEED)
    for key in IGNORED_BY_DEEPSPEED:
        (message,) = [m for m in messages if f"'{key}'" in m]
        assert "DeepSpeed 0.19.8" in message and "ignored" in message
    assert all(w.filename == __file__ for w in caught)  # points at the caller
    assert "Did you mean 'gradient_clipping'?" in " ".join(messages)
    assert "write it nested (zero_optimization: {reduce_bucket_size: ...})" in " ".join(messages)
    # The dropped keys change nothing: the config is the one without them.
    assert loaded.model_dump() == again.model_dump() == load_config(BASE).model_dump()
    assert "aio" not in loaded._source or "thread_count" not in loaded._source["aio"]


@pytest.mark.parametrize("key", sorted(REFUSED_BY_DEEPSPEED))
def test_deepspeed_policy_keeps_deepspeeds_strict_blocks(deepspeed_policy, key):
    with pytest.raises(ConfigError, match=f"unknown key '{key}'"):
        load_config(config_with(REFUSED_BY_DEEPSPEED[key]))


def test_a_policy_given_to_load_config_wins(deepspeed_policy):
    with pytest.raises(ConfigError, match="unknown key 'gradient_clippin'"):
        load_config({**BASE, "gradient_clippin": 1.0}, key_policy=STRICT)
    use_key_policy(STRICT)
    with pytest.warns(UserWarning, match="gradient_clippin"):
        load_config({**BASE, "gradient_clippin": 1.0}, key_policy=DEEPSPEED)


def test_policy_ignores_by_block():
    assert not STRICT.ignores(("aio", "thread_count"))
    assert DEEPSPEED.ignores(("aio", "thread_count"))
    assert DEEPSPEED.ignores(("zero_optimization.stage",))  # a top-level key named with dots
    assert not DEEPSPEED.ignores(("zero_optimization", "offload_param", "x"))
    assert DEEPSPEED.ignores(("timers", "x"))
    assert not DEEPSPEED.ignores(("timers", "throughput", "x"))
    with pytest.raises(TypeError, match="KeyPolicy"):
        use_key_policy("deepspeed")


# What DeepSpeed 0.19.8's own DeepSpeedConfig says of each case, asked in a Python where it is
# installed (DEEPSPEED_PYTHON; never this one, where `deepspeed` must be the doorway or nothing).
_ASK_DEEPSPEED = """
import json, logging, sys
logging.disable(logging.CRITICAL)
from deepspeed.runtime.config import DeepSpeedConfig
verdicts = {}
for key, config in json.loads(sys.stdin.read()).items():
    try:
        DeepSpeedConfig(config)
        verdicts[key] = "accepted"
    except Exception as error:
        verdicts[key] = type(error).__name__
print(json.dumps(verdicts))
"""


@pytest.mark.skipif(
    not os.environ.get("DEEPSPEED_PYTHON"),
    reason="set DEEPSPEED_PYTHON to a Python with deepspeed==0.19.8 installed to compare",
)
def test_deepspeed_policy_accepts_and_refuses_what_deepspeed_does(deepspeed_policy):
    cases = {k: config_with(v) for k, v in {**IGNORED_BY_DEEPSPEED, **REFUSED_BY_DEEPSPEED}.items()}
    result = subprocess.run(
        [os.environ["DEEPSPEED_PYTHON"], "-c", _ASK_DEEPSPEED],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    deepspeed = json.loads(result.stdout.splitlines()[-1])
    for key, config in cases.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                load_config(config)
                ours = "accepted"
            except ConfigError:
                ours = "refused"
        assert (ours == "accepted") == (deepspeed[key] == "accepted"), (key, deepspeed[key])
