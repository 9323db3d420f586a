"""Parity of ZeRO stages 0, 1, 2 with a single-process torch reference on the same global batch.

Each world size is started once: every test at world size 2 reads its part of one group's results
(the two_ranks fixture); the cases (stage, gradient accumulation steps, clipping, bucket sizes,
precision) are swept inside that group.
"""

import itertools
import math

import pytest
import torch
from distributed import run_ranks
from parity_model import DIM, HIDDEN, SEQ, VOCAB, Net, batches, config, param_groups


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
    if engine.gatherer is not None:  # stage 3: gather every unit to read the full parameters
        for unit in engine.gatherer.units:
            engine.gatherer.fetch(unit)
    return max(
        (p.detach().float() - ref_params[n].detach()).abs().max().item() if p.numel() else 0.0
        for n, p in engine.module.named_parameters()
    )


def sweep_fp32(world_size):
    results = []
    cases = itertools.product((0, 1, 2, 3), (1, 4), (0.0, 0.05), (40, 10**6))
    for stage, gas, clip, bucket in cases:
        data = batches(world_size, gas, same_modules=stage == 3)
        # bucket also sets the stage-3 unit size: one unit per leaf module, or one for all
        cfg = config(stage, gas, clip, world_size, bucket=bucket, unit=min(bucket, 60))
        engine, norms = train_engine(cfg, data)
        ref, ref_norms = reference(data, world_size, gas, clip)
        # stage 3: frozen parameters are partitioned too; this rank holds 1/N of them
        frozen_held = sum(p.numel() for p in engine.module.frozen.parameters()) + sum(
            b.param_shard.numel() for b in (engine.frozen.buckets if engine.frozen else [])
        )
        results.append(
            {
                "case": (stage, gas, clip, bucket),
                "frozen_held": frozen_held,
                "param_diff": max_param_diff(engine, ref),
                "norms": norms,
                "ref_norms": ref_norms,
                "frozen_equal": torch.equal(engine.module.frozen.weight, ref.frozen.weight),
                "num_buckets": len(engine.optimizer.buckets),
            }
        )
    return results


