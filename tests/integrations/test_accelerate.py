"""An unchanged accelerate training loop (programs/accelerate_program.py) under `accelerate
launch` with a DeepSpeed config (distributed_type DEEPSPEED) runs on zero through
zero-as-deepspeed at stages 2 and 3: prepare, backward, save_state / load_state, get_state_dict
and unwrap_model. 2 CPU ranks and a tiny Llama built here.

On a machine without an accelerator, accelerate's state counts one process for DeepSpeed runs
(its backend detection knows no CPU DeepSpeed), so it does not shard the data loader: every rank
trains on the same batches. The averaged gradient then equals one process's, and the losses equal
the same loop run as one plain process (no DeepSpeed): the reference.
"""

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

PROGRAM = Path(__file__).resolve().parent / "programs" / "accelerate_program.py"
DOORWAY = [sys.executable, "-m", "zero.integrations.doorway_cli"]
ACCELERATE_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  deepspeed_config_file: {ds_config}
  zero3_init_flag: {zero3_init}
num_processes: 2
num_machines: 1
machine_rank: 0
use_cpu: true
main_training_function: main
rdzv_backend: static
same_network: true
"""


def run(command, out) -> dict:
    run_launched(command, timeout=240)
    with open(out / "result.json") as handle:
        return json.load(handle)


def launch(tmp_path, stage, model_dir, out, *extra) -> dict:
    ds_config = tmp_path / "ds_config.json"
    zero_optimization = {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True}
    ds_config.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": 1,
                "gradient_clipping": 0.0,  # DeepSpeed 0.19 clips at 1.0; the plain loop does not
                "zero_optimization": zero_optimization,
            }
        )
    )
    config = tmp_path / "accelerate.yaml"
    config.write_text(
        ACCELERATE_CONFIG.format(ds_config=ds_config, zero3_init=str(stage == 3).lower())
    )
    command = [*DOORWAY, sys.executable, "-m", "accelerate.commands.launch"]
    command += ["--config_file", str(config), "--main_process_port", str(find_free_port())]
    command += [str(PROGRAM), "--model_dir", str(model_dir), "--output_dir", str(out), *extra]
    return run(command, out)


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("plain")
    command = [
        sys.executable,
        str(PROGRAM),
        "--model_dir",
        str(model_dir),
        "--output_dir",
        str(out),
    ]
    return run(command, out), load_file(out / "final" / "model.safetensors")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [2, 3])
def test_accelerate_launch_with_deepspeed_plugin(stage, model_dir, reference, tmp_path):
    ref_result, ref_weights = reference
    full = launch(tmp_path, stage, model_dir, tmp_path / "full")
    assert full["losses"] == pytest.approx(ref_result["losses"], abs=1e-5)
    got = load_file(tmp_path / "full" / "final" / "model.safetensors")
    assert got.keys() == ref_weights.keys()
    for key, value in ref_weights.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-5, msg=key)
    state = tmp_path / "full" / "state"
    assert (state / "latest").read_text().strip() == "pytorch_model"
    if stage != 3:
        return  # load_state is the same code at every stage: one stage keeps the suite short

    resumed = launch(tmp_path, stage, model_dir, tmp_path / "resumed", "--resume_from", str(state))
    assert resumed["losses"] == full["losses"][2:]
    again = load_file(tmp_path / "resumed" / "final" / "model.safetensors")
    for key, value in got.items():
        assert torch.equal(again[key], value), key
