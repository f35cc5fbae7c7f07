"""Load a published Hugging Face folder's weights (`init_from=DIR`: a Llama, a Mixtral, a Qwen3 or a Llama 4) into the
model of any layout.

torch's distributed checkpoint reads the folder through its Hugging Face reader: each rank asks for its
parameters as they are laid out (whole, or DTensor shards under fsdp2, tp, tp_fsdp and the pipeline) and
reads only those slices from the safetensors files, so no rank holds more of the model than its own share. A
Mixtral's experts are one tensor each in the folder and one stacked tensor here: of each expert a rank holds a part
of, it reads the rows its part spans (FSDP2 splits experts along their width: the rank's own rows), one expert at a
time.
Values are copied into the parameters' own type: a bfloat16 folder fills float32 master weights.
The folder itself was checked (project.hf.folder) before training started.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.tensor import DTensor

from project.hf.conversion import hf_pieces
from project.hf.folder import INDEX
from project.model.families.llama.hf import Transposed
from project.model.llama import Llama
from project.model.spec import own_name
from project.parallel.init import local_indices


@torch.no_grad()
def load_published_weights(model: Llama, folder: str | Path) -> None:
    """Fill every parameter this rank holds from `folder`; a pipeline stage holds only its own layers."""
    # A tied output matrix is the embedding parameter itself, which named_parameters lists once.
    state, stacked, parts = {}, [], []
    for name, param in model.named_parameters():
        pieces = hf_pieces(own_name(name), model.config)  # whatever wraps its block
        if pieces[0][1] is None:
            state[pieces[0][0]] = param
        elif isinstance(pieces[0][1], Transposed):
            parts.append((param, *pieces[0]))
        else:
            stacked.append((param, [hf for hf, _ in pieces]))
    single_process = not (dist.is_available() and dist.is_initialized())
    with warnings.catch_warnings():  # said even when asked for: one process is what we mean
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(folder)), no_dist=single_process)
    files = tensor_files(Path(folder))
    for param, names in stacked:
        load_experts(param, [files(name) for name in names], names)
    for param, hf, piece in parts:
        load_part(param, files(hf), hf, piece)


def tensor_files(folder: Path):
    """The safetensors file of each tensor of a published folder (its index's map, or its one file)."""
    index = folder / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return lambda name: folder / weight_map[name]
    return lambda name: folder / "model.safetensors"


def load_experts(param: torch.Tensor, files: list[Path], names: list[str]) -> None:
    """A mixture's stacked experts [n, out, in] (this rank's shard of them) from a folder's one tensor per expert
    (`names`, expert by expert, in `files`): of each expert this rank holds a part of, it reads the rows its part
    spans (safetensors reads slices of a file) and keeps its part. Every rank reads on its own: ranks hold different
    experts, and no collective is needed."""
    local = param.to_local() if isinstance(param, DTensor) else param
    if local.numel() == 0:
        return
    rows, cols = local_indices(param) if isinstance(param, DTensor) else (torch.arange(param.shape[0]), None)
    in_dim = param.shape[2]
    first, last = (0, param.shape[1]) if cols is None else (int(cols.min()) // in_dim, int(cols.max()) // in_dim + 1)
    held = local.view(rows.numel(), -1)
    for i, expert in enumerate(rows.tolist()):
        with safe_open(str(files[expert]), framework="pt") as tensors:
            values = tensors.get_slice(names[expert])[first:last].to(param.dtype).reshape(-1)
        held[i].copy_(values if cols is None else values[cols - first * in_dim])


def load_part(param: torch.Tensor, file: Path, name: str, piece: Transposed) -> None:
    """A weight that is part of a folder's tensor `name`, laid out the other way round (Llama 4's experts: w1 and w3
    side by side): only the part's columns read, of the experts this rank holds a shard of, and the shard kept."""
    if not isinstance(param, DTensor):
        with safe_open(str(file), framework="pt") as tensors:
            param.copy_(piece.of(tensors.get_slice(name)).to(param.dtype))
        return
    local = param.to_local()
    if local.numel() == 0:
        return
    rows, cols = local_indices(param)
    first, last = int(rows.min()), int(rows.max()) + 1
    with safe_open(str(file), framework="pt") as tensors:
        values = piece.of(tensors.get_slice(name), slice(first, last)).to(param.dtype)
    local.copy_(values.reshape(last - first, -1)[rows - first][:, cols].view(local.shape))
