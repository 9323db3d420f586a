"""Engine semantics in one process: the DeepSpeed-style loop, its counters and its errors."""

import argparse
import logging

import pytest
import torch

import zero
from zero.optim.precision import LossScaler


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(5, 3)
        self.b = torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).pow(2).mean()


def base_config(**overrides):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 2},
    }
    cfg.update(overrides)
    return cfg


def test_loop_counters_and_boundary():
    engine, optimizer, loader, sched = zero.initialize(model=Tiny(), config=base_config())
    assert type(optimizer.optimizer) is torch.optim.AdamW  # DeepSpeed: "Adam" means AdamW
    assert loader is None and sched is None
    boundaries = []
    for _ in range(4):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(torch.randn(2, 5)))
        engine.step()
    assert boundaries == [False, True, False, True]
    assert engine.global_steps == 2 and engine.global_samples == 8 and engine.skipped_steps == 0
    assert engine.was_step_applied() and engine.get_global_grad_norm() > 0
    assert engine.get_lr() == [1e-2]
    # DeepSpeed's accessors
    assert (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu()) == (4, 2)
    assert engine.gradient_accumulation_steps() == 2 and engine.zero_optimization_stage() == 2
    assert not engine.fp16_enabled() and not engine.bfloat16_enabled()
    assert engine.global_rank == 0 and engine.local_rank == 0


def test_adam_w_mode_false_gives_adam():
    cfg = base_config(optimizer={"type": "Adam", "params": {"lr": 1e-2, "adam_w_mode": False}})
    _, optimizer, _, _ = zero.initialize(model=Tiny(), config=cfg)
    assert type(optimizer.optimizer) is torch.optim.Adam


def test_backward_twice_is_an_error():
    engine, _, _, _ = zero.initialize(model=Tiny(), config=base_config())
    engine.backward(engine(torch.randn(2, 5)))
    with pytest.raises(RuntimeError, match="called twice"):
        engine.backward(engine(torch.randn(2, 5)))


def test_plain_loss_backward_is_an_error_naming_the_parameter():
    engine, _, _, _ = zero.initialize(model=Tiny(), config=base_config())
    with pytest.raises(RuntimeError, match=r"parameter 'b\.(weight|bias)'.*engine.backward"):
        engine(torch.randn(2, 5)).backward()


def test_step_without_backward_is_an_error():
    engine, _, _, _ = zero.initialize(model=Tiny(), config=base_config())
    with pytest.raises(RuntimeError, match="without engine.backward"):
        engine.step()


def test_client_optimizer_keeps_groups_and_scheduler():
    model = Tiny()
    opt = torch.optim.SGD(
        [{"params": model.a.parameters(), "lr": 0.1}, {"params": model.b.parameters()}],
        lr=0.01,
        momentum=0.9,
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    engine, optimizer, _, lr_scheduler = zero.initialize(
        model=model, optimizer=opt, lr_scheduler=sched, config=base_config(optimizer=None)
    )
    assert optimizer.optimizer is opt and lr_scheduler is sched
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.01]
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 5)))
        engine.step()
    assert engine.get_lr() == [0.05, 0.005]


def test_scheduler_callable_and_config_scheduler():
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    engine, _, _, sched = zero.initialize(
        model=model,
        optimizer=opt,
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.5**s),
        config=base_config(optimizer=None, gradient_accumulation_steps=1),
    )
    engine.backward(engine(torch.randn(2, 5)))
    engine.step()
    assert engine.get_lr() == [0.5]
    cfg = base_config(
        scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 4}}
    )
    _, _, _, sched = zero.initialize(model=Tiny(), config=cfg)
    assert type(sched).__name__ == "WarmupLR"


def test_frozen_only_group_and_missing_parameter():
    model = Tiny()
    model.a.requires_grad_(False)
    opt = torch.optim.AdamW(
        [{"params": model.a.parameters()}, {"params": model.b.parameters()}], lr=1e-2
    )
    engine, _, _, _ = zero.initialize(model=model, optimizer=opt, config=base_config())
    before = model.a.weight.detach().clone()
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 5)))
        engine.step()
    assert torch.equal(model.a.weight, before)
    model = Tiny()
    opt = torch.optim.AdamW(model.b.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match=r"a\.weight.*no param group"):
        zero.initialize(model=model, optimizer=opt, config=base_config())


def test_training_data_gives_distributed_loader():
    data = torch.utils.data.TensorDataset(torch.randn(10, 5))
    _, _, loader, _ = zero.initialize(model=Tiny(), training_data=data, config=base_config())
    assert loader.batch_size == 2 and len(loader) == 5


