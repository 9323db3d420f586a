"""DeepSpeed's free-standing names, each tested for its meaning: get_accelerator (CPU here, CUDA
by construction), the z3 leaf-module setters, VALID_LR_SCHEDULES, FusedAdam on CPU parameters,
and TiledLinear (equal to nn.Linear; at stage 3 on two ranks, trained like it)."""

import types

import pytest
import torch

import zero.accelerator as accel
from tests.distributed import full_params, one_thread, run_ranks
from zero.lr_schedules import SCHEDULERS, VALID_LR_SCHEDULES
from zero.ops import BuildState, FusedAdam, get_builder
from zero.partition.tiling import TiledLinear, TiledLinearReturnBias
from zero.utils import (
    get_z3_leaf_modules,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
)


@pytest.fixture
def fresh_accelerator(monkeypatch):
    """get_accelerator() built anew (it is cached per process), without DS_ACCELERATOR."""
    monkeypatch.setattr(accel, "_accelerator", None)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    return monkeypatch


# ----- get_accelerator ---------------------------------------------------------------------------
def test_cpu_accelerator_agrees_with_zeros_device(fresh_accelerator):
    acc = accel.get_accelerator()
    assert acc is accel.get_accelerator()
    engine_side = accel.detect_accelerator(0)
    assert isinstance(acc, accel.CpuAccelerator) and engine_side.device == torch.device("cpu")
    assert acc.communication_backend_name() == engine_side.backend == "gloo"
    assert acc.device_name() == acc.device_name(1) == acc.current_device_name() == "cpu"
    assert acc.device(0) == engine_side.device and acc.is_available()
    fresh_accelerator.setenv("LOCAL_RANK", "1")
    fresh_accelerator.setenv("LOCAL_WORLD_SIZE", "2")
    assert (acc.current_device(), acc.device_count()) == (1, 2)
    acc.manual_seed(3)
    first = torch.rand(4)
    acc.manual_seed_all(3)
    assert torch.equal(torch.rand(4), first)
    tensor = torch.ones(3)
    assert acc.pin_memory(tensor) is tensor and acc.on_accelerator(tensor)
    assert acc.is_bf16_supported() and torch.float in acc.supported_dtypes()
    held = acc.memory_allocated()
    assert 0 < held <= acc.max_memory_allocated() <= acc.total_memory()
    acc.synchronize()
    acc.empty_cache()
    with acc.stream(acc.current_stream()):
        pass
    assert acc.FloatTensor([1.0]).dtype == torch.float32
    with pytest.raises(AttributeError, match="create_op_builder"):
        acc.create_op_builder("CPUAdamBuilder")


def test_cuda_accelerator_agrees_with_zeros_device_by_construction(fresh_accelerator):
    # torch as a machine with two GPUs of compute capability 8.0 would answer.
    calls = []
    for name, value in {
        "is_available": lambda: True,
        "device_count": lambda: 2,
        "set_device": calls.append,
        "current_device": lambda: 1,
        "get_device_capability": lambda device=None: (8, 0),
        "is_bf16_supported": lambda: True,
        "memory_allocated": lambda device=None: 1024,
    }.items():
        fresh_accelerator.setattr(torch.cuda, name, value)
    acc = accel.get_accelerator()
    engine_side = accel.detect_accelerator(1)
    assert isinstance(acc, accel.CudaAccelerator) and calls == [1]
    assert acc.communication_backend_name() == engine_side.backend == "nccl"
    assert acc.device_name(1) == acc.device_name("1") == str(engine_side.device) == "cuda:1"
    assert acc.device(1) == engine_side.device and acc.device_name() == "cuda"
    assert acc.current_device_name() == "cuda:1" and acc.current_device() == 1
    assert acc.device_count() == 2 and acc.memory_allocated() == 1024
    acc.set_device(0)
    assert calls == [1, 0]
    assert acc.is_fp16_supported() and acc.is_bf16_supported() and acc.is_triton_supported()
    on_gpu = types.SimpleNamespace(device=torch.device("cuda", 0))
    assert acc.on_accelerator(on_gpu) and not acc.on_accelerator(torch.ones(1))
    fresh_accelerator.setattr(torch.cuda, "get_device_capability", lambda device=None: (6, 1))
    assert not acc.is_fp16_supported()
    fresh_accelerator.setenv("DS_ALLOW_DEPRECATED_FP16", "1")
    assert acc.is_fp16_supported()


