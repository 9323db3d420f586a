"""DeepSpeed's public names, each tested for its meaning: a DeepSpeed-style script under zrun at
stages 0-3, the command-line flags, zero.comm as deepspeed.comm, and the engine methods scripts
call (manual accumulation boundaries, no_sync, partial checkpoint loads, queries)."""

import argparse
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

import zero
from tests.distributed import full_params, run_ranks
from tests.test_engine import Tiny
from zero.launcher.world import find_free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----- a DeepSpeed-style script under zrun ------------------------------------------------
def test_deepspeed_style_script_under_zrun_at_every_stage(tmp_path):
    """examples/deepspeed_style.py (argparse + add_config_arguments + init_distributed +
    initialize(args=..., training_data=...) + save/load_checkpoint with client_state) trains
    equally at stages 0-3 and its resume reproduces the last epoch bitwise."""
    results = {}
    for stage in range(4):
        config = {
            "train_micro_batch_size_per_gpu": 16,
            "gradient_accumulation_steps": 2,
            "gradient_clipping": 1.0,
            "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 2e-2, "weight_decay": 0.1}},
            "scheduler": {
                "type": "WarmupLR",
                "params": {"warmup_max_lr": 2e-2, "warmup_num_steps": 3},
            },
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 300},
        }
        path = tmp_path / f"zero{stage}.json"
        path.write_text(json.dumps(config))
        out = tmp_path / f"results{stage}.json"
        command = [
            *(os.path.join(os.path.dirname(sys.executable), "zrun"), "--num_gpus", "2"),
            *("--master_port", str(find_free_port())),
            os.path.join(REPO, "examples", "deepspeed_style.py"),
            *("--deepspeed", "--zero_config", str(path), "--epochs", "2"),
            *("--save_dir", str(tmp_path / f"ckpt{stage}"), "--results", str(out)),
        ]
        run = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=tmp_path)
        assert run.returncode == 0, run.stdout + run.stderr
        results[stage] = json.loads(out.read_text())
        assert f"stage {stage}, world size 2" in run.stdout
    for stage, result in results.items():
        assert result["again"] == result["losses"][-len(result["again"]) :], stage
        # 512 samples, 2 ranks, micro-batch 16, accumulation 2: 8 steps per epoch, resumed at 8
        assert result["train_batch_size"] == 64 and result["global_steps"] == 16
        assert result["losses"][-1] < 0.8 * result["losses"][0]
        torch.testing.assert_close(result["losses"], results[0]["losses"], rtol=1e-5, atol=0)


# ----- command-line flags and initialize(args=...) -------------------------------------------
def small_config(**overrides):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 1000,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 1},
    }
    cfg.update(overrides)
    return cfg


def test_add_config_arguments_and_initialize_from_args(tmp_path):
    parser = zero.add_config_arguments(argparse.ArgumentParser())
    assert parser.parse_args([]).deepspeed is False
    path = tmp_path / "c.json"
    path.write_text(json.dumps(small_config(gradient_accumulation_steps=3)))
    for flags in (["--deepspeed", "--deepspeed_config", str(path)], ["--zero_config", str(path)]):
        args = parser.parse_args(flags)
        assert args.deepspeed_config == str(path) and args.deepspeed_mpi is False
        engine, *_ = zero.initialize(args=args, model=Tiny())
        assert engine.gradient_accumulation_steps() == 3  # the file's value was read
    # Hugging Face's --deepspeed PATH
    engine, *_ = zero.initialize(args=argparse.Namespace(deepspeed=str(path)), model=Tiny())
    assert engine.gradient_accumulation_steps() == 3
    other = tmp_path / "other.json"
    other.write_text(json.dumps(small_config()))
    both = argparse.Namespace(deepspeed=str(path), deepspeed_config=str(other))
    with pytest.raises(ValueError, match="two configs given"):
        zero.initialize(args=both, model=Tiny())
    with pytest.raises(argparse.ArgumentError):
        zero.add_config_arguments(parser)  # the flags exist already


def test_args_local_rank_must_match_the_launcher(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match="args.local_rank=1 but the launcher"):
        zero.initialize(args=argparse.Namespace(local_rank=1), model=Tiny(), config=small_config())


def test_is_compile_supported_means_torch_compile_runs():
    if not zero.is_compile_supported():
        pytest.skip("torch.compile is not supported on this Python/platform")
    compiled = torch.compile(lambda x: torch.sin(x) * 2, backend="eager")
    x = torch.randn(4)
    assert torch.equal(compiled(x), torch.sin(x) * 2)


