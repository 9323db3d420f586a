"""Sharded checkpoints: resume across world sizes 4 -> 2 -> 3 -> 1 equals an uninterrupted
single-process reference; atomic save; corrupted and mismatched checkpoints; consolidation."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from parity_model import VOCAB, Net, param_groups

import zero
from zero.checkpoint import CheckpointError, consolidate
from zero.lr_schedules import build_scheduler

GLOBAL_BATCH, SEQ, STEPS_PER_RUN = 12, 5, 2
CHAIN = (4, 2, 3, 1)
SCHED = {
    "type": "WarmupLR",
    "params": {
        "warmup_min_lr": 1e-3,
        "warmup_max_lr": 1e-2,
        "warmup_num_steps": 20,
        "warmup_type": "linear",
    },
}


def global_batches(steps):
    g = torch.Generator().manual_seed(7)
    return [
        (
            torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
        )
        for _ in range(steps)
    ]


class SubgroupMPU:
    """A data-parallel group made of the first `size` ranks, no model parallelism (the
    Megatron-style mpu interface)."""

    def __init__(self, group, size, single):
        import torch.distributed as dist

        self.group, self.size, self.rank, self.single = group, size, dist.get_rank(), single

    def get_model_parallel_group(self):
        return self.single

    def get_model_parallel_rank(self):
        return 0

    def get_model_parallel_world_size(self):
        return 1

    def get_data_parallel_group(self):
        return self.group

    def get_data_parallel_rank(self):
        return self.rank

    def get_data_parallel_world_size(self):
        return self.size


def make_engine(
    stage,
    dtype="fp32",
    bucket=40,
    model=None,
    mpu=None,
    opt_cls=torch.optim.AdamW,
    extra=None,
    scheduler=SCHED,
):
    torch.manual_seed(0)
    model = model or Net()
    cfg = {
        "train_batch_size": GLOBAL_BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket},
    }
    if scheduler is not None:
        cfg["scheduler"] = scheduler
    if dtype in ("bf16", "fp16"):
        cfg[dtype] = {"enabled": True}
    cfg.update(extra or {})
    kwargs = {"betas": (0.9, 0.99)} if opt_cls is torch.optim.AdamW else {}
    opt = opt_cls(param_groups(model), lr=1e-2, **kwargs)
    engine, _, _, _ = zero.initialize(model=model, optimizer=opt, config=cfg, mpu=mpu)
    return engine


def train(engine, batches):
    micro = GLOBAL_BATCH // engine.world_size
    rows = slice(engine.rank * micro, (engine.rank + 1) * micro)
    for x, y in batches:
        engine.backward(engine(x[rows], y[rows]))
        engine.step()


def chain(root, cases):
    """On 4 spawned ranks, run the chain's world sizes as data-parallel subgroups of the first
    ranks: each link loads the previous link's checkpoint, trains, and saves."""
    import torch.distributed as dist

    zero.initialize(
        model=Net(),
        config={
            "train_batch_size": GLOBAL_BATCH,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        },
    )
    groups = [dist.new_group(list(range(size))) for size in CHAIN]
    singles = [dist.new_group([rank]) for rank in range(max(CHAIN))]
    single = singles[dist.get_rank()]
    links = []
    for index, size in enumerate(CHAIN):
        if dist.get_rank() < size:
            links.append(chain_link(root, index, cases, SubgroupMPU(groups[index], size, single)))
        dist.barrier()
    return links, tag_mismatch(root)


def tag_mismatch(root):
    """Ranks passing different tags: Fail raises on every rank, Warn saves under rank 0's tag."""
    engine = make_engine(2, extra={"checkpoint": {"tag_validation": "Fail"}})
    try:
        engine.save_checkpoint(os.path.join(root, "tags"), tag=f"T{engine.rank}")
        failed = None
    except CheckpointError as error:
        failed = str(error)
    engine = make_engine(2)
    saved = engine.save_checkpoint(os.path.join(root, "tags"), tag=f"T{engine.rank}")
    return failed, os.path.basename(saved)


