"""zero.utils' sharded-state helpers (DeepSpeed's safe_get_full_* / safe_set_full_* / *_local_*)
against a single-process torch reference on the same global batch.

Each world size is spawned once and sweeps its cases (stages 0-3, gradient accumulation, bf16,
fp16 with a loss scale, optimizer offload) inside the group. The model has a tied weight
(embed.weight, used by the embedding and the output projection), a frozen layer, and parameter
sizes that 3 ranks split unevenly (some ranks own none of out.bias or proj.bias).
"""

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks

import zero

VOCAB, DIM, HIDDEN = 11, 6, 7
SEQ, MICRO = 5, 2
LR, BETAS, EPS, DECAY = 1e-2, (0.9, 0.99), 1e-8, 0.1
TRAINED = ("embed.weight", "proj.weight", "proj.bias", "out.weight", "out.bias")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.proj = torch.nn.Linear(DIM, HIDDEN)
        self.frozen = torch.nn.Linear(HIDDEN, HIDDEN)
        self.frozen.requires_grad_(False)
        self.out = torch.nn.Linear(HIDDEN, DIM)

    def forward(self, x, y):
        h = self.frozen(F.gelu(self.proj(self.embed(x))))
        logits = self.out(h) @ self.embed.weight.T  # the tied use of embed.weight
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1))


def batches(world_size, gas, steps, seed=0):
    """batches[step][micro][rank] = (x, y)."""
    g = torch.Generator().manual_seed(seed)

    def sample():
        shape = (MICRO, SEQ)
        return torch.randint(0, VOCAB, shape, generator=g), torch.randint(
            0, VOCAB, shape, generator=g
        )

    return [[[sample() for _ in range(world_size)] for _ in range(gas)] for _ in range(steps)]


def trained(model) -> dict:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def reference():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(
        list(trained(model).values()), lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY
    )
    return model, opt


def reference_backward(model, step, world_size, gas):
    """The gradient of the mean loss over the global batch (every rank, every micro-batch)."""
    for micro in step:
        for x, y in micro:
            (model(x, y) / (world_size * gas)).backward()


def build(stage, gas, dtype, offload):
    import zero

    torch.manual_seed(0)
    model = Net()
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,  # the reference does not clip
        "steps_per_print": 1000,
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 50,  # out.bias+out.weight, proj.bias+proj.weight, embed
            "stage3_module_granularity_threshold": 60,  # each leaf module a unit
            "stage3_param_persistence_threshold": 8,  # the biases stay gathered
        },
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":  # loss scale 256: the gradient getters remove it
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    options = {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": DECAY}
    params = list(trained(model).values())
    if offload:  # the config's AdamW becomes zero.ops.CPUAdam on host masters
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        cfg["optimizer"] = {"type": "AdamW", "params": options}
        engine, *_ = zero.initialize(model=model, model_parameters=params, config=cfg)
    else:
        opt = torch.optim.AdamW(params, **options)
        engine, *_ = zero.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def raises(kind, fn, *args) -> str | None:
    """The message of the `kind` exception fn(*args) raises; None when it raises nothing."""
    try:
        fn(*args)
    except kind as error:
        return str(error)
    return None


def rel(got, want) -> float:
    got, want = got.detach(), want.detach()
    return float(
        (got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12)
    )


def owned_offset(local_numel, numel) -> int:
    """Where this rank's local part starts in the flattened parameter: parts are in rank order;
    every rank owns all of it at stage 0 or world size 1."""
    import torch.distributed as dist

    if local_numel == numel:
        return 0
    sizes = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, local_numel)
    return sum(sizes[: dist.get_rank()])


def train_step(engine, step, errors=None):
    """One optimizer step; with `errors`, what safe_get_full_grad raises before the boundary."""
    from zero import utils

    weight = engine.module.proj.weight
    for index, micro in enumerate(step):
        x, y = micro[engine.rank]
        engine.backward(engine(x, y))
        if index < len(step) - 1:
            if errors is not None:
                errors["grad before the boundary"] = raises(
                    RuntimeError, utils.safe_get_full_grad, weight
                )
                errors["local grad before the boundary"] = raises(
                    RuntimeError, utils.safe_get_local_grad, weight
                )
            engine.step()