def test_missing_config_errors():
    with pytest.raises(ValueError, match="no config"):
        zero.initialize(model=Tiny())
    # a DeepSpeed-style script: `--deepspeed` given without `--deepspeed_config FILE`
    args = argparse.Namespace(deepspeed=True, deepspeed_config=None, local_rank=-1)
    with pytest.raises(ValueError, match="no config: the command line gave no --deepspeed_conf"):
        zero.initialize(args=args, model=Tiny())
    engine, optimizer, _, _ = zero.initialize(model=Tiny(), config=base_config(optimizer=None))
    assert optimizer is None and engine.inference_only  # ZeRO-Inference


def test_a_parameter_in_two_param_groups_is_named():
    model = Tiny()
    groups = [
        {"params": (p for p in model.parameters())},  # generators are read once, as torch does
        {"params": [model.a.weight], "lr": 0.1},
    ]
    with pytest.raises(ValueError, match="parameter 'a.weight' is in param groups 0 and 1"):
        zero.initialize(model=model, model_parameters=groups, config=base_config())
    groups = [{"params": (p for p in model.parameters() if p is not model.a.weight)}]
    groups.append({"params": [model.a.weight], "lr": 0.1})
    _, optimizer, _, _ = zero.initialize(model=model, model_parameters=groups, config=base_config())
    assert [g["lr"] for g in optimizer.param_groups] == [1e-2, 0.1]


def test_bad_config_fails_before_model_is_touched():
    model = Tiny()
    before = model.a.weight.data_ptr()
    with pytest.raises(zero.ConfigError, match="zero_optimization.stage"):
        zero.initialize(model=model, config=base_config(zero_optimization={"stage": 4}))
    assert model.a.weight.data_ptr() == before


def test_fp16_auto_cast_and_bf16_dtypes():
    seen = {}

    class Probe(Tiny):
        def forward(self, x):
            seen["dtype"] = x.dtype
            return super().forward(x)

    cfg = base_config(fp16={"enabled": True, "auto_cast": True})
    engine, _, _, _ = zero.initialize(model=Probe(), config=cfg)
    engine(torch.randn(2, 5))
    assert seen["dtype"] == torch.float16 and engine.loss_scale == 2.0**16
    engine, _, _, _ = zero.initialize(model=Tiny(), config=base_config(bf16={"enabled": True}))
    assert engine.module.a.weight.dtype == torch.bfloat16


def test_loss_scaler_hysteresis_window_and_minimum():
    s = LossScaler(scale=8.0, dynamic=True, window=2, hysteresis=2, min_scale=2.0)
    s.update(overflow=True)
    assert s.scale == 8.0  # first overflow uses up hysteresis
    s.update(overflow=True)
    assert s.scale == 4.0
    s.update(overflow=True)
    assert s.scale == 2.0
    s.update(overflow=True)  # at the minimum: stays, the step is skipped by the engine
    assert s.scale == 2.0
    s.update(overflow=False)
    s.update(overflow=False)
    assert s.scale == 4.0  # window of 2 clean steps doubles it
    static = LossScaler(scale=128.0)
    static.update(overflow=True)
    assert static.scale == 128.0


def test_stage3_state_dict_needs_gathering_enabled():
    partition_all = {"stage": 3, "stage3_param_persistence_threshold": 0}
    engine, _, _, _ = zero.initialize(
        model=Tiny(), config=base_config(zero_optimization=partition_all)
    )
    assert engine.module.a.weight.numel() == 0  # partitioned between uses
    with pytest.raises(RuntimeError, match="stage3_gather_16bit_weights_on_model_save"):
        engine.module.state_dict()
    with pytest.raises(RuntimeError, match="stage3_gather_16bit_weights_on_model_save"):
        engine.save_16bit_model("unused")
    engine.backward(engine(torch.randn(2, 5)))
    engine.step()
    engine.backward(engine(torch.randn(2, 5)))
    engine.step()
    assert engine.global_steps == 1 and engine.module.a.weight.numel() == 0


def _train_once(model, cfg, optimizer=None):
    engine, *_ = zero.initialize(model=model, config=cfg, optimizer=optimizer)
    torch.manual_seed(3)
    engine.backward(engine(torch.randn(2, 5)))
    engine.step()
    with zero.GatheredParameters(list(engine.module.parameters())):
        return [p.detach().clone() for p in engine.module.parameters()]


@pytest.mark.parametrize("stage", [1, 3])
def test_failed_initialize_leaves_the_model_as_it_found_it(stage):
    """A misspelled scheduler parameter, or an optimizer zero cannot run, fails initialize;
    the model keeps its values, has no hook of zero's, and a corrected retry trains exactly as
    a fresh model does (it failed at the first backward with a misleading message)."""
    cfg = base_config(zero_optimization={"stage": stage}, gradient_accumulation_steps=1)
    torch.manual_seed(0)
    expected = _train_once(Tiny(), cfg)
    bad_scheduler = dict(cfg, scheduler={"type": "WarmupLR", "params": {"warmup_num_step": 3}})
    for build in (
        lambda m: zero.initialize(model=m, config=bad_scheduler),
        lambda m: zero.initialize(model=m, config=cfg, optimizer=torch.optim.LBFGS(m.parameters())),
    ):
        torch.manual_seed(0)
        model = Tiny()
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises((ValueError, NotImplementedError)):
            build(model)
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert not any(p._post_accumulate_grad_hooks for p in model.parameters())
        for module in model.modules():
            assert not module._forward_pre_hooks and not module._state_dict_pre_hooks
        got = _train_once(model, cfg)
        assert all(torch.equal(a, b) for a, b in zip(expected, got))