def chain_link(root, index, cases, mpu):
    batches = global_batches(STEPS_PER_RUN * len(CHAIN))
    out = {}
    for stage, dtype in cases:
        save_dir = os.path.join(root, f"stage{stage}-{dtype}")
        engine = make_engine(stage, dtype, bucket=40 if index % 2 else 10**6, mpu=mpu)
        client = {"link": index}
        if index > 0:
            scramble_frozen(engine)  # the checkpoint must restore them
            _, client = engine.load_checkpoint(save_dir)
            assert client == {"link": index - 1, "note": "x"}
        train(engine, batches[index * STEPS_PER_RUN : (index + 1) * STEPS_PER_RUN])
        engine.save_checkpoint(save_dir, client_state={"link": index, "note": "x"})
        out[(stage, dtype)] = {
            "global_steps": engine.global_steps,
            "lr": engine.get_lr(),
            "masters": [b.master[: b.layout.shard_numel].clone() for b in engine.optimizer.buckets],
        }
    return out


def scramble_frozen(engine):
    """Overwrite the frozen layer: its full tensors, or (stage 3) this rank's shards of them."""
    with torch.no_grad():
        for param in engine.module.frozen.parameters():
            param.fill_(7.0)  # 0 elements under stage 3
        for bucket in engine.frozen.buckets if engine.frozen is not None else []:
            bucket.param_shard.fill_(7.0)