def test_ds_accelerator_naming_another_device_is_an_error(fresh_accelerator):
    for asked in ("cuda", "xpu"):
        fresh_accelerator.setenv("DS_ACCELERATOR", asked)
        with pytest.raises(ValueError, match=f"DS_ACCELERATOR='{asked}'"):
            accel.get_accelerator()
    fresh_accelerator.setenv("DS_ACCELERATOR", "cpu")
    assert isinstance(accel.get_accelerator(), accel.CpuAccelerator)


# ----- z3 leaf modules ---------------------------------------------------------------------------
class Expert(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)


class Moe(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ModuleList([Expert(), Expert()])
        self.gate = torch.nn.Linear(2, 2)


def test_set_z3_leaf_modules_matches_classes_and_names():
    qualified = f"{Expert.__module__}.{Expert.__qualname__}"
    for classes in ([Expert], ["Expert"], [qualified]):
        model = Moe()
        marked = set_z3_leaf_modules(model, classes)
        assert marked == list(model.experts) == get_z3_leaf_modules(model)
    assert unset_z3_leaf_modules(model, [Expert]) == list(model.experts)
    assert get_z3_leaf_modules(model) == []
    assert set_z3_leaf_modules(model, ["torch.nn.modules.linear.Linear"])[0] is model.experts[0].fc
    assert set_z3_leaf_modules(model, ["Missing"], raise_if_not_found=False) == []
    with pytest.raises(ValueError, match="Missing"):
        set_z3_leaf_modules(model, ["Missing"])
    with pytest.raises(ValueError, match="Missing"):
        unset_z3_leaf_modules(model, ["Missing"])
    with pytest.raises(TypeError, match="list"):
        set_z3_leaf_modules(model, Expert)


def test_set_z3_leaf_modules_by_name_and_suffix():
    model = Moe()
    found, missing = set_z3_leaf_modules_by_name(model, ["experts.1", "nope"], False, False)
    assert (found, missing) == ([model.experts[1]], ["nope"]) and not z3_leaf_module(found[0])
    found, missing = set_z3_leaf_modules_by_name(model, ["experts.1", "nope"], True, False)
    assert z3_leaf_module(model.experts[1]) and get_z3_leaf_modules(model) == found
    with pytest.raises(ValueError, match="nope"):
        set_z3_leaf_modules_by_name(model, ["gate", "nope"])
    assert not z3_leaf_module(model.gate)  # nothing is marked when a name is missing
    found, missing = set_z3_leaf_modules_by_suffix(model, ["fc", "gate", "xyz"], True, False)
    assert found == [model.experts[0].fc, model.experts[1].fc, model.gate] and missing == ["xyz"]
    found, missing = set_z3_leaf_modules_by_suffix(model, ["fc"], flag=False)
    assert missing == [] and not any(z3_leaf_module(m) for m in found)
    with pytest.raises(ValueError, match="xyz"):
        set_z3_leaf_modules_by_suffix(model, ["xyz"])


# ----- VALID_LR_SCHEDULES ------------------------------------------------------------------------
def test_valid_lr_schedules_names_deepspeeds_schedulers():
    assert VALID_LR_SCHEDULES == [
        "LRRangeTest",
        "OneCycle",
        "WarmupLR",
        "WarmupDecayLR",
        "WarmupCosineLR",
    ]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    required = {
        "WarmupDecayLR": {"total_num_steps": 2000},
        "WarmupCosineLR": {"total_num_steps": 2000},
        "OneCycle": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1},
    }
    for name in VALID_LR_SCHEDULES:  # Accelerate's test: type(scheduler).__name__ in the list
        scheduler = SCHEDULERS[name](optimizer, **required.get(name, {}))
        assert type(scheduler).__name__ in VALID_LR_SCHEDULES


