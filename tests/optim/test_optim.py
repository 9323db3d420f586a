"""Optimizer registry: DeepSpeed optimizer {type, params} -> torch.optim, and its errors."""

import pytest
import torch

from zero.optim import build_optimizer, resolve_optimizer, supported_optimizer_types


def _params():
    return [torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(2, 3))]


# ---- type mapping -----------------------------------------------------------------------------


def test_adam_is_adamw_with_deepspeed_weight_decay_default():
    opt = build_optimizer("Adam", {"lr": 1e-3}, _params())
    assert type(opt) is torch.optim.AdamW
    # DeepSpeed's default Adam (FusedAdam) has weight_decay 0, not torch AdamW's 0.01.
    assert opt.param_groups[0]["weight_decay"] == 0.0


def test_adam_w_mode_false_is_l2_adam():
    opt = build_optimizer("Adam", {"adam_w_mode": False, "weight_decay": 0.1}, _params())
    assert type(opt) is torch.optim.Adam
    assert opt.param_groups[0]["weight_decay"] == 0.1
    assert not opt.param_groups[0]["decoupled_weight_decay"]


def test_adamw_ignores_adam_w_mode_false_with_warning():
    with pytest.warns(UserWarning, match="adam_w_mode"):
        opt = build_optimizer("AdamW", {"adam_w_mode": False}, _params())
    assert type(opt) is torch.optim.AdamW


def test_torch_adam_keeps_torch_defaults():
    opt = build_optimizer("AdamW", {"torch_adam": True}, _params())
    assert type(opt) is torch.optim.AdamW
    assert opt.param_groups[0]["weight_decay"] == 0.01
    opt = build_optimizer("Adam", {"torch_adam": True, "adam_w_mode": False}, _params())
    assert type(opt) is torch.optim.Adam


@pytest.mark.parametrize(
    "name, cls",
    [
        ("adam", torch.optim.AdamW),
        ("ADAMW", torch.optim.AdamW),
        ("sgd", torch.optim.SGD),
        ("SGD", torch.optim.SGD),
        ("rmsprop", torch.optim.RMSprop),
        ("Adagrad", torch.optim.Adagrad),
        ("Adamax", torch.optim.Adamax),
        ("nadam", torch.optim.NAdam),
    ],
)
def test_case_insensitive_types_and_any_torch_class(name, cls):
    assert type(build_optimizer(name, {}, _params())) is cls


def test_supported_types_lists_torch_classes_but_not_unrunnable_ones():
    names = supported_optimizer_types()
    assert names[:3] == ["Adam", "AdamW", "SGD"]
    assert {"Adagrad", "RMSprop", "Adamax", "RAdam"} <= set(names)
    assert "LBFGS" not in names and "SparseAdam" not in names and "Optimizer" not in names


def test_params_translated():
    opt = build_optimizer(
        "Adam",
        {
            "lr": 2e-4,
            "betas": [0.8, 0.95],
            "eps": 1e-6,
            "bias_correction": True,
            "set_grad_none": True,
        },
        _params(),
    )
    group = opt.param_groups[0]
    assert group["betas"] == (0.8, 0.95) and isinstance(group["betas"], tuple)
    assert group["lr"] == 2e-4 and group["eps"] == 1e-6
    # zero steps a few large flat shards: the fused kernel where torch has one.
    assert group["foreach"] is None and group["fused"] is True


@pytest.mark.parametrize("chosen", [{"foreach": True}, {"foreach": False}, {"fused": False}])
def test_implementation_chosen_in_config_is_kept(chosen):
    group = build_optimizer("AdamW", {"lr": 1e-3, **chosen}, _params()).param_groups[0]
    assert group["fused"] in (None, False) and all(group[k] == v for k, v in chosen.items())


def test_fused_kernel_is_close_to_the_per_tensor_loop():
    """What fused=True changes: the same update within 1 ulp-scale differences after many steps,
    on shards whose length is not a multiple of any vector width."""
    torch.manual_seed(0)
    start = torch.randn(10_007)
    grads = [torch.randn(10_007) for _ in range(20)]
    results = []
    for chosen in ({}, {"foreach": False}):
        param = torch.nn.Parameter(start.clone())
        opt = build_optimizer("AdamW", {"lr": 1e-3, "weight_decay": 0.01, **chosen}, [param])
        for grad in grads:
            param.grad = grad
            opt.step()
        results.append(param.detach())
    assert opt.param_groups[0]["fused"] is None  # the second one was the loop
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=1e-6)


