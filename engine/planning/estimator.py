"""zero-estimate: plan a run before renting the cluster (memory and communication per stage).

Given a parameter count (or a model factory, laid out exactly as the engine would) and the
cluster shape, print for stages 0-3, with and without optimizer offload, the bytes per device
(model states, zero's buffers and, given the transformer's shape, activations: the predicted
peak of a training step) and per host, the per-step communication volume in units of Psi, and
recommend the lowest stage that fits. Model states follow zero's own conventions
(memory.py, [Note: the two formulas]): gradients in data_types.grad_accum_dtype (fp32 by
default, --grad-accum-dtype) and buckets padded to a multiple of the data-parallel degree, so they
match engine.memory_report() of a real run. Buffers, activations and the peak are
footprint.py's formulas. `--paper` prints the paper's Table 1 instead (section 5.4).
"""

import argparse
import decimal
import importlib
import json
import math
import sys
from dataclasses import dataclass, replace

from ..config.values import parse_size
from .footprint import (
    GLIBC_RETENTION,
    Activations,
    BufferSettings,
    LayoutSummary,
    Peak,
    TransformerShape,
    activation_bytes,
    peak_bytes,
)
from .memory import ModelStateSpec, model_state_formula, offloaded_bytes

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


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
class Options:
    """What the estimate assumes besides the model and the cluster (DeepSpeed key in brackets).

    dtype: compute dtype, "bf16", "fp16" or "fp32" [bf16/fp16.enabled]. reduce_dtype: dtype of the
    gradient reduction, None for the compute dtype [communication_data_type]. grad_accum_dtype:
    dtype of the gradient buffers, "fp32" or the 2-byte compute dtype [data_types.grad_accum_dtype].
    Sizes in elements:
    bucket_numel [reduce_bucket_size], allgather_numel [allgather_bucket_size], prefetch_numel
    [stage3_prefetch_bucket_size], persistence_threshold [stage3_param_persistence_threshold],
    persistence_total [stage3_model_persistence_threshold],
    unit_threshold [stage3_module_granularity_threshold, 0: bucket_numel],
    reuse_numel [stage3_max_reuse_distance].
    gradient_accumulation_steps [same]. checkpointing: activation checkpointing of every layer.
    cpu: the ranks are CPU processes (gloo copies collective buffers; glibc's heap retention,
    footprint [Note: CPU ranks]). runtime_bytes: memory besides tensors per rank (a CUDA context,
    CPU kernel workspaces), bytes. headroom: fraction of device and host memory the fit check
    keeps free (allocator fragmentation). mics_shard_size [zero_optimization.mics_shard_size,
    -1: off]: stages 1-3 partition over that many ranks. hpz_partition_size
    [zero_optimization.zero_hpz_partition_size, 1: off]: stage 3 also holds a secondary copy of
    the parameters partitioned over that many ranks (partition/hierarchy.py).
    """

    dtype: str = "bf16"
    reduce_dtype: str | None = None
    grad_accum_dtype: str = "fp32"
    bucket_numel: int = 500_000_000
    allgather_numel: int = 500_000_000
    prefetch_numel: int = 50_000_000
    persistence_threshold: int = 100_000
    persistence_total: int = sys.maxsize
    unit_threshold: int = 0
    reuse_numel: int = 1_000_000_000
    gradient_accumulation_steps: int = 1
    checkpointing: bool = False
    cpu: bool = False
    runtime_bytes: int = 0
    headroom: float = 0.2
    mics_shard_size: int = -1
    hpz_partition_size: int = 1

    @classmethod
    def from_config(cls, config, **overrides) -> "Options":
        """The options a zero Config (zero.load_config) sets; `overrides` replace fields."""
        zero = config.zero
        dtype = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}
        values = dict(
            dtype=dtype[str(config.compute_dtype)],
            reduce_dtype=config.communication_data_type,
            grad_accum_dtype=config.data_types.grad_accum_dtype or "fp32",
            bucket_numel=zero.reduce_bucket_size,
            allgather_numel=zero.allgather_bucket_size,
            prefetch_numel=zero.stage3_prefetch_bucket_size,
            persistence_threshold=zero.stage3_param_persistence_threshold,
            persistence_total=zero.stage3_model_persistence_threshold,
            unit_threshold=zero.stage3_module_granularity_threshold,
            reuse_numel=zero.stage3_max_reuse_distance,
            gradient_accumulation_steps=config.gradient_accumulation_steps or 1,
            mics_shard_size=zero.mics_shard_size,
            hpz_partition_size=zero.zero_hpz_partition_size,
        )
        values.update(overrides)
        return cls(**values)


