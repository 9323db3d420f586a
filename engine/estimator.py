"""zero-estimate: plan a run before renting the cluster (model states and communication).

Given a parameter count (or a model factory, laid out exactly as the engine would) and the
cluster shape, print for stages 0-3, with and without optimizer offload, the model-state bytes
per device and per host, the per-step communication volume in units of Psi, and recommend the
lowest stage that fits. The byte figures are zero's own conventions (engine/memory.py, [Note: the
two formulas]): fp32 gradient accumulation and buckets padded to a multiple of the data-parallel
degree, so they match engine.memory_report() of a real run.

Activations, gathered stage-3 units and transient gradient buckets are not model states and are
not estimated; the fit check keeps `headroom` of device memory free for them.
"""

import argparse
import importlib
import json
import math
import re
import sys
from dataclasses import dataclass

from .memory import ModelStateSpec, model_state_formula, offloaded_bytes

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_SIZE = re.compile(r"^\s*([0-9.eE+]+)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Cluster:
    """nodes x devices_per_node data-parallel ranks; memory sizes in bytes."""

    nodes: int = 1
    devices_per_node: int = 1
    device_memory: int = 80 * 2**30
    host_memory: int = 512 * 2**30

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node


@dataclass(frozen=True)
class Estimate:
    """One row: per-device and per-host model-state bytes, comm volume in Psi, fit."""

    stage: int
    offload: bool
    per_device: int
    per_host: int
    comm_psi: float
    fits: bool


def parse_size(text: str) -> int:
    """'80G', '80GiB', '80GB' (all 2**30-based), '1T' or a plain byte count -> bytes.

    Raises ValueError for anything else.
    """
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"memory size {text!r}: give bytes or a number with K/M/G/T, e.g. 80G")
    power = " KMGT".index(match.group(2).upper() or " ")
    return int(float(match.group(1)) * 1024**power)


def padded_numel(num_params: int, num_shards: int, bucket_numel: int) -> int:
    """Psi after zero's padding when only a count is known: about ceil(Psi / bucket) buckets,
    each padded by (N - 1) / 2 elements on average (flat.py pads each bucket to a multiple of N)."""
    num_buckets = max(1, math.ceil(num_params / bucket_numel))
    return num_params + num_buckets * (num_shards - 1) // 2


def layout_numel(model, num_shards: int, bucket_numel: int, stage: int) -> int:
    """Psi with padding, exactly as the engine lays out `model` (one param group, trainable)."""
    from .flat import FlatLayout
    from .stage3 import choose_units

    unit_of = choose_units(model, bucket_numel)[1] if stage == 3 else None
    seen, named = set(), []
    for name, param in model.named_parameters():
        if param.requires_grad and param.numel() and id(param) not in seen:
            seen.add(id(param))
            named.append((name, param))
    return FlatLayout([named], bucket_numel, num_shards, unit_of).padded_numel


def comm_psi(stage: int, gradient_accumulation_steps: int = 1) -> float:
    """Expected elements per rank per optimizer step, in Psi (paper section 7): 2 for stages 0-1;
    stage 2 reduce-scatters every micro-batch (GAS + 1); stage 3 gathers twice and
    reduce-scatters every micro-batch (3 GAS)."""
    gas = gradient_accumulation_steps
    return {0: 2.0, 1: 2.0, 2: gas + 1.0, 3: 3.0 * gas}[stage]


def estimate_stage(
    numel: int, stage: int, offload: bool, cluster: Cluster, dtype: str, headroom: float
) -> Estimate:
    """Model-state bytes per device and per host for one stage (numel: padded Psi)."""
    num_shards = 1 if stage == 0 else cluster.world_size
    spec = ModelStateSpec(stage, numel, num_shards, DTYPE_BYTES[dtype], 8, offload)
    parts = model_state_formula(spec)
    total = sum(v or 0 for v in parts.values())
    host_per_rank = offloaded_bytes(parts) if offload else 0
    per_device = total - host_per_rank
    per_host = host_per_rank * cluster.devices_per_node
    fits = (
        per_device <= (1 - headroom) * cluster.device_memory
        and per_host <= (1 - headroom) * cluster.host_memory
    )
    return Estimate(stage, offload, per_device, per_host, comm_psi(stage), fits)


