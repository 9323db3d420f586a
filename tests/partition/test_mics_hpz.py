"""MiCS (stages 1-3) and hpZ (stage 3) on 4 gloo ranks as 2 simulated nodes of 2 ranks
(ZERO_RANKS_PER_NODE=2): parity with the flat run, the ledger's intra/inter-node split against
the formulas of partition/hierarchy.py, and a MiCS checkpoint loaded by a flat engine.

One group of 4 ranks runs every case (_sweep); the tests read its results.
"""

import json
import os

import pytest
import torch
from distributed import full_params, run_ranks
from parity_model import Net, batches, config, param_groups

from zero.planning.estimator import (
    Cluster,
    Options,
    count_layout,
    estimate_stage,
    tier_comm_psi,
)

WORLD, PER_NODE, GAS = 4, 2, 2


def _config(stage, **zero):
    cfg = config(stage, GAS, 0.05, WORLD)
    # stage 3: no unit stays gathered from forward to backward, so backward all-gathers
    cfg["zero_optimization"].update(stage3_max_reuse_distance=0, **zero)
    return cfg


def _engine(cfg):
    import zero

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2, betas=(0.9, 0.99), eps=1e-8)
    engine, _, _, _ = zero.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def _delta(before: dict, after: dict) -> dict:
    """op -> (elements, inter_elements) counted between two ledger snapshots."""
    out = {}
    for op, totals in after.items():
        old = before.get(op)
        out[op] = (
            totals.elements - (old.elements if old else 0),
            totals.inter_elements - (old.inter_elements if old else 0),
        )
    return out


def _snapshot(engine) -> dict:
    from zero.comm import OpTotals

    return {op: OpTotals(**vars(t)) for op, t in engine.comm.ledger.current.items()}


def _train(engine, data) -> dict:
    """Train on `data`; per phase ("forward", "backward") of the last optimizer step, op ->
    [elements, inter-node elements] of its collectives."""
    phases = {}
    for step in data:
        phases = {"forward": {}, "backward": {}}
        for micro in step:
            x, y, use_extra = micro[engine.rank]
            before = _snapshot(engine)
            loss = engine(x, y, use_extra=use_extra)
            middle = _snapshot(engine)
            engine.backward(loss)
            after = _snapshot(engine)
            engine.step()
            for name, (a, b) in (("forward", (before, middle)), ("backward", (middle, after))):
                for op, (n, inter) in _delta(a, b).items():
                    total = phases[name].setdefault(op, [0, 0])
                    total[0], total[1] = total[0] + n, total[1] + inter
    return phases


def _sweep(root):
    import zero

    os.environ["ZERO_RANKS_PER_NODE"] = str(PER_NODE)
    data = batches(WORLD, GAS, steps=2, same_modules=True)
    nxt = batches(WORLD, GAS, steps=1, seed=5, same_modules=True)
    out = {"cases": {}}
    cases = [(s, "flat", {}) for s in (1, 2, 3)]
    cases += [(s, "mics", {"mics_shard_size": PER_NODE}) for s in (1, 2, 3)]
    cases += [(3, "hpz", {"zero_hpz_partition_size": PER_NODE})]
    for stage, kind, zero_keys in cases:
        engine = _engine(_config(stage, **zero_keys))
        phases = _train(engine, data)
        out["cases"][(stage, kind)] = {
            "params": full_params(engine),
            "norm": engine.get_global_grad_norm(),
            "stats": engine.comm_stats(),
            "phases": phases,
            "padded": engine.optimizer.layout.padded_numel,
            "frozen_padded": engine.frozen.layout.padded_numel if engine.frozen else 0,
            "num_shards": engine.optimizer.layout.num_shards,
            "memory": engine.model_state_bytes(),
            "fp32": zero.utils.safe_get_full_fp32_param(engine.module.proj.weight),
        }
        if kind == "mics" and stage == 2:
            engine.save_checkpoint(root, tag="mics")
            out["saved"] = full_params(engine)
            _train(engine, nxt)
            out["continued"] = full_params(engine)
        engine.close()
    # The MiCS checkpoint, loaded by a flat stage-3 engine (4 shards instead of 2): it holds the
    # saved parameters (and optimizer state: the next step equals the saving run's).
    engine = _engine(_config(3))
    engine.load_checkpoint(root, tag="mics")
    out["loaded"] = full_params(engine)
    _train(engine, nxt)
    out["loaded_next"] = full_params(engine)
    engine.close()
    with open(os.path.join(root, "mics", "meta.json")) as f:
        out["meta_ranks"] = json.load(f)["ranks"]
    # The node groups of the data-parallel Communicator, and what an all-reduce over each counts
    comm = zero.comm.data_parallel_comm()
    intra, inter = comm.node_groups()
    for group in (intra, inter):
        group.all_reduce(torch.ones(10))
    comm.ledger.end_step()
    out["node_groups"] = (intra.global_ranks(), inter.global_ranks(), comm.ledger.tiers())
    # As zrun and torchrun start ranks: each knows its node's index (GROUP_RANK) only
    del os.environ["ZERO_RANKS_PER_NODE"]
    os.environ["GROUP_RANK"] = str(comm.rank // PER_NODE)
    out["from_group_rank"] = zero.comm.read_topology(list(range(WORLD)), comm.rank).nodes
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("mics"))
    return run_ranks(_sweep, WORLD, root)


