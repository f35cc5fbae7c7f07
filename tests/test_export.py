"""project.hf.export: a checkpoint in the training format becomes a folder transformers loads offline.

The checkpoint and tokenizer are built here in the documented contract: a Lightning-style dict whose
`state_dict` holds the Llama under `model.`, `hyper_parameters['model']` the LlamaConfig as a dict, and
`datamodule_hyper_parameters['data_dir']` a folder with manifest.json naming the tokenizer file.
"""

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from project.hf.export import main  # noqa: E402
from project.model.llama import Llama, LlamaConfig  # noqa: E402
from tests.conftest import run_module  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
SAMPLE = "To be, or not to be: that is the question. Héllo wörld 123!"
CORPUS = [
    "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer",
    "The slings and arrows of outrageous fortune, Or to take arms against a sea of troubles",
    "And by opposing end them. To die: to sleep; No more; and by a sleep to say we end",
] * 20


def train_byte_level_bpe(path: Path) -> tuple[int, int]:
    """A ~300-token byte-level BPE saved as tokenizer.json; returns (bos_id, eos_id)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],  # the names project.data's own BPE uses
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.save(str(path))
    return tokenizer.token_to_id("<|begin_of_text|>"), tokenizer.token_to_id("<|end_of_text|>")


def train_llama_style_sentencepiece(path: Path, corpus_dir: Path) -> None:
    """A sentencepiece BPE with Llama's settings (byte fallback, no normalization), saved at `path`."""
    spm = pytest.importorskip("sentencepiece")
    corpus = corpus_dir / "corpus.txt"
    corpus.write_text("\n".join(CORPUS))
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(path.with_suffix("")), vocab_size=300, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", split_digits=True, minloglevel=2,
    )  # fmt: skip


def write_checkpoint(directory: Path, config: LlamaConfig, tokenizer_file: str, bos_id, eos_id) -> tuple[Path, Llama]:
    """A data dir (manifest + tokenizer already at `tokenizer_file`) and a checkpoint naming it."""
    data_dir = directory / "data"
    manifest = {"tokenizer": {"file": tokenizer_file, "bos_id": bos_id, "eos_id": eos_id}}
    (data_dir / "manifest.json").write_text(json.dumps(manifest))
    torch.manual_seed(0)
    model = Llama(config).eval()
    ckpt = {
        "epoch": 0,
        "global_step": 10,
        "pytorch-lightning_version": "2.6.0",
        "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
        "optimizer_states": [],
        "lr_schedulers": [],
        "schedule": {},  # every checkpoint written since 2026-11-27 records one
        "hyper_parameters": {"model": asdict(config)},
        "datamodule_hyper_parameters": {"data_dir": str(data_dir)},
    }
    path = directory / "last.ckpt"
    torch.save(ckpt, path)
    return path, model


def tiny_config(**overrides) -> LlamaConfig:
    # vocab 320 > the tokenizer's 300: training code may pad the embedding table.
    base = {"vocab_size": 320, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "multiple_of": 32}
    return LlamaConfig(**{**base, "max_seq_len": 128, **overrides})


@pytest.fixture
def bpe_checkpoint(tmp_path):
    (tmp_path / "data").mkdir()
    bos_id, eos_id = train_byte_level_bpe(tmp_path / "data" / "tokenizer.json")
    return tmp_path, bos_id, eos_id


