"""Generation and adapters at ZeRO stage 3, on 2 ranks (one spawned group sweeps every case):

- engine.generate() of T5 and BART (whose generate() runs the encoder directly, its embedding
  tied to `shared.weight`) and of a decoder-only Llama with tied embeddings returns the tokens of
  a single-process reference (greedy), with each rank generating its own prompt to its own
  length; it prefetches, and gathers per fetch unit, never the whole model.
- model.generate() on the raw module: with synced_gpus=True it matches too; left to
  transformers' default (synced_gpus=False) it raises on every rank within seconds, naming
  synced_gpus; with every parameter held by zero.GatheredParameters it needs no synced_gpus.
- DeepSpeed's idiom for saving a peft adapter (GatheredParameters over the adapter's
  parameters on every rank, save_pretrained on rank 0 alone) writes the adapter at once, and
  training goes on.
- LoRA on stacked experts (Mixtral's 3-D expert weights, reached by peft's "all-linear") trains
  at stage 3 as a single process does, whether the experts are a fetch unit of their own or part
  of a larger one; frozen experts used by the LoRA wrapper around them are released after their
  forward, not kept until backward.
- A custom decoding loop that one rank leaves early: the rank left waiting stops after
  agreement_timeout with an error that says so.
"""

import os
import time

import pytest
import torch
from distributed import abandon_group, run_ranks

PROMPTS = ([[5, 6, 7, 8, 9]], [[11, 12, 13]])  # rank r generates PROMPTS[r]
NEW_TOKENS = (3, 8)  # so the ranks finish at different steps
GREEDY = {"do_sample": False, "no_repeat_ngram_size": 1}  # varied tokens from a tiny model


def _config(**zero_optimization):
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
        "agreement_timeout": 20,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_module_granularity_threshold": 300,  # several units per model
            "stage3_prefetch_bucket_size": 700,
            **zero_optimization,
        },
    }


def _perturbed(model):
    """Weights far from their tiny init, so greedy decoding does not repeat one token."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.5)
    return model


def _t5():
    from transformers import AutoModelForSeq2SeqLM, T5Config

    config = T5Config(
        vocab_size=48,
        d_model=16,
        d_kv=4,
        d_ff=32,
        num_layers=2,
        num_heads=2,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    return _perturbed(AutoModelForSeq2SeqLM.from_config(config))


def _bart():
    from transformers import AutoModelForSeq2SeqLM, BartConfig

    config = BartConfig(
        vocab_size=48,
        d_model=16,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=64,
        forced_bos_token_id=None,
        forced_eos_token_id=None,
    )
    torch.manual_seed(0)
    return _perturbed(AutoModelForSeq2SeqLM.from_config(config))


def _llama():
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=48,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    return _perturbed(AutoModelForCausalLM.from_config(config))


def _mixtral():
    from transformers import AutoModelForCausalLM, MixtralConfig

    config = MixtralConfig(
        vocab_size=48,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def _case(fn, *args):
    """fn(*args), or the failure's text: one case failing leaves the others to be checked."""
    import traceback

    try:
        return fn(*args)
    except Exception:
        return traceback.format_exc()[-3000:]


# ----- generate ---------------------------------------------------------------------------
def _gathered_peak(engine) -> dict:
    """Counts, while generating, the most units gathered at once (pre-hooks on every module)."""
    units = [u for u in engine.gatherer.units if not u.persistent]
    seen = {"peak": 0, "units": len(units)}

    def count(module, args):
        gathered = sum(u.state.value != "sharded" for u in units)
        seen["peak"] = max(seen["peak"], gathered)

    seen["handles"] = [m.register_forward_pre_hook(count) for m in engine.module.modules()]
    return seen


