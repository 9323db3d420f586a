"""zero.GatheredParameters inside an open zero.Init context (transformers gathers weights in
__init__ and _init_weights while building a model under deepspeed.zero.Init): the parameter
stays gathered for the whole block, is partitioned once on exit from modifier_rank's values,
keeps its shape, and trains like a model built without zero.Init.

One group of 2 ranks is spawned; every case runs inside it and reports its own failure.
"""

import math
import traceback

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from torch import nn

DIM, POS, SEED = 6, 5, 1234


class Sinusoidal(nn.Module):
    """distilbert's construction: under ZeRO-3 the table is written on rank 0 alone inside
    GatheredParameters(modifier_rank=0); a weight_norm conv as wav2vec2's positional conv;
    a read-only gather with an alias kept while more modules are built."""

    def __init__(self, under_init: bool):
        import torch.distributed as dist

        import zero

        super().__init__()
        self.pos = nn.Embedding(POS, DIM)
        with zero.GatheredParameters(self.pos.weight, modifier_rank=0):
            if not under_init or dist.get_rank() == 0:
                _sinusoidal(self.pos.weight)
        # distilbert freezes the table on rank 0 alone, which zero.initialize refuses (the
        # ranks would lay out different trainable parameters): freeze it on every rank
        self.pos.weight.requires_grad_(False)
        self.conv = nn.Conv1d(DIM, DIM, kernel_size=3, padding=1, groups=2)
        with zero.GatheredParameters(self.conv.weight, modifier_rank=0):
            self.conv = nn.utils.parametrizations.weight_norm(self.conv, name="weight", dim=2)
        self.embed = nn.Embedding(11, DIM)
        with zero.GatheredParameters(self.embed.weight, modifier_rank=0):
            alias = self.embed.weight.data  # kept across more than KEEP_GATHERED touches
            self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(3))
            for layer in self.layers:
                nn.init.normal_(layer.weight, std=0.1)
                nn.init.zeros_(layer.bias)
            alias.mul_(0.5)
            self.rows = alias.shape[0]
        self.head = nn.Linear(DIM, 11)
        nn.init.normal_(self.head.weight, std=0.02)  # touched before a gather: kept
        with zero.GatheredParameters(self.head.weight, modifier_rank=0):
            if not under_init or dist.get_rank() == 0:
                with torch.no_grad():
                    self.head.weight.mul_(2.0)

    def forward(self, x, y):
        h = self.embed(x) + self.pos.weight[: x.shape[1]]
        h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        for layer in self.layers:
            h = h + F.gelu(layer(h))
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


