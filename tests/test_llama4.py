"""The Llama 4 family (project.model.families.llama4): its logits against transformers' Llama4ForCausalLM with a chunk
shorter than the sequence, its masks against the rule they stand for (also for a context-parallel rank's rows), its
presets' sizes against Meta's published counts, its export and import, and training in every layout its shapes allow
equal to one device, documents masked (in process, over gloo)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import yaml
from conftest import PARITY_STEPS, assert_reproduces, read_metrics, train_overrides
from hf_folders import assert_folder_reads_back, write_hf_folder
from in_process import CONF, train_in_process

from project.hf.export import export
from project.hf.folder import model_settings
from project.hf.published import load_published_weights
from project.model.families import build_model, model_config
from project.model.flops import count_parameters
from project.parallel.context_parallel import ContextParallelDocumentMasking, zigzag_positions

# Four blocks: rotary ones (0, 2) attending within chunks of 16 of a 48-token sequence, rope-free global ones (1, 3)
# whose temperature rises every 8 positions; dense blocks (0, 2) of width 96 beside mixtures (1, 3) of experts of 48.
TINY = {"family": "llama4", "vocab_size": 256, "dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2}
TINY |= {"ffn_dim": 96, "expert_ffn_dim": 48, "n_experts": 4, "moe_every": 2, "nope_every": 2}
TINY |= {"attention_chunk_size": 16, "floor_scale": 8, "attn_scale": 0.5, "rope_theta": 10000.0, "max_seq_len": 256}


def seeded_llama4(**changes):
    """Our Llama 4 with every norm's gain drawn too (they start at ones, which would hide one read for another)."""
    model = build_model(model_config({**TINY, **changes}), init_seed=3).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=torch.Generator().manual_seed(len(name))) + 0.5)
    return model


def test_llama4_with_our_weights_gives_our_logits_in_transformers(tmp_path):
    """Written as a folder (our config.json and safetensors) and read by transformers' own loader: chunked and global
    layers, the temperature, the QK norm, dense and mixture blocks, the experts fused as transformers holds them."""
    transformers = pytest.importorskip("transformers")
    ours = seeded_llama4()
    exported = write_hf_folder(ours, tmp_path)
    assert exported["model.layers.1.feed_forward.experts.gate_up_proj"].shape == (4, 64, 96)
    hf = transformers.Llama4ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert hf.config.layer_types == ["chunked_attention", "full_attention"] * 2 and hf.config.moe_layers == [1, 3]
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, atol=1e-5, rtol=1e-5)
    # The folder reads back as the same settings, its weights as the same tensors, also into the model directly.
    assert_folder_reads_back(tmp_path, ours, exported)
    loaded = build_model(ours.config, init_seed=5)
    load_published_weights(loaded, tmp_path)
    for name, tensor in ours.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, atol=0, rtol=0, msg=name)


def test_llama4_decoding_with_a_cache_gives_the_logits_of_the_whole_sequence():
    """Token by token past a chunk's end: the cached positions' chunks and temperatures are those of the whole run."""
    from project.model.llama import KVCache

    model = seeded_llama4()
    tokens = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    cache = KVCache(model.config, 1, 40)
    with torch.no_grad():
        whole = model(tokens)
        first = model(tokens[:, :30], cache=cache)
        rest = [model(tokens[:, i : i + 1], cache=cache) for i in range(30, 40)]
    torch.testing.assert_close(torch.cat([first, *rest], dim=1), whole, atol=1e-5, rtol=1e-5)


def allowed(positions: torch.Tensor, documents: torch.Tensor, chunk: int | None) -> torch.Tensor:
    """[B, 1, rows, T]: query at `positions` may see key j: j earlier or itself, same document, same chunk."""
    keys = torch.arange(documents.shape[1])
    rule = (positions[:, None] >= keys) & (documents[:, positions, None] == documents[:, None, :])
    if chunk is not None:
        rule &= positions[:, None] // chunk == keys // chunk
    return rule[:, None]


