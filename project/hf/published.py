"""Load a published Hugging Face folder's weights (`init_from=DIR`: a Llama, or a Mixtral) into the model of any
layout.

torch's distributed checkpoint reads the folder through its Hugging Face reader: each rank asks for its
parameters as they are laid out (whole, or DTensor shards under fsdp2, tp, tp_fsdp and the pipeline) and
reads only those slices from the safetensors files, so no rank holds more of the model than its own share. A
Mixtral's experts are one tensor each in the folder and one stacked tensor here: a rank reads each expert it holds
a part of whole, one at a time (at most one expert's matrix more than its share: 235 MB at Mixtral 8x7B's size in
float32), and keeps its part.
Values are copied into the parameters' own type: a bfloat16 folder fills float32 master weights.
The folder itself was checked (project.hf.folder) before training started.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.tensor import DTensor

from project.hf.conversion import hf_pieces
from project.model.llama import Llama
from project.parallel.init import local_indices


@torch.no_grad()
def load_published_weights(model: Llama, folder: str | Path) -> None:
    """Fill every parameter this rank holds from `folder`; a pipeline stage holds only its own layers."""
    # A tied output matrix is the embedding parameter itself, which named_parameters lists once.
    state, stacked = {}, []
    for name, param in model.named_parameters():
        pieces = hf_pieces(name, model.config)
        if pieces[0][1] is None:
            state[pieces[0][0]] = param
        else:
            stacked.append((param, [hf for hf, _ in pieces]))
    single_process = not (dist.is_available() and dist.is_initialized())
    with warnings.catch_warnings():  # said even when asked for: one process is what we mean
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(folder)), no_dist=single_process)
        for param, names in stacked:
            load_experts(param, names, str(folder))


def load_experts(param: torch.Tensor, names: list[str], folder: str) -> None:
    """A mixture's stacked experts [n, out, in] (this rank's shard of them) from the folder's one tensor per expert
    (`names`, expert by expert): each expert this rank holds any of is read whole, one at a time, and the rank keeps
    its part. Every rank reads on its own (no collective: ranks may hold different experts)."""
    local = param.to_local() if isinstance(param, DTensor) else param
    if local.numel() == 0:
        return
    rows, cols = local_indices(param) if isinstance(param, DTensor) else (torch.arange(param.shape[0]), None)
    held = local.view(rows.numel(), -1)
    for i, expert in enumerate(rows.tolist()):
        whole = torch.empty(param.shape[1:], dtype=param.dtype)
        dcp.load({names[expert]: whole}, storage_reader=HuggingFaceStorageReader(folder), no_dist=True)
        values = whole.view(-1)
        held[i].copy_(values if cols is None else values[cols])
