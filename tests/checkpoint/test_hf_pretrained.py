"""Hugging Face pretrained weights under ZeRO: from_pretrained inside zero.Init partitions the
model as it loads, zero.load_pretrained streams a safetensors checkpoint into plain, zero.Init and
engine models (stages 0, 2, 3), Engine.save_pretrained writes what from_pretrained reads back,
and zero-to-fp32 --hf writes the same from a stage-3 checkpoint.

The checkpoints are tiny Llama ("model." prefix, untied head) and GPT-2 ("transformer." prefix,
lm_head tied to the token embedding) models built from a config and saved in several files (no
download). One group of 2 ranks is spawned; every case runs inside it.
"""

import math
import os

import pytest
import torch
from distributed import run_ranks

pytest.importorskip("transformers")

VOCAB, SEQ, MICRO, STEPS = 64, 7, 2, 3
LR, BETAS, EPS = 1e-2, (0.9, 0.99), 1e-8


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )


def gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=0
    )


def make_checkpoints(root) -> dict:
    """Directories written by transformers' own save_pretrained (several files each)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    paths = {name: os.path.join(root, name) for name in ("llama", "gpt2", "gpt2_base", "missing")}
    torch.manual_seed(0)
    llama = AutoModelForCausalLM.from_config(llama_config())
    llama.save_pretrained(paths["llama"], max_shard_size="4KB")
    gpt2 = AutoModelForCausalLM.from_config(gpt2_config())
    gpt2.save_pretrained(paths["gpt2"], max_shard_size="4KB")
    gpt2.transformer.save_pretrained(paths["gpt2_base"])  # names without "transformer."
    llama.save_pretrained(paths["missing"])
    single = os.path.join(paths["missing"], "model.safetensors")
    tensors = load_file(single)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, single, metadata={"format": "pt"})
    return paths


def config(stage: int, bf16: bool = False) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 1000,
        "gradient_clipping": 0.0,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": 0.0},
        },
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 600,
            "stage3_param_persistence_threshold": 20,
            "stage3_module_granularity_threshold": 1200,
        },
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def tokens(steps=STEPS, world=2):
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, VOCAB, (steps, world, MICRO, SEQ), generator=g)


def logits_of(model, x):
    model.eval()
    with torch.no_grad():
        return model(input_ids=x).logits


def max_diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def file_tensors(path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


def file_bytes(path) -> int:
    return sum(v.numel() * v.element_size() for v in file_tensors(path).values())


def read_bound(path, world: int) -> tuple[int, int]:
    """(total, largest) bytes one rank may read for its parts of every tensor in `path`: its
    ceil(numel / N) elements plus two partial rows each."""
    from safetensors import safe_open

    total = largest = 0
    for name in os.listdir(path):
        if not name.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(path, name), framework="pt") as handle:
            for key in handle.keys():
                value = handle.get_tensor(key)
                row = value[0].numel() if value.dim() else 1
                size = (-(-value.numel() // world) + 2 * row) * value.element_size()
                total, largest = total + size, max(largest, size)
    return total, largest


# ----- the cases, run on every rank -----------------------------------------------------------
def init_from_pretrained(paths, out):
    """from_pretrained inside zero.Init: each rank holds only its slices, with the checkpoint's
    values, buffers (rotary inv_freq) as in an ordinary load, ties kept."""
    import transformers.modeling_utils as loader
    from transformers import AutoModelForCausalLM

    import zero
    from zero.init import gather_full, is_partitioned

    # the backends transformers' safe_open is called with: inside zero.Init, "pread" (each
    # tensor read into private memory, not the whole file mapped into every rank)
    backends, safe_open = [], loader.safe_open

    def recording(*args, **kwargs):
        backends.append(kwargs.get("backend"))
        return safe_open(*args, **kwargs)

    loader.safe_open = recording
    for name, ref_name in (("llama", "llama"), ("gpt2", "gpt2"), ("gpt2_base", "gpt2")):
        reference = AutoModelForCausalLM.from_pretrained(paths[ref_name])
        out[f"backends_{name}"] = [backends.copy()]
        backends.clear()
        with zero.Init(config=config(3)):
            model = AutoModelForCausalLM.from_pretrained(paths[name])
        out[f"backends_{name}"].append((backends.copy(), loader.safe_open is recording))
        backends.clear()
        slices, values = {}, {}
        for n, p in model.named_parameters():
            slices[n] = (
                is_partitioned(p),
                p.numel(),
                p.zero_shard.data.numel(),
                p.zero_shard.numel,
            )
            values[n] = torch.equal(gather_full(p), reference.get_parameter(n))
        buffers = {n: torch.equal(b, reference.get_buffer(n)) for n, b in model.named_buffers()}
        tied = getattr(model, "transformer", None)
        out[f"init_{name}"] = {
            "slices": slices,
            "values": values,
            "buffers": buffers,
            "tied": tied is None or model.lm_head.weight is tied.wte.weight,
        }
    loader.safe_open = safe_open


def init_engine_trains_like_a_single_process(paths, out):
    """zero.Init + from_pretrained -> stage-3 engine: the logits of the plain model; three
    training steps equal a single process on the global batch; save_pretrained of the trained
    engine loads back with the same logits."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import zero

    rank = dist.get_rank()
    data = tokens()
    x = data[0].flatten(0, 1)
    reference = AutoModelForCausalLM.from_pretrained(paths["llama"])
    want = logits_of(reference, x)
    with zero.Init(config=config(3)):
        model = AutoModelForCausalLM.from_pretrained(paths["llama"])
    engine, *_ = zero.initialize(model=model, config=config(3))
    out["engine_logits"] = max_diff(logits_of(engine, x), want)
    engine.train()
    reference.train()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, betas=BETAS, eps=EPS)
    optimizer.param_groups[0]["weight_decay"] = 0.0
    for batch in data:
        loss = engine(input_ids=batch[rank], labels=batch[rank]).loss
        engine.backward(loss)
        engine.step()
        optimizer.zero_grad()
        whole = batch.flatten(0, 1)
        reference(input_ids=whole, labels=whole).loss.backward()
        optimizer.step()
    with zero.GatheredParameters(list(engine.module.parameters())):
        out["trained"] = max(
            max_diff(p, reference.get_parameter(n)) for n, p in engine.module.named_parameters()
        )
    save_dir = os.path.join(paths["out"], "trained")
    engine.save_pretrained(save_dir, max_shard_size="3KB")
    back = AutoModelForCausalLM.from_pretrained(save_dir)
    out["trained_round_trip"] = (
        max_diff(logits_of(back, x), logits_of(engine, x)),
        max_diff(logits_of(back, x), logits_of(reference, x)),
    )
    out["trained_files"] = sorted(os.listdir(save_dir))


