"""An unchanged Hugging Face Trainer program that only evaluates and predicts
(programs/evaluate_program.py) runs on zero under zero-as-deepspeed at stage 3 with the
parameters offloaded to the CPU: the Trainer builds the engine without an optimizer
(transformers' deepspeed_init(inference=True) drops the config's optimizer block and prepares
the model alone), and the eval loss, the test loss and the predicted logits of 2 CPU ranks equal
those of the same program on one process without DeepSpeed."""

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from launched import run_launched  # noqa: E402

from zero.launcher.world import find_free_port  # noqa: E402

PROGRAM = Path(__file__).resolve().parent / "programs" / "evaluate_program.py"
DOORWAY = [sys.executable, "-m", "zero.integrations.doorway_cli"]

# A training config reused for evaluation, as the Trainer allows: it removes the optimizer
# block itself; the scheduler block stays and has no effect without an optimizer.
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "zero_optimization": {
        "stage": 3,
        "offload_param": {"device": "cpu"},
        "stage3_param_persistence_threshold": 0,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
    },
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
}


def evaluate(model_dir, out, *extra, ranks: int) -> tuple[dict, torch.Tensor]:
    """Run the program (on `ranks` processes through torch.distributed.run, else plainly);
    its metrics and the predicted logits."""
    program = [str(PROGRAM), "--model_dir", str(model_dir), "--output_dir", str(out)]
    program += ["--per_device_eval_batch_size", "4", "--use_cpu", "--report_to", "none", *extra]
    command = [sys.executable, *program]
    if ranks > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks)]
        command = [*DOORWAY, *command, "--master_port", str(find_free_port()), *program]
    run_launched(command, timeout=240)
    with open(out / "result.json") as handle:
        return json.load(handle), torch.load(out / "logits.pt")


@pytest.mark.timeout(300)
def test_trainer_evaluates_and_predicts_at_stage3_offload_like_plain_torch(model_dir, tmp_path):
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(DS_CONFIG))
    (tmp_path / "zero").mkdir()
    (tmp_path / "plain").mkdir()
    got, logits = evaluate(model_dir, tmp_path / "zero", "--deepspeed", str(config), ranks=2)
    want, want_logits = evaluate(model_dir, tmp_path / "plain", ranks=1)
    assert got["engine"].startswith("zero.engine")  # the doorway's deepspeed.initialize built it
    assert want["engine"].startswith("transformers.")
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], abs=1e-6)
    assert got["test_loss"] == pytest.approx(want["test_loss"], abs=1e-6)
    assert logits.shape == want_logits.shape == (12, 16, 128)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-5)
