"""examples/finetune_hf.py end to end under zrun (2 CPU ranks, about 10 s): a tiny Llama it
creates itself, loaded under zero.Init at stage 3, LoRA adapters through peft with transformers'
gradient checkpointing, trained on the default text (Python's own source, no download), merged
and exported; from_pretrained of the export gives the trained engine's logits.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parent.parent
CONFIG = """{
  "train_micro_batch_size_per_gpu": 4, "steps_per_print": 5, "gradient_clipping": 1.0,
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100,
                        "stage3_module_granularity_threshold": 20000}
}"""


def zrun() -> list[str]:
    from zero.launcher.world import find_free_port

    launcher = "import sys; from zero.launcher import main; sys.exit(main())"
    return [
        sys.executable,
        "-c",
        launcher,
        "--num_gpus",
        "2",
        "--master_port",
        str(find_free_port()),
    ]


@pytest.mark.timeout(120)
def test_lora_at_stage_3_trains_and_exports_what_from_pretrained_reads(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config = tmp_path / "zero3.json"
    config.write_text(CONFIG)
    command = [*zrun(), "examples/finetune_hf.py", "--init-tiny", "llama", "--config", str(config)]
    command += ["--steps", "12", "--block_size", "64", "--eval_batches", "2", "--lora", "4"]
    command += ["--gradient_checkpointing", "--out", str(tmp_path / "out")]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "loaded partitioned (zero.Init)" in result.stdout
    assert re.search(r"8,192 trained \(LoRA r=4\)", result.stdout), result.stdout
    final = re.search(r"^final: (.*)$", result.stdout, re.MULTILINE)
    values = dict(item.split("=") for item in final.group(1).split())
    assert float(values["val_loss"]) < float(values["val_loss_before"]) - 0.1, values
    assert float(values["logits_max_diff"]) <= 1e-5, values

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model")
    assert type(model).__name__ == "LlamaForCausalLM"
    base = load_file(tmp_path / "out" / "tiny-llama" / "model.safetensors")
    merged = model.state_dict()
    assert not any("lora" in name for name in merged)
    # the adapters are merged into the projections; what LoRA does not touch is the base's
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[q_proj], base[q_proj])
    norm = "model.layers.0.input_layernorm.weight"
    assert torch.equal(merged[norm], base[norm])
    assert torch.equal(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
