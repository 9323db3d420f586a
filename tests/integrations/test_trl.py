"""An unchanged TRL SFTTrainer program (programs/trl_sft_program.py; its default loss is TRL's
fused LM head, a custom autograd Function that saves `lm_head.weight` and gathers it in backward
when its ds_status is not AVAILABLE) runs to its end on zero under zero-as-deepspeed: 2 CPU
ranks, a tiny Llama built here, stages 2 and 3. Stage 3's losses equal stage 2's, the model
trainer.save_model() wrote reloads full-size with from_pretrained and trains. (DeepSpeed 0.19.8
is not run beside it: under transformers' --use_cpu its engine counts one rank.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

from zero.launcher.world import find_free_port  # noqa: E402

PROGRAM = Path(__file__).resolve().parent / "programs" / "trl_sft_program.py"
DOORWAY = [sys.executable, "-m", "zero.integrations.doorway_cli"]


def ds_config(stage: int) -> dict:
    zero_optimization = {"stage": stage, "reduce_bucket_size": "auto"}
    if stage == 3:  # partition the tiny model for real; save_model gathers it
        zero_optimization |= {
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": "auto",
            "stage3_gather_16bit_weights_on_model_save": True,
        }
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": zero_optimization,
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
    }


def sft(model_dir, out: Path, stage: int) -> dict:
    """Run the program on 2 ranks; returns its result.json (the losses, the step)."""
    config = out / "ds_config.json"
    out.mkdir(parents=True)
    config.write_text(json.dumps(ds_config(stage)))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_port", str(find_free_port()), str(PROGRAM), "--model_dir", str(model_dir)]
    command += ["--output_dir", str(out), "--deepspeed", str(config), "--max_steps", "3"]
    command += ["--per_device_train_batch_size", "4", "--logging_steps", "1", "--seed", "0"]
    command += ["--learning_rate", "1e-2", "--report_to", "none", "--save_strategy", "no"]
    command += ["--use_cpu"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    argv = [*DOORWAY, *command]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=400, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    with open(out / "result.json") as handle:
        return json.load(handle)


@pytest.fixture(scope="module")
def zero_runs(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("trl")
    return {stage: (sft(model_dir, root / f"stage{stage}", stage), root) for stage in (2, 3)}


@pytest.mark.timeout(900)
def test_sft_runs_to_its_end_at_stages_2_and_3(model_dir, zero_runs):
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    for stage, (result, root) in zero_runs.items():
        assert result["step"] == 3 and len(result["losses"]) == 3, (stage, result)
        model = AutoModelForCausalLM.from_pretrained(root / f"stage{stage}" / "final")
        saved = model.state_dict()
        assert saved.keys() == initial.keys()
        for key, value in initial.items():
            assert saved[key].shape == value.shape, (stage, key)  # full-size, no placeholder
        assert not torch.equal(saved["lm_head.weight"], initial["lm_head.weight"]), stage
        ids = torch.randint(0, model.config.vocab_size, (2, 8))
        model(input_ids=ids, labels=ids).loss.backward()  # the reloaded model trains
        assert all(p.grad is not None for p in model.parameters()), stage
    torch.testing.assert_close(
        zero_runs[3][0]["losses"], zero_runs[2][0]["losses"], rtol=0, atol=1e-5
    )
