"""Each tile of initial values has a generator key of its own (project.model.initial_values), counted over every
tile of the largest preset without drawing any; and the tiles' values are Normal(0, std)."""

from __future__ import annotations

import functools
import statistics
import zlib

import numpy as np
import pytest
import torch

from benchmarks.runner import load_preset
from project.model.initial_values import TILE_COLS, TILE_ROWS, matrix_shape, normal_values, tile_generator, tile_key
from project.model.llama import Llama

TRAIN_SEED = 1234  # conf/train.yaml's seed, which module.init_seed follows


@functools.cache
def tile_grids(preset: str) -> dict[str, tuple[int, int]]:
    """Each parameter's tiles, (tile rows, tile columns), read off the model built on the meta device."""
    with torch.device("meta"):
        model = Llama(load_preset(preset, 128256))
    grids = {}
    for name, param in model.named_parameters():
        rows, cols = matrix_shape(param.shape)
        grids[name] = (-(-rows // TILE_ROWS), -(-cols // TILE_COLS))
    return grids


def philox_keys(preset: str, seed: int) -> np.ndarray:
    """The 128-bit key of every tile of every parameter, [tiles, 2] uint64, as initial_values makes them."""
    keys = []
    for name, (rows, cols) in tile_grids(preset).items():
        first, second = tile_key(
            seed, name, np.arange(rows, dtype=np.uint64)[:, None], np.arange(cols, dtype=np.uint64)
        )
        keys.append(np.stack(np.broadcast_arrays(np.uint64(first), second), axis=-1).reshape(-1, 2))
    return np.concatenate(keys)


def crc32_keys(preset: str, seed: int) -> np.ndarray:
    """The 32-bit seeds the tiles had until 2026-11-27, [tiles, 1] uint64."""
    seeds = [
        zlib.crc32(f"{seed}/{name}/{row}/{col}".encode())
        for name, (rows, cols) in tile_grids(preset).items()
        for row in range(rows)
        for col in range(cols)
    ]
    return np.array(seeds, dtype=np.uint64)[:, None]


def tiles_sharing_a_key(keys: np.ndarray) -> int:
    """How many tiles (rows of `keys`, uint64 words) have the same key as some other tile.

    Equal keys have equal XOR folds of their words, so only the tiles whose fold repeats (next to none, unless
    keys repeat) are compared word by word: one sort of a uint64 per tile rather than a lexicographic one."""
    fold = np.bitwise_xor.reduce(keys, axis=1)
    ordered = np.sort(fold)
    candidates = keys[np.isin(fold, ordered[1:][ordered[1:] == ordered[:-1]])]
    candidates = candidates[np.lexsort(candidates.T[::-1])]
    same = (candidates[1:] == candidates[:-1]).all(axis=1)
    shared = np.zeros(len(candidates), dtype=bool)
    shared[1:] |= same
    shared[:-1] |= same
    return int(shared.sum())


def test_no_two_tiles_of_llama3_405b_share_a_generator_key():
    keys = philox_keys("llama3_405b", TRAIN_SEED)
    assert len(keys) == 12_515_072  # every tile, 1,137 parameters
    assert tiles_sharing_a_key(keys) == 0
    name = "layers.125.feed_forward.w2.weight"  # the keys counted are those the tiles' generators get
    assert list(tile_generator(TRAIN_SEED, name, 3, 5).state["state"]["key"]) == list(tile_key(TRAIN_SEED, name, 3, 5))


def test_the_count_finds_the_32_bit_seeds_that_llama3_70b_tiles_shared():
    """The count can fail: the CRC-32 seeds of llama3_70b's 2.2 million tiles hold 28 pairs of equal ones
    (counted apart by sorting them all), and the same tiles' 128-bit keys none."""
    assert tiles_sharing_a_key(crc32_keys("llama3_70b", TRAIN_SEED)) == 2 * 28
    assert tiles_sharing_a_key(philox_keys("llama3_70b", TRAIN_SEED)) == 0


def test_a_key_shared_by_two_tiles_is_counted_whatever_the_words_that_differ():
    keys = np.array([[1, 2], [3, 4], [1, 2], [2, 1], [5, 6], [5, 6], [5, 6]], dtype=np.uint64)  # [2, 1]: same fold
    assert tiles_sharing_a_key(keys) == 5


def test_a_parameter_of_more_tiles_than_a_key_tells_apart_is_refused():
    with pytest.raises(ValueError, match="2\\*\\*32 tiles"):
        normal_values(0, "w", (TILE_ROWS << 32 | 1, 1), 0.02, torch.arange(2), torch.arange(1))
    with pytest.raises(ValueError, match="2\\*\\*32 tiles"):
        normal_values(0, "w", (1, TILE_COLS << 32 | 1), 0.02, torch.arange(1), torch.arange(2))


@pytest.mark.parametrize("std", [0.02, 1.0])
def test_initial_values_are_normal_with_the_asked_std(std):
    """Quantiles of a million values against the normal distribution's (the standard error of the 0.001 quantile
    is about 0.01 std here; the tolerance is 0.05 std)."""
    values = np.sort(normal_values(TRAIN_SEED, "layers.0.attention.wq.weight", (1024, 1024), std).flatten().numpy())
    normal = statistics.NormalDist(0.0, std)
    for p in (0.001, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 0.999):
        assert values[int(p * len(values))] == pytest.approx(normal.inv_cdf(p), abs=0.05 * std), p
    assert abs(values.mean()) < 0.005 * std and values.std() == pytest.approx(std, rel=0.005)