@dataclass(frozen=True)
class Estimate:
    """One row. Bytes: model_states, buffers and activations at the peak, per_device (the
    predicted peak of one rank: all of it), per_host (the offloaded states of the node's ranks;
    with CPU ranks, the node's processes in full). comm_psi: elements per rank per optimizer step
    in Psi. `peak` holds the parts."""

    stage: int
    offload: bool
    model_states: int
    buffers: int
    activations: int
    per_device: int
    per_host: int
    comm_psi: float
    fits: bool
    peak: Peak | None = None
    # Where offloaded optimizer state goes ("none", "cpu", "nvme"), the fraction offloaded
    # [offload_optimizer.ratio], and the bytes the node writes under nvme_path.
    device: str = "none"
    ratio: float = 1.0
    per_nvme: int = 0
    # The part of comm_psi exchanged with other nodes (tier_comm_psi; ranks fill nodes in order).
    inter_psi: float = 0.0


def padded_numel(num_params: int, num_shards: int, bucket_numel: int) -> int:
    """Psi after zero's padding when only a count is known: about ceil(Psi / bucket) buckets,
    each padded by (N - 1) / 2 elements on average (flat.py pads each bucket to a multiple of N)."""
    num_buckets = max(1, math.ceil(num_params / bucket_numel))
    return num_params + num_buckets * (num_shards - 1) // 2


def count_layout(num_params: int, num_shards: int, bucket_numel: int) -> LayoutSummary:
    """A LayoutSummary from a parameter count: full buckets of bucket_numel elements and, for
    stage 3, fetch units of the same size (the engine's default unit threshold); no persistent
    parameters (their count needs the model)."""
    padded = padded_numel(num_params, num_shards, bucket_numel)
    bucket = min(padded, bucket_numel)
    buckets = (bucket,) * max(1, math.ceil(padded / bucket))
    return LayoutSummary(padded, buckets, 0, buckets)


def model_layout(model, num_shards: int, stage: int, options: Options) -> LayoutSummary:
    """The exact LayoutSummary of `model` (may live on the meta device), one param group of its
    trainable parameters, laid out as the engine does (stage 3: its fetch units)."""
    from ..partition.flat import FlatLayout
    from ..partition.units import choose_units, persistent_unit

    units, unit_of = [], None
    if stage == 3:
        threshold = options.unit_threshold or options.bucket_numel
        units, unit_of = choose_units(
            model, threshold, (), options.persistence_threshold, options.persistence_total
        )
    seen, named = set(), []
    for name, param in model.named_parameters():
        if param.requires_grad and param.numel() and id(param) not in seen:
            seen.add(id(param))
            named.append((name, param))
    layout = FlatLayout([named], options.bucket_numel, num_shards, unit_of, persistent_unit(units))
    per_unit = [0] * len(units)
    for bucket in layout.buckets if units else ():
        per_unit[bucket.unit] += bucket.padded_numel
    persistent = sum(n for unit, n in zip(units, per_unit) if unit.persistent)
    others = [n for unit, n in zip(units, per_unit) if not unit.persistent]
    return LayoutSummary(
        layout.padded_numel,
        tuple(sorted((b.padded_numel for b in layout.buckets), reverse=True)),
        persistent,
        tuple(sorted(others, reverse=True)),
    )


