r"""The largest GPT each system trains under a per-rank memory cap M on N ranks.

    python benchmarks/largest_model.py --cap_mib 600 --world_size 2 --precision 0.05

For each system (zero stages 0-3, zero stage 3 with offload_optimizer cpu, FSDP2, and DeepSpeed
stages 0-3 when deepspeed imports) it searches the largest GPT of examples/gpt.py, scaling
n_layer at a fixed --n_embd (--search layers) or the width at a fixed --n_layer (--search
width, in steps of 64), that completes --steps training steps (fp32, AdamW, clipping 1.0,
micro-batch --micro_batch x --block_size tokens) on every rank: from 0.7 of the system's own
fp32 formula, by 1.5x steps until the outcome flips, then bisecting to --precision. Each trial
runs in --world_size fresh processes (gloo, one intra-op thread each). Stage 3 builds under
zero.Init / deepspeed.zero.Init; the others build the full model and wrap it.

The cap: each rank imports torch, zero (and deepspeed for the ds rows), joins the process
group and runs one step of a 1 x 64 model of the same system (threads, kernels, JIT ops and
caches of a first step), then reads its VmData (the private writable mappings Linux counts
against RLIMIT_DATA) as the baseline and calls setrlimit(RLIMIT_DATA, baseline + M) before it
builds the model. So M is what the model, its optimizer, gradients, buffers and activations may
take. RLIMIT_DATA holds for torch's allocator (an over-cap torch.empty raises
"DefaultCPUAllocator: can't allocate memory") and counts allocated, not touched, memory. The
ranks run with glibc MALLOC_MMAP_THRESHOLD_ (freed tensors return to the kernel at once) and a
1 MiB RLIMIT_STACK (every thread's stack size; an 8 MiB stack per thread would count in M).

Reported per system: the largest n_layer / n_embd, its parameter count Psi, and
Psi / (N M / 16): the fraction of the paper's stage-3 bound (ZeRO, section 5: 16 bytes per
parameter of model states with Adam, all partitioned over N ranks). On a CPU-only machine
offload moves the optimizer state to the same process's host memory, so it cannot raise the
figure here: the row shows what the cap sees. Results and method: docs/performance.md.
"""

import argparse
import gc
import json
import os
import resource
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import formula, run_spawned, status_bytes  # noqa: E402

SYSTEMS = (
    "zero0",
    "zero1",
    "zero2",
    "zero3",
    "zero3_offload",
    "fsdp2",
    "ds0",
    "ds1",
    "ds2",
    "ds3",
)
WIDTH_STEP = 64
OOM_MARKERS = ("can't allocate memory", "bad_alloc", "Cannot allocate memory", "MemoryError")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cap_mib", type=int, default=300, help="M: MiB per rank over baseline")
    parser.add_argument("--world_size", type=int, default=2)
    parser.add_argument("--search", choices=("layers", "width"), default="layers")
    parser.add_argument("--n_layer", type=int, default=4, help="fixed depth for --search width")
    parser.add_argument("--n_embd", type=int, default=256, help="fixed width for --search layers")
    parser.add_argument("--n_head", type=int, default=4)
    parser.add_argument("--block_size", type=int, default=64)
    parser.add_argument("--micro_batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2, help="k: steps a trial must complete")
    parser.add_argument("--max_size", type=int, default=512, help="largest n_layer / width step")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per trial")
    parser.add_argument(
        "--precision", type=float, default=0.1, help="stop when the bracket is this fraction"
    )
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument(
        "--reduce_bucket_size",
        type=int,
        default=5_000_000,
        help="elements per gradient bucket for zero and DeepSpeed; 0: each one's own default "
        "(500M elements: DeepSpeed 1-2 then allocate a 2 GB bucket and fit nothing)",
    )
    parser.add_argument(
        "--thread_stack_kib",
        type=int,
        default=1024,
        help="RLIMIT_STACK of the ranks, hence their threads' stack size (0: inherit)",
    )
    parser.add_argument(
        "--malloc_mmap_threshold",
        type=int,
        default=65536,
        help="glibc MALLOC_MMAP_THRESHOLD_ of the ranks in bytes (0: glibc's adaptive default)",
    )
    parser.add_argument(
        "--stage3_overrides",
        type=json.loads,
        default={},
        help="JSON object of zero_optimization keys for the stage 3 rows of zero and DeepSpeed, "
        'e.g. \'{"stage3_prefetch_bucket_size": 0, "stage3_max_live_parameters": 1000000}\'',
    )
    args = parser.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"--systems: unknown {unknown}; choose from {','.join(SYSTEMS)}")
    return args


