"""cpu_adam (compiled) and CPUAdam against torch.optim.Adam / AdamW.

Parity: after STEPS steps with a changing lr, parameters and both moments agree with torch
within 1e-6 relative to the tensor's largest magnitude (elementwise rtol 1e-6 as well, with that
floor for elements that pass through zero, whose own relative error is meaningless).
"""

import copy

import pytest
import torch

from zero.ops import CPUAdam, adam_reference

# The first test to use the cpu_adam_op fixture builds the op (1-3 minutes on 2 cores).
pytestmark = pytest.mark.timeout(900)

SIZES = [0, 1, 7, 15, 16, 17, 1_000_003]
STEPS = 50
TOL = 1e-6


def _lr(step):
    # Changes every step, as a warmup schedule would: the op takes lr per call.
    return 1e-2 * (0.5 + step / STEPS)


def _run_pair(numel, adamw_mode, use_op, weight_decay=0.1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    init = torch.randn(numel, generator=gen)
    ref_param = torch.nn.Parameter(init.clone())
    param = torch.nn.Parameter(init.clone())
    torch_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    ref = torch_cls([ref_param], lr=_lr(0), weight_decay=weight_decay, foreach=False)
    ours = CPUAdam([param], lr=_lr(0), weight_decay=weight_decay, adamw_mode=adamw_mode,
                   use_op=use_op)  # fmt: skip
    for step in range(STEPS):
        grad = torch.randn(numel, generator=gen)
        ref_param.grad, param.grad = grad.clone(), grad.clone()
        for opt in (ref, ours):
            opt.param_groups[0]["lr"] = _lr(step)
            opt.step()
    return ref, ref_param, ours, param


def _assert_close(actual, expected):
    if expected.numel() == 0:
        assert actual.numel() == 0
        return
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=TOL, atol=TOL * scale)
    assert (actual - expected).abs().max().item() <= TOL * scale


@pytest.mark.parametrize("adamw_mode", [False, True], ids=["adam_l2", "adamw"])
@pytest.mark.parametrize("numel", SIZES)
def test_cpu_adam_matches_torch(cpu_adam_op, numel, adamw_mode):
    ref, ref_param, ours, param = _run_pair(numel, adamw_mode, use_op=True)
    assert ours.uses_op
    _assert_close(param.detach(), ref_param.detach())
    for key in ("exp_avg", "exp_avg_sq"):
        _assert_close(ours.state[param][key], ref.state[ref_param][key])
    assert ours.state[param]["step"].item() == STEPS


@pytest.mark.parametrize("adamw_mode", [False, True], ids=["adam_l2", "adamw"])
def test_reference_matches_torch(adamw_mode):
    # The fallback path: pure PyTorch, torch's order of operations.
    _, ref_param, ours, param = _run_pair(1003, adamw_mode, use_op=False)
    assert not ours.uses_op
    _assert_close(param.detach(), ref_param.detach())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", SIZES)