def generate_matches_reference(build):
    import zero

    rank = int(os.environ["RANK"])
    ids, kwargs = torch.tensor(PROMPTS[rank]), {"max_new_tokens": NEW_TOKENS[rank], **GREEDY}
    with torch.no_grad():
        want = build().eval().generate(ids, **kwargs)
    engine, _, _, _ = zero.initialize(model=build(), config=_config())
    engine.eval()
    seen = _gathered_peak(engine)
    hits = engine.gatherer.prefetch_hits
    got = engine.generate(ids, **kwargs)
    for handle in seen.pop("handles"):
        handle.remove()
    raw = engine.module.generate(ids, synced_gpus=True, **kwargs)
    return {
        "want": want.tolist(),
        "got": got.tolist(),
        "raw": raw.tolist(),
        "peak": seen["peak"],
        "units": seen["units"],
        "prefetched": engine.gatherer.prefetch_hits - hits,
        "released": all(p.numel() == 0 for p in engine.module.parameters()),
    }


def unsynced_generate():
    import zero

    rank = int(os.environ["RANK"])
    ids, kwargs = torch.tensor(PROMPTS[rank]), {"max_new_tokens": NEW_TOKENS[rank], **GREEDY}
    with torch.no_grad():
        want = _t5().eval().generate(ids, **kwargs)
    engine, _, _, _ = zero.initialize(model=_t5(), config=_config())
    engine.eval()
    start = time.monotonic()
    try:
        engine.module.generate(ids, **kwargs)  # transformers' default: synced_gpus=False
        refused = None
    except ValueError as error:
        refused = str(error)
    seconds = time.monotonic() - start
    with zero.GatheredParameters(list(engine.module.parameters())):
        held = engine.module.generate(ids, synced_gpus=False, **kwargs)
    again = engine.generate(ids, **kwargs)  # the engine is usable after the refusal
    return {
        "refused": refused,
        "seconds": seconds,
        "held": held.tolist() == want.tolist(),
        "again": again.tolist() == want.tolist(),
    }


# ----- peft adapters ----------------------------------------------------------------------
def _lora(model, **lora):
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(r=2, **lora))


def save_adapter_idiom(directory):
    import torch.distributed as dist

    import zero

    rank = int(os.environ["RANK"])
    model = _lora(_llama(), target_modules=["q_proj", "v_proj"])
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = zero.initialize(model=model, model_parameters=trainable, config=_config())
    ids = torch.tensor(PROMPTS[rank])
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    named = [(n, p) for n, p in engine.module.named_parameters() if "lora_" in n]
    start = time.monotonic()
    with zero.GatheredParameters([p for _, p in named]):
        if rank == 0:
            engine.module.save_pretrained(directory)
        expected = {n.replace(".default.", "."): p.detach().clone() for n, p in named}
    seconds = time.monotonic() - start
    engine.backward(engine(input_ids=ids, labels=ids).loss)  # training goes on
    engine.step()
    dist.barrier()
    from safetensors.torch import load_file

    saved = load_file(os.path.join(directory, "adapter_model.safetensors"))
    same = saved.keys() == expected.keys() and all(
        torch.equal(saved[k], v) for k, v in expected.items()
    )
    return {"seconds": seconds, "same": same, "adapters": len(saved)}


def _moe_batches():
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, 48, (1, 6), generator=generator) for _ in range(2)]


def _moe_lora():
    # "all-linear" reaches the stacked experts' 3-D weights through peft's ParamWrapper (one
    # per weight, nested), as target_parameters=["experts.gate_up_proj", ...] does.
    return _lora(_mixtral(), target_modules="all-linear")


