"""MiCS (stages 1-3) and hpZ (stage 3) on 4 gloo ranks as 2 simulated nodes of 2 ranks
(ZERO_RANKS_PER_NODE=2): parity with the flat run, the ledger's intra/inter-node split against
the formulas of partition/hierarchy.py, and a MiCS checkpoint loaded by a flat engine. MiCS's
two-level parameter all-gather (mics_hierarchical_params_gather, a shard group of all 4 ranks
spanning both nodes; comm/two_level.py) at stages 2 and 3, and TwoLevelGather on its own.

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
    two_level = {"mics_shard_size": WORLD, "mics_hierarchical_params_gather": True}
    cases += [(s, "two-level", two_level) for s in (2, 3)]
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
            "two_level": engine.partition_groups.two_level is not None,
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
    out["two_level_gather"] = _two_level_gathers(comm)
    out["interleaved"] = _interleaved_nodes_refused()
    return out


def _interleaved_nodes_refused() -> str:
    """partition_groups with the two-level gather over ranks whose nodes alternate (0, 1, 0, 1):
    the NotImplementedError's text (every rank raises before creating any group)."""
    from types import SimpleNamespace

    import zero
    from zero.partition.hierarchy import partition_groups

    comm = zero.comm.data_parallel_comm()
    comm.topology = zero.comm.Topology({r: r % 2 for r in range(WORLD)}, "a test")
    keys = SimpleNamespace(
        stage=3,
        mics_shard_size=WORLD,
        zero_hpz_partition_size=1,
        mics_hierarchical_params_gather=True,
    )
    with pytest.raises(NotImplementedError) as error:
        partition_groups(comm, keys)
    return str(error.value)


def _two_level_gathers(comm):
    """Three asynchronous two-level all-gathers waited in reverse order, and the same gathers
    flat: (bitwise equal, their ledgers' (elements, inter_elements))."""
    from zero.comm.two_level import TwoLevelGather

    gather = TwoLevelGather(*comm.node_groups())
    assert gather.rank == comm.rank and gather.world_size == WORLD
    flat_comm = comm.subgroup("flat", list(range(WORLD)))  # the same group: comm itself
    comm.ledger.end_step()
    shards = [
        torch.randn(n, generator=torch.Generator().manual_seed(comm.rank)) for n in (1, 6, 50)
    ]
    outputs = [torch.full((WORLD * s.numel(),), float("nan")) for s in shards]
    handles = [gather.all_gather(o, s, async_op=True) for o, s in zip(outputs, shards)]
    for handle in reversed(handles):
        handle.wait()
    handles[0].wait()  # idempotent
    comm.ledger.end_step()
    two_level = comm.ledger.last_step["all_gather"]
    expected = [torch.empty_like(o) for o in outputs]
    for e, s in zip(expected, shards):
        flat_comm.all_gather(e, s)
    comm.ledger.end_step()
    flat = comm.ledger.last_step["all_gather"]
    same = all(torch.equal(o, e) for o, e in zip(outputs, expected))
    return (
        same,
        (two_level.elements, two_level.inter_elements),
        (flat.elements, flat.inter_elements),
    )


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


@pytest.mark.parametrize("stage", [2, 3])
def test_two_level_gather_equals_flat(results, stage):
    """mics_hierarchical_params_gather with a shard group of s = k * l = 2 x 2 ranks: parameters
    equal the flat run's bitwise. Per all-gather of V elements the ledger counts V elements, as
    the flat gather, of which V (k - 1) / s = V / 4 cross nodes per rank (the flat gather: V (k
    - 1) / k = V / 2): the step's inter-node all-gather elements are 1/l of the flat run's."""
    nodes = WORLD // PER_NODE
    for rank in results:
        case, flat = rank["cases"][(stage, "two-level")], rank["cases"][(stage, "flat")]
        assert case["two_level"] and not flat["two_level"]
        assert case["num_shards"] == WORLD
        assert _max_diff(case["params"], flat["params"]) == 0.0
        gathered, flat_gathered = case["stats"]["all_gather"], flat["stats"]["all_gather"]
        assert gathered["elements"] == flat_gathered["elements"]
        assert gathered["inter_elements"] == gathered["elements"] * (nodes - 1) // WORLD
        assert flat_gathered["inter_elements"] == flat_gathered["elements"] * (nodes - 1) // nodes
        assert gathered["inter_bytes"] == 4 * gathered["inter_elements"]  # fp32 parameters
        # the other collectives are the flat run's
        for op in case["stats"]:
            if op != "all_gather":
                assert case["stats"][op] == flat["stats"][op], op
        if stage == 3:
            for phase in ("forward", "backward"):
                n, inter = case["phases"][phase]["all_gather"]
                assert n == flat["phases"][phase]["all_gather"][0] and inter * WORLD == n


def test_two_level_gather_alone(results):
    for rank in results:
        same, (elements, inter), (flat_elements, flat_inter) = rank["two_level_gather"]
        assert same
        assert elements == flat_elements == WORLD * (1 + 6 + 50)
        assert inter == elements // WORLD and flat_inter == flat_elements // 2


def test_two_level_gather_refuses_interleaved_nodes(results):
    for rank, result in enumerate(results):
        text = result["interleaved"]
        assert text.startswith(f"rank {rank}:") and "mics_hierarchical_params_gather" in text
        assert "[0, 1, 0, 1]" in text and "node by node" in text
