"""project.data.prepare: token shards from raw text, checked by reading them back through litdata."""

import hashlib
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import litdata
import numpy as np
import pytest
import sentencepiece
import tokenizers

from project.data import corpus
from project.data import prepare as prepare_module
from project.data.prepare import prepare_shards
from project.data.tokenizer import load_tokenizer
from project.runtime.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
PART_MB = 8 / 1024
WORDS = "to be or not that is the question whether tis nobler in mind suffer slings arrows outrageous fortune".split()


def write_documents(directory: Path, count: int = 10, seed: int = 0) -> list[Path]:
    """`count` .txt files of a few KB each, each with its own first line so that no two are equal."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for d in range(count):
        lines = [f"Document {d} of {count}."]
        lines += [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(rng.randint(40, 80))]
        paths.append(directory / f"doc{d:02d}.txt")
        paths[-1].write_text("\n".join(lines) + "\n")
    return paths


def read_stream(split_dir: Path) -> np.ndarray:
    """Every token of a split in order: blocks of one token lose nothing at chunk ends."""
    ds = litdata.StreamingDataset(str(split_dir), item_loader=litdata.TokensLoader(block_size=1))
    return np.concatenate([ds[i] for i in range(len(ds))])


def split_documents(stream: np.ndarray, eos_id: int) -> list[np.ndarray]:
    """The documents of a token stream, without their end-of-text tokens."""
    assert stream[-1] == eos_id, "every document, the last included, ends with end-of-text"
    ends = np.flatnonzero(stream == eos_id)
    return [stream[start:end] for start, end in zip([0, *(ends[:-1] + 1)], ends)]


def file_hashes(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def file_states(directory: Path) -> dict[str, tuple[int, str]]:
    return {
        str(p.relative_to(directory)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A 10-document corpus prepared with two workers, in parts of about 8 KB (several parts, several chunks)."""
    root = tmp_path_factory.mktemp("prepared")
    docs = write_documents(root / "raw")
    manifest = prepare_shards(
        str(root / "raw" / "*.txt"),
        root / "shards",
        vocab_size=320,
        seq_len=16,
        val_fraction=0.2,
        num_workers=2,
        part_mb=PART_MB,
    )
    return docs, root / "shards", manifest


def test_each_split_is_its_documents_in_source_order_each_followed_by_eos(prepared):
    docs, shards, manifest = prepared
    tok = load_tokenizer(shards / manifest["tokenizer"]["file"])
    texts = [p.read_text() for p in docs]
    seen = {}
    for split in ("train", "val"):
        stream = read_stream(shards / split)
        decoded = [tok.decode(ids.tolist()) for ids in split_documents(stream, tok.eos_id)]
        assert decoded == sorted(decoded, key=texts.index), "documents keep the sources' order"
        expected = np.concatenate([tok.encode(text) + [tok.eos_id] for text in decoded])
        assert np.array_equal(stream, expected)
        assert stream.dtype == np.uint16 and manifest["dtype"] == "uint16"
        seen[split] = decoded
    assert sorted(seen["train"] + seen["val"]) == sorted(texts), "every document in exactly one split"
    assert len(seen["val"]) >= 1 and len(seen["train"]) >= 1


