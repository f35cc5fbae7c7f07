"""Held-out sets for evaluation inside training (`eval.sets`, project.training.callbacks.evaluation): each a split of
prepared shards, its own folder or a corpus of the training data, checked before training starts.

A set is read as validation is (project.data.sampler.ValidationSampler): the same `sequences` blocks whatever the
layout, spread over the split, each data-parallel replica a contiguous share. Its tokens must mean what the
training data's mean: prepared with the same tokenizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from project.data.shards import MANIFEST_NAME
from project.runtime.errors import ConfigError

KEYS = ("dir", "split", "sequences")


@dataclass(frozen=True)
class HeldOutSet:
    """`eval.sets.<name>`: the `split` of the shards prepared in `dir`, `sequences` blocks of it (None: all)."""

    name: str
    dir: str
    split: str = "val"
    sequences: int | None = None


def held_out_sets(sets: Mapping[str, Any] | None) -> list[HeldOutSet]:
    """`eval.sets` ({name: {dir, split, sequences}}) as HeldOutSet entries, refused with one clear error where
    malformed."""
    found = []
    for name, entry in (sets or {}).items():
        where = f"eval.sets.{name}"
        if not isinstance(entry, Mapping) or not entry.get("dir"):
            raise ConfigError(
                f"{where}={entry!r} needs a `dir`: a folder of prepared shards (project.prepare), e.g. "
                f"{{dir: data/wiki, split: val, sequences: 128}}."
            )
        unknown = sorted(set(entry) - set(KEYS))
        if unknown:
            raise ConfigError(f"{where} has no setting {', '.join(unknown)}: it takes {', '.join(KEYS)}.")
        sequences = entry.get("sequences")
        if sequences is not None and (not isinstance(sequences, int) or isinstance(sequences, bool) or sequences < 1):
            raise ConfigError(
                f"{where}.sequences={sequences!r}: give a whole number of sequences above 0, or null for the whole "
                "split."
            )
        split = str(entry.get("split", "val"))
        found.append(HeldOutSet(str(name), str(entry["dir"]), split, sequences))
    return found


def check_split(held_out: HeldOutSet, manifest: Mapping[str, Any]) -> int:
    """The blocks of the set's split, refused where the shards have none of it."""
    splits = manifest.get("splits", {})
    if held_out.split not in splits:
        raise ConfigError(
            f"eval.sets.{held_out.name}.split={held_out.split}: the shards in {held_out.dir} have the splits "
            f"{', '.join(sorted(splits))}. Choose one of them."
        )
    blocks = int(splits[held_out.split]["blocks"])
    if blocks == 0:
        raise ConfigError(
            f"eval.sets.{held_out.name}: the {held_out.split} split in {held_out.dir} holds no complete block: its "
            "documents are too few or too short. Prepare more text, or a larger data.val_fraction, there."
        )
    return blocks


def check_prepared(held_out: HeldOutSet) -> None:
    """A local set's folder must hold prepared shards (remote ones are checked when their view is made)."""
    if "://" not in held_out.dir and not (Path(held_out.dir) / MANIFEST_NAME).is_file():
        raise ConfigError(
            f"eval.sets.{held_out.name}.dir={held_out.dir} holds no prepared shards (no manifest.json): prepare its "
            f"text there first with `python -m project.prepare data.dir={held_out.dir} ...` and the training data's "
            "tokenizer (data.tokenizer=<the training data's folder>/tokenizer.json)."
        )


def check_same_tokenizer(held_out: HeldOutSet, theirs: Mapping[str, Any], ours: Mapping[str, Any]) -> None:
    """The set's tokenizer identity (project.data.datamodule.tokenizer_identity) must be the training data's."""
    if dict(theirs) != dict(ours):
        differ = ", ".join(
            f"{k} {str(ours.get(k))[:12]} vs {str(theirs.get(k))[:12]}" for k in ours if ours.get(k) != theirs.get(k)
        )
        raise ConfigError(
            f"eval.sets.{held_out.name}: the shards in {held_out.dir} were prepared with another tokenizer than the "
            f"training data: {differ}. Its token ids would mean other text to the model: prepare it again with "
            "data.tokenizer=<the training data's folder>/tokenizer.json."
        )
