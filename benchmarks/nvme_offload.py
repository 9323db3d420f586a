r"""Optimizer offload to nvme (ZeRO-Infinity) beside cpu offload and no offload, on the GPT.

    python benchmarks/nvme_offload.py --nvme_path /tmp/nvme --stage 3 --world_size 2 \
        --n_layer 4 --n_embd 256 --steps 10 --warmup 2
    python benchmarks/nvme_offload.py --nvme_path /tmp/nvme --capped --world_size 2 \
        --n_layer 8 --n_embd 1024 --steps 5 --warmup 0

Spawns `world_size` gloo ranks (CPU processes) once. Default mode: each rank runs the GPT of
examples/gpt.py (random byte tokens, same initialization and batches for every configuration)
with offload_optimizer none, cpu, nvme and nvme with ratio 0.5, and rank 0 prints the median
step time (forward + backward + optimizer step) of each.

--capped: one nvme run (bf16, 2-byte gradients, stage 3) under a per-rank host memory cap of
--cap_fraction x 12 Psi bytes, i.e. below the model's fp32 master weights + Adam moments: a
thread samples the rank's resident set every 5 ms and exits the rank when it passes the cap,
and the kernel's own peak (getrusage ru_maxrss) is checked against the cap at the end. Prints
the losses of each step and the peak. On a machine without GPUs host memory is the device's
memory too, so the cap covers parameters, gradients, activations and the swap buffers.
This is a measurement script, not a test: nothing here asserts on time.
"""

import argparse
import os
import resource
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from gpt import GPT, GPTConfig  # noqa: E402

import zero  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nvme_path", required=True, help="directory for the swap files")
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--world_size", type=int, default=2)
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_head", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=256)
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--micro_batch", type=int, default=4)
    parser.add_argument("--reduce_bucket_size", type=float, default=2e6)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--capped", action="store_true", help="the memory-capped nvme run")
    parser.add_argument(
        "--cap_fraction",
        type=float,
        default=0.8,
        help="cap = baseline RSS of an empty rank + cap_fraction x 12 Psi / N bytes",
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--nvme_params", type=int, default=1, help="--capped: offload_param nvme")
    parser.add_argument("--buffer_numel", type=float, default=4e6, help="nvme buffers, elements")
    return parser.parse_args(argv)


def config(args, offload: dict | None, dtype: str = "fp32") -> dict:
    zero_block = {
        "stage": args.stage,
        "reduce_bucket_size": int(args.reduce_bucket_size),
        "stage3_param_persistence_threshold": 0,
    }
    if offload is not None:
        zero_block["offload_optimizer"] = offload
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr}},
        "zero_optimization": zero_block,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
        cfg["data_types"] = {"grad_accum_dtype": "bf16"}
    return cfg


def batches(args, rank: int, count: int):
    g = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, 256, (args.micro_batch, args.block_size + 1), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def build(args, cfg, partitioned: bool = False):
    """The GPT under zero.initialize; `partitioned` builds it under zero.Init (stage 3), so no
    rank ever holds the whole fp32 model."""
    torch.manual_seed(0)
    shape = GPTConfig(
        n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size
    )
    if partitioned:
        with zero.Init(config_dict_or_path=cfg):
            model = GPT(shape)
    else:
        model = GPT(shape)
    engine, _, _, _ = zero.initialize(model=model, config=cfg)
    return engine


def train(engine, data, phase=None) -> tuple[list[float], list[float]]:
    losses, seconds = [], []
    for x, y in data:
        if phase is not None:
            phase[0] = f"step {len(losses) + 1}"
        start = time.perf_counter()
        loss = engine(x, y)
        loss = loss[1] if isinstance(loss, tuple) else loss
        engine.backward(loss)
        engine.step()
        seconds.append(time.perf_counter() - start)
        losses.append(float(loss))
    return losses, seconds


