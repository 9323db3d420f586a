"""Consolidation in bounded memory ([Note: consolidation in bounded memory] in
checkpoint/consolidation.py, [Note: export] in checkpoint/hf.py): zero-to-fp32,
convert_zero_checkpoint_to_fp32_state_dict and engine.save_pretrained run under an RLIMIT_DATA
cap of 1.5x the largest tensor plus 64 MiB above what the process already holds, about half the
model, and write bitwise the model's values."""

import json
import os
import resource
from pathlib import Path

import torch
from distributed import run_ranks
from safetensors.torch import load_file

MIB = 2**20
NUM_LAYERS, WIDTH = 48, 512  # 48 Linear(512 -> 1024) weights of 2 MiB: 96 MiB of fp32
LARGEST = 2 * WIDTH * WIDTH * 4
CAP = int(1.5 * LARGEST) + 64 * MIB  # 67 MiB, 0.7x the model


class Wide(torch.nn.Module):
    """Many equal tensors, one tied to another, a frozen layer and an integer buffer."""

    def __init__(self):
        super().__init__()
        make = lambda: torch.nn.Linear(WIDTH, 2 * WIDTH, bias=False)  # noqa: E731
        self.layers = torch.nn.ModuleList(make() for _ in range(NUM_LAYERS))
        self.head = make()
        self.head.weight = self.layers[0].weight
        self.frozen = torch.nn.Linear(4, 3).requires_grad_(False)
        self.register_buffer("counts", torch.arange(5))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)[..., :WIDTH]
        return x


def _data_bytes() -> int:
    """VmData: the address space RLIMIT_DATA counts (heap, anonymous and private writable
    mappings), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmData:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmData in /proc/self/status")


class data_capped:
    """RLIMIT_DATA at the current VmData + `extra` bytes inside, restored on exit."""

    def __init__(self, extra: int):
        self.extra = extra

    def __enter__(self):
        self.saved = resource.getrlimit(resource.RLIMIT_DATA)
        resource.setrlimit(resource.RLIMIT_DATA, (_data_bytes() + self.extra, self.saved[1]))

    def __exit__(self, *exc):
        resource.setrlimit(resource.RLIMIT_DATA, self.saved)


def consolidate_capped(root: str):
    """2 ranks: save a stage-2 checkpoint (one bucket holds the whole model), then, capped,
    rank 0 runs zero-to-fp32 and DeepSpeed's convert function, and both ranks save_pretrained.
    Returns rank 0's name -> (file tensor equals the model's) per output."""
    import zero
    from zero import zero_to_fp32

    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 10**9},
    }
    engine, _, _, _ = zero.initialize(model=Wide(), config=config)
    engine.save_checkpoint(root, tag="t")
    checkpoint, out = os.path.join(root, "t"), Path(root, "out")
    out.mkdir(exist_ok=True)
    rank0 = engine.comm.rank == 0
    with data_capped(CAP):
        if rank0:
            assert zero_to_fp32.main([checkpoint, str(out / "cmd.safetensors")]) == 0
            zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(
                checkpoint, out / "convert", max_shard_size="30MB", safe_serialization=True
            )
        engine.save_pretrained(out / "pretrained")
    if not rank0:
        return None
    expected = engine.module.state_dict()
    results = {}
    for name, files in (
        ("cmd", [out / "cmd.safetensors"]),
        ("convert", sorted((out / "convert").glob("*.safetensors"))),
        ("pretrained", [out / "pretrained" / "model.safetensors"]),
    ):
        saved = {k: v for file in files for k, v in load_file(file).items()}
        results[name] = {k: torch.equal(v, expected[k]) for k, v in saved.items()}
    index = json.loads((out / "convert" / "model.safetensors.index.json").read_text())
    results["convert_files"] = sorted(set(index["weight_map"].values()))
    return results


def test_consolidation_and_save_pretrained_fit_under_a_data_cap(tmp_path):
    results = run_ranks(consolidate_capped, 2, str(tmp_path), timeout=120)[0]
    names = {f"layers.{i}.weight" for i in range(NUM_LAYERS)}
    names |= {"frozen.weight", "frozen.bias", "counts"}
    assert results["cmd"] == dict.fromkeys(names | {"head.weight"}, True)
    assert results["convert"] == dict.fromkeys(names | {"head.weight"}, True)
    assert results["pretrained"] == dict.fromkeys(names, True)  # the tie once, as HF saves it
    assert len(results["convert_files"]) == 4  # 30 MB shards of the 103 MB state dict
