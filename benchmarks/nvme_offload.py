r"""Optimizer offload to nvme (ZeRO-Infinity) beside cpu offload and no offload, on the GPT.

    python benchmarks/nvme_offload.py --nvme_path /tmp/nvme --stage 3 --world_size 2 \
        --n_layer 4 --n_embd 256 --steps 10 --warmup 2
    python benchmarks/nvme_offload.py --nvme_path /tmp/nvme --capped --world_size 1 \
        --n_layer 16 --n_embd 1024 --block_size 32 --micro_batch 2 --steps 8 --lr 1e-5 \
        --cap_fraction 0.6 --buffer_numel 4194304 --data tinyshakespeare.txt

Spawns `world_size` gloo ranks (CPU processes) once. Default mode: each rank runs the GPT of
examples/gpt.py (random byte tokens, same initialization and batches for every configuration)
with offload_optimizer none, cpu, nvme and nvme with ratio 0.5, and rank 0 prints the median
step time (forward + backward + optimizer step) of each.

--capped: one run (stage 3, bf16, 2-byte gradients, fp32 master + Adam and the parameter shards
on nvme) under a per-rank host memory cap of empty-rank RSS + --cap_fraction x 12 Psi / N bytes,
i.e. below what the fp32 master weights + Adam moments alone need without nvme: a thread
samples the rank's resident set every 5 ms and exits the rank when it passes the cap, and the
kernel's own peak (getrusage ru_maxrss) is checked against the cap at the end. It trains one
fixed batch (bytes of --data, else random tokens) --steps times, then (--reference 1) the same
model, seed and batch without offload and without a cap. Prints the holders measured from
zero's tensors, the RSS peak of each phase, the losses of both runs and the step time. The
ranks are spawned with MALLOC_MMAP_THRESHOLD_=65536 (glibc then returns freed tensors of more
than 64 KiB to the kernel at once; otherwise RSS does not fall when zero.Init's shards are
dropped). On a machine without GPUs host memory is the device's memory too, so the cap covers
parameters, gradients, activations and the swap buffers.
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
        default=0.7,
        help="cap = baseline RSS of an empty rank + cap_fraction x 12 Psi / N bytes",
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--nvme_params", type=int, default=1, help="--capped: offload_param nvme")
    parser.add_argument("--buffer_numel", type=float, default=4e6, help="nvme buffers, elements")
    parser.add_argument("--data", help="--capped: a text file; one fixed batch of its bytes")
    parser.add_argument(
        "--reference",
        type=int,
        default=1,
        help="--capped: then train the same model without offload, uncapped, and compare losses",
    )
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


def build(args, cfg, partitioned: bool = False, phase=None, rss=None):
    """The GPT under zero.initialize; `partitioned` builds it under zero.Init (stage 3), so no
    rank ever holds the whole fp32 model. phase: the watcher's phase name, set here; rss: a
    dict that gets the RSS after zero.Init."""
    torch.manual_seed(0)
    shape = GPTConfig(
        n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size
    )
    phase = phase if phase is not None else [""]
    phase[0] = "build zero.Init"
    if partitioned:
        with zero.Init(config_dict_or_path=cfg):
            model = GPT(shape)
    else:
        model = GPT(shape)
    if rss is not None:
        rss["after zero.Init"] = _rss()
    phase[0] = "build initialize"
    engine, _, _, _ = zero.initialize(model=model, config=cfg)
    return engine


def train(engine, data) -> tuple[list[float], list[float]]:
    losses, seconds = [], []
    for x, y in data:
        start = time.perf_counter()
        loss = engine(x, y)
        loss = loss[1] if isinstance(loss, tuple) else loss
        engine.backward(loss)
        engine.step()
        seconds.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
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


def text_batch(args, rank: int):
    """One fixed batch of real text (bytes of --data at fixed offsets, per rank)."""
    data = torch.frombuffer(bytearray(Path(args.data).read_bytes()), dtype=torch.uint8).long()
    g = torch.Generator().manual_seed(1000 + rank)
    starts = torch.randint(0, data.numel() - args.block_size - 1, (args.micro_batch,), generator=g)
    tokens = torch.stack([data[s : s + args.block_size + 1] for s in starts.tolist()])
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def capped_config(args) -> dict:
    """Stage 3, bf16 compute and 2-byte gradients; fp32 master + Adam and the bf16 parameter
    shards in nvme files; sub-groups and parameter buffers of --buffer_numel elements; at most
    --buffer_numel parameters prefetched and 3x that gathered at once."""
    args.stage = 3
    buffer = int(args.buffer_numel)
    nvme = {"device": "nvme", "nvme_path": args.nvme_path, "buffer_count": 2}
    cfg = config(args, nvme, "bf16")
    cfg["zero_optimization"].update(
        sub_group_size=buffer,
        stage3_prefetch_bucket_size=buffer,
        stage3_max_live_parameters=3 * buffer,
        stage3_max_reuse_distance=0,
    )
    if args.nvme_params:
        cfg["zero_optimization"]["offload_param"] = {
            "device": "nvme",
            "nvme_path": args.nvme_path,
            "buffer_count": 4,
            "buffer_size": buffer,
            "max_in_cpu": 0,
        }
    return cfg


def holders(engine) -> list[tuple[str, int]]:
    """Bytes this rank holds by kind, measured from zero's own tensors after a step."""
    opt = engine.optimizer
    states = opt.model_state_bytes()
    slots = opt.offloader.slots if opt.offloader is not None else []
    slot_bytes = sum(b.numel() * b.element_size() for s in slots for b in s.buffers.values())
    pool = opt.param_swap.pool if opt.param_swap is not None else []
    largest_unit = max(
        (sum(b.layout.padded_numel for b in u.buckets) for u in engine.gatherer.units), default=0
    )
    largest_sub_group = max(b.layout.shard_numel for b in opt.buckets)
    return [
        ("parameter shards resident (bf16; on nvme)", states["params"]),
        ("gradient shards (bf16, 2 Psi/N)", states["grads"]),
        ("fp32 master + Adam resident (on nvme)", states["master"] + states["optimizer_state"]),
        ("optimizer nvme slots (buffer_count x kinds x sub_group_size fp32)", slot_bytes),
        ("parameter swap buffers (buffer_count x buffer_size bf16)", sum(b.nbytes for b in pool)),
        ("step: one sub-group's fp32 gradient (transient)", 4 * largest_sub_group),
        ("largest gathered unit (bf16, transient)", 2 * largest_unit),
        (
            "zero.Init's fp32 shards (4 Psi/N, build only)",
            4 * opt.layout.numel // opt.layout.num_shards,
        ),
    ]


