"""Every bad input file is one clear error that names its setting, and earlier good output survives it
(issue: reliability).

One row per case: a function that builds the bad input in tmp_path (a copy of the session's tiny shards
where they must be damaged: the fixture itself stays whole), the command and its arguments, and the
pattern the message must match. Each case checks the answer `python -m <command>` gives: `error: ...`
in one paragraph, exit status 2, no traceback, and every file of the earlier good output the row names
(shards, a run's checkpoints, an export) byte for byte as it was.

Rows run in this process where the command's own code raises the error before anything a subprocess
would add (the checks before training, the prepare and export functions, generate's main), wrapped in
the same `exit_on_config_error` as the command; at least one row per command, and every row whose error
comes from deeper in (Lightning's fit, litdata's workers, a file-size limit), runs the real command.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from project.config.checks import preflight
from project.config.command_line import CONF, check_command_line
from project.runtime.errors import exit_on_config_error
from tests.conftest import run_module, run_train, train_overrides, write_corpus

pytestmark = pytest.mark.slow

MODULES = {
    "train": "project.train",
    "prepare": "project.prepare",
    "export": "project.export",
    "generate": "project.generate",
}
# Bytes a file may grow to in a row that fills the disk: the tokenizer, manifests and configs fit, a
# shard chunk (121 KB for the tiny corpus) or the tiny model's safetensors (~400 KB) do not.
FILE_SIZE_LIMIT = 64 * 1024


@dataclass
class Inputs:
    """What a row builds its bad input from; rows write only under `tmp`. The module's fixtures are made
    when a row first asks for them, so that rows which need no trained run do not wait for one."""

    tmp: Path
    shards: Path  # the session's tiny shards (tests/conftest.py): read, copied, never changed
    request: pytest.FixtureRequest

    @property
    def run(self) -> Path:
        """A short training run of the shards, with checkpoints/last.ckpt."""
        return self.request.getfixturevalue("trained_run")

    @property
    def other_tokenizer_shards(self) -> Path:
        """The same text, tokenized by another tokenizer of the same size."""
        return self.request.getfixturevalue("other_tokenizer_shards")

    @property
    def raw(self) -> Path:
        return self.shards.parent / "raw"

    @property
    def ckpt(self) -> Path:
        return self.run / "checkpoints" / "last.ckpt"

    def copy_shards(self) -> Path:
        return Path(shutil.copytree(self.shards, self.tmp / "shards"))

    def train(self, data_dir: Path, *extra: str) -> list[str]:
        # The source files of the shards (copies of tiny_shards included): their data settings are the run's.
        return train_overrides(data_dir, self.tmp / "run", f"data.sources=[{self.raw}/*.txt]", *extra)

    def prepare(self, sources: str, data_dir: Path, *extra: str) -> list[str]:
        return ["data=tiny", f"data.sources=[{sources}]", f"data.dir={data_dir}", "data.vocab_size=300",
                "data.seq_len=32", f"hydra.run.dir={self.tmp / 'prepare-run'}", *extra]  # fmt: skip


OLDER_FORMAT = r"ckpt_path=\S*older.ckpt was written before 2026-11-27 .* 0.1.0 \(git checkout da724a6\) reads it"


@dataclass
class Built:
    args: list[str]
    keep: list[Path] = field(default_factory=list)  # earlier good output: must be byte for byte unchanged


@dataclass
class Case:
    id: str
    command: str
    build: Callable[[Inputs], Built]
    message: str
    subprocess: bool = False
    file_size_limit: int | None = None
    # The command got as far as Lightning or litdata, which print warnings or progress bars on stderr first.
    past_the_checks: bool = False


def read_only_folder(path: Path) -> Path:
    """A folder its owner cannot write; skips where the tests run as root, whose writes no mode stops."""
    path.mkdir(parents=True)
    path.chmod(0o555)
    try:
        (path / ".probe").write_text("")
    except PermissionError:
        return path
    (path / ".probe").unlink()
    path.chmod(0o755)
    pytest.skip("running as root: a read-only folder does not stop root's writes")


def a_file(inputs: Inputs) -> Path:
    """A plain file where a folder should be: no mode, and no root, can write below it."""
    path = inputs.tmp / "a-file"
    path.write_text("not a folder\n")
    return path


def random_bytes(path: Path, size: int, seed: int = 0) -> Path:
    path.write_bytes(random.Random(seed).randbytes(size))
    return path


def first_half(source: Path, path: Path) -> Path:
    data = source.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def good_export(inputs: Inputs) -> Path:
    """An export of the run's checkpoint, as a user would have it before exporting again."""
    from project.hf.export import export

    out = inputs.tmp / "hf"
    export(str(inputs.ckpt), str(out))
    return out