def test_comm_before_init_and_init_distributed_without_launcher():
    """Outside a launcher, zero.comm names the fix before initialization, and
    init_distributed() makes a one-rank group (a separate process: the group is global)."""
    code = """
import os
for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
    os.environ.pop(name, None)
import torch
import zero
from zero import comm as dist
assert not dist.is_initialized() and dist.get_local_rank() == 0
try:
    dist.get_rank()
except RuntimeError as error:
    assert "zero.init_distributed()" in str(error), error
else:
    raise AssertionError("get_rank before init did not raise")
try:
    zero.init_distributed(dist_init_required=False)
except RuntimeError as error:
    assert "dist_init_required=False" in str(error)
zero.init_distributed(verbose=False)
zero.init_distributed()  # a second call does nothing
value = torch.ones(3)
dist.all_reduce(value)
assert dist.is_initialized() and (dist.get_rank(), dist.get_world_size()) == (0, 1)
assert value.tolist() == [1.0, 1.0, 1.0]
dist.destroy_process_group()
print("ok")
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr


# ----- zero.comm over two ranks, and the engine's DeepSpeed methods ---------------------------
def comm_on_ranks():
    from zero import comm as dist

    zero.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"rank": rank, "world": world, "local": dist.get_local_rank()}
    out["initialized"] = dist.is_initialized() and zero.comm.is_available()
    value = torch.tensor([rank + 1.0])
    dist.all_reduce(value)
    out["all_reduce"] = value.item()
    value = torch.tensor([rank + 1.0])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    out["all_reduce_max"] = value.item()
    value = torch.tensor([10.0 * (rank + 1)])
    dist.broadcast(value, src=1)
    out["broadcast"] = value.item()
    parts = [torch.zeros(2) for _ in range(world)]
    dist.all_gather(parts, torch.full((2,), float(rank)))
    out["all_gather"] = torch.cat(parts).tolist()
    flat = torch.zeros(2 * world)
    dist.all_gather_into_tensor(flat, torch.full((2,), float(rank)))
    out["all_gather_into_tensor"] = flat.tolist()
    received = torch.zeros(2)
    inputs = [torch.full((2,), float(rank + 10 * r)) for r in range(world)]
    dist.reduce_scatter(received, inputs)
    out["reduce_scatter"] = received.tolist()
    received = torch.zeros(2)
    dist.reduce_scatter_tensor(received, torch.arange(2.0 * world) * (rank + 1))
    out["reduce_scatter_tensor"] = received.tolist()
    dist.barrier()
    out["global_rank_of_1"] = dist.get_global_rank(torch.distributed.group.WORLD, 1)
    value = torch.tensor([rank + 1.0])
    dist.reduce(value, dst=0)
    out["reduce"] = value.item()
    sent = torch.arange(2.0 * world) + 10 * rank
    exchanged = torch.zeros(2 * world)
    dist.all_to_all_single(exchanged, sent)
    out["all_to_all_single"] = exchanged.tolist()
    objects = [{"from": rank}]
    dist.broadcast_object_list(objects, src=1)
    out["broadcast_object_list"] = objects[0]
    out["backend"] = dist.get_backend()
    dist.monitored_barrier()
    # The script's own collectives are not zero's traffic.
    engine, *_ = zero.initialize(model=Tiny(), config=small_config())
    engine.backward(engine(torch.randn(2, 5)))
    engine.step()
    before = {op: vars(t).copy() for op, t in engine.comm.ledger.current.items()}
    dist.all_reduce(torch.ones(100))
    after = {op: vars(t).copy() for op, t in engine.comm.ledger.current.items()}
    out["ledger_unchanged"] = before == after
    return out


def test_zero_comm_as_deepspeed_comm():
    results = run_ranks(comm_on_ranks, 2)
    for rank, out in enumerate(results):
        assert (out["rank"], out["world"], out["local"], out["initialized"]) == (rank, 2, rank, 1)
        assert out["all_reduce"] == 3.0 and out["all_reduce_max"] == 2.0
        assert out["broadcast"] == 20.0
        assert out["all_gather"] == out["all_gather_into_tensor"] == [0.0, 0.0, 1.0, 1.0]
        # rank r receives sum over ranks s of (s + 10 r)
        assert out["reduce_scatter"] == [1.0 + 20 * rank] * 2
        # rank r receives elements 2r, 2r+1 of arange(4) * (1 + 2)
        assert out["reduce_scatter_tensor"] == [3.0 * (2 * rank), 3.0 * (2 * rank + 1)]
        assert out["global_rank_of_1"] == 1 and out["ledger_unchanged"]
        assert out["reduce"] == (3.0 if rank == 0 else rank + 1.0)
        # rank r receives chunk r of every rank s: [2r, 2r+1] + 10 s
        assert out["all_to_all_single"] == [2 * rank, 2 * rank + 1, 2 * rank + 10, 2 * rank + 11]
        assert out["broadcast_object_list"] == {"from": 1} and out["backend"] == "gloo"


class Net(torch.nn.Module):
    """Odd sizes (no world size divides them) and a tied parameter."""

    def __init__(self, dropout=0.0):
        super().__init__()
        self.embed = torch.nn.Linear(7, 11, bias=False)
        self.mid = torch.nn.Linear(11, 11)
        self.head = torch.nn.Linear(11, 7, bias=False)
        self.head.weight = torch.nn.Parameter(self.embed.weight.t().contiguous())
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, x):
        return self.head(self.drop(torch.tanh(self.mid(self.embed(x)))))


def net(dropout=0.0):
    torch.manual_seed(0)
    return Net(dropout)


def data(world, micro_batches, seed=1):
    """(micro_batches, world, 3, 7) inputs and targets; rank r takes [:, r]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(micro_batches, world, 3, 7, generator=g), torch.randn(
        micro_batches, world, 3, 7, generator=g
    )


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def ds_config(stage, gas, optimizer="SGD", **extra):
    params = {"lr": 0.1} if optimizer == "SGD" else {"lr": 1e-2}
    cfg = {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,
        "steps_per_print": 1000,
        "optimizer": {"type": optimizer, "params": params},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 40},
    }
    cfg.update(extra)
    return cfg


