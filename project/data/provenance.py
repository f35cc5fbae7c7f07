"""What prepared shards were made from, as their manifest records it, said in a few words: for the refusal of a run
whose data settings differ, and for the line data.overwrite=true prints before it replaces them."""

from __future__ import annotations

import os
from typing import Any, Mapping


def files_said(sizes: Mapping[str, Any]) -> str:
    """`12 files in /data/raw/shakespeare (a_gut.txt, ...)`: what a list of source files is, said briefly."""
    paths = sorted(sizes)
    if not paths:
        return "no files"
    folder = os.path.commonpath([os.path.dirname(p) for p in paths])
    names = ", ".join(os.path.relpath(p, folder) for p in paths[:2]) + (", ..." if len(paths) > 2 else "")
    return f"{len(paths)} file{'s' if len(paths) != 1 else ''} in {folder} ({names})"


def shards_origin(manifest: Mapping[str, Any]) -> str:
    """`data.name=shakespeare: 8 files in /data/raw (a.txt, b.txt, ...), a BPE of 512 tokens, data.seq_len=64`: whose
    shards these are. What an older manifest does not record is left out."""
    settings, tokenizer = _mapping(manifest.get("settings")), _mapping(manifest.get("tokenizer"))
    sources = {str(s.get("path")): s.get("bytes") for s in manifest.get("sources", []) if isinstance(s, Mapping)}
    parts = [files_said(sources)] if sources else []
    if settings.get("tokenizer"):
        parts.append(f"data.tokenizer={settings['tokenizer']}")
    elif tokenizer.get("vocab_size"):
        parts.append(f"a BPE of {tokenizer['vocab_size']} tokens")
    if "block_size" in manifest:
        parts.append(f"data.seq_len={int(manifest['block_size']) - 1}")
    said = ", ".join(parts) or "settings their manifest does not record"
    return f"data.name={settings['name']}: {said}" if settings.get("name") else said


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}