# --- the data a run trains on (data.dir) ---


def data_dir_missing(inputs: Inputs) -> Built:
    return Built(inputs.train(inputs.tmp / "nowhere", "data.auto_prepare=false"))


def data_dir_empty(inputs: Inputs) -> Built:
    (inputs.tmp / "empty").mkdir()
    return Built(inputs.train(inputs.tmp / "empty", "data.auto_prepare=false"))


def data_dir_foreign(inputs: Inputs) -> Built:
    folder = inputs.tmp / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("A folder of other files, not shards.\n")
    # data.auto_prepare stays true: the run must neither prepare into it nor first fetch the corpus.
    return Built(inputs.train(folder), keep=[folder])


def shards_of_another_block_size(inputs: Inputs) -> Built:
    return Built(inputs.train(inputs.shards, "data.seq_len=16"), keep=[inputs.shards])


def manifest_not_json(inputs: Inputs) -> Built:
    shards = inputs.copy_shards()
    (shards / "manifest.json").write_text('{"format": 1, "tokenizer": ')
    return Built(inputs.train(shards))


def manifest_without_keys(inputs: Inputs) -> Built:
    shards = inputs.copy_shards()
    manifest = json.loads((shards / "manifest.json").read_text())
    del manifest["block_size"], manifest["splits"]["train"]
    (shards / "manifest.json").write_text(json.dumps(manifest))
    return Built(inputs.train(shards))


def index_missing(inputs: Inputs) -> Built:
    shards = inputs.copy_shards()
    (shards / "val" / "index.json").unlink()
    return Built(inputs.train(shards))


def chunk_truncated(inputs: Inputs) -> Built:
    shards = inputs.copy_shards()
    chunk = shards / "train" / "chunk-0-0.bin"
    first_half(chunk, chunk)
    return Built(inputs.train(shards))


def chunk_corrupt(inputs: Inputs) -> Built:
    shards = inputs.copy_shards()
    chunk = shards / "train" / "chunk-0-0.bin"
    random_bytes(chunk, chunk.stat().st_size)  # the size litdata's index records: only the bytes are wrong
    return Built(inputs.train(shards))


# --- raw text and tokenizers for prepare (data.sources, data.tokenizer) ---


def sources_match_nothing(inputs: Inputs) -> Built:
    return Built(inputs.prepare(str(inputs.tmp / "raw" / "*.txt"), inputs.tmp / "shards"))


def sources_all_empty(inputs: Inputs) -> Built:
    raw = inputs.tmp / "raw"
    raw.mkdir()
    for name in ("a.txt", "b.txt", "c.md"):
        (raw / name).write_text("\n  \n" if name == "c.md" else "")
    return Built(inputs.prepare(str(raw), inputs.tmp / "shards"))


def source_binary(inputs: Inputs) -> Built:
    raw = write_corpus(inputs.tmp / "raw", documents=2, lines=20)
    (raw / "doc1.txt").write_bytes(gzip.compress((raw / "doc1.txt").read_bytes()))  # compressed, named .txt
    return Built(inputs.prepare(str(raw / "*.txt"), inputs.tmp / "shards"))


def source_latin1(inputs: Inputs) -> Built:
    raw = write_corpus(inputs.tmp / "raw", documents=2, lines=20)
    (raw / "doc1.txt").write_bytes("Le café de la reine, à minuit.\n".encode("latin-1"))
    return Built(inputs.prepare(str(raw / "*.txt"), inputs.tmp / "shards"))


