"""Unchanged TRL programs run to their end on zero under zero-as-deepspeed, 2 CPU ranks, a tiny
Llama built here:
- SFTTrainer (programs/trl_sft_program.py) at stages 2 and 3; its default loss is TRL's fused
  LM head, a custom autograd Function that saves `lm_head.weight` and gathers it in backward
  when its ds_status is not AVAILABLE. Stage 3's losses equal stage 2's.
- DPOTrainer with a reference model (programs/trl_dpo_program.py) at stage 3.
Each model trainer.save_model() wrote reloads full-size with from_pretrained and trains.
(DeepSpeed 0.19.8 is not run beside them: under transformers' --use_cpu its engine counts one
rank.)"""

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

from launched import run_launched  # noqa: E402
from test_hf_trainer import ds_config  # noqa: E402

from zero.launcher.world import find_free_port  # noqa: E402

PROGRAMS = Path(__file__).resolve().parent / "programs"
DOORWAY = [sys.executable, "-m", "zero.integrations.doorway_cli"]


def trl_config(stage: int) -> dict:
    zero_optimization = {"stage": stage, "reduce_bucket_size": "auto"}
    if stage == 3:  # partition the tiny model for real; save_model gathers it
        zero_optimization |= {
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": "auto",
            "stage3_gather_16bit_weights_on_model_save": True,
        }
    return ds_config(zero_optimization)


def run(program: str, model_dir, out: Path, stage: int, *extra) -> dict:
    """Run programs/`program` on 2 ranks; returns its result.json (the losses, the step)."""
    config = out / "ds_config.json"
    out.mkdir(parents=True)
    config.write_text(json.dumps(trl_config(stage)))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_port", str(find_free_port()), str(PROGRAMS / program)]
    command += ["--model_dir", str(model_dir), "--output_dir", str(out), "--deepspeed", str(config)]
    command += ["--logging_steps", "1", "--seed", "0", "--report_to", "none"]
    command += ["--save_strategy", "no", "--use_cpu", *extra]
    argv = [*DOORWAY, *command]
    run_launched(argv, timeout=400)
    with open(out / "result.json") as handle:
        return json.load(handle)


@pytest.fixture(scope="module")
def zero_runs(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("trl")
    extra = ["--max_steps", "3", "--per_device_train_batch_size", "4", "--learning_rate", "1e-2"]
    return {
        stage: (run("trl_sft_program.py", model_dir, root / f"stage{stage}", stage, *extra), root)
        for stage in (2, 3)
    }


def reloads_and_trains(model_dir, directory: Path) -> None:
    """The model save_model() wrote reloads full-size (no placeholder), moved from its initial
    values, and trains."""
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    model = AutoModelForCausalLM.from_pretrained(directory)
    saved = model.state_dict()
    assert saved.keys() == initial.keys()
    for key, value in initial.items():
        assert saved[key].shape == value.shape, key
    assert not torch.equal(saved["lm_head.weight"], initial["lm_head.weight"])
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.timeout(900)
def test_sft_runs_to_its_end_at_stages_2_and_3(model_dir, zero_runs):
    for stage, (result, root) in zero_runs.items():
        assert result["step"] == 3 and len(result["losses"]) == 3, (stage, result)
        reloads_and_trains(model_dir, root / f"stage{stage}" / "final")
    torch.testing.assert_close(
        zero_runs[3][0]["losses"], zero_runs[2][0]["losses"], rtol=0, atol=1e-5
    )


@pytest.mark.timeout(600)
def test_dpo_with_a_reference_model_at_stage_3(model_dir, tmp_path):
    """DPOTrainer prepares the reference model as a second stage-3 engine (inference) beside
    the policy's; the first loss is ln 2 (policy and reference start equal)."""
    extra = ["--max_steps", "2", "--per_device_train_batch_size", "2", "--learning_rate", "1e-3"]
    result = run("trl_dpo_program.py", model_dir, tmp_path / "dpo", 3, *extra)
    assert result["step"] == 2 and len(result["losses"]) == 2, result
    assert result["losses"][0] == pytest.approx(0.693147, abs=1e-5)
    reloads_and_trains(model_dir, tmp_path / "dpo" / "final")
