"""Engine.close(): a closed engine, once the script drops it, leaves nothing behind.

A script that builds engines in a loop (a hyper-parameter sweep, a test suite, Hugging Face's
Trainer run twice in one process) calls zero.initialize, trains, closes the engine and drops
it; every cycle must return what it took. One process at world size 1 runs the same engine code
as a rank of a larger group (the gradient hooks, the stage-3 gatherer, the offload paths).
"""

import copy
import gc
import weakref

import psutil
import pytest
import torch

import zero
from tests.distributed import one_thread

WIDTH, DEPTH = 512, 4
MODEL_BYTES = 4 * WIDTH * (WIDTH + 1) * DEPTH  # 4 MiB in fp32; with Adam's state, 16 MiB
CYCLES = 20


class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).mean()


def config(stage: int, offload: bool) -> dict:
    zero_block = {"stage": stage}
    if stage == 3:
        # one fetch unit per layer, none persistent: each unit's forward hooks its graph
        zero_block["stage3_module_granularity_threshold"] = WIDTH * WIDTH + WIDTH
        zero_block["stage3_param_persistence_threshold"] = 0
    if offload:
        zero_block["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zero_block["offload_param"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": zero_block,
    }


def cycle(template, cfg):
    """initialize, one step, close, drop: weak references to what the engine was made of, and
    the last loss, which a script's loop variable keeps."""
    engine, optimizer, _, _ = zero.initialize(model=copy.deepcopy(template), config=cfg)
    loss = engine(torch.randn(2, WIDTH))
    engine.backward(loss)
    engine.step()
    engine(torch.randn(2, WIDTH))  # a forward whose backward never comes
    engine.close()
    parts = [engine, optimizer] + ([engine.gatherer] if engine.gatherer is not None else [])
    refs = [weakref.ref(part) for part in parts]
    del engine, optimizer, parts
    gc.collect()
    return refs, loss


def live_tensors() -> list[tuple]:
    return [(type(o).__name__, tuple(o.shape)) for o in gc.get_objects() if torch.is_tensor(o)]


@pytest.mark.parametrize(
    "stage, offload",
    [(0, False), (1, False), (2, False), (3, False), (2, True), (3, True)],
    ids=["stage0", "stage1", "stage2", "stage3", "stage2-offload", "stage3-offload"],
)
def test_initialize_close_cycles_keep_memory_flat(stage, offload):
    template, cfg = Stack(), config(stage, offload)
    # Frozen objects are left out of collections and of gc.get_objects(): each collection stays
    # cheap, and after the first cycle (torch's and zero's one-time state) what the cycles
    # leave alive is all the count sees.
    gc.freeze()
    try:
        with one_thread():
            cycle(template, cfg)
            gc.freeze()
            process = psutil.Process()
            rss = []
            for number in range(1, CYCLES):
                refs, loss = cycle(template, cfg)  # the loss of this cycle is still alive
                kept = [type(ref()).__name__ for ref in refs if ref() is not None]
                assert not kept, f"cycle {number}: closed and dropped, yet alive: {kept}"
                rss.append(process.memory_info().rss)
            del loss
            gc.collect()
            left = live_tensors()
    finally:
        gc.unfreeze()
    assert not left, f"tensors left by {CYCLES - 1} cycles: {left[:8]}"
    # The allocator keeps some freed memory for reuse, so RSS wanders by a few MiB; a cycle that
    # leaked even one fp32 copy of the model would add 12 copies between these readings.
    grown = min(rss[-3:]) - max(rss[2:5])
    assert grown < 8 * MODEL_BYTES, f"RSS grew {grown >> 20} MiB in {CYCLES - 5} cycles"
