"""ZeRO-Infinity optimizer offload to nvme and partial offload (offload_optimizer.ratio):

- runs offloaded to nvme (all of it, or ratio 0.5) and runs with half the state on the host equal
  runs without offload after every optimizer step (fp32, 1e-6), stages 1-3, GAS 1 and 2, N = 2,
  on a model of odd sizes (tests/parity_model.py Net);
- the swap files exist only while the engine lives; a crashed run's directory is never reused
  and is removed by the next run on the host;
- checkpoints move between nvme and no-offload runs in both directions;
- nvme_path that is missing, not a directory, not writable or too small is an error naming the
  key before anything is allocated;
- a run killed during a step leaves its last checkpoint loadable.
"""

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from distributed import run_ranks
from parity_model import Net, batches, param_groups
from test_offload import config

import zero
from zero.config import ConfigError

STEPS = 3


def make_engine(cfg):
    torch.manual_seed(0)
    model = Net()
    params = [{k: v for k, v in g.items() if k != "weight_decay"} for g in param_groups(model)]
    engine, _, _, _ = zero.initialize(model=model, model_parameters=params, config=cfg)
    return engine


def params_of(engine):
    with zero.GatheredParameters(list(engine.module.parameters())):
        return [p.detach().float().clone() for p in engine.module.parameters()]


def train(engine, gas, steps, same_modules):
    data = batches(engine.world_size, gas, steps=STEPS, same_modules=same_modules)
    history = []
    for step in (data[i] for i in steps):
        for micro in step:
            x, y, use_extra = micro[engine.rank]
            engine.backward(engine(x, y, use_extra=use_extra))
            engine.step()
        history.append(params_of(engine))
    return history


def swap_dirs(root):
    return sorted(n for n in os.listdir(root) if n.startswith("zero-"))


def run_case(root, stage, gas, offload):
    engine = make_engine(config(stage, gas, offload))
    placement = []
    if engine.optimizer.offloader is not None:
        placement = [engine.optimizer.offloader.where(b) for b in engine.optimizer.buckets]
    history = train(engine, gas, range(STEPS), stage == 3)
    mine = [d for d in swap_dirs(root) if d.endswith(f"rank{engine.rank}")]
    files = len(os.listdir(os.path.join(root, mine[0]))) if mine else 0
    engine.close()
    left = [d for d in swap_dirs(root) if d.endswith(f"rank{engine.rank}")]
    return history, placement, files, left


def resume_case(root, stage, before, after, tag):
    """Two steps with offload `before`, save, load into an engine with offload `after`, one
    more step: the params after it, and those of the same three steps without offload."""
    engine = make_engine(config(stage, 1, before))
    train(engine, 1, range(2), stage == 3)
    engine.save_checkpoint(f"{root}/ckpt", tag=tag)
    engine.close()
    engine = make_engine(config(stage, 1, after))
    engine.load_checkpoint(f"{root}/ckpt", tag=tag)
    resumed = train(engine, 1, range(2, 3), stage == 3)
    engine.close()
    return resumed[-1]


def sweep(root):
    nvme = {"device": "nvme", "nvme_path": f"{root}/swap", "buffer_count": 2}
    os.makedirs(nvme["nvme_path"], exist_ok=True)
    offloads = {
        "none": None,
        "nvme": nvme,
        "nvme ratio 0.5": dict(nvme, ratio=0.5),
        "cpu ratio 0.5": {"device": "cpu", "ratio": 0.5},
    }
    out = {}
    for stage, gas in itertools.product((1, 2, 3), (1, 2)):
        for name, offload in offloads.items():
            out[(stage, gas, name)] = run_case(nvme["nvme_path"], stage, gas, offload)
    for stage in (2, 3):
        plain = out[(stage, 1, "none")][0][-1]
        for before, after in (("nvme", "none"), ("none", "nvme"), ("nvme", "nvme ratio 0.5")):
            tag = f"s{stage}-{before}-{after}".replace(" ", "_")
            got = resume_case(root, stage, offloads[before], offloads[after], tag)
            out[(stage, f"{before} -> {after}")] = (plain, got)
    rank = os.environ["RANK"]  # the other rank may still be closing its last engine
    out["left"] = [d for d in swap_dirs(nvme["nvme_path"]) if d.endswith(f"rank{rank}")]
    return out