def shape(args, size: int) -> dict:
    """The GPT of one trial: `size` layers, or `size` * WIDTH_STEP wide."""
    if args.search == "layers":
        return {"n_layer": size, "n_embd": args.n_embd}
    return {"n_layer": args.n_layer, "n_embd": size * WIDTH_STEP}


def num_params(n_layer: int, n_embd: int, block_size: int) -> int:
    """Parameters of examples/gpt.py's GPT (vocab 256, biases, tied head), counted once."""
    per_block = 12 * n_embd * n_embd + 13 * n_embd
    return n_layer * per_block + (256 + block_size) * n_embd + 2 * n_embd


# ----- one trial, in fresh processes ------------------------------------------------------------
def trial_rank(rank: int, world_size: int, port: int, spec: dict, results) -> None:
    """One rank of one trial: imports, process group, cap, then build and --steps steps."""
    os.environ.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    import torch
    import torch.distributed as dist
    from _common import init_rank, make_batches

    init_rank(rank, world_size, port, "cpu", threads=1)
    from side_by_side import build_one

    from zero.optim import resolve_optimizer

    if spec["system"].startswith("ds"):
        import deepspeed  # noqa: F401  (its import is part of the baseline, not of M)
    args = argparse.Namespace(**spec["args"])
    _, params = resolve_optimizer("AdamW", {"lr": 1e-4})
    batches = make_batches(args, rank, args.steps)
    # One step of a 1 x 64 model of the same system first: the threads, kernels, op libraries
    # and caches that any first step creates then belong to the baseline, not to M.
    tiny = argparse.Namespace(**{**spec["args"], "n_layer": 1, "n_embd": 64})
    warm = build_one(tiny, spec["system"], params, torch.device("cpu"))
    warm.step(*make_batches(tiny, rank, 1)[0])
    del warm
    gc.collect()
    baseline = status_bytes("VmData")
    results.put((rank, "started", baseline))  # the queue's feeder thread exists before the cap
    resource.setrlimit(resource.RLIMIT_DATA, (baseline + spec["cap"], resource.RLIM_INFINITY))
    phase = "build"
    try:
        system = build_one(args, spec["system"], params, torch.device("cpu"))
        for i, (x, y) in enumerate(batches):
            phase = f"step {i + 1}"
            system.step(x, y)
        dist.barrier()
        results.put((rank, "ok", (baseline, status_bytes("VmHWM"))))
    except BaseException as exc:
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        kind = "oom" if any(m in text for m in OOM_MARKERS) else "error"
        where = traceback.extract_tb(exc.__traceback__)[-2:]
        frames = "; ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in where)
        results.put((rank, kind, f"in {phase} ({frames}): {text[-200:]}"))
        results.close()
        results.join_thread()
        # A peer may be waiting in a collective: leave without the process group's teardown.
        os._exit(1)
    dist.destroy_process_group()


def run_trial(args, system: str, size: int) -> tuple[str, str | tuple[int, int]]:
    """("ok", (VmData baseline, peak RSS) bytes of rank 0) or (failure kind, message)."""
    spec = {
        "system": system,
        "cap": args.cap_mib * 2**20,
        "args": {
            **shape(args, size),
            "n_head": args.n_head,
            "block_size": args.block_size,
            "micro_batch": args.micro_batch,
            "steps": args.steps,
            "dtype": "fp32",
            "reduce_bucket_size": args.reduce_bucket_size or None,
            "partitioned_init": True,
            "stage3_overrides": args.stage3_overrides,
        },
    }
    if args.malloc_mmap_threshold:
        # Freed tensors go back to the kernel at once (no heap high-water mark), so the cap
        # sees live memory; the spawned ranks inherit this environment.
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    # glibc sizes every thread's stack from RLIMIT_STACK at process start (8 MiB by default),
    # and a stack is private writable memory: the threads gloo and autograd start after the cap
    # would take 8 MiB each of M. The ranks inherit a smaller limit.
    stack = args.thread_stack_kib * 1024
    outcome, seen = run_spawned(trial_rank, args.world_size, spec, args.timeout, stack)
    return outcome or ("ok", seen[0])


