"""Our Llama against transformers' LlamaForCausalLM, the independent reference.

transformers' model is built offline from the config.json contents we export (hf_config_dict) and given our
seeded random weights through to_hf_state_dict; equal logits prove the config, the names and the rotary
layout all agree.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from project.hf.conversion import from_hf_state_dict, hf_config_dict, to_hf_state_dict  # noqa: E402
from project.model.llama import Llama, LlamaConfig, rope_frequencies  # noqa: E402

# original_max_position_embeddings=64 (bands at wavelengths 16 and 64 tokens) with head_dim 16 and rope_theta 5e5
# (wavelengths 6, 33, 167, ... tokens) puts rotary frequencies in all three Llama-3.1 bands: kept, interpolated
# and slowed by `factor`.
LLAMA31_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
VARIANTS = {
    "gqa": {"n_heads": 4, "n_kv_heads": 2},
    "mha": {"n_heads": 4, "n_kv_heads": 4},
    "tied_embeddings": {"n_heads": 4, "n_kv_heads": 2, "tie_embeddings": True},
    "llama31_rope_scaling": {"n_heads": 4, "n_kv_heads": 1, "rope_scaling": LLAMA31_SCALING, "rope_theta": 500000.0},
}


def tiny_config(**overrides) -> LlamaConfig:
    base = {"vocab_size": 256, "dim": 64, "n_layers": 2, "multiple_of": 32, "norm_eps": 1e-5, "max_seq_len": 256}
    return LlamaConfig(**{**base, **overrides})


def seeded_llama(config: LlamaConfig, seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(config, init_seed=seed).eval()


def hf_llama(config: LlamaConfig, attn_implementation: str = "eager"):
    hf_config = transformers.LlamaConfig(**hf_config_dict(config))
    return transformers.LlamaForCausalLM._from_config(hf_config, attn_implementation=attn_implementation).eval()


def load_ours_into_hf(ours: Llama, hf) -> None:
    result = hf.load_state_dict(to_hf_state_dict(ours.state_dict(), ours.config), strict=False)
    # A tied lm_head is left out of the export, as in HF's own checkpoints; HF ties it to the embedding.
    assert result.missing_keys == (["lm_head.weight"] if ours.config.tie_embeddings else [])
    assert result.unexpected_keys == []


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_hf_llama_with_our_weights_gives_our_logits(variant, attn_implementation):
    config = tiny_config(**VARIANTS[variant])
    ours = seeded_llama(config)
    hf = hf_llama(config, attn_implementation)
    load_ours_into_hf(ours, hf)
    tokens = torch.randint(0, config.vocab_size, (2, 96), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        actual = ours(tokens)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    if config.tie_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()


def test_llama31_scaling_reaches_hf_rotary_frequencies():
    """Guards the scaled parity case from passing vacuously: HF must really apply llama3 scaling."""
    scaled = tiny_config(**VARIANTS["llama31_rope_scaling"])
    plain = tiny_config(**{**VARIANTS["llama31_rope_scaling"], "rope_scaling": None})
    hf_scaled = hf_llama(scaled).model.rotary_emb.inv_freq
    torch.testing.assert_close(hf_scaled, rope_frequencies(scaled), atol=1e-7, rtol=1e-6)
    assert not torch.allclose(hf_scaled, rope_frequencies(plain))


@pytest.mark.parametrize("variant", ["gqa", "llama31_rope_scaling"])
def test_legacy_and_current_rope_keys_configure_hf_alike(variant):
    """config.json carries rope settings twice (rope_theta/rope_scaling for transformers 4, rope_parameters
    for 5); each spelling alone must give the same rope parameters."""
    if not hasattr(transformers.LlamaConfig(), "rope_parameters"):
        pytest.skip("transformers < 5 reads only the legacy spelling, which the parity tests cover")
    full = hf_config_dict(tiny_config(**VARIANTS[variant]))
    legacy_only = {k: v for k, v in full.items() if k != "rope_parameters"}
    current_only = {k: v for k, v in full.items() if k not in ("rope_theta", "rope_scaling")}
    from_legacy = transformers.LlamaConfig(**legacy_only).rope_parameters
    from_current = transformers.LlamaConfig(**current_only).rope_parameters
    assert from_legacy == from_current
    assert transformers.LlamaConfig(**full).rope_parameters == from_current


@pytest.mark.parametrize("source", ["hf_model_state_dict", "exported_tensors"])
@pytest.mark.parametrize("variant", ["gqa", "tied_embeddings"])
def test_hf_state_dict_converts_back_to_identical_llama(variant, source):
    """Both HF spellings of tied weights load: a model's state_dict lists lm_head, an export omits it."""
    config = tiny_config(**VARIANTS[variant])
    original = seeded_llama(config, seed=0)
    if source == "hf_model_state_dict":
        hf = hf_llama(config)
        load_ours_into_hf(original, hf)
        hf_state_dict = hf.state_dict()
    else:
        hf_state_dict = to_hf_state_dict(original.state_dict(), config)

    restored = seeded_llama(config, seed=1)  # different weights, so the load must overwrite all of them
    restored.load_state_dict(from_hf_state_dict(hf_state_dict, config), strict=True)

    for name, tensor in original.state_dict().items():
        torch.testing.assert_close(restored.state_dict()[name], tensor, atol=0, rtol=0, msg=name)


def test_conversion_refuses_weights_that_do_not_fit_the_config():
    config = tiny_config(**VARIANTS["gqa"])
    state_dict = seeded_llama(config).state_dict()
    with pytest.raises(KeyError, match="missing"):
        to_hf_state_dict(state_dict, tiny_config(**VARIANTS["gqa"], n_layers=3))
    with pytest.raises(KeyError, match="unexpected"):
        to_hf_state_dict({"model." + k: v for k, v in state_dict.items()}, config)


def test_mixtral_from_our_exported_tensors_gives_our_mixtures_logits(tmp_path):
    """Mixtral's format as published (one tensor per expert, `block_sparse_moe`), written by our conversion to a
    folder and read by transformers' own loader, computes our mixture's logits; and it converts back exactly."""
    from safetensors.torch import save_file

    from project.model.families.moe.config import MoEConfig
    from project.model.families.moe.model import MoELlama

    # Odd widths, experts wider than the dense rule, top 2 of 5: a mistake in names, stacking or routing shows.
    config = MoEConfig(**{**tiny_config().__dict__, "family": "moe", "n_experts": 5, "top_k": 2, "expert_ffn_dim": 40})
    ours = MoELlama(config, init_seed=3).eval()
    exported = to_hf_state_dict(ours.state_dict(), config)
    assert "model.layers.1.block_sparse_moe.experts.4.w2.weight" in exported
    save_file({k: v.contiguous() for k, v in exported.items()}, tmp_path / "model.safetensors", {"format": "pt"})
    (tmp_path / "config.json").write_text(__import__("json").dumps(hf_config_dict(config)))
    hf = transformers.MixtralForCausalLM.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, atol=1e-5, rtol=1e-5)
    restored = MoELlama(config, init_seed=4)
    restored.load_state_dict(from_hf_state_dict(exported, config), strict=True)
    for name, tensor in ours.state_dict().items():
        torch.testing.assert_close(restored.state_dict()[name], tensor, atol=0, rtol=0, msg=name)
