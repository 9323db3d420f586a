"""Stage 3 with what real models do: BatchNorm buffers, a frozen layer, torch.utils.checkpoint
(reentrant and non-reentrant) around blocks, a parameter used outside its module's forward
(logits = h @ embed.weight.T), and eval / no_grad / inference_mode forwards between training
steps. Every case matches a single-process reference that runs each rank's micro-batch the way
that rank does (BatchNorm normalizes per micro-batch, as in DDP), and the buffers agree across
ranks after every step.

A unit whose frozen weight backward needs after the unit's trainable gradients have arrived (a
frozen scale in front of a trainable projection, as LoRA has a frozen norm in front of its
adapters), under reentrant and non-reentrant checkpointing: equal to the reference, with the
all-gather volume of the run without checkpointing (no unit is gathered twice).

One 2-rank group; the cases are swept inside it.
"""

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from torch import nn
from torch.utils.checkpoint import checkpoint

VOCAB, DIM, SEQ, BATCH, STEPS, WORLD = 11, 6, 5, 3, 3, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(DIM, 2 * DIM)
        self.proj = nn.Linear(2 * DIM, DIM)

    def forward(self, h):
        return h + self.proj(F.gelu(self.fc(h)))


class Modes(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm = nn.BatchNorm1d(DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x, y, recompute=False):
        h = self.embed(x)
        h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        h = self.frozen(h)
        for index, block in enumerate(self.blocks):
            if recompute:
                h = checkpoint(block, h, use_reentrant=index % 2 == 0)
            else:
                h = block(h)
        logits = h @ self.embed.weight.T  # a parameter used outside its module's forward
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def data(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, VOCAB, (WORLD, BATCH, SEQ), generator=g)
    return x, torch.randint(0, VOCAB, (WORLD, BATCH, SEQ), generator=g)


def reference(recompute):
    """Each step: rank r's micro-batch through the model (its own BatchNorm statistics), the
    gradients averaged, AdamW; the buffers then hold what rank 0's forward left (the engine
    broadcasts rank 0's). Eval losses between steps use the running statistics."""
    torch.manual_seed(0)
    model = Modes()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    evals = []
    for step in range(STEPS):
        x, y = data(step)
        kept = None
        for rank in range(WORLD):
            (model(x[rank], y[rank], recompute) / WORLD).backward()
            if rank == 0:
                kept = [b.clone() for b in model.buffers()]
        with torch.no_grad():
            for buffer, value in zip(model.buffers(), kept):
                buffer.copy_(value)
        opt.step()
        opt.zero_grad()
        model.eval()
        with torch.no_grad():
            evals.append(model(x[0], y[0]).item())
        model.train()
    return model, evals


def trainable_gathered(engine) -> int:
    """Elements all-gathered for trainable parameters in the last step (the frozen ones' are
    counted apart: comm.CommLedger.frozen)."""
    return engine.comm_stats()["all_gather"]["elements"] - engine.comm.ledger.last_frozen


def engine_run(recompute, reuse=0):
    import zero

    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_clipping": 0.0,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": 40,
            "stage3_param_persistence_threshold": 0,
            "stage3_module_granularity_threshold": 30,
            "stage3_max_reuse_distance": reuse,
        },
    }
    engine, _, _, _ = zero.initialize(model=Modes(), config=cfg)
    evals, buffers = [], []
    for step in range(STEPS):
        x, y = data(step)
        engine.backward(engine(x[engine.rank], y[engine.rank], recompute))
        engine.step()
        kept, gathered = engine.comm.ledger.last_kept, trainable_gathered(engine)
        engine.eval()
        with torch.no_grad():
            evals.append(engine(x[0], y[0]).item())
        with torch.inference_mode():
            evals[-1] = (evals[-1], engine(x[0], y[0]).item())
        engine.train()
        buffers.append([(b.dtype, b.clone()) for b in engine.module.buffers()])
    with zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    released = all(p.numel() == 0 for p in engine.module.parameters())
    return {
        "params": params,
        "evals": evals,
        "buffers": buffers,
        "released": released,
        "kept": kept,  # of the last step
        "gathered": gathered,  # last step, the eval forwards after the step before included
    }