class Watch:
    """Samples this process's RSS every 5 ms, keeps the peak per phase, and exits the rank
    (code 3) the moment RSS passes `cap`."""

    def __init__(self, cap: int, rank: int):
        self.cap, self.rank = cap, rank
        self.phase = ["build"]
        self.peaks: dict[str, int] = {}
        self.stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        import psutil

        me = psutil.Process()
        while not self.stop.wait(0.005):
            rss, phase = me.memory_info().rss, self.phase[0].split(" ")[-1]
            self.peaks[phase] = max(self.peaks.get(phase, 0), rss)
            if rss > self.cap:
                print(
                    f"rank {self.rank}: resident {rss / 2**20:.0f} MiB passed the cap "
                    f"{self.cap / 2**20:.0f} MiB during {self.phase[0]}",
                    flush=True,
                )
                os._exit(3)


def train_phased(engine, data, phase) -> tuple[list[float], list[float]]:
    """train() with the phase named for the watcher: step k forward / backward / optimizer."""
    losses, seconds = [], []
    for k, (x, y) in enumerate(data, 1):
        start = time.perf_counter()
        phase[0] = f"step {k} forward"
        loss = engine(x, y)
        loss = loss[1] if isinstance(loss, tuple) else loss
        phase[0] = f"step {k} backward"
        engine.backward(loss)
        phase[0] = f"step {k} optimizer"
        engine.step()
        seconds.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    return losses, seconds


