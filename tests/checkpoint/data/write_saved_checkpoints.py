"""Write the checkpoints in tests/checkpoint/data/ with the zero on sys.path (public API only).

    python tests/checkpoint/data/write_saved_checkpoints.py OUT_DIR

For each stage in STAGES, two gloo ranks train parity_model.Net for two optimizer steps and save
OUT_DIR/stage{N} (tag "step2"), then take one more step and write the module's state dict to
OUT_DIR/stage{N}/after_step3.safetensors. test_saved_format.py loads these with the current
code: the format is the compatibility promise, so a change that stops them loading is a bug.
"""

import os
import sys

import torch
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE))]  # tests/: distributed, parity_model
from distributed import run_ranks  # noqa: E402
from parity_model import Net, batches, config, param_groups  # noqa: E402

STAGES = (2, 3)
SCHEDULER = {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 10}}


def saved_config(stage: int, world_size: int) -> dict:
    cfg = config(stage, gas=2, clip=1.0, world_size=world_size)
    cfg["scheduler"] = SCHEDULER
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    return cfg


def make_engine(stage: int, world_size: int):
    import zero

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2, betas=(0.9, 0.99), eps=1e-8)
    engine, *_ = zero.initialize(model=model, optimizer=opt, config=saved_config(stage, world_size))
    return engine


def train_step(engine, step_batches, rank: int) -> None:
    for micro in step_batches:
        x, y, _ = micro[rank]
        engine.backward(engine(x, y))
        engine.step()


def write(out: str) -> None:
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])
    data = batches(2, gas=2, steps=3, same_modules=True)
    for stage in STAGES:
        engine = make_engine(stage, 2)
        for step in data[:2]:
            train_step(engine, step, rank)
        directory = os.path.join(out, f"stage{stage}")
        engine.save_checkpoint(directory, tag="step2")
        train_step(engine, data[2], rank)
        state = {k: v.detach().clone().contiguous() for k, v in engine.module.state_dict().items()}
        if rank == 0:
            save_file(state, os.path.join(directory, "after_step3.safetensors"))


if __name__ == "__main__":
    run_ranks(write, 2, os.path.abspath(sys.argv[1]))
