"""An unchanged Hugging Face Trainer program (programs/trainer_program.py) trains, evaluates,
saves and resumes on zero under zero-as-deepspeed: 2 CPU ranks, a tiny Llama built here, stage 2
with the optimizer offloaded and stage 3 with optimizer and parameters offloaded. Losses and
weights equal the same program on torch DDP, and (stage 3) a run resumed from its step-2
checkpoint ends bitwise equal to the uninterrupted one."""

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from launched import run_launched  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from zero.launcher.world import find_free_port  # noqa: E402

PROGRAM = Path(__file__).resolve().parent / "programs" / "trainer_program.py"
DOORWAY = [sys.executable, "-m", "zero.integrations.doorway_cli"]
CONFIGS = {
    "stage2_offload": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "stage3_offload": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"},
        "stage3_gather_16bit_weights_on_model_save": True,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    },
}


def ds_config(zero_optimization: dict) -> dict:
    """A Hugging Face style DeepSpeed config: the Trainer fills every "auto"."""
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": zero_optimization,
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
    }


def train(model_dir, out, *extra, doorway=True) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_port", str(find_free_port()), str(PROGRAM), "--model_dir", str(model_dir)]
    command += ["--output_dir", str(out), "--max_steps", "4", "--save_steps", "2", "--seed", "0"]
    command += ["--per_device_train_batch_size", "4", "--logging_steps", "1", "--use_cpu"]
    command += ["--learning_rate", "1e-2", "--report_to", "none", *extra]
    run_launched([*DOORWAY, *command] if doorway else command, timeout=240)
    with open(out / "result.json") as handle:
        return json.load(handle)


def weights(out) -> dict:
    return load_file(out / "final" / "model.safetensors")


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    return train(model_dir, out, doorway=False), weights(out)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_trainer_trains_saves_and_resumes_like_ddp(name, model_dir, reference, tmp_path):
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(ds_config(CONFIGS[name])))
    full = train(model_dir, tmp_path / "full", "--deepspeed", str(config))
    (ref_result, ref_weights) = reference
    assert full["step"] == 4
    assert full["losses"] == pytest.approx(ref_result["losses"], abs=1e-5)
    assert full["eval_loss"] == pytest.approx(ref_result["eval_loss"], abs=1e-5)
    got = weights(tmp_path / "full")
    assert got.keys() == ref_weights.keys()
    for key, value in ref_weights.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-5, msg=key)
    checkpoint = tmp_path / "full" / "checkpoint-2"
    assert (checkpoint / "latest").read_text().strip() == "global_step2"
    if name != "stage3_offload":
        return  # resuming is the same code at every stage: one stage keeps the suite short

    resumed_out = tmp_path / "resumed"
    resumed_out.mkdir()
    resumed = train(
        model_dir,
        resumed_out,
        "--deepspeed",
        str(config),
        "--resume_from_checkpoint",
        str(checkpoint),
    )
    assert resumed["step"] == 4
    assert resumed["losses"][2:] == full["losses"][2:]
    for key, value in weights(tmp_path / "full").items():
        assert torch.equal(weights(resumed_out)[key], value), key