@pytest.mark.parametrize("cp", [1, 2])
def test_chunks_and_documents_both_cut_attention_also_for_a_context_parallel_ranks_rows(cp):
    model = build_model(model_config(TINY))
    documents = torch.tensor([[0] * 20 + [1] * 30 + [2] * 14, [0] * 64])
    for rank in range(cp):
        if cp > 1:
            model.document_masking = ContextParallelDocumentMasking(rank, cp)
        positions = zigzag_positions(64, rank, cp)
        masks = model.attention_mask(64 // cp, torch.device("cpu"), documents)
        assert torch.equal(masks.positions, positions)
        assert torch.equal(masks.chunked, allowed(positions, documents, 16))
        assert torch.equal(masks.full, allowed(positions, documents, None))


def test_a_llama4_folders_irregular_layers_are_refused_and_meta_s_numbered_switches_read(tmp_path):
    """Only the patterns interleave_moe_layer_step and no_rope_layer_interval make are read; Meta's folders give
    attn_temperature_tuning as 4, which transformers takes for true."""
    from project.runtime.errors import ConfigError

    ours = seeded_llama4()
    write_hf_folder(ours, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert model_settings(tmp_path, config | {"attn_temperature_tuning": 4})["temperature_tuning"] is True
    for key, irregular in (("moe_layers", [0, 3]), ("no_rope_layers", [1, 1, 1, 0])):
        with pytest.raises(ConfigError, match=rf"has {key}=\[.*Llama4ForCausalLM here does not take"):
            model_settings(tmp_path, config | {key: irregular})


def test_a_setting_llama4s_format_cannot_hold_is_named():
    config = model_config({**TINY, "weigh_inputs": False, "bias_update_rate": 0.001})
    assert config.hf_format_differences() == ["model.weigh_inputs=False", "model.bias_update_rate=0.001"]


@pytest.mark.parametrize(
    ("preset", "total", "active"),
    # Meta's model cards: Llama 4 Scout 109B parameters, Maverick 400B, both 17B active per token (the totals count
    # the vision encoder too, which the text model lacks).
    [("llama4_scout_text", 109, 17), ("llama4_maverick_text", 400, 17)],
)
def test_llama4_presets_have_the_published_sizes(preset, total, active):
    config = model_config(yaml.safe_load((CONF / "model" / f"{preset}.yaml").read_text()))
    count = count_parameters(config)
    assert count / 1e9 == pytest.approx(total, rel=0.015)
    assert round(count_parameters(config, active=True) / 1e9) == active
    with torch.device("meta"):
        assert sum(p.numel() for p in build_model(config).parameters()) == count
    assert dataclasses.asdict(config)["nope_every"] == 4 and config.attention_chunk_size == 8192


LLAMA4 = [*PARITY_STEPS, "trainer.max_steps=6", "model=llama4_debug", "model.loss_chunk_tokens=64"]
LLAMA4 += ["document_mask=true"]  # documents and chunks both cut attention, in every layout
LAYOUTS = {
    "tp2-sp": ["strategy=tp", "trainer.devices=2", "strategy.sequence_parallel=true"],
    "cp2": ["strategy=fsdp2", "trainer.devices=2", "strategy.context_parallel_size=2"],
    "fsdp2": ["strategy=fsdp2", "trainer.devices=2"],  # each expert's rows split over the ranks
    "ep2": ["strategy=fsdp2", "trainer.devices=2", "strategy.expert_parallel_size=2"],  # each rank 2 whole experts
    "ddp": ["strategy=ddp", "trainer.devices=2"],
    "pp2": ["strategy=pipeline", "trainer.devices=2"],
}
CAUSAL = ["document_mask=false"]  # chunks alone: each rank's rows of the chunks' mask, the global layers causal
# New runs from the single run's export in Llama4ForCausalLM's format: each rank of ddp reads the whole model, of ep=2
# its own experts' parts of the fused tensors.
FROM_EXPORT = {"init-from-ddp": "ddp", "init-from-ep2": "ep2"}


@pytest.fixture(scope="module")
def runs(tiny_shards, tmp_path_factory) -> dict:
    names = ["single", "single-causal", "cp2-causal", *LAYOUTS, *FROM_EXPORT]
    folders = {name: tmp_path_factory.mktemp(name) for name in names}

    def case(name: str, *overrides: str):
        return folders[name], train_overrides(tiny_shards, folders[name], *LLAMA4, *overrides)

    train_in_process(1, [case("single"), case("single-causal", *CAUSAL)])
    folders["exported"] = tmp_path_factory.mktemp("exported") / "llama4"
    export(str(folders["single"] / "checkpoints" / "last.ckpt"), str(folders["exported"]))
    from_export = (f"init_from={folders['exported']}", "trainer.max_steps=2")
    two = [case(name, *o) for name, o in LAYOUTS.items()] + [case("cp2-causal", *LAYOUTS["cp2"], *CAUSAL)]
    two += [case(name, *LAYOUTS[layout], *from_export) for name, layout in FROM_EXPORT.items()]
    train_in_process(2, two)
    return folders


@pytest.mark.slow
@pytest.mark.parametrize("layout", [*LAYOUTS, "cp2-causal"])
def test_llama4_trains_in_every_layout_its_shapes_allow_like_one_device(runs, layout):
    assert_reproduces(runs[layout], runs["single-causal" if layout == "cp2-causal" else "single"], steps=6)


@pytest.mark.slow
def test_init_from_a_llama4_folder_starts_every_layout_from_its_weights(runs):
    config = json.loads((runs["exported"] / "config.json").read_text())
    assert config["architectures"] == ["Llama4ForCausalLM"] and config["model_type"] == "llama4_text"
    one = read_metrics(runs["init-from-ddp"], "train/loss")
    assert sorted(one) == [0, 1]
    assert read_metrics(runs["init-from-ep2"], "train/loss") == pytest.approx(one, rel=1e-5)
    assert one[0] < read_metrics(runs["single"], "train/loss")[0] - 0.5


def test_flex_attention_under_the_chunks_block_mask_serves_every_sequence_of_a_batch():
    """Without documents the chunks' ids are one sequence's [1, T] (the GPU's block mask): every sequence of the batch
    attends within its chunks, as under the dense mask."""
    import torch.nn.functional as F

    from project.model.document_mask import dense_document_mask, document_block_mask
    from project.model.families.llama4.model import chunk_segments
    from project.model.kernels import flex_attend

    q, k, v = torch.randn(3, 2, 4, 200, 16, generator=torch.Generator().manual_seed(0)).unbind(0)
    segments = chunk_segments(torch.arange(200), 48, None)
    out = flex_attend(q, k, v, document_block_mask(segments), enable_gqa=False)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=dense_document_mask(segments)))
