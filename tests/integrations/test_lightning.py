"""An unchanged Lightning program with strategy="deepspeed_stage_2" / "deepspeed_stage_3"
(programs/lightning_program.py) runs to its end on zero under zero-as-deepspeed: 2 CPU ranks, a
tiny Llama built here. Lightning's DeepSpeed strategy refuses accelerators other than CUDA, so
the program hands its Trainer a CUDAAccelerator whose devices are CPU processes (the one
stand-in; nothing else of the program knows zero). Checked: stage 3's losses equal stage 2's;
Lightning's checkpoint (DeepSpeed's save_checkpoint with its checkpoint dict, tensors included,
as client_state) loads into a fresh Trainer that trains on; the checkpoint consolidates into a
full-size model that reloads and trains; where DeepSpeed 0.19.8 is installed, the same program on
it gives the same losses."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from launched import run_launched

pytest.importorskip("lightning")

PROGRAM = Path(__file__).resolve().parent / "programs" / "lightning_program.py"
DOORWAY = [sys.executable, "-m", "zero.integrations.doorway_cli"]


def fit(model_dir, out: Path, stage: int, doorway: bool = True) -> dict:
    out.mkdir(parents=True)
    command = [*DOORWAY] if doorway else []
    command += [sys.executable, str(PROGRAM), "--model_dir", str(model_dir)]
    command += ["--out", str(out), "--stage", str(stage)]
    run_launched(command, timeout=300)
    with open(out / "result.json") as handle:
        return json.load(handle)


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    """stage -> (result.json, its output directory), each stage run once."""
    root, done = tmp_path_factory.mktemp("lightning"), {}

    def run(stage):
        if stage not in done:
            done[stage] = (fit(model_dir, root / f"stage{stage}", stage), root / f"stage{stage}")
        return done[stage]

    return run


def check_run(model_dir, result: dict, out: Path) -> None:
    """The run trained 3 steps, resumed from its checkpoint for a 4th with its callbacks' state,
    and the checkpoint consolidates into a full-size model that reloads and trains."""
    from transformers import AutoModelForCausalLM

    from zero.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    assert len(result["losses"]) == 3 and result["resumed_step"] == 4, result
    assert all(score is not None for score in result["best_scores"]), result
    state = get_fp32_state_dict_from_zero_checkpoint(str(out / "last.ckpt"))
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})  # every key
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.timeout(600)
def test_lightning_deepspeed_stage_2(model_dir, runs):
    check_run(model_dir, *runs(2))


@pytest.mark.timeout(600)
def test_lightning_deepspeed_stage_3(model_dir, runs):
    result, out = runs(3)
    check_run(model_dir, result, out)
    torch.testing.assert_close(result["losses"], runs(2)[0]["losses"], rtol=0, atol=1e-5)


def _real_deepspeed() -> bool:
    from zero.integrations.deepspeed import DOORWAY_DIR

    spec = importlib.util.find_spec("deepspeed")  # this process has no doorway on its path
    return spec is not None and not (spec.origin or "").startswith(DOORWAY_DIR)


@pytest.mark.timeout(900)
@pytest.mark.skipif(not _real_deepspeed(), reason="DeepSpeed 0.19.8 is not installed")
def test_lightning_losses_equal_deepspeeds(model_dir, runs, tmp_path):
    """The same program on DeepSpeed 0.19.8 (its CPU accelerator): fp32 losses and the resumed
    run's best score equal zero's."""
    for stage in (2, 3):
        theirs = fit(model_dir, tmp_path / f"deepspeed{stage}", stage, doorway=False)
        ours = runs(stage)[0]
        torch.testing.assert_close(ours["losses"], theirs["losses"], rtol=0, atol=1e-6)
        torch.testing.assert_close(ours["best_scores"], theirs["best_scores"], rtol=0, atol=1e-6)