def reference_sgd_step(world, x, y, gas, lr=0.1):
    """One SGD step of a single process on the whole global batch: the gradient of the mean over
    ranks of the sum over micro-batches of each micro-batch's mean loss / gas."""
    model = net()
    loss = sum(loss_of(model, x[m, r], y[m, r]) for m in range(len(x)) for r in range(world))
    (loss / (world * gas)).backward()
    norm = torch.sqrt(sum(p.grad.square().sum() for p in model.parameters()))
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return model, float(norm)


def max_diff(engine, model):
    got = full_params(engine)
    return max((got[n] - p.detach()).abs().max().item() for n, p in model.named_parameters())


def engine_methods_on_ranks(tmp):
    zero.init_distributed()
    from zero import comm as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    x, y = data(world, 2)
    for stage in range(4):
        # set_gradient_accumulation_boundary: one step() after both micro-batches equals the
        # counted loop (gradient_accumulation_steps 2) and the single-process reference.
        counted, *_ = zero.initialize(model=net(), config=ds_config(stage, 2))
        manual, *_ = zero.initialize(model=net(), config=ds_config(stage, 2))
        for m in range(2):
            counted.backward(loss_of(counted, x[m, rank], y[m, rank]))
            counted.step()
        manual.set_gradient_accumulation_boundary(False)
        out[f"boundary_before_{stage}"] = manual.is_gradient_accumulation_boundary()
        manual.backward(loss_of(manual, x[0, rank], y[0, rank]))
        manual.set_gradient_accumulation_boundary(True)
        manual.backward(loss_of(manual, x[1, rank], y[1, rank]))
        manual.step()
        reference, norm = reference_sgd_step(world, x, y, gas=2)
        out[f"manual_{stage}"] = max_diff(manual, reference)
        out[f"counted_{stage}"] = max_diff(counted, reference)
        out[f"norm_{stage}"] = (manual.get_global_grad_norm(), norm)
        out[f"steps_{stage}"] = (manual.global_steps, counted.global_steps)
        if stage >= 2:
            try:
                with manual.no_sync():
                    pass
            except RuntimeError as error:
                out[f"no_sync_error_{stage}"] = str(error)
    # no_sync at stages 0 and 1: the backward inside is not reduced; the first one after it
    # reduces the sum (gradient_accumulation_steps 1: each micro-batch's loss counts fully).
    for stage in (0, 1):
        engine, *_ = zero.initialize(model=net(), config=ds_config(stage, 1))
        with engine.no_sync():
            engine.backward(loss_of(engine, x[0, rank], y[0, rank]))
            try:
                engine.step()
            except RuntimeError as error:
                out[f"step_inside_{stage}"] = str(error)
            try:
                with engine.no_sync():
                    pass
            except RuntimeError as error:
                out[f"nested_{stage}"] = str(error)
        try:
            engine.step()  # its gradients were never reduced
        except RuntimeError as error:
            out[f"step_after_{stage}"] = str(error)
        reduced_before = engine.comm.ledger.current.copy()
        engine.backward(loss_of(engine, x[1, rank], y[1, rank]))
        engine.step()
        out[f"no_sync_{stage}"] = max_diff(engine, reference_sgd_step(world, x, y, gas=1)[0])
        out[f"no_sync_reduced_inside_{stage}"] = bool(reduced_before)
        out[f"no_sync_steps_{stage}"] = (engine.global_steps, engine.micro_steps)
    # Queries a script reads, and eval()/train().
    cfg = ds_config(
        2,
        2,
        optimizer="AdamW",
        scheduler={
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 8},
        },
    )
    engine, optimizer, _, scheduler = zero.initialize(model=net(dropout=0.5), config=cfg)
    out["queries"] = {
        "local_rank": engine.local_rank,
        "global_rank": engine.global_rank,
        "world_size": engine.world_size,
        "device": str(engine.device),
        "train_batch_size": engine.train_batch_size(),
        "micro": engine.train_micro_batch_size_per_gpu(),
        "gas": engine.gradient_accumulation_steps(),
        "stage": engine.zero_optimization_stage(),
        "fp16": engine.fp16_enabled(),
        "bf16": engine.bfloat16_enabled(),
        "module_is_model": type(engine.module) is Net,
        "optimizer": optimizer is engine.optimizer,
        "scheduler": scheduler is engine.lr_scheduler and scheduler is not None,
    }
    engine.eval()
    out["eval_modes"] = {m.training for m in engine.module.modules()} | {engine.training}
    with torch.no_grad():
        first, second = engine(x[0, rank]), engine(x[0, rank])
    out["eval_deterministic"] = torch.equal(first, second)
    engine.train()
    out["train_modes"] = {m.training for m in engine.module.modules()} | {engine.training}
    expected = zero.lr_schedules.build_scheduler(
        "WarmupLR", cfg["scheduler"]["params"], torch.optim.SGD([torch.zeros(1)], lr=1.0)
    )
    out["expected_lrs"] = []
    for _ in range(6):
        expected.step()
        out["expected_lrs"].append(expected.get_last_lr()[0])
    lrs = []
    for m in range(12):  # 6 optimizer steps; a checkpoint after the 4th
        engine.backward(loss_of(engine, x[m % 2, rank], y[m % 2, rank]))
        engine.step()
        if m % 2:
            lrs.append(engine.get_lr()[0])
        if m == 7:
            # Partial checkpoint loads (DeepSpeed's flags) return to this point.
            engine.save_checkpoint(tmp, client_state={"note": "four steps"})
            saved = full_params(engine)
            saved_state = {
                k: v.clone() for k, v in optimizer.optimizer.state_dict()["state"][0].items()
            }
    out["lrs"] = lrs
    moved_state = {k: v.clone() for k, v in optimizer.optimizer.state_dict()["state"][0].items()}
    _, client = engine.load_checkpoint(
        tmp, load_optimizer_states=False, load_lr_scheduler_states=False, load_module_only=True
    )
    state_now = optimizer.optimizer.state_dict()["state"][0]
    out["module_only"] = {
        "client": client,
        "weights_restored": all(torch.equal(saved[n], v) for n, v in full_params(engine).items()),
        "optimizer_kept": all(torch.equal(moved_state[k], state_now[k]) for k in moved_state),
        "steps_kept": engine.global_steps,
        "lr_kept": engine.get_lr()[0],
    }
    engine.load_checkpoint(tmp, load_optimizer_states=False)
    state_now = optimizer.optimizer.state_dict()["state"][0]
    out["no_optimizer"] = {
        "optimizer_kept": all(torch.equal(moved_state[k], state_now[k]) for k in moved_state),
        "steps_restored": engine.global_steps,
        "lr_restored": engine.get_lr()[0],
    }
    engine.load_checkpoint(tmp)
    state_now = optimizer.optimizer.state_dict()["state"][0]
    out["full_optimizer_restored"] = all(
        torch.equal(saved_state[k], state_now[k]) for k in saved_state
    )
    return out


