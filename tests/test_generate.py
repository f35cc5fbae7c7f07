"""project.generate: KV-cached decoding against full recomputation, seeded sampling, and the CLI on checkpoints."""

import json
import subprocess
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from project.data.tokenizer import train_bpe
from project.generate import generate, main
from project.model.llama import KVCache, Llama, LlamaConfig
from tests.conftest import run_module, run_train, write_corpus

PROMPT = "The king"
CONFIGS = {
    "gqa": {},
    "mha": {"n_kv_heads": 4},
    # original_max_position_embeddings well under the sequence, so that the scaled band is reached.
    "rope_scaling": {
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
    },
    "tied": {"tie_embeddings": True},
}


def tiny_model(seed: int = 0, **overrides) -> Llama:
    fields = dict(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16, max_seq_len=64)
    torch.manual_seed(seed)
    # A larger init than training's 0.02 so that logits differ clearly between tokens and greedy has no near-ties.
    return Llama(LlamaConfig(**{**fields, "init_std": 0.2, **overrides}), init_seed=seed).eval()


@torch.no_grad()
def greedy_without_cache(model: Llama, prompt: list[int], steps: int) -> list[int]:
    """The reference: re-run the whole sequence for every new token."""
    seq = list(prompt)
    for _ in range(steps):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt) :]


@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
def test_greedy_decoding_with_kv_cache_gives_the_tokens_of_full_recomputation(overrides):
    model = tiny_model(**overrides)
    prompt = torch.randint(0, 97, (7,), generator=torch.Generator().manual_seed(1)).tolist()
    result = generate(model, prompt, max_new_tokens=40, temperature=0)
    assert result.tokens == greedy_without_cache(model, prompt, 40)
    assert result.stop == "max_new_tokens"


@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
@torch.no_grad()
def test_cached_logits_equal_full_sequence_logits_at_every_step(overrides):
    model = tiny_model(**overrides)
    tokens = torch.randint(0, 97, (2, 48), generator=torch.Generator().manual_seed(2))
    full = model(tokens)
    cache = KVCache(model.config, batch_size=2, max_len=48)
    # A prompt, then one token at a time, then a chunk of several: the mask must be causal within the chunk.
    chunks = [(0, 5), *((t, t + 1) for t in range(5, 40)), (40, 48)]
    for start, end in chunks:
        cached = model(tokens[:, start:end], cache=cache)
        torch.testing.assert_close(cached, full[:, start:end], rtol=1e-5, atol=1e-5, msg=f"positions {start}..{end}")
    assert cache.length == 48


def test_same_seed_gives_the_same_sample_and_another_seed_another():
    model = tiny_model()
    prompt = [3, 14, 15]

    def sample(seed: int) -> list[int]:
        return generate(
            model, prompt, 30, temperature=1.0, top_k=20, generator=torch.Generator().manual_seed(seed)
        ).tokens

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)  # 30 draws from ~20 tokens each: equal by chance with negligible probability
    assert len(set(sample(7))) > 1


def test_top_k_of_one_and_temperature_zero_are_both_greedy():
    model = tiny_model()
    greedy = generate(model, [5, 6], 20, temperature=0).tokens
    assert (
        generate(model, [5, 6], 20, temperature=1.5, top_k=1, generator=torch.Generator().manual_seed(0)).tokens
        == greedy
    )


def test_generation_stops_at_max_seq_len_and_says_so():
    model = tiny_model(max_seq_len=16)
    result = generate(model, list(range(10)), max_new_tokens=50, temperature=0)
    assert (len(result.tokens), result.stop) == (6, "max_seq_len")
    assert result.tokens == greedy_without_cache(model, list(range(10)), 6)


def test_generation_stops_at_eos_without_returning_it():
    model = tiny_model()
    greedy = generate(model, [1, 2, 3], 10, temperature=0).tokens
    result = generate(model, [1, 2, 3], 10, temperature=0, eos_id=greedy[4])
    assert (result.tokens, result.stop) == (greedy[: greedy.index(greedy[4])], "eos")


def test_sampling_keeps_to_the_tokenizers_ids_when_the_embedding_table_is_padded():
    model = tiny_model()
    tokens = generate(model, [1], 60, temperature=5.0, generator=torch.Generator().manual_seed(0), vocab_size=10).tokens
    assert max(tokens) < 10


# The CLI, on a checkpoint written here in the training format (fast) and on real training runs (slow).


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """A data directory as prepare leaves it, as far as generate reads it: manifest.json and the tokenizer."""
    directory = tmp_path_factory.mktemp("data")
    corpus = write_corpus(directory / "raw", documents=2, lines=100)
    tokenizer = train_bpe((p.read_text() for p in sorted(corpus.iterdir())), 300, directory)
    manifest = {
        "tokenizer": {
            "kind": "hf",
            "file": "tokenizer.json",
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
        }
    }
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return directory


