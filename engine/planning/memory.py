"""Memory accounting of model states: what each rank holds, next to the paper's formula.

[Note: the two formulas]
The paper (ZeRO, section 3.1 and figure 1) counts mixed-precision Adam as 2 bytes of fp16
parameters, 2 bytes of fp16 gradients and K = 12 bytes of fp32 master weights, momentum and
variance per parameter: DP 16 Psi, stage 1 4 Psi + 12 Psi / N, stage 2 2 Psi + 14 Psi / N,
stage 3 16 Psi / N. zero accumulates gradients in data_types.grad_accum_dtype: with bf16/fp16
(2-byte gradients) a rank holds exactly the paper's figures; with the default fp32 the gradient
term is 4 bytes, not 2: DP 18 Psi, stage 1 6 Psi + 12 Psi / N, stage 2 2 Psi + 16 Psi / N,
stage 3 18 Psi / N. With fp32 compute the fp32 parameters are the master weights (no copy), so K
drops to 8. Every report prints both and says which gradient width the measurement follows.

zero's own convention also sets Psi: each bucket is padded to a multiple of N (flat.py), so the
per-rank figures use the padded element count; the paper's Psi (unpadded) differs by under 1%.

[Note: frozen parameters and ZeRO-Inference]
Parameters no optimizer trains (requires_grad=False; every parameter of an engine built without
an optimizer, [Note: ZeRO-Inference] in partition/stages.py) are counted apart, as
"frozen_params": p bytes per element of the compute dtype, whole below stage 3 (p Psi_f), a 1/N
shard at stage 3 (p Psi_f / N, Psi_f padded per bucket). They have no gradient, master or
optimizer-state term, so an engine without an optimizer holds exactly 2 Psi (bf16/fp16) or
4 Psi (fp32) at stages 0-2 and 2 Psi / N or 4 Psi / N at stage 3. With offload_param (stage 3)
the parameter shards, trained and frozen, are in host memory ("offloaded_bytes"), or in nvme
files beyond offload_param.max_in_cpu ("nvme_bytes", counted 0 in "measured").
"""

from dataclasses import dataclass

import torch

# Optimizers whose state is two fp32 tensors per parameter (Adam's m and v): 8 bytes/element.
ADAM_LIKE = frozenset({"Adam", "AdamW", "CPUAdam", "FusedAdam", "Adamax", "NAdam", "RAdam"})

CATEGORIES = ("params", "frozen_params", "grads", "master", "optimizer_state", "host_grad")
CATEGORY_TITLES = {
    "params": "low-precision parameters",
    "frozen_params": "frozen parameters (no optimizer)",
    "grads": "gradient buffers/shards",
    "master": "fp32 master weights",
    "optimizer_state": "optimizer state",
    "host_grad": "host gradient copy (offload)",
}


@dataclass(frozen=True)
class ModelStateSpec:
    """What decides model-state bytes per rank.

    numel: parameter elements (Psi) as laid out, padding included (elements). num_shards: N, the
    ranks that split each bucket (1 for stage 0). compute_bytes: bytes of one element of the
    compute dtype (2 for bf16/fp16, 4 for fp32). state_bytes: optimizer-state bytes per element
    (8 for Adam-like optimizers; None when unknown). offload: optimizer offload to the host.
    grad_bytes: bytes of one gradient element [data_types.grad_accum_dtype]: 4 for fp32 (zero's
    default), 2 for bf16/fp16 (the paper's count). The offload host copy is always fp32.
    frozen_numel: elements of the parameters no optimizer trains ([Note: frozen parameters and
    ZeRO-Inference]): at stage 3 as laid out (padded), else unpadded.
    """

    stage: int
    numel: int
    num_shards: int
    compute_bytes: int = 2
    state_bytes: int | None = 8
    offload: bool = False
    grad_bytes: int = 4
    frozen_numel: int = 0