def run_export(*args: str) -> subprocess.CompletedProcess:
    return run_module("project.export", list(args), env={"HF_HUB_OFFLINE": "1"})


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize("tie_embeddings", [False, True], ids=["untied", "tied"])
def test_exported_folder_loads_in_transformers_with_our_logits_and_token_ids(bpe_checkpoint, tie_embeddings):
    from tokenizers import Tokenizer

    tmp_path, bos_id, eos_id = bpe_checkpoint
    config = tiny_config(tie_embeddings=tie_embeddings)
    ckpt_path, ours = write_checkpoint(tmp_path, config, "tokenizer.json", bos_id, eos_id)
    out = tmp_path / "hf"

    result = run_export(f"ckpt_path={ckpt_path}", f"output_dir={out}")
    assert result.returncode == 0, result.stderr
    assert "model.safetensors" in result.stdout

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    expected_ids = Tokenizer.from_file(str(tmp_path / "data" / "tokenizer.json")).encode(SAMPLE).ids
    # The end-of-text token first, as before every document in training (tests/test_export_clients.py).
    assert hf_tokenizer(SAMPLE)["input_ids"] == [eos_id, *expected_ids]
    assert hf_tokenizer.eos_token_id == eos_id

    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    assert hf.generation_config.eos_token_id == eos_id
    tokens = torch.tensor([[eos_id, *expected_ids]])
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), atol=1e-5, rtol=1e-5)


def test_bfloat16_export_stores_bfloat16_weights(bpe_checkpoint):
    from safetensors import safe_open

    tmp_path, bos_id, eos_id = bpe_checkpoint
    ckpt_path, ours = write_checkpoint(tmp_path, tiny_config(), "tokenizer.json", bos_id, eos_id)
    main([f"ckpt_path={ckpt_path}", f"output_dir={tmp_path / 'hf'}", "dtype=bfloat16"])

    with safe_open(tmp_path / "hf" / "model.safetensors", framework="pt") as f:
        embedding = f.get_tensor("model.embed_tokens.weight")
    assert embedding.dtype == torch.bfloat16
    torch.testing.assert_close(embedding, ours.tok_embeddings.weight.detach().to(torch.bfloat16), atol=0, rtol=0)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_exported_files_get_the_modes_a_plain_write_would(bpe_checkpoint):
    """Readable by colleagues where the umask allows it: not mkdtemp's 0700 folder and 0600 files."""
    tmp_path, bos_id, eos_id = bpe_checkpoint
    ckpt_path, _ = write_checkpoint(tmp_path, tiny_config(), "tokenizer.json", bos_id, eos_id)
    umask = os.umask(0o022)
    try:
        main([f"ckpt_path={ckpt_path}", f"output_dir={tmp_path / 'shared' / 'hf'}"])
    finally:
        os.umask(umask)
    out = tmp_path / "shared" / "hf"
    assert out.stat().st_mode & 0o777 == 0o755
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == {p.name: 0o644 for p in out.iterdir()}


def test_export_refuses_a_non_empty_output_dir_and_leaves_it_untouched(bpe_checkpoint):
    tmp_path, bos_id, eos_id = bpe_checkpoint
    ckpt_path, _ = write_checkpoint(tmp_path, tiny_config(), "tokenizer.json", bos_id, eos_id)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")

    result = run_export(f"ckpt_path={ckpt_path}", f"output_dir={out}")

    assert result.returncode == 2
    assert "overwrite=true" in result.stderr and "Traceback" not in result.stderr
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "hf", "last.ckpt"]  # no temp folder left


def test_without_output_dir_an_export_goes_under_outputs_hf_named_for_run_and_checkpoint(bpe_checkpoint, monkeypatch):
    tmp_path, bos_id, eos_id = bpe_checkpoint
    ckpt_path, _ = write_checkpoint(tmp_path, tiny_config(), "tokenizer.json", bos_id, eos_id)
    in_run = tmp_path / "runs" / "r1" / "checkpoints" / "last.ckpt"
    in_run.parent.mkdir(parents=True)
    os.link(ckpt_path, in_run)
    root = tmp_path / "root"
    root.mkdir()
    monkeypatch.setenv("PROJECT_ROOT", str(root))
    monkeypatch.chdir(root)

    main([f"ckpt_path={in_run}"])
    main([f"ckpt_path={ckpt_path}"])  # a checkpoint outside a run: named for itself

    assert sorted(str(p.relative_to(root)) for p in root.rglob("config.json")) == [
        "outputs/hf/last/config.json",
        "outputs/hf/r1-last/config.json",
    ]
    assert [p.name for p in root.iterdir()] == ["outputs"]