def capped(args, rank: int) -> None:
    psi = build_psi(args)
    # An empty rank: torch imported, threads set, no model (gloo's group adds a few MiB).
    baseline = _rss()
    budget = int(args.cap_fraction * 12 * psi / args.world_size)
    cap = baseline + budget
    watch = Watch(cap, rank)
    cfg = capped_config(args)
    batch = text_batch(args, rank) if args.data else batches(args, rank, 1)[0]
    points = {}
    engine = build(args, cfg, partitioned=True, phase=watch.phase, rss=points)
    points["after initialize"] = _rss()
    losses, seconds = train_phased(engine, [batch] * args.steps, watch.phase)
    table = holders(engine)
    on_disk = engine.optimizer.nvme_bytes()
    engine.close()
    watch.stop.set()
    kernel_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ref = reference(args, rank, batch) if args.reference else None
    if rank == 0:
        report(args, psi, baseline, cap, points, watch.peaks, kernel_peak, table, on_disk)
    print(
        f"rank {rank}: losses {[round(v, 4) for v in losses]}; median step "
        f"{statistics.median(seconds):.2f} s; peak {kernel_peak / 2**20:.0f} MiB "
        f"{'within' if kernel_peak <= cap else 'ABOVE'} the cap {cap / 2**20:.0f} MiB",
        flush=True,
    )
    if ref is not None:
        ref_losses, ref_peak = ref
        diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
        print(
            f"rank {rank}: reference (no offload, uncapped, same seed and data): losses "
            f"{[round(v, 4) for v in ref_losses]}; max |difference| {diff:.2e}; its peak "
            f"{ref_peak / 2**20:.0f} MiB",
            flush=True,
        )


def reference(args, rank: int, batch) -> tuple[list[float], int]:
    """The same model, seed and batch without any offload and without a cap: its losses and
    the process's peak RSS afterwards (ru_maxrss, the larger of both runs)."""
    cfg = config(args, None, "bf16")
    cfg["zero_optimization"]["stage"] = 3
    engine = build(args, cfg, partitioned=True)
    losses, _ = train(engine, [batch] * args.steps)
    engine.close()
    return losses, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def report(args, psi, baseline, cap, points, peaks, kernel_peak, table, on_disk) -> None:
    mib = 2**20
    n = args.world_size
    print(
        f"Psi = {psi:,}; 12 Psi = {12 * psi / mib:.0f} MiB; 12 Psi/N = {12 * psi / n / mib:.0f} "
        f"MiB (N = {n}); empty rank {baseline / mib:.0f} MiB; cap = {baseline / mib:.0f} + "
        f"{args.cap_fraction} x 12 Psi/N = {cap / mib:.0f} MiB; without nvme the fp32 master "
        f"+ Adam alone need {baseline / mib + 12 * psi / n / mib:.0f} MiB with the empty rank"
    )
    print("| holder (rank 0, measured from zero's tensors) | MiB |")
    print("|---|---|")
    for name, nbytes in table:
        print(f"| {name} | {nbytes / mib:.1f} |")
    print(
        f"| on nvme: parameter shards / fp32 master + Adam | {on_disk['params'] / mib:.0f} / "
        f"{on_disk['optimizer'] / mib:.0f} |"
    )
    print("| RSS (rank 0) | MiB |")
    print("|---|---|")
    print(f"| empty rank | {baseline / mib:.0f} |")
    for point, rss in points.items():
        print(f"| {point} | {rss / mib:.0f} |")
    for phase, peak in peaks.items():
        print(f"| peak during {phase} | {peak / mib:.0f} |")
    print(f"| peak (ru_maxrss) | {kernel_peak / mib:.0f} |")
    print(f"| cap | {cap / mib:.0f} |", flush=True)


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
    if args.capped:
        # glibc's dynamic mmap threshold keeps freed tensors of up to 32 MiB in the heap, so
        # RSS would not fall when zero.Init's fp32 shards are dropped; spawned ranks inherit
        # this environment and glibc reads it at their start.
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(rank_main, args=(args, port), nprocs=args.world_size)


if __name__ == "__main__":
    main()
