r"""Checkpoint save/load cost of zero (sharded, stage 2) beside torch.save / torch.load.

    python benchmarks/checkpoint_io.py --n_layer 11 --n_embd 768 --world_size 2 --repeats 3

Spawns `world_size` gloo ranks (CPU processes) once. Every rank builds the GPT of examples/gpt.py
(default ~78M parameters, ~312 MB of fp32 weights), wraps it in a zero stage-2 engine with AdamW
and takes one optimizer step, so Adam's exp_avg / exp_avg_sq exist. Rank 0 also builds the same
model as a plain torch module with torch.optim.AdamW and takes one step on the same batch. Then,
contestants taking turns per repetition so drift of a shared machine hits them alike:

- zero: engine.save_checkpoint (all ranks, a new tag per repetition) and engine.load_checkpoint
  (which checks the crc32 of every file it reads unless --no_verify_checksums);
- torch: torch.save({"model": ..., "optimizer": ...}) from rank 0 (fsync'ed, as zero fsyncs its
  files) and torch.load + model.load_state_dict + optimizer.load_state_dict on rank 0.

Per call and rank: wall time (a barrier precedes the clock read; median of --repeats) and the
peak extra memory (process RSS sampled by a psutil thread every --sample_ms, minus the RSS just
before the call; also the anonymous part, RSS minus file-backed/shared pages, since safetensors
reads through mmap and mapped file pages count in RSS). Loads run twice: with the files in the
page cache (they were just written: optimistic) and after dropping the files' pages with
posix_fadvise(DONTNEED) (the disk, or the host's cache on a VM). The crc32 pass alone (what a
save adds after writing a file, and a load before reading one) is timed on each rank's file,
warm. Finally the parent process times zero's consolidate() (zero-to-fp32, which checks every
file's crc32 too) and save_consolidated() of the saved checkpoint.

Rank 0 / the parent prints a markdown table (the results land in docs/performance.md). This is a
measurement script, not a test: nothing here asserts on time.
"""

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from _common import evict, free_port, init_rank  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

import zero  # noqa: E402
from zero.checkpoint import consolidate, file_crc32, save_consolidated  # noqa: E402

LR = 1e-4
MB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n_layer", type=int, default=11, help="GPT blocks (model size)")
    parser.add_argument("--n_embd", type=int, default=768, help="GPT width (model size)")
    parser.add_argument("--n_head", type=int, default=12)
    parser.add_argument("--block_size", type=int, default=32, help="tokens per sample")
    parser.add_argument("--micro_batch", type=int, default=1)
    parser.add_argument("--world_size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per operation")
    parser.add_argument("--sample_ms", type=float, default=2.0, help="RSS sampling period")
    parser.add_argument(
        "--dir", default=None, help="parent of the temporary checkpoint directory (default /tmp)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints afterwards")
    parser.add_argument(
        "--no_verify_checksums",
        action="store_true",
        help="load with checkpoint.verify_checksums false (and consolidate with verify=False)",
    )
    return parser.parse_args(argv)


def filesystem(path: str) -> str:
    """'fstype on device (mount point)' of the mount holding path."""
    real = os.path.realpath(path)
    best = None
    for part in psutil.disk_partitions(all=True):
        inside = real == part.mountpoint or real.startswith(part.mountpoint.rstrip("/") + "/")
        if inside and (best is None or len(part.mountpoint) > len(best.mountpoint)):
            best = part
    if best is None:
        return "unknown filesystem"
    return f"{best.fstype} on {best.device} (mounted at {best.mountpoint})"


def dir_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