# ----- the search -------------------------------------------------------------------------------
def bytes_per_param(system: str, n: int) -> float:
    """fp32 model-state bytes per parameter per rank (_common.formula) that seed the search."""
    stage = 3 if system == "fsdp2" else int(system[-1] if system.startswith("ds") else system[4])
    return formula(stage, "fp32", n)[0]


def size_for(args, psi: float) -> int:
    """The largest size whose GPT has at most psi parameters (at least 1)."""
    size = 1
    while (
        size < args.max_size
        and num_params(**shape(args, size + 1), block_size=args.block_size) <= psi
    ):
        size += 1
    return size


def largest(args, system: str, log) -> tuple[int, dict]:
    """Largest size that trains. Starts at 0.7 of the paper's bound for the system, steps up
    (or down) by 1.5x until the outcome flips, then bisects until the bracket is within
    --precision of the size. Returns the size (0 when size 1 fails) and the trials
    {size: (kind, info)}."""
    trials = {}

    def fits(size):
        trials[size] = run_trial(args, system, size)
        kind, info = trials[size]
        log(f"  {system} size {size}: {kind}" + ("" if kind == "ok" else f" ({info})"))
        return trials[size][0] == "ok"

    n, cap = args.world_size, args.cap_mib * 2**20
    guess = size_for(args, 0.7 * cap / bytes_per_param(system, n))
    if fits(guess):
        lo, hi = guess, None
        while hi is None and lo < args.max_size:
            step = min(args.max_size, max(lo + 1, int(lo * 1.5)))
            lo, hi = (step, None) if fits(step) else (lo, step)
        hi = hi or args.max_size + 1
    else:
        lo, hi = None, guess
        while lo is None and hi > 1:
            step = max(1, min(hi - 1, int(hi / 1.5)))
            lo, hi = (step, hi) if fits(step) else (None, step)
        lo = lo or 0
    while hi - lo > max(1, int(lo * args.precision)):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, trials


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:
        skipped = [s for s in args.systems if s.startswith("ds")]
        if skipped:
            print(f"skipped {','.join(skipped)}: deepspeed does not import ({exc})")
        args.systems = [s for s in args.systems if not s.startswith("ds")]
    start = time.perf_counter()
    rows = []
    for system in args.systems:
        rows.append((system, *largest(args, system, lambda line: print(line, flush=True))))
    report(args, rows, time.perf_counter() - start)


def report(args, rows, seconds: float) -> None:
    """The table: per system the largest size, its Psi against N M / 16 and against the
    system's own fp32 formula, the rank-0 baseline and peak RSS, and why the next size failed."""
    n, cap = args.world_size, args.cap_mib * 2**20
    bound = n * cap / 16
    print(
        f"\ncap M = {args.cap_mib} MiB per rank over the baseline (RLIMIT_DATA), N = {n} gloo "
        f"ranks, fp32 AdamW, {args.steps} steps, micro-batch {args.micro_batch} x "
        f"{args.block_size} tokens, search {args.search}, MALLOC_MMAP_THRESHOLD_="
        f"{args.malloc_mmap_threshold or 'default'}, reduce_bucket_size "
        f"{args.reduce_bucket_size or 'each default'}, stage 3 overrides {args.stage3_overrides}; "
        f"N M / 16 = {bound / 1e6:.1f}M params; load average {os.getloadavg()[0]:.2f}; "
        f"{seconds:.0f} s\n"
    )
    print(
        "| system | n_layer | n_embd | params | params / (N M / 16) | fp32 formula bytes / M "
        "| baseline VmData MiB | peak RSS MiB | next size failed |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for system, size, trials in rows:
        dims = shape(args, size) if size else {"n_layer": 0, "n_embd": 0}
        psi = num_params(**dims, block_size=args.block_size) if size else 0
        base, peak = trials[size][1] if size else (0, 0)
        failed = sorted(k for k, (kind, _) in trials.items() if kind != "ok")
        why = f"{failed[0]}: {trials[failed[0]][1][:90]}".replace("|", "/") if failed else "-"
        print(
            f"| {system} | {dims['n_layer']} | {dims['n_embd']} | {psi:,} | {psi / bound:.3f} "
            f"| {psi * bytes_per_param(system, n) / cap:.2f} | {base / 2**20:.0f} "
            f"| {peak / 2**20:.0f} | {why} |"
        )


if __name__ == "__main__":
    main()