@pytest.mark.parametrize("check, applied", [(None, False), (True, False), (False, True)])
def test_bf16_check_grad_overflow_skips_non_finite_steps(check, applied):
    """DeepSpeed's bf16.check_grad_overflow (default true) skips a step whose gradients are not
    finite; false applies it."""
    bf16 = {"enabled": True} if check is None else {"enabled": True, "check_grad_overflow": check}
    cfg = base_config(bf16=bf16, gradient_accumulation_steps=1)
    engine, _, _, _ = zero.initialize(model=Tiny(), config=cfg)
    before = engine.module.a.weight.detach().clone()
    x = torch.randn(2, 5, dtype=torch.bfloat16)
    x[0, 0] = float("inf")
    engine.backward(engine(x))
    engine.step()
    assert engine.was_step_applied() is applied
    assert engine.skipped_steps == (0 if applied else 1)
    if not applied:
        assert torch.equal(engine.module.a.weight, before)


def test_deepspeed_leaf_module_block_makes_stage3_fetch_units():
    """zero_optimization.leaf_module (DeepSpeed's): classes, names and name suffixes each make
    a module one fetch unit, as stage3_module_classes does; a name matching nothing is an error."""

    def units(leaf):
        torch.manual_seed(0)
        model = torch.nn.Sequential(Tiny(), Tiny())
        zero_cfg = {
            "stage": 3,
            "stage3_module_granularity_threshold": 1,
            "stage3_param_persistence_threshold": 0,
            "leaf_module": leaf,
        }
        engine, _, _, _ = zero.initialize(
            model=model, config=base_config(zero_optimization=zero_cfg)
        )
        names = {id(m): n for n, m in engine.module.named_modules()}
        return sorted(names[id(u.module)] for u in engine.gatherer.units if not u.persistent)

    assert units({}) == ["0.a", "0.b", "1.a", "1.b"]
    assert units({"classes": ["Tiny"]}) == ["0", "1"]
    # DeepSpeed's form: the fully qualified class name
    assert units({"classes": [f"{Tiny.__module__}.{Tiny.__qualname__}"]}) == ["0", "1"]
    assert units({"classes": "Tiny"}) == ["0", "1"]
    assert units({"names": ["0"]}) == ["0", "1.a", "1.b"]
    assert units({"name_suffixes": ["1"]}) == ["0.a", "0.b", "1"]
    with pytest.raises(ValueError, match="leaf_module.names: no module of Sequential is named 'x'"):
        units({"names": ["x"]})


def test_leaf_module_classes_matching_no_module_warn_as_deepspeed_does(caplog):
    model = torch.nn.Sequential(Tiny(), Tiny())
    zero_cfg = {"stage": 3, "leaf_module": {"classes": ["transformers.models.x.NoSuchBlock"]}}
    with caplog.at_level(logging.WARNING, logger="zero"):
        zero.initialize(model=model, config=base_config(zero_optimization=zero_cfg))
    (record,) = [r for r in caplog.records if "leaf_module.classes" in r.getMessage()]
    assert "NoSuchBlock" in record.getMessage()


def test_optimizer_is_read_as_a_torch_optimizer():
    """The optimizer zero.initialize returns has torch's state / param_groups / state_dict():
    `state` is the real dict keyed by this rank's master shards (DeepSpeed keys its ZeRO
    optimizers' by the flat partitions), and Lightning's teardown loop over it works."""
    cfg = base_config(zero_optimization={"stage": 2}, gradient_accumulation_steps=1)
    engine, optimizer, _, _ = zero.initialize(model=Tiny(), config=cfg)
    assert isinstance(optimizer.state, dict) and len(optimizer.state) == 0
    engine.backward(engine(torch.randn(2, 5)).sum())
    engine.step()
    masters = [p for group in optimizer.param_groups for p in group["params"]]
    assert list(optimizer.state) == masters and optimizer.defaults["lr"] > 0
    for master, per_param in optimizer.state.items():
        assert per_param["exp_avg"].shape == master.shape
    # Lightning's _optimizer_to_device, as it runs at teardown
    for per_param in optimizer.state.values():
        for key, value in per_param.items():
            if key != "step":
                per_param[key] = value.to("cpu")
    saved = optimizer.state_dict()
    optimizer.load_state_dict(saved)
    engine.backward(engine(torch.randn(2, 5)).sum())
    engine.step()  # the state written back is the one the next step reads
    assert engine.global_steps == 2
