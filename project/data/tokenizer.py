"""One face for the two tokenizer formats in common use: HF `tokenizer.json` and sentencepiece `.model`.

Shard writing needs little from a tokenizer: ids for a text, the end-of-text id that separates
documents, and the vocabulary size that decides the token dtype and the model's embedding size.
Special tokens are never added by `encode`: where documents begin and end is the shard writer's call.
"""

import hashlib
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import sentencepiece
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from project.runtime.errors import ConfigError

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
# Llama 3's names first, then what other tokenizer.json families call the same two roles.
_EOS_NAMES = (EOS_TOKEN, "<|endoftext|>", "</s>", "<eos>")
_BOS_NAMES = (BOS_TOKEN, "<s>", "<bos>")
# A byte-level BPE starts from all 256 byte values; the special tokens come on top.
MIN_BPE_VOCAB_SIZE = 256 + 2


class Tokenizer(ABC):
    """A loaded tokenizer file; build one with `load_tokenizer` or `train_bpe`."""

    kind: str
    file_name: str

    def __init__(self, path: Path, vocab_size: int, eos_id: int, bos_id: int | None) -> None:
        self.path = path
        # Its file as loaded: the tokenizer saves and records it even where the file is gone (a checkpoint's
        # tokenizer, written to a temporary folder to be loaded), or was replaced since.
        self.content = Path(path).read_bytes()
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.bos_id = bos_id

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without any special tokens."""

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`; special tokens appear as their text."""

    @abstractmethod
    def tokens(self) -> list[str]:
        """The token of each id, in id order ("" for an id no token has)."""

    @abstractmethod
    def token_bytes(self) -> list[int]:
        """The bytes of UTF-8 text each id stands for, in id order (0 for special tokens): what bits per byte
        divides by, so that models with other tokenizers compare."""

    def vocabulary_digest(self) -> str:
        """A hash of which token each id stands for: equal for tokenizers whose ids mean the same tokens,
        whatever the file's formatting or the library version that wrote it."""
        return hashlib.sha256("\n".join(self.tokens()).encode("utf-8", "surrogatepass")).hexdigest()

    def save(self, directory: str | os.PathLike) -> Path:
        """Copy the tokenizer file into `directory` under its conventional name; return the new path."""
        target = Path(directory) / self.file_name
        target.parent.mkdir(parents=True, exist_ok=True)
        if not (target.exists() and self.path.exists() and target.samefile(self.path)):
            target.write_bytes(self.content)
        return target

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, vocab_size={self.vocab_size})"


class _HFTokenizer(Tokenizer):
    kind = "hf"
    file_name = "tokenizer.json"

    def __init__(self, path: Path) -> None:
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust binding raises a bare Exception for any parse error
            raise _unreadable(path, "a HF tokenizer.json", exc) from None
        # A literal "<|end_of_text|>" inside raw text is text, not a document boundary.
        self._tokenizer.encode_special_tokens = True
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        eos_id = _first_present(vocab, _EOS_NAMES)
        if eos_id is None:
            raise ConfigError(
                f"data.tokenizer={str(path)!r} has no end-of-text token (looked for {', '.join(_EOS_NAMES)}); "
                f"documents in the shards are separated by one, so pick a tokenizer that has it."
            )
        # Ids may have gaps (added tokens placed far out), so size by the largest id, not the count.
        super().__init__(path, max(vocab.values()) + 1, eos_id, _first_present(vocab, _BOS_NAMES))

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def tokens(self) -> list[str]:
        tokens = [""] * self.vocab_size
        for token, token_id in self._tokenizer.get_vocab(with_added_tokens=True).items():
            tokens[token_id] = token
        return tokens

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def token_bytes(self) -> list[int]:
        special = {token.content for token in self._tokenizer.get_added_tokens_decoder().values()}
        byte_level = isinstance(self._tokenizer.decoder, decoders.ByteLevel)
        return [
            0 if token in special or not token else len(token) if byte_level else _piece_bytes(token)
            for token in self.tokens()
        ]  # a byte-level token's characters stand for one byte each (GPT-2's byte alphabet)


