"""The README and the documentation pages are executable truth: every `python -m project.*`, `python -c` and `make`
command in their bash blocks runs, the README's first and then each page in the site's order (mkdocs.yml), on one
fresh copy of the repository, as a user would run them after `make train`.

Only small overrides are appended (a tiny model, few steps); the pages' own values stay in the command. Where the
user brings something (text for `make train` to have fetched, their own corpus), the test makes a small stand-in
first. Commands that cannot run here are skipped, each for the reason named in SKIPS; a command that an earlier
page already ran, word for word, is not run again (a page may show a run of another page again as an example).

The commands run in two states of the tree: a fresh one, where the first run on `make train`'s corpus prepares its
shards, and the one `make train` leaves, with those shards prepared. The runs that come after the first see the
second; the dry runs, which read the shards but never prepare them, run in both: where they come, and once more in
the other state (make train's shards put in place, or moved aside).
"""

import contextlib
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, WORDS, read_metrics, write_corpus
from warm_start import WarmServer, shared_server

from project.data.shards import MANIFEST_NAME
from project.runtime.console import IMPORT_NOISE

pytestmark = pytest.mark.slow

SKIPS = {
    "make train": "the test stands in for it: the packages are this environment's, and the corpus it fetches is "
    "generated below (tests reach no network)",
    "make test": "it runs this test",
    "trainer=gpu": "needs GPUs",
    "make install-horovod": "make test has run it before this test (the build is kept per machine)",
    "make gpu-check": "needs GPUs (tests/test_gpu_check.py runs its CPU plumbing, and its answer where there is none)",
    "make gpu-wheels": "fetches wheels from the package index (tests reach no network)",
    "s3://": "needs an S3 bucket and its credentials (tests/test_object_storage.py runs the same on moto's server)",
}
# Commands of other programs, none run here, each for its reason.
SKIPPED_PROGRAMS = {
    "source": "the test runs the environment's interpreter directly, as `.venv/bin/python` would",
    "wandb": "needs a wandb server (the offline runner on the same page runs the same specs)",
    "torchrun": "needs two machines (tests/test_clusters.py runs torchrun on two local nodes)",
    "sbatch": "needs a SLURM cluster (tests/test_clusters.py runs the scripts on a local one)",
    "mkdir": "prepares the SLURM job's log folder, for the sbatch command after it",
    "export": "sets the credentials of the s3:// commands after it",
    "scripts/gpu_check_offline.sh": "runs on a GPU node without a package index (tests/test_gpu_check.py runs it here)",
}
HOROVODRUN = Path(sys.executable).parent / "horovodrun"
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")
# The README's tour runs as written (the debug model's 30 steps, 20 of them under DDP and the rest resumed under
# FSDP2), so that what it says is checked: the resumed run continues exactly, ending on the one-device run's losses.
TOUR_FIRST = ["python", "-m", "project.train", "experiment=debug"]
TOUR_DIR = "outputs/runs/tour"
MAKE_PREPARE = ["experiment=shakespeare"]  # the Makefile's `prepare` (EXPERIMENT ?= shakespeare)
TINY_MODEL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.multiple_of=32"]


def documented_pages(repo: Path) -> list[Path]:
    """README.md, then the site's pages in the order of mkdocs.yml's nav."""

    def walk(nav: list) -> list[str]:
        return [p for entry in nav for v in entry.values() for p in (walk(v) if isinstance(v, list) else [v])]

    docs = yaml.safe_load((repo / "mkdocs.yml").read_text())
    return [repo / "README.md", *(repo / docs["docs_dir"] / page for page in walk(docs["nav"]))]


