"""Data: raw text -> tokenizer -> litdata token shards (offline), and the datamodule that streams them.

The preparation side imports no Lightning, so `python -m project.prepare` and its worker processes
start quickly; the datamodule is imported on first use.
"""

from importlib import import_module

from project.data.prepare import prepare_shards
from project.data.tokenizer import Tokenizer, load_tokenizer, train_bpe

# Training side, imported lazily (it pulls in Lightning).
_LAZY = {"TokenShardDataModule": "project.data.datamodule"}

__all__ = ["Tokenizer", "load_tokenizer", "train_bpe", "prepare_shards", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'project.data' has no attribute {name!r}")
