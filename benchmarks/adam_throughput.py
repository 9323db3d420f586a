"""Adam step throughput on the CPU: zero's cpu_adam beside torch.optim.AdamW and DeepSpeed.

    python benchmarks/adam_throughput.py --numel 50000000 --steps 20 --warmup 3

One process, one fp32 parameter of --numel elements, the same hyper-parameters (AdamW, weight
decay 0.01) for every row. Rows: cpu_adam (the compiled op through CPUAdam), cpu_adam writing a
bf16 copy in the same pass, torch.optim.AdamW with foreach=True and with fused=True, and
DeepSpeed's DeepSpeedCPUAdam when deepspeed is importable. Beside them, two bounds timed in the
same rounds:

- triad: torch's in-place a += s * b, 12 bytes per element; its bandwidth / 28 is the usual
  bound on Adam, which must read params, grads, exp_avg, exp_avg_sq and write three of them
  back (28 bytes per element, 30 with the bf16 copy).
- Adam's traffic without arithmetic: cpu_adam's `traffic_only_step`, which moves exactly a
  step's 28 bytes per element (one pass, four streams read, three written back) with no math.
  A step as fast as this row is bound by memory, not by its loop.

By default every optimizer steps the same parameter, gradient and moments (the moments CPUAdam
allocated), so all rows move the same physical memory and only the kernels differ; --separate
gives each row its own tensors, as separate jobs would have (about 0.8 GB per row at 50M).
After --warmup steps of every row, --steps rounds each time one step of every row, the order
rotated every round, so load from other processes falls on all rows alike. Prints a markdown
table: median and quartiles of elements per second, the bandwidth at the row's bytes per
element, the bytes per element the triad's bandwidth would allow at that rate, and each row's
time over cpu_adam's in the same round (median over rounds; above 1: cpu_adam is faster). A
measurement script, not a test: nothing asserts on time.
"""

import argparse
import os
import statistics
import time

import torch

from zero.ops import CPUAdam
from zero.ops.builder import cpu_features, get_builder

ADAM_BYTES = 28
TRIAD_BYTES = 12
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
TRIAD = "triad a += s * b (torch)"
TRAFFIC = "Adam's traffic, no arithmetic"
CPU_ADAM = "zero cpu_adam"


def _param(numel):
    gen = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(numel, generator=gen))
    param.grad = torch.randn(numel, generator=gen) * 1e-2
    return param


def _triad(numel):
    a, b = torch.rand(numel), torch.rand(numel)
    return lambda: a.add_(b, alpha=3.0)


class _Memory:
    """Hands each row its parameter and moments: one shared set, or a new set per row."""

    def __init__(self, numel, separate):
        self.numel, self.separate = numel, separate
        self.param, self.moments = _param(numel), None

    def new_param(self):
        return _param(self.numel) if self.separate else self.param

    def adopt(self, opt, param):
        """Take one step (the optimizer creates its state), then share the first moments."""
        opt.step()
        state = opt.state[param]
        if self.separate:
            return
        if self.moments is None:
            self.moments = state["exp_avg"], state["exp_avg_sq"]
        state["exp_avg"], state["exp_avg_sq"] = self.moments

    def traffic_row(self):
        op = get_builder("cpu_adam").load()
        if self.separate:
            param, moments = _param(self.numel), (torch.zeros(self.numel), torch.zeros(self.numel))
        else:
            param, moments = self.param, self.moments
        return lambda: op.traffic_only_step(param.detach(), param.grad, *moments, 0.0)