def load_into_engines(paths, out):
    """zero.load_pretrained into engines at stages 0, 2, 3 over randomly initialized models:
    the logits of the plain from_pretrained model; stage 3 reads only each rank's parts; the
    export round-trips (GPT-2: tied head, base checkpoint without the "transformer." prefix)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import zero

    x = tokens()[0].flatten(0, 1)
    for name, source in (("llama", "llama"), ("gpt2", "gpt2_base")):
        reference = AutoModelForCausalLM.from_pretrained(paths[name])
        want = logits_of(reference, x)
        for stage in (0, 2, 3):
            torch.manual_seed(100 + stage)
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(paths[name]))
            engine, *_ = zero.initialize(model=model, config=config(stage))
            result = zero.load_pretrained(engine, paths[source])
            save_dir = os.path.join(paths["out"], f"{name}_stage{stage}")
            engine.save_pretrained(save_dir, max_shard_size="3KB")
            back = AutoModelForCausalLM.from_pretrained(save_dir)
            out[f"load_{name}_stage{stage}"] = {
                "logits": max_diff(logits_of(engine, x), want),
                "result": result,
                "round_trip": max_diff(logits_of(back, x), want),
                "files": sorted(os.listdir(save_dir)),
                "saved_keys": sorted(file_tensors(save_dir)),
            }


def checkpoints_for_the_hf_export(paths, out):
    """Stage-3 engines (Llama; GPT-2 with its tied head) trained two steps, then
    save_checkpoint and save_pretrained; the trained engine's logits for the export check."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import zero

    rank = dist.get_rank()
    data = tokens(steps=2)
    x = data[0].flatten(0, 1)
    for name in ("llama", "gpt2"):
        with zero.Init(config=config(3)):
            model = AutoModelForCausalLM.from_pretrained(paths[name])
        engine, *_ = zero.initialize(model=model, config=config(3))
        for batch in data:
            engine.backward(engine(input_ids=batch[rank], labels=batch[rank]).loss)
            engine.step()
        engine.save_checkpoint(os.path.join(paths["out"], f"ckpt_{name}"))
        engine.save_pretrained(os.path.join(paths["out"], f"saved_{name}"), max_shard_size="3KB")
        out[f"checkpoint_{name}"] = logits_of(engine, x)