def prepared_manifest_not_json(inputs: Inputs) -> Built:
    shards = inputs.copy_shards()
    (shards / "manifest.json").write_text("{")
    return Built(inputs.prepare(str(inputs.raw / "*.txt"), shards), keep=[shards])


def tokenizer_corrupt(inputs: Inputs) -> Built:
    tokenizer = inputs.tmp / "tokenizer.json"
    tokenizer.write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": ')
    return Built(inputs.prepare(str(inputs.raw / "*.txt"), inputs.tmp / "shards", f"data.tokenizer={tokenizer}"))


def tokenizer_without_end_of_text(inputs: Inputs) -> Built:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator(["the king and the queen"] * 10, trainer)
    tokenizer.save(str(inputs.tmp / "tokenizer.json"))
    return Built(
        inputs.prepare(
            str(inputs.raw / "*.txt"), inputs.tmp / "shards", f"data.tokenizer={inputs.tmp / 'tokenizer.json'}"
        )
    )


def tokenizer_missing(inputs: Inputs) -> Built:
    tokenizer = inputs.tmp / "nowhere" / "tokenizer.json"
    return Built(inputs.prepare(str(inputs.raw / "*.txt"), inputs.tmp / "shards", f"data.tokenizer={tokenizer}"))


def prepare_into_read_only_folder(inputs: Inputs) -> Built:
    return Built(inputs.prepare(str(inputs.raw / "*.txt"), read_only_folder(inputs.tmp / "ro") / "shards"))


def prepare_below_a_file(inputs: Inputs) -> Built:
    return Built(inputs.prepare(str(inputs.raw / "*.txt"), a_file(inputs) / "shards"))


def prepare_into_a_file(inputs: Inputs) -> Built:
    path = a_file(inputs)
    return Built(inputs.prepare(str(inputs.raw / "*.txt"), path), keep=[path])


def prepare_fills_the_disk(inputs: Inputs) -> Built:
    shards = inputs.copy_shards()  # earlier good shards, from other settings, replaced only once the new are whole
    return Built(
        inputs.prepare(str(inputs.raw / "*.txt"), shards, "data.seq_len=16", "data.overwrite=true"), keep=[shards]
    )


# --- checkpoints to resume from (ckpt_path) and where a run writes (hydra.run.dir) ---


def ckpt_missing(inputs: Inputs) -> Built:
    return Built(inputs.train(inputs.shards, f"ckpt_path={inputs.tmp / 'nowhere.ckpt'}"))


def ckpt_corrupt(inputs: Inputs) -> Built:
    return Built(inputs.train(inputs.shards, f"ckpt_path={random_bytes(inputs.tmp / 'last.ckpt', 4096)}"))


def ckpt_truncated(inputs: Inputs) -> Built:
    ckpt = first_half(inputs.ckpt, inputs.tmp / "last.ckpt")
    return Built(inputs.train(inputs.shards, f"ckpt_path={ckpt}", "trainer.max_steps=4"))


def ckpt_corrupt_inside(inputs: Inputs) -> Built:
    """Whole as a zip archive (its directory, at the end, is intact), damaged within: torch must read it to tell."""
    data = bytearray(inputs.ckpt.read_bytes())
    data[64:4096] = random.Random(0).randbytes(4096 - 64)  # the pickled dict, right after the first local header
    (inputs.tmp / "last.ckpt").write_bytes(bytes(data))
    return Built(inputs.train(inputs.shards, f"ckpt_path={inputs.tmp / 'last.ckpt'}", "trainer.max_steps=4"))


def ckpt_of_another_model_shape(inputs: Inputs) -> Built:
    run = Path(shutil.copytree(inputs.run, inputs.tmp / "run"))  # resumed in place, as `ckpt_path=last` does
    args = train_overrides(inputs.shards, run, "ckpt_path=last", "trainer.max_steps=4", "model.dim=32")
    return Built(args, keep=[run / "checkpoints"])