def test_manifest_counts_are_what_litdata_reads(prepared):
    docs, shards, manifest = prepared
    block_size = manifest["block_size"]
    assert (manifest["seq_len"], block_size) == (16, 17)
    assert manifest["tokenizer"] == {
        "kind": "hf",
        "file": "tokenizer.json",
        "vocab_size": load_tokenizer(shards / "tokenizer.json").vocab_size,
        "eos_id": 1,
        "bos_id": 0,
    }
    assert manifest["sources"] == [{"path": str(p.resolve()), "bytes": p.stat().st_size} for p in docs]
    assert json.loads((shards / "manifest.json").read_text()) == manifest
    chunk_count = 0
    for split in ("train", "val"):
        counts, stream = manifest["splits"][split], read_stream(shards / split)
        assert counts["tokens"] == len(stream)
        assert counts["documents"] == int((stream == manifest["tokenizer"]["eos_id"]).sum())
        blocks = litdata.StreamingDataset(str(shards / split), item_loader=litdata.TokensLoader(block_size=block_size))
        assert counts["blocks"] == len(blocks)
        # Blocks cut the stream within each chunk: the first block is the stream's first tokens.
        assert np.array_equal(blocks[0], stream[:block_size])
        chunks = json.loads((shards / split / "index.json").read_text())["chunks"]
        assert counts["blocks"] == sum(c["dim"] // block_size for c in chunks)
        assert counts["blocks"] >= len(stream) // block_size - len(chunks)
        chunk_count += len(chunks)
    assert manifest["parts"] >= 3 and chunk_count >= manifest["parts"], "each part fills chunks of its own"


def test_split_is_deterministic_about_as_large_as_asked_and_follows_the_seed(tmp_path):
    lines = [json.dumps({"text": f"line {i}: " + " ".join(WORDS[i % 7 :: 3])}) for i in range(400)]
    (tmp_path / "docs.jsonl").write_text("\n".join(lines) + "\n")
    files = [tmp_path / "docs.jsonl"]

    def val_lines(seed):
        return [ref.line for ref in prepare_module._split_documents(files, "text", 0.2, seed)["val"]]

    assert val_lines(7) == val_lines(7)
    assert 50 <= len(val_lines(7)) <= 110  # 80 expected; binomial sd ~8
    assert val_lines(7) != val_lines(8)


def test_the_same_settings_give_the_same_shards_whatever_the_worker_count(prepared, tmp_path):
    docs, shards, manifest = prepared
    again = prepare_shards(
        str(docs[0].parent / "*.txt"),
        tmp_path / "one_worker",
        vocab_size=320,
        seq_len=16,
        val_fraction=0.2,
        num_workers=1,
        part_mb=PART_MB,
    )
    assert again == manifest
    assert file_hashes(tmp_path / "one_worker") == file_hashes(shards), "the same chunks, byte for byte"


def test_jsonl_sources_give_one_document_per_line_from_text_field(tmp_path):
    records = [{"id": i, "body": f"record {i}: " + " ".join(WORDS[i:] + WORDS[:i])} for i in range(12)]
    # A blank line in the middle is no document.
    lines = [json.dumps(r) for r in records[:6]] + [""] + [json.dumps(r) for r in records[6:]]
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "records.jsonl").write_text("\n".join(lines) + "\n")
    manifest = prepare_shards(
        tmp_path / "raw", tmp_path / "shards", text_field="body", vocab_size=300, seq_len=8, num_workers=1
    )
    tok = load_tokenizer(tmp_path / "shards" / "tokenizer.json")
    decoded = [
        tok.decode(ids.tolist())
        for split in ("train", "val")
        for ids in split_documents(read_stream(tmp_path / "shards" / split), tok.eos_id)
    ]
    assert sorted(decoded) == sorted(r["body"] for r in records)
    assert manifest["splits"]["train"]["documents"] + manifest["splits"]["val"]["documents"] == 12


