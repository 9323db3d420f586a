"""Checkpoints written by an earlier zero (tests/checkpoint/data/zero-0.1.0, made by
data/write_saved_checkpoints.py) still load: resuming them at the same world size gives the
earlier code's next step bit for bit, whatever the package's internal module layout."""

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


def test_checkpoints_of_zero_0_1_0_resume_bitwise():
    stages = (2, 3)
    results = run_ranks(resume_and_step, 2, stages)
    for stage in stages:
        expected = load_file(os.path.join(SAVED, f"stage{stage}", "after_step3.safetensors"))
        for rank_result in results:
            got = rank_result[stage]
            assert got.keys() == expected.keys()
            for name, value in expected.items():
                assert torch.equal(got[name], value), (stage, name)