class _SentencePieceTokenizer(Tokenizer):
    kind = "sentencepiece"
    file_name = "tokenizer.model"

    def __init__(self, path: Path) -> None:
        try:
            self._processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except Exception as exc:  # sentencepiece raises RuntimeError or OSError depending on the fault
            raise _unreadable(path, "a sentencepiece model", exc) from None
        if self._processor.eos_id() < 0:
            raise ConfigError(
                f"data.tokenizer={str(path)!r} was trained without an end-of-text piece (eos_id=-1); "
                f"documents in the shards are separated by one, so train it with eos_id set."
            )
        bos = self._processor.bos_id()  # -1: trained without one
        super().__init__(path, self._processor.get_piece_size(), self._processor.eos_id(), bos if bos >= 0 else None)

    def encode(self, text: str) -> list[int]:
        return self._processor.encode(text, out_type=int)

    def tokens(self) -> list[str]:
        return [self._processor.id_to_piece(i) for i in range(self.vocab_size)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._processor.decode(list(ids))

    def token_bytes(self) -> list[int]:
        p = self._processor
        return [
            0 if p.is_control(i) or p.is_unknown(i) else _piece_bytes(p.id_to_piece(i)) for i in range(self.vocab_size)
        ]


def _piece_bytes(piece: str) -> int:
    """A sentencepiece-style piece's bytes: "▁" a space, a byte-fallback piece ("<0x0A>") one byte."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return 1
    return len(piece.replace("\u2581", " ").encode("utf-8"))


_KINDS_BY_SUFFIX: dict[str, type[_HFTokenizer] | type[_SentencePieceTokenizer]] = {
    ".json": _HFTokenizer,
    ".model": _SentencePieceTokenizer,
}


def tokenizer_file(path: str | os.PathLike) -> Path:
    """The tokenizer file `path` names: itself, or in a folder (a published model's, say) its `tokenizer.json`,
    else its `tokenizer.model`."""
    path = Path(path)
    if path.is_dir():
        path = next(
            (path / kind.file_name for kind in _KINDS_BY_SUFFIX.values() if (path / kind.file_name).is_file()), path
        )
    return path


def file_sha256(path: str | os.PathLike) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a HF `tokenizer.json` or a sentencepiece `.model` file, chosen by the file's suffix; given a folder
    (a published model's, say), the `tokenizer.json` in it, else its `tokenizer.model`."""
    path = tokenizer_file(path)
    kind = _KINDS_BY_SUFFIX.get(path.suffix)
    if not path.is_file() or kind is None:
        problem = (
            "is a folder with neither a tokenizer.json nor a tokenizer.model"
            if path.is_dir()
            else "is not a file"
            if not path.is_file()
            else "has an unknown suffix"
        )
        raise ConfigError(
            f"data.tokenizer={str(path)!r} {problem}. Point it at a HF tokenizer.json or a sentencepiece "
            f".model file, or set data.tokenizer=null to train a byte-level BPE of data.vocab_size tokens."
        )
    return kind(path)


# Where a checkpoint keeps the tokenizer it was trained with (project.training.lit_module), so that an export or a
# generation from it, copied anywhere, needs no data.dir, and no later preparation there can change its tokens.
CHECKPOINT_TOKENIZER = "tokenizer_file"


def tokenizer_record(tokenizer: Tokenizer) -> dict[str, Any]:
    """The tokenizer as a checkpoint carries it: its file's conventional name and bytes (KB to a few MB), its
    end-of-text and beginning-of-text ids."""
    return {
        "name": tokenizer.file_name,
        "content": tokenizer.content,
        "eos_id": tokenizer.eos_id,
        "bos_id": tokenizer.bos_id,
    }


def write_tokenizer_record(record: Mapping[str, Any], directory: str | os.PathLike) -> Path:
    """The file of a `tokenizer_record`, written into `directory`; returns its path."""
    name = str(record.get("name"))
    if name not in {kind.file_name for kind in _KINDS_BY_SUFFIX.values()} or not isinstance(
        record.get("content"), bytes
    ):
        raise ConfigError(
            f"the checkpoint's {CHECKPOINT_TOKENIZER!r} record is damaged (a file named {name!r}); pass tokenizer=PATH."
        )
    path = Path(directory) / name  # one of the two conventional names: never a path out of `directory`
    path.write_bytes(record["content"])
    return path


def train_bpe(texts: Iterable[str], vocab_size: int, directory: str | os.PathLike) -> Tokenizer:
    """Train a byte-level BPE on `texts` and save it as `directory/tokenizer.json`.

    Byte level: any text encodes without unknown tokens. The result depends only on the texts and
    their order (the trainer has no randomness and breaks ties by token id), so the same corpus
    gives the same tokenizer.
    """
    if vocab_size < MIN_BPE_VOCAB_SIZE:
        raise ConfigError(
            f"data.vocab_size={vocab_size} is too small for a byte-level BPE: it needs the 256 byte tokens "
            f"plus {BOS_TOKEN} and {EOS_TOKEN}, so at least {MIN_BPE_VOCAB_SIZE}."
        )
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    path = Path(directory) / _HFTokenizer.file_name
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return load_tokenizer(path)


def _first_present(vocab: dict[str, int], names: Iterable[str]) -> int | None:
    return next((vocab[name] for name in names if name in vocab), None)


def _unreadable(path: Path, what: str, exc: Exception) -> ConfigError:
    return ConfigError(f"data.tokenizer={str(path)!r} could not be read as {what}: {exc}")