def comm_psi(
    stage: int, gradient_accumulation_steps: int = 1, persistent: float = 0.0, kept: float = 0.0
) -> float:
    """Expected elements per rank per optimizer step, in Psi (paper section 7): 2 for stages 0-1
    (reduced once, at the boundary); stage 2 reduce-scatters every micro-batch (GAS + 1); stage 3
    gathers twice and reduce-scatters every micro-batch (3 GAS), except its persistent
    parameters, the fraction `persistent` of Psi, which are reduce-scattered every micro-batch and
    gathered once, after the step (GAS + 1), and the fraction `kept` of Psi per micro-batch that
    stays gathered from its forward to its backward (stage3_max_reuse_distance): gathered once."""
    gas = gradient_accumulation_steps
    if stage == 3:
        return 3.0 * gas * (1.0 - persistent) + (gas + 1.0) * persistent - gas * kept
    return {0: 2.0, 1: 2.0, 2: gas + 1.0}[stage]


def shard_count(stage: int, cluster: Cluster, options: Options) -> int:
    """Ranks each bucket is split over: 1 at stage 0, mics_shard_size with MiCS, else N."""
    if stage == 0:
        return 1
    return options.mics_shard_size if options.mics_shard_size > 0 else cluster.world_size


def _inter_fraction(members: range, ranks_per_node: int) -> float:
    """The inter-node fraction of a collective over global ranks `members`, seen from the
    first (comm/topology.py [Note: intra- and inter-node volume]); ranks fill nodes in order."""
    local = sum(1 for m in members if m // ranks_per_node == members[0] // ranks_per_node)
    return (len(members) - local) / len(members)


def tier_comm_psi(
    stage: int, cluster: Cluster, options: Options, persistent: float = 0.0, kept: float = 0.0
) -> tuple[float, float]:
    """(intra-node, inter-node) elements per rank per optimizer step, in Psi (padded), for
    `cluster` (ranks filling nodes in order) with MiCS and hpZ as `options` set them; the two
    add up to comm_psi() plus MiCS's replica all-reduce (2 Psi / mics_shard_size). Each
    collective's share crossing nodes is (n - n_local) / n of its volume (comm/topology.py
    [Note: intra- and inter-node volume]; partition/hierarchy.py has the per-feature
    formulas). `persistent`, `kept`: as comm_psi. Pure arithmetic."""
    n, g = cluster.world_size, cluster.devices_per_node
    shards = shard_count(stage, cluster, options)
    f_shard = _inter_fraction(range(shards), g) if stage else 0.0
    total = comm_psi(stage, options.gradient_accumulation_steps, persistent, kept)
    inter = total * (f_shard if stage else _inter_fraction(range(n), g))
    if stage == 3 and options.hpz_partition_size > 1 and options.mics_shard_size < 1:
        # the backward all-gathers (of the sharded, not kept, part) run over the hpZ group
        backward = options.gradient_accumulation_steps * (1.0 - persistent - kept)
        inter -= backward * (f_shard - _inter_fraction(range(options.hpz_partition_size), g))
    if stage and options.mics_shard_size > 0 and shards < n:
        replica = 2.0 / shards
        total += replica
        inter += replica * _inter_fraction(range(0, n, shards), g)
    return total - inter, inter


def estimate_stage(
    layout: LayoutSummary,
    stage: int,
    offload: bool,
    cluster: Cluster,
    options: Options,
    activations: Activations | None = None,
    retention: int = 0,
    device: str | None = None,
    ratio: float = 1.0,
) -> Estimate:
    """Bytes per device and per host for one stage of `layout` (see Estimate); `retention`: the
    allocator's resident excess (footprint [Note: CPU ranks]). device: where offloaded state
    goes, "cpu" (default with `offload`) or "nvme"; ratio: the fraction of it offloaded, the
    rest stays on the device (engine/offload/nvme.py [Note: placement]). MiCS partitions over
    options.mics_shard_size ranks; hpZ (stage 3) adds its secondary parameter copy,
    padded Psi / hpz_partition_size elements of the compute dtype, to the model states."""
    num_shards = shard_count(stage, cluster, options)
    compute = DTYPE_BYTES[options.dtype]
    accum = DTYPE_BYTES[options.grad_accum_dtype]
    device = device or ("cpu" if offload else "none")
    spec = ModelStateSpec(stage, layout.padded_numel, num_shards, compute, 8, offload, accum)
    parts = model_state_formula(spec)
    host_per_rank = offloaded_bytes(parts) if offload else 0
    states = sum(v or 0 for v in parts.values()) - host_per_rank
    if stage == 3 and options.hpz_partition_size > 1:
        states += layout.padded_numel // options.hpz_partition_size * compute
    nvme_per_rank = 0
    if offload and (device == "nvme" or ratio < 1):
        kept = replace(spec, offload=False)
        on_device = model_state_formula(kept)
        states += round((1 - ratio) * (on_device["master"] + on_device["optimizer_state"]))
        moved = parts["master"] + parts["optimizer_state"]
        if device == "nvme":
            # Files hold master + moments; host memory holds the buffer sets of the step
            # (4 sets x master, 2 moments and a gradient copy, one sub-group = bucket shard).
            nvme_per_rank = round(ratio * moved)
            sub_group = (layout.bucket_numels[0] if layout.bucket_numels else 0) // num_shards
            host_per_rank = 4 * 4 * 4 * sub_group
        else:
            host_per_rank = round(ratio * host_per_rank)
    settings = BufferSettings(
        stage,
        num_shards,
        compute,
        DTYPE_BYTES[options.reduce_dtype or options.dtype],
        options.gradient_accumulation_steps,
        options.allgather_numel,
        options.prefetch_numel,
        options.cpu,
        accum,
        options.reuse_numel,
    )
    peak = peak_bytes(
        states, layout, settings, activations, options.runtime_bytes, retention, parts["grads"]
    )
    # CPU ranks hold everything in host memory: a node holds devices_per_node processes.
    per_host = (host_per_rank + (peak.total if options.cpu else 0)) * cluster.devices_per_node
    on_device = 0 if options.cpu else peak.total
    fits = (
        on_device <= (1 - options.headroom) * cluster.device_memory
        and per_host <= (1 - options.headroom) * cluster.host_memory
    )
    persistent = layout.persistent_numel / layout.padded_numel if stage == 3 else 0.0
    # Units kept for backward: those with fewer than reuse_numel elements gathered after them,
    # twice the units that follow (about the last reuse_numel / 2 elements of the forward).
    sharded = layout.padded_numel - layout.persistent_numel
    kept = min(sharded, options.reuse_numel // 2) / layout.padded_numel if stage == 3 else 0.0
    intra, inter = tier_comm_psi(stage, cluster, options, persistent, kept)
    buffers = sum(peak.buffers.values())
    acts = activations.peak if activations else 0
    return Estimate(
        stage,
        offload,
        states,
        buffers,
        acts,
        peak.total,
        per_host,
        intra + inter,
        fits,
        peak,
        device,
        ratio,
        nvme_per_rank * cluster.devices_per_node,
        inter,
    )


RATIOS = tuple(i / 10 for i in range(1, 11))


def partial_offload(layout, stage, device, cluster, options, activations, retention) -> Estimate:
    """The row offloading to `device` the smallest fraction (offload_optimizer.ratio, in steps
    of 0.1) that fits: the device is filled first; ratio 1 when none fits."""
    row = None
    for ratio in RATIOS:
        row = estimate_stage(
            layout, stage, True, cluster, options, activations, retention, device, ratio
        )
        if row.fits:
            return row
    return row


def activation_terms(shape, options) -> tuple:
    """(activations, retention) of one micro-batch of `shape` under `options`: the
    activation_bytes breakdown (None without a shape) and, on the CPU, the bytes glibc keeps
    after a step without checkpointing (GLIBC_RETENTION of its peak; 0 elsewhere)."""
    if shape is None:
        return None, 0
    compute = DTYPE_BYTES[options.dtype]
    activations = activation_bytes(shape, compute, options.checkpointing)
    retention = 0
    if options.cpu:
        full = activation_bytes(shape, compute, checkpointing=False)
        retention = int(GLIBC_RETENTION * full.peak)
    return activations, retention


def estimate(
    num_params: int,
    cluster: Cluster,
    options: Options = Options(),
    model=None,
    shape: TransformerShape | None = None,
) -> list[Estimate]:
    """Every stage 0-3 without offload, stages 1-2 with optimizer offload to the cpu, and stages
    1-3 with optimizer offload to nvme, offloading the smallest fraction that fits
    (offload_optimizer.ratio; parameter offload is not estimated). `model` (optional, may live
    on the meta device) gives the exact layout; `shape` adds the activations of one
    micro-batch (without it, per_device counts no activations)."""
    activations, retention = activation_terms(shape, options)
    rows = []
    for stage in range(4):
        shards = shard_count(stage, cluster, options)
        if model is not None:
            layout = model_layout(model, shards, stage, options)
        else:
            layout = count_layout(num_params, shards, options.bucket_numel)
        for offload in (False, True) if stage in (1, 2) else (False,):
            rows.append(
                estimate_stage(layout, stage, offload, cluster, options, activations, retention)
            )
        if stage > 0:
            rows.append(
                partial_offload(layout, stage, "nvme", cluster, options, activations, retention)
            )
    return rows


def recommend(rows: list[Estimate]) -> Estimate | None:
    """The lowest stage that fits, preferring no offload, then cpu offload, then nvme (each
    trades more step time)."""
    for device in ("none", "cpu", "nvme"):
        for row in rows:
            if row.fits and row.device == device:
                return row
    return None


def recommended_config(row: Estimate, options: Options, micro_batch: int = 1) -> dict:
    """A ready zero config for the recommended row (DeepSpeed key names)."""
    zero_block = {
        "stage": row.stage,
        "reduce_bucket_size": options.bucket_numel,
        "allgather_bucket_size": options.allgather_numel,
        "overlap_comm": True,
    }
    if row.stage == 3:
        zero_block["stage3_prefetch_bucket_size"] = options.prefetch_numel
        zero_block["stage3_param_persistence_threshold"] = options.persistence_threshold
        zero_block["stage3_max_reuse_distance"] = options.reuse_numel
    if options.mics_shard_size > 0 and row.stage > 0:
        zero_block["mics_shard_size"] = options.mics_shard_size
    elif options.hpz_partition_size > 1 and row.stage == 3:
        zero_block["zero_hpz_partition_size"] = options.hpz_partition_size
    if row.offload:
        zero_block["offload_optimizer"] = {"device": row.device, "pin_memory": True}
        if row.device == "nvme":
            zero_block["offload_optimizer"]["nvme_path"] = "/local_nvme"
        if row.ratio < 1:
            zero_block["offload_optimizer"]["ratio"] = row.ratio
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": options.gradient_accumulation_steps,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
        "zero_optimization": zero_block,
    }
    if options.dtype != "fp32":
        config[options.dtype] = {"enabled": True}
    if options.grad_accum_dtype != "fp32":
        config["data_types"] = {"grad_accum_dtype": options.grad_accum_dtype}
    return config


def two_byte_offer(rows: list[Estimate], num_params: int, cluster: Cluster, options: Options, **kw):
    """With fp32 accumulation and 2-byte compute: (options, row) of the same estimate with
    grad_accum_dtype = the compute dtype when that recommends a lower stage or no offload where
    fp32 accumulation does not (or fits where fp32 does not fit at all); else None. `kw`: model,
    shape, as for estimate()."""
    if options.grad_accum_dtype != "fp32" or options.dtype == "fp32":
        return None
    two = replace(options, grad_accum_dtype=options.dtype)
    best, alt = recommend(rows), recommend(estimate(num_params, cluster, two, **kw))
    if alt is None:
        return None
    if best is None or (alt.offload, alt.stage) < (best.offload, best.stage):
        return two, alt
    return None


def format_table(
    rows: list[Estimate], psi: int, cluster: Cluster, options: Options, shape=None
) -> str:
    gib = 2**30
    lines = [
        f"Psi = {psi:,} parameters, {cluster.nodes} node(s) x {cluster.devices_per_node} "
        f"device(s), {options.dtype}, {options.grad_accum_dtype} gradient accumulation "
        f"({DTYPE_BYTES[options.grad_accum_dtype]}-byte gradients), Adam (8 B/element)",
        f"device memory {cluster.device_memory / gib:.1f} GiB, "
        f"host memory {cluster.host_memory / gib:.1f} GiB per node, "
        f"headroom {options.headroom:.0%}",
    ]
    if shape is not None:
        compute = DTYPE_BYTES[options.dtype]
        off = activation_bytes(shape, compute, checkpointing=False)
        on = activation_bytes(shape, compute, checkpointing=True)
        lines.append(
            f"activations per device (L={shape.num_layers} h={shape.hidden} "
            f"s={shape.seq_len} b={shape.micro_batch} V={shape.vocab_size}): "
            f"{off.peak / gib:.3f} GiB, {on.peak / gib:.3f} GiB with activation checkpointing "
            f"({'used' if options.checkpointing else 'not used'} below)"
        )
    lines.append(
        f"{'stage':<7}{'offload':<9}{'states GiB':>11}{'buffers GiB':>12}{'peak GiB':>10}"
        f"{'host GiB':>10}{'comm/step':>12}{'inter-node':>14}  fits"
    )
    for row in rows:
        lines.append(
            f"{row.stage:<7}{_offload_name(row):<9}"
            f"{row.model_states / gib:>11.3f}{row.buffers / gib:>12.3f}"
            f"{row.per_device / gib:>10.3f}{row.per_host / gib:>10.3f}"
            f"{row.comm_psi:>8.2f} Psi{row.inter_psi:>10.2f} Psi  {'yes' if row.fits else 'no'}"
            + (f"  (nvme {row.per_nvme / gib:.3f} GiB per node)" if row.per_nvme else "")
        )
    return "\n".join(lines)


def _offload_name(row: Estimate) -> str:
    return row.device + (f" {row.ratio:g}" if row.ratio < 1 else "")


# The paper's Table 1 (section 5.4): model sizes (Psi) and data-parallel degrees (N).
PAPER_MODELS = ((7_500_000_000, "7.5B"), (128_000_000_000, "128B"), (10**12, "1T"))
PAPER_DEVICES = (1, 4, 16, 64, 256, 1024)
PAPER_STAGES = ("DP", "P_os", "P_os+g", "P_os+g+p")


def paper_bytes(num_params: int, num_devices: int, stage: int, grad_bytes: int = 2) -> int:
    """Model-state bytes per device in the paper's accounting: mixed-precision Adam (2-byte
    parameters, K = 12), unpadded Psi, `grad_bytes` per gradient element (the paper: 2). Stage 0
    is plain data parallelism (N = 1 shard)."""
    shards = 1 if stage == 0 else num_devices
    spec = ModelStateSpec(stage, num_params, shards, 2, 8, False, grad_bytes)
    return sum(v or 0 for v in model_state_formula(spec).values())


def paper_round(gigabytes: float) -> str:
    """A figure as the paper's Table 1 prints it: from 100 GB whole gigabytes, cut (4187.5 ->
    4187); below, 3 significant digits half up, at most 2 decimals (0.469 -> 0.47)."""
    if gigabytes >= 100:
        return str(int(gigabytes))
    value = decimal.Decimal(repr(gigabytes))
    digits = min(2, 2 - value.adjusted())
    quantum = decimal.Decimal(1).scaleb(-digits)
    text = str(value.quantize(quantum, rounding=decimal.ROUND_HALF_UP))
    return text.rstrip("0").rstrip(".") if "." in text else text


def paper_table(grad_bytes: int = 2) -> str:
    """The paper's Table 1: model states per device in GB (10**9 bytes) for 7.5B, 128B and 1T
    parameters at N = 1 ... 1024, plain data parallelism and the three ZeRO-DP stages."""
    width = 10
    title = f"{'':>6}" + "".join(f"{name + ' model (GB)':^{4 * width}}" for _, name in PAPER_MODELS)
    lines = [
        "model states per device, the paper's Table 1 (mixed-precision Adam, K = 12, "
        f"{grad_bytes}-byte gradients, GB = 1e9 bytes)",
        title,
        f"{'N':>6}" + "".join(f"{s:>{width}}" for s in PAPER_STAGES) * len(PAPER_MODELS),
    ]
    for devices in PAPER_DEVICES:
        cells = [
            paper_round(paper_bytes(psi, devices, stage, grad_bytes) / 1e9)
            for psi, _ in PAPER_MODELS
            for stage in range(4)
        ]
        lines.append(f"{devices:>6}" + "".join(f"{c:>{width}}" for c in cells))
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


SHAPE_FLAGS = ("layers", "hidden", "seq_len", "micro_batch", "vocab_size")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="zero-estimate", description="Memory and communication per ZeRO stage."
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--params", type=float, help="parameter count, e.g. 1.5e9")
    source.add_argument("--model", help="model factory 'package.module:callable'")
    source.add_argument(
        "--paper", action="store_true", help="print the paper's Table 1 (2-byte gradients)"
    )
    parser.add_argument(
        "--config", help="a zero config: dtypes, bucket sizes and accumulation steps from it"
    )
    parser.add_argument("--model-kwargs", default="{}", help="JSON keyword arguments of --model")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--devices-per-node", type=int, default=8)
    parser.add_argument("--device-memory", default="80G", help="per device, e.g. 80G")
    parser.add_argument("--host-memory", default="512G", help="per node, e.g. 1T")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPE_BYTES), help="compute dtype (default: config, else bf16)"
    )
    parser.add_argument(
        "--grad-accum-dtype",
        choices=sorted(DTYPE_BYTES),
        help="gradient accumulation dtype [data_types.grad_accum_dtype] (default: config, else "
        "fp32); bf16/fp16 must be the compute dtype",
    )
    parser.add_argument(
        "--reduce-bucket-size", type=float, default=5e8, help="elements per gradient bucket"
    )
    parser.add_argument("--headroom", type=float, default=0.2, help="fraction of memory kept free")
    parser.add_argument(
        "--runtime-memory", default="0", help="per device besides tensors, e.g. 1G (CUDA context)"
    )
    parser.add_argument(
        "--cpu-ranks", action="store_true", help="ranks are CPU processes (gloo, glibc heap)"
    )
    group = parser.add_argument_group("activations (a dense GPT-style transformer)")
    group.add_argument("--layers", type=int, help="transformer layers")
    group.add_argument("--hidden", type=int, help="hidden size")
    group.add_argument("--seq-len", type=int, help="tokens per sequence")
    group.add_argument("--micro-batch", type=int, help="sequences per device per micro-batch")
    group.add_argument("--vocab-size", type=int, help="vocabulary size")
    group.add_argument("--heads", type=int, default=0, help="attention heads (default h/64)")
    group.add_argument(
        "--activation-checkpointing", action="store_true", help="checkpoint every layer"
    )
    parser.add_argument(
        "--mics-shard-size",
        type=int,
        help="MiCS: partition over groups of this many ranks [zero_optimization.mics_shard_size]",
    )
    parser.add_argument(
        "--hpz-partition-size",
        type=int,
        help="hpZ (stage 3): secondary partition over this many ranks "
        "[zero_optimization.zero_hpz_partition_size]",
    )
    parser.add_argument("--write-config", metavar="PATH", help="write the recommended config")
    return parser.parse_args(argv)


