"""TokenShardDataModule: what it refuses and says about the data it is given."""

import json

import pytest

from project.data.datamodule import TokenShardDataModule
from project.runtime.errors import ConfigError


def test_a_global_batch_larger_than_the_training_split_is_refused_unless_repeats_are_allowed(tiny_shards):
    blocks = json.loads((tiny_shards / "manifest.json").read_text())["splits"]["train"]["blocks"]
    with pytest.raises(ConfigError, match=f"global_batch_size={blocks + 1} is more than the {blocks} training blocks"):
        TokenShardDataModule(str(tiny_shards), seq_len=32, global_batch_size=blocks + 1, micro_batch_size=1)
    with pytest.warns(UserWarning, match=f"every block is read about {(2 * blocks) / blocks:.1f} times per step"):
        TokenShardDataModule(
            str(tiny_shards), seq_len=32, global_batch_size=2 * blocks, micro_batch_size=2, allow_repeats=True
        )
    TokenShardDataModule(
        str(tiny_shards), seq_len=32, global_batch_size=blocks, micro_batch_size=1
    )  # the whole split fits