def model_state_formula(spec: ModelStateSpec) -> dict[str, int | None]:
    """Bytes per rank per category under zero's conventions (gradients of spec.grad_bytes,
    padded Psi; see [Note: the two formulas]). Keys are CATEGORIES; None when unknown."""
    psi, n = spec.numel, spec.num_shards
    shard = psi // n
    master_aliases = spec.compute_bytes == 4 and not spec.offload
    frozen = spec.frozen_numel // n if spec.stage == 3 else spec.frozen_numel
    return {
        "params": (shard if spec.stage == 3 else psi) * spec.compute_bytes,
        "frozen_params": frozen * spec.compute_bytes,
        "grads": spec.grad_bytes * (psi if spec.stage < 2 else shard),
        "master": 0 if master_aliases else 4 * shard,
        "optimizer_state": None if spec.state_bytes is None else spec.state_bytes * shard,
        "host_grad": 4 * shard if spec.offload else 0,
    }


def offloaded_bytes(bytes_by_category: dict) -> int:
    """Bytes of the categories that live in host memory with optimizer offload."""
    return sum(bytes_by_category.get(k) or 0 for k in ("master", "optimizer_state", "host_grad"))


def formula_text(
    stage: int, compute_bytes: int, grad_bytes: int = 4, trains: bool = True
) -> tuple[str, str]:
    """(paper formula with 2-byte gradients, zero's formula with `grad_bytes`-byte gradients),
    per rank, in Psi and N; for fp32 compute, K = 8 (no separate master copy). Without an
    optimizer (trains=False) both are the parameters alone: p Psi, at stage 3 p Psi/N."""
    if not trains:
        text = f"{compute_bytes} Psi/N" if stage == 3 else f"{compute_bytes} Psi"
        return text, text
    paper = {0: "16 Psi", 1: "4 Psi + 12 Psi/N", 2: "2 Psi + 14 Psi/N", 3: "16 Psi/N"}[stage]
    p, g, k = compute_bytes, grad_bytes, (12 if compute_bytes != 4 else 8)
    ours = {
        0: f"{p + g + k} Psi",
        1: f"{p + g} Psi + {k} Psi/N",
        2: f"{p} Psi + {g + k} Psi/N",
        3: f"{p + g + k} Psi/N",
    }[stage]
    return paper, ours


def state_bytes_per_element(optimizer) -> int | None:
    """Optimizer-state bytes per parameter element for known optimizers, else None."""
    return 8 if type(optimizer).__name__ in ADAM_LIKE else None


def measure(engine) -> dict[str, int]:
    """Bytes this rank holds in memory per category (CATEGORIES), measured from the engine's
    tensors (not a collective).

    Optimizer state exists only after the first optimizer step (torch creates it lazily).
    """
    zero_optimizer = engine.optimizer
    measured = dict(zero_optimizer.model_state_bytes())
    measured["frozen_params"] = frozen_param_bytes(engine)
    measured["host_grad"] = sum(
        b.host_grad.numel() * b.host_grad.element_size()
        for b in zero_optimizer.buckets
        if b.host_grad is not None
    )
    return {k: measured.get(k, 0) for k in CATEGORIES}


def _frozen_params(engine) -> list:
    """The parameters with elements that no optimizer of `engine` trains, each once."""
    trained = {id(p) for b in engine.optimizer.buckets for p in b.params}
    unique = {id(p): p for p in engine.module.parameters() if id(p) not in trained}
    return list(unique.values())


def frozen_param_bytes(engine) -> int:
    """Bytes of the parameters no optimizer trains that this rank holds in memory (device or
    host): at stage 3 its shards of them (0 for a shard in an nvme file), below stage 3 the
    whole tensors. Not a collective."""
    if engine.frozen is not None:
        shards = [b.param_shard for b in engine.frozen.buckets]
        return sum(shard.numel() * shard.element_size() for shard in shards)
    return sum(p.numel() * p.element_size() for p in _frozen_params(engine))


def frozen_numel(engine) -> int:
    """Elements of the parameters no optimizer trains, as ModelStateSpec.frozen_numel counts
    them: padded at stage 3 (their FrozenShards layout), else unpadded."""
    if engine.frozen is not None:
        return engine.frozen.layout.padded_numel
    return sum(p.numel() for p in _frozen_params(engine))