def test_low_precision_copy_equals_cast(cpu_adam_op, numel, dtype):
    gen = torch.Generator().manual_seed(1)
    param = torch.nn.Parameter(torch.randn(numel, generator=gen))
    out = torch.empty(numel, dtype=dtype)
    opt = CPUAdam([param], lr=1e-2, weight_decay=0.1, use_op=True)
    for _ in range(3):
        param.grad = torch.randn(numel, generator=gen)
        opt.step_with_copy({param: out})
        assert torch.equal(out, param.detach().to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_large_low_precision_copy_is_streamed_exactly(cpu_adam_op, dtype):
    # From stream_copy_min_numel elements on, the copy is written with streaming stores, after
    # a scalar head up to the first vector-aligned address of each thread's chunk. An output
    # one element past an aligned address and an odd count cover the head, the vector loop and
    # the tail.
    numel = cpu_adam_op.stream_copy_min_numel + 5
    gen = torch.Generator().manual_seed(3)
    param = torch.nn.Parameter(torch.randn(numel, generator=gen))
    out = torch.empty(numel + 1, dtype=dtype)[1:]
    opt = CPUAdam([param], lr=1e-2, weight_decay=0.1, use_op=True)
    for _ in range(2):
        param.grad = torch.randn(numel, generator=gen)
        opt.step_with_copy({param: out})
        assert torch.equal(out, param.detach().to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_rounding_edges(cpu_adam_op, dtype):
    # lr 0 and no decay leave the parameters as they are, so the copy is the cast of the input:
    # ties (round to even), values that overflow fp16, subnormals, infinities and NaN.
    bits = torch.tensor(
        [0x3F808000, 0x3F818000, 0x3F807FFF, 0x7F7FFFFF, 0x477FF000, 0x00000001, 0x80000000,
         0x7F800000, 0xFF800000, 0x7FC00000, 0x33800000, 0x387FE000, 0x4EFFFFFF],
        dtype=torch.int64,
    )  # fmt: skip
    values = bits.to(torch.int32).view(torch.float32)
    values = torch.cat([values, torch.randn(45) * 1e4])
    param = torch.nn.Parameter(values.clone())
    param.grad = torch.zeros_like(values)
    out = torch.empty(values.numel(), dtype=dtype)
    CPUAdam([param], lr=0.0, use_op=True).step_with_copy({param: out})
    torch.testing.assert_close(out, values.to(dtype), rtol=0, atol=0, equal_nan=True)


def test_state_dict_matches_torch_layout(cpu_adam_op):
    ref, ref_param, ours, param = _run_pair(33, adamw_mode=False, use_op=True)
    ours_sd, ref_sd = ours.state_dict(), ref.state_dict()
    assert ours_sd["state"].keys() == ref_sd["state"].keys()
    for key in ("step", "exp_avg", "exp_avg_sq"):
        assert ours_sd["state"][0][key].dtype == ref_sd["state"][0][key].dtype
    # torch.optim.Adam resumes from CPUAdam's state (hyper-parameters included) and takes the
    # same next step. (torch's AdamW would also need group["decoupled_weight_decay"] = True.)
    resumed_param = torch.nn.Parameter(param.detach().clone())
    resumed = torch.optim.Adam([resumed_param], foreach=False)
    resumed.load_state_dict(copy.deepcopy(ours_sd))  # state_dict() shares the moments
    grad = torch.randn(33)
    resumed_param.grad, param.grad = grad.clone(), grad.clone()
    resumed.step()
    ours.step()
    _assert_close(param.detach(), resumed_param.detach())


def test_param_groups_keep_their_own_hyperparameters(cpu_adam_op):
    params = [torch.nn.Parameter(torch.randn(40)) for _ in range(2)]
    refs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    groups = [{"lr": 1e-2, "weight_decay": 0.0}, {"lr": 3e-3, "betas": (0.8, 0.99)}]
    ours = CPUAdam([dict(g, params=[p]) for g, p in zip(groups, params)], weight_decay=0.05)
    ref = torch.optim.AdamW([dict(g, params=[p]) for g, p in zip(groups, refs)],
                            weight_decay=0.05, foreach=False)  # fmt: skip
    for _ in range(10):
        for p, r in zip(params, refs):
            p.grad = torch.randn(40)
            r.grad = p.grad.clone()
        ours.step()
        ref.step()
    for p, r in zip(params, refs):
        _assert_close(p.detach(), r.detach())


def test_op_and_reference_agree_with_copy(cpu_adam_op):
    # Same signature: the op can be swapped for the reference anywhere.
    gen = torch.Generator().manual_seed(2)
    tensors = [torch.randn(1025, generator=gen) for _ in range(4)]
    op_tensors = [t.clone() for t in tensors]
    ref_out, op_out = (
        torch.empty(1025, dtype=torch.bfloat16),
        torch.empty(1025, dtype=torch.bfloat16),
    )
    tensors[3].abs_()
    op_tensors[3].abs_()
    args = (7, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, False)
    adam_reference(*tensors, *args, ref_out)
    cpu_adam_op.adam_step(*op_tensors, *args, op_out)
    for ours, ref in zip(op_tensors, tensors):
        _assert_close(ours, ref)


def test_traffic_only_step(cpu_adam_op):
    # The benchmark's memory bound: x += scale * grads for params and both moments; scale 0.5
    # keeps every product exact, so the result equals torch's bit for bit.
    gen = torch.Generator().manual_seed(4)
    params, grads, exp_avg, exp_avg_sq = (torch.randn(100_003, generator=gen) for _ in range(4))
    expected = [t + 0.5 * grads for t in (params, exp_avg, exp_avg_sq)]
    cpu_adam_op.traffic_only_step(params, grads, exp_avg, exp_avg_sq, 0.5)
    for actual, wanted in zip((params, exp_avg, exp_avg_sq), expected):
        assert torch.equal(actual, wanted)
    cpu_adam_op.traffic_only_step(params, grads, exp_avg, exp_avg_sq, 0.0)
    for actual, wanted in zip((params, exp_avg, exp_avg_sq), expected):
        assert torch.equal(actual, wanted)


def test_rejects_bad_inputs(cpu_adam_op):
    # Any parameter is accepted at construction (zero.initialize builds the optimizer over the
    # model's bf16 or CUDA parameters, then steps fp32 host shards); stepping one is an error.
    low = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    low.grad = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="float32"):
        CPUAdam([low]).step()
    with pytest.raises(ValueError, match="betas"):
        CPUAdam([torch.nn.Parameter(torch.zeros(4))], betas=(0.9, 1.5))
    param = torch.nn.Parameter(torch.zeros(4))
    param.grad = torch.zeros(4)
    opt = CPUAdam([param])
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        opt.step_with_copy({param: torch.empty(4, dtype=torch.float64)})
    with pytest.raises(ValueError, match="4 elements"):
        opt.step_with_copy({param: torch.empty(5, dtype=torch.bfloat16)})
    with pytest.raises(RuntimeError, match="grads has 3 elements"):
        cpu_adam_op.adam_step(torch.zeros(4), torch.zeros(3), torch.zeros(4), torch.zeros(4),
                              1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True)  # fmt: skip