def estimate(
    num_params: int,
    cluster: Cluster,
    dtype: str = "bf16",
    bucket_numel: int = 500_000_000,
    headroom: float = 0.2,
    model=None,
) -> list[Estimate]:
    """Every stage 0-3 without offload, stages 1-2 with optimizer offload (zero offloads stages
    1-2 only). `model` (optional, may live on the meta device) gives the exact padded Psi."""
    rows = []
    for stage in range(4):
        shards = 1 if stage == 0 else cluster.world_size
        if model is not None:
            numel = layout_numel(model, shards, bucket_numel, stage)
        else:
            numel = padded_numel(num_params, shards, bucket_numel)
        for offload in (False, True) if stage in (1, 2) else (False,):
            rows.append(estimate_stage(numel, stage, offload, cluster, dtype, headroom))
    return rows


def recommend(rows: list[Estimate]) -> Estimate | None:
    """The lowest stage that fits, preferring no offload (offload trades step time)."""
    for offload in (False, True):
        for row in rows:
            if row.fits and row.offload == offload:
                return row
    return None


def recommended_config(row: Estimate, dtype: str, bucket_numel: int) -> dict:
    """A ready zero config for the recommended row (DeepSpeed key names)."""
    zero_block = {"stage": row.stage, "reduce_bucket_size": bucket_numel, "overlap_comm": True}
    if row.offload:
        zero_block["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
        "zero_optimization": zero_block,
    }
    if dtype != "fp32":
        config[dtype] = {"enabled": True}
    return config


def format_table(rows: list[Estimate], psi: int, cluster: Cluster, dtype: str) -> str:
    gib = 2**30
    lines = [
        f"Psi = {psi:,} parameters, {cluster.nodes} node(s) x {cluster.devices_per_node} "
        f"device(s), {dtype}, fp32 gradient accumulation (4-byte gradients), Adam (8 B/element)",
        f"device memory {cluster.device_memory / gib:.1f} GiB, "
        f"host memory {cluster.host_memory / gib:.1f} GiB per node",
        f"{'stage':<7}{'offload':<9}{'per device GiB':>16}{'per host GiB':>14}"
        f"{'comm/step':>12}  fits",
    ]
    for row in rows:
        lines.append(
            f"{row.stage:<7}{'cpu' if row.offload else 'none':<9}"
            f"{row.per_device / gib:>16.3f}{row.per_host / gib:>14.3f}"
            f"{row.comm_psi:>10.1f} Psi  {'yes' if row.fits else 'no'}"
        )
    return "\n".join(lines)


def load_model(path: str, kwargs: dict):
    """'package.module:factory' -> factory(**kwargs), built on the meta device (no memory)."""
    import torch

    module_name, sep, attr = path.partition(":")
    if not sep:
        raise ValueError(f"--model {path!r}: give 'package.module:factory'")
    factory = getattr(importlib.import_module(module_name), attr)
    with torch.device("meta"):
        return factory(**kwargs)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="zero-estimate", description="Model-state memory and communication per ZeRO stage."
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--params", type=float, help="parameter count, e.g. 1.5e9")
    source.add_argument("--model", help="model factory 'package.module:callable'")
    parser.add_argument("--model-kwargs", default="{}", help="JSON keyword arguments of --model")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--devices-per-node", type=int, default=8)
    parser.add_argument("--device-memory", default="80G", help="per device, e.g. 80G")
    parser.add_argument("--host-memory", default="512G", help="per node, e.g. 1T")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16")
    parser.add_argument(
        "--reduce-bucket-size", type=float, default=5e8, help="elements per gradient bucket"
    )
    parser.add_argument(
        "--headroom", type=float, default=0.2, help="device fraction kept for activations"
    )
    parser.add_argument("--write-config", metavar="PATH", help="write the recommended config")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cluster = Cluster(
        args.nodes,
        args.devices_per_node,
        parse_size(args.device_memory),
        parse_size(args.host_memory),
    )
    bucket = int(args.reduce_bucket_size)
    model = None
    if args.model:
        model = load_model(args.model, json.loads(args.model_kwargs))
        psi = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    else:
        psi = int(args.params)
    rows = estimate(psi, cluster, args.dtype, bucket, args.headroom, model)
    print(format_table(rows, psi, cluster, args.dtype))
    best = recommend(rows)
    if best is None:
        print("no stage fits: add devices or nodes, or use a smaller model")
        return 1
    offload = "with optimizer offload" if best.offload else "without offload"
    print(f"recommended: stage {best.stage} {offload}")
    if args.write_config:
        with open(args.write_config, "w") as f:
            json.dump(recommended_config(best, args.dtype, bucket), f, indent=2)
            f.write("\n")
        print(f"wrote {args.write_config}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