# ----- measurement ------------------------------------------------------------------------------
class PeakMemory:
    """Peak RSS and peak anonymous memory (RSS minus shared/file-backed pages) of this process,
    in bytes above their values at entry, sampled by a thread every `period_s`.

    The sampler is a Python thread: it runs whenever the measured call releases the GIL (torch
    kernels and file I/O do). /proc/self's VmHWM is reset at entry and read at exit as an exact
    cross-check of the RSS peak.
    """

    def __init__(self, period_s: float):
        self.period_s = period_s
        self.process = psutil.Process()
        self._stop = threading.Event()

    def _sample(self) -> tuple[int, int]:
        info = self.process.memory_info()
        return info.rss, info.rss - info.shared

    def _run(self) -> None:
        while not self._stop.is_set():
            rss, anon = self._sample()
            self.peak_rss, self.peak_anon = max(self.peak_rss, rss), max(self.peak_anon, anon)
            time.sleep(self.period_s)

    def __enter__(self):
        gc.collect()
        _reset_hwm()
        self.base_rss, self.base_anon = self._sample()
        self.peak_rss, self.peak_anon = self.base_rss, self.base_anon
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        rss, anon = self._sample()
        self.peak_rss, self.peak_anon = max(self.peak_rss, rss), max(self.peak_anon, anon)
        hwm = _hwm()
        self.extra_rss = self.peak_rss - self.base_rss
        self.extra_anon = self.peak_anon - self.base_anon
        self.extra_hwm = None if hwm is None else hwm - self.base_rss


def _reset_hwm() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # "5" resets the peak RSS (VmHWM) to the current RSS
    except OSError:
        pass


def _hwm() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def measure(fn, period_s: float, barrier: bool) -> dict:
    """Run fn once: seconds (clock read after a barrier when `barrier`) and memory peaks."""
    if barrier:
        dist.barrier()
    with PeakMemory(period_s) as memory:
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
    return {
        "s": seconds,
        "rss": memory.extra_rss,
        "anon": memory.extra_anon,
        "hwm": memory.extra_hwm,
    }


def summarize(samples: list[dict]) -> dict:
    """Median time; the largest memory peak over the repetitions."""
    hwm = [s["hwm"] for s in samples if s["hwm"] is not None]
    return {
        "s": statistics.median(s["s"] for s in samples),
        "all_s": [s["s"] for s in samples],
        "rss": max(s["rss"] for s in samples),
        "anon": max(s["anon"] for s in samples),
        "hwm": max(hwm) if hwm else None,
    }


# ----- the two contestants ----------------------------------------------------------------------
def build_model(args) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(
        n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size
    )
    return GPT(config)


def batch(args) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (args.micro_batch, args.block_size + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def build_engine(args):
    """A stage-2 fp32 engine after one AdamW step (the same batch on every rank)."""
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": {"stage": 2},
        "checkpoint": {"verify_checksums": not args.no_verify_checksums},
    }
    engine, _, _, _ = zero.initialize(model=build_model(args), config=config)
    x, y = batch(args)
    engine.backward(engine(x, y))
    engine.step()
    return engine


def build_torch(args, hyper: dict):
    """The same model as a plain module + torch.optim.AdamW (zero's resolved hyper-parameters)
    after one step on the same batch; gradients freed as a training loop's zero_grad would."""
    model = build_model(args)
    kwargs = {k: hyper[k] for k in ("lr", "betas", "eps", "weight_decay") if k in hyper}
    optimizer = torch.optim.AdamW(model.parameters(), **kwargs)
    x, y = batch(args)
    model(x, y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def torch_save(model, optimizer, path: str) -> None:
    with open(path, "wb") as handle:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, handle)
        handle.flush()
        os.fsync(handle.fileno())


def torch_load(model, optimizer, path: str) -> None:
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def master_copy(engine) -> list[torch.Tensor]:
    return [b.master.detach().clone() for b in engine.optimizer.buckets]


# ----- per rank ---------------------------------------------------------------------------------
def time_saves(engine, plain, paths, tags, period) -> dict[str, list]:
    """zero save (all ranks) and torch.save (rank 0) in turns, one of each per tag."""
    zero_dir, torch_file = paths
    runs = {"zero_save": [], "torch_save": []}
    for tag in tags:
        save = partial(engine.save_checkpoint, zero_dir, tag=tag)
        runs["zero_save"].append(measure(save, period, barrier=True))
        if plain is not None:
            save = partial(torch_save, *plain, torch_file)
            runs["torch_save"].append(measure(save, period, barrier=False))
        dist.barrier()
    return runs