def test_engine_methods_mean_what_deepspeed_means(tmp_path):
    results = run_ranks(engine_methods_on_ranks, 2, str(tmp_path / "ckpt"))
    for rank, out in enumerate(results):
        for stage in range(4):
            assert out[f"boundary_before_{stage}"] is False
            assert out[f"manual_{stage}"] < 1e-6 and out[f"counted_{stage}"] < 1e-6, stage
            got, want = out[f"norm_{stage}"]
            assert abs(got - want) < 1e-5 * want
            assert out[f"steps_{stage}"] == (1, 1)
        for stage in (2, 3):
            assert f"cannot run under ZeRO stage {stage}" in out[f"no_sync_error_{stage}"]
        for stage in (0, 1):
            assert out[f"no_sync_{stage}"] < 1e-6, stage
            assert not out[f"no_sync_reduced_inside_{stage}"]  # nothing crossed ranks inside
            assert "inside engine.no_sync()" in out[f"step_inside_{stage}"]
            assert "do not nest" in out[f"nested_{stage}"]
            assert "did not reduce gradients" in out[f"step_after_{stage}"]
            assert out[f"no_sync_steps_{stage}"] == (1, 1)  # the micro-batch inside not counted
        queries = out["queries"]
        assert queries == {
            "local_rank": rank,
            "global_rank": rank,
            "world_size": 2,
            "device": "cpu",
            "train_batch_size": 12,
            "micro": 3,
            "gas": 2,
            "stage": 2,
            "fp16": False,
            "bf16": False,
            "module_is_model": True,
            "optimizer": True,
            "scheduler": True,
        }
        assert out["eval_modes"] == {False} and out["train_modes"] == {True}
        assert out["eval_deterministic"]
        assert out["lrs"] == out["expected_lrs"] and out["lrs"][3] < out["lrs"][5] < 1e-2
        only = out["module_only"]
        assert only["client"] == {"note": "four steps"} and only["weights_restored"]
        assert only["optimizer_kept"] and only["steps_kept"] == 6
        assert only["lr_kept"] == out["lrs"][5]
        partial = out["no_optimizer"]
        assert partial["optimizer_kept"] and partial["steps_restored"] == 4
        assert partial["lr_restored"] == out["lrs"][3]
        assert out["full_optimizer_restored"]