def _max_diff(a: dict, b: dict) -> float:
    return max((a[n].float() - b[n].float()).abs().max().item() if a[n].numel() else 0.0 for n in a)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_mics_equals_flat(results, stage):
    for rank in results:
        mics, flat = rank["cases"][(stage, "mics")], rank["cases"][(stage, "flat")]
        assert mics["num_shards"] == PER_NODE and flat["num_shards"] == WORLD
        assert _max_diff(mics["params"], flat["params"]) < 1e-6
        assert mics["norm"] == pytest.approx(flat["norm"], rel=1e-6)
        assert (mics["fp32"] - flat["fp32"]).abs().max() < 1e-6  # zero.utils over shard groups


def test_hpz_equals_flat(results):
    for rank in results:
        hpz, flat = rank["cases"][(3, "hpz")], rank["cases"][(3, "flat")]
        assert _max_diff(hpz["params"], flat["params"]) < 1e-6
        assert hpz["norm"] == pytest.approx(flat["norm"], rel=1e-6)


def test_hpz_backward_all_gather_is_intra_node(results):
    for rank in results:
        hpz, flat = rank["cases"][(3, "hpz")], rank["cases"][(3, "flat")]
        gathered, inter = hpz["phases"]["backward"]["all_gather"]
        assert gathered > 0 and inter == 0
        # the forward's all-gather spans both nodes: half of each buffer comes from the other
        gathered, inter = hpz["phases"]["forward"]["all_gather"]
        assert gathered > 0 and inter == gathered // 2
        assert hpz["phases"]["forward"] == flat["phases"]["forward"]
        # the flat run's backward all-gather moves the same elements, half of them across nodes
        flat_gathered, flat_inter = flat["phases"]["backward"]["all_gather"]
        assert flat_gathered == hpz["phases"]["backward"]["all_gather"][0]
        assert flat_inter == flat_gathered // 2
        stats = hpz["stats"]["all_gather"]
        assert stats["inter_bytes"] + stats["intra_bytes"] == stats["bytes"]
        # the secondary copy: 1/2 of the (padded) parameters, trained and frozen, in fp32
        held = (hpz["padded"] + hpz["frozen_padded"]) // PER_NODE * 4
        assert hpz["memory"]["secondary_params"] == held
        assert "secondary_params" not in flat["memory"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_mics_inter_node_bytes_follow_the_formula(results, stage):
    replicas = WORLD // PER_NODE
    for rank in results:
        case = rank["cases"][(stage, "mics")]
        stats = case["stats"]
        # shard-group collectives stay inside the node
        for op in ("all_gather", "reduce_scatter"):
            if op in stats:
                assert stats[op]["inter_bytes"] == 0, op
        # the replica all-reduce: 2 Psi/s (padded) elements, (R - 1)/R of them across nodes
        expected = 2 * case["padded"] // PER_NODE * (replicas - 1) // replicas
        assert stats["all_reduce"]["inter_elements"] == expected
        assert stats["all_reduce"]["inter_bytes"] == 4 * expected  # fp32 gradient shards
        assert stats["all_reduce"]["elements"] == 2 * case["padded"] // PER_NODE
        flat = rank["cases"][(stage, "flat")]["stats"]
        assert sum(t["inter_bytes"] for t in flat.values()) > sum(
            t["inter_bytes"] for t in stats.values()
        )
        # zero-estimate's formula: only the replica all-reduce crosses nodes
        options = Options(gradient_accumulation_steps=GAS, mics_shard_size=PER_NODE)
        _, inter = tier_comm_psi(stage, Cluster(replicas, PER_NODE), options)
        measured = sum(t["inter_elements"] for t in stats.values())
        assert measured == pytest.approx(inter * case["padded"], rel=1e-12)


def test_estimator_counts_the_hpz_secondary_copy():
    options = Options(dtype="fp32", hpz_partition_size=PER_NODE)
    layout = count_layout(1001, WORLD, 10**6)
    cluster = Cluster(WORLD // PER_NODE, PER_NODE)
    with_hpz = estimate_stage(layout, 3, False, cluster, options)
    without = estimate_stage(layout, 3, False, cluster, Options(dtype="fp32"))
    assert with_hpz.model_states - without.model_states == layout.padded_numel // PER_NODE * 4
    # ZeRO-3 on 2 nodes x 2: half of 3 Psi crosses nodes; hpZ keeps the backward half in
    intra, inter = tier_comm_psi(3, cluster, Options(reuse_numel=0))
    assert (intra, inter) == (1.5, 1.5)
    intra, inter = tier_comm_psi(3, cluster, Options(reuse_numel=0, hpz_partition_size=2))
    assert (intra, inter) == (2.0, 1.0)


def test_nodes_from_group_rank_are_exchanged(results):
    for result in results:
        assert result["from_group_rank"] == {0: 0, 1: 0, 2: 1, 3: 1}


def test_node_groups_follow_the_topology(results):
    for rank, result in enumerate(results):
        intra, inter, tiers = result["node_groups"]
        node = rank // PER_NODE
        assert intra == [node * PER_NODE, node * PER_NODE + 1]
        assert inter == [rank % PER_NODE, rank % PER_NODE + PER_NODE]
        # two all-reduces of 10 elements (20 each in paper units); the inter-node one: half
        assert tiers == {
            "intra_bytes": 4 * 30,
            "inter_bytes": 4 * 10,
            "intra_elements": 30,
            "inter_elements": 10,
        }


def test_mics_checkpoint_loads_into_a_flat_engine(results):
    meta = results[0]["meta_ranks"]
    # only the first shard group writes shards; the replicas write no duplicates
    assert meta["0"] and meta["1"] and not meta["2"] and not meta["3"]
    for rank in results:
        assert _max_diff(rank["loaded"], rank["saved"]) == 0.0
        assert _max_diff(rank["loaded_next"], rank["continued"]) < 1e-6
