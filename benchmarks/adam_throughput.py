"""Adam step throughput on the CPU: zero's cpu_adam beside torch.optim.Adam and DeepSpeed.

    python benchmarks/adam_throughput.py --numel 50000000 --steps 10 --warmup 3

One process, one fp32 parameter of --numel elements, the same hyper-parameters (AdamW, weight
decay 0.01) for every row. Rows: cpu_adam (the compiled op through CPUAdam), cpu_adam writing a
bf16 copy in the same pass, torch.optim.Adam with foreach=True and with fused=True, and
DeepSpeed's DeepSpeedCPUAdam when deepspeed is importable. Beside them: the memory bandwidth
of an in-place triad a += s * b (12 bytes per element, the same read-then-write-back pattern as
Adam, so no write-allocate traffic either side), timed in the same rounds, and the bound it puts
on Adam, which must read params, grads, exp_avg, exp_avg_sq and write three of
them back: 28 bytes per element (30 with the bf16 copy).

Every row is allocated up front (about 0.8 GB per row at 50M elements), then --steps rounds
each time one step of every row in turn. Prints a markdown table of elements per second (best
and median over the rounds) and the implied bytes per second. A measurement script, not a
test: nothing asserts on time. Other load on the machine lowers every row; rerun when it is
quiet and compare rows of one run.
"""

import argparse
import statistics
import time

import torch

from zero.ops import CPUAdam

ADAM_BYTES = 28
TRIAD_BYTES = 12
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _time(fn, steps, warmup):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def _triad(numel):
    a, b = torch.rand(numel), torch.rand(numel)
    return lambda: a.add_(b, alpha=3.0)


def _param(numel):
    gen = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(numel, generator=gen))
    param.grad = torch.randn(numel, generator=gen) * 1e-2
    return param


def _optimizers(numel):
    """(name, bytes per element, make) for each row; make() allocates the row's tensors."""

    def cpu_adam():
        param = _param(numel)
        return CPUAdam([param], adamw_mode=True, use_op=True, **HYPER).step

    def cpu_adam_bf16():
        param = _param(numel)
        out = torch.empty(numel, dtype=torch.bfloat16)
        opt = CPUAdam([param], adamw_mode=True, use_op=True, **HYPER)
        return lambda: opt.step_with_copy({param: out})

    def torch_adam(**kwargs):
        def make():
            return torch.optim.AdamW([_param(numel)], **HYPER, **kwargs).step

        return make

    rows = [
        ("zero cpu_adam", ADAM_BYTES, cpu_adam),
        ("zero cpu_adam + bf16 copy", ADAM_BYTES + 2, cpu_adam_bf16),
        ("torch AdamW foreach=True", ADAM_BYTES, torch_adam(foreach=True)),
        ("torch AdamW fused=True", ADAM_BYTES, torch_adam(fused=True)),
    ]
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        def deepspeed():
            return DeepSpeedCPUAdam([_param(numel)], adamw_mode=True, **HYPER).step

        rows.append(("DeepSpeed DeepSpeedCPUAdam", ADAM_BYTES, deepspeed))
    except Exception as error:  # any import failure: the row is simply absent
        print(f"(DeepSpeed CPUAdam not measured: {error.__class__.__name__}: {error})")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=50_000_000, help="elements (fp32)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per row")
    args = parser.parse_args()

    rows = [("triad a += s * b", TRIAD_BYTES, _triad(args.numel))]
    rows += [(name, nbytes, make()) for name, nbytes, make in _optimizers(args.numel)]
    for _, _, step in rows:
        for _ in range(args.warmup):
            step()
    # Interleaved rounds (one step of each row per round) so load from other processes, which
    # comes and goes, falls on every row alike instead of on whichever row ran during it.
    times = {name: [] for name, _, _ in rows}
    for _ in range(args.steps):
        for name, _, step in rows:
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    triad = TRIAD_BYTES * args.numel / min(times[rows[0][0]])
    print(f"numel {args.numel:,}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"triad bandwidth {triad / 1e9:.1f} GB/s -> Adam bound {triad / ADAM_BYTES / 1e9:.2f} "
          f"Gelem/s at {ADAM_BYTES} bytes/element\n")  # fmt: skip
    print("| row | best Gelem/s | median Gelem/s | GB/s (best) | of triad |")
    print("| --- | --- | --- | --- | --- |")
    for name, bytes_per_element, _ in rows:
        best, median = min(times[name]), statistics.median(times[name])
        rate = args.numel / best
        print(
            f"| {name} | {rate / 1e9:.3f} | {args.numel / median / 1e9:.3f} | "
            f"{rate * bytes_per_element / 1e9:.1f} | {rate * bytes_per_element / triad:.0%} |"
        )


if __name__ == "__main__":
    main()