def reference_run(steps):
    """Uninterrupted single-process torch reference on the same global batches."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2, betas=(0.9, 0.99))
    sched = build_scheduler(SCHED["type"], SCHED["params"], opt)
    for x, y in global_batches(steps):
        model(x, y).backward()
        trainable = [p for p in model.parameters() if p.requires_grad]
        for p in trainable:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


CASES = [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (2, "bf16")]


@pytest.fixture(scope="module")
def chained(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("chain"))
    results = run_ranks(chain, max(CHAIN), root, CASES, timeout=300)
    for _, (failed, saved) in results:
        assert "different checkpoint tags" in (failed or "") and saved == "T0"
    return root, results[0][0]


def test_resume_across_world_sizes_matches_uninterrupted_run(chained):
    root, links = chained
    steps = STEPS_PER_RUN * len(CHAIN)
    ref, ref_opt = reference_run(steps)
    # WarmupLR continued: lr equals an uninterrupted schedule after `steps` steps.
    warm = SCHED["params"]
    expected_lr = 1e-3 + (warm["warmup_max_lr"] - 1e-3) * (steps - 1) / warm["warmup_num_steps"]
    for stage, dtype in CASES:
        last = links[-1][(stage, dtype)]
        assert last["global_steps"] == steps
        assert last["lr"][0] == pytest.approx(expected_lr, rel=1e-9)
        if dtype != "fp32":
            continue
        save_dir = os.path.join(root, f"stage{stage}-{dtype}")
        weights = consolidate(save_dir)
        ref_state = ref.state_dict()
        assert set(weights) == set(ref_state)
        for name, value in ref_state.items():
            assert torch.allclose(weights[name], value, rtol=0, atol=1e-6), (stage, name)
        names = {id(p): n for n, p in ref.named_parameters()}
        for kind in ("exp_avg", "exp_avg_sq"):
            moments = consolidate(save_dir, state=kind)
            for param, state in ref_opt.state.items():
                if param.numel() == 0:
                    continue
                got = moments[names[id(param)]]
                assert torch.allclose(got, state[kind], rtol=0, atol=1e-6), (stage, kind)
        tag = Path(save_dir, "latest").read_text()
        meta = json.loads(Path(save_dir, tag, "meta.json").read_text())
        assert meta["scalar_state"]["0"]["step"]["value"] == steps  # Adam step counts


def test_bf16_resume_restores_masters_bitwise(chained):
    root, links = chained
    # masters saved by a link equal the consolidated checkpoint of that link bitwise
    weights = consolidate(os.path.join(root, "stage2-bf16"))
    ref = Net()
    ref.load_state_dict(weights, strict=True)  # every key, tied names included
    assert torch.equal(weights["embed.weight"], ref.embed.weight)


def test_consolidated_state_loads_strict_with_ties_and_frozen(chained, tmp_path, capsys):
    from zero import zero_to_fp32

    root, _ = chained
    out = tmp_path / "model.safetensors"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "zero.zero_to_fp32",
            os.path.join(root, "stage1-fp32"),
            str(out),
            "--max_shard_size",
            "1KB",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    index = json.loads((tmp_path / "model.index.json").read_text())["weight_map"]
    from safetensors.torch import load_file

    state = {}
    for file in set(index.values()):
        state.update(load_file(tmp_path / file))
    model = Net()
    model.load_state_dict(state, strict=True)
    weights = consolidate(os.path.join(root, "stage1-fp32"))
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[name]), name
    assert torch.equal(model.frozen.weight, weights["frozen.weight"])
    inside = os.path.join(root, "stage1-fp32", "out.safetensors")
    # The console script with the first bad argument; its main() with each of the others (the
    # script is sys.exit(main()): one process start, not three).
    result = subprocess.run(
        [shutil.which("zero-to-fp32"), os.path.join(root, "stage1-fp32"), inside],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2 and result.stderr.startswith("zero-to-fp32: error:")
    capsys.readouterr()
    for bad_args in (
        [str(tmp_path / "missing" / "x.safetensors")],
        [str(out), "--max_shard_size", "0"],
    ):
        assert zero_to_fp32.main([os.path.join(root, "stage1-fp32"), *bad_args]) == 2, bad_args
        assert capsys.readouterr().err.startswith("zero-to-fp32: error:"), bad_args


def kill_during_save(root):
    """Save A, then die on rank 1 in the middle of saving B."""
    engine = make_engine(2)
    train(engine, global_batches(1))
    engine.save_checkpoint(root, tag="A")
    train(engine, global_batches(1))
    if engine.rank == 1:
        import safetensors.torch

        def crash(tensors, path, *args, **kwargs):
            with open(path, "wb") as handle:
                handle.write(b"partial")
            os._exit(9)

        safetensors.torch.save_file = crash
        import zero.checkpoint.files as checkpoint_files

        checkpoint_files.save_file = crash
    engine.save_checkpoint(root, tag="B")
    return "saved B"


def load_single(root, tag=None):
    engine = make_engine(2)
    path, client = engine.load_checkpoint(root, tag=tag)
    return os.path.basename(path), engine.global_steps


def test_kill_during_save_keeps_previous_checkpoint(tmp_path):
    root = str(tmp_path)
    with pytest.raises(RuntimeError, match="rank 1 exited with code 9|rank 0 failed"):
        run_ranks(kill_during_save, 2, root, timeout=120)
    assert Path(root, "latest").read_text() == "A"
    assert not os.path.exists(os.path.join(root, "B"))
    assert load_single(root) == ("A", 1)


def test_errors_name_file_and_key(tmp_path):
    engine = make_engine(2)
    train(engine, global_batches(1))
    with pytest.raises(CheckpointError, match=r"client_state\['bad'\]\[1\] is a object"):
        engine.save_checkpoint(tmp_path, client_state={"ok": 1, "bad": [2, object()]})
    assert not os.path.exists(tmp_path / "latest")
    for bad in ("../evil", "a/b", "..", "x.tmp", "", "latest", "best.old", " C", "C\n", "C "):
        with pytest.raises(CheckpointError, match="plain directory name"):
            engine.save_checkpoint(tmp_path, tag=bad)
    engine.save_checkpoint(tmp_path, tag="good")
    assert engine.load_checkpoint(tmp_path / "nowhere") == (None, None)  # DeepSpeed: nothing yet
    with pytest.raises(CheckpointError, match="nowhere/absent/meta.json does not exist"):
        engine.load_checkpoint(tmp_path / "nowhere", tag="absent")

    class Wider(Net):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(6, 7, bias=False)
            self.added = torch.nn.Linear(2, 2)

    wider = Wider()
    wider.added.requires_grad_(False)  # frozen: checked through module.safetensors
    other = make_engine(2, model=wider)
    before = [p.detach().clone() for p in other.module.parameters()]
    with pytest.raises(CheckpointError) as error:
        other.load_checkpoint(tmp_path)
    message = str(error.value)
    assert "meta.json" in message and "added.weight" in message and "proj.bias" in message
    assert all(torch.equal(a, b) for a, b in zip(before, other.module.parameters()))
    sgd = make_engine(2, opt_cls=torch.optim.SGD)
    with pytest.raises(CheckpointError, match="optimizer 'AdamW' was saved.*'SGD'"):
        sgd.load_checkpoint(tmp_path)
    rank_file = tmp_path / "good" / "rank0.safetensors"
    data = rank_file.read_bytes()
    rank_file.write_bytes(data[: len(data) // 2])
    fresh = make_engine(2)
    before = [p.detach().clone() for p in fresh.module.parameters()]
    with pytest.raises(CheckpointError, match=r"rank0\.safetensors.*truncated"):
        fresh.load_checkpoint(tmp_path)
    os.remove(rank_file)
    with pytest.raises(CheckpointError, match=r"rank0\.safetensors is missing"):
        fresh.load_checkpoint(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.module.parameters()))
    assert fresh.global_steps == 0


def test_loss_scaler_and_counters_continue(tmp_path):
    engine = make_engine(2, dtype="fp16")
    x, y = global_batches(1)[0]
    for _ in range(2):  # two overflows: hysteresis 2 halves the scale once
        engine.backward(engine(x, y) * float("inf"))
        engine.step()
    train(engine, global_batches(1))
    state = engine.scaler.state_dict()
    assert engine.skipped_steps == 2 and state["scale"] == 2.0**15
    engine.save_checkpoint(tmp_path)
    resumed = make_engine(2, dtype="fp16")
    resumed.load_checkpoint(tmp_path)
    assert resumed.scaler.state_dict() == state
    assert (resumed.global_steps, resumed.skipped_steps) == (3, 2)
    assert resumed.get_lr() == engine.get_lr()


class Mlp(torch.nn.Module):
    """At stage 3 below `block` is one fetch unit whose weights are interleaved, in registration
    order, with biases and a norm that are persistent."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.block = torch.nn.Sequential(
            torch.nn.Linear(16, 33),
            torch.nn.GELU(),
            torch.nn.LayerNorm(33),
            torch.nn.Linear(33, 16),
        )

    def forward(self, x, y):
        logits = self.block(self.embed(x)) @ self.embed.weight.T
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def mlp_engine(stage):
    torch.manual_seed(0)
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 40,
            "stage3_module_granularity_threshold": 1200,  # embed (176), block (1171)
        },
    }
    return zero.initialize(model=Mlp(), config=config)[0]