def ckpt_of_another_tokenizer(inputs: Inputs) -> Built:
    shards = (
        inputs.other_tokenizer_shards
    )  # trained with the tokenizer they were prepared with: only the checkpoint differs
    tokenizer = shards.parent / "tokenizer" / "tokenizer.json"
    args = inputs.train(
        shards,
        f"ckpt_path={inputs.ckpt}",
        "trainer.max_steps=4",
        f"data.sources=[{inputs.raw}/*.txt]",
        f"data.tokenizer={tokenizer}",
    )
    return Built(args, keep=[inputs.run / "checkpoints"])


def older_format(inputs: Inputs) -> Path:
    """The run's checkpoint as one written before 2026-11-27 looked: no schedule record."""
    import torch

    checkpoint = torch.load(inputs.ckpt, weights_only=False)
    del checkpoint["schedule"]
    torch.save(checkpoint, inputs.tmp / "older.ckpt")
    return inputs.tmp / "older.ckpt"


def ckpt_of_an_older_format(inputs: Inputs) -> Built:
    ckpt = older_format(inputs)
    return Built(inputs.train(inputs.shards, f"ckpt_path={ckpt}", "trainer.max_steps=4"), keep=[ckpt])


def export_ckpt_of_an_older_format(inputs: Inputs) -> Built:
    ckpt = older_format(inputs)
    return Built([f"ckpt_path={ckpt}", f"output_dir={inputs.tmp / 'hf'}"], keep=[ckpt])


def generate_ckpt_of_an_older_format(inputs: Inputs) -> Built:
    ckpt = older_format(inputs)
    return Built([f"ckpt_path={ckpt}", "prompt=the king"], keep=[ckpt])


def run_dir_read_only(inputs: Inputs) -> Built:
    return Built(train_overrides(inputs.shards, read_only_folder(inputs.tmp / "ro") / "run"))


def run_dir_below_a_file(inputs: Inputs) -> Built:
    return Built(train_overrides(inputs.shards, a_file(inputs) / "run"))


# --- checkpoints to export and to generate from, and where an export goes (output_dir) ---


def export_ckpt_missing(inputs: Inputs) -> Built:
    return Built([f"ckpt_path={inputs.tmp / 'nowhere.ckpt'}", f"output_dir={inputs.tmp / 'hf'}"])


def export_ckpt_corrupt(inputs: Inputs) -> Built:
    ckpt = random_bytes(inputs.tmp / "last.ckpt", 4096)
    return Built([f"ckpt_path={ckpt}", f"output_dir={inputs.tmp / 'hf'}"])


def export_ckpt_truncated(inputs: Inputs) -> Built:
    ckpt = first_half(inputs.ckpt, inputs.tmp / "last.ckpt")
    return Built([f"ckpt_path={ckpt}", f"output_dir={inputs.tmp / 'hf'}"])


def export_into_read_only_folder(inputs: Inputs) -> Built:
    return Built([f"ckpt_path={inputs.ckpt}", f"output_dir={read_only_folder(inputs.tmp / 'ro') / 'hf'}"])


def export_below_a_file(inputs: Inputs) -> Built:
    return Built([f"ckpt_path={inputs.ckpt}", f"output_dir={a_file(inputs) / 'hf'}"])


def export_fills_the_disk(inputs: Inputs) -> Built:
    out = good_export(inputs)
    return Built([f"ckpt_path={inputs.ckpt}", f"output_dir={out}", "overwrite=true"], keep=[out])


def generate_ckpt_missing(inputs: Inputs) -> Built:
    return Built([f"ckpt_path={inputs.tmp / 'nowhere.ckpt'}", "prompt=the king"])


def generate_ckpt_corrupt(inputs: Inputs) -> Built:
    return Built([f"ckpt_path={random_bytes(inputs.tmp / 'last.ckpt', 4096)}", "prompt=the king"])


def generate_ckpt_truncated(inputs: Inputs) -> Built:
    return Built([f"ckpt_path={first_half(inputs.ckpt, inputs.tmp / 'last.ckpt')}", "prompt=the king"])