# ----- more of DeepSpeed's surface, in one process -------------------------------------------
def sgd_engine(stage=1, gas=2, **extra):
    torch.manual_seed(0)
    cfg = dict(small_config(gradient_accumulation_steps=gas, gradient_clipping=0.0), **extra)
    cfg["zero_optimization"] = {"stage": stage, "stage3_param_persistence_threshold": 0}
    engine, optimizer, _, _ = zero.initialize(model=Tiny(), config=cfg)
    return engine, optimizer


def test_boundary_none_returns_to_counting_and_other_values_are_refused():
    engine, _ = sgd_engine()
    engine.set_gradient_accumulation_boundary(True)
    assert engine.is_gradient_accumulation_boundary()
    engine.set_gradient_accumulation_boundary(None)  # DeepSpeed's reset: count again
    steps = []
    for _ in range(4):
        engine.backward(engine(torch.randn(2, 5)))
        engine.step()
        steps.append(engine.global_steps)
    assert steps == [0, 1, 1, 2]
    with pytest.raises(TypeError, match="True, False or None"):
        engine.set_gradient_accumulation_boundary(1)


def test_optimizer_zero_grad_between_micro_batches_discards_nothing():
    """The habit `engine.step(); optimizer.zero_grad()` with accumulation: each update still
    uses every micro-batch (it used only the last one)."""
    torch.manual_seed(1)
    batches = [torch.randn(2, 5) for _ in range(4)]
    results = []
    for habit in (False, True):
        for stage in (0, 1, 2, 3):
            engine, optimizer = sgd_engine(stage)
            for x in batches:
                engine.backward(engine(x))
                engine.step()
                if habit:
                    optimizer.zero_grad()
            results.append(list(full_params(engine).values()))
    for got in results[1:]:
        assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(results[0], got))


def test_backward_scale_wrt_gas_and_step_lr_kwargs():
    """backward(scale_wrt_gas=False) leaves out 1/gradient_accumulation_steps; step(lr_kwargs=)
    reaches the scheduler's step (Megatron passes {"increment": n})."""
    x = torch.randn(2, 5)
    scaled, _ = sgd_engine(gas=2)
    unscaled, _ = sgd_engine(gas=2)
    for engine, loss_factor, scale_wrt_gas in ((scaled, 1.0, True), (unscaled, 0.5, False)):
        for _ in range(2):
            engine.backward(engine(x) * loss_factor, scale_wrt_gas=scale_wrt_gas)
            engine.step()
    got, want = full_params(unscaled), full_params(scaled)
    assert all(torch.equal(got[n], want[n]) for n in want)

    class Recorder:
        def __init__(self, optimizer):
            self.calls = []

        def step(self, **kwargs):
            self.calls.append(kwargs)

    torch.manual_seed(0)
    engine, _, _, scheduler = zero.initialize(
        model=Tiny(), config=small_config(), lr_scheduler=lambda o: Recorder(o)
    )
    engine.backward(engine(x))
    engine.step(lr_kwargs={"increment": 4})
    engine.backward(engine(x))
    engine.step()
    assert scheduler.calls == [{"increment": 4}, {}]