def sweep_two_ranks(root):
    """Every world-size-2 sweep of this module in one group, each in a directory of its own."""
    parts = {"offload": sweep, "two_byte": two_byte_sweep, "param": param_sweep, "api": api_sweep}
    out = {}
    for name, part in parts.items():
        os.makedirs(f"{root}/{name}", exist_ok=True)
        out[name] = part(f"{root}/{name}")
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """part -> [rank 0's result, rank 1's result] of sweep_two_ranks."""
    per_rank = run_ranks(sweep_two_ranks, 2, str(tmp_path_factory.mktemp("two_ranks")))
    return {part: [r[part] for r in per_rank] for part in per_rank[0]}


def test_nvme_and_ratio_match_no_offload_after_every_step(two_ranks):
    results = two_ranks["offload"]
    for rank_results in results:
        assert rank_results.pop("left") == []
        for case, value in rank_results.items():
            if "->" in str(case[-1]):
                plain, got = value
                for a, b in zip(plain, got):
                    assert torch.allclose(a, b, rtol=0, atol=1e-6), case
                continue
            history, placement, files, left = value
            assert left == [], case  # close() removed the run's directory
            ref = rank_results[(case[0], case[1], "none")][0]
            for step, (a_step, b_step) in enumerate(zip(ref, history)):
                for a, b in zip(a_step, b_step):
                    assert torch.allclose(a, b, rtol=0, atol=1e-6), (case, step)
            if case[2] == "nvme":
                assert set(placement) == {"nvme"} and files > 1, case
            elif "ratio" in case[2]:
                kind = case[2].split()[0]
                assert placement[0] == "device" and placement[-1] == kind, (case, placement)


# ----- 2-byte gradients: one fp32 gradient copy at a time ------------------------------------
def two_byte_sweep(root):
    """bf16, grad_accum_dtype bf16, clipping on: nvme runs and the cpu offload run (whose step
    casts every shard at once) after every step, and the most fp32 gradient copies the nvme
    step held at once (ScaledGrads items alive when the next one is made)."""
    import weakref

    from zero.partition import stages

    made, most = [], [0]
    original = stages.ScaledGrads.__getitem__

    def counting(self, index):
        alive = [r for r in made if r() is not None]
        most[0] = max(most[0], len(alive) + 1)
        value = original(self, index)
        made[:] = alive + [weakref.ref(value)]
        return value

    stages.ScaledGrads.__getitem__ = counting
    nvme = {"device": "nvme", "nvme_path": f"{root}/swap", "buffer_count": 2}
    os.makedirs(nvme["nvme_path"], exist_ok=True)
    out = {}
    try:
        for stage, gas in itertools.product((2, 3), (1, 2)):
            for name, offload in (("cpu", {"device": "cpu"}), ("nvme", nvme)):
                cfg = config(stage, gas, offload)
                cfg["bf16"] = {"enabled": True}
                cfg["data_types"] = {"grad_accum_dtype": "bf16"}
                cfg["gradient_clipping"] = 0.05  # clips: the factor differs from the unscale
                most[0] = 0
                engine = make_engine(cfg)
                history = train(engine, gas, range(STEPS), stage == 3)
                norms = engine.get_global_grad_norm()
                engine.close()
                out[(stage, gas, name)] = (history, norms, most[0])
    finally:
        stages.ScaledGrads.__getitem__ = original  # the group's other sweeps run unwatched
    return out