NOT_A_CHECKPOINT = r"is not a checkpoint this platform can read"
RE_PREPARE = r"prepare the shards again with `python -m project.prepare data.dir=.* data.overwrite=true`"
CASES = [
    Case(
        "data-dir-missing",
        "train",
        data_dir_missing,
        r"no prepared shards in data.dir=\S*nowhere \(missing manifest.json; the folder does not exist\): "
        r"run `python -m project.prepare`",
    ),
    Case(
        "data-dir-empty",
        "train",
        data_dir_empty,
        r"no prepared shards in data.dir=\S*empty \(missing manifest.json\): run `python -m project.prepare`",
    ),
    Case(
        "data-dir-foreign",
        "train",
        data_dir_foreign,
        r"data.dir=\S*mine exists, is not empty and holds no manifest.json",
        subprocess=True,
    ),
    Case(
        "data-other-block-size",
        "train",
        shards_of_another_block_size,
        r"holds shards prepared from other data settings than this run's: data.seq_len: 32 there, 16 here\. "
        r".*data.overwrite=true",
    ),
    Case(
        "data-manifest-not-json",
        "train",
        manifest_not_json,
        rf"data.dir=\S*: \S*manifest.json is not JSON \(.*\); {RE_PREPARE}",
    ),
    Case(
        "data-manifest-without-keys",
        "train",
        manifest_without_keys,
        rf"manifest.json lacks block_size, splits.train.blocks, .*; {RE_PREPARE}",
    ),
    Case("data-index-missing", "train", index_missing, rf"val/index.json is missing; {RE_PREPARE}"),
    Case(
        "data-chunk-truncated",
        "train",
        chunk_truncated,
        rf"shard \S*train/chunk-0-0.bin holds \d+ bytes where its index.json says \d+.*; {RE_PREPARE}",
    ),
    Case(
        "data-chunk-corrupt",
        "train",
        chunk_corrupt,
        rf"shard \S*train/chunk-0-0.bin does not start with the header litdata wrote .*; {RE_PREPARE}",
    ),
    Case(
        "sources-match-nothing", "prepare", sources_match_nothing, r"data.sources=\[\S*raw/\*.txt'\] matched no files"
    ),
    Case("sources-all-empty", "prepare", sources_all_empty, r"data.sources hold 0 non-empty document\(s\)"),
    Case(
        "source-binary",
        "prepare",
        source_binary,
        r"\S*doc1.txt is not UTF-8 text \(.*\); convert it or drop it from data.sources",
    ),
    Case(
        "source-latin1",
        "prepare",
        source_latin1,
        r"\S*doc1.txt is not UTF-8 text \(.*\); convert it or drop it from data.sources",
        subprocess=True,
    ),
    Case(
        "prepare-manifest-not-json",
        "prepare",
        prepared_manifest_not_json,
        r"data.dir=\S*shards holds a manifest.json that is not a manifest .* Set data.overwrite=true",
    ),
    Case(
        "tokenizer-corrupt",
        "prepare",
        tokenizer_corrupt,
        r"data.tokenizer='\S*tokenizer.json' could not be read as a HF tokenizer.json",
    ),
    Case(
        "tokenizer-without-eos",
        "prepare",
        tokenizer_without_end_of_text,
        r"data.tokenizer='\S*tokenizer.json' has no end-of-text token",
    ),
    Case(
        "tokenizer-missing", "prepare", tokenizer_missing, r"data.tokenizer='\S*nowhere/tokenizer.json' is not a file"
    ),
    Case(
        "prepare-read-only",
        "prepare",
        prepare_into_read_only_folder,
        r"data.dir=\S*ro/shards: cannot write there \(\S*ro is not writable by this user",
    ),
    Case(
        "prepare-below-a-file",
        "prepare",
        prepare_below_a_file,
        r"data.dir=\S*a-file/shards: cannot write there \(\S*a-file is a file, not a folder\)",
    ),
    Case(
        "prepare-into-a-file",
        "prepare",
        prepare_into_a_file,
        r"data.dir=\S*a-file: cannot write there \(\S*a-file is a file, not a folder\)",
    ),
    Case(
        "prepare-disk-full",
        "prepare",
        prepare_fills_the_disk,
        r"data.dir=\S*shards: could not write \S* \(File too large\): free space on that disk.*left as it was",
        subprocess=True,
        file_size_limit=FILE_SIZE_LIMIT,
        past_the_checks=True,
    ),  # fmt: skip
    Case(
        "ckpt-missing",
        "train",
        ckpt_missing,
        r"ckpt_path=\S*nowhere.ckpt: no checkpoint at \S*nowhere.ckpt. Pass a checkpoint file",
    ),
    Case(
        "ckpt-corrupt",
        "train",
        ckpt_corrupt,
        rf"{NOT_A_CHECKPOINT} \(no whole zip archive.*\): set ckpt_path= to another checkpoint",
    ),
    Case(
        "ckpt-truncated",
        "train",
        ckpt_truncated,
        rf"{NOT_A_CHECKPOINT} \(no whole zip archive.*\): set ckpt_path= to another",
        subprocess=True,
    ),
    Case(
        "ckpt-corrupt-inside",
        "train",
        ckpt_corrupt_inside,
        rf"{NOT_A_CHECKPOINT} \(.*\): it may be truncated or corrupt",
        subprocess=True,
        past_the_checks=True,
    ),  # fmt: skip
    Case(
        "ckpt-other-model-shape",
        "train",
        ckpt_of_another_model_shape,
        r"ckpt_path=\S*last.ckpt holds a model of another shape \(\S+: \[\d+, 64\] there, \[\d+, 32\] here\): "
        r"it was trained with model.dim=64, this run has model.dim=32. Resume with the checkpoint's model settings",
        subprocess=True,
        past_the_checks=True,
    ),  # fmt: skip
    Case(
        "ckpt-other-tokenizer",
        "train",
        ckpt_of_another_tokenizer,
        r"ckpt_path=\S*last.ckpt was trained on the token ids of another tokenizer than the shards in "
        r"data.dir=\S* \(.*vocabulary_sha256.*\).* Resume with data.dir set to shards prepared with the checkpoint's "
        r"tokenizer",
        subprocess=True,
        past_the_checks=True,
    ),  # fmt: skip
    Case("ckpt-older-format", "train", ckpt_of_an_older_format, OLDER_FORMAT, subprocess=True, past_the_checks=True),
    Case(
        "run-dir-read-only",
        "train",
        run_dir_read_only,
        r"hydra.run.dir=\S*ro/run: cannot make the run directory there \(\S*ro is not writable by this user",
        subprocess=True,
    ),
    Case(
        "run-dir-below-a-file",
        "train",
        run_dir_below_a_file,
        r"hydra.run.dir=\S*a-file/run: cannot make the run directory there \(\S*a-file is a file",
        subprocess=True,
    ),
    Case(
        "export-ckpt-missing",
        "export",
        export_ckpt_missing,
        r"checkpoint \S*nowhere.ckpt does not exist; pass ckpt_path=",
    ),
    Case(
        "export-ckpt-corrupt",
        "export",
        export_ckpt_corrupt,
        rf"ckpt_path=\S*last.ckpt: \S*last.ckpt {NOT_A_CHECKPOINT}",
    ),
    Case(
        "export-ckpt-truncated",
        "export",
        export_ckpt_truncated,
        rf"ckpt_path=\S*last.ckpt: \S*last.ckpt {NOT_A_CHECKPOINT}",
        subprocess=True,
    ),
    Case("export-ckpt-older-format", "export", export_ckpt_of_an_older_format, OLDER_FORMAT),
    Case(
        "export-read-only",
        "export",
        export_into_read_only_folder,
        r"output_dir=\S*ro/hf: cannot write there \(\S*ro is not writable by this user",
    ),
    Case(
        "export-below-a-file",
        "export",
        export_below_a_file,
        r"output_dir=\S*a-file/hf: cannot write there \(\S*a-file is a file, not a folder\)",
    ),
    Case(
        "export-disk-full",
        "export",
        export_fills_the_disk,
        r"output_dir=\S*hf: could not write the export \(.*File too large.*\): free space on that disk",
        subprocess=True,
        file_size_limit=FILE_SIZE_LIMIT,
    ),  # fmt: skip
    Case(
        "generate-ckpt-missing",
        "generate",
        generate_ckpt_missing,
        r"checkpoint \S*nowhere.ckpt does not exist; pass ckpt_path=",
        subprocess=True,
    ),
    Case(
        "generate-ckpt-corrupt",
        "generate",
        generate_ckpt_corrupt,
        rf"ckpt_path=\S*last.ckpt: \S*last.ckpt {NOT_A_CHECKPOINT}",
    ),
    Case(
        "generate-ckpt-truncated",
        "generate",
        generate_ckpt_truncated,
        rf"ckpt_path=\S*last.ckpt: \S*last.ckpt {NOT_A_CHECKPOINT}",
    ),
    Case("generate-ckpt-older-format", "generate", generate_ckpt_of_an_older_format, OLDER_FORMAT),
]