def save_mlp_stage3(root):
    engine = mlp_engine(3)
    train(engine, global_batches(2))
    engine.save_checkpoint(root, tag="stage3")


def test_checkpoint_loads_into_another_stages_layout_order(tmp_path):
    """Stage 3 lays out each fetch unit's parameters together, stages 0-2 in registration
    order: a checkpoint saved in one order loads into the other, element for element."""
    root = str(tmp_path)
    run_ranks(save_mlp_stage3, 2, root)
    engine = mlp_engine(1)
    engine.load_checkpoint(root, tag="stage3")
    engine.save_checkpoint(root, tag="stage1")
    engine = mlp_engine(3)
    # one bucket per fetch unit (embed, block); the persistent biases and norm stay in place
    units = [
        b.unit
        for b in engine.optimizer.layout.buckets
        if not engine.gatherer.units[b.unit].persistent
    ]
    assert len(units) == len(set(units)) == 2, units
    engine.load_checkpoint(root, tag="stage1")
    engine.save_checkpoint(root, tag="again")
    orders = {
        tag: [p["name"] for p in json.loads(Path(root, tag, "meta.json").read_text())["groups"][0]]
        for tag in ("stage3", "stage1", "again")
    }
    assert orders["stage3"] == orders["again"] != orders["stage1"]
    for state in ("master", "exp_avg", "exp_avg_sq"):
        saved = consolidate(root, "stage3", state)
        for tag in ("stage1", "again"):
            loaded = consolidate(root, tag, state)
            assert loaded.keys() == saved.keys()
            for name, value in saved.items():
                assert torch.equal(loaded[name], value), (tag, state, name)


# ----- lr scheduler presence ------------------------------------------------------------------
def masters_of(engine):
    return [b.master[: b.layout.shard_numel].clone() for b in engine.optimizer.buckets]