def timed(args, rank: int) -> None:
    nvme = {"device": "nvme", "nvme_path": args.nvme_path}
    runs = {
        "none": None,
        "cpu": {"device": "cpu"},
        "nvme": nvme,
        "nvme, ratio 0.5": dict(nvme, ratio=0.5),
    }
    data = batches(args, rank, args.warmup + args.steps)
    rows = []
    for name, offload in runs.items():
        engine = build(args, config(args, offload))
        psi = engine.optimizer.layout.numel
        _, seconds = train(engine, data)
        on_disk = engine.optimizer.offloader.bytes_on_disk if engine.optimizer.offloader else 0
        engine.close()
        rows.append((name, statistics.median(seconds[args.warmup :]) * 1e3, on_disk))
    if rank == 0:
        print(
            f"GPT n_layer={args.n_layer} n_embd={args.n_embd}: Psi = {psi:,}, stage "
            f"{args.stage}, N = {args.world_size} gloo CPU ranks, fp32, {os.cpu_count()} cores"
        )
        print("| offload_optimizer | median step ms | swap files per rank MiB |")
        print("|---|---|---|")
        for name, ms, on_disk in rows:
            print(f"| {name} | {ms:.1f} | {on_disk / 2**20:.1f} |")


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def capped(args, rank: int) -> None:
    psi = build_psi(args)
    # An empty rank: torch imported, threads set, no model (gloo's group adds a few MiB).
    baseline = _rss()
    budget = int(args.cap_fraction * 12 * psi / args.world_size)
    cap = baseline + budget
    peak = [0]
    phase = ["build"]
    stop = threading.Event()

    def watch():
        import psutil

        me = psutil.Process()
        while not stop.wait(0.005):
            rss = me.memory_info().rss
            peak[0] = max(peak[0], rss)
            if rss > cap:
                print(
                    f"rank {rank}: resident {rss / 2**20:.0f} MiB passed the cap "
                    f"{cap / 2**20:.0f} MiB during {phase[0]}",
                    flush=True,
                )
                os._exit(3)

    threading.Thread(target=watch, daemon=True).start()
    args.stage = 3
    buffer = int(args.buffer_numel)
    nvme = {"device": "nvme", "nvme_path": args.nvme_path, "buffer_count": 2}
    cfg = config(args, nvme, "bf16")
    cfg["zero_optimization"]["sub_group_size"] = buffer
    # fp32 gradient shards (4 Psi/N): 2-byte ones need a transient fp32 copy of every shard at
    # the step (2 + 4 Psi/N at the peak)
    cfg.pop("data_types")
    if args.nvme_params:
        cfg["zero_optimization"]["offload_param"] = {
            "device": "nvme",
            "nvme_path": args.nvme_path,
            "buffer_count": 4,
            "buffer_size": buffer,
            "max_in_cpu": 0,
        }
    engine = build(args, cfg, partitioned=True)
    built = _rss()
    # one batch, learnt: the loss must fall
    losses, seconds = train(engine, batches(args, rank, 1) * args.steps, phase)
    on_disk = engine.optimizer.nvme_bytes()
    engine.close()
    stop.set()
    kernel_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    mib = 2**20
    print(
        f"rank {rank}: Psi = {psi:,}; 12 Psi = {12 * psi / mib:.0f} MiB, 12 Psi/N = "
        f"{12 * psi / args.world_size / mib:.0f} MiB; empty rank {baseline / mib:.0f} MiB; cap "
        f"{baseline / mib:.0f} + {budget / mib:.0f} = {cap / mib:.0f} MiB; after build "
        f"{built / mib:.0f} MiB; peak {kernel_peak / mib:.0f} MiB (ru_maxrss), "
        f"{'within' if kernel_peak <= cap else 'ABOVE'} the cap; on nvme: params "
        f"{on_disk['params'] / mib:.0f} MiB, masters+Adam {on_disk['optimizer'] / mib:.0f} MiB; "
        f"losses {[round(v, 3) for v in losses]}; median step {statistics.median(seconds):.2f} s",
        flush=True,
    )


def build_psi(args) -> int:
    with torch.device("meta"):
        model = GPT(
            GPTConfig(
                n_layer=args.n_layer,
                n_head=args.n_head,
                n_embd=args.n_embd,
                block_size=args.block_size,
            )
        )
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def rank_main(rank: int, args, port: int) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(args.world_size),
        LOCAL_WORLD_SIZE=str(args.world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
    (capped if args.capped else timed)(args, rank)


def main(argv=None) -> None:
    args = parse_args(argv)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(rank_main, args=(args, port), nprocs=args.world_size)


if __name__ == "__main__":
    main()