def shape_from_args(args) -> TransformerShape | None:
    """The TransformerShape of the activation flags, None when none is given. Raises ValueError
    when only some are given."""
    given = [f for f in SHAPE_FLAGS if getattr(args, f) is not None]
    if not given:
        return None
    if len(given) < len(SHAPE_FLAGS):
        missing = ", ".join("--" + f.replace("_", "-") for f in SHAPE_FLAGS if f not in given)
        raise ValueError(f"activations need every shape flag; missing {missing}")
    heads = args.heads or max(1, args.hidden // 64)
    return TransformerShape(
        args.layers, args.hidden, args.seq_len, args.micro_batch, args.vocab_size, heads
    )


def options_from_args(args) -> Options:
    """Options of the command line; with --config, the config's, then the flags given.
    Raises ValueError for a 2-byte accumulation dtype other than the compute dtype (the rule the
    config enforces, docs/config.md)."""
    given = dict(
        bucket_numel=int(args.reduce_bucket_size),
        checkpointing=args.activation_checkpointing,
        cpu=args.cpu_ranks,
        runtime_bytes=parse_size(args.runtime_memory),
        headroom=args.headroom,
    )
    if args.dtype:
        given["dtype"] = args.dtype
    if args.grad_accum_dtype:
        given["grad_accum_dtype"] = args.grad_accum_dtype
    if args.mics_shard_size is not None:
        given["mics_shard_size"] = args.mics_shard_size
    if args.hpz_partition_size is not None:
        given["hpz_partition_size"] = args.hpz_partition_size
    if args.config:
        from ..config import load_config

        options = Options.from_config(load_config(args.config), **given)
    else:
        options = Options(**given)
    if options.grad_accum_dtype not in ("fp32", options.dtype):
        raise ValueError(
            f"--grad-accum-dtype {options.grad_accum_dtype} does not fit {options.dtype} compute "
            f"(data_types.grad_accum_dtype): use fp32 or {options.dtype}"
        )
    return options


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.paper:
        print(paper_table(DTYPE_BYTES[args.grad_accum_dtype] if args.grad_accum_dtype else 2))
        return 0
    cluster = Cluster(
        args.nodes,
        args.devices_per_node,
        parse_size(args.device_memory),
        parse_size(args.host_memory),
    )
    options = options_from_args(args)
    shape = shape_from_args(args)
    model = None
    if args.model:
        model = load_model(args.model, json.loads(args.model_kwargs))
        psi = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    else:
        psi = int(args.params)
    rows = estimate(psi, cluster, options, model, shape)
    print(format_table(rows, psi, cluster, options, shape))
    best = recommend(rows)
    offer = two_byte_offer(rows, psi, cluster, options, model=model, shape=shape)
    if offer is not None:
        two, alt = offer
        how = _how(alt)
        print(
            f"with 2-byte gradients (data_types.grad_accum_dtype {two.grad_accum_dtype}, "
            f"--grad-accum-dtype {two.grad_accum_dtype}): stage {alt.stage} {how} fits, "
            f"{alt.per_device / 2**30:.3f} GiB per device (docs/config.md: when 2-byte is safe)"
        )
    if best is None:
        print("no stage fits: add devices or nodes, or use a smaller model or micro-batch")
        return 1
    print(f"recommended: stage {best.stage} {_how(best)}")
    if args.write_config:
        with open(args.write_config, "w") as f:
            micro_batch = shape.micro_batch if shape is not None else 1
            json.dump(recommended_config(best, options, micro_batch), f, indent=2)
            f.write("\n")
        print(f"wrote {args.write_config}")
    return 0


def _how(row: Estimate) -> str:
    if not row.offload:
        return "without offload"
    part = f", ratio {row.ratio:g}" if row.ratio < 1 else ""
    if row.device == "nvme":
        return f"with optimizer offload to nvme{part}"
    return f"with optimizer offload{part}"


if __name__ == "__main__":
    sys.exit(main())