# ----- FusedAdam on CPU parameters ---------------------------------------------------------------
def _pair(torch_cls, ours_kwargs, torch_kwargs, steps=20, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(n, generator=gen) for n in (1, 17, 1000)]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    ours = [torch.nn.Parameter(t.clone().to(dtype)) for t in init]
    ref_opt = torch_cls(ref, foreach=False, **torch_kwargs)
    opt = FusedAdam(ours, **ours_kwargs)
    for _ in range(steps):
        for a, b in zip(ref, ours):
            grad = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = grad.clone(), grad.clone().to(dtype)
        ref_opt.step()
        opt.step()
    return ref, ours, opt


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam_l2"])
def test_fused_adam_on_cpu_equals_torch(adam_w_mode):
    torch_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    # the pure-PyTorch CPU path: bitwise
    ref, ours, opt = _pair(torch_cls, dict(hyper, adam_w_mode=adam_w_mode, use_op=False), hyper)
    assert all(torch.equal(a, b) for a, b in zip(ref, ours)) and not opt.uses_op
    assert opt.adam_w_mode == int(adam_w_mode) and ref[0].grad is not None
    # DeepSpeed's positional order: lr, bias_correction, betas, eps, adam_w_mode, weight_decay
    positional = FusedAdam([torch.nn.Parameter(torch.zeros(2))], 1e-2, True, (0.9, 0.99), 1e-8,
                           adam_w_mode, 0.1)  # fmt: skip
    assert positional.defaults["adamw_mode"] is adam_w_mode
    assert (
        positional.defaults["betas"] == (0.9, 0.99) and positional.defaults["weight_decay"] == 0.1
    )
    # the default path, the compiled cpu_adam op (tests/ops builds it; not built here, a first
    # build takes minutes): within 1e-6
    if get_builder("cpu_adam").state() not in (BuildState.CACHED, BuildState.LOADED):
        return
    ref, ours, opt = _pair(torch_cls, dict(hyper, adam_w_mode=adam_w_mode), hyper)
    assert opt.uses_op
    for a, b in zip(ref, ours):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6 * a.abs().max().item())


def test_fused_adam_cpu_options_follow_deepspeed():
    # bias_correction=False: m / (sqrt(v) + eps) with raw moments, one step from zero state
    param = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    param.grad = torch.tensor([0.5, 0.25])
    FusedAdam([param], lr=0.1, bias_correction=False, use_op=False).step()
    m, v = 0.1 * torch.tensor([0.5, 0.25]), 0.001 * torch.tensor([0.5, 0.25]) ** 2
    torch.testing.assert_close(
        param.detach(), torch.tensor([1.0, -2.0]) - 0.1 * m / (v.sqrt() + 1e-8)
    )
    # bf16 CPU parameters (DeepSpeed's kernel takes them): fp32 math, moments in bf16
    ref, ours, opt = _pair(torch.optim.AdamW, dict(lr=1e-2), dict(lr=1e-2, weight_decay=0.0),
                           steps=3, dtype=torch.bfloat16)  # fmt: skip
    for a, b in zip(ref, ours):
        torch.testing.assert_close(b.float(), a, rtol=2e-2, atol=2e-2)
        assert opt.state[b]["exp_avg"].dtype == torch.bfloat16
    with pytest.raises(NotImplementedError, match="amsgrad") as info:
        FusedAdam([torch.nn.Parameter(torch.zeros(1))], amsgrad=True)
    assert isinstance(info.value, RuntimeError)  # what DeepSpeed raises
    with pytest.raises(ValueError, match="disagree"):
        FusedAdam([torch.nn.Parameter(torch.zeros(1))], adam_w_mode=True, adamw_mode=False)


