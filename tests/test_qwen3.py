"""The Qwen3 family (project.model.families.qwen3): its logits against transformers' Qwen3ForCausalLM, its presets'
sizes against Qwen's published counts, its Hugging Face folder read back as its settings, and training in the
layouts its shapes allow equal to one device (in process, over gloo)."""

from __future__ import annotations

import pytest
import torch
import yaml
from conftest import PARITY_STEPS, assert_reproduces, train_overrides
from hf_folders import assert_folder_reads_back, write_hf_folder
from in_process import CONF, train_in_process

from project.model.families import build_model, model_config
from project.model.flops import count_parameters

transformers = pytest.importorskip("transformers")

# Heads of 24 over a width of 64 (dim / n_heads would be 16): a mistake in any width shows.
TINY = {"family": "qwen3", "vocab_size": 256, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2}
TINY |= {"head_dim": 24, "ffn_dim": 96, "norm_eps": 1e-6, "rope_theta": 1e6, "max_seq_len": 256}


def seeded_qwen3(tied: bool, dim: int = TINY["dim"]):
    """Our Qwen3 with every norm's gain drawn too (they start at ones, which would hide a query norm read as a key
    norm)."""
    model = build_model(model_config({**TINY, "tie_embeddings": tied, "dim": dim}), init_seed=3).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=torch.Generator().manual_seed(len(name))) + 0.5)
    return model


@pytest.mark.parametrize(("tied", "dim"), [(False, 64), (True, 64), (False, 70)], ids=["untied", "tied", "dim-70"])
def test_qwen3_with_our_weights_gives_our_logits_in_transformers(tied, dim, tmp_path):
    """Written as a folder (our config.json and safetensors) and read by transformers' own loader; at a width of 70
    too, which the 4 heads do not divide (their width is head_dim's alone)."""
    ours = seeded_qwen3(tied, dim)
    exported = write_hf_folder(ours, tmp_path)
    assert "model.layers.1.self_attn.k_norm.weight" in exported and ("lm_head.weight" in exported) != tied
    hf = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, atol=1e-5, rtol=1e-5)
    assert_folder_reads_back(tmp_path, ours, exported)


@pytest.mark.parametrize(
    ("preset", "total", "without_embeddings"),
    # Qwen's model cards: Qwen3-0.6B 0.6B (0.44B non-embedding; its head is the embedding), Qwen3-8B 8.2B (6.95B).
    [("qwen3_0_6b", 0.6, 0.44), ("qwen3_8b", 8.2, 6.95)],
)
def test_qwen3_presets_have_the_published_sizes(preset, total, without_embeddings):
    config = model_config(yaml.safe_load((CONF / "model" / f"{preset}.yaml").read_text()))
    count = count_parameters(config)
    embeddings = config.vocab_size * config.dim * (1 if config.tie_embeddings else 2)
    assert round(count / 1e9, 1) == total
    assert round((count - embeddings) / 1e9, 2) == without_embeddings
    with torch.device("meta"):
        assert sum(p.numel() for p in build_model(config).parameters()) == count


QWEN3 = [*PARITY_STEPS, "trainer.max_steps=6", "model=qwen3_debug", "model.loss_chunk_tokens=64"]
LAYOUTS = {
    # The head tied to the embedding, both split over the vocabulary; the per-head norms over each rank's heads.
    "tp2-sp": ["strategy=tp", "trainer.devices=2", "strategy.sequence_parallel=true"],
    "cp2": ["strategy=fsdp2", "trainer.devices=2", "strategy.context_parallel_size=2"],
    "fsdp2": ["strategy=fsdp2", "trainer.devices=2"],
    "ddp": ["strategy=ddp", "trainer.devices=2"],
}
UNTIED = ["model.tie_embeddings=false"]  # a pipeline puts the embedding and the head on different stages
PIPELINE = ["strategy=pipeline", "trainer.devices=2", *UNTIED]


@pytest.fixture(scope="module")
def runs(tiny_shards, tmp_path_factory) -> dict:
    names = ["single", "single-untied", *LAYOUTS, "pp2"]
    folders = {name: tmp_path_factory.mktemp(name) for name in names}

    def case(name: str, *overrides: str):
        return folders[name], train_overrides(tiny_shards, folders[name], *QWEN3, *overrides)

    train_in_process(1, [case("single"), case("single-untied", *UNTIED)])
    train_in_process(2, [*(case(name, *o) for name, o in LAYOUTS.items()), case("pp2", *PIPELINE)])
    return folders


@pytest.mark.slow
@pytest.mark.parametrize("layout", [*LAYOUTS, "pp2"])
def test_qwen3_trains_in_every_layout_its_shapes_allow_like_one_device(runs, layout):
    reference = runs["single-untied" if layout == "pp2" else "single"]
    assert_reproduces(runs[layout], reference, steps=6)
