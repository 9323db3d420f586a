"""A DeepSpeed-Chat step-1 style SFT program (programs/dschat_sft_program.py: get_accelerator,
HfDeepSpeedConfig, LoRA sized from ds_shape, FusedAdam / DeepSpeedCPUAdam, a transformers
scheduler, LoRA fused under GatheredParameters(modifier_rank=0), main.py's save: save_hf_format
on rank 0 alone, then at stage 3 the ds_id-gated save_zero_three_model on every rank)
started by DeepSpeed's `deepspeed` launcher under zero-as-deepspeed, 2 CPU ranks. Its saved model
reloads with from_pretrained equal to the engine's weights, the LoRA update is fused into it, and
stage 3 with CPU offload ends where stage 2 does."""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from launched import run_launched  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from zero.launcher.world import find_free_port  # noqa: E402

PROGRAM = Path(__file__).resolve().parent / "programs" / "dschat_sft_program.py"
DOORWAY = [sys.executable, "-m", "zero.integrations.doorway_cli"]


def sft(model_dir, out, *extra) -> tuple[dict, str]:
    """Run the program; returns the model from_pretrained reads back from its output, and the
    program's output (stdout and stderr)."""
    from transformers import AutoModelForCausalLM

    command = [*DOORWAY, "deepspeed", "--num_gpus", "2", "--master_port", str(find_free_port())]
    command += [str(PROGRAM), "--model_dir", str(model_dir), "--output_dir", str(out / "model")]
    command += ["--lora_dim", "4", "--reference_out", str(out / "engine.safetensors")]
    command += [*extra, "--deepspeed"]
    result = run_launched(command, timeout=240)
    saved = AutoModelForCausalLM.from_pretrained(out / "model").state_dict()
    return saved, result.stdout + result.stderr


@pytest.mark.timeout(300)
def test_dschat_style_sft_saves_what_the_engine_trained(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    saved = {}
    for stage, extra in ((2, ()), (3, ("--offload", "--persistence_threshold", "0"))):
        out = tmp_path / f"stage{stage}"
        saved[stage], output = sft(model_dir, out, "--zero_stage", str(stage), *extra)
        # main.py's save_hf_format: rank 0 alone calls module.state_dict(); at stage 3 the
        # doorway gives DeepSpeed's placeholders and says so once, then save_zero_three_model
        # overwrites the file with the gathered weights.
        assert output.count("0-element placeholders, as DeepSpeed does") == (stage == 3), output
        engine = load_file(out / "engine.safetensors")
        assert saved[stage].keys() == engine.keys() == initial.keys()
        for key, value in engine.items():  # every tensor whole, as the engine holds it
            assert torch.equal(saved[stage][key], value), (stage, key)
        # the base projections are frozen under LoRA: only the fused update moved them
        fused = "model.layers.0.self_attn.q_proj.weight"
        assert not torch.equal(saved[stage][fused], initial[fused]), stage
    for key, value in saved[2].items():
        torch.testing.assert_close(saved[3][key], value, rtol=0, atol=1e-5, msg=key)