def test_overwrite_replaces_exported_files_and_keeps_others(bpe_checkpoint):
    tmp_path, bos_id, eos_id = bpe_checkpoint
    ckpt_path, _ = write_checkpoint(tmp_path, tiny_config(), "tokenizer.json", bos_id, eos_id)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "config.json").write_text("{}")

    main([f"ckpt_path={ckpt_path}", f"output_dir={out}", "overwrite=true"])

    assert (out / "notes.txt").read_text() == "mine"
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "hf", "last.ckpt"]


def _missing_checkpoint(tmp_path, ckpt_path):
    return [f"ckpt_path={tmp_path / 'nope.ckpt'}"]


def _checkpoint_without_model_config(tmp_path, ckpt_path):
    ckpt = torch.load(ckpt_path, weights_only=False)
    del ckpt["hyper_parameters"]["model"]
    torch.save(ckpt, ckpt_path)
    return [f"ckpt_path={ckpt_path}"]


def _weights_of_another_model(tmp_path, ckpt_path):
    ckpt = torch.load(ckpt_path, weights_only=False)
    ckpt["hyper_parameters"]["model"]["n_layers"] = 3
    torch.save(ckpt, ckpt_path)
    return [f"ckpt_path={ckpt_path}"]


def _missing_tokenizer(tmp_path, ckpt_path):
    (tmp_path / "data" / "tokenizer.json").unlink()
    return [f"ckpt_path={ckpt_path}"]


def _missing_manifest(tmp_path, ckpt_path):
    (tmp_path / "data" / "manifest.json").unlink()
    return [f"ckpt_path={ckpt_path}"]


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (_missing_checkpoint, "does not exist"),
        (_checkpoint_without_model_config, "hyper_parameters"),
        (_weights_of_another_model, "do not fit"),
        (_missing_tokenizer, "tokenizer=PATH"),
        (_missing_manifest, "tokenizer=PATH"),
    ],
)
def test_export_explains_unusable_inputs_in_one_message(bpe_checkpoint, capsys, breakage, message):
    tmp_path, bos_id, eos_id = bpe_checkpoint
    ckpt_path, _ = write_checkpoint(tmp_path, tiny_config(), "tokenizer.json", bos_id, eos_id)
    args = breakage(tmp_path, ckpt_path)

    with pytest.raises(SystemExit) as exit_:
        main([*args, f"output_dir={tmp_path / 'hf'}"])

    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_tokenizer_override_is_used_when_the_data_dir_is_gone(bpe_checkpoint):
    from tokenizers import Tokenizer

    tmp_path, bos_id, eos_id = bpe_checkpoint
    ckpt_path, _ = write_checkpoint(tmp_path, tiny_config(), "tokenizer.json", bos_id, eos_id)
    moved = tmp_path / "tokenizer.json"
    (tmp_path / "data" / "tokenizer.json").rename(moved)
    (tmp_path / "data" / "manifest.json").unlink()

    main([f"ckpt_path={ckpt_path}", f"output_dir={tmp_path / 'hf'}", f"tokenizer={moved}"])
    # With no manifest, the end-of-text token is found by its name, as project.generate finds it.
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tokenizer(SAMPLE)["input_ids"] == [eos_id, *Tokenizer.from_file(str(moved)).encode(SAMPLE).ids]


