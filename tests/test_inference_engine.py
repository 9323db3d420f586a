"""ZeRO-Inference: zero.initialize without an optimizer (no optimizer= and no 'optimizer' block,
or a model none of whose parameters requires grad) builds an engine for forward and evaluation
at stages 0-3, with offload_param cpu and nvme at stage 3, that holds the parameters only.

One spawned 2-rank group sweeps the stages: outputs equal the plain model's bitwise; the bytes
a rank holds are p Psi (stages 0-2) or p Psi/N (stage 3, p = 4 for fp32, 2 for bf16) with no
gradient, master or optimizer-state bytes; backward/step raise naming the missing optimizer;
GatheredParameters, state_dict, _zero3_consolidated_16bit_state_dict, save/load_checkpoint
(a training checkpoint with load_module_only, and the engine's own) work;
safe_get_full_fp32_param raises."""

import pytest
import torch
from distributed import run_ranks

VOCAB, DIM = 16, 8
CASES = [  # (stage, compute dtype, offload_param device)
    (0, "fp32", None),
    (1, "fp32", None),
    (2, "fp32", None),
    (3, "fp32", None),
    (3, "fp32", "cpu"),
    (3, "bf16", "cpu"),
    (3, "fp32", "nvme"),
]


class Net(torch.nn.Module):
    """Embedding, projection, LayerNorm and an output layer tied to the embedding, a buffer."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.proj = torch.nn.Linear(DIM, DIM)
        self.norm = torch.nn.LayerNorm(DIM)
        self.out = torch.nn.Linear(DIM, VOCAB, bias=False)
        self.out.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(1.5))

    def forward(self, ids):
        hidden = self.norm(torch.nn.functional.gelu(self.proj(self.embed(ids))))
        return self.out(hidden) * self.scale


def net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def psi(model) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied weight once


def config(stage: int, dtype: str = "fp32", offload=None, root=None, optimizer=False) -> dict:
    zero_cfg = {"stage": stage}
    if stage == 3:  # really partitioned: no persistent parameters, several buckets
        zero_cfg |= {"stage3_param_persistence_threshold": 0, "reduce_bucket_size": 64}
        zero_cfg["stage3_gather_16bit_weights_on_model_save"] = offload == "cpu"
    if offload == "cpu":
        zero_cfg["offload_param"] = {"device": "cpu"}
    if offload == "nvme":
        zero_cfg["offload_param"] = {
            "device": "nvme",
            "nvme_path": root,
            "buffer_size": 128,
            "max_in_cpu": 0,
        }
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero_cfg}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 0.1}}
    return cfg


def attempt(fn) -> str:
    """The error fn() raises, as 'Type: message' ('' when it returns)."""
    try:
        fn()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return ""


def ids(rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(rank))


def trained_checkpoint(root: str, x: torch.Tensor) -> torch.Tensor:
    """A stage-2 training run of one step saved to root/train; its eval output on `x`."""
    import zero

    engine, *_ = zero.initialize(model=net(), config=config(2, optimizer=True))
    engine.backward(engine(x).float().square().mean())
    engine.step()
    engine.save_checkpoint(f"{root}/train", tag="t")
    with torch.no_grad():
        out = engine.eval()(x)
    engine.close()
    return out


def one_case(root, x, trained_out, stage, dtype, offload) -> dict:
    import zero
    from zero import utils

    dtype_t = torch.bfloat16 if dtype == "bf16" else torch.float32
    cfg = config(stage, dtype, offload, root)
    engine, optimizer, _, scheduler = zero.initialize(model=net(), config=cfg)
    ref = net().to(dtype_t).eval()
    got = {"returned": (optimizer, scheduler), "buckets": len(engine.optimizer.buckets)}
    with torch.no_grad():
        got["equal"] = torch.equal(engine.eval()(x), ref(x))
    got["report"] = engine.memory_report()
    got["state_bytes"] = engine.model_state_bytes()
    got["placeholders"] = {p.numel() for p in engine.module.parameters()}
    got["backward"] = attempt(lambda: engine.backward(engine.train()(x).float().sum()))
    got["step"] = attempt(engine.step)
    got["allreduce"] = attempt(engine.allreduce_gradients)
    got["fp32"] = attempt(lambda: utils.safe_get_full_fp32_param(engine.module.proj.weight))
    with zero.GatheredParameters(list(engine.module.parameters())):
        got["gathered"] = torch.equal(engine.module.proj.weight, ref.proj.weight)
    want = ref.state_dict()
    full = engine._zero3_consolidated_16bit_state_dict()
    got["consolidated"] = full is None or all(torch.equal(full[k], v) for k, v in want.items())
    got["state_dict"] = attempt(lambda: engine.module.state_dict())
    if not got["state_dict"]:
        state = engine.module.state_dict()
        got["state_dict"] = all(torch.equal(state[k], v) for k, v in want.items())
    # a training checkpoint, weights only (DeepSpeed's load_module_only=True)
    engine.load_checkpoint(f"{root}/train", tag="t", load_module_only=True)
    with torch.no_grad():
        out = engine.eval()(x)
    got["loaded_trained"] = torch.equal(out, trained_out) if dtype == "fp32" else True
    tag = f"{stage}-{dtype}-{offload}"
    engine.save_checkpoint(f"{root}/own", tag=tag)
    engine.close()
    fresh, *_ = zero.initialize(model=net(seed=1), config=cfg)
    fresh.load_checkpoint(f"{root}/own", tag=tag)  # load_optimizer_states=True: weights
    with torch.no_grad():
        got["loaded_own"] = torch.equal(fresh.eval()(x), out)
    fresh.close()
    return got


def frozen_left_out(root, x) -> dict:
    """A LoRA-style checkpoint (stage 3, proj frozen, saved with exclude_frozen_parameters)
    loads into an engine without an optimizer whose proj is frozen too: proj keeps its value;
    a model that does not fit is refused before anything changes."""
    import zero

    def frozen_net(seed):
        model = net(seed)
        model.proj.requires_grad_(False)
        return model

    cfg = config(3, optimizer=True)
    engine, *_ = zero.initialize(model=frozen_net(0), config=cfg)
    engine.backward(engine(x).float().square().mean())
    engine.step()
    engine.save_checkpoint(f"{root}/lora", tag="t", exclude_frozen_parameters=True)
    with torch.no_grad():
        want = engine.eval()(x)
    engine.close()
    got = {}
    engine, *_ = zero.initialize(model=frozen_net(0), config=config(3))
    engine.load_checkpoint(f"{root}/lora", tag="t")
    with torch.no_grad():
        got["kept_frozen"] = torch.equal(engine.eval()(x), want)
    engine.close()
    wider = net(0)
    wider.extra = torch.nn.Linear(2, 2)
    engine, *_ = zero.initialize(model=wider, config=config(3))
    with zero.GatheredParameters([wider.extra.weight]):
        before = wider.extra.weight.detach().clone()
    got["misfit"] = attempt(lambda: engine.load_checkpoint(f"{root}/train", tag="t"))
    with zero.GatheredParameters([wider.extra.weight]):
        got["unchanged"] = torch.equal(wider.extra.weight, before)
    engine.load_checkpoint(f"{root}/train", tag="t", load_module_strict=False)
    with torch.no_grad():
        got["not_strict"] = engine.eval()(x).shape == (2, 5, VOCAB)
    return got


def fetch_policy(x) -> dict:
    """stage3_fetch_budget below the whole model (864 bytes in fp32) makes units of at most a
    quarter of the live budget ([Note: memory-aware fetch policy]); one that holds it keeps
    DeepSpeed's values (here one unit, reduce_bucket_size elements); a key set in the config
    wins over the policy."""
    import zero

    got = {}
    for name, extra in (
        ("small", {"stage3_fetch_budget": 512}),
        ("large", {"stage3_fetch_budget": 10**9}),
        ("explicit", {"stage3_fetch_budget": 512, "stage3_max_live_parameters": 5000}),
    ):
        cfg = config(3)
        cfg["zero_optimization"] |= {"reduce_bucket_size": 10**6, **extra}
        engine, *_ = zero.initialize(model=net(), config=cfg)
        fetch = engine.fetch
        with torch.no_grad():
            equal = torch.equal(engine.eval()(x), net().eval()(x))
        units = sorted(u.name for u in engine.gatherer.units)
        got[name] = (
            fetch.unit_numel,
            fetch.prefetch_numel,
            fetch.max_live_numel,
            fetch.max_reuse_numel,
            units,
            equal,
        )
        engine.close()
    return got


def sweep(root):
    import torch.distributed as dist

    x = ids(0)
    trained_out = trained_checkpoint(root, x)
    results = {}
    for case in CASES:
        results[case] = one_case(root, x, trained_out, *case)
    results["frozen_left_out"] = frozen_left_out(root, x)
    results["fetch_policy"] = fetch_policy(x)
    results["world_size"] = dist.get_world_size()
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(sweep, 2, str(tmp_path_factory.mktemp("inference")), timeout=240)


@pytest.mark.parametrize("case", CASES, ids=[f"{s}-{d}-{o}" for s, d, o in CASES])
def test_forward_equals_the_model_and_training_calls_raise(ranks, case):
    for results in ranks:
        got = results[case]
        assert got["returned"] == (None, None), case
        assert got["equal"] and got["gathered"] and got["consolidated"], case
        for method in ("backward", "step", "allreduce"):
            assert got[method].startswith("RuntimeError"), (case, got[method])
            assert "needs an optimizer" in got[method], (case, got[method])
            assert "no 'optimizer' block" in got[method], (case, got[method])
        assert got["fp32"].startswith("ValueError"), (case, got["fp32"])
        stage, _, offload = case
        if stage == 3 and offload != "cpu":  # stage3_gather_16bit_weights_on_model_save off
            assert "stage3_gather_16bit_weights_on_model_save" in got["state_dict"], case
        else:
            assert got["state_dict"] is True, case
        assert got["loaded_trained"] and got["loaded_own"], case


@pytest.mark.parametrize("case", CASES, ids=[f"{s}-{d}-{o}" for s, d, o in CASES])
def test_holds_the_parameters_only(ranks, case):
    stage, dtype, offload = case
    p = 2 if dtype == "bf16" else 4
    numel = psi(net())
    for results in ranks:
        got = results[case]
        report, held = got["report"], got["state_bytes"]
        assert got["buckets"] == 0, case  # no gradient buffer, master or optimizer state
        assert report["trains"] is False and report["psi"] == 0, case
        assert {k: v for k, v in held.items() if k != "frozen_params"} == dict.fromkeys(
            ("params", "grads", "master", "optimizer_state"), 0
        ), (case, held)
        if stage < 3:
            assert held["frozen_params"] == p * numel, (case, held)
            assert report["zero_formula"] == f"{p} Psi", case
            continue
        padded, n = report["frozen_psi"], results["world_size"]
        assert got["placeholders"] == {0}, case  # every parameter partitioned
        assert 0 <= padded - numel < 2 * 8, (case, padded)  # under N per bucket of padding
        assert report["zero_formula"] == f"{p} Psi/N", case
        if offload == "nvme":  # max_in_cpu 0: every shard is in its file
            assert held["frozen_params"] == 0 and report["nvme_bytes"]["params"] > 0, case
            continue
        assert held["frozen_params"] == p * padded // n, (case, held)
        assert report["measured"] == report["formula"], (case, report)
        assert report["offloaded_bytes"] == (held["frozen_params"] if offload else 0), case


def test_checkpoint_fit_and_frozen_parameters_left_out(ranks):
    for results in ranks:
        got = results["frozen_left_out"]
        assert got["kept_frozen"] and got["unchanged"] and got["not_strict"], got
        assert got["misfit"].startswith("CheckpointError"), got["misfit"]
        assert "missing key 'extra.weight'" in got["misfit"], got["misfit"]


# ----- what zero.initialize decides, on one process -------------------------------------------
def test_frozen_model_with_an_optimizer_block_is_built_without_one(zero_log):
    import zero

    model = net().requires_grad_(False)
    engine, optimizer, _, _ = zero.initialize(model=model, config=config(3, optimizer=True))
    assert optimizer is None and engine.inference_only
    assert any("'optimizer' block is not used" in m for m in zero_log)
    error = attempt(lambda: engine.backward(engine(ids(0)).sum()))
    assert "no parameter of Net requires grad" in error and "requires_grad=True" in error
    assert engine.model_state_bytes()["optimizer_state"] == 0


def test_client_optimizer_over_frozen_parameters_is_not_used(zero_log):
    import zero

    model = net().requires_grad_(False)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, optimizer, _, _ = zero.initialize(model=model, optimizer=sgd, config=config(0))
    assert optimizer is None and engine.inference_only
    assert any("optimizer= is not used" in m for m in zero_log)
    assert "needs an optimizer" in attempt(engine.step)


def test_lr_scheduler_without_an_optimizer_is_refused():
    import zero

    error = attempt(
        lambda: zero.initialize(model=net(), lr_scheduler=lambda opt: None, config=config(0))
    )
    assert error.startswith("ValueError") and "lr_scheduler= but no optimizer" in error


def test_a_trainable_model_with_an_optimizer_block_still_trains():
    import zero

    engine, optimizer, _, _ = zero.initialize(model=net(), config=config(2, optimizer=True))
    assert optimizer is engine.optimizer and not engine.inference_only
    engine.backward(engine(ids(0)).float().square().mean())
    engine.step()
    assert engine.model_state_bytes()["optimizer_state"] > 0


def test_fetch_policy_sizes_units_from_the_budget(ranks):
    for got in ranks:
        small, large, explicit = (got["fetch_policy"][k] for k in ("small", "large", "explicit"))
        # live = max(512 bytes / 4, twice the embedding's 128 elements) = 256 elements
        assert small == (64, 128, 256, 0, ["embed", "norm", "proj"], True)
        assert large == (10**6, 50_000_000, 10**9, 10**9, ["<root>"], True)
        assert explicit == (64, 128, 5000, 0, ["embed", "norm", "proj"], True)