def _rows(numel, separate):
    """(name, bytes per element, step) for every row; allocates each row's tensors."""
    memory = _Memory(numel, separate)

    def optimizer_row(make, with_copy=False):
        param = memory.new_param()
        opt = make([param])
        memory.adopt(opt, param)
        if not with_copy:
            return opt.step
        out = torch.empty(numel, dtype=torch.bfloat16)
        return lambda: opt.step_with_copy({param: out})

    def cpu_adam(params):
        return CPUAdam(params, adamw_mode=True, use_op=True, **HYPER)

    rows = [
        (CPU_ADAM, ADAM_BYTES, optimizer_row(cpu_adam)),  # first: its moments are shared
        ("zero cpu_adam + bf16 copy", ADAM_BYTES + 2, optimizer_row(cpu_adam, with_copy=True)),
        (TRAFFIC, ADAM_BYTES, memory.traffic_row()),
        (TRIAD, TRIAD_BYTES, _triad(numel)),
    ]
    for flag in ("foreach", "fused"):

        def torch_adamw(params, flag=flag):
            return torch.optim.AdamW(params, **HYPER, **{flag: True})

        rows.append((f"torch AdamW {flag}=True", ADAM_BYTES, optimizer_row(torch_adamw)))
    try:
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        def deepspeed_adam(params):
            return DeepSpeedCPUAdam(params, adamw_mode=True, **HYPER)

        name = f"DeepSpeed DeepSpeedCPUAdam {deepspeed.__version__}"
        rows.append((name, ADAM_BYTES, optimizer_row(deepspeed_adam)))
    except Exception as error:  # any import or build failure: the row is simply absent
        print(f"(DeepSpeed CPUAdam not measured: {error.__class__.__name__}: {error})")
    return rows


def _measure(rows, steps, warmup):
    """Seconds per step of every row: warmup steps each, then rounds in rotated order."""
    for _, _, step in rows:
        for _ in range(warmup):
            step()
    times = {name: [] for name, _, _ in rows}
    for round_index in range(steps):
        shift = round_index % len(rows)
        for name, _, step in rows[shift:] + rows[:shift]:
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return times


def _print_table(rows, times, numel):
    triad_bandwidth = TRIAD_BYTES * numel / statistics.median(times[TRIAD])
    bound = triad_bandwidth / ADAM_BYTES
    print(f"triad bandwidth {triad_bandwidth / 1e9:.1f} GB/s (median) -> Adam bound "
          f"{bound / 1e9:.2f} Gelem/s at {ADAM_BYTES} bytes/element\n")  # fmt: skip
    print("| row | bytes/element | median Gelem/s | p25-p75 Gelem/s | GB/s (median) | "
          "bytes/element at triad bandwidth | time / cpu_adam's |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    reference = times[CPU_ADAM]
    for name, bytes_per_element, _ in rows:
        q1, median, q3 = statistics.quantiles(times[name], n=4)
        rate = numel / median
        ratio = statistics.median(t / r for t, r in zip(times[name], reference))
        print(
            f"| {name} | {bytes_per_element} | {rate / 1e9:.3f} | "
            f"{numel / q3 / 1e9:.3f}-{numel / q1 / 1e9:.3f} | "
            f"{rate * bytes_per_element / 1e9:.1f} | {triad_bandwidth / rate:.1f} | {ratio:.3f} |"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=50_000_000, help="elements (fp32)")
    parser.add_argument("--steps", type=int, default=20, help="timed rounds (a step of each row)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per row")
    parser.add_argument("--separate", action="store_true", help="each row its own tensors")
    args = parser.parse_args()

    rows = _rows(args.numel, args.separate)
    load_before = os.getloadavg()[0]
    times = _measure(rows, args.steps, args.warmup)
    simd = get_builder("cpu_adam").load().simd_path()
    avx = sorted(flag for flag in cpu_features() if flag in ("avx2", "avx512f"))
    print(f"numel {args.numel:,}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"cpu_adam {simd} build (CPU: {', '.join(avx) or 'no avx2'}), "
          f"{'separate' if args.separate else 'shared'} tensors, {args.steps} rounds, load "
          f"average {load_before:.1f} -> {os.getloadavg()[0]:.1f}")  # fmt: skip
    _print_table(rows, times, args.numel)


if __name__ == "__main__":
    main()