def scheduler_presence(root):
    """On 2 ranks: a checkpoint saved without a scheduler, loaded into an engine with one."""
    batches = global_batches(3)
    plain = make_engine(2, scheduler=None)
    train(plain, batches[:2])
    plain.save_checkpoint(os.path.join(root, "plain"), tag="T")
    out = {"saved_lr": plain.get_lr(), "saved_masters": masters_of(plain)}
    engine = make_engine(2)  # WarmupLR, at its start
    before = (masters_of(engine), engine.get_lr(), engine.global_steps)
    try:
        engine.load_checkpoint(os.path.join(root, "plain"))
        out["error"] = None
    except CheckpointError as error:
        out["error"] = str(error)
    after = (masters_of(engine), engine.get_lr(), engine.global_steps)
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
    out["unchanged"] &= before[1:] == after[1:]
    engine.load_checkpoint(os.path.join(root, "plain"), load_lr_scheduler_states=False)
    out["kept"] = (engine.get_lr(), engine.lr_scheduler.last_batch_iteration, engine.global_steps)
    out["weight_decay"] = [g["weight_decay"] for g in engine.optimizer.param_groups]
    out["loaded_masters"] = masters_of(engine)
    train(engine, batches[2:])
    out["next"] = (engine.get_lr(), engine.lr_scheduler.last_batch_iteration, engine.global_steps)
    # The same rule when the checkpoint has a scheduler: this run's keeps driving the lr.
    scheduled = make_engine(2)
    train(scheduled, batches[:2])
    scheduled.save_checkpoint(os.path.join(root, "scheduled"), tag="T")
    fresh = make_engine(2)
    start = fresh.get_lr()
    fresh.load_checkpoint(os.path.join(root, "scheduled"), load_lr_scheduler_states=False)
    out["scheduled"] = (scheduled.get_lr(), start, fresh.get_lr())
    fresh.load_checkpoint(os.path.join(root, "scheduled"))  # loaded: the saved position
    out["loaded"] = (fresh.get_lr(), fresh.lr_scheduler.last_batch_iteration)
    return out


def test_checkpoint_without_scheduler_into_engine_with_one(tmp_path):
    """Loading, with load_lr_scheduler_states=True, a checkpoint saved without a scheduler into an
    engine with one is an error on every rank before anything changes; with False the run's
    scheduler keeps its position and the lr it set, the rest of the checkpoint loads."""
    results = run_ranks(scheduler_presence, 2, str(tmp_path), timeout=240)
    for rank, out in enumerate(results):
        error = out["error"]
        assert error is not None, rank
        assert "saved without an lr scheduler, and this run has WarmupLR" in error, error
        assert "load_lr_scheduler_states=False" in error and "meta.json" in error, error
        assert out["unchanged"], rank
        start = [SCHED["params"]["warmup_min_lr"]] * 3
        assert out["saved_lr"] == [1e-2, 2e-2, 1e-2] != start
        lr, iteration, steps = out["kept"]
        assert lr == start and iteration == -1 and steps == 2, out["kept"]
        assert out["weight_decay"] == [0.1, 0.0, 0.0]
        for loaded, saved in zip(out["loaded_masters"], out["saved_masters"]):
            assert torch.equal(loaded, saved)
        assert out["next"] == (start, 0, 3), out["next"]  # the schedule's first step (t = 0)
        saved, start_lr, kept = out["scheduled"]
        assert kept == start_lr == start != saved, out["scheduled"]
        assert out["loaded"] == (saved, 1), out["loaded"]


def test_client_state_holds_tensors_without_pickle(tmp_path):
    """A checkpoint dict as Lightning passes it (tensors, tuples, int keys, inf, nested lists)
    comes back from load_checkpoint equal, tensors with their dtype and shape; plain JSON stays
    readable in meta.json as it is."""
    engine = make_engine(2)
    train(engine, global_batches(1))
    best = "ModelCheckpoint{'monitor': 'loss'}"
    client = {
        "epoch": 3,
        "callbacks": {best: {"best_model_score": torch.tensor(0.25)}},
        "loops": {"fit": [{"total": (1, 2)}, {7: "int key", "$ref": None}]},
        "scores": torch.arange(6, dtype=torch.bfloat16).view(2, 3).t(),
        "limit": float("inf"),
    }
    engine.save_checkpoint(tmp_path, tag="rich", client_state=client)
    engine.save_checkpoint(tmp_path, tag="plain", client_state={"note": [1, "x"]})
    _, loaded = engine.load_checkpoint(tmp_path, tag="rich")
    assert loaded.keys() == client.keys() and loaded["loops"] == client["loops"]
    assert loaded["limit"] == float("inf") and loaded["epoch"] == 3
    assert torch.equal(loaded["callbacks"][best]["best_model_score"], torch.tensor(0.25))
    assert loaded["scores"].dtype == torch.bfloat16
    assert torch.equal(loaded["scores"], client["scores"])
    meta = json.loads((tmp_path / "plain" / "meta.json").read_text())
    assert meta["client_state"] == {"note": [1, "x"]}
    assert engine.load_checkpoint(tmp_path, tag="plain")[1] == {"note": [1, "x"]}
