"""The model, batches and config the parity tests share: odd sizes (no world size divides
them), a tied weight, a frozen layer, an empty parameter and a branch some ranks skip."""

import torch
import torch.nn.functional as F

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
    no_decay = [p for p in no_decay if p is not None]
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": no_decay, "weight_decay": 0.0, "lr": 2e-2},
        {"params": [model.frozen.weight, model.frozen.bias], "weight_decay": 0.0},
    ]


def batches(world_size, gas, steps=STEPS, seed=0, same_modules=False):
    """batches[step][micro][rank] = (x, y, use_extra). With same_modules every rank runs the
    same modules in a micro-batch (required by stage 3, see docs/stages.md)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        micro = []
        for m in range(gas):
            per_rank = []
            for r in range(world_size):
                x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
                y = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
                per_rank.append((x, y, (step + m + (1 if same_modules else r)) % 3 == 0))
            micro.append(per_rank)
        out.append(micro)
    return out


def config(stage, gas, clip, world_size, dtype="fp32", bucket=40, allgather=50, unit=60):
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
            "stage3_module_granularity_threshold": unit,  # stage 3: each leaf module a unit
            "stage3_param_persistence_threshold": 0,  # stage 3: every parameter partitioned
        },
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg
