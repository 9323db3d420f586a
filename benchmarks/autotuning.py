"""zrun --autotuning against hand-picked configs, and the planner's predictions against what the
trials measured (docs/tuning.md).

    python benchmarks/autotuning.py gpt --ranks 2 --out /tmp/tune_gpt
    python benchmarks/autotuning.py hf --ranks 2 --out /tmp/tune_hf     (needs transformers)

1. tunes (zrun --autotuning tune; `hf` through zero-as-deepspeed's `deepspeed --autotuning`)
   with a per-rank memory budget, so the planner drops some candidates;
2. runs every candidate the planner dropped anyway, to see whether it would have exceeded the
   budget (the planner's verdict checked against a measurement);
3. measures the tuned config and the hand-picked ones (configs/zero0..3.json and the
   offload config, as shipped) the same way, over a window of --compare_steps optimizer steps
   (each step timed, the median kept), each --repeats times, alternating, and prints the
   medians and each one's ratio to the tuned config.
Timings hold for the machine that ran them; on a shared machine repeat before comparing.
"""

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from zero.config import read_mapping
from zero.launcher.autotuning import trials
from zero.launcher.autotuning.space import Candidate, candidate_config

ROOT = Path(__file__).resolve().parent.parent
HAND_PICKED = ("zero0", "zero1", "zero2", "zero3", "zero2_offload")
WINDOW = {"start_profile_step": 2, "end_profile_step": 5}  # the search's (DeepSpeed's is 3-5)
SCRIPT_STEPS = 120  # room for finalist rounds and the comparison's window


def gpt_workload(out: Path, args) -> tuple[list[str], list[str], dict]:
    """(command prefix, script and its args with CONFIG for the config path, base config)."""
    corpus = out / "corpus.txt"
    corpus.write_text((ROOT / "examples" / "gpt.py").read_text() * 20)
    script = [str(ROOT / "examples" / "train.py"), "--config", "CONFIG", "--data", str(corpus)]
    script += ["--n_layer", "2", "--n_embd", "64", "--n_head", "4", "--block_size", "64"]
    script += ["--steps", str(SCRIPT_STEPS), "--eval_batches", "1"]
    base = read_mapping(ROOT / "configs" / "zero2.json")
    return [sys.executable, "-m", "zero.launcher", "--num_gpus", str(args.ranks)], script, base


def hf_workload(out: Path, args) -> tuple[list[str], list[str], dict]:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model_dir = out / "tiny_llama"
    transformers.LlamaForCausalLM(config).save_pretrained(model_dir)
    program = ROOT / "tests" / "integrations" / "programs" / "trainer_program.py"
    script = [str(program), "--model_dir", str(model_dir), "--output_dir", str(out / "trainer")]
    script += ["--deepspeed", "CONFIG", "--max_steps", str(SCRIPT_STEPS), "--num_samples", "512"]
    script += ["--seq_len", "32", "--per_device_train_batch_size", "16", "--report_to", "none"]
    script += ["--save_strategy", "no", "--logging_steps", "100", "--use_cpu"]
    base = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "zero_optimization": {"stage": 2},
    }
    doorway = [sys.executable, "-m", "zero.integrations.doorway_cli", "deepspeed"]
    return [*doorway, "--num_gpus", str(args.ranks)], script, base


def hand_picked(name: str, base: dict, hf: bool) -> dict:
    config = read_mapping(ROOT / "configs" / f"{name}.json")
    if hf:  # the Trainer builds the optimizer and schedule from its own flags
        config.pop("optimizer", None)
        config.pop("scheduler", None)
        for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            config[key] = "auto"
    return config


def measure(prefix, script, config, directory: Path, arg_mappings=None, window=WINDOW):
    """One trial (the tuner's own machinery) of `config` over `window`; its record or None."""
    directory.mkdir(parents=True, exist_ok=True)
    config = dict(config, autotuning=dict(config.get("autotuning") or {}, **window))
    path = directory / "config.json"
    path.write_text(json.dumps(config))
    args = [str(path) if word == "CONFIG" else word for word in script]
    args = trials.script_args_for(args, str(path), config, arg_mappings)
    command = [*prefix, "--master_port", "0", *args]
    env = dict(os.environ, **{trials.METRICS_ENV: str(directory / "metrics")})
    with open(directory / "log.txt", "w") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=900)
    return trials.merged_record(str(directory / "metrics"))