def write_checkpoint(path: Path, model: Llama, data_dir: Path) -> Path:
    """What Lightning saves for our module, reduced to the parts generate reads."""
    ckpt = {
        "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
        "schedule": {},  # every checkpoint written since 2026-11-27 records one
        "hyper_parameters": {"model": asdict(model.config), "document_mask": False},
        "datamodule_hyper_parameters": {"data_dir": str(data_dir)},
    }
    torch.save(ckpt, path)
    return path


def test_cli_prints_the_prompt_and_the_greedy_continuation_of_the_library(data_dir, tmp_path, capsys):
    from project.data.tokenizer import load_tokenizer

    model = tiny_model(vocab_size=320)  # padded beyond the tokenizer's 300, as training may do
    ckpt = write_checkpoint(tmp_path / "last.ckpt", model, data_dir)
    main([f"ckpt_path={ckpt}", f"prompt={PROMPT}", "max_new_tokens=12", "temperature=0"])
    tokenizer = load_tokenizer(data_dir / "tokenizer.json")
    body = tokenizer.encode(PROMPT)
    # The prompt starts a document, as in the shards: after an end-of-text token.
    expected = generate(model, [tokenizer.eos_id, *body], 12, temperature=0, vocab_size=300, eos_id=tokenizer.eos_id)
    out = capsys.readouterr().out
    assert out == tokenizer.decode(body + expected.tokens) + "\n"
    assert out.startswith(PROMPT) and len(out) > len(PROMPT) + 1


def test_cli_uses_the_tokenizer_override_when_the_data_dir_is_gone(data_dir, tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "last.ckpt", tiny_model(vocab_size=300), tmp_path / "moved-away")
    main([f"ckpt_path={ckpt}", f"tokenizer={data_dir / 'tokenizer.json'}", "max_new_tokens=5", "seed=3"])
    assert capsys.readouterr().out.strip()


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "ckpt_path= is required"),
        (["ckpt_path={tmp}/nowhere.ckpt"], "does not exist"),
        (["ckpt_path={ckpt}", "temperature=-1"], "temperature=-1 must be at least 0"),
        (["ckpt_path={ckpt}", "top_k=many"], "top_k=many is not an integer"),
        (["ckpt_path={ckpt}", "promt=hi"], "unknown argument 'promt=hi'"),
        (["ckpt_path={lost}"], "cannot find the tokenizer"),
        (["ckpt_path={ckpt}", "prompt={long}"], "shorten it"),
    ],
)
def test_cli_explains_unusable_input_in_one_message(data_dir, tmp_path, capsys, args, message):
    ckpt = write_checkpoint(tmp_path / "last.ckpt", tiny_model(vocab_size=300), data_dir)
    lost = write_checkpoint(tmp_path / "lost.ckpt", tiny_model(vocab_size=300), tmp_path / "moved-away")
    values = {"tmp": tmp_path, "ckpt": ckpt, "lost": lost, "long": " king" * 80}  # 64 positions at most
    with pytest.raises(SystemExit) as exit_info:
        main([arg.format(**values) for arg in args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_missing_checkpoint_is_a_clean_error_exit_with_status_2(tmp_path):
    result = run_module("project.generate", [f"ckpt_path={tmp_path / 'missing.ckpt'}", "prompt=hi"], timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith("error: checkpoint ") and "Traceback" not in result.stderr
    assert result.stdout == ""


def run_generate(*args: str) -> subprocess.CompletedProcess:
    return run_module("project.generate", list(args), timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [[], ["strategy=fsdp2", "trainer.devices=2"]], ids=["file", "fsdp2-folder"])
def test_cli_continues_a_prompt_from_a_trained_checkpoint(tiny_shards, tmp_path, layout):
    run_train(tiny_shards, tmp_path, *layout, "trainer.max_steps=3", "val_every_n_steps=3")
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    assert ckpt.is_dir() == bool(layout)  # the sharded strategies write a folder
    from project.checkpoint.files import checkpoint_metadata

    # The tokenizer it trained with, in the file or the folder's meta.pt: what generate reads.
    assert checkpoint_metadata(ckpt)["tokenizer_file"]["content"] == (tiny_shards / "tokenizer.json").read_bytes()
    result = run_generate(f"ckpt_path={ckpt}", f"prompt={PROMPT}", "max_new_tokens=20")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(PROMPT) and len(result.stdout.strip()) > len(PROMPT)
    assert result.stdout == run_generate(f"ckpt_path={ckpt}", f"prompt={PROMPT}", "max_new_tokens=20").stdout  # seeded