def stacked_experts_lora(threshold):
    """Two steps of LoRA on stacked experts; the adapters' largest difference from a single
    process stepping on both ranks' batches."""
    import zero

    rank = int(os.environ["RANK"])
    batches = _moe_batches()
    reference = _moe_lora()
    params = [p for p in reference.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    model = _moe_lora()
    config = _config(stage3_module_granularity_threshold=threshold, stage3_max_reuse_distance=0)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = zero.initialize(model=model, model_parameters=trainable, config=config)
    for _ in range(2):
        losses = [reference(input_ids=b, labels=b).loss for b in batches]
        (sum(losses) / len(losses)).backward()
        optimizer.step()
        optimizer.zero_grad()
        ids = batches[rank]
        loss = engine(input_ids=ids, labels=ids).loss
        # The frozen experts, used by the LoRA wrapper around their unit, are not pinned until
        # backward: every layer's experts gathered at once would be the whole model's.
        kept = [u.name for u in engine.gatherer.units if u.frozen and u.state.value != "sharded"]
        engine.backward(loss)
        engine.step()
    want = {n: p for n, p in reference.named_parameters() if p.requires_grad}
    got = [(n, p) for n, p in engine.module.named_parameters() if n in want]
    with zero.GatheredParameters([p for _, p in got]):
        difference = max((p - want[n]).abs().max().item() for n, p in got)
    experts = sum("experts" in n for n, _ in got)
    return {"difference": difference, "experts": experts, "kept": kept}


# ----- a custom decoding loop that one rank leaves ------------------------------------------
def loop_left_early():
    import zero

    rank = int(os.environ["RANK"])
    config = _config()
    config["agreement_timeout"] = 3
    engine, _, _, _ = zero.initialize(model=_llama(), config=config)
    engine.eval()
    ids = torch.tensor([[5, 6, 7]])
    start = time.monotonic()
    try:
        with torch.no_grad():
            for _ in range(2 + rank):  # rank 1 wants one more token than rank 0
                token = engine.module(ids).logits[:, -1].argmax(-1, keepdim=True)
                ids = torch.cat([ids, token], dim=1)
        if rank == 0:
            time.sleep(6)  # busy elsewhere, beyond agreement_timeout
        message = None
    except zero.RankMismatchError as error:
        message = str(error)
    abandon_group()  # rank 1's all-gather check is left in flight
    return {"message": message, "seconds": time.monotonic() - start}


def generation_group(directory):
    torch.manual_seed(0)
    out = {name: _case(generate_matches_reference, b) for name, b in _MODELS.items()}
    out["unsynced"] = _case(unsynced_generate)
    out["adapter"] = _case(save_adapter_idiom, directory)
    out["experts"] = {t: _case(stacked_experts_lora, t) for t in (400, 10**6)}
    out["loop"] = _case(loop_left_early)  # last: it leaves the group unusable
    return out


_MODELS = {"t5": _t5, "bart": _bart, "llama": _llama}


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("adapter"))
    return run_ranks(generation_group, 2, directory, timeout=180)


def _result(out, key):
    assert isinstance(out[key], dict), out[key]  # else the case's traceback
    return out[key]


@pytest.mark.parametrize("model", sorted(_MODELS))
def test_generate_equals_single_process_reference(per_rank, model):
    for rank, out in enumerate(per_rank):
        res = _result(out, model)
        assert res["got"] == res["want"], (rank, res)
        assert res["raw"] == res["want"], (rank, res)
        assert len(res["want"][0]) - len(PROMPTS[rank][0]) <= NEW_TOKENS[rank], res
        assert res["peak"] < res["units"], res  # per fetch unit, never the whole model
        assert res["prefetched"] > 0 and res["released"], res


def test_unsynced_generate_stops_every_rank_at_once(per_rank):
    for out in per_rank:
        res = _result(out, "unsynced")
        assert res["refused"] is not None and "synced_gpus=True" in res["refused"], res
        assert res["seconds"] < 10, res
        assert res["held"] and res["again"], res


def test_adapter_save_idiom(per_rank):
    for out in per_rank:
        res = _result(out, "adapter")
        assert res["same"] and res["adapters"] == 8, res  # q and v, A and B, 2 layers
        assert res["seconds"] < 10, res


@pytest.mark.parametrize("threshold", [400, 10**6])
def test_lora_on_stacked_experts(per_rank, threshold):
    for out in per_rank:
        res = _result(out, "experts")[threshold]
        assert isinstance(res, dict), res
        assert res["experts"] == 8 and res["difference"] <= 1e-5, res
        if threshold < 10**6:  # the experts are units of their own
            assert res["kept"] == [], res


def test_loop_left_early_names_the_cause(per_rank):
    waiting = _result(per_rank[1], "loop")
    assert waiting["message"] is not None and waiting["seconds"] < 15, waiting
    assert "stopped running forwards before the others" in waiting["message"], waiting
    assert "synced_gpus=True" in waiting["message"], waiting