def readme_commands(readme: Path) -> list[list[str]]:
    """Every shell command of a page's bash blocks, as an argv list (`.venv/bin/python` read as `python`);
    variables set before a command (`PYTHONPATH=... python ...`) included."""
    commands, block, in_bash = [], "", False
    for line in readme.read_text().splitlines():
        if line.startswith("```"):
            in_bash = line.strip() == "```bash" and not in_bash
            continue
        if in_bash:
            block += line.rstrip()[:-1] + " " if line.rstrip().endswith("\\") else line + "\n"
    for line in block.splitlines():
        argv = ["python" if word == ".venv/bin/python" else word for word in shlex.split(line, comments=True)]
        if argv:
            commands.append(argv)
    return commands


def runnable(argv: list[str]) -> bool:
    """`python -m project.*` (also under horovodrun or after variables), `python -c` or `make`."""
    python = python_part(argv)
    return (
        python[:2] == ["python", "-m"]
        and len(python) > 2
        and python[2].startswith("project.")
        or python[:2] == ["python", "-c"]
        or argv[:1] == ["make"]
    )


def python_part(argv: list[str]) -> list[str]:
    """`python ...` of a command, also of one that a launcher (horovodrun) starts or that sets variables first."""
    if argv[:1] == ["horovodrun"] or argv and ENV_ASSIGNMENT.match(argv[0]):
        return argv[argv.index("python") :] if "python" in argv else argv
    return argv


def command_environment(argv: list[str], env: dict[str, str]) -> dict[str, str]:
    """The variables a command sets before `python`; `.venv/...` is this environment, which the copy lacks."""
    for assignment in argv[: argv.index("python")] if ENV_ASSIGNMENT.match(argv[0]) else []:
        name, value = assignment.split("=", 1)
        if value.startswith(".venv/"):
            value = str(Path(sys.prefix) / value.removeprefix(".venv/"))
        env = {**env, name: value}
    return env


def skip_reason(argv: list[str]) -> str | None:
    text = " ".join(argv)
    if "dry_run=true" in argv and argv[2] == "project.train":  # a dry run of a GPU job needs no GPU
        return None
    if argv[0] == "horovodrun" and not HOROVODRUN.exists():
        return "Horovod is not installed here (make install-horovod)"
    if argv[0] in SKIPPED_PROGRAMS:
        return SKIPPED_PROGRAMS[argv[0]]
    return next((reason for key, reason in SKIPS.items() if key in text), None)


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


def shakespeare_stand_in(repo: Path) -> None:
    """The corpus `make train` fetches, in small (generated, under the names the shakespeare data config globs for).
    Four documents of about 20,000 tokens: the long-context command's validation split needs a whole 16,385-token
    block."""
    write_corpus(repo / "data" / "raw" / "shakespeare", documents=4, lines=2000, seed=0, suffix="_gut.txt")


@pytest.fixture(scope="session")
def make_train_shards(tmp_path_factory) -> Path:
    """The shards `make train` prepares (`make prepare`: project.prepare of its experiment) from the stand-in corpus,
    in a folder laid out as a checkout: the same relative paths, so that a copy holding the same corpus takes them as
    its own."""
    root = tmp_path_factory.mktemp("make-train")
    shakespeare_stand_in(root)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PROJECT_ROOT": "."}
    env.pop("PYTEST_CURRENT_TEST", None)
    started = shared_server().start("project.prepare", MAKE_PREPARE, root, env)
    assert started.wait(300) == 0, started.communicate(10)[1][-4000:]
    (shards,) = (folder for folder in (root / "data").iterdir() if (folder / MANIFEST_NAME).is_file())
    return shards


def planned_dry_run(argv: list[str], repo: Path) -> list[str] | None:
    """After `project.plan ... out=DIR`, what the README says to do next: the plan's best layout as `project.train`
    overrides, with dry_run=true (on one rank, dry_run.ranks=[0]: the checks are the whole job's, the shares one
    rank's; planning.md's own dry run of that layout shows them all)."""
    out = next((a.split("=", 1)[1] for a in argv if a.startswith("out=")), None)
    if argv[:3] != ["python", "-m", "project.plan"] or out is None:
        return None
    best = json.loads((repo / out / "plan.json").read_text())["layouts"][0]["train_overrides"]
    return ["python", "-m", "project.train", *best, "dry_run=true", "dry_run.ranks=[0]"]