def tune(prefix, script, base, out: Path, args) -> float:
    block = {
        **WINDOW,
        "max_train_micro_batch_size_per_gpu": args.max_micro_batch,
        "num_tuning_micro_batch_sizes": args.sizes,
        "max_memory_per_rank": args.budget,
        "results_dir": str(out / "results"),
        "exps_dir": str(out / "exps"),
        "tuner_early_stopping": 100,
    }
    if args.workload == "hf":
        block["arg_mappings"] = {
            "train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
            "gradient_accumulation_steps": "--gradient_accumulation_steps",
        }
    config = dict(base, autotuning=block)
    config["zero_optimization"] = dict(base.get("zero_optimization") or {})
    config["zero_optimization"].pop("stage", None)  # all stages
    config["train_micro_batch_size_per_gpu"] = "auto" if args.workload == "hf" else 1
    path = out / "tune_config.json"
    path.write_text(json.dumps(config))
    command = [*prefix[:-2], "--autotuning", "tune", *prefix[-2:]]
    command += [str(path) if word == "CONFIG" else word for word in script]
    start = time.perf_counter()
    subprocess.run(command, check=True)
    return time.perf_counter() - start


def check_dropped(prefix, script, out: Path, arg_mappings) -> list[tuple]:
    """Run each dropped candidate anyway: (name, predicted GiB, measured GiB or None)."""
    with open(out / "results" / "results.csv") as handle:
        rows = list(csv.DictReader(handle))
    checked = []
    for row in rows:
        if row["status"] != "dropped":
            continue
        bucket = int(float(row["bucket"])) if row["bucket"] else None
        candidate = Candidate(
            int(row["stage"]), row["offload"], int(row["micro_batch"]), int(row["gas"]), bucket
        )
        config = candidate_config(read_mapping(out / "tune_config.json"), candidate)
        record = measure(prefix, script, config, out / "dropped" / row["candidate"], arg_mappings)
        peak = None if record is None else record["peak_bytes"] / 2**30
        checked.append((row["candidate"], float(row["predicted_peak_GiB"]), peak))
    return checked


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", choices=("gpt", "hf"))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget", default="0.75G", help="autotuning.max_memory_per_rank")
    parser.add_argument("--max_micro_batch", type=int, default=256)
    parser.add_argument("--sizes", type=int, default=4, help="num_tuning_micro_batch_sizes")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--compare_steps", type=int, default=100, help="steps each comparison times"
    )
    parser.add_argument("--skip_tune", action="store_true", help="reuse --out's tune results")
    parser.add_argument("--skip_dropped", action="store_true", help="do not run dropped ones")
    parser.add_argument("--hand_picked", default=",".join(HAND_PICKED), help="configs/NAME list")
    args = parser.parse_args()
    out = Path(args.out)
    if not args.skip_tune:
        shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    hf = args.workload == "hf"
    prefix, script, base = (hf_workload if hf else gpt_workload)(out, args)
    # The HF program's --per_device_train_batch_size must agree with an explicit micro-batch.
    mappings = {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size"} if hf else None
    if not args.skip_tune:
        print(f"load {_load()}; tuning took {tune(prefix, script, base, out, args):.1f} s")
        print(f"load after the tune {_load()}")
    limit = 0.8 * float(args.budget.rstrip("G"))
    dropped = [] if args.skip_dropped else check_dropped(prefix, script, out, mappings)
    for name, predicted, measured in dropped:
        verdict = "n/a" if measured is None else ("right" if measured > limit else "WRONG")
        print(f"dropped {name}: predicted {predicted:.3f} GiB, measured {measured} GiB: {verdict}")
    with open(out / "results" / "results.csv") as handle:
        for row in csv.DictReader(handle):
            if row["measured_peak_GiB"]:
                fits = float(row["measured_peak_GiB"]) <= limit
                print(
                    f"ran {row['candidate']}: predicted {row['predicted_peak_GiB']} GiB, "
                    f"measured {row['measured_peak_GiB']} GiB: {'right' if fits else 'WRONG'}"
                )
    optimal = json.loads((out / "results" / "ds_config_optimal.json").read_text())
    contestants = {"tuned": optimal} | {
        n: hand_picked(n, base, hf) for n in args.hand_picked.split(",")
    }
    results = {name: [] for name in contestants}
    window = {"start_profile_step": 3, "end_profile_step": 3 + args.compare_steps}
    for repeat in range(args.repeats):
        for name, config in contestants.items():
            directory = out / "compare" / f"{name}.{repeat}"
            record = measure(prefix, script, config, directory, mappings if hf else None, window)
            results[name].append(record["samples_per_s"] if record else float("nan"))
            print(f"{name} run {repeat + 1}: {results[name][-1]:.2f} samples/s, load {_load()}")
    tuned = statistics.median(results["tuned"])
    for name, values in results.items():
        config = contestants[name]
        stage = config.get("zero_optimization", {}).get("stage")
        median = statistics.median(values)
        print(
            f"{name:<14} stage {stage} micro-batch {config.get('train_micro_batch_size_per_gpu')}"
            f": median {median:.2f} samples/s ({median / tuned:.3f} of tuned) over "
            + ", ".join(f"{v:.2f}" for v in values)
        )


if __name__ == "__main__":
    main()
