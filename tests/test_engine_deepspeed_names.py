"""DeepSpeed's engine names that scripts and libraries call (the Hugging Face Trainer, accelerate):
the config read as a dict, the consolidated 16-bit state dict, destroy, empty_partition_cache,
allreduce_gradients, tput_timer, the fallthrough to the model, optimizer.overflow, zero_grad and
save_checkpoint(exclude_frozen_parameters=True) with the Trainer's resume. One group of 2 ranks
sweeps stages 2 and 3; the rest runs in one process."""

import glob
import inspect
import json
import os

import pytest
import torch
from distributed import full_params, run_ranks
from parity_model import DIM, VOCAB, Net, batches, config, param_groups
from safetensors import safe_open

import zero
from zero.checkpoint import CheckpointError
from zero.monitor import ThroughputTimer

GAS = 2
FROZEN = ["frozen.weight", "frozen.bias"]


class TiedNet(Net):
    """The parity model with a second name for the embedding (an output head tied to it, as
    language models tie lm_head.weight): state_dict() holds both names."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight


def make_engine(stage, seed=0, train_frozen=False):
    torch.manual_seed(seed)
    model = TiedNet()
    if train_frozen:
        model.frozen.requires_grad_(True)
    cfg = config(stage, GAS, 1.0, 2)
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2}}
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}
    engine, *_ = zero.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    return engine


def train_step(engine, step, rank, deepspeed_calls=False):
    """One optimizer step of GAS micro-batches; with deepspeed_calls, the calls a DeepSpeed
    script may add: empty_partition_cache between forward and backward, allreduce_gradients and
    zero_grad after backward (none may change what is trained)."""
    for micro in step:
        x, y, use_extra = micro[rank]
        loss = engine(x, y, use_extra)
        if deepspeed_calls:
            engine.empty_partition_cache()
        engine.backward(loss)
        if deepspeed_calls:
            engine.allreduce_gradients()
            engine.zero_grad()
        engine.step()


def gathered_state(engine):
    with zero.GatheredParameters(list(engine.module.parameters())):
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def stage_case(root, stage, rank):
    data = batches(2, GAS, steps=2, same_modules=True)
    out = {}
    engine = make_engine(stage)
    twin = make_engine(stage)
    train_step(engine, data[0], rank)
    train_step(twin, data[0], rank, deepspeed_calls=True)
    # Consolidated 16-bit state dict: rank 0 gets the gathered module state, others None.
    out["consolidated"] = engine._zero3_consolidated_16bit_state_dict()
    out["consolidated_alias"] = engine._consolidated_16bit_state_dict()
    out["without_frozen"] = engine._zero3_consolidated_16bit_state_dict(
        exclude_frozen_parameters=True
    )
    out["gathered"] = gathered_state(engine)
    if stage == 3:
        out["units_gathered_after"] = [
            u.name for u in engine.gatherer.units if u.state.name != "SHARDED"
        ]
    # exclude_frozen_parameters: the Trainer's save for peft models, then its resume.
    ckpt = os.path.join(root, f"stage{stage}")
    engine.save_checkpoint(ckpt, exclude_frozen_parameters=True)
    saved = full_params(engine)
    if rank == 0:
        checkpoint = os.path.join(ckpt, "global_step1")
        with open(os.path.join(checkpoint, "meta.json")) as f:
            meta = json.load(f)
        out["meta"] = {k: meta.get(k) for k in ("excluded_frozen", "frozen", "ties")}
        with safe_open(os.path.join(checkpoint, "module.safetensors"), "pt") as f:
            out["module_file"] = sorted(f.keys())
    train_step(engine, data[1], rank)
    train_step(twin, data[1], rank, deepspeed_calls=True)
    out["trained"], out["twin"] = full_params(engine), full_params(twin)
    out["reduced"] = [e.comm_stats()["reduce_scatter"]["elements"] for e in (engine, twin)]
    twin.destroy()

    resumed = make_engine(stage)
    out["found"] = [os.path.basename(p) for p in sorted(glob.glob(f"{ckpt}/global_step*"))]
    path, _ = resumed.load_checkpoint(
        ckpt, load_module_strict=False, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    out["loaded_path"] = os.path.basename(path)
    train_step(resumed, data[1], rank)
    out["resumed"] = full_params(resumed)
    resumed.destroy()

    other = make_engine(stage, seed=1)  # other pretrained values: the frozen ones are kept
    own_frozen = {n: p.clone() for n, p in full_params(other).items() if n in FROZEN}
    other.load_checkpoint(ckpt)  # load_module_strict=True
    out["strict"] = (saved, own_frozen, full_params(other))
    other.destroy()
    if stage == 2:
        trains_frozen = make_engine(stage, train_frozen=True)
        try:
            trains_frozen.load_checkpoint(ckpt, load_module_strict=False)
        except CheckpointError as error:
            out["trained_but_excluded"] = str(error)
        trains_frozen.destroy()

    engine.destroy()
    x, y, use_extra = data[0][0][rank]
    raised = []
    for call in (
        engine.step,
        lambda: engine.backward(torch.zeros(())),
        lambda: engine(x, y, use_extra),
        lambda: engine.save_checkpoint(ckpt),
    ):
        try:
            call()
        except RuntimeError as error:
            raised.append(str(error))
    out["after_destroy"] = raised
    return out


def sweep(root):
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])
    return {stage: stage_case(root, stage, rank) for stage in (2, 3)}


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    return run_ranks(sweep, 2, str(tmp_path_factory.mktemp("names")))


@pytest.mark.parametrize("stage", [2, 3])
def test_consolidated_16bit_state_dict_is_the_gathered_module_state(swept, stage):
    rank0, rank1 = swept[0][stage], swept[1][stage]
    state, expected = rank0["consolidated"], rank0["gathered"]
    assert list(state) == list(expected)  # every state_dict key, in state_dict's order
    for name, value in expected.items():
        assert state[name].device.type == "cpu" and not state[name].requires_grad
        assert state[name].dtype == value.dtype and torch.equal(state[name], value), name
    assert state["head.weight"] is state["embed.weight"]  # tied names share one tensor
    assert list(rank0["consolidated_alias"]) == list(expected)
    assert list(rank0["without_frozen"]) == [n for n in expected if n not in FROZEN]
    assert rank1["consolidated"] is None and rank1["without_frozen"] is None
    if stage == 3:
        assert rank0["units_gathered_after"] == []  # streamed: no unit left gathered


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_calls_after_backward_change_nothing(swept, stage):
    """allreduce_gradients (zero reduced inside backward), zero_grad (between micro-batches)
    and empty_partition_cache (between forward and backward) train exactly the same."""
    for result in (swept[0][stage], swept[1][stage]):
        for name, value in result["trained"].items():
            assert torch.equal(result["twin"][name], value), name
        reduced, reduced_twin = result["reduced"]
        assert reduced == reduced_twin  # no gradient reduced twice


@pytest.mark.parametrize("stage", [2, 3])
def test_exclude_frozen_parameters_round_trip(swept, stage):
    rank0 = swept[0][stage]
    assert rank0["meta"]["excluded_frozen"] == FROZEN and rank0["meta"]["frozen"] == []
    assert not set(FROZEN) & set(rank0["module_file"])
    assert "head.weight" in rank0["meta"]["ties"]
    for result in (swept[0][stage], swept[1][stage]):
        # The Trainer's resume: glob global_step*, then load with its keywords.
        assert result["found"] == ["global_step1"] and result["loaded_path"] == "global_step1"
        for name, value in result["trained"].items():
            assert torch.equal(result["resumed"][name], value), name
        saved, own_frozen, loaded = result["strict"]
        for name, value in loaded.items():
            expected = own_frozen[name] if name in FROZEN else saved[name]
            assert torch.equal(value, expected), name


def test_a_parameter_left_out_as_frozen_that_the_run_trains_is_an_error(swept):
    for result in (swept[0][2], swept[1][2]):
        message = result["trained_but_excluded"]
        assert "frozen.weight" in message and "exclude_frozen_parameters=True" in message


@pytest.mark.parametrize("stage", [2, 3])
def test_destroyed_engine_refuses_training(swept, stage):
    for result in (swept[0][stage], swept[1][stage]):
        raised = result["after_destroy"]
        assert len(raised) == 4 and all("after engine.destroy()" in m for m in raised)


# ----- one process --------------------------------------------------------------------------
class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(5, 3)
        self.b = torch.nn.Linear(3, 1)
        self.config = {"model_type": "tiny"}  # a Hugging Face model's config attribute
        self.checkpointing = False

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).pow(2).mean()

    def gradient_checkpointing_enable(self):
        self.checkpointing = True
        return "enabled"


def tiny_engine(stage=2, gas=1, **extra):
    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        **extra,
    }
    engine, *_ = zero.initialize(model=Tiny(), config=cfg)
    return engine


def test_config_reads_as_deepspeeds_dict():
    engine = tiny_engine(3)
    config = engine.config
    assert config.zero.stage == 3  # still zero's Config
    # The Hugging Face Trainer's read (trainer.py save_model)
    assert config.get("zero_optimization", {}).get("stage", None) == 3
    assert config["train_batch_size"] == 2 and config["gradient_accumulation_steps"] == 1
    assert config["optimizer"]["params"]["lr"] == 1e-2
    assert "zero_optimization" in config and "no_such_block" not in config
    assert config.get("no_such_block", "default") == "default"
    assert "scheduler" not in config  # absent blocks are absent, as in the user's JSON
    assert "train_micro_batch_size_per_gpu" in config.keys()
    with pytest.raises(KeyError):
        config["no_such_block"]
    with pytest.raises(TypeError):
        config["zero_optimization"]["stage"] = 2  # read-only


def test_fallthrough_reaches_the_model_and_hides_no_engine_attribute():
    engine = tiny_engine()
    assert engine.gradient_checkpointing_enable() == "enabled" and engine.module.checkpointing
    assert engine.checkpointing is True  # a plain attribute of the model
    assert engine.config.zero.stage == 2  # the engine's, not the model's `config`
    assert engine.a is engine.module.a  # submodules of the model too
    assert engine.module is not None and engine.optimizer is not engine.module
    assert engine.device == torch.device("cpu")
    with pytest.raises(AttributeError, match="nor has its model"):
        _ = engine.no_such_name
    assert not hasattr(engine, "__array_interface__")  # dunder names never fall through


def test_zero_gather_16bit_weights_and_save_checkpoint_signature():
    assert tiny_engine(3).zero_gather_16bit_weights_on_model_save() is False
    engine = tiny_engine(
        3, zero_optimization={"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}
    )
    assert engine.zero_gather_16bit_weights_on_model_save() is True
    # The Hugging Face Trainer checks the keyword before passing it.
    assert "exclude_frozen_parameters" in inspect.signature(engine.save_checkpoint).parameters


def test_tput_timer_measures_the_engine_steps():
    engine = tiny_engine(gas=2)
    timer = engine.tput_timer
    assert timer.avg_samples_per_sec() == float("-inf")  # nothing timed yet
    for _ in range(5 * 2):
        engine.backward(engine(torch.randn(2, 5)))
        engine.step()
    assert (timer.global_step_count, timer.micro_step_count) == (5, 10)
    # Steps 3-5 are timed (start_step 2): their forward, backward and step calls.
    assert timer.total_elapsed_time > 0
    expected = engine.train_batch_size() / (timer.total_elapsed_time / 3)
    assert timer.avg_samples_per_sec() == pytest.approx(expected)
    timer.update_epoch_count()
    assert (timer.epoch_count, timer.micro_step_count) == (1, 0)
    # A script's own use, with report_speed: one line per steps_per_output optimizer steps.
    lines = []
    own = ThroughputTimer(engine.config.timers.throughput, 8, 0, 2, logging_fn=lines.append)
    for _ in range(4):
        own.start()
        own.stop(global_step=True, report_speed=True)
    assert len(lines) == 2 and "global_step=4" in lines[1] and "avg_samples/s=" in lines[1]
    off = tiny_engine(timers={"throughput": {"enabled": False}})
    off.backward(off(torch.randn(2, 5)))
    off.step()
    assert off.tput_timer.micro_step_count == 0


def test_optimizer_overflow_says_whether_the_step_was_skipped():
    """accelerate's DeepSpeedOptimizerWrapper.step_was_skipped reads optimizer.overflow when the
    optimizer zero.initialize returned has it."""
    engine = tiny_engine(bf16={"enabled": True})
    x = torch.randn(2, 5, dtype=torch.bfloat16)
    engine.backward(engine(x))
    engine.step()
    assert engine.optimizer.overflow is False
    x[0, 0] = float("inf")
    engine.backward(engine(x))
    engine.step()
    assert engine.optimizer.overflow is True and not engine.was_step_applied()
    engine.backward(engine(torch.randn(2, 5, dtype=torch.bfloat16)))
    engine.step()
    assert engine.optimizer.overflow is False


def test_allreduce_gradients_and_zero_grad_errors():
    engine = tiny_engine(1, gas=2)
    with pytest.raises(RuntimeError, match="without engine.backward"):
        engine.allreduce_gradients()
    engine.backward(engine(torch.randn(2, 5)))
    with pytest.raises(TypeError, match="bucket_size"):
        engine.allreduce_gradients(bucket_size=1.5)
    with pytest.raises(ValueError, match="positive"):
        engine.allreduce_gradients(bucket_size=0)
    engine.allreduce_gradients(bucket_size=1000)
    engine.zero_grad()
    engine.step()
    with engine.no_sync():
        engine.backward(engine(torch.randn(2, 5)))
        with pytest.raises(RuntimeError, match="no_sync"):
            engine.allreduce_gradients()


def test_empty_partition_cache_releases_what_is_not_held():
    units = {"stage": 3, "stage3_param_persistence_threshold": 0}
    engine = tiny_engine(3, zero_optimization=dict(units, stage3_module_granularity_threshold=1))
    engine.empty_partition_cache()  # nothing gathered: nothing to do
    engine.module(torch.randn(2, 5))  # keeps nothing, but a held unit must stay
    held = engine.module.a.weight
    with zero.GatheredParameters([held]):
        engine.backward(engine(torch.randn(2, 5)))  # a training forward's units
        engine.step()
        loss = engine(torch.randn(2, 5))
        kept = [u for u in engine.gatherer.units if u.state.name == "GATHERED"]
        assert len(kept) == 2  # `a` is held, `b` kept for backward
        engine.empty_partition_cache()
        assert [u.module for u in engine.gatherer.units if u.state.name == "GATHERED"] == [
            engine.module.a
        ]
        assert held.numel() == 15
        engine.backward(loss)  # b is gathered again for its backward
        engine.step()
    tiny_engine(2).empty_partition_cache()  # stages 0-2: no-op


@pytest.mark.parametrize("stage", [2, 3])
def test_destroy_detaches_the_engine_from_the_model(stage):
    engine = tiny_engine(stage)
    engine.backward(engine(torch.randn(2, 5)))
    engine.step()
    model = engine.module
    engine.destroy()
    engine.destroy()  # idempotent
    for method in (engine.step, lambda: engine(torch.randn(2, 5)), engine.allreduce_gradients):
        with pytest.raises(RuntimeError, match=r"after engine.destroy\(\)"):
            method()
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())
    for module in model.modules():
        assert not module._state_dict_pre_hooks and not module._forward_hooks
    if stage == 2:
        # The model keeps its weights and trains as a plain module, or under a new engine.
        assert not any(m._forward_pre_hooks for m in model.modules())
        model(torch.randn(2, 5)).backward()
        assert model.a.weight.grad is not None
        model.zero_grad()
        again, *_ = zero.initialize(model=model, config=dict(engine.config.to_dict()))
        again.backward(again(torch.randn(2, 5)))
        again.step()
    else:
        with pytest.raises(RuntimeError, match="destroyed"):
            model(torch.randn(2, 5))
        with pytest.raises(ValueError, match="0-element placeholders"):
            zero.initialize(model=model, config=engine.config.to_dict())


def test_left_out_frozen_parameters_are_logged_when_kept(tmp_path, zero_log):
    torch.manual_seed(0)
    model = Tiny()
    model.b.requires_grad_(False)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 1}}}
    engine, *_ = zero.initialize(model=model, config=cfg)
    engine.save_checkpoint(tmp_path, exclude_frozen_parameters=True)
    engine.load_checkpoint(tmp_path)
    assert any("keep this model's current values: ['b.weight', 'b.bias']" in m for m in zero_log)
