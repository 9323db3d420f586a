"""Fixtures shared by the tests that run programs written for DeepSpeed under zero-as-deepspeed."""

import pytest
import torch


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny Llama saved with save_pretrained (built here: nothing is downloaded); read only."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    path = tmp_path_factory.mktemp("tiny_llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path