@torch.no_grad()
def _sinusoidal(out):
    pos = torch.arange(POS, dtype=torch.float64)[:, None]
    freq = torch.pow(10000.0, -2 * (torch.arange(DIM) // 2) / DIM).to(torch.float64)
    table = pos * freq
    out[:, 0::2] = torch.sin(table[:, 0::2]).float()
    out[:, 1::2] = torch.cos(table[:, 1::2]).float()


def config():
    return {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }


def _case(out, name, fn):
    try:
        out[name] = fn()
    except Exception:
        out[name] = "error: " + traceback.format_exc()


def _rank():
    import torch.distributed as dist

    return dist.get_rank()


def read_only():
    """Read-only gathers inside the context, one of a parameter that construction code had
    gathered already: shapes and values as without zero.Init (same seed)."""
    import zero
    from zero.init import full_shape, gather_full

    torch.manual_seed(SEED)
    want = nn.Linear(12, 9)
    torch.manual_seed(SEED)
    with zero.Init():
        layer = nn.Linear(12, 9)
        with zero.GatheredParameters(layer.weight):
            inside = (tuple(layer.weight.shape), torch.equal(layer.weight, want.weight))
        nn.init.zeros_(layer.bias)  # gathered by the context, then read under a gather
        with zero.GatheredParameters([layer.bias, layer.bias]):
            pass
        in_context = tuple(full_shape(layer.weight))
    return {
        "inside": inside,
        "in_context": in_context,
        "after": (tuple(full_shape(layer.weight)), layer.weight.numel()),
        "weight": torch.equal(gather_full(layer.weight), want.weight),
        "bias": gather_full(layer.bias).abs().max().item(),
    }


def modified():
    """modifier_rank writes inside the context reach every rank's shard; nested blocks; a
    parameter re-assigned inside the context."""
    import zero
    from zero.init import full_shape, gather_full

    rank = _rank()
    with zero.Init():
        layer = nn.Linear(4, 3)
        with zero.GatheredParameters(layer.weight, modifier_rank=0):
            if rank == 0:
                with torch.no_grad():
                    layer.weight.fill_(7.0)
        with zero.GatheredParameters(layer.bias):
            with zero.GatheredParameters(layer.bias, modifier_rank=1):
                if rank == 1:
                    with torch.no_grad():
                        layer.bias.fill_(-2.0)
            inner = layer.bias.numel()
        # transformers' initialize_weights_zero3: rank 0 alone initializes inside an outer
        # block, and _init_weights opens its own (no communication: the outer one holds them)
        with zero.GatheredParameters(list(layer.parameters()), modifier_rank=0):
            if rank == 0:
                with zero.GatheredParameters(layer.weight, modifier_rank=0), torch.no_grad():
                    layer.weight.add_(1.0)
        other = nn.Linear(4, 3)
        other.weight = nn.Parameter(torch.ones(3, 4))  # re-assigned: partitioned at once
        with zero.GatheredParameters(other.weight, modifier_rank=0):
            if rank == 0:
                with torch.no_grad():
                    other.weight.mul_(3.0)
        other.bias = nn.Parameter(other.bias.detach() * 0 + 5.0)  # from the gathered old value
        with zero.GatheredParameters(other.bias):
            reassigned_read = other.bias.tolist()
    return {
        "weight": (tuple(full_shape(layer.weight)), gather_full(layer.weight).unique().tolist()),
        "bias": (inner, gather_full(layer.bias).tolist()),
        "reassigned": (
            tuple(full_shape(other.weight)),
            gather_full(other.weight).unique().tolist(),
            reassigned_read,
            gather_full(other.bias).tolist(),
        ),
    }


def tiled():
    """TiledLinear(init_linear=...) built under zero.Init equals one built without it."""
    import zero
    from zero.init import gather_full

    torch.manual_seed(SEED)
    source = nn.Linear(7, 5)
    want = zero.zero.TiledLinear(7, 5, in_splits=2, out_splits=3, init_linear=source)
    with zero.Init():
        source_init = nn.Linear(7, 5)
        params = list(source_init.parameters())
        with zero.GatheredParameters(params, modifier_rank=0), torch.no_grad():
            source_init.weight.copy_(source.weight)
            source_init.bias.copy_(source.bias)
        got = zero.zero.TiledLinear(7, 5, in_splits=2, out_splits=3, init_linear=source_init)
    return all(
        torch.equal(gather_full(p), want.get_parameter(n)) for n, p in got.named_parameters()
    )


def built_model():
    """Sinusoidal under zero.Init against the same construction without it: values, shapes."""
    import zero
    from zero.init import full_shape, gather_full

    torch.manual_seed(SEED)
    want = Sinusoidal(under_init=False)
    torch.manual_seed(SEED + _rank())  # rank 0's draws are broadcast: other seeds do not matter
    with zero.Init():
        got = Sinusoidal(under_init=True)
    return {
        n: (tuple(full_shape(p)), torch.equal(gather_full(p), want.get_parameter(n)))
        for n, p in got.named_parameters()
    }, got.rows


def train(under_init: bool, steps: int = 3) -> dict:
    import zero

    torch.manual_seed(SEED if not under_init else SEED + _rank())
    if under_init:
        with zero.Init(config=config()):
            model = Sinusoidal(under_init=True)
    else:
        torch.manual_seed(SEED)
        model = Sinusoidal(under_init=False)
    engine, _, _, _ = zero.initialize(model=model, config=config())
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x = torch.randint(0, 11, (engine.comm.world_size, 2, POS), generator=g)
        y = torch.randint(0, 11, (engine.comm.world_size, 2, POS), generator=g)
        engine.backward(engine(x[engine.rank], y[engine.rank]))
        engine.step()
    with zero.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def training():
    want, got = train(under_init=False), train(under_init=True)
    return max((got[n] - w).abs().max().item() for n, w in want.items())


def sweep():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    out = {}
    for name, fn in [
        ("read_only", read_only),
        ("modified", modified),
        ("tiled", tiled),
        ("built_model", built_model),
        ("training", training),
    ]:
        _case(out, name, fn)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(sweep, 2)


def _get(res, name):
    value = res[name]
    assert not (isinstance(value, str) and value.startswith("error: ")), value
    return value


def test_read_only_gathering_inside_init_keeps_shapes_and_values(results):
    for res in results:
        got = _get(res, "read_only")
        assert got["inside"] == ((9, 12), True)
        assert got["in_context"] == (9, 12)
        assert got["after"] == ((9, 12), 0)
        assert got["weight"] and got["bias"] == 0.0


def test_modifier_rank_writes_inside_init_reach_every_shard(results):
    for res in results:
        got = _get(res, "modified")
        assert got["weight"] == ((3, 4), [8.0])
        assert got["bias"] == (3, [-2.0] * 3)


def test_gathering_a_parameter_reassigned_inside_init(results):
    for res in results:
        shape, values, read, bias = _get(res, "modified")["reassigned"]
        assert (shape, values) == ((3, 4), [3.0])
        assert read == [5.0] * 3 and bias == [5.0] * 3


def test_hf_style_construction_under_init_equals_an_ordinary_one(results):
    """distilbert's rank-0 table, a weight_norm conv, an alias kept across a block, a write
    after construction code gathered the parameter, TiledLinear(init_linear=...)."""
    for res in results:
        values, rows = _get(res, "built_model")
        assert rows == 11
        assert all(equal for _, equal in values.values()), values
        assert values["pos.weight"][0] == (POS, DIM)
        assert math.prod(values["conv.parametrizations.weight.original1"][0]) == DIM * DIM // 2 * 3
        assert _get(res, "tiled") is True


def test_stage3_engine_from_init_with_gathers_trains_like_an_ordinary_model(results):
    for res in results:
        assert _get(res, "training") == 0.0