def time_loads(engine, plain, paths, tags, period, cold: bool) -> dict[str, list]:
    """zero load (all ranks) and torch.load (rank 0) in turns; `cold` drops the files' pages
    from the page cache before every call."""
    zero_dir, torch_file = paths
    suffix = "_cold" if cold else ""
    runs = {"zero_load" + suffix: [], "torch_load" + suffix: []}
    for tag in tags:
        if cold and plain is not None:
            evict(zero_dir)  # the page cache is shared: rank 0 drops every rank's files
        load = partial(engine.load_checkpoint, zero_dir, tag=tag)
        runs["zero_load" + suffix].append(measure(load, period, barrier=True))
        if plain is not None:
            if cold:
                evict(torch_file)
            load = partial(torch_load, *plain, torch_file)
            runs["torch_load" + suffix].append(measure(load, period, barrier=False))
        dist.barrier()
    return runs


def run_rank(args, root: str, rank: int) -> dict:
    period = args.sample_ms / 1000.0
    engine = build_engine(args)
    plain = build_torch(args, dict(engine.optimizer.param_groups[0])) if rank == 0 else None
    dist.barrier()
    paths = (os.path.join(root, "zero"), os.path.join(root, "torch.pt"))
    tags = [f"rep{i}" for i in range(args.repeats)]
    before = master_copy(engine)
    runs = time_saves(engine, plain, paths, tags, period)
    runs.update(time_loads(engine, plain, paths, tags, period, cold=False))
    runs.update(time_loads(engine, plain, paths, tags, period, cold=True))
    own_file = os.path.join(paths[0], tags[-1], f"rank{rank}.safetensors")
    crc = partial(file_crc32, own_file)
    runs["crc32"] = [measure(crc, period, barrier=True) for _ in tags]
    after = master_copy(engine)
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "load changed the weights"
    result = {name: summarize(samples) for name, samples in runs.items() if samples}
    result["psi"] = engine.optimizer.layout.numel
    rank_file = os.path.join(paths[0], tags[-1], f"rank{rank}.safetensors")
    result["rank_file_bytes"] = os.path.getsize(rank_file)
    return result


def worker(rank: int, args: argparse.Namespace, port: int, root: str) -> None:
    init_rank(rank, args.world_size, port)
    try:
        result = run_rank(args, root, rank)
        gathered = [None] * args.world_size
        dist.all_gather_object(gathered, result)
        if rank == 0:
            with open(os.path.join(root, "results.json"), "w") as handle:
                json.dump(gathered, handle)
    finally:
        dist.destroy_process_group()


# ----- consolidation (one process) and report ---------------------------------------------------
def run_consolidate(args, root: str) -> dict:
    period = args.sample_ms / 1000.0
    checkpoint = os.path.join(root, "zero", f"rep{args.repeats - 1}")
    output = os.path.join(root, "consolidated.safetensors")
    held = {}

    def load():
        held["state"] = consolidate(checkpoint, verify=not args.no_verify_checksums)

    loads, writes = [], []
    for _ in range(args.repeats):
        held.clear()
        loads.append(measure(load, period, barrier=False))
        writes.append(measure(lambda: save_consolidated(held["state"], output), period, False))
    numel = sum(t.numel() for t in held["state"].values())
    return {
        "consolidate": summarize(loads),
        "save_consolidated": summarize(writes),
        "tensors": len(held["state"]),
        "numel": numel,
        "bytes": os.path.getsize(output),
    }


def mb(value) -> str:
    return "-" if value is None else f"{value / MB:,.0f}"


def cells(per_rank: list[dict | None], key: str, fmt) -> str:
    return " / ".join("-" if r is None else fmt(r[key]) for r in per_rank)