def case(stage, gas, dtype="fp32", offload=False):
    """Grads, params and optimizer state against the reference; setters; errors."""
    import zero
    from zero import utils

    engine = build(stage, gas, dtype, offload)
    ref, ref_opt = reference()
    world = engine.world_size
    params, ref_params = trained(engine.module), trained(ref)
    data = batches(world, gas, steps=3)
    errors, diff, local, full = {}, {}, {}, {}
    weight = params["proj.weight"]
    errors["grad before any backward"] = raises(RuntimeError, utils.safe_get_full_grad, weight)
    errors["state before the first step"] = raises(
        KeyError, utils.safe_get_full_optimizer_state, weight, "exp_avg"
    )

    # ----- the boundary micro-batch's reduced gradients --------------------------------------
    train_step(engine, data[0], errors)
    reference_backward(ref, data[0], world, gas)
    full["grad"] = {n: utils.safe_get_full_grad(p) for n, p in params.items()}
    local["grad"] = {n: utils.safe_get_local_grad(p) for n, p in params.items()}
    diff["grad"] = max(rel(full["grad"][n], p.grad) for n, p in ref_params.items())
    engine.step()
    ref_opt.step()
    ref_opt.zero_grad()
    errors["grad after step"] = raises(RuntimeError, utils.safe_get_full_grad, weight)

    # ----- master weights and optimizer state after the step ---------------------------------
    full["param"] = {n: utils.safe_get_full_fp32_param(p) for n, p in params.items()}
    local["param"] = {n: utils.safe_get_local_fp32_param(p) for n, p in params.items()}
    diff["param"] = max(rel(full["param"][n], p) for n, p in ref_params.items())
    for key in ("exp_avg", "exp_avg_sq"):
        full[key] = {n: utils.safe_get_full_optimizer_state(p, key) for n, p in params.items()}
        local[key] = {n: utils.safe_get_local_optimizer_state(p, key) for n, p in params.items()}
        diff[key] = max(rel(full[key][n], ref_opt.state[p][key]) for n, p in ref_params.items())
    step = utils.safe_get_full_optimizer_state(weight, "step")
    diff["step"] = float(step) - float(ref_opt.state[ref.proj.weight]["step"])
    fresh = utils.safe_get_full_fp32_param(weight)
    fresh.add_(1.0)  # a new tensor: zero's master is unchanged
    diff["copy"] = rel(utils.safe_get_full_fp32_param(weight), full["param"]["proj.weight"])

    errors.update(misuse(engine, stage))

    # ----- full setters: every rank passes the same value ------------------------------------
    g = torch.Generator().manual_seed(5)
    value = torch.randn(HIDDEN, DIM, generator=g)
    moment = torch.randn(DIM, HIDDEN, generator=g).abs() * 1e-3
    out_value = torch.randn(DIM, HIDDEN, generator=g)
    utils.safe_set_full_fp32_param(weight, value)
    utils.safe_set_full_optimizer_state(params["out.weight"], moment, "exp_avg")
    if stage == 3:  # the unit is gathered now: the gathered copy changes too
        with zero.GatheredParameters([params["out.weight"]]):
            utils.safe_set_full_fp32_param(params["out.weight"], out_value)
            seen = params["out.weight"].detach().clone()
    else:  # the parameter is a view of zero's flat buffer
        utils.safe_set_full_fp32_param(params["out.weight"], out_value)
        seen = params["out.weight"].detach().clone()
    with torch.no_grad():
        ref.proj.weight.copy_(value)
        ref.out.weight.copy_(out_value)
        ref_opt.state[ref.out.weight]["exp_avg"].copy_(moment)
    diff["set param"] = rel(utils.safe_get_full_fp32_param(weight), value)
    diff["set state"] = rel(
        utils.safe_get_full_optimizer_state(params["out.weight"], "exp_avg"), moment
    )
    diff["seen"] = rel(seen, out_value.to(seen.dtype))  # exact: the compute-dtype cast
    x, y = batches(1, 1, 1, seed=9)[0][0][0]
    with torch.no_grad():
        diff["eval after set"] = rel(engine(x, y), ref(x, y))

    # ----- training continues from the set values ---------------------------------------------
    train_step(engine, data[1])
    engine.step()
    reference_backward(ref, data[1], world, gas)
    ref_opt.step()
    ref_opt.zero_grad()
    diff["param after set"] = max(
        rel(utils.safe_get_full_fp32_param(params[n]), p) for n, p in ref_params.items()
    )
    diff["state after set"] = rel(
        utils.safe_get_full_optimizer_state(params["out.weight"], "exp_avg"),
        ref_opt.state[ref.out.weight]["exp_avg"],
    )

    diff.update(local_setters(engine, stage))
    return {"errors": errors, "diff": diff, "local": local, "full": full}