@pytest.fixture(scope="module")
def trained_run(tiny_shards, tmp_path_factory) -> Path:
    """Two steps on the tiny shards, checkpointed: the run a user resumes, exports and samples from."""
    run_dir = tmp_path_factory.mktemp("trained")
    run_train(
        tiny_shards, run_dir, "trainer.max_steps=2", "val_every_n_steps=2", "ckpt_every_n_steps=2", "val_sequences=8"
    )
    return run_dir


@pytest.fixture(scope="module")
def other_tokenizer_shards(tiny_shards, tmp_path_factory) -> Path:
    """The tiny corpus prepared with a BPE of the same size trained on other text: same shapes, other ids."""
    from project.data.prepare import prepare_shards
    from project.data.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("other-tokenizer")
    other_text = write_corpus(root / "other-text", seed=1)
    texts = (p.read_text()[::-1] for p in sorted(other_text.iterdir()))  # reversed: other words, other merges
    tokenizer = train_bpe(texts, 300, root / "tokenizer")
    prepare_shards(
        [str(tiny_shards.parent / "raw" / "*.txt")],
        root / "shards",
        tokenizer=tokenizer.path,
        seq_len=32,
        num_workers=1,
    )
    return root / "shards"


def file_hashes(paths: list[Path]) -> dict[str, str]:
    files = [f for p in paths for f in ([p] if p.is_file() else sorted(p.rglob("*"))) if f.is_file()]
    return {str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def compose_for(command: str, args: list[str]):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose(
            "train" if command == "train" else "prepare", overrides=[a for a in args if not a.startswith("hydra.")]
        )


def call_in_process(command: str, args: list[str]) -> None:
    """What the command runs, from its arguments, in this process."""
    if command == "train":  # project.train checks all this before it imports torch
        check_command_line(args)
        preflight(compose_for(command, args))
    elif command == "prepare":
        from project.data.prepare import prepare_from_config

        check_command_line(args, config_name="prepare")
        prepare_from_config(OmegaConf.to_container(compose_for(command, args).data, resolve=True))
    else:
        from project.generate import main as generate_main
        from project.hf.export import main as export_main

        {"export": export_main, "generate": generate_main}[command](args)


def run_command(command: str, args: list[str], file_size_limit: int | None) -> tuple[int, str]:
    result = run_module(
        MODULES[command], args, timeout=300, env={"HF_HUB_OFFLINE": "1"}, file_size_limit=file_size_limit
    )
    return result.returncode, result.stderr


def error_paragraph(stderr: str) -> str:
    """The error the command ended with. Runs that got as far as training (a checkpoint refused when Lightning
    restores it) or as litdata's workers (the disk filling up) print their own warnings and progress bars on
    stderr before it: the error is then the last paragraph, which must come after them all."""
    start = stderr.rfind("\nerror: ") + 1
    return stderr[start:]


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_a_bad_file_is_one_clear_error_and_earlier_output_survives(case, tmp_path, tiny_shards, request, capsys):
    built = case.build(Inputs(tmp_path, tiny_shards, request))
    before = file_hashes(built.keep)
    capsys.readouterr()  # what building printed is not the answer

    if case.subprocess:
        code, stderr = run_command(case.command, built.args, case.file_size_limit)
    else:
        with pytest.raises(SystemExit) as exit_, exit_on_config_error():
            call_in_process(case.command, built.args)
        code, stderr = exit_.value.code, capsys.readouterr().err

    assert code == 2, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    error = error_paragraph(stderr) if case.past_the_checks else stderr
    assert error.startswith("error: ") and error.count("\n") == 1, stderr[-3000:]
    assert re.search(case.message, error), error
    assert file_hashes(built.keep) == before


# Every refusal of a real start's files but three: a checkpoint whose tensors are damaged (a dry run reads no tensor),
# a data.dir that does not exist here, and one of shards prepared from other settings (a dry run sizes a job for
# another machine, and says the shards are elsewhere or not the job's: tests/test_dry_run.py).
NOT_DRY_RUN_CASES = ("ckpt-corrupt-inside", "data-dir-missing", "data-other-block-size")
DRY_RUN_CASES = [case for case in CASES if case.command == "train" and case.id not in NOT_DRY_RUN_CASES]


@pytest.mark.parametrize("case", DRY_RUN_CASES, ids=[case.id for case in DRY_RUN_CASES])
def test_a_dry_run_refuses_every_bad_file_a_real_start_refuses(case, tmp_path, tiny_shards, request, capsys):
    from project.planning.dry_run import dry_run

    built = case.build(Inputs(tmp_path, tiny_shards, request))
    capsys.readouterr()
    run_dir = Path(next(a for a in built.args if a.startswith("hydra.run.dir=")).partition("=")[2])
    with pytest.raises(SystemExit) as exit_, exit_on_config_error():
        check_command_line([*built.args, "dry_run.enabled=true"])
        cfg = compose_for("train", [*built.args, "dry_run.enabled=true"])
        dry_run(cfg, preflight(cfg, dry_run=True, run_dir=run_dir), "single", run_dir)
    error = capsys.readouterr().err
    assert exit_.value.code == 2 and error.startswith("error: ") and re.search(case.message, error), error


def test_a_checkpoint_records_its_tokenizer_and_one_without_the_record_still_resumes(trained_run, tiny_shards):
    from project.checkpoint.files import read_checkpoint_file
    from project.data.datamodule import TokenShardDataModule
    from project.training.lit_module import check_resumable

    checkpoint = read_checkpoint_file(trained_run / "checkpoints" / "last.ckpt")
    identity = TokenShardDataModule(
        str(tiny_shards), seq_len=32, global_batch_size=8, micro_batch_size=8
    ).tokenizer_identity
    assert checkpoint["tokenizer"] == identity and len(identity["vocabulary_sha256"]) == 64
    model = checkpoint["hyper_parameters"]["model"]
    check_resumable(checkpoint, model, identity, "last.ckpt")  # the run's own shards: resumes
    del checkpoint["tokenizer"]
    check_resumable(checkpoint, model, identity, "last.ckpt")  # a fit that read no token shards records none


def test_load_from_checkpoint_refuses_a_checkpoint_of_an_older_format_too(trained_run, tiny_shards, tmp_path, request):
    from project.runtime.errors import ConfigError
    from project.training.lit_module import LlamaLitModule

    older = older_format(Inputs(tmp_path, tiny_shards, request))
    with pytest.raises(ConfigError, match=OLDER_FORMAT.replace(r"ckpt_path=\S*older.ckpt", "the checkpoint")):
        LlamaLitModule.load_from_checkpoint(older)
    LlamaLitModule.load_from_checkpoint(trained_run / "checkpoints" / "last.ckpt")  # today's format loads


def test_the_datamodule_refuses_damaged_shards_too(tiny_shards, tmp_path):
    """The checks before training see the shards a run names; the datamodule, which other code builds
    directly, makes the same ones."""
    from project.data.datamodule import TokenShardDataModule
    from project.runtime.errors import ConfigError

    shards = Path(shutil.copytree(tiny_shards, tmp_path / "shards"))
    first_half(shards / "val" / "chunk-0-0.bin", shards / "val" / "chunk-0-0.bin")
    with pytest.raises(ConfigError, match=r"shard \S*val/chunk-0-0.bin holds \d+ bytes where its index.json says"):
        TokenShardDataModule(str(shards), seq_len=32, global_batch_size=8, micro_batch_size=8)