def test_no_fused_kernel_builds_the_default():
    group = build_optimizer("RMSprop", {"lr": 1e-3}, _params()).param_groups[0]
    assert group["foreach"] is None


def test_sgd_params_and_none_params():
    opt = build_optimizer("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True}, _params())
    assert opt.param_groups[0]["momentum"] == 0.9 and opt.param_groups[0]["nesterov"]
    assert type(build_optimizer("SGD", None, _params())) is torch.optim.SGD


def test_param_group_dicts():
    a, b = _params()
    opt = build_optimizer("AdamW", {"lr": 1e-3}, [{"params": [a]}, {"params": [b], "lr": 0.5}])
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 0.5]


def test_resolve_without_params():
    cls, kwargs = resolve_optimizer("adam", {"adam_w_mode": False})
    assert cls is torch.optim.Adam and kwargs == {"weight_decay": 0.0}


def test_adam_step_matches_torch_adamw():
    torch.manual_seed(0)
    ours = torch.nn.Parameter(torch.randn(8))
    ref = torch.nn.Parameter(ours.detach().clone())
    opt = build_optimizer("Adam", {"lr": 0.1, "weight_decay": 0.01}, [ours])
    ref_opt = torch.optim.AdamW([ref], lr=0.1, weight_decay=0.01, fused=True)
    for _ in range(3):
        for p, o in ((ours, opt), (ref, ref_opt)):
            o.zero_grad()
            (p * p).sum().backward()
            o.step()
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)


# ---- errors name the config key ---------------------------------------------------------------


def test_unknown_type_suggests_and_lists():
    with pytest.raises(ValueError) as err:
        build_optimizer("Adm", {}, _params())
    msg = str(err.value)
    assert "unknown optimizer type 'Adm' (config key optimizer.type)" in msg
    assert "Did you mean 'Adam'?" in msg and "Supported: Adam, AdamW, SGD" in msg


def test_unknown_type_case_insensitive_hint():
    with pytest.raises(ValueError, match="Did you mean 'RMSprop'"):
        build_optimizer("rmsprp", {}, _params())


@pytest.mark.parametrize(
    "name", ["Lamb", "OneBitAdam", "onebitlamb", "ZeroOneAdam", "Lion", "MuAdam"]
)
def test_deepspeed_only_types_not_implemented(name):
    with pytest.raises(NotImplementedError, match=f"'{name}'.*optimizer.type"):
        build_optimizer(name, {}, _params())


@pytest.mark.parametrize("name", ["LBFGS", "sparseadam"])
def test_unrunnable_torch_types_not_implemented(name):
    with pytest.raises(NotImplementedError, match=f"'{name}'"):
        build_optimizer(name, {}, _params())


def test_unknown_param_names_key_and_suggests():
    with pytest.raises(ValueError) as err:
        build_optimizer("Adam", {"lrr": 1e-3}, _params())
    assert "optimizer.params.lrr" in str(err.value) and "Did you mean 'lr'?" in str(err.value)


def test_deepspeed_adam_keys_unknown_for_other_types():
    with pytest.raises(ValueError, match="optimizer.params.adam_w_mode"):
        build_optimizer("SGD", {"adam_w_mode": True}, _params())


@pytest.mark.parametrize(
    "params, key",
    [
        ({"lr": "auto"}, "optimizer.params.lr"),
        ({"betas": [0.9]}, "optimizer.params.betas"),
        ({"betas": "0.9,0.99"}, "optimizer.params.betas"),
        ({"amsgrad": "yes"}, "optimizer.params.amsgrad"),
        ({"weight_decay": None}, "optimizer.params.weight_decay"),
        ({"adam_w_mode": 1}, "optimizer.params.adam_w_mode"),
        ({"torch_adam": "true"}, "optimizer.params.torch_adam"),
        ({"bias_correction": False}, "optimizer.params.bias_correction"),
        ({"lr": -1.0}, "optimizer.params.lr"),
        ({"eps": -1.0}, "optimizer.params.eps"),
        ({"max_grad_norm": 1.0}, "gradient_clipping"),
    ],
)
def test_bad_values_name_the_key(params, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        build_optimizer("Adam", params, _params())


def test_bad_type_and_params_containers():
    with pytest.raises(ValueError, match="optimizer.type"):
        build_optimizer(None, {}, _params())
    with pytest.raises(ValueError, match="optimizer.params must be a mapping"):
        build_optimizer("Adam", [("lr", 1.0)], _params())
