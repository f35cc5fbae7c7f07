"""The README is executable truth: every `python -m project.*` and `make` command in its code blocks runs,
in order, on a fresh copy of the repository, as a user would run them after `make train`.

Only small overrides are appended (a tiny model, few steps); the README's own values stay in the command.
Where the user brings something (text for `make train` to have fetched, their own corpus), the test makes
a small stand-in first. Commands that cannot run here are skipped, each for the reason named in SKIPS.
"""

import json
import os
import random
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, WORDS

pytestmark = pytest.mark.slow

SKIPS = {
    "make train": "the test stands in for it: the packages are this environment's, and the corpus it fetches is "
    "generated below (tests reach no network)",
    "make test": "it runs this test",
    "trainer=gpu": "needs GPUs",
    "make install-horovod": "make test has run it before this test (the build is kept per machine)",
}
HOROVODRUN = Path(sys.executable).parent / "horovodrun"
TINY_MODEL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.multiple_of=32"]


def readme_commands(readme: Path) -> list[list[str]]:
    """The shell commands of the README's bash blocks that run `python -m project.*` (also under horovodrun) or
    `make`, as argv lists."""
    commands, block, in_bash = [], "", False
    for line in readme.read_text().splitlines():
        if line.startswith("```"):
            in_bash = line.strip() == "```bash" and not in_bash
            continue
        if in_bash:
            block += line.rstrip()[:-1] + " " if line.rstrip().endswith("\\") else line + "\n"
    for line in block.splitlines():
        argv = shlex.split(line, comments=True)
        python = python_part(argv)
        if python[:2] == ["python", "-m"] and python[2].startswith("project.") or argv[:1] == ["make"]:
            commands.append(argv)
    return commands


def python_part(argv: list[str]) -> list[str]:
    """`python -m ...` of a command, also of one that a launcher (horovodrun) starts."""
    return argv[argv.index("python") :] if argv[:1] == ["horovodrun"] and "python" in argv else argv


def skip_reason(argv: list[str]) -> str | None:
    text = " ".join(argv)
    if "dry_run=true" in argv and argv[2] == "project.train":  # a dry run of a GPU job needs no GPU
        return None
    if argv[0] == "horovodrun" and not HOROVODRUN.exists():
        return "Horovod is not installed here (make install-horovod)"
    return next((reason for key, reason in SKIPS.items() if key in text), None)


def write_text(path: Path, documents: int, lines: int, seed: int, suffix: str = ".txt") -> None:
    rng = random.Random(seed)
    path.mkdir(parents=True, exist_ok=True)
    for d in range(documents):
        text = "\n".join(
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + "." for _ in range(lines)
        )
        (path / f"doc{d}{suffix}").write_text(text + "\n")


def fresh_copy(target: Path) -> Path:
    """The repository's tracked files as they are in the working tree, and nothing else."""
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            (target / name).write_bytes((ROOT / name).read_bytes())
    return target


def published_stand_in(folder: Path, texts: list[str]) -> None:
    """A small Llama in the layout of Meta's Meta-Llama-3-8B folder, for the "Continue pretraining" commands:
    weights in several safetensors files with an index (as transformers saves them), and a tokenizer.json."""
    transformers = pytest.importorskip("transformers")
    import torch

    from project.data.tokenizer import train_bpe
    from project.hf.conversion import hf_config_dict
    from project.model.config import LlamaConfig

    tokenizer = train_bpe(texts, 512, folder)
    vocab = 4 * -(-tokenizer.vocab_size // 4)  # divisible by the tensor-parallel degree
    config = LlamaConfig(
        vocab_size=vocab,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        multiple_of=32,
        max_seq_len=8192,
        rope_theta=500000.0,
    )
    hf_config = transformers.LlamaConfig(
        **hf_config_dict(config, eos_token_id=tokenizer.eos_id, torch_dtype="bfloat16")
    )
    transformers.LlamaForCausalLM(hf_config).to(torch.bfloat16).save_pretrained(folder, max_shard_size="100KB")


def test_readme_lists_the_commands_this_test_runs():
    commands = readme_commands(ROOT / "README.md")
    runs = [c for c in commands if skip_reason(c) is None]
    assert ["make", "train"] in commands and ["make", "test"] in commands
    assert (
        len(runs) >= 10 and any(c[2] == "project.export" for c in runs) and any(c[2] == "project.prepare" for c in runs)
    )


def test_every_readme_command_runs_as_written_on_a_fresh_copy(tmp_path):
    repo = fresh_copy(tmp_path / "repo")
    # What `make train` leaves behind, in small: the corpus it fetches (generated here, under the names the
    # shakespeare data config globs for), prepared by training itself on first use (data.auto_prepare).
    write_text(repo / "data" / "raw" / "shakespeare", documents=8, lines=300, seed=0, suffix="_gut.txt")
    # The user's own text for the "Bring your own text" commands.
    (repo / "my_corpus").mkdir()
    rng = random.Random(1)
    lines = [f'{{"text": "{" ".join(rng.choice(WORDS) for _ in range(800))}"}}' for _ in range(60)]
    (repo / "my_corpus" / "docs.jsonl").write_text("\n".join(lines) + "\n")
    write_text(repo / "my_corpus" / "more", documents=3, lines=200, seed=2)
    # The published model for "Continue pretraining a published model".
    published_stand_in(repo / "published" / "Meta-Llama-3-8B", [json.loads(line)["text"] for line in lines])

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline"}
    env.pop("PYTEST_CURRENT_TEST", None)
    before = set(repo.rglob("*"))
    ran, steps = [], {}
    for argv in readme_commands(repo / "README.md"):
        if skip_reason(argv) is not None:
            continue
        launcher = [str(HOROVODRUN), *argv[1 : argv.index("python")]] if argv[0] == "horovodrun" else []
        argv = python_part(argv)
        command = [*launcher, sys.executable, *argv[1:]]
        if argv[2] == "project.train":
            # A run trains 2 steps; one that continues a run (its directory, or a checkpoint in it) one step more
            # than that run did, so that every resume has a step left.
            run = next((a.split("=", 1)[1] for a in argv if a.startswith("hydra.run.dir=")), None)
            source = next(
                (
                    a.split("=", 1)[1].split("/checkpoints/")[0]
                    for a in argv
                    if a.startswith("ckpt_path=") and "/checkpoints/" in a
                ),
                run,
            )
            max_steps = steps.get(source, 1) + 1
            steps[run or source or len(steps)] = max_steps
            # A run from a published folder takes the folder's (small) shape; the others are made small here.
            # A dry run shards the model as written (on the meta device: no memory, no training).
            tiny = [] if any(a.startswith(("init_from=", "dry_run=")) for a in argv) else TINY_MODEL
            command += [*tiny, f"trainer.max_steps={max_steps}", "trainer.enable_progress_bar=false"]
        result = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"`{shlex.join(argv)}` failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
        ran.append(shlex.join(argv))
    assert len(ran) >= 10
    assert (
        repo / "outputs" / "hf" / "my-llama" / "model.safetensors"
    ).is_file()  # the last command exported the r1 run
    assert (
        repo / "outputs" / "hf" / "llama3-mytext" / "config.json"
    ).is_file()  # and one before it the continued pretraining
    # What the commands write lands in outputs/ and data/, never among the user's sources (Python's own caches aside).
    written = {p.relative_to(repo) for p in set(repo.rglob("*")) - before if "__pycache__" not in p.parts}
    assert {p for p in written if p.parts[0] not in ("outputs", "data")} == set()