def test_auto_resume_from_an_empty_directory_loads_nothing(tmp_path, zero_log):
    engine, _ = sgd_engine()
    assert engine.load_checkpoint(tmp_path / "none_yet") == (None, None)
    assert "nothing was loaded" in zero_log[-1] and "DeepSpeed" not in zero_log[-1]
    with pytest.raises(zero.CheckpointError):
        engine.load_checkpoint(tmp_path / "none_yet", tag="global_step5")  # asked by name


def test_deepspeed_namespaces_and_stage3_full_sizes():
    import zero.ops.adam

    assert zero.zero.Init is zero.Init and zero.zero.GatheredParameters is zero.GatheredParameters
    assert zero.ops.adam.DeepSpeedCPUAdam is zero.ops.CPUAdam
    engine, _ = sgd_engine(stage=3)
    for name, param in engine.module.named_parameters():
        full = dict(Tiny().named_parameters())[name]
        assert param.numel() == 0 and param.ds_numel == full.numel()
        assert param.ds_shape == full.shape == zero.init.full_shape(param)


def test_client_optimizer_or_scheduler_beside_a_config_block_is_said(caplog):
    model = Tiny()
    cfg = small_config(scheduler={"type": "WarmupLR", "params": {}})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # the config says lr 0.1
    with caplog.at_level("WARNING", logger="zero"):
        zero.initialize(model=model, optimizer=optimizer, config=cfg, lr_scheduler=lambda o: None)
    assert "'scheduler' block (WarmupLR) is ignored" in caplog.text
    assert "'optimizer' block, whose params ['lr'] differ from it, is ignored" in caplog.text
    caplog.clear()
    model = Tiny()
    same = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level("WARNING", logger="zero"):
        zero.initialize(model=model, optimizer=same, config=small_config())
    assert "ignored" not in caplog.text