def sweep_two_ranks(tmp):
    """Every world-size-2 part of this module in one group: {test's part: this rank's result}."""
    return {
        "fp32": sweep_fp32(2),
        "low_precision": sweep_low_precision(),
        "grad_norm_vs_gas": sweep_grad_norm_vs_gas(),
        "overflow": sweep_overflow(),
        "comm_volume": comm_volume(),
        "stage3_memory": stage3_memory(),
        "gathered_16bit": gathered_and_16bit(tmp),
        "persistence": stage3_persistence(),
        "prefetch": sweep_prefetch(),
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """part -> [rank 0's result, rank 1's result] of sweep_two_ranks."""
    per_rank = run_ranks(sweep_two_ranks, 2, str(tmp_path_factory.mktemp("two_ranks")))
    return {part: [r[part] for r in per_rank] for part in per_rank[0]}


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_fp32_parity(world_size, request):
    if world_size == 2:
        per_rank = request.getfixturevalue("two_ranks")["fp32"]
    else:
        per_rank = run_ranks(sweep_fp32, world_size, world_size)
    for rank_results in per_rank:
        for res in rank_results:
            assert res["param_diff"] <= 1e-6, res
            assert res["frozen_equal"], res
            frozen_numel = HIDDEN * HIDDEN + HIDDEN
            if res["case"][0] == 3:
                # the owned slice of each frozen bucket, padding included
                assert res["frozen_held"] <= -(-frozen_numel // world_size) + 2, res
            else:
                assert res["frozen_held"] == frozen_numel, res
            for got, want in zip(res["norms"], res["ref_norms"]):
                assert got == pytest.approx(want, rel=1e-6, abs=1e-7), res
    # The reported norm is the same on every rank.
    for case in range(len(per_rank[0])):
        assert len({tuple(r[case]["norms"]) for r in per_rank}) == 1
    assert any(res["num_buckets"] > 1 for res in per_rank[0])


def sweep_low_precision():
    """bf16 and fp16 against the fp32 reference (tolerances documented in docs/stages.md)."""
    results = []
    for dtype, stage in itertools.product(("bf16", "fp16"), (0, 1, 2)):
        data = batches(2, 2)
        engine, norms = train_engine(config(stage, 2, 1.0, 2, dtype=dtype), data)
        ref, ref_norms = reference(data, 2, 2, 1.0)
        results.append(
            {
                "case": (dtype, stage),
                "param_diff": max_param_diff(engine, ref),
                "norm_rel": max(abs(a - b) / b for a, b in zip(norms, ref_norms)),
                "param_dtype": str(engine.module.proj.weight.dtype),
                "master_dtype": str(engine.optimizer.buckets[0].master.dtype),
            }
        )
    return results


def test_low_precision_parity(two_ranks):
    for res in two_ranks["low_precision"][0]:
        dtype, _ = res["case"]
        assert res["param_dtype"] == {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[dtype]
        assert res["master_dtype"] == "torch.float32"
        assert res["param_diff"] <= {"bf16": 2e-2, "fp16": 2e-3}[dtype], res
        assert res["norm_rel"] <= {"bf16": 1e-2, "fp16": 2e-3}[dtype], res


def grad_norms_for_split(stage, gas):
    """Same global batch (2 ranks x 4 samples) as gas micro-batches of 4 // gas samples."""
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (2, 4, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (2, 4, SEQ), generator=g)
    cfg = config(stage, gas, 1.0, 2)
    cfg["train_micro_batch_size_per_gpu"] = 4 // gas
    engine, _, _, _ = _engine_for(cfg)
    per = 4 // gas
    for m in range(gas):
        sl = slice(m * per, (m + 1) * per)
        engine.backward(engine(x[engine.rank, sl], y[engine.rank, sl]))
        engine.step()
    return engine.get_global_grad_norm()


def _engine_for(cfg):
    import zero

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2)
    return zero.initialize(model=model, optimizer=opt, config=cfg)


def sweep_grad_norm_vs_gas():
    return {(s, gas): grad_norms_for_split(s, gas) for s in (0, 1, 2) for gas in (1, 2, 4)}


def test_grad_norm_independent_of_gas(two_ranks):
    per_rank = two_ranks["grad_norm_vs_gas"]
    norms = per_rank[0]
    assert per_rank[0] == per_rank[1]
    first = norms[(0, 1)]
    for key, value in norms.items():
        assert value == pytest.approx(first, rel=1e-6), key


def overflow_scenario(stage):
    """fp16: steps 2 and 3 overflow on rank 1 only; hysteresis 2 halves the scale at step 3."""
    import zero

    torch.manual_seed(0)
    cfg = config(stage, 1, 1.0, 2, dtype="fp16")
    cfg["fp16"].update(hysteresis=2, loss_scale_window=1000)
    cfg["scheduler"] = {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": 1e-3,
            "warmup_max_lr": 1e-2,
            "warmup_num_steps": 10,
            "warmup_type": "linear",
        },
    }
    model = Net()
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2)
    engine, optimizer, _, _ = zero.initialize(model=model, optimizer=opt, config=cfg)
    data = batches(2, 1, steps=4)
    log = []
    for step, micro in enumerate(data):
        x, y, use_extra = micro[0][engine.rank]
        params = [p.detach().clone() for p in engine.module.parameters()]
        state = [
            v.clone()
            for s in optimizer.optimizer.state.values()
            for v in s.values()
            if torch.is_tensor(v)
        ]
        loss = engine(x, y, use_extra=use_extra)
        if step in (1, 2) and engine.rank == 1:
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        new_state = [
            v for s in optimizer.optimizer.state.values() for v in s.values() if torch.is_tensor(v)
        ]
        log.append(
            {
                "applied": engine.was_step_applied(),
                "skipped": engine.skipped_steps,
                "scale": engine.loss_scale,
                "lr": engine.get_lr()[0],
                "params_same": all(
                    torch.equal(a, b) for a, b in zip(params, engine.module.parameters())
                ),
                "state_same": len(state) == len(new_state)
                and all(torch.equal(a, b) for a, b in zip(state, new_state)),
            }
        )
    return log


def sweep_overflow():
    return {stage: overflow_scenario(stage) for stage in (0, 1, 2)}


