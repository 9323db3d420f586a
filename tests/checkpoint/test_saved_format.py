"""Checkpoints written by an earlier zero (tests/checkpoint/data/zero-0.1.0, made by
data/write_saved_checkpoints.py) still load: resuming them at the same world size gives the
earlier code's next step, whatever the package's internal module layout. The stored step was
computed on the machine that wrote the data, whose CPU may round the last bits of a sum
differently from this one, so it is compared within fp32 rounding, not bit for bit: a few units
in the last place, far below what one step moves a weight (lr 1e-2 warmed up, Adam-normalized),
so a state that loads wrong (a moment, a master weight, the step count) still fails."""

import os

import torch
from distributed import run_ranks
from safetensors.torch import load_file

DATA = os.path.join(os.path.dirname(__file__), "data")
SAVED = os.path.join(DATA, "zero-0.1.0")


def resume_and_step(stages):
    import sys

    import torch.distributed as dist

    sys.path.insert(0, DATA)
    from write_saved_checkpoints import batches, make_engine, train_step

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])
    data = batches(2, gas=2, steps=3, same_modules=True)
    out = {}
    for stage in stages:
        engine = make_engine(stage, 2)
        engine.load_checkpoint(os.path.join(SAVED, f"stage{stage}"))
        assert engine.global_steps == 2, engine.global_steps
        train_step(engine, data[2], rank)
        out[stage] = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return out


# fp32 rounding: about ten units in the last place relative (2**-23 = 1.2e-7), and an absolute
# floor for weights near zero far below one step's change (~1e-3).
RTOL, ATOL = 1.3e-6, 1e-6


def test_checkpoints_of_zero_0_1_0_resume_within_fp32_rounding():
    stages = (2, 3)
    results = run_ranks(resume_and_step, 2, stages)
    for stage in stages:
        expected = load_file(os.path.join(SAVED, f"stage{stage}", "after_step3.safetensors"))
        for rank, rank_result in enumerate(results):
            got = rank_result[stage]
            assert got.keys() == expected.keys()
            torch.testing.assert_close(
                got,
                expected,
                rtol=RTOL,
                atol=ATOL,
                msg=lambda m, s=stage, r=rank: f"stage {s} rank {r}: {m}",
            )
