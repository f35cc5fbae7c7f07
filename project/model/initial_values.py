"""Initial values any part of which can be drawn alone: an element's value depends only on the seed, the
parameter's name and the element's position, never on which other elements are drawn, where, or in what order.

A parameter is seen as a matrix (its first dimension by the product of the others) cut into tiles of TILE_ROWS x
TILE_COLS elements; each tile is drawn whole from a generator of its own, keyed by (seed, name, tile row, tile
column). Asked for the elements at some rows and columns, `normal_values` draws only the tiles they touch. A rank
whose shard is a product of row and column sets (FSDP2's dim-0 shards, tensor parallelism's column and row splits,
both at once, or a pipeline stage's whole parameters) so draws about its shard's share of the model, not the whole
model, and gets exactly the values one device draws for the whole parameter.

Tiles 32 rows high keep the rows drawn beyond a dim-0 shard few (at most 31 at each end); 1,024 columns wide keep a
column split over up to 8 ranks of a 4,096- to 14,336-wide matrix within two or three tiles of its own.

A tile's generator is Philox4x64 (numpy's), a counter-based generator whose 128-bit key is the tile's own: 64 bits
of hash of the seed and the name, then the tile's row and column, 32 bits each. Tiles of one parameter so never
share a stream, and parameters share one only if their names' 64-bit hashes collide (1,137 names at 405B: a chance
of 4e-14; tests/test_initial_values_keys.py counts llama3_405b's 12.5 million keys, all distinct). 128 bits, not 32:
32-bit seeds collide, and colliding tiles draw the same values up to scale; a CRC-32 of the same four (the tiles'
seeds until 2026-11-27) gives 11,334 pairs of llama3_405b's tiles equal seeds at seed 1234, and 28 of llama3_70b's.
And not torch's generator: its CPU one (mt19937) keeps only 32 bits of any seed it is given.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch

TILE_ROWS, TILE_COLS = 32, 1024
# Tiles and indices are made on the host whatever the default device: the tiles' generators are CPU generators,
# and Lightning builds the model inside a `torch.device("cuda")` context on GPUs.
HOST = torch.device("cpu")


def matrix_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """(rows, columns) of a parameter seen as a matrix: its first dimension by the product of the others."""
    return (shape[0], math.prod(shape[1:])) if len(shape) else (1, 1)


def name_key(seed: int, name: str) -> int:
    """64 bits of hash of (seed, name): the same in every process (Python's own `hash` of a str is not)."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest(), "little")


def tile_key(
    seed: int, name: str, tile_row: int | np.ndarray, tile_col: int | np.ndarray
) -> tuple[int, int | np.ndarray]:
    """The 128-bit Philox key, two 64-bit words, of parameter `name`'s tile at `tile_row` and `tile_col`: the name's
    key, then the tile's row and column, 32 bits each (normal_values keeps them below 2**32). The tile's row and
    column may also be uint64 arrays: the second word is then the array of their tiles' words."""
    return name_key(seed, name), tile_row << 32 | tile_col


def tile_generator(seed: int, name: str, tile_row: int, tile_col: int) -> np.random.Philox:
    return np.random.Philox(key=np.array(tile_key(seed, name, tile_row, tile_col), dtype=np.uint64))


def normal_draw(bits: np.random.BitGenerator, n: int, std: float) -> np.ndarray:
    """n Normal(0, std) float32 values from `bits`'s 64-bit words by the Box-Muller transform.

    Not numpy's `Generator.standard_normal`: numpy keeps a bit generator's stream the same from version to version
    but not its Generator's distributions (NEP 19), and its ziggurat, fetching each word through a C callback, took
    three times as long here. Each 64-bit word is two 32-bit ones, whose top 24 bits k give a uniform (k + 1) / 2**24
    (exact in float32) in (0, 1], so that the logarithm is finite; the first half of them give the radii, the second
    half the angles. The values stop at 5.8 std, as torch's CPU normal_ (Box-Muller on 24-bit uniforms too) did. The
    last bit of a value may differ between CPUs whose float32 log, sin and cos (numpy's SIMD kernels) differ, as
    torch's did."""
    pairs = (n + 1) // 2
    # Little-endian words whatever the machine, so that a word's two halves are taken in the same order everywhere.
    words = bits.random_raw(pairs).astype("<u8", copy=False).view("<u4")
    uniform = (words >> np.uint32(8)).astype(np.float32)
    uniform += 1.0
    uniform *= 2.0**-24
    radius, angle = uniform[:pairs], uniform[pairs:]
    np.log(radius, out=radius)
    radius *= -2.0
    np.sqrt(radius, out=radius)
    radius *= std
    angle *= 2 * math.pi
    values = np.empty(2 * pairs, dtype=np.float32)
    np.cos(angle, out=values[:pairs])
    np.sin(angle, out=values[pairs:])
    values[:pairs] *= radius
    values[pairs:] *= radius
    return values[:n]


def segments(indices: torch.Tensor, size: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(tile, positions in `indices`, offsets within the tile) for each tile of `size` that `indices` touch."""
    tiles = indices // size
    order = torch.argsort(tiles, stable=True)
    found, counts = torch.unique_consecutive(tiles[order], return_counts=True)
    out, start = [], 0
    for tile, count in zip(found.tolist(), counts.tolist()):
        positions = order[start : start + count]
        out.append((tile, positions, indices[positions] - tile * size))
        start += count
    return out


def as_slice(index: torch.Tensor) -> slice | torch.Tensor:
    """A run of consecutive indices as a slice (a view, no gather); anything else as it is."""
    first, n = int(index[0]), index.numel()
    return slice(first, first + n) if int(index[-1]) - first == n - 1 and bool((index.diff() == 1).all()) else index


@torch.no_grad()
def normal_values(
    seed: int,
    name: str,
    shape: torch.Size | tuple[int, ...],
    std: float,
    rows: torch.Tensor | None = None,
    cols: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Normal(0, std) values of parameter `name` (of `shape`, seen as a matrix) at the given row and column
    indices (1-D int64 tensors; None: all), as a [len(rows), len(cols)] tensor on the CPU, or written into `out`
    (a rank's shard seen as that matrix, wherever it lives)."""
    n_rows, n_cols = matrix_shape(shape)
    if n_rows > TILE_ROWS << 32 or n_cols > TILE_COLS << 32:
        raise ValueError(
            f"{name}: {n_rows} x {n_cols} is over 2**32 tiles high or wide; a tile's key holds 32 bits of each"
        )
    rows = torch.arange(n_rows, device=HOST) if rows is None else rows
    cols = torch.arange(n_cols, device=HOST) if cols is None else cols
    out = torch.empty(rows.numel(), cols.numel(), device=HOST) if out is None else out
    if out.numel() == 0:
        return out
    col_segments = [(tile, as_slice(where), as_slice(offsets)) for tile, where, offsets in segments(cols, TILE_COLS)]
    for tile_row, row_where, row_offsets in segments(rows, TILE_ROWS):
        height = min(TILE_ROWS, n_rows - tile_row * TILE_ROWS)
        r_out, r_in = as_slice(row_where), as_slice(row_offsets)
        for tile_col, c_out, c_in in col_segments:
            width = min(TILE_COLS, n_cols - tile_col * TILE_COLS)
            bits = tile_generator(seed, name, tile_row, tile_col)
            tile = torch.from_numpy(normal_draw(bits, height * width, std)).view(height, width)
            if all(isinstance(s, slice) for s in (r_out, r_in, c_out, c_in)):
                out[r_out, c_out] = tile[r_in, c_in]
            else:  # scattered positions (a strided shard): gathered and placed element by element
                out[_column(r_out, out.shape[0]), _row(c_out, out.shape[1])] = tile[
                    _column(r_in, height), _row(c_in, width)
                ]
    return out


def _column(index: slice | torch.Tensor, size: int) -> torch.Tensor:
    return (torch.arange(size, device=HOST)[index] if isinstance(index, slice) else index)[:, None]


def _row(index: slice | torch.Tensor, size: int) -> torch.Tensor:
    return (torch.arange(size, device=HOST)[index] if isinstance(index, slice) else index)[None, :]
