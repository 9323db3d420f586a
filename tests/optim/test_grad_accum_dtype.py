"""data_types.grad_accum_dtype bf16/fp16: 2-byte gradient buffers at stages 0-3.

Parity: the engine on 2 gloo ranks equals, bitwise, a single-process reference that accumulates in
the 2-byte dtype in the engine's order of additions (stages 0/1: each rank sums its micro-batches,
then the ranks' sums are added; stages 2/3: each micro-batch's gradients are added over ranks,
then into the running shard). With 2 ranks every reduction is one rounded addition, so the order
is fixed. No gradient clipping (the norm's summation order differs); the reported global norm is
checked against the reference's fp32 norm of the same 2-byte sums to 1e-5.

Memory: engine.model_state_bytes() equals the paper's formulas exactly, on the padded Psi:
DP 16 Psi, stage 1 4 Psi + 12 Psi/N, stage 2 2 Psi + 14 Psi/N, stage 3 16 Psi/N (N = 2 and 3).
"""

import itertools
import math

import pytest
import torch
from distributed import one_thread, run_ranks
from parity_model import Net, batches, config, param_groups

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
LOSS_SCALE = {"bf16": 1.0, "fp16": 2.0**8}  # parity_model.config: fp16 initial_scale_power 8
LR = 1e-2


def _micro_grads(model, x, y, use_extra, scale):
    """{name: 2-byte gradient} of one rank's micro-batch; zero for parameters it did not use."""
    model.zero_grad(set_to_none=True)
    (model(x, y, use_extra) * scale).backward()
    return {
        n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters()
        if p.requires_grad and p.numel()
    }


def _add(a, b):
    return {n: a[n] + b[n] for n in a} if a is not None else b


def reference(data, stage, gas, dtype):
    """Single process, the engine's arithmetic: 2-byte sums in its order, then fp32 master
    weights stepped by AdamW on the fp32 copy of the averaged sum. Returns (params, norms).
    One thread, as the spawned ranks: a multi-threaded CPU kernel (LayerNorm's weight gradient)
    sums in another order."""
    with one_thread():
        return _reference(data, stage, gas, dtype)


def _reference(data, stage, gas, dtype):
    torch.manual_seed(0)
    model = Net()
    masters = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.to(DTYPES[dtype])  # the engine's master weights are the fp32 values before the cast
    by_id = {id(p): n for n, p in model.named_parameters()}
    groups = [
        {**g, "params": [masters[by_id[id(p)]] for p in g["params"] if p.requires_grad]}
        for g in param_groups(model)
    ]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.99), eps=1e-8)
    scale = LOSS_SCALE[dtype]
    world = len(data[0][0])
    norms = []
    for step in data:
        total = None
        if stage < 2:  # each rank accumulates its micro-batches, then one reduction
            per_rank = [None] * world
            for micro in step:
                for r, (x, y, use_extra) in enumerate(micro):
                    grads = _micro_grads(model, x, y, use_extra, scale / gas)
                    per_rank[r] = _add(per_rank[r], grads)
            for grads in per_rank:
                total = _add(total, grads)
        else:  # every micro-batch reduced over ranks, then added to the running shard
            for micro in step:
                reduced = None
                for x, y, use_extra in micro:
                    reduced = _add(reduced, _micro_grads(model, x, y, use_extra, scale / gas))
                total = _add(total, reduced)
        unscale = 1.0 / (world * scale)
        squares = sum(float(g.float().square().sum()) for g in total.values())
        norms.append(math.sqrt(squares) * unscale)
        for n, g in total.items():
            masters[n].grad = g.float() * unscale
        opt.step()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if p.requires_grad:
                    p.copy_(masters[n])
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def _engine(stage, gas, dtype, accum=None):
    import zero

    cfg = config(stage, gas, 0.0, 2, dtype)
    cfg["data_types"] = {"grad_accum_dtype": accum or dtype}
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(param_groups(model), lr=LR, betas=(0.9, 0.99), eps=1e-8)
    engine, _, _, _ = zero.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def _full_params(engine):
    if engine.gatherer is not None:
        for unit in engine.gatherer.units:
            engine.gatherer.fetch(unit)
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def sweep_parity():
    import zero

    out = []
    cases = [(d, s, g) for d in ("bf16",) for s in range(4) for g in (1, 2)]
    cases += [("fp16", s, 2) for s in (1, 2)]
    for dtype, stage, gas in cases:
        engine = _engine(stage, gas, dtype)
        data = batches(2, gas, same_modules=True)
        norms, full_grad = [], None
        for s, step in enumerate(data):
            for m, micro in enumerate(step):
                x, y, use_extra = micro[engine.rank]
                engine.backward(engine(x, y, use_extra=use_extra))
                if s == 0 and m == gas - 1:  # inside the safe_get window: averaged, fp32
                    full_grad = zero.utils.safe_get_full_grad(engine.module.proj.weight)
                    shard_dtypes = {str(b.grad_shard.dtype) for b in engine.optimizer.buckets}
                engine.step()
            norms.append(engine.get_global_grad_norm())
        out.append((dtype, stage, gas, _full_params(engine), norms, full_grad, shard_dtypes))
    return out