def test_two_byte_gradients_step_one_fp32_copy_at_a_time_bitwise(two_ranks):
    for rank_results in two_ranks["two_byte"]:
        for (stage, gas, name), (history, norm, most) in rank_results.items():
            if name == "cpu":
                continue
            ref_history, ref_norm, _ = rank_results[(stage, gas, "cpu")]
            assert norm == ref_norm, (stage, gas)
            for a_step, b_step in zip(ref_history, history):
                for a, b in zip(a_step, b_step):
                    assert torch.equal(a, b), (stage, gas)
            assert most == 1, (stage, gas, most)


# ----- directory lifetime -------------------------------------------------------------------
def _fake_run_dir(root, pid, host=None):
    path = os.path.join(root, f"zero-{pid}-1a2b-c3d4e5f6-rank0")
    os.mkdir(path)
    with open(os.path.join(path, "owner.json"), "w") as handle:
        json.dump({"host": host or socket.gethostname(), "pid": pid, "started": 1.0}, handle)
    with open(os.path.join(path, "b0.master.swp"), "wb") as handle:
        handle.write(b"\0" * 4096)
    return path


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_directories_are_removed_and_never_reused(tmp_path):
    stale = _fake_run_dir(str(tmp_path), _dead_pid())
    remote = _fake_run_dir(str(tmp_path), os.getpid() + 1, host="another-host")
    cfg = config(2, 1, {"device": "nvme", "nvme_path": str(tmp_path)})
    engine = make_engine(cfg)
    try:
        assert not os.path.exists(stale)  # this host, owner gone: removed
        assert os.path.exists(remote)  # another host's run may be alive: kept
        mine = [d for d in swap_dirs(tmp_path) if d.split("-")[1] == str(os.getpid())]
        assert len(mine) == 1 and os.path.join(tmp_path, mine[0]) != remote
        assert engine.optimizer.offloader.bytes_on_disk > 0
    finally:
        engine.close()
    assert swap_dirs(tmp_path) == [os.path.basename(remote)]


# ----- checks before anything is allocated --------------------------------------------------
def _refused(cfg, match):
    model = Net()
    before = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(ConfigError, match=match):
        zero.initialize(model=model, config=cfg)
    assert [p.data_ptr() for p in model.parameters()] == before


def test_bad_nvme_path_is_an_error_naming_the_key(tmp_path, monkeypatch):
    key = r"zero_optimization\.offload_optimizer\.nvme_path"
    for path, why in (
        (tmp_path / "missing", "does not exist"),
        (tmp_path / "file", "is not a directory"),
    ):
        (tmp_path / "file").write_text("x")
        _refused(config(2, 1, {"device": "nvme", "nvme_path": str(path)}), f"{key}.*{why}")
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        _refused(config(2, 1, {"device": "nvme", "nvme_path": str(locked)}), f"{key}.*writable")
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(
        "zero.offload.nvme.shutil.disk_usage", lambda p: real(p)._replace(free=1 << 20)
    )
    _refused(config(3, 1, {"device": "nvme", "nvme_path": str(tmp_path)}), f"{key}.*GiB free")
    assert swap_dirs(tmp_path) == []