def dry_run_data_dir(argv: list[str], stdout: str, repo: Path) -> Path | None:
    """The data.dir a dry run read (its dry_run.json's), or None for a command that is not one."""
    written = re.search(r"^written: (.*dry_run\.json)$", stdout, re.MULTILINE)
    if "dry_run=true" not in argv or written is None:
        return None
    return (repo / json.loads((repo / written.group(1)).read_text())["data"]["dir"]).resolve()


@contextlib.contextmanager
def other_data_state(shards: Path, make_train_shards: Path):
    """The tree as it is, but `shards` (make train's data.dir in it) in the other state: moved aside where they are
    prepared, make train's put in place where they are not."""
    if (shards / MANIFEST_NAME).is_file():
        aside = shards.with_name(f"{shards.name}.aside")
        shards.rename(aside)
        try:
            yield
        finally:
            shutil.rmtree(shards, ignore_errors=True)
            aside.rename(shards)
    else:
        shutil.copytree(make_train_shards, shards, dirs_exist_ok=True)
        try:
            yield
        finally:
            shutil.rmtree(shards)


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


# First in the file: pytest-xdist hands a worker its next group once two or fewer of its tests are left, and a group
# whose long test came last would have the next group wait behind it on a busy worker while another worker idles.
def test_every_documented_command_runs_as_written_on_a_fresh_copy_and_after_make_train(
    tmp_path, request, make_train_shards
):
    repo = fresh_copy(tmp_path / "repo")
    # The corpus `make train` fetches, prepared by training itself on first use (data.auto_prepare).
    shakespeare_stand_in(repo)
    shards = repo / make_train_shards.relative_to(make_train_shards.parents[1])  # make train's data.dir
    # The user's own text for the "Bring your own text" commands.
    (repo / "my_corpus").mkdir()
    rng = random.Random(1)
    lines = [f'{{"text": "{" ".join(rng.choice(WORDS) for _ in range(800))}"}}' for _ in range(60)]
    (repo / "my_corpus" / "docs.jsonl").write_text("\n".join(lines) + "\n")
    write_corpus(repo / "my_corpus" / "more", documents=3, lines=200, seed=2)
    # The published model for "Continue pretraining a published model".
    published_stand_in(repo / "published" / "Meta-Llama-3-8B", [json.loads(line)["text"] for line in lines])

    # The copy is the user's checkout here: its data/ and outputs/ are where the commands read and write.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline", "PROJECT_ROOT": "."}
    env.pop("PYTEST_CURRENT_TEST", None)
    before = set(repo.rglob("*"))
    ran, steps, reran = [], {}, []
    server = WarmServer(repo)
    request.addfinalizer(server.close)
    commands = [argv for page in documented_pages(repo) for argv in readme_commands(page)]

    def run_as_shown(shown: list[str]) -> subprocess.CompletedProcess:
        argv = shown
        launcher = [str(HOROVODRUN), *argv[1 : argv.index("python")]] if argv[0] == "horovodrun" else []
        command_env = command_environment(argv, env)
        argv = python_part(argv)
        command = [*launcher, sys.executable, *argv[1:]]
        if launcher:  # horovodrun's processes start warm too, from the copy's server (as tests/test_horovod.py's)
            python, warm = server.python()
            command, command_env = [*launcher, python, *argv[1:]], {**command_env, **warm}
        run = next((a.split("=", 1)[1] for a in argv if a.startswith("hydra.run.dir=")), None)
        tour = argv[2] == "project.train" and (argv == TOUR_FIRST or run == TOUR_DIR)
        if tour:
            if run is not None:  # the debug experiment's trainer.max_steps, where a later command continues the run
                steps[run] = 30
            command += ["trainer.enable_progress_bar=false"]
        elif argv[2] == "project.train":
            # A run trains 2 steps; one that continues a run (its directory, or a checkpoint in it) one step more
            # than that run did, so that every resume has a step left.
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
        if launcher or argv[1] != "-m":  # horovodrun, and `python -c`, start as written
            result = subprocess.run(command, cwd=repo, env=command_env, capture_output=True, text=True, timeout=600)
        else:  # warm, from a server that imported the copy's own code (tests/warm_start.py)
            started = server.start(argv[2], command[3:], repo, command_env)
            result = subprocess.CompletedProcess(command, started.wait(600), *started.communicate(600))
        output = f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
        assert result.returncode == 0, f"`{shlex.join(shown)}` failed ({state()}):\n{output}"
        if tour and "ckpt_path=last" in argv:
            assert "learning-rate schedule" not in result.stderr, output
        if argv[1] == "-c":  # the user's own process (transformers, which imports torchao): its import noise filtered
            assert not any(re.search(start, result.stderr) for start, _why in IMPORT_NOISE.values()), output
        return result

    def state() -> str:
        return f"{shards.relative_to(repo)} {'prepared' if (shards / MANIFEST_NAME).is_file() else 'not prepared'}"

    for shown in commands:
        if skip_reason(shown) is not None or shlex.join(shown) in ran:
            continue
        result = run_as_shown(shown)
        ran.append(shlex.join(shown))
        if (next_step := planned_dry_run(shown, repo)) is not None:
            result = run_as_shown(shown := next_step)
        if dry_run_data_dir(shown, result.stdout, repo) == shards.resolve():
            with other_data_state(shards, make_train_shards):
                run_as_shown(shown)
            reran.append(shlex.join(shown))
    assert len(ran) >= 10
    # Each in both states: the README's plan-then-dry-run flow and planning.md's Mixtral dry run among them.
    assert any("dry_run.ranks=[0]" in c for c in reran) and any("model=mixtral_8x7b" in c for c in reran), reran
    # The tour's one-device run (the first run directory by date), and its DDP run resumed under FSDP2: equal losses.
    one_device = min((repo / "outputs" / "runs").glob("20*"))
    single, resumed = read_metrics(one_device, "train/loss"), read_metrics(repo / TOUR_DIR, "train/loss")
    assert sorted(resumed) == sorted(single) == list(range(30))
    assert resumed == pytest.approx(single, rel=1e-5)
    # The exports of the tour, of the Runs page's r1 run and of the continued pretraining.
    for export in ("tour", "my-llama", "llama3-mytext"):
        assert (repo / "outputs" / "hf" / export / "model.safetensors").is_file(), export
    # What the commands write lands in outputs/ and data/, never among the user's sources (Python's own caches aside).
    written = {p.relative_to(repo) for p in set(repo.rglob("*")) - before if "__pycache__" not in p.parts}
    assert {p for p in written if p.parts[0] not in ("outputs", "data")} == set()


def test_the_readme_gives_the_set_up_commands_first_and_stays_short():
    readme = (ROOT / "README.md").read_text()
    assert readme_commands(ROOT / "README.md")[:2] == [["make", "train"], ["make", "test"]]
    assert len(readme.splitlines()) <= 250


def test_the_pages_list_the_commands_this_test_runs():
    commands = [c for page in documented_pages(ROOT) for c in readme_commands(page)]
    runs = [python_part(c) for c in commands if skip_reason(c) is None]
    assert ["make", "train"] in commands and ["make", "test"] in commands
    unaccounted = [shlex.join(c) for c in commands if not runnable(c) and skip_reason(c) is None]
    assert unaccounted == []  # each command runs, or is skipped for a reason named above
    for entry in ("project.train", "project.prepare", "project.export", "project.generate", "project.plan"):
        assert any(c[2] == entry for c in runs if c[1] == "-m"), entry
    assert any(c[1] == "-c" and "transformers" in c[2] for c in runs)  # the export loads in transformers