# ----- deepspeed.utils.zero_to_fp32, __version__, logging --------------------------------------
class TiedNet(torch.nn.Module):
    """A tied embedding/output weight, a frozen layer, a buffer and a non-persistent buffer."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.fc = torch.nn.Linear(6, 6)
        self.frozen = torch.nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(0.5))
        self.register_buffer("cache", torch.ones(3), persistent=False)

    def forward(self, x, y):
        h = self.embed(x)
        h = torch.tanh(self.fc(h)) * self.scale + self.frozen(h)
        return torch.nn.functional.cross_entropy(self.head(h).reshape(-1, 11), y.reshape(-1))


def tied_engine(tmp_path, stage=2):
    torch.manual_seed(0)
    cfg = small_config()
    cfg["zero_optimization"] = {"stage": stage}
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2}}
    engine, *_ = zero.initialize(model=TiedNet(), config=cfg)
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        x, y = torch.randint(0, 11, (2, 4), generator=g), torch.randint(0, 11, (2, 4), generator=g)
        engine.backward(engine(x, y))
        engine.step()
    engine.save_checkpoint(tmp_path / "ckpt")
    return engine, x, y


def test_zero_to_fp32_functions_as_deepspeed_utils(tmp_path, zero_log):
    from safetensors.torch import load_file

    from zero.utils.zero_to_fp32 import (
        convert_zero_checkpoint_to_fp32_state_dict,
        get_fp32_state_dict_from_zero_checkpoint,
        load_state_dict_from_zero_checkpoint,
    )

    assert zero.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint is (
        get_fp32_state_dict_from_zero_checkpoint
    )
    engine, x, y = tied_engine(tmp_path)
    ckpt = tmp_path / "ckpt"
    state = get_fp32_state_dict_from_zero_checkpoint(ckpt)
    expected = zero.checkpoint.consolidate(str(ckpt))
    assert state.keys() == expected.keys() >= {"head.weight", "frozen.weight", "scale"}
    for name, value in expected.items():
        assert torch.equal(state[name], value), name
    masters = {
        n: zero.utils.safe_get_full_fp32_param(p)
        for n, p in engine.module.named_parameters()
        if p.requires_grad
    }
    for name, value in masters.items():
        assert torch.equal(state[name], value), name
    by_tag = get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="global_step2")
    assert all(torch.equal(by_tag[k], v) for k, v in state.items())
    lean = get_fp32_state_dict_from_zero_checkpoint(ckpt, exclude_frozen_parameters=True)
    assert set(state) - set(lean) == {"frozen.weight", "frozen.bias"}
    # Into a plain model, checked before any write; the model computes the engine's loss.
    model = TiedNet()
    assert load_state_dict_from_zero_checkpoint(model, ckpt) is model
    assert model.head.weight is model.embed.weight and torch.equal(
        model.fc.weight, state["fc.weight"]
    )
    with torch.no_grad():
        torch.testing.assert_close(model(x, y), engine(x, y))
    other = torch.nn.Linear(6, 6)
    before = other.weight.clone()
    with pytest.raises(zero.CheckpointError, match=r"missing \['bias', 'weight'\]; unexpected"):
        load_state_dict_from_zero_checkpoint(other, ckpt)
    assert torch.equal(other.weight, before)
    with pytest.raises(ValueError, match="'embed.weight' is managed by zero"):
        load_state_dict_from_zero_checkpoint(engine.module, ckpt)
    # Files: one model.safetensors, or shards with model.safetensors.index.json.
    zero_log.clear()
    files = convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "out")
    assert files == ["model.safetensors"] and "not pytorch_model.bin" in "".join(zero_log)
    single = load_file(tmp_path / "out" / "model.safetensors")
    assert single.keys() == state.keys()
    assert all(torch.equal(single[k], v) for k, v in state.items())
    zero_log.clear()
    files = convert_zero_checkpoint_to_fp32_state_dict(
        ckpt,
        tmp_path / "sharded",
        max_shard_size=200,
        safe_serialization=True,
        exclude_frozen_parameters=True,
    )
    assert zero_log == [] and files[-1] == "model.safetensors.index.json" and len(files) > 2
    index = json.loads((tmp_path / "sharded" / files[-1]).read_text())
    assert set(index["weight_map"]) == set(lean)
    for name, file in index["weight_map"].items():
        assert torch.equal(load_file(tmp_path / "sharded" / file)[name], lean[name]), name


def test_version_logger_and_log_dist_without_a_group(monkeypatch):
    import importlib.metadata
    import re

    with open(os.path.join(REPO, "setup.py")) as handle:
        setup = handle.read()
    assert zero.__version__ == re.search(r'version="([^"]+)"', setup).group(1)

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert zero._version() == zero.__version__  # from setup.py
    assert "__version__" in zero.__all__
    assert zero.utils.logger is logging.getLogger("zero")
    assert log_dist_records(ranks_cases=False) == [("INFO", "[Rank -1] no group yet")]


def log_dist_records(ranks_cases=True):
    """The records log_dist sends to zero's logger (INFO and up), with a process group (a
    call on each rank) or without one."""
    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append((record.levelname, record.getMessage()))
    level = zero.utils.logger.level
    zero.utils.logger.addHandler(handler)
    zero.utils.logger.setLevel(logging.INFO)
    try:
        if not ranks_cases:
            zero.utils.log_dist("no group yet")  # no process group: every process logs
            zero.utils.log_dist("debug", ranks=[-1], level=logging.DEBUG)  # below the level
            return records
        zero.init_distributed()
        records.clear()  # its own message
        zero.utils.log_dist("none")
        zero.utils.log_dist("empty", ranks=[])
        zero.utils.log_dist("all", ranks=[-1], level=logging.WARNING)
        zero.utils.log_dist("first", ranks=[0])
        zero.utils.log_dist("second", ranks=[1, 5])
        return records
    finally:
        zero.utils.logger.removeHandler(handler)
        zero.utils.logger.setLevel(level)


def test_log_dist_logs_on_the_listed_ranks():
    results = run_ranks(log_dist_records, 2)
    assert results[0] == [("WARNING", "[Rank 0] all"), ("INFO", "[Rank 0] first")]
    assert results[1] == [("WARNING", "[Rank 1] all"), ("INFO", "[Rank 1] second")]


# ----- deepspeed.zero.register_external_parameter ---------------------------------------------
class UsesSiblingWeight(torch.nn.Module):
    """DeepSpeed's example: layer2's use of layer1.weight is registered on the parent."""

    def __init__(self):
        super().__init__()
        self.layer1 = torch.nn.Linear(5, 5)
        self.layer2 = torch.nn.Linear(5, 1)
        zero.zero.register_external_parameter(self, self.layer1.weight)

    def forward(self, x):
        h = torch.tanh(self.layer1(x))
        return self.layer2(h @ self.layer1.weight).pow(2).mean()


def external_parameter_at_stage3():
    torch.manual_seed(0)
    reference = UsesSiblingWeight()
    cfg = small_config(gradient_clipping=0.0)
    cfg["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": 0}
    torch.manual_seed(0)
    engine, *_ = zero.initialize(model=UsesSiblingWeight(), config=cfg)
    zero.zero.register_external_parameter(engine.module.layer2, engine.module.layer1.weight)
    zero.zero.unregister_external_parameter(engine.module.layer2, engine.module.layer1.weight)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        x = torch.randn(4, 5, generator=g)  # 2 samples per rank
        engine.backward(engine(x[2 * engine.rank : 2 * engine.rank + 2]))
        engine.step()
        reference(x).backward()
        optimizer.step()
        optimizer.zero_grad()
    full = {n: zero.utils.safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}
    return max((full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())


def test_register_external_parameter_checks_and_stage3_gathers_anyway():
    assert run_ranks(external_parameter_at_stage3, 2) == [pytest.approx(0, abs=1e-6)] * 2
    model = UsesSiblingWeight()
    register = zero.zero.register_external_parameter
    unregister = zero.zero.unregister_external_parameter
    register(model, model.layer2.bias)  # a parameter of a submodule
    with pytest.raises(TypeError, match="module must be a torch.nn.Module, not Parameter"):
        register(model.layer1.weight, model.layer1.weight)
    with pytest.raises(TypeError, match="parameter must be a torch.nn.Parameter, not Tensor"):
        register(model, model.layer1.weight * 2)
    with pytest.raises(ValueError, match=r"shape \(5, 5\) is not a parameter of Linear"):
        register(model.layer2, model.layer1.weight)  # a sibling's, before zero.initialize
    with pytest.raises(ValueError, match="not a parameter of UsesSiblingWeight"):
        register(model, torch.nn.Parameter(torch.zeros(2)))
    unregister(model, model.layer2.bias)
    with pytest.raises(ValueError, match="is not registered on UsesSiblingWeight"):
        unregister(model, model.layer2.bias)  # once only
    with pytest.raises(TypeError, match="parameter must be a torch.nn.Parameter"):
        unregister(model, None)
    unregister(model, model.layer1.weight)  # registered by the constructor


# ----- a DeepSpeed checkpoint directory -------------------------------------------------------
def deepspeed_checkpoint(root, files=("mp_rank_00_model_states.pt",)):
    tag = root / "global_step5"
    tag.mkdir(parents=True)
    (root / "latest").write_text("global_step5")
    for name in files:
        (tag / name).write_bytes(b"not a pickle zero may open")
    return tag


def test_deepspeed_checkpoint_is_named_with_the_migration_path(tmp_path, zero_log):
    from zero.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    optim = [f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(5)]
    tag = deepspeed_checkpoint(tmp_path / "ds", ["mp_rank_00_model_states.pt", *optim])
    deepspeed_checkpoint(tmp_path / "ds3", ["zero_pp_rank_0_mp_rank_00_model_states.pt"])
    engine, _ = sgd_engine()
    before = [p.detach().clone() for p in engine.module.parameters()]
    messages = []
    for load in (
        lambda: engine.load_checkpoint(tmp_path / "ds"),
        lambda: engine.load_checkpoint(tmp_path / "ds", tag="global_step5"),
        lambda: engine.load_checkpoint(tmp_path / "ds3"),
        lambda: get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ds"),
        lambda: get_fp32_state_dict_from_zero_checkpoint(tag),  # the tag directory itself
    ):
        with pytest.raises(zero.CheckpointError) as caught:
            load()
        message = str(caught.value)
        messages.append(message)
        assert "is a DeepSpeed checkpoint (" in message, message
        assert "never unpickles .pt files" in message and "zero_to_fp32.py" in message
        assert "model.load_state_dict(...) before zero.initialize" in message
    listed = "(bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt, bf16_zero_pp_rank_1_mp_rank_00"
    assert listed in messages[0] and "states.pt and 3 more)" in messages[0], messages[0]
    assert "(zero_pp_rank_0_mp_rank_00_model_states.pt)" in messages[2], messages[2]
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    assert engine.global_steps == 0
    assert engine.load_checkpoint(tag) == (None, None)  # the tag directory passed as load_dir
    assert "nothing was loaded" in zero_log[-1] and "holds a DeepSpeed checkpoint" in zero_log[-1]
    with pytest.raises(zero.CheckpointError, match="meta.json does not exist: not a zero"):
        engine.load_checkpoint(tmp_path / "ds", tag="other")  # no DeepSpeed files: as before
