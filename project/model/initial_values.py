"""Initial values any part of which can be drawn alone: an element's value depends only on the seed, the
parameter's name and the element's position, never on which other elements are drawn, where, or in what order.

A parameter is seen as a matrix (its first dimension by the product of the others) cut into tiles of TILE_ROWS x
TILE_COLS elements; each tile is drawn whole from a generator of its own, seeded by (seed, name, tile row, tile
column). Asked for the elements at some rows and columns, `normal_values` draws only the tiles they touch. A rank
whose shard is a product of row and column sets (FSDP2's dim-0 shards, tensor parallelism's column and row splits,
both at once, or a pipeline stage's whole parameters) so draws about its shard's share of the model, not the whole
model, and gets exactly the values one device draws for the whole parameter.

Tiles 32 rows high keep the rows drawn beyond a dim-0 shard few (at most 31 at each end); 1,024 columns wide keep a
column split over up to 8 ranks of a 4,096- to 14,336-wide matrix within two or three tiles of its own.
"""

from __future__ import annotations

import math
import zlib

import torch

TILE_ROWS, TILE_COLS = 32, 1024
# Tiles and indices are made on the host whatever the default device: the tiles' generators are CPU generators,
# and Lightning builds the model inside a `torch.device("cuda")` context on GPUs.
HOST = torch.device("cpu")


def matrix_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """(rows, columns) of a parameter seen as a matrix: its first dimension by the product of the others."""
    return (shape[0], math.prod(shape[1:])) if len(shape) else (1, 1)


def tile_generator(seed: int, name: str, tile_row: int, tile_col: int) -> torch.Generator:
    return torch.Generator(device=HOST).manual_seed(zlib.crc32(f"{seed}/{name}/{tile_row}/{tile_col}".encode()))


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
            generator = tile_generator(seed, name, tile_row, tile_col)
            tile = torch.empty(height, width, device=HOST).normal_(0.0, std, generator=generator)
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