def bf16_engines_keep_the_files_precision(paths, out):
    """fp32 files into bf16 engines: the fp32 master weights take the file's values, so the
    default (fp32) export gives the files back bitwise, dtype="bf16" their bf16 cast; one
    max_shard_size above the model writes a single model.safetensors; files already in the
    directory stay, except earlier weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import zero

    original = file_tensors(paths["llama"])
    for stage in (2, 3):
        torch.manual_seed(5)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(paths["llama"]))
        engine, *_ = zero.initialize(model=model, config=config(stage, bf16=True))
        zero.load_pretrained(engine, paths["llama"])
        fp32_dir = os.path.join(paths["out"], f"bf16_stage{stage}_fp32")
        bf16_dir = os.path.join(paths["out"], f"bf16_stage{stage}_bf16")
        if engine.rank == 0:
            os.makedirs(fp32_dir)
            for name in ("tokenizer.json", "model-00001-of-00009.safetensors"):
                with open(os.path.join(fp32_dir, name), "w") as handle:
                    handle.write("{}")
        engine.save_pretrained(fp32_dir)
        engine.save_pretrained(bf16_dir, dtype="bf16")
        fp32, bf16 = file_tensors(fp32_dir), file_tensors(bf16_dir)
        out[f"bf16_stage{stage}"] = {
            "fp32_exact": fp32.keys() == original.keys()
            and all(torch.equal(fp32[k], v) for k, v in original.items()),
            "bf16_exact": all(torch.equal(bf16[k], v.bfloat16()) for k, v in original.items()),
            "files": sorted(os.listdir(fp32_dir)),
        }


def load_into_init_and_plain_models(paths, out):
    """zero.load_pretrained into zero.Init models (random values; on the meta device) and into
    plain ones (on the meta device; a base model from a checkpoint with a head)."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaModel

    import zero
    from zero.init import gather_full

    reference = AutoModelForCausalLM.from_pretrained(paths["gpt2"])
    for meta in (False, True):
        with zero.Init(config=config(3)), torch.device("meta" if meta else "cpu"):
            model = AutoModelForCausalLM.from_config(gpt2_config())
        result = zero.load_pretrained(model, paths["gpt2"])
        out[f"init_load_meta{meta}"] = {
            "values": all(
                torch.equal(gather_full(p), reference.get_parameter(n))
                for n, p in model.named_parameters()
            ),
            "numel": sum(p.numel() for p in model.parameters()),
            "meta": [n for n, p in model.named_parameters() if p.is_meta],
            "result": result,
        }
    with zero.Init(config=config(3)), torch.device("meta"):
        model = AutoModelForCausalLM.from_config(llama_config())
    try:
        zero.load_pretrained(model, paths["llama"])
        out["meta_buffers"] = None
    except ValueError as error:
        out["meta_buffers"] = str(error)
    x = tokens()[0].flatten(0, 1)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(gpt2_config())
    zero.load_pretrained(plain, paths["gpt2_base"])
    out["plain_meta"] = max_diff(logits_of(plain, x), logits_of(reference, x))
    base = LlamaModel(AutoConfig.from_pretrained(paths["llama"]))
    result = zero.load_pretrained(base, paths["llama"], strict=False)
    llama = AutoModelForCausalLM.from_pretrained(paths["llama"])
    out["base_from_head"] = (
        result.missing_keys,
        result.unexpected_keys,
        all(torch.equal(p, llama.model.get_parameter(n)) for n, p in base.named_parameters()),
    )


def errors(paths, out):
    """A missing key is an error naming it on every rank (strict) or returned (strict=False);
    values assigned under zero.Init that differ between ranks are an error on every rank."""
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    import zero
    from zero.init import is_partitioned

    for stage in (None, 3):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(paths["llama"]))
        target = model
        if stage is not None:
            target, *_ = zero.initialize(model=model, config=config(stage))
        try:
            zero.load_pretrained(target, paths["missing"])
            out[f"missing_{stage}"] = None
        except zero.CheckpointError as error:
            out[f"missing_{stage}"] = str(error)
    result = zero.load_pretrained(model, paths["missing"], strict=False)
    out["missing_not_strict"] = (result.missing_keys, result.unexpected_keys)
    try:
        with zero.Init(config=config(3)):
            layer = torch.nn.Linear(3, 3)
            layer.weight = torch.nn.Parameter(torch.full((3, 3), float(dist.get_rank())))
        out["differing_assignment"] = None
    except ValueError as error:
        out["differing_assignment"] = str(error)
    with zero.Init(config=config(3)):  # the failed context is closed: a new one works
        layer = torch.nn.Linear(3, 3)
    out["init_after_error"] = is_partitioned(layer.weight)


