"""zero-estimate against the engine: predicted model-state bytes match engine.memory_report()
within 2% for the example GPT at three sizes and stages 0-3 on 2 ranks (one spawn, swept inside),
the exact layout summary matches the engine's (stage-3 persistent unit included), and the comms
ledger of the same runs matches the expectation (2 Psi / 3 Psi, persistent parameters, GAS)."""

import json
import os
import sys

import pytest
import torch
from distributed import run_ranks

from zero import estimator

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples"))

SIZES = [(1, 32), (2, 48), (3, 64)]  # (n_layer, n_embd)
SEQ = 8


def _sweep():
    import torch
    from gpt import GPT, GPTConfig

    import zero
    from zero.monitor import comms_report, persistent_numel

    out = []
    for n_layer, n_embd in SIZES:
        for stage in range(4):
            torch.manual_seed(0)
            model = GPT(GPTConfig(block_size=SEQ, n_layer=n_layer, n_head=4, n_embd=n_embd))
            psi = model.num_parameters()
            config = {
                "train_micro_batch_size_per_gpu": 1,
                "gradient_accumulation_steps": 2,
                "bf16": {"enabled": True},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "comms_logger": {"enabled": True},
                "steps_per_print": 1000,
                "zero_optimization": {"stage": stage, "reduce_bucket_size": 20000},
            }
            engine, _, _, _ = zero.initialize(model=model, config=config)
            for _ in range(4):  # two optimizer steps: the ledger's last one is a steady step
                x = torch.randint(0, 256, (1, SEQ))
                engine.backward(engine(x, x))
                engine.step()
            report = engine.memory_report()
            persistent = persistent_numel(engine.gatherer)
            text, deviates = comms_report(
                engine.comm.ledger.last_step, psi, stage, 2, 0, persistent
            )
            seconds = sum(t.seconds for t in engine.comm.ledger.last_step.values())
            units = [
                (u.persistent, sum(b.layout.padded_numel for b in u.buckets))
                for u in (engine.gatherer.units if engine.gatherer else [])
            ]
            out.append((n_layer, n_embd, stage, psi, report, deviates, text, seconds, units))
    return out


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_sweep, 2, timeout=240)


def test_predicted_model_state_bytes_match_memory_report(runs):
    cluster = estimator.Cluster(nodes=1, devices_per_node=2)
    options = estimator.Options(dtype="bf16", bucket_numel=20000)
    for n_layer, n_embd, stage, psi, report, *_ in runs[0]:
        rows = estimator.estimate(psi, cluster, options)
        row = next(r for r in rows if r.stage == stage and not r.offload)
        measured = sum(report["measured"].values())
        assert abs(row.model_states - measured) <= 0.02 * measured, (n_layer, n_embd, stage)
        # The engine's own formula (exact padded Psi) reproduces the measurement exactly.
        assert report["measured"] == report["formula"], (n_layer, stage, report)


def test_model_layout_matches_engine(runs):
    from gpt import GPT, GPTConfig

    for n_layer, n_embd, stage, _, report, *_, units in runs[0]:
        with torch.device("meta"):
            model = GPT(GPTConfig(block_size=SEQ, n_layer=n_layer, n_head=4, n_embd=n_embd))
        options = estimator.Options(bucket_numel=20000)  # the default persistence threshold
        layout = estimator.model_layout(model, 1 if stage == 0 else 2, stage, options)
        assert layout.padded_numel == report["psi_padded"], (n_layer, stage)
        persistent = sum(n for is_persistent, n in units if is_persistent)
        others = sorted((n for is_persistent, n in units if not is_persistent), reverse=True)
        assert (layout.persistent_numel, list(layout.unit_numels)) == (persistent, others)


def test_comms_ledger_matches_expectation(runs):
    for rank_runs in runs:
        for n_layer, _, stage, _, report, deviates, text, seconds, _ in rank_runs:
            assert seconds > 0, text
            # Stage 3 with the default stage3_param_persistence_threshold (1e5): every parameter
            # of these small GPTs is persistent, GAS + 1 = 3 Psi instead of 3 GAS = 6.
            assert not deviates, f"layers {n_layer} stage {stage}:\n{text}"
            if stage == 3:
                padded = report["psi_padded"]
                line = next(ln for ln in text.splitlines() if "reduce_scatter" in ln)
                assert line.split()[5] == f"{2 * padded:,}", text  # every micro-batch