def test_a_jsonl_line_without_the_text_field_is_named_with_file_and_line(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n{"content": "elsewhere"}\n')
    with pytest.raises(ConfigError, match=r"a\.jsonl:2 has no text field 'text' \(data.text_field\)"):
        prepare_shards(tmp_path / "a.jsonl", tmp_path / "shards")


def test_a_given_sentencepiece_tokenizer_is_used_and_copied(tmp_path):
    docs = write_documents(tmp_path / "raw", count=4)
    sentencepiece.SentencePieceTrainer.train(
        input=[str(p) for p in docs], model_prefix=str(tmp_path / "sp"), vocab_size=40, minloglevel=2
    )
    manifest = prepare_shards(
        str(tmp_path / "raw"),
        tmp_path / "shards",
        tokenizer=tmp_path / "sp.model",
        seq_len=8,
        val_fraction=0.3,
        num_workers=1,
    )
    sp = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    assert manifest["tokenizer"] == {
        "kind": "sentencepiece",
        "file": "tokenizer.model",
        "vocab_size": 40,
        "eos_id": sp.eos_id(),
        "bos_id": sp.bos_id(),
    }
    assert (tmp_path / "shards" / "tokenizer.model").read_bytes() == (tmp_path / "sp.model").read_bytes()
    streams = [read_stream(tmp_path / "shards" / split) for split in ("train", "val")]
    expected = sorted(sp.encode(p.read_text()) + [sp.eos_id()] for p in docs)
    assert sorted(ids.tolist() + [sp.eos_id()] for s in streams for ids in split_documents(s, sp.eos_id())) == expected


def test_a_vocabulary_beyond_uint16_is_stored_as_int32(tmp_path):
    vocab = {"</s>": 0, "<unk>": 1, **{f"w{i}": i + 2 for i in range(70_000)}}
    rust = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    rust.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    rust.save(str(tmp_path / "big.json"))
    (tmp_path / "raw").mkdir()
    for d in range(3):
        (tmp_path / "raw" / f"{d}.txt").write_text(" ".join(f"w{69_990 - 10 * d + i}" for i in range(10)))
    manifest = prepare_shards(
        tmp_path / "raw", tmp_path / "shards", tokenizer=tmp_path / "big.json", seq_len=4, num_workers=1
    )
    assert manifest["dtype"] == "int32"
    stream = np.concatenate([read_stream(tmp_path / "shards" / s) for s in ("train", "val")])
    assert stream.dtype == np.int32 and sorted(stream[stream > 0].tolist()) == sorted(
        vocab[f"w{69_990 - 10 * d + i}"] for d in range(3) for i in range(10)
    )


def test_a_second_run_with_the_same_settings_does_no_work(prepared, monkeypatch):
    docs, shards, manifest = prepared
    before = file_states(shards)
    monkeypatch.setattr(prepare_module.litdata, "optimize", lambda *a, **k: pytest.fail("optimize was called"))
    again = prepare_shards(
        str(docs[0].parent / "*.txt"),
        shards,
        vocab_size=320,
        seq_len=16,
        val_fraction=0.2,
        num_workers=2,
        part_mb=PART_MB,
    )
    assert again == manifest and file_states(shards) == before


def test_changed_settings_are_refused_without_overwrite_and_leave_the_shards_intact(tmp_path, caplog):
    write_documents(tmp_path / "raw", count=4)
    sources, shards = str(tmp_path / "raw" / "*.txt"), tmp_path / "shards"
    prepare_shards(sources, shards, vocab_size=300, seq_len=8, num_workers=1, name="plays")
    before = file_states(shards)

    # Each change named as training names it (project.config.data): the setting, its value there and here; a folder
    # of your own offered first, then data.overwrite=true, saying whose shards it would replace.
    raw = re.escape(str(tmp_path / "raw"))
    whose = rf"data.name=plays: 4 files in {raw} \(doc00.txt, doc01.txt, ...\), a BPE of \d+ tokens, "
    with pytest.raises(
        ConfigError,
        match=r"other settings: data.seq_len: 8 there, 12 here. Point data.dir at a folder of your own to keep both, "
        rf"or, only if those shards are yours to lose, set data.overwrite=true to replace them \({whose}"
        r"data.seq_len=8\)\.$",
    ):
        prepare_shards(sources, shards, vocab_size=300, seq_len=12, num_workers=1)
    with pytest.raises(ConfigError, match=r"other settings: data.vocab_size: 300 there, 320 here. Point"):
        prepare_shards(sources, shards, vocab_size=320, seq_len=8, num_workers=1)
    with pytest.raises(ConfigError, match=r"other settings: data.text_field: text there, body here. Point"):
        prepare_shards(sources, shards, vocab_size=300, seq_len=8, num_workers=1, text_field="body")
    edited = tmp_path / "raw" / "doc00.txt"
    os.utime(edited, ns=(edited.stat().st_atime_ns, edited.stat().st_mtime_ns + 10**9))
    with pytest.raises(ConfigError, match=r"other settings: the source files' modification times \(their names"):
        prepare_shards(sources, shards, vocab_size=300, seq_len=8, num_workers=1)
    edited.write_text("An edited document.\n" * 50)
    with pytest.raises(ConfigError, match=rf"data.sources: {edited} held \d+ bytes when prepared, 1000 now"):
        prepare_shards(sources, shards, vocab_size=300, seq_len=8, num_workers=1)
    assert file_states(shards) == before
    assert "replacing" not in caplog.text

    with caplog.at_level("WARNING", logger=prepare_module.__name__):
        manifest = prepare_shards(sources, shards, vocab_size=300, seq_len=12, num_workers=1, overwrite=True)
    assert manifest["block_size"] == 13 and json.loads((shards / "manifest.json").read_text()) == manifest
    # Said once, before the shards were replaced: whose they were.
    replaced = [r.getMessage() for r in caplog.records if "replacing" in r.getMessage()]
    assert len(replaced) == 1 and re.fullmatch(
        rf"data.overwrite=true: replacing the shards in {re.escape(str(shards))}, prepared from {whose}data.seq_len=8",
        replaced[0],
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [".shards.lock", "raw", "shards"], "no staging left behind"


def test_an_interrupted_rebuild_keeps_the_previous_shards(tmp_path, monkeypatch):
    write_documents(tmp_path / "raw", count=3)
    sources, shards = str(tmp_path / "raw" / "*.txt"), tmp_path / "shards"
    prepare_shards(sources, shards, vocab_size=300, seq_len=8, num_workers=1)
    before = file_states(shards)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_module.litdata, "optimize", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare_shards(sources, shards, vocab_size=300, seq_len=4, num_workers=1, overwrite=True)
    assert file_states(shards) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [".shards.lock", "raw", "shards"]


def test_missing_sources_are_fetched_into_the_patterns_folder(tmp_path, monkeypatch):
    calls = []

    def fake_fetch(name, destination):
        calls.append((name, Path(destination)))
        write_documents(Path(destination), count=3)

    monkeypatch.setattr(prepare_module, "fetch_corpus", fake_fetch)
    pattern = str(tmp_path / "raw" / "corpus" / "*.txt")
    manifest = prepare_shards(
        pattern, tmp_path / "shards", vocab_size=300, seq_len=8, num_workers=1, fetch="shakespeare"
    )
    assert calls == [("shakespeare", tmp_path / "raw" / "corpus")] and len(manifest["sources"]) == 3
    prepare_shards(pattern, tmp_path / "shards", vocab_size=300, seq_len=8, num_workers=1, fetch="shakespeare")
    assert len(calls) == 1, "sources present: no second fetch"


@pytest.mark.parametrize(
    "case, message",
    [
        ("no_sources", r"data.sources=\[.*\] matched no files"),
        ("one_document", "add more files, or use a .jsonl file"),
        ("bad_tokenizer", r"data.tokenizer='.*nope.model' is not a file"),
        ("foreign_dir", "holds no manifest.json, so it is not a prepared dataset"),
        ("unknown_corpus", "data.fetch='gutenberg' is not a corpus .* known: shakespeare"),
        ("bad_fraction", "data.val_fraction=1.0 must lie strictly between 0 and 1"),
    ],
)
def test_bad_input_is_a_one_paragraph_config_error(tmp_path, case, message):
    write_documents(tmp_path / "raw", count=1 if case == "one_document" else 3)
    sources = str(tmp_path / ("empty/*.txt" if case in ("no_sources", "unknown_corpus") else "raw"))
    kwargs = {
        "bad_tokenizer": {"tokenizer": tmp_path / "nope.model"},
        "unknown_corpus": {"fetch": "gutenberg"},
        "bad_fraction": {"val_fraction": 1.0},
    }.get(case, {})
    if case == "foreign_dir":
        (tmp_path / "shards").mkdir()
        (tmp_path / "shards" / "precious.txt").write_text("not ours")
    with pytest.raises(ConfigError, match=message) as error:
        # overwrite=True: replacing shards is allowed, none of the above is.
        prepare_shards(sources, tmp_path / "shards", vocab_size=300, num_workers=1, overwrite=True, **kwargs)
    assert "\n" not in str(error.value)
    if case == "foreign_dir":
        assert (tmp_path / "shards" / "precious.txt").read_text() == "not ours"


def test_resolve_sources_takes_files_folders_and_globs_sorted_and_once(tmp_path):
    a, b = write_documents(tmp_path / "x", count=2)
    nested = tmp_path / "y" / "deep" / "c.md"
    nested.parent.mkdir(parents=True)
    nested.write_text("markdown")
    table = tmp_path / "y" / "table.csv"
    table.write_text("a,b")
    (tmp_path / "y" / ".git").mkdir()
    (tmp_path / "y" / ".git" / "HEAD").write_text("ref: refs/heads/main")
    (tmp_path / "y" / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    found = corpus.resolve_sources([str(b), str(tmp_path / "x" / "*.txt"), tmp_path / "y"])
    assert found == [a.resolve(), b.resolve(), nested.resolve(), table.resolve()]
    with pytest.raises(ConfigError, match="logo.png, which is not UTF-8 text"):
        corpus.resolve_sources([str(tmp_path / "y" / "logo.png")])


def python_package(directory: Path) -> list[Path]:
    """Eight small .py modules, each its own, plus one in a sub-package."""
    paths = []
    for i in range(8):
        path = directory / ("sub" if i == 7 else "") / f"module{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        body = "\n".join(f"    total += {j} * {i}  # step {WORDS[(i + j) % len(WORDS)]}" for j in range(30))
        path.write_text(f"def f{i}(total=0):\n{body}\n    return total\n")
        paths.append(path)
    return paths


def test_a_folder_of_code_is_text_and_its_binary_files_are_skipped_and_counted(tmp_path, caplog):
    code = python_package(tmp_path / "code")
    notes = tmp_path / "code" / "NOTES.txt"
    notes.write_text("Notes on the package.\n" + " ".join(WORDS) + "\n")
    # Bytecode beside its source, as Python leaves it: a NUL in the first bytes.
    (tmp_path / "code" / "__pycache__").mkdir()
    (tmp_path / "code" / "__pycache__" / "module0.cpython-312.pyc").write_bytes(b"\xcb\r\r\n\x00\x00\x00\x00" * 40)
    (tmp_path / "code" / "latin1.py").write_bytes("# caf\xe9\n".encode("latin-1"))  # not UTF-8: binary to us
    texts = sorted([*code, notes])
    with caplog.at_level("WARNING", logger="project.data.prepare"):
        manifest = prepare_shards(tmp_path / "code", tmp_path / "shards", vocab_size=300, seq_len=8, num_workers=1)
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert skipped == [
        "data.sources: skipped 2 binary files, e.g. "
        + str((tmp_path / "code" / "__pycache__").resolve() / "module0.cpython-312.pyc")
    ]
    assert [s["path"] for s in manifest["sources"]] == [str(p.resolve()) for p in texts]
    tok = load_tokenizer(tmp_path / "shards" / "tokenizer.json")
    streams = [read_stream(tmp_path / "shards" / split) for split in ("train", "val")]
    decoded = [tok.decode(ids.tolist()) for stream in streams for ids in split_documents(stream, tok.eos_id)]
    assert sorted(decoded) == sorted(p.read_text() for p in texts), "each text file one document, as written"
    own_tokens = sum(len(tok.encode(p.read_text())) + 1 for p in texts)
    assert sum(len(stream) for stream in streams) == own_tokens, "the text files' own tokens, nothing else"
    # A glob of the .py files is taken the same way.
    assert corpus.resolve_sources(str(tmp_path / "code" / "**" / "*.py")) == sorted(p.resolve() for p in code)


def run_prepare(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "project.prepare",
            "data=tiny",
            f"paths.data_dir={tmp_path}",
            f"paths.log_dir={tmp_path}/logs",
            *overrides,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_entry_point_prepares_data_tiny_and_reports_bad_input_without_traceback(tmp_path):
    write_documents(tmp_path / "raw" / "tiny", count=4)
    result = run_prepare(tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = json.loads((tmp_path / "tiny" / "manifest.json").read_text())
    assert (manifest["seq_len"], manifest["tokenizer"]["kind"]) == (64, "hf")
    assert manifest["tokenizer"]["vocab_size"] <= 512

    refused = run_prepare(tmp_path, "data.seq_len=32")
    assert refused.returncode == 2
    assert refused.stderr.startswith("error: data.dir=") and "Traceback" not in refused.stderr


def test_a_corpus_too_small_for_the_vocabulary_is_said_and_recorded(tmp_path, caplog):
    write_documents(tmp_path / "raw", count=3)
    with caplog.at_level("WARNING", logger="project.data.prepare"):
        manifest = prepare_shards(
            str(tmp_path / "raw" / "*.txt"), tmp_path / "shards", vocab_size=8192, seq_len=16, num_workers=1
        )
    real = manifest["tokenizer"]["vocab_size"]
    assert real < 8192 and real == load_tokenizer(tmp_path / "shards" / "tokenizer.json").vocab_size
    assert (
        f"only {real} tokens, fewer than data.vocab_size=8192" in caplog.text
        and f"data.vocab_size={real}" in caplog.text
    )


def test_machines_preparing_their_shares_merge_into_the_one_machine_result(prepared, tmp_path):
    docs, shards, manifest = prepared
    settings = dict(tokenizer=shards / "tokenizer.json", seq_len=16, val_fraction=0.2, num_workers=2, part_mb=PART_MB)
    single = prepare_shards(str(docs[0].parent / "*.txt"), tmp_path / "one", **settings)
    results = [
        prepare_shards(str(docs[0].parent / "*.txt"), tmp_path / "three", node_rank=rank, num_nodes=3, **settings)
        for rank in (2, 0, 1)
    ]  # in any order: the last one done merges
    assert results[:2] == [{}, {}] and results[2] == single
    assert file_hashes(tmp_path / "three") == file_hashes(tmp_path / "one")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".one.lock", ".three.lock", "one", "three"], (
        "no parts left behind"
    )


def test_the_machine_is_read_from_slurm_or_torchrun_and_checked():
    from project.data.parts import node_of

    assert node_of(environ={}) == (0, 1)
    assert node_of(
        environ={"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_COUNT": "8"}
    ) == (4, 8)
    assert node_of(environ={"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "NODE_RANK": "0", "NUM_NODES": "2"}) == (3, 4)
    assert node_of(environ={"GROUP_RANK": "1", "NNODES": "2"}) == (1, 2)
    assert node_of(2, 3, environ={"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) == (2, 3)
    with pytest.raises(ConfigError, match="machine 4 of 4 .*data.prepare_node_rank"):
        node_of(environ={"NODE_RANK": "4", "NUM_NODES": "4"})


def test_several_machines_need_a_given_tokenizer(tmp_path):
    write_documents(tmp_path / "raw", count=3)
    with pytest.raises(ConfigError, match="prepare on 2 machines needs a tokenizer they all share"):
        prepare_shards(str(tmp_path / "raw"), tmp_path / "shards", num_nodes=2, node_rank=0)
