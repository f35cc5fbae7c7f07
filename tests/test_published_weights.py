"""Continued pretraining: `init_from=DIR` starts a run from a folder written by transformers itself, in any
layout, and a folder that cannot be loaded is one clear error before training starts."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import read_metrics, run_module, run_train, train_overrides
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from project.hf.conversion import hf_config_dict, hf_weight_shapes, to_hf_state_dict
from project.hf.folder import model_settings
from project.model.config import LlamaConfig
from project.model.flops import count_parameters
from project.model.llama import Llama

transformers = pytest.importorskip("transformers")

# GQA, untied embeddings, Llama 3.1 RoPE scaling, and an FFN width no rule of multiple_of gives
# (HF's intermediate_size).
PUBLISHED = LlamaConfig(
    vocab_size=300,
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=160,
    rope_theta=500000.0,
    max_seq_len=256,
    rope_scaling={
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
)
FIRST_STEP = ["trainer.max_steps=1", "global_batch_size=8", "val_every_n_steps=1000"]
LAYOUTS = {
    "single": [],
    "ddp": ["strategy=ddp", "trainer.devices=2"],
    "fsdp2": ["strategy=fsdp2", "trainer.devices=2"],
    "tp": ["strategy=tp", "trainer.devices=2"],
    "tp_fsdp": ["strategy=tp_fsdp", "trainer.devices=4"],
    "pipeline": ["strategy=pipeline", "trainer.devices=2", "strategy.schedule=1f1b"],
}


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> Path:
    """A bfloat16 Llama saved by transformers in several safetensors files with an index, as models are published."""
    folder = tmp_path_factory.mktemp("published") / "tiny-llama"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**hf_config_dict(PUBLISHED, eos_token_id=0, torch_dtype="bfloat16"))
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="40KB")
    assert (
        len(list(folder.glob("model-*-of-*.safetensors"))) > 1 and (folder / "model.safetensors.index.json").is_file()
    )
    return folder


def hf_first_batch_loss(folder: Path, shards: Path, run_dir: Path) -> float:
    """transformers' own loss on the run's first global batch, read from the shards as the run reads them."""
    from project.data.datamodule import TokenShardDataModule

    cfg = OmegaConf.load(run_dir / "config.yaml")
    data = TokenShardDataModule(
        data_dir=shards,
        seq_len=32,
        global_batch_size=8,
        micro_batch_size=8,
        seed=cfg.data.seed,
        num_workers=0,
        val_sequences=8,
    )
    data.setup("fit")
    inputs, targets = next(iter(data.train_dataloader()))
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(inputs).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()


def test_the_weight_shapes_a_folder_must_hold_are_those_of_the_model():
    for config in (
        PUBLISHED,
        LlamaConfig(vocab_size=96, dim=32, n_layers=1, n_heads=2, multiple_of=16, tie_embeddings=True),
    ):
        with torch.device("meta"):
            model = Llama(config)
        exported = to_hf_state_dict(model.state_dict(), config)
        assert hf_weight_shapes(config) == {name: tuple(t.shape) for name, t in exported.items()}


def test_a_config_json_gives_back_the_model_settings_it_was_written_from():
    settings = model_settings(Path("x"), hf_config_dict(PUBLISHED))
    assert LlamaConfig(**settings) == PUBLISHED


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=list(LAYOUTS))
def test_the_first_step_of_a_run_from_a_published_folder_has_transformers_loss(
    published, tiny_shards, tmp_path, layout
):
    # The model's shape is not restated: it comes from the folder (the debug preset's would not fit its weights).
    extra = ["model.tie_embeddings=false"] if "strategy=pipeline" in layout else []
    run_train(tiny_shards, tmp_path, f"init_from={published}", *FIRST_STEP, *layout, *extra)
    loss = read_metrics(tmp_path, "train/loss")[0]
    assert loss == pytest.approx(hf_first_batch_loss(published, tiny_shards, tmp_path), rel=1e-5)
    if "strategy=fsdp2" in layout:  # each rank read and holds its half of the parameters only
        ranks = [json.loads((tmp_path / "memory" / f"rank{r}.json").read_text()) for r in range(2)]
        assert sum(r["param_bytes"] for r in ranks) == 4 * count_parameters(PUBLISHED)
        assert all(r["param_bytes"] == pytest.approx(2 * count_parameters(PUBLISHED), rel=0.05) for r in ranks)


def test_weights_read_from_a_folder_export_to_the_same_tensors(published, tmp_path):
    from project.training.lit_module import LlamaLitModule

    module = LlamaLitModule(model=PUBLISHED.__dict__, init_from=str(published))
    module.configure_model()  # as the trainer calls it: the weights are read here
    assert all(p.dtype == torch.float32 for p in module.model.parameters())  # bfloat16 folder, float32 master weights
    again = to_hf_state_dict(module.model.state_dict(), PUBLISHED)
    published_tensors = {}
    for file in published.glob("*.safetensors"):
        published_tensors.update(load_file(file))
    assert again.keys() == published_tensors.keys()
    assert all(torch.equal(again[name].to(torch.bfloat16), published_tensors[name]) for name in again)
    assert all(
        torch.equal(again[name], published_tensors[name].float()) for name in again
    )  # nothing lost on the way in


def refused(*args: str) -> subprocess.CompletedProcess:
    return run_module("project.train", list(args), timeout=120)


def broken_copy(published: Path, target: Path, change) -> Path:
    target.mkdir()
    for file in published.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    change(target)
    return target


def drop_weight(folder: Path) -> None:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    file = folder / index["weight_map"].pop("model.layers.1.mlp.up_proj.weight")
    tensors = load_file(file)
    tensors.pop("model.layers.1.mlp.up_proj.weight", None)
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    index["weight_map"]["model.layers.0.self_attn.q_norm.weight"] = file.name
    save_file(tensors, file, metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def with_config(**changes):
    def change(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **changes}))

    return change


CASES = {
    "no config.json": (lambda f: (f / "config.json").unlink(), [], r"holds no config.json"),
    "not a Llama": (
        with_config(model_type="mistral"),
        [],
        r"model_type='mistral' model; this platform reads model_type 'llama' or 'mixtral'",
    ),
    "missing and extra weights": (
        drop_weight,
        [],
        r"missing \['model.layers.1.mlp.up_proj.weight'\]; unexpected \['model.layers.0.self_attn.q_norm.weight'\]",
    ),
    "override against the folder": (
        lambda f: None,
        ["model.n_kv_heads=4"],
        r"model.n_kv_heads=4 contradicts init_from=.*num_key_value_heads=2",
    ),
    "tokenizer larger than the model": (
        with_config(vocab_size=256),
        [],
        r"tokenizer of 300 tokens, more than the 256 of the model in init_from",
    ),
    "init_from and ckpt_path": (
        lambda f: None,
        ["ckpt_path=some/last.ckpt"],
        r"both given: init_from starts a new run",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_a_folder_that_cannot_start_a_run_is_one_clear_error(published, tiny_shards, tmp_path, case):
    change, extra, message = CASES[case]
    folder = broken_copy(published, tmp_path / "folder", change)
    if (
        case == "tokenizer larger than the model"
    ):  # weights of the smaller vocabulary too, so only the tokenizer is at odds
        for file in folder.glob("*.safetensors"):
            save_file(
                {k: v[:256] if re.search("embed_tokens|lm_head", k) else v for k, v in load_file(file).items()}, file
            )
    result = refused(*train_overrides(tiny_shards, tmp_path / "run", f"init_from={folder}", *FIRST_STEP, *extra))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and re.search(message, result.stderr), result.stderr[-2000:]


def test_prepare_takes_the_tokenizer_of_a_published_folder(published, tiny_shards, tmp_path):
    from project.data.prepare import prepare_shards

    folder = broken_copy(
        published,
        tmp_path / "with-tokenizer",
        lambda f: (f / "tokenizer.json").write_bytes((tiny_shards / "tokenizer.json").read_bytes()),
    )
    manifest = prepare_shards(
        [str(tiny_shards.parent / "raw" / "*.txt")], tmp_path / "shards", tokenizer=folder, seq_len=32, num_workers=1
    )
    assert manifest["tokenizer"]["vocab_size"] == 300
    assert (tmp_path / "shards" / "tokenizer.json").read_bytes() == (tiny_shards / "tokenizer.json").read_bytes()


@pytest.mark.slow
def test_a_sharded_checkpoint_exports_in_parts_that_init_from_reads_back_to_the_same_tensors(
    published, tiny_shards, tmp_path
):
    from project.hf.checkpoint_weights import checkpoint_weights, write_safetensors
    from project.training.lit_module import LlamaLitModule

    run_train(tiny_shards, tmp_path / "run", f"init_from={published}", *FIRST_STEP, *LAYOUTS["fsdp2"])
    exported = tmp_path / "exported"
    args = [
        f"ckpt_path={tmp_path / 'run' / 'checkpoints' / 'last.ckpt'}",
        f"output_dir={exported}",
        "max_shard_size=40KB",
    ]
    result = run_module("project.export", list(args), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # in parts, each read from the shards as it was written

    module = LlamaLitModule(model=PUBLISHED.__dict__, init_from=str(exported))
    module.configure_model()
    again = tmp_path / "again"
    again.mkdir()
    state = {f"model.{k}": v for k, v in module.model.state_dict().items()}
    write_safetensors(checkpoint_weights(again, state), PUBLISHED, torch.float32, again, max_shard_size=40_000)
    assert json.loads((again / "model.safetensors.index.json").read_text())["weight_map"] == index["weight_map"]
    for file in set(index["weight_map"].values()):
        first, second = load_file(exported / file), load_file(again / file)
        assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    trained = checkpoint_weights(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert all(
        torch.equal(module.model.state_dict()[name], tensor)
        for name, tensor in trained.read(list(trained.shapes)).items()
    )