class ScaledBlock(nn.Module):
    """A frozen per-channel scale in front of a trainable projection: backward needs the scale
    (which a recomputation saves as the parameter itself) after the projection's gradients."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(DIM) + 0.5, requires_grad=False)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, h):
        return h + self.proj(F.gelu(h * self.scale))


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(ScaledBlock() for _ in range(2))

    def forward(self, x, y, reentrant=None):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h) if reentrant is None else checkpoint(block, h, use_reentrant=reentrant)
        return F.cross_entropy((h @ self.embed.weight.T).reshape(-1, VOCAB), y.reshape(-1))


def scaled_reference(reentrant):
    torch.manual_seed(0)
    model = Scaled()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for step in range(STEPS):
        x, y = data(step)
        for rank in range(WORLD):
            (model(x[rank], y[rank], reentrant) / WORLD).backward()
        opt.step()
        opt.zero_grad()
    return dict(model.named_parameters())


def scaled_run(reentrant, reuse):
    import zero

    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_module_granularity_threshold": 60,  # each block one unit
            "stage3_max_reuse_distance": reuse,
        },
    }
    engine, _, _, _ = zero.initialize(model=Scaled(), config=cfg)
    for step in range(STEPS):
        x, y = data(step)
        engine.backward(engine(x[engine.rank], y[engine.rank], reentrant))
        engine.step()
    gathered, kept = trainable_gathered(engine), engine.comm.ledger.last_kept
    with zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {"params": params, "gathered": gathered, "kept": kept}


REUSE = (0, 1, 10**9)  # stage3_max_reuse_distance: never keep, the last unit, every unit


def sweep():
    out = {
        (recompute, reuse): engine_run(recompute, reuse)
        for recompute in (False, True)
        for reuse in REUSE
    }
    out["scaled"] = {
        (reentrant, reuse): scaled_run(reentrant, reuse)
        for reentrant in (None, True, False)
        for reuse in (0, 10**9)
    }
    return out


@pytest.fixture(scope="module")
def per_rank():
    return run_ranks(sweep, WORLD)


@pytest.mark.parametrize("reuse", REUSE)
@pytest.mark.parametrize("recompute", [False, True])
def test_matches_reference_with_buffers_frozen_checkpointing_and_eval(per_rank, recompute, reuse):
    ref, ref_evals = reference(recompute)
    ref_params = dict(ref.named_parameters())
    for res in (r[recompute, reuse] for r in per_rank):
        assert res["released"]
        for name, value in res["params"].items():
            assert torch.allclose(value, ref_params[name], rtol=0, atol=1e-6), name
        for (no_grad, inference), want in zip(res["evals"], ref_evals):
            assert no_grad == pytest.approx(want, abs=1e-6)
            assert inference == pytest.approx(want, abs=1e-6)
        for (dtype, got), want in zip(res["buffers"][-1], ref.buffers()):
            assert dtype == want.dtype and got.shape == want.shape
            assert torch.allclose(got.to(want.dtype), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("recompute", [False, True])
def test_units_kept_for_backward_are_not_gathered_again(per_rank, recompute):
    """stage3_max_reuse_distance: units kept gathered from forward to backward save exactly
    their all-gather, and the comms report expects that."""
    for runs in per_rank:
        kept = {reuse: runs[recompute, reuse]["kept"] for reuse in REUSE}
        # With recompute the last block is a reentrant checkpoint, whose forward runs without
        # grad: nothing to keep it for (its recomputation gathers it in backward).
        assert 0 == kept[0] <= kept[1] < kept[10**9] and (recompute or kept[1] > 0), kept
        for reuse in REUSE:
            run = runs[recompute, reuse]
            assert runs[recompute, 0]["gathered"] - run["gathered"] == kept[reuse], reuse


def test_buffers_agree_across_ranks(per_rank):
    for recompute in (False, True):
        first, second = (r[recompute, 0]["buffers"] for r in per_rank)
        for step_a, step_b in zip(first, second):
            for (_, a), (_, b) in zip(step_a, step_b):
                assert torch.equal(a, b)


@pytest.mark.parametrize("reentrant", [True, False])
def test_frozen_weight_needed_after_the_trainable_gradients(per_rank, reentrant):
    ref = scaled_reference(reentrant)
    for runs in (r["scaled"] for r in per_rank):
        for reuse in (0, 10**9):
            for name, value in runs[reentrant, reuse]["params"].items():
                assert torch.allclose(value, ref[name], rtol=0, atol=1e-6), (name, reuse)
        assert runs[reentrant, 0]["gathered"] == runs[None, 0]["gathered"]
        # Without checkpointing the default stage3_max_reuse_distance keeps units for backward
        # (a checkpointed block's forward runs without grad: its recomputation gathers it).
        assert runs[None, 10**9]["kept"] > 0
        assert (
            runs[None, 0]["gathered"] - runs[None, 10**9]["gathered"] == runs[None, 10**9]["kept"]
        )