def test_fp16_overflow_skips_step(two_ranks):
    per_rank = two_ranks["overflow"]
    assert per_rank[0] == per_rank[1]
    for stage, log in per_rank[0].items():
        assert [e["applied"] for e in log] == [True, False, False, True], stage
        assert [e["skipped"] for e in log] == [0, 1, 2, 2], stage
        assert log[1]["params_same"] and log[1]["state_same"], stage
        assert log[2]["params_same"] and log[2]["state_same"], stage
        assert not log[0]["params_same"] and not log[3]["params_same"], stage
        # hysteresis 2: the first overflow keeps the scale, the second halves it
        assert [e["scale"] for e in log] == [256.0, 256.0, 128.0, 128.0], stage
        # lr advances only on applied steps (WarmupLR, linear, 10 steps to 1e-2)
        assert log[1]["lr"] == log[0]["lr"] == log[2]["lr"] < log[3]["lr"], stage


def comm_volume():
    """Elements moved in one optimizer step at gradient_accumulation_steps 1 (paper units)."""
    out = {}
    for stage in (0, 1, 2, 3):
        engine, _, _, _ = _engine_for(config(stage, 1, 1.0, 2))
        for micro in batches(2, 1, steps=1, same_modules=True)[0]:
            x, y, use_extra = micro[engine.rank]
            engine.backward(engine(x, y, use_extra=use_extra))
            engine.step()
        layout = engine.optimizer.layout
        units = [
            (u.name, sum(b.layout.padded_numel for b in u.buckets))
            for u in (engine.gatherer.units if engine.gatherer else [])
        ]
        out[stage] = (
            engine.comm_stats(),
            layout.numel,
            layout.padded_numel,
            len(layout.buckets),
            units,
        )
    return out


def test_comm_volume_is_two_psi(two_ranks):
    stats = two_ranks["comm_volume"][0]
    for stage, (ops, numel, padded, num_buckets, units) in stats.items():
        big = {op: t for op, t in ops.items() if t["elements"] > 2}  # drop the 1-element norm sum
        if stage == 3:
            # reduce-scatter once; all-gather before forward and again before backward (3 Psi).
            # `extra` did not run in this step (never gathered); the embedding is gathered for its
            # forward and again when the output layer uses its weight, then stays pinned through
            # backward (no third gather)
            gathers = {"extra": 0}
            expected = sum(gathers.get(name, 2) * size for name, size in units)
            assert big["reduce_scatter"]["elements"] == padded
            assert big["all_gather"]["elements"] == expected, (units, ops)
        elif stage == 0:
            keys = ("calls", "elements", "bytes")
            totals = {op: {k: t[k] for k in keys} for op, t in big.items()}
            assert totals == {
                "all_reduce": {
                    "calls": big["all_reduce"]["calls"],
                    "elements": 2 * padded,
                    "bytes": 8 * padded,
                }
            }
        else:
            assert set(big) == {"reduce_scatter", "all_gather"}, ops
            assert big["reduce_scatter"]["elements"] == padded
            assert big["all_gather"]["elements"] == padded
        # stage 0 needs no padding; otherwise fewer than world-size pad elements per bucket
        assert padded - numel < (1 if stage == 0 else 2 * num_buckets)


def stage3_memory():
    """Stage 3 keeps only shards: after a step every trained parameter is a 0-element
    placeholder, and the parameter bytes held are the owned slices."""
    engine, _, _, _ = _engine_for(config(3, 1, 1.0, 2))
    x, y, use_extra = batches(2, 1, steps=1, same_modules=True)[0][0][engine.rank]
    engine.backward(engine(x, y, use_extra=use_extra))
    engine.step()
    sizes = {n: p.numel() for n, p in engine.module.named_parameters() if p.requires_grad}
    layout = engine.optimizer.layout
    with torch.no_grad():
        engine.eval()
        eval_loss = float(engine(x, y))
        engine.train()
    after_eval = {n: p.numel() for n, p in engine.module.named_parameters() if p.requires_grad}
    return sizes, after_eval, engine.model_state_bytes()["params"], layout.padded_numel, eval_loss


def test_stage3_holds_only_shards(two_ranks):
    for sizes, after_eval, param_bytes, padded, eval_loss in two_ranks["stage3_memory"]:
        assert set(sizes.values()) == {0} and set(after_eval.values()) == {0}
        assert param_bytes == padded // 2 * 4  # fp32, this rank's half of every bucket
        assert math.isfinite(eval_loss)