def sweep(paths):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    out = {}
    for case in (
        init_from_pretrained,
        init_engine_trains_like_a_single_process,
        load_into_engines,
        checkpoints_for_the_hf_export,
        bf16_engines_keep_the_files_precision,
        load_into_init_and_plain_models,
        errors,
    ):
        case(paths, out)
    return out


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    paths = make_checkpoints(str(root))
    paths["out"] = str(root / "out")
    return paths, run_ranks(sweep, 2, paths, timeout=280)


# ----- the checks -----------------------------------------------------------------------------
def test_from_pretrained_under_init_keeps_only_each_ranks_slice(per_rank):
    _, results = per_rank
    for res in results:
        for name in ("llama", "gpt2", "gpt2_base"):
            case = res[f"init_{name}"]
            assert all(case["values"].values()), (name, case["values"])
            assert case["buffers"] and all(case["buffers"].values()) or name != "llama", case
            assert case["tied"], name
            for param, (partitioned, numel, kept, full) in case["slices"].items():
                assert partitioned and numel == 0, param
                assert kept == -(-full // 2), param
            outside, (inside, restored) = res[f"backends_{name}"]
            assert set(outside) == {"mmap"} and set(inside) == {"pread"}, (outside, inside)
            assert restored, name


def test_init_engine_matches_plain_model_and_single_process_training(per_rank):
    _, results = per_rank
    for res in results:
        assert res["engine_logits"] <= 1e-5
        assert res["trained"] <= 1e-5
        back_vs_engine, back_vs_reference = res["trained_round_trip"]
        assert back_vs_engine <= 1e-5 and back_vs_reference <= 1e-5
        assert "model.safetensors.index.json" in res["trained_files"]
        assert "config.json" in res["trained_files"]


def test_load_pretrained_into_engines_at_stages_0_2_3(per_rank):
    paths, results = per_rank
    for res in results:
        for name in ("llama", "gpt2"):
            for stage in (0, 2, 3):
                case = res[f"load_{name}_stage{stage}"]
                assert case["logits"] <= 1e-5, (name, stage, case["logits"])
                assert case["round_trip"] <= 1e-5, (name, stage)
                assert case["result"].missing_keys == [] == case["result"].unexpected_keys
                shards = [f for f in case["files"] if f.startswith("model-")]
                assert len(shards) > 1 and "model.safetensors.index.json" in case["files"]
        gpt2_keys = res["load_gpt2_stage3"]["saved_keys"]
        assert "transformer.wte.weight" in gpt2_keys and "lm_head.weight" not in gpt2_keys
        for stage in (0, 2):  # every tensor whole, once
            result = res[f"load_llama_stage{stage}"]["result"]
            assert result.bytes_read == file_bytes(paths["llama"])


def test_zero_to_fp32_hf_export_of_a_checkpoint(per_rank, tmp_path, capsys):
    """zero-to-fp32 --hf: a stage-3 checkpoint in HF's layout gives the trained engine's logits
    and the tensors save_pretrained wrote (tied head dropped); config.json from --config-from,
    or from the checkpoint directory; without one, an error that names the option."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    from zero.zero_to_fp32 import main

    paths, results = per_rank
    x = tokens(steps=2)[0].flatten(0, 1)
    for name in ("llama", "gpt2"):
        checkpoint, out = os.path.join(paths["out"], f"ckpt_{name}"), tmp_path / name
        argv = [checkpoint, str(out), "--hf", "--config-from", paths[name]]
        assert main([*argv, "--max_shard_size", "3KB"]) == 0
        files = sorted(os.listdir(out))
        assert "config.json" in files and "model.safetensors.index.json" in files
        assert len([f for f in files if f.startswith("model-")]) > 1
        back = AutoModelForCausalLM.from_pretrained(out)
        assert max_diff(logits_of(back, x), results[0][f"checkpoint_{name}"]) <= 1e-6, name
        exported = file_tensors(out)
        saved = file_tensors(os.path.join(paths["out"], f"saved_{name}"))
        assert exported.keys() == saved.keys(), name
        assert all(torch.equal(exported[k], saved[k]) for k in saved), name
    assert "lm_head.weight" not in exported and "transformer.wte.weight" in exported
    # config.json beside the checkpoint (model.config.save_pretrained(save_dir)); bf16 output
    copy = tmp_path / "ckpt_with_config"
    shutil.copytree(os.path.join(paths["out"], "ckpt_llama"), copy)
    AutoConfig.from_pretrained(paths["llama"]).save_pretrained(copy)
    assert main([str(copy), str(tmp_path / "bf16"), "--hf", "--dtype", "bf16"]) == 0
    assert {v.dtype for v in file_tensors(tmp_path / "bf16").values()} == {torch.bfloat16}
    assert main([checkpoint, str(tmp_path / "none"), "--hf"]) == 2
    assert "pass --config-from MODEL_DIR" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()


def test_loading_reads_only_each_ranks_part_under_stage_3_and_init(per_rank):
    """The peak bytes held while loading: stage 3 and zero.Init read at most each tensor's
    1/N part plus two partial rows (largest_read), half the checkpoint in all; stages 0-2 read
    each tensor whole, one at a time."""
    paths, results = per_rank
    llama_total, llama_largest = read_bound(paths["llama"], 2)
    gpt2_total, gpt2_largest = read_bound(paths["gpt2"], 2)
    for res in results:
        stage3 = res["load_llama_stage3"]["result"]
        assert (
            stage3.largest_read <= llama_largest < res["load_llama_stage0"]["result"].largest_read
        )
        assert stage3.bytes_read <= llama_total
        for meta in (False, True):
            init = res[f"init_load_meta{meta}"]["result"]
            assert init.largest_read <= gpt2_largest and init.bytes_read <= gpt2_total


def test_load_pretrained_into_init_and_plain_models(per_rank):
    _, results = per_rank
    for res in results:
        for meta in (False, True):
            case = res[f"init_load_meta{meta}"]
            assert case["values"] and case["numel"] == 0 and case["meta"] == [], (meta, case)
        assert "model.rotary_emb.inv_freq" in res["meta_buffers"]
        assert "non-persistent" in res["meta_buffers"]
        assert res["plain_meta"] <= 1e-6
        missing, unexpected, equal = res["base_from_head"]
        assert missing == [] and unexpected == ["lm_head.weight"] and equal


def test_bf16_engines_export_the_fp32_master_weights(per_rank):
    _, results = per_rank
    for res in results:
        for stage in (2, 3):
            case = res[f"bf16_stage{stage}"]
            assert case["fp32_exact"] and case["bf16_exact"], stage
            # one file when it fits; the tokenizer stays, the stale shard is gone
            assert case["files"] == [
                "config.json",
                "generation_config.json",
                "model.safetensors",
                "tokenizer.json",
            ]


def test_missing_keys_and_differing_assignments_are_errors(per_rank):
    _, results = per_rank
    for res in results:
        for stage in (None, 3):
            message = res[f"missing_{stage}"]
            assert "missing keys ['model.layers.1.mlp.up_proj.weight']" in message, message
        assert res["missing_not_strict"] == (["model.layers.1.mlp.up_proj.weight"], [])
        assert "differ between ranks" in res["differing_assignment"]
        assert res["init_after_error"]


def test_a_file_in_another_layout_names_some_keys_and_the_way_to_load_it(tmp_path):
    """Missing and unexpected keys together (a checkpoint whose tensors transformers converts
    while loading): the message lists a few keys of each, how many more, and what to do."""
    from safetensors.torch import save_file

    from zero.hf import CheckpointError, load_pretrained

    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(6)])
    save_file({f"{k}.old": v for k, v in model.state_dict().items()}, tmp_path / "m.safetensors")
    with pytest.raises(CheckpointError) as raised:
        load_pretrained(model, tmp_path / "m.safetensors")
    message = str(raised.value)
    assert "missing keys ['0.weight', '0.bias', " in message and " and 4 more;" in message
    assert "unexpected keys ['0.bias.old', " in message, message
    assert "from_pretrained inside zero.Init" in message, message


def test_shard_writer_files_read_back_with_safetensors(tmp_path):
    """The streamed writer's files are what safetensors reads (dtypes, empty and 0-d tensors,
    a tensor larger than the shard size alone in its file)."""
    from safetensors.torch import load_file

    from zero.checkpoint.safetensors_io import ShardedWriter

    values = {
        "a": torch.randn(3, 5),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.randn(2, 2).bfloat16(),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(3.5, dtype=torch.float16),
        "big": torch.randn(40),
        "flag": torch.tensor([True, False]),
    }
    entries = [(k, tuple(v.shape), v.dtype) for k, v in values.items()]
    writer = ShardedWriter(str(tmp_path), entries, max_shard_bytes=100)
    for name, value in values.items():
        writer.write(name, value)
    files = writer.close()
    assert "model.safetensors.index.json" in files and len(files) > 3
    back = {}
    for name in files[:-1]:
        back.update(load_file(tmp_path / name))
    assert back.keys() == values.keys()
    assert all(torch.equal(back[k], v) for k, v in values.items())
    assert math.prod(back["big"].shape) == 40