def misuse(engine, stage) -> dict:
    """Errors: frozen parameter, a parameter of no engine, unknown key, bad values."""
    from zero import utils

    weight = engine.module.proj.weight
    before = utils.safe_get_full_fp32_param(weight)
    errors = {
        "frozen": raises(ValueError, utils.safe_get_full_fp32_param, engine.module.frozen.weight),
        "frozen grad": raises(ValueError, utils.safe_get_full_grad, engine.module.frozen.bias),
        "no engine": raises(
            ValueError, utils.safe_get_full_fp32_param, torch.nn.Parameter(torch.zeros(3))
        ),
        "unknown key": raises(KeyError, utils.safe_get_full_optimizer_state, weight, "momentum"),
        "local unknown key": raises(
            KeyError, utils.safe_get_local_optimizer_state, weight, "momentum"
        ),
        "wrong shape": raises(ValueError, utils.safe_set_full_fp32_param, weight, before.T),
        "scalar state": raises(
            ValueError, utils.safe_set_full_optimizer_state, weight, before, "step"
        ),
        "local wrong numel": raises(
            ValueError, utils.safe_set_local_fp32_param, weight, torch.zeros(HIDDEN * DIM + 1)
        ),
    }
    # a different value on every rank: every rank raises, and nothing is written
    errors["different values"] = raises(
        zero.RankMismatchError, utils.safe_set_full_fp32_param, weight, before + engine.rank
    )
    errors["unchanged"] = torch.equal(utils.safe_get_full_fp32_param(weight), before)
    # ranks asking for different parameters: every rank raises before the all-gather
    params = [p for p in engine.module.parameters() if p.requires_grad]
    errors["different parameters"] = raises(
        zero.RankMismatchError, utils.safe_get_full_fp32_param, params[engine.rank % 2]
    )
    return errors


def local_setters(engine, stage) -> dict:
    """Each rank sets its own part of one value; together they make the full value."""
    import zero
    from zero import utils

    weight, embed = engine.module.proj.weight, engine.module.embed.weight
    g = torch.Generator().manual_seed(7)
    value = torch.randn(HIDDEN, DIM, generator=g).reshape(-1)
    moment = torch.rand(VOCAB, DIM, generator=g).reshape(-1) * 1e-4
    mine = utils.safe_get_local_fp32_param(weight)
    start = owned_offset(mine.numel(), value.numel())
    part = slice(start, start + mine.numel())
    utils.safe_set_local_fp32_param(weight, value[part])
    embed_part = utils.safe_get_local_optimizer_state(embed, "exp_avg_sq")
    start = owned_offset(embed_part.numel(), moment.numel())
    utils.safe_set_local_optimizer_state(
        embed, moment[start : start + embed_part.numel()], "exp_avg_sq"
    )
    got = utils.safe_get_full_fp32_param(weight).reshape(-1)
    if stage == 3:  # the next gather brings every rank's part
        with zero.GatheredParameters([weight]):
            seen, want = weight.detach().reshape(-1).clone(), value
    else:  # until the next step only this rank's own part is in its copy
        seen, want = weight.detach().reshape(-1)[part].clone(), value[part]
    return {
        "local set param": rel(got, value),
        "local set state": rel(
            utils.safe_get_full_optimizer_state(embed, "exp_avg_sq").reshape(-1), moment
        ),
        "local set seen": rel(seen, want.to(seen.dtype)),
    }


