"""zero's FLOPs profiler against the transformer formula and DeepSpeed's profiler, one forward.

    python benchmarks/flops_profiler.py [--n_layer 4 --n_embd 128 --block_size 128 --batch 8]

Profiles one forward of examples/gpt.py's GPT with zero.profiling.flops_profiler and, where
deepspeed is installed (pip install deepspeed==0.19.8), with DeepSpeed's own get_model_profile
on the same model and batch, and prints both totals beside the formula 2 N T + 4 L T^2 d per
sequence (N: the weights used in matrix products, 12 L d^2 + d vocab; T tokens per sequence).
Results: docs/observability.md, "FLOPs profiler".
"""

import argparse
import importlib.util
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

from zero.profiling.flops_profiler import get_model_profile  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=128)
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, block_size=args.block_size)
    model = GPT(config)
    idx = torch.randint(0, config.vocab_size, (args.batch, args.block_size))
    L, d, T, V = args.n_layer, args.n_embd, args.block_size, config.vocab_size  # noqa: N806
    weights = 12 * L * d * d + d * V
    formula = args.batch * (2 * weights * T + 4 * L * T * T * d)
    rows = [("formula 2 N T + 4 L T^2 d", formula, formula // 2, model.num_parameters())]
    ours = get_model_profile(model, args=[idx], print_profile=False, as_string=False)
    rows.append(("zero", *ours))
    spec = importlib.util.find_spec("deepspeed")
    if spec is not None and "zero" not in str(spec.origin):
        from deepspeed.profiling.flops_profiler import get_model_profile as deepspeeds

        result = deepspeeds(model, args=[idx], print_profile=False, as_string=False)
        rows.append(("DeepSpeed 0.19.8", *result))
    else:
        rows.append(("DeepSpeed: not installed", 0, 0, 0))
    print(f"GPT {L} layers, width {d}, context {T}, batch {args.batch} (one forward)")
    print(f"{'counted by':<28}{'FLOPs':>16}{'MACs':>16}{'params':>12}{'FLOPs/formula':>15}")
    for name, flops, macs, params in rows:
        print(f"{name:<28}{flops:>16,}{macs:>16,}{params:>12,}{flops / formula:>15.4f}")


if __name__ == "__main__":
    main()