# ----- TiledLinear --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "in_splits, out_splits, bias", [(1, 1, True), (3, 2, True), (4, 5, False), (10, 7, True)]
)
def test_tiled_linear_equals_linear_forward_and_backward(in_splits, out_splits, bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(10, 7, bias=bias)
    tiled = TiledLinear(10, 7, bias=bias, in_splits=in_splits, out_splits=out_splits,
                        init_linear=linear)  # fmt: skip
    assert len(list(tiled.parameters())) == in_splits * out_splits + (out_splits if bias else 0)
    x = torch.randn(3, 4, 10)
    x_tiled = x.clone().requires_grad_()
    x.requires_grad_()
    want, got = linear(x), tiled(x_tiled)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    weights = torch.randn(want.shape)
    (want * weights).sum().backward()
    (got * weights).sum().backward()
    torch.testing.assert_close(x_tiled.grad, x.grad, rtol=1e-6, atol=1e-6)
    for o in range(out_splits):
        rows = slice(tiled.out_parts[o], tiled.out_parts[o + 1])
        for i in range(in_splits):
            tile = tiled.linears[o][i]
            cols = slice(tiled.in_parts[i], tiled.in_parts[i + 1])
            torch.testing.assert_close(tile.weight.grad, linear.weight.grad[rows, cols])
            has_bias = bias and i == in_splits - 1
            assert (tile.bias is not None) == has_bias
            if has_bias:
                torch.testing.assert_close(tile.bias.grad, linear.bias.grad[rows])


def test_tiled_linear_options():
    torch.manual_seed(0)
    linear = torch.nn.Linear(10, 7)
    x = torch.randn(2, 10)
    # DeepSpeed's split points: the longer parts first
    tiled = TiledLinear(10, 7, in_splits=3, out_splits=2, combine_out_splits=False)
    assert (tiled.in_parts, tiled.out_parts) == ([0, 4, 7, 10], [0, 4, 7])
    tiled.copy_params_from(linear)
    parts = tiled(x)
    assert [tuple(p.shape) for p in parts] == [(2, 4), (2, 3)]
    torch.testing.assert_close(torch.cat(parts, -1), linear(x))
    presplit = TiledLinear(10, 7, in_splits=3, input_is_already_split=True, init_linear=linear)
    torch.testing.assert_close(presplit(torch.split(x, [4, 3, 3], -1)), linear(x))
    with pytest.raises(ValueError, match="in_splits=3 input parts, got 2"):
        presplit(torch.split(x, [5, 5], -1))
    double = TiledLinear(10, 7, dtype=torch.float64)  # kwargs reach each tile
    assert double.linears[0][0].weight.dtype == torch.float64
    for bad in (dict(in_splits=0), dict(in_splits=11), dict(out_splits=8)):
        with pytest.raises(ValueError, match="splits"):
            TiledLinear(10, 7, **bad)
    with pytest.raises(ValueError, match="bias"):
        TiledLinear(10, 7, bias=False).copy_params_from(linear)
    with pytest.raises(ValueError, match=r"\(7, 10\)"):
        TiledLinear(10, 7).copy_params_from(torch.nn.Linear(7, 10))


class _BiasReturning(torch.nn.Linear):
    """A Megatron-style layer: returns (x W^T, b) and leaves the bias to the caller."""

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight), self.bias


def test_tiled_linear_return_bias():
    torch.manual_seed(0)
    linear = torch.nn.Linear(6, 4)
    tiled = TiledLinearReturnBias(6, 4, in_splits=2, out_splits=2, linear_cls=_BiasReturning,
                                  init_linear=linear)  # fmt: skip
    x = torch.randn(3, 6)
    out, bias = tiled(x)
    torch.testing.assert_close(out + bias, linear(x))
    torch.testing.assert_close(bias, linear.bias)


# ----- TiledLinear at stage 3 on two ranks -------------------------------------------------------
def _tiled_model(linear):
    return torch.nn.Sequential(TiledLinear(12, 9, in_splits=3, out_splits=2, init_linear=linear))


def _stage3_tiled(steps):
    import torch.distributed as dist

    import zero

    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 0.0,
        "steps_per_print": float("inf"),  # as Accelerate writes it
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    linear = torch.nn.Linear(12, 9)
    torch.manual_seed(100 + rank)  # the tiles' own init differs per rank; rank 0's copy wins
    with zero.Init(config=config):
        model = _tiled_model(None)
    model[0].copy_params_from(linear)  # on zero.Init's partitioned tiles: a collective
    engine, *_ = zero.initialize(model=model, config=config)
    tiles = [t for row in engine.module[0].linears for t in row]
    held = [t.weight.numel() < t.weight.ds_numel for t in tiles]
    for x, y in steps:
        loss = torch.nn.functional.mse_loss(engine(x[rank * 4 : rank * 4 + 4]), y[rank * 4 :][:4])
        engine.backward(loss)
        engine.step()
    return held, full_params(engine)


def test_tiled_linear_trains_at_stage_3_like_linear():
    gen = torch.Generator().manual_seed(1)
    steps = [
        (torch.randn(8, 12, generator=gen), torch.randn(8, 9, generator=gen)) for _ in range(3)
    ]
    held, params = run_ranks(_stage3_tiled, 2, steps)[0]
    assert all(held)  # each tile partitioned on its own: a rank holds part of every tile
    with one_thread():
        torch.manual_seed(0)
        linear = torch.nn.Linear(12, 9)
        reference = _tiled_model(linear)
        optimizer = torch.optim.AdamW(linear.parameters(), lr=1e-2, weight_decay=0.0)
        for x, y in steps:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(linear(x), y).backward()
            optimizer.step()
    reference[0].copy_params_from(linear)
    for name, want in reference.named_parameters():
        torch.testing.assert_close(params[name], want.detach(), rtol=1e-5, atol=1e-6)