def gathered_and_16bit(tmp):
    """GatheredParameters reads and modifies (stage 3 and 2); state_dict and save_16bit_model give
    full tensors equal to the masters cast to the compute dtype."""
    import os

    import zero

    out = {}
    for stage in (2, 3):
        cfg = config(stage, 1, 1.0, 2)
        cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
        engine, _, _, _ = _engine_for(cfg)
        weight = engine.module.proj.weight
        with zero.GatheredParameters([weight], modifier_rank=1):
            shape = tuple(weight.shape)
            if engine.rank == 1:
                weight.data[0].fill_(7.0)
        with zero.GatheredParameters(weight):
            row = weight[0].tolist()
        state = engine.module.state_dict()
        path = engine.save_16bit_model(os.path.join(tmp, f"s{stage}"))
        masters = torch.cat([b.master[: b.layout.shard_numel] for b in engine.optimizer.buckets])
        out[stage] = {
            "shape": shape,
            "row": row,
            "state_shapes": {k: tuple(v.shape) for k, v in state.items()},
            "released": engine.module.proj.weight.numel(),
            "path": path,
            "master_has_7": bool((masters == 7.0).any()),
        }
    return out


def test_gathered_parameters_and_16bit_save(two_ranks):
    from safetensors.torch import load_file

    per_rank = two_ranks["gathered_16bit"]
    full = {k: tuple(v.shape) for k, v in Net().state_dict().items()}
    for stage in (2, 3):
        for rank_out in per_rank:
            res = rank_out[stage]
            assert res["shape"] == (HIDDEN, DIM) and res["row"] == [7.0] * DIM
            assert res["state_shapes"] == full
            assert res["released"] == (0 if stage == 3 else HIDDEN * DIM)
        assert any(r[stage]["master_has_7"] for r in per_rank)  # the owner's master changed
        saved = load_file(per_rank[0][stage]["path"])
        model = Net()
        model.load_state_dict(saved, strict=True)
        assert torch.equal(model.proj.weight[0], torch.full((DIM,), 7.0))
        assert per_rank[1][stage]["path"] is None


def stage3_persistence():
    """stage3_param_persistence_threshold 20: the 7-element biases and norm parameters stay
    gathered (one all-gather per step after the update); the rest is partitioned. With
    stage3_model_persistence_threshold 21 only the first three of them in module order
    (proj.bias, the frozen bias, extra.bias) do."""
    results = {}
    for total in (None, 21):
        cfg = config(3, 2, 1.0, 2)
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 20
        if total is not None:
            cfg["zero_optimization"]["stage3_model_persistence_threshold"] = total
        data = batches(2, 2, same_modules=True)
        engine, norms = train_engine(cfg, data)
        sizes = {n: p.numel() for n, p in engine.module.named_parameters() if p.requires_grad}
        ref, ref_norms = reference(data, 2, 2, 1.0)
        results[total] = sizes, max_param_diff(engine, ref), norms, ref_norms
    return results


def test_stage3_persistent_small_parameters(two_ranks):
    small = {
        None: {"proj.bias", "extra.bias", "norm.weight", "norm.bias"},
        21: {"proj.bias", "extra.bias"},
    }
    for results in two_ranks["persistence"]:
        for total, (sizes, diff, norms, ref_norms) in results.items():
            assert {n for n, size in sizes.items() if size > 0} == small[total], sizes
            assert diff <= 1e-6
            assert norms == pytest.approx(ref_norms, rel=1e-6)


def stage3_prefetch(prefetch):
    """Steps 2 and 3 prefetch the units recorded in step 1; results equal no prefetch."""
    cfg = config(3, 1, 1.0, 2)
    cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = prefetch
    data = batches(2, 1, same_modules=True)
    engine, norms = train_engine(cfg, data)
    ref, _ = reference(data, 2, 1, 1.0)
    return engine.gatherer.prefetch_hits, max_param_diff(engine, ref), norms


def sweep_prefetch():
    return {size: stage3_prefetch(size) for size in (0, 60, 10**6)}


def test_stage3_prefetch(two_ranks):
    results = two_ranks["prefetch"][0]
    assert results[0][0] == 0 and results[60][0] > 0 and results[10**6][0] > 0
    for _, diff, norms in results.values():
        assert diff <= 1e-6
        assert norms == results[0][2]  # prefetching changes nothing numerically