def print_report(args, root: str, results: list[dict], merged: dict) -> None:
    n = args.world_size
    psi = results[0]["psi"]
    zero_bytes = dir_bytes(os.path.join(root, "zero", f"rep{args.repeats - 1}"))
    torch_bytes = os.path.getsize(os.path.join(root, "torch.pt"))
    print(
        f"machine: {psutil.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB, "
        f"torch {torch.__version__}, world size {n} (gloo)"
    )
    print(
        f"model: GPT n_layer={args.n_layer} n_embd={args.n_embd} n_head={args.n_head} "
        f"block_size={args.block_size}: Psi = {psi:,} trainable parameters "
        f"({4 * psi / MB:,.0f} MiB fp32); zero stage 2 fp32 + AdamW, one step taken"
    )
    print(f"checkpoint directory: {root}, {filesystem(root)}")
    print(
        "deepspeed: "
        + (
            "importable, but its save is not wired into this script"
            if _deepspeed_importable()
            else "not installed here, no DeepSpeed row"
        )
    )
    rank_files = ", ".join(f"rank{r} {mb(res['rank_file_bytes'])}" for r, res in enumerate(results))
    print(
        f"on disk: zero {mb(zero_bytes)} MiB in {n} rank files ({rank_files} MiB) + meta.json + "
        f"module.safetensors; torch.save {mb(torch_bytes)} MiB in one file; consolidated fp32 "
        f"{mb(merged['bytes'])} MiB ({merged['tensors']} tensors, {merged['numel']:,} elements)"
    )
    verify = "off (--no_verify_checksums)" if args.no_verify_checksums else "on"
    print(f"crc32 verification on load and in consolidate(): {verify}")
    print(
        f"times: median of {args.repeats}, seconds; memory: peak over the repetitions of the "
        f"extra RSS (anonymous part) above the RSS before the call, MiB; values are per rank "
        f"(rank 0 / rank 1 / ...). 'warm': files in the page cache; 'cold': pages dropped with "
        f"posix_fadvise(DONTNEED) first"
    )
    print()
    rows = [
        ("zero save_checkpoint", "all ranks", "zero_save", zero_bytes),
        ("zero load_checkpoint, warm", "all ranks", "zero_load", zero_bytes),
        ("zero load_checkpoint, cold", "all ranks", "zero_load_cold", zero_bytes),
        ("torch.save(model+optim sd)", "rank 0", "torch_save", torch_bytes),
        ("torch.load + load_state_dict, warm", "rank 0", "torch_load", torch_bytes),
        ("torch.load + load_state_dict, cold", "rank 0", "torch_load_cold", torch_bytes),
        ("crc32 of the rank's own file, warm", "all ranks", "crc32", results[0]["rank_file_bytes"]),
    ]
    print(
        "| operation | who | bytes on disk MiB | time s | peak extra RSS MiB | of which anon MiB |"
    )
    print("|---|---|---|---|---|---|")
    for label, who, key, size in rows:
        per_rank = [r.get(key) for r in results]
        print(
            f"| {label} | {who} | {mb(size)} | {cells(per_rank, 's', lambda v: f'{v:.2f}')} "
            f"| {cells(per_rank, 'rss', mb)} | {cells(per_rank, 'anon', mb)} |"
        )
    for label, key, size in (
        ("zero consolidate() (zero-to-fp32 read)", "consolidate", zero_bytes),
        ("zero save_consolidated() (write)", "save_consolidated", merged["bytes"]),
    ):
        r = merged[key]
        print(
            f"| {label} | 1 process | {mb(size)} | {r['s']:.2f} | {mb(r['rss'])} "
            f"| {mb(r['anon'])} |"
        )
    print()
    print("all timings (s) and VmHWM cross-check of the RSS peak (MiB):")
    keys = ("zero_save", "zero_load", "zero_load_cold", "torch_save", "torch_load", "crc32")
    for key in keys:
        for rank, res in enumerate(results):
            if key in res:
                times = ", ".join(f"{t:.2f}" for t in res[key]["all_s"])
                print(f"- {key} rank {rank}: {times}; VmHWM extra {mb(res[key]['hwm'])}")
    for key in ("consolidate", "save_consolidated"):
        times = ", ".join(f"{t:.2f}" for t in merged[key]["all_s"])
        print(f"- {key}: {times}; VmHWM extra {mb(merged[key]['hwm'])}")


def _deepspeed_importable() -> bool:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv=None) -> None:
    args = parse_args(argv)
    parent = args.dir or "/tmp"
    os.makedirs(parent, exist_ok=True)
    root = tempfile.mkdtemp(prefix="zero_ckpt_io_", dir=parent)
    try:
        mp.spawn(worker, args=(args, free_port(), root), nprocs=args.world_size, join=True)
        with open(os.path.join(root, "results.json")) as handle:
            results = json.load(handle)
        merged = run_consolidate(args, root)
        print_report(args, root, results, merged)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
