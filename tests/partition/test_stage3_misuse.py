"""Stage 3 refuses what it cannot do instead of losing data: an in-place write to a gathered
parameter that would be released without reaching the shards (during forward, by
load_state_dict(), under a read-only GatheredParameters; persistent parameters too), full values
loaded into partitioned parameters, torch.func inside forward; and what it keeps working: a
modification published by GatheredParameters(modifier_rank=0) followed by a forward inside the
same block, saved-tensor hooks the caller installs around engine(...) (single process: the same
gather and release code paths as N ranks), a forward through engine.module that uses a tied
weight outside its unit (what Hugging Face's generate() does), and a no-grad forward through
engine.module between backward and step, whose prefetched units the step releases (2 ranks)."""

import copy

import pytest
import torch
import torch.nn.functional as F

import zero

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}
PERSISTENT = {
    **CONFIG,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10**6},
}
X, Y = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]]), torch.tensor([0, 1])
MODIFIED = r"parameter '0.weight' of unit '.*' was modified in place while gathered"


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(10, 8, max_norm=1.0), torch.nn.Flatten(), torch.nn.Linear(32, 3)
    )


def test_in_place_write_during_forward_is_refused():
    # nn.Embedding(max_norm) renormalizes the rows it looks up in place during forward.
    engine, _, _, _ = zero.initialize(model=_model(), config=CONFIG)
    x = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    with pytest.raises(RuntimeError, match=MODIFIED):
        engine(x)
    # Persistent parameters are never released in forward: the loss shows at the step's refresh.
    engine, _, _, _ = zero.initialize(model=_model(), config=PERSISTENT)
    engine.backward(F.cross_entropy(engine(X), Y))
    with pytest.raises(RuntimeError, match=MODIFIED):
        engine.step()
    # Without max_norm the same model trains.
    model = _model()
    model[0].max_norm = None
    engine, _, _, _ = zero.initialize(model=model, config=CONFIG)
    engine.backward(F.cross_entropy(engine(x), torch.tensor([0, 1])))
    engine.step()


def test_load_state_dict_into_partitioned_parameters():
    full = {k: v.clone() + 1 for k, v in _model().state_dict().items()}
    engine, _, _, _ = zero.initialize(model=_model(), config=CONFIG)
    with pytest.raises(RuntimeError, match=r"load_state_dict: '0.weight' is partitioned"):
        engine.module.load_state_dict(full)
    with zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=0):
        engine.module.load_state_dict(full)
    with zero.GatheredParameters(list(engine.module.parameters())):
        for name, param in engine.module.named_parameters():
            assert torch.equal(param, full[name]), name

    with zero.Init(config=CONFIG):  # before initialize too
        model = _model()
    with pytest.raises(RuntimeError, match=r"load_state_dict: '0.weight' is partitioned"):
        model.load_state_dict(full)


def test_modifications_outside_forward():
    model = _model()
    model[0].max_norm = None
    engine, _, _, _ = zero.initialize(model=model, config=CONFIG)
    weight = engine.module[0].weight
    # Published by modifier_rank: a forward inside the same block is fine, the change is kept.
    with zero.GatheredParameters([weight], modifier_rank=0):
        with torch.no_grad():
            weight.mul_(0.5)
        expected = weight.detach().clone()
        engine(X)
    with zero.GatheredParameters([weight]):
        assert torch.equal(weight, expected)
    # A read-only gather would drop the write: refused when the context exits.
    gathered = zero.GatheredParameters([weight])
    without = "1 of 1 ranks changed parameters in place inside zero.GatheredParameters without"
    with pytest.raises(RuntimeError, match=without), gathered, torch.no_grad():
        weight.zero_()
    # load_state_dict into persistent parameters (full-size, not placeholders): refused too.
    engine, _, _, _ = zero.initialize(model=_model(), config=PERSISTENT)
    engine.module[0].max_norm = None
    engine.module.load_state_dict(_model().state_dict())
    engine.backward(F.cross_entropy(engine(X), Y))
    with pytest.raises(RuntimeError, match=r"parameter '.*' of unit '<persistent>' was modified"):
        engine.step()


def test_callers_saved_tensor_hooks_and_torch_func():
    model = _model()
    model[0].max_norm = None
    engine, _, _, _ = zero.initialize(model=model, config=CONFIG)
    packed = []

    def pack(tensor):
        packed.append(tensor.shape)
        return tensor.clone()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(engine(X), Y)
    assert packed  # the activations still go through the caller's hooks
    engine.backward(loss)
    engine.step()

    class FuncInside(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.func.grad(lambda v: self.linear(v).sum())(x)

    engine, _, _, _ = zero.initialize(model=FuncInside(), config=CONFIG)
    with pytest.raises(RuntimeError, match="torch.func transforms cannot run inside"):
        engine(torch.randn(2, 4))


def module_forward_between_backward_and_step():
    """Largest |parameter - reference| after steps with a no-grad forward through engine.module
    (not engine(...)) between each backward and step, 2 ranks."""
    from distributed import full_params

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    reference = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    reference.load_state_dict(model.state_dict())
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        # one unit per layer (72 elements each), prefetched by the default 50M look-ahead
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "reduce_bucket_size": 80,
        },
    }
    engine, _, _, _ = zero.initialize(model=model, config=config)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        xs = [torch.randn(2, 8, generator=generator) for _ in range(2)]
        engine.backward(engine(xs[engine.rank]).square().mean())
        with torch.no_grad():
            engine.module(xs[engine.rank])
        engine.step()
        optimizer.zero_grad()
        reference(torch.cat(xs)).square().mean().backward()
        optimizer.step()
    got = full_params(engine)
    return max((got[n] - p).abs().max().item() for n, p in reference.named_parameters())


class TiedHead(torch.nn.Module):
    """An output layer tied to the embedding, used in the root's forward: outside the
    embedding's unit, as a tied lm_head is."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.body = torch.nn.Linear(8, 8)

    def forward(self, ids):
        return self.body(self.embed(ids)) @ self.embed.weight.T


def test_forward_through_module_gathers_a_tied_weight():
    torch.manual_seed(0)
    reference = TiedHead()
    config = {
        **CONFIG,
        "zero_optimization": {
            **CONFIG["zero_optimization"],
            "stage3_module_granularity_threshold": 50,
        },
    }
    engine, _, _, _ = zero.initialize(model=copy.deepcopy(reference), config=config)
    assert len(engine.gatherer.units) > 1  # the tied weight's unit is not the root's
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    engine.eval()
    with torch.no_grad():
        for forward in (engine, engine.module):  # generate() calls engine.module(...)
            assert torch.equal(forward(ids), reference(ids))
            assert all(p.numel() == 0 for p in engine.module.parameters())  # released after
    engine.train()
    # A training forward through engine.module keeps the tied unit until its backward, like
    # engine(...) does: the step matches the reference's.
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.0)
    engine.backward(engine.module(ids).square().mean())
    engine.step()
    reference(ids).square().mean().backward()
    optimizer.step()
    with zero.GatheredParameters(list(engine.module.parameters())):
        for got, want in zip(engine.module.parameters(), reference.parameters()):
            assert (got - want).abs().max() <= 1e-6


def test_forward_through_module_between_backward_and_step_leaves_no_stale_unit():
    # That forward prefetches the units after each one it runs; those still gathered at step()
    # would keep the old values into the next forward, so the step releases them.
    from distributed import run_ranks

    for difference in run_ranks(module_forward_between_backward_and_step, 2):
        assert difference <= 1e-6, difference