def test_an_export_into_a_folder_that_holds_files_is_refused_before_torch_is_imported(tmp_path):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    argv = ["-X", "importtime", "-m", "project.export", f"ckpt_path={tmp_path / 'last.ckpt'}", f"output_dir={taken}"]
    result = subprocess.run([sys.executable, *argv], cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 2
    assert f"error: output_dir {taken} exists and is not empty; choose another or pass overwrite=true" in result.stderr
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" not in imported and (taken / "notes.txt").read_text() == "mine"


# A trained run's checkpoint carries its tokenizer: what an export or a generation from it takes, whatever was prepared
# into its data.dir since.


@pytest.fixture
def prepared_again(single_reference, tiny_shards, tmp_path):
    """(single_reference's checkpoint, its data.dir): a copy of the shards it trained on, whose tokenizer has since
    been replaced by another of as many tokens, as data.overwrite=true with other text would leave it."""
    shards = Path(shutil.copytree(tiny_shards, tmp_path / "shards"))
    ckpt = torch.load(single_reference / "checkpoints" / "last.ckpt", weights_only=True)
    ckpt["datamodule_hyper_parameters"]["data_dir"] = str(shards)
    path = tmp_path / "last.ckpt"
    torch.save(ckpt, path)
    train_byte_level_bpe(shards / "tokenizer.json")
    return path, shards


def test_export_and_generate_take_the_tokenizer_the_checkpoint_carries_after_data_dir_was_prepared_again(
    prepared_again, tiny_shards, tmp_path, capsys
):
    from tokenizers import Tokenizer

    from project.generate import main as generate_main

    ckpt_path, shards = prepared_again
    trained_with = tiny_shards / "tokenizer.json"
    assert torch.load(ckpt_path, weights_only=True)["tokenizer_file"]["content"] == trained_with.read_bytes()
    assert (
        Tokenizer.from_file(str(shards / "tokenizer.json")).get_vocab()
        != Tokenizer.from_file(str(trained_with)).get_vocab()
    )

    main([f"ckpt_path={ckpt_path}", f"output_dir={tmp_path / 'hf'}"])
    exported = Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    assert exported.get_vocab() == Tokenizer.from_file(str(trained_with)).get_vocab()
    eos_id = json.loads((tiny_shards / "manifest.json").read_text())["tokenizer"]["eos_id"]
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tokenizer(SAMPLE)["input_ids"] == [eos_id, *Tokenizer.from_file(str(trained_with)).encode(SAMPLE).ids]

    capsys.readouterr()
    prompt = ["prompt=The king", "max_new_tokens=8", "temperature=0"]
    generate_main([f"ckpt_path={ckpt_path}", *prompt])
    carried = capsys.readouterr().out
    generate_main([f"ckpt_path={ckpt_path}", *prompt, f"tokenizer={trained_with}"])
    assert carried == capsys.readouterr().out and carried.startswith("The king")
    # The Python API's tokenizer (project.generate.load) outlives the temporary file it was loaded from.
    from project.generate import load

    _, tokenizer, _ = load(str(ckpt_path), None)
    assert tokenizer.save(tmp_path / "saved").read_bytes() == trained_with.read_bytes()


def _older_checkpoint(ckpt_path: Path, shards: Path) -> list[str]:
    """A checkpoint from before checkpoints carried their tokenizer: data.dir's is looked up, and checked."""
    ckpt = torch.load(ckpt_path, weights_only=True)
    del ckpt["tokenizer_file"]
    torch.save(ckpt, ckpt_path)
    return [f"ckpt_path={ckpt_path}"]


def _another_tokenizer_given(ckpt_path: Path, shards: Path) -> list[str]:
    return [f"ckpt_path={ckpt_path}", f"tokenizer={shards / 'tokenizer.json'}"]


@pytest.mark.parametrize("command", ["export", "generate"])
@pytest.mark.parametrize("case", [_older_checkpoint, _another_tokenizer_given], ids=["older-checkpoint", "given"])
def test_a_tokenizer_whose_vocabulary_is_not_the_checkpoints_is_refused(
    prepared_again, tmp_path, capsys, command, case
):
    from project.generate import main as generate_main

    ckpt_path, shards = prepared_again
    args = case(ckpt_path, shards)
    with pytest.raises(SystemExit) as exit_:
        if command == "export":
            main([*args, f"output_dir={tmp_path / 'hf'}"])
        else:
            generate_main([*args, "max_new_tokens=4"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1
    assert f"{shards / 'tokenizer.json'} is not the tokenizer ckpt_path={ckpt_path} was trained with" in err
    assert "its vocabulary's digest" in err and not (tmp_path / "hf").exists()