def memory_report(engine) -> dict:
    """engine.memory_report(): measured and formula bytes per category for this rank.

    Returns {"rank", "stage", "world_size", "num_shards", "psi", "psi_padded", "frozen_psi",
    "trains", "measured", "formula", "offloaded_bytes", "nvme_bytes", "paper_formula",
    "zero_formula", "gradient_bytes"}; bytes are per rank; psi counts the trained parameters'
    elements, frozen_psi the others' (as ModelStateSpec.frozen_numel); trains is False for an
    engine built without an optimizer ([Note: frozen parameters and ZeRO-Inference]);
    gradient_bytes is 4 (fp32) or 2 (data_types.grad_accum_dtype bf16/fp16). "measured" counts
    memory only: what lives in nvme files (ZeRO-Infinity) is 0 there and counted in nvme_bytes,
    {"params": parameter shards, "optimizer": fp32 masters and optimizer state}, bytes on
    disk; offloaded_bytes is the part of "measured" in host memory (optimizer offload: masters,
    optimizer state, host gradient; offload_param: the parameter shards). Not a collective.
    """
    opt = engine.optimizer
    layout = opt.layout
    compute_bytes = torch.empty(0, dtype=engine.config.compute_dtype).element_size()
    grad_bytes = torch.empty(0, dtype=engine.config.grad_accum_dtype).element_size()
    spec = ModelStateSpec(
        stage=engine.config.zero.stage,
        numel=layout.padded_numel,
        num_shards=layout.num_shards,
        compute_bytes=compute_bytes,
        state_bytes=state_bytes_per_element(opt.optimizer) if opt.trains else 0,
        offload=opt.settings.offload,
        grad_bytes=grad_bytes,
        frozen_numel=frozen_numel(engine),
    )
    measured = measure(engine)
    paper, ours = formula_text(spec.stage, compute_bytes, grad_bytes, opt.trains)
    host = offloaded_bytes(measured) if spec.offload else 0
    if spec.stage == 3 and _offloads_params(engine.config):
        host += measured["params"] + measured["frozen_params"]
    return {
        "rank": engine.comm.rank,
        "stage": spec.stage,
        "world_size": engine.comm.world_size,
        "num_shards": spec.num_shards,
        "psi": layout.numel,
        "psi_padded": layout.padded_numel,
        "frozen_psi": spec.frozen_numel,
        "trains": opt.trains,
        "measured": measured,
        "formula": model_state_formula(spec),
        "offloaded_bytes": host,
        "nvme_bytes": opt.nvme_bytes(),
        "paper_formula": paper,
        "zero_formula": ours,
        "gradient_bytes": grad_bytes,
    }


def _offloads_params(config) -> bool:
    """zero_optimization.offload_param keeps stage-3 parameter shards off the device."""
    block = config.zero.offload_param
    return block is not None and block.device in ("cpu", "nvme")


def format_report(report: dict) -> str:
    """The memory report as a fixed-width table (MiB and bytes)."""
    lines = [
        f"zero memory report, rank {report['rank']}, stage {report['stage']}, "
        f"N={report['num_shards']} of world {report['world_size']}, "
        f"Psi={report['psi']:,} ({report['psi_padded']:,} padded)"
        + (f", frozen {report['frozen_psi']:,}" if report.get("frozen_psi") else "")
        + ("" if report.get("trains", True) else ", no optimizer (ZeRO-Inference)"),
        f"{'category':<32}{'measured B':>16}{'formula B':>16}{'MiB':>10}",
    ]
    for key in CATEGORIES:
        got, want = report["measured"][key], report["formula"][key]
        want_text = "n/a" if want is None else f"{want:,}"
        lines.append(f"{CATEGORY_TITLES[key]:<32}{got:>16,}{want_text:>16}{got / 2**20:>10.2f}")
    total = sum(report["measured"].values())
    want_total = sum(v or 0 for v in report["formula"].values())
    lines.append(f"{'total model states':<32}{total:>16,}{want_total:>16,}{total / 2**20:>10.2f}")
    if report["offloaded_bytes"]:
        lines.append(f"of which in host memory (offload): {report['offloaded_bytes']:,} B")
    on_disk = report.get("nvme_bytes") or {}
    if any(on_disk.values()):
        lines.append(
            f"on nvme (files, not in memory): parameter shards {on_disk['params']:,} B, "
            f"fp32 masters + optimizer state {on_disk['optimizer']:,} B"
        )
    width = report["gradient_bytes"]
    accum = "fp32" if width == 4 else "2-byte"
    lines.append(
        f"formula: zero ({accum} gradient accumulation, {width}-byte gradients) "
        f"{report['zero_formula']}; paper (2-byte gradients) {report['paper_formula']}"
    )
    return "\n".join(lines)