CASES = {
    1: [(0, 2), (3, 1)],
    2: [(0, 2), (1, 2), (2, 2), (3, 2), (2, 1, "bf16"), (1, 2, "fp16"), (3, 1, "fp32", True)],
    3: [(0, 1), (1, 1), (2, 1), (3, 1)],
}


def sweep(world_size):
    return {spec: case(*spec) for spec in CASES[world_size]}


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_sharded_state_matches_reference(world_size):
    per_rank = run_ranks(sweep, world_size, world_size)
    for spec in CASES[world_size]:
        results = [r[spec] for r in per_rank]
        low = len(spec) > 2 and spec[2] != "fp32"  # bf16 or fp16 compute
        for res in results:
            check_case(spec, res, world_size, low)
        # every rank gets the same full values; local parts in rank order make up the full
        for kind in ("grad", "param", "exp_avg", "exp_avg_sq"):
            for name in TRAINED:
                want = results[0]["full"][kind][name]
                for res in results[1:]:
                    assert torch.equal(res["full"][kind][name], want), (spec, kind, name)
                parts = [res["local"][kind][name] for res in results]
                if spec[0] == 0:  # every rank owns everything
                    assert all(torch.equal(p, want.reshape(-1)) for p in parts), (spec, name)
                else:
                    assert torch.equal(torch.cat(parts), want.reshape(-1)), (spec, kind, name)
                    if world_size == 3 and spec[0] < 3 and name in ("proj.bias", "out.bias"):
                        assert 0 in [p.numel() for p in parts], (spec, name)


def check_case(spec, res, world_size, low):
    errors, diff = res["errors"], res["diff"]
    tol = 5e-2 if low else 1e-5  # bf16 / fp16: the forward runs in it, the reference in fp32
    for key in ("grad", "exp_avg", "exp_avg_sq", "eval after set", "state after set"):
        assert diff[key] <= tol, (spec, key, diff)
    for key in ("param", "param after set"):
        assert diff[key] <= (2e-2 if low else 1e-5), (spec, key, diff)
    exact = ("step", "copy", "set param", "set state", "seen", "local set param")
    for key in (*exact, "local set state", "local set seen"):
        assert diff[key] == 0, (spec, key, diff)
    for when in ("grad before any backward", "grad after step"):
        assert "gradient accumulation boundary" in errors[when], (spec, when)
    if spec[1] > 1:
        assert "gradient accumulation boundary" in errors["grad before the boundary"]
        assert "gradient accumulation boundary" in errors["local grad before the boundary"]
    assert "has []" in errors["state before the first step"], errors
    assert "frozen" in errors["frozen"] and "GatheredParameters" in errors["frozen"]
    assert "frozen" in errors["frozen grad"]
    if spec[0] == 3:  # stage 3 lays frozen parameters out too, so it knows the name
        assert "'frozen.weight'" in errors["frozen"]
    assert "not trained by any engine" in errors["no engine"]
    for key in ("unknown key", "local unknown key"):
        assert "'momentum'" in errors[key] and "'exp_avg'" in errors[key], errors[key]
    for key in ("wrong shape", "scalar state", "local wrong numel"):
        assert errors[key] is not None, (spec, key)
    assert errors["unchanged"]
    for key in ("different values", "different parameters"):
        if world_size > 1 and (key == "different values" or spec[0] > 0):
            assert "with different arguments" in errors[key], errors
        else:
            assert errors[key] is None, (spec, key)
