"""Parity of ZeRO stages 0, 1, 2 with a single-process torch reference on the same global batch.

Each world size is spawned once; the cases (stage, gradient accumulation steps, clipping, bucket
sizes, precision) are swept inside that group.
"""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks

VOCAB, DIM, HIDDEN = 11, 6, 7
SEQ, MICRO = 5, 2
STEPS = 3


class Net(torch.nn.Module):
    """Odd sizes, a tied embedding/output weight, a frozen layer, an empty parameter, and a branch
    (`extra`) that only some ranks use in some steps."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.proj = torch.nn.Linear(DIM, HIDDEN)
        self.frozen = torch.nn.Linear(HIDDEN, HIDDEN)
        self.frozen.requires_grad_(False)
        self.extra = torch.nn.Linear(HIDDEN, HIDDEN)
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, DIM, bias=False)
        self.empty = torch.nn.Parameter(torch.empty(0))

    def forward(self, x, y, use_extra=False):
        h = F.gelu(self.proj(self.embed(x)))
        h = self.frozen(h)
        if use_extra:
            h = h + self.extra(h)
        logits = self.out(self.norm(h)) @ self.embed.weight.T
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1))


def param_groups(model):
    decay = [model.embed.weight, model.proj.weight, model.extra.weight, model.out.weight]
    no_decay = [model.proj.bias, model.extra.bias, model.norm.weight, model.norm.bias, model.empty]
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": no_decay, "weight_decay": 0.0, "lr": 2e-2},
        {"params": [model.frozen.weight, model.frozen.bias], "weight_decay": 0.0},
    ]


def batches(world_size, gas, steps=STEPS, seed=0):
    """batches[step][micro][rank] = (x, y, use_extra)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        micro = []
        for m in range(gas):
            per_rank = []
            for r in range(world_size):
                x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
                y = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
                per_rank.append((x, y, (step + m + r) % 3 == 0))
            micro.append(per_rank)
        out.append(micro)
    return out


def reference(data, world_size, gas, clip, lr=1e-2):
    """Plain torch: average gradients over ranks and micro-batches, clip, AdamW."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(param_groups(model), lr=lr, betas=(0.9, 0.99), eps=1e-8)
    norms = []
    for step in data:
        for micro in step:
            for x, y, use_extra in micro:
                (model(x, y, use_extra) / (world_size * gas)).backward()
        trainable = [p for p in model.parameters() if p.requires_grad]
        for p in trainable:
            if p.grad is None:  # unused everywhere: zero gradient, as the engine defines it
                p.grad = torch.zeros_like(p)
        norms.append(float(torch.nn.utils.clip_grad_norm_(trainable, clip if clip else math.inf)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, norms


def config(stage, gas, clip, world_size, dtype="fp32", bucket=40, allgather=50):
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "steps_per_print": 1000,
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": allgather,
            "overlap_comm": True,
        },
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def train_engine(cfg, data, lr=1e-2):
    import zero

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(param_groups(model), lr=lr, betas=(0.9, 0.99), eps=1e-8)
    engine, _, _, _ = zero.initialize(model=model, optimizer=opt, config=cfg)
    norms = []
    for step in data:
        for micro in step:
            x, y, use_extra = micro[engine.rank]
            engine.backward(engine(x, y, use_extra=use_extra))
            engine.step()
        norms.append(engine.get_global_grad_norm())
    return engine, norms


def max_param_diff(engine, ref):
    ref_params = dict(ref.named_parameters())
    return max(
        (p.detach().float() - ref_params[n].detach()).abs().max().item() if p.numel() else 0.0
        for n, p in engine.module.named_parameters()
    )


def sweep_fp32(world_size):
    results = []
    for stage, gas, clip, bucket in itertools.product((0, 1, 2), (1, 4), (0.0, 0.05), (40, 10**6)):
        data = batches(world_size, gas)
        engine, norms = train_engine(config(stage, gas, clip, world_size, bucket=bucket), data)
        ref, ref_norms = reference(data, world_size, gas, clip)
        results.append(
            {
                "case": (stage, gas, clip, bucket),
                "param_diff": max_param_diff(engine, ref),
                "norms": norms,
                "ref_norms": ref_norms,
                "frozen_equal": torch.equal(engine.module.frozen.weight, ref.frozen.weight),
                "num_buckets": len(engine.optimizer.buckets),
            }
        )
    return results


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_fp32_parity(world_size):
    per_rank = run_ranks(sweep_fp32, world_size, world_size)
    for rank_results in per_rank:
        for res in rank_results:
            assert res["param_diff"] <= 1e-6, res
            assert res["frozen_equal"], res
            for got, want in zip(res["norms"], res["ref_norms"]):
                assert got == pytest.approx(want, rel=1e-6, abs=1e-7), res
    # The reported norm is the same on every rank.
    for case in range(len(per_rank[0])):
        assert len({tuple(r[case]["norms"]) for r in per_rank}) == 1
    assert any(res["num_buckets"] > 1 for res in per_rank[0])
