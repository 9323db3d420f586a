"""DeepSpeedExamples' CIFAR program (its shape and calls: programs/cifar_program.py; one
stand-in, a random dataset for torchvision's CIFAR10) runs to its end through zero-as-deepspeed
at stages 2 and 3 on 2 CPU ranks, started by DeepSpeed's `deepspeed` launcher, its config's
deprecated zero_optimization.cpu_offload included. Before, it stopped at its import of
deepspeed.moe.utils. Stage 3's losses equal stage 2's (fp32); bf16 runs to its end."""

import json
import sys
from pathlib import Path

import pytest
from launched import run_launched

from zero.launcher.world import find_free_port

PROGRAM = Path(__file__).resolve().parent / "programs" / "cifar_program.py"
DOORWAY = [sys.executable, "-m", "zero.integrations.doorway_cli"]


def run(stage: int, dtype: str) -> dict:
    command = [*DOORWAY, "deepspeed", "--num_gpus", "2", "--master_port", str(find_free_port())]
    command += [str(PROGRAM), "--stage", str(stage), "--dtype", dtype, "--deepspeed"]
    result = run_launched(command, timeout=240)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, result.stdout[-2000:]
    return json.loads(lines[0])


@pytest.mark.timeout(600)
def test_cifar_example_runs_to_its_end():
    stage2, stage3 = run(2, "fp32"), run(3, "fp32")
    assert len(stage2["losses"]) == 8  # 64 images / 16 per step x 2 epochs (WarmupLR from 0)
    for a, b in zip(stage2["losses"], stage3["losses"]):
        assert abs(a - b) <= 1e-5, (stage2["losses"], stage3["losses"])
    bf16 = run(3, "bf16")
    assert len(bf16["losses"]) == 8 and 0.0 <= bf16["accuracy"] <= 1.0