def sweep_memory():
    out = []
    for dtype, stage in itertools.product(("bf16", "fp32"), range(4)):
        engine = _engine(stage, 1, "bf16", accum=dtype)
        x, y, use_extra = batches(engine.comm.world_size, 1, steps=1, same_modules=True)[0][0][0]
        engine.backward(engine(x, y, use_extra=use_extra))
        engine.step()  # optimizer state exists after the first step
        layout = engine.optimizer.layout
        report = engine.memory_report()
        out.append((dtype, stage, layout.padded_numel, layout.num_shards, report))
    return out


@pytest.fixture(scope="module")
def parity():
    return run_ranks(sweep_parity, 2, timeout=240)


def test_two_byte_accumulation_is_bitwise_the_reference(parity):
    for rank_results in parity:
        for dtype, stage, gas, params, norms, full_grad, shard_dtypes in rank_results:
            case = (dtype, stage, gas)
            assert shard_dtypes == {str(DTYPES[dtype])}, case
            ref, ref_norms = reference(batches(2, gas, same_modules=True), stage, gas, dtype)
            for name, value in ref.items():
                assert params[name].dtype == value.dtype, (case, name)
                assert torch.equal(params[name], value), (case, name)
            for got, want in zip(norms, ref_norms):
                assert got == pytest.approx(want, rel=1e-5), case
            assert full_grad.dtype == torch.float32, case


def test_safe_get_full_grad_is_the_fp32_average(parity):
    gas_one = [r for r in parity[0] if r[0] == "bf16" and r[2] == 1]
    data = batches(2, 1, same_modules=True)
    torch.manual_seed(0)
    model = Net().to(torch.bfloat16)
    with one_thread():
        grads = [_micro_grads(model, *data[0][0][r], 1.0)["proj.weight"] for r in range(2)]
    want = (grads[0] + grads[1]).float() / 2  # one bf16 addition, averaged in fp32
    for _, stage, _, _, _, full_grad, _ in gas_one:
        assert torch.equal(full_grad, want), stage


def _paper(stage, psi, n):
    return {0: 16 * psi, 1: 4 * psi + 12 * psi // n, 2: 2 * psi + 14 * psi // n}.get(
        stage, 16 * psi // n
    )


@pytest.mark.parametrize("world_size", [2, 3])
def test_model_state_bytes_equal_the_paper(world_size):
    for dtype, stage, padded, n, report in run_ranks(sweep_memory, world_size)[0]:
        measured = report["measured"]
        total = sum(measured.values()) - measured["frozen_params"]  # the paper counts trained ones
        assert measured == report["formula"], (dtype, stage, report)
        assert n == (1 if stage == 0 else world_size)
        grad_elements = padded if stage < 2 else padded // n
        extra = 0 if dtype == "bf16" else 2 * grad_elements  # fp32: 4-byte gradients
        assert total == _paper(stage, padded, n) + extra, (dtype, stage, measured)
        assert report["gradient_bytes"] == (2 if dtype == "bf16" else 4)


def test_config_refuses_a_mismatched_accumulation_dtype():
    import zero

    for compute, accum in [("fp32", "bf16"), ("fp32", "fp16"), ("bf16", "fp16"), ("fp16", "bf16")]:
        cfg = {"train_micro_batch_size_per_gpu": 1, "data_types": {"grad_accum_dtype": accum}}
        if compute != "fp32":
            cfg[compute] = {"enabled": True}
        with pytest.raises(Exception, match="data_types.grad_accum_dtype") as info:
            zero.load_config(cfg)
        assert type(info.value).__name__ == "ConfigError"
