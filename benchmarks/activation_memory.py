r"""Activation memory and step time of the GPT of examples/gpt.py under ZeRO-R options.

    python benchmarks/activation_memory.py --sizes 128x4,256x4,384x6 --block_size 128 \
        --micro_batch 8 --steps 5 --warmup 2

Spawns 2 gloo ranks (CPU processes) once and runs, for every model size (n_embd x n_layer), ZeRO
stage 2 (fp32) with:

| row       | model parallel | checkpointing | activation_checkpointing options     |
|-----------|----------------|---------------|--------------------------------------|
| off       | 1 (dp 2)       | no            |                                      |
| ckpt      | 1 (dp 2)       | every block   |                                      |
| off mp2   | 2 (dp 1)       | no            |                                      |
| ckpt mp2  | 2 (dp 1)       | every block   |                                      |
| Pa        | 2 (dp 1)       | every block   | partition_activations                |
| Pa+cpu    | 2 (dp 1)       | every block   | partition_activations, cpu_checkpointing |

Memory is counted, not sampled (CPU ranks have no allocator statistics): during one extra
forward, a saved-tensor hook sums the distinct storages autograd keeps for backward (parameters
excluded), and zero.checkpointing.memory_stats() gives the bytes its checkpoints keep on the
device and in host memory. "kept" is what lives from the end of forward until backward; "peak"
adds the working set of recomputing one block (its saved tensors, counted the same way), which
backward holds on top of the kept bytes. Step time is the median of --steps optimizer steps
(forward, backward, step) after --warmup, without the counting hook. Rank 0 prints a markdown
table (bytes per rank, MiB). A measurement script, not a test.
"""

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from gpt import GPT, GPTConfig  # noqa: E402

import zero  # noqa: E402

ROWS = [
    ("off", 1, False, {}),
    ("ckpt", 1, True, {}),
    ("off mp2", 2, False, {}),
    ("ckpt mp2", 2, True, {}),
    ("Pa", 2, True, {"partition_activations": True}),
    ("Pa+cpu", 2, True, {"partition_activations": True, "cpu_checkpointing": True}),
]
MIB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="128x4,256x4,384x6", help="n_embd x n_layer, ...")
    parser.add_argument("--n_head", type=int, default=4)
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--micro_batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    return parser.parse_args(argv)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class SavedBytes:
    """Saved-tensor hooks that sum the distinct non-parameter storages autograd keeps."""

    def __init__(self, model):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages: dict[int, int] = {}

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.params:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def total(self) -> int:
        return sum(self.storages.values())

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def build(args, n_embd, n_layer, mp_size, checkpointing, options, mpus):
    cfg = GPTConfig(
        block_size=args.block_size,
        n_layer=n_layer,
        n_head=args.n_head,
        n_embd=n_embd,
        activation_checkpointing=checkpointing,
    )
    mpu = mpus[mp_size]
    torch.manual_seed(0)
    model = GPT(cfg, mpu if mp_size > 1 else None)
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 500_000},
        "activation_checkpointing": dict(options),
    }
    engine, _, _, _ = zero.initialize(model=model, config=config, mpu=mpu)
    return engine


def measure_memory(engine, x, y) -> dict:
    from zero import checkpointing

    counter = SavedBytes(engine.module)
    checkpointing.reset_peak_stats()
    with counter.hooks():
        loss = engine(x, y)
    stats = checkpointing.memory_stats()
    kept_device = counter.total + stats["device_bytes"]
    engine.backward(loss)
    engine.step()
    # Working set of recomputing one block: what the block saves when run with grad.
    block = engine.module.blocks[0]
    h = torch.randn(x.shape[0], x.shape[1], engine.module.config.n_embd, requires_grad=True)
    block_counter = SavedBytes(block)
    with block_counter.hooks():
        block(h)
    recompute = block_counter.total if engine.module.config.activation_checkpointing else 0
    return {
        "kept_device": kept_device,
        "kept_host": stats["host_bytes"],
        "peak_device": kept_device + recompute,  # recomputation runs on the device
    }


def time_steps(engine, x, y, steps, warmup) -> float:
    times = []
    for i in range(steps + warmup):
        start = time.perf_counter()
        engine.backward(engine(x, y))
        engine.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def worker(rank: int, args, port: int) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    mpus = {1: zero.mpu.initialize_model_parallel(1), 2: zero.mpu.initialize_model_parallel(2)}
    results = []
    for size in args.sizes.split(","):
        n_embd, n_layer = (int(v) for v in size.split("x"))
        for name, mp_size, checkpointing, options in ROWS:
            engine = build(args, n_embd, n_layer, mp_size, checkpointing, options, mpus)
            dp_rank = mpus[mp_size].get_data_parallel_rank()
            g = torch.Generator().manual_seed(dp_rank)
            x = torch.randint(0, 256, (args.micro_batch, args.block_size), generator=g)
            y = torch.roll(x, -1, dims=1)
            memory = measure_memory(engine, x, y)
            step_ms = time_steps(engine, x, y, args.steps, args.warmup)
            results.append((size, name, memory, step_ms, engine.module.num_parameters()))
            del engine
    if rank == 0:
        report(args, results)


def report(args, results) -> None:
    print(
        f"GPT, block_size {args.block_size}, micro-batch {args.micro_batch}, fp32, ZeRO stage 2, "
        f"2 CPU ranks (gloo), median of {args.steps} steps; bytes per rank"
    )
    print()
    print(
        "| model (n_embd x n_layer, params) | row | kept device MiB | kept host MiB | "
        "peak device MiB | step ms |"
    )
    print("|---|---|---|---|---|---|")
    for size, name, memory, step_ms, params in results:
        print(
            f"| {size} ({params / 1e6:.2f} M) | {name} | {memory['kept_device'] / MIB:.2f} | "
            f"{memory['kept_host'] / MIB:.2f} | {memory['peak_device'] / MIB:.2f} | "
            f"{step_ms:.0f} |"
        )


def main(argv=None) -> None:
    args = parse_args(argv)
    mp.spawn(worker, args=(args, free_port()), nprocs=2, join=True)


if __name__ == "__main__":
    main()