def test_free_space_counts_every_local_rank_and_both_kinds_on_one_disk(tmp_path, monkeypatch):
    """Ranks on one host share the disk: a check per rank passed with room for one rank only,
    and the run failed in its first step with ENOSPC."""
    import shutil

    from zero.offload.nvme import SPACE_MARGIN_BYTES, check_free_space

    real = shutil.disk_usage
    free = 3 * (100 << 20) + SPACE_MARGIN_BYTES
    monkeypatch.setattr(
        "zero.offload.nvme.shutil.disk_usage", lambda p: real(p)._replace(free=free)
    )
    opt = ("zero_optimization.offload_optimizer.nvme_path", str(tmp_path), 100 << 20)
    par = ("zero_optimization.offload_param.nvme_path", str(tmp_path / "."), 50 << 20)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    check_free_space([opt, par], rank=0)  # 2 x 150 MiB fits
    check_free_space([opt, None], rank=0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    check_free_space([None, par], rank=0)  # 4 x 50 MiB fits
    with pytest.raises(ConfigError, match=r"offload_optimizer\.nvme_path and .*offload_param"):
        check_free_space([opt, par], rank=3)  # 4 x 150 MiB does not
    with pytest.raises(ConfigError, match=r"the 4 rank\(s\) on this host will write"):
        check_free_space([opt], rank=3)


def test_bad_param_nvme_path_or_buffer_size_is_an_error_naming_the_key(tmp_path):
    key = r"zero_optimization\.offload_param"
    missing = param_config(1, str(tmp_path / "missing"))
    _refused(missing, f"{key}\\.nvme_path.*does not exist")
    small = param_config(1, str(tmp_path))
    small["zero_optimization"]["offload_param"]["buffer_size"] = 8  # embed: 66, one rank
    _refused(small, f"{key}\\.buffer_size.*at least 66")
    assert swap_dirs(tmp_path) == []


# ----- a kill during a step ------------------------------------------------------------------
KILLED_RUN = """
import os, signal, sys
sys.path[:0] = [{tests!r}, os.path.dirname({tests!r})]  # test_nvme, parity_model
import torch
import zero.offload.nvme
from test_nvme import config, make_engine, train

engine = make_engine(config(2, 1, {{"device": "nvme", "nvme_path": {swap!r}}}))
train(engine, 1, range(2), False)
engine.save_checkpoint({ckpt!r}, tag="last")
written = zero.offload.nvme.PartialOffload._write_back

def die(self, *args):
    written(self, *args)
    os.kill(os.getpid(), signal.SIGKILL)  # with the first sub-group's writes in flight

zero.offload.nvme.PartialOffload._write_back = die
train(engine, 1, range(2, 3), False)
"""


def test_kill_during_step_leaves_the_last_checkpoint_loadable(tmp_path):
    swap, ckpt = tmp_path / "swap", tmp_path / "ckpt"
    swap.mkdir()
    script = KILLED_RUN.format(tests=os.path.dirname(__file__), swap=str(swap), ckpt=str(ckpt))
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    left = swap_dirs(swap)
    assert len(left) == 1  # the killed run's files stay behind, recognizably its own
    expected = train(make_engine(config(2, 1)), 1, range(3), False)
    for offload in ({"device": "nvme", "nvme_path": str(swap)}, None):
        engine = make_engine(config(2, 1, offload))
        engine.load_checkpoint(str(ckpt), tag="last")
        assert left[0] not in swap_dirs(swap)  # removed: its owner is dead
        got = train(engine, 1, range(2, 3), False)
        engine.close()
        for a, b in zip(expected[-1], got[-1]):
            assert torch.allclose(a, b, rtol=0, atol=1e-6), offload
    assert swap_dirs(swap) == []


# ----- zero-estimate --------------------------------------------------------------------------
def test_estimator_recommends_nvme_with_a_ratio_when_nothing_else_fits(tmp_path, capsys):
    from zero import estimator

    out = tmp_path / "recommended.json"
    argv = ["--params", "4e9", "--devices-per-node", "1", "--device-memory", "80G"]
    argv += ["--host-memory", "32G", "--reduce-bucket-size", "1e8", "--write-config", str(out)]
    assert estimator.main(argv) == 0
    printed = capsys.readouterr().out
    assert "recommended: stage 1 with optimizer offload to nvme, ratio 0.5" in printed
    block = json.loads(out.read_text())["zero_optimization"]["offload_optimizer"]
    assert block["device"] == "nvme" and block["ratio"] == 0.5 and block["nvme_path"]
    cluster = estimator.Cluster(devices_per_node=1, device_memory=80 * 2**30)
    rows = estimator.estimate(4 * 10**9, cluster, estimator.Options(bucket_numel=10**8))
    full = next(r for r in rows if r.stage == 3 and r.device == "none")
    half = next(r for r in rows if r.stage == 3 and r.device == "nvme")
    # Half of the fp32 master + Adam moments (12 bytes per element) left the device for files.
    assert full.model_states - half.model_states == half.per_nvme == 6 * 4 * 10**9


# ----- parameter shards on nvme (offload_param.device "nvme", stage 3) -----------------------
def param_config(gas, root, opt_offload=None, prefetch=0, max_in_cpu=0, param=True):
    cfg = config(3, gas, opt_offload)
    zero_cfg = cfg["zero_optimization"]
    zero_cfg["stage3_prefetch_bucket_size"] = prefetch
    zero_cfg["stage3_param_persistence_threshold"] = 0  # one unit per module: read ahead
    zero_cfg["stage3_gather_16bit_weights_on_model_save"] = True  # state_dict() gathers
    if param:
        zero_cfg["offload_param"] = {
            "device": "nvme",
            "nvme_path": root,
            "buffer_count": 2,
            "buffer_size": 128,
            "max_in_cpu": max_in_cpu,
        }
    return cfg


def eval_loss(engine, step):
    """A forward without backward (no_grad), on the next step's first micro-batch."""
    x, y, use_extra = batches(engine.world_size, 1, steps=STEPS + 1, same_modules=True)[step][0][
        engine.rank
    ]
    with torch.no_grad():
        return float(engine(x, y, use_extra=use_extra))


def param_run(root, cfg, gas):
    engine = make_engine(cfg)
    swap = engine.optimizer.param_swap
    data = batches(engine.world_size, gas, steps=STEPS, same_modules=True)
    history = []
    for step in data:
        for micro in step:
            x, y, use_extra = micro[engine.rank]
            engine.backward(engine(x, y, use_extra=use_extra))
            engine.step()
        history.append((params_of(engine), eval_loss(engine, len(history) + 1)))
    state = {k: v.float().clone() for k, v in engine.module.state_dict().items()}
    stats = None
    if swap is not None:
        hits = swap.ahead_hits + engine.gatherer.prefetch_hits
        stats = (len(swap.shards), hits, swap.bytes_on_disk, engine.memory_report())
    engine.close()
    left = [d for d in swap_dirs(root) if d.endswith(f"rank{engine.rank}")]
    return history, state, stats, left


def param_sweep(root):
    swap = f"{root}/swap"
    os.makedirs(swap, exist_ok=True)
    opt_nvme = {"device": "nvme", "nvme_path": swap, "buffer_count": 2}
    out = {}
    for gas in (1, 2):
        out[(gas, "ref")] = param_run(swap, param_config(gas, swap, param=False), gas)
        for prefetch, opt in itertools.product((0, 60), (None, opt_nvme)):
            cfg = param_config(gas, swap, opt, prefetch)
            out[(gas, prefetch, opt is not None)] = param_run(swap, cfg, gas)
    # the first shards stay in host memory (max_in_cpu elements), the rest in files
    out[(1, "max_in_cpu")] = param_run(swap, param_config(1, swap, max_in_cpu=40), 1)
    return out


def test_param_nvme_matches_no_offload_after_every_step(two_ranks):
    results = two_ranks["param"]
    for rank_results in results:
        for case, (history, state, stats, left) in rank_results.items():
            assert left == [], case
            ref_history, ref_state, _, _ = rank_results[(case[0], "ref")]
            for step, ((a_params, a_loss), (b_params, b_loss)) in enumerate(
                zip(ref_history, history)
            ):
                assert abs(a_loss - b_loss) <= 1e-6, (case, step)
                for a, b in zip(a_params, b_params):
                    assert torch.allclose(a, b, rtol=0, atol=1e-6), (case, step)
            for name, value in ref_state.items():
                assert torch.allclose(value, state[name], rtol=0, atol=1e-6), (case, name)
            if case[1] == "ref":
                continue
            shards, hits, on_disk, report = stats
            # shards are read ahead of use: read ahead (prefetch off) or prefetched gathers
            assert shards > 0 and hits > 0 and on_disk > 0, case
            assert report["nvme_bytes"]["params"] == on_disk, case


def api_run(root, cfg, tag):
    """Every reader and writer of masters, optimizer state and parameter shards outside the
    step: zero.utils getters and setters, GatheredParameters(modifier_rank=0) on a trained and a
    frozen weight, memory_report, save/load_checkpoint, save_pretrained/load_pretrained."""
    from zero import utils

    engine = make_engine(cfg)
    model = engine.module
    data = batches(engine.world_size, 1, steps=STEPS, same_modules=True)

    def step(i):
        x, y, use_extra = data[i][0][engine.rank]
        engine.backward(engine(x, y, use_extra=use_extra))
        engine.step()

    step(0)
    step(1)
    got = {
        "full": [utils.safe_get_full_fp32_param(p) for p in (model.proj.weight, model.out.weight)]
    }
    got["m"] = utils.safe_get_full_optimizer_state(model.proj.weight, "exp_avg")
    got["local"] = utils.safe_get_local_fp32_param(model.out.weight)
    got["v_local"] = utils.safe_get_local_optimizer_state(model.out.weight, "exp_avg_sq")
    utils.safe_set_full_fp32_param(model.proj.weight, torch.full((7, 6), 0.1))
    utils.safe_set_full_optimizer_state(model.proj.weight, torch.zeros(7, 6), "exp_avg")
    utils.safe_set_local_fp32_param(model.out.weight, got["local"] * 2)
    utils.safe_set_local_optimizer_state(model.out.weight, got["v_local"] * 0.5, "exp_avg_sq")
    with zero.GatheredParameters([model.embed.weight, model.frozen.weight], modifier_rank=0):
        if engine.rank == 0:
            with torch.no_grad():
                model.embed.weight[3].zero_()
                model.frozen.weight.mul_(0.5)
    got["after_set"] = params_of(engine)
    got["report"] = engine.memory_report()
    engine.save_checkpoint(f"{root}/ckpt", tag=tag)
    engine.save_pretrained(f"{root}/hf-{tag}")
    step(2)
    got["trained"] = params_of(engine)
    engine.close()
    loaded = {}
    for source in (tag, "ref"):  # its own checkpoint, and the run without offload's
        engine = make_engine(cfg)
        engine.load_checkpoint(f"{root}/ckpt", tag=source)
        step(2)
        loaded[source] = params_of(engine)
        engine.close()
    got["resumed"] = loaded
    engine = make_engine(cfg)
    zero.load_pretrained(engine, f"{root}/hf-{tag}")
    got["pretrained"] = params_of(engine)
    engine.close()
    return got


def api_sweep(root):
    swap = f"{root}/swap"
    os.makedirs(swap, exist_ok=True)
    opt_nvme = {"device": "nvme", "nvme_path": swap, "buffer_count": 2}
    out = {"ref": api_run(root, param_config(1, swap, param=False), "ref")}
    out["nvme"] = api_run(root, param_config(1, swap, opt_nvme), "nvme")
    rank = os.environ["RANK"]
    out["left"] = [d for d in swap_dirs(swap) if d.endswith(f"rank{rank}")]
    return out


def _close(a, b, what):
    if isinstance(a, (list, tuple)):
        for x, y in zip(a, b):
            _close(x, y, what)
        return
    assert torch.allclose(a.float(), b.float(), rtol=0, atol=1e-6), what


def test_every_reader_sees_nvme_values(two_ranks):
    barrier = two_ranks["api"]
    for results in barrier:
        assert results["left"] == []
        ref, got = results["ref"], results["nvme"]
        for key in ("full", "m", "local", "v_local", "after_set", "trained"):
            _close(ref[key], got[key], key)
        for source in ("nvme", "ref"):
            _close(ref["resumed"]["ref"], got["resumed"][source], source)
        _close(ref["after_set"], got["pretrained"], "pretrained")
        measured, on_disk = got["report"]["measured"], got["report"]["nvme_bytes"]
        assert measured["master"] == measured["optimizer_state"] == 0
        assert measured["params"] < ref["report"]["measured"]["params"]
        assert on_disk["params"] > 0 and on_disk["optimizer"] > 0
        assert ref["report"]["nvme_bytes"] == {"params": 0, "optimizer": 0}