def test_cli_writes_recommended_config(tmp_path, capsys):
    path = tmp_path / "plan.json"
    argv = ["--params", "7.5e9", "--devices-per-node", "64", "--device-memory", "32G"]
    assert estimator.main([*argv, "--write-config", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "recommended: stage 2 without offload" in printed
    config = json.loads(path.read_text())
    assert config["zero_optimization"]["stage"] == 2 and config["bf16"] == {"enabled": True}


def test_cli_model_factory_and_sizes(capsys):
    kwargs = '{"in_features": 1000, "out_features": 999}'
    argv = ["--model", "torch.nn:Linear", "--model-kwargs", kwargs, "--devices-per-node", "2"]
    assert estimator.main(argv) == 0  # built on the meta device: no memory allocated
    assert "Psi = 999,999 parameters" in capsys.readouterr().out
    assert estimator.parse_size("80G") == 80 * 2**30 == estimator.parse_size("80GiB")
    with pytest.raises(ValueError, match="80 gigs"):
        estimator.parse_size("80 gigs")


def test_cli_activations_and_cpu_ranks(capsys):
    shape = ["--layers", "2", "--hidden", "64", "--seq-len", "32", "--micro-batch", "2"]
    argv = ["--params", "1e6", "--devices-per-node", "2", *shape, "--vocab-size", "256"]
    assert estimator.main([*argv, "--cpu-ranks"]) == 0
    assert "activations per device (L=2 h=64 s=32 b=2 V=256)" in capsys.readouterr().out
    with pytest.raises(ValueError, match="missing --vocab-size"):
        estimator.main(argv[:-2])
    options = estimator.Options(cpu=True, checkpointing=True)
    cluster = estimator.Cluster(devices_per_node=2)
    shape = estimator.TransformerShape(2, 64, 32, 2, 256)
    for row in estimator.estimate(10**6, cluster, options, shape=shape):
        assert row.per_host >= 2 * row.per_device  # CPU ranks: the node holds both processes
        assert row.offload or row.per_host == 2 * row.per_device
        assert row.peak.allocator > 0  # glibc retention of the uncheckpointed activations


def test_paper_table_reproduces_the_published_figures(capsys):
    # ZeRO paper, Table 1 (GB = 1e9 bytes): 7.5B parameters at N = 64, and 1T at N = 1024.
    assert estimator.main(["--paper"]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()}
    assert rows["64"][:4] == ["120", "31.4", "16.6", "1.88"]
    assert rows["1024"][11] == "15.6"
    assert rows["1"] == ["120"] * 4 + ["2048"] * 4 + ["16000"] * 4
    assert rows["256"][3] == "0.47" and rows["4"][2] == "41.3"


def test_grad_accum_dtype_flag_config_and_offer(tmp_path, capsys):
    base = ["--params", "7.5e9", "--devices-per-node", "64"]
    cluster = estimator.Cluster(devices_per_node=64)
    padded = estimator.padded_numel(64 * 10**6, 64, 10**12)  # one bucket, padded
    for accum, grad_bytes in (("bf16", 2), ("fp32", 4)):
        options = estimator.Options(grad_accum_dtype=accum, bucket_numel=10**12)
        row = next(r for r in estimator.estimate(64 * 10**6, cluster, options) if r.stage == 1)
        assert row.model_states == (2 + grad_bytes) * padded + 12 * (padded // 64)
    assert estimator.main([*base, "--grad-accum-dtype", "bf16"]) == 0
    assert "bf16 gradient accumulation (2-byte gradients)" in capsys.readouterr().out
    path = tmp_path / "zero.json"
    path.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 1,
                "bf16": {"enabled": True},
                "data_types": {"grad_accum_dtype": "bf16"},
            }
        )
    )
    assert estimator.main([*base, "--config", str(path)]) == 0
    assert "bf16 gradient accumulation" in capsys.readouterr().out
    with pytest.raises(ValueError, match="does not fit fp32 compute"):
        estimator.main([*base, "--dtype", "fp32", "--grad-accum-dtype", "bf16"])
    # 40G devices: fp32 accumulation needs stage 2 at N = 64; 2-byte gradients fit stage 1.
    assert estimator.main([*base, "--device-memory", "40G"]) == 0
    printed = capsys.readouterr().out
    assert "recommended: stage 2 without offload" in printed
    assert "grad_accum_dtype bf16" in printed and "stage 1 without offload fits" in printed


def test_stage3_comm_counts_units_kept_for_backward():
    # 1.5e9 parameters: the default stage3_max_reuse_distance (1e9) keeps the forward's last
    # 5e8 elements gathered into backward, so a third of the model is gathered once, not twice.
    cluster = estimator.Cluster(nodes=1, devices_per_node=8)
    for reuse, expected in ((10**9, 3 - 1 / 3), (0, 3.0)):
        options = estimator.Options(reuse_numel=reuse, persistence_threshold=0)
        row = next(r for r in estimator.estimate(1.5e9, cluster, options) if r.stage == 3)
        assert row.comm_psi == pytest.approx(expected, rel=1e-3), reuse
    # GAS 2: 3 * 2 * 0.9 + 3 * 0.1 - 2 * 0.5
    assert estimator.comm_psi(3, 2, persistent=0.1, kept=0.5) == pytest.approx(4.7)
