"""Load a published Hugging Face Llama folder's weights (`init_from=DIR`) into the model of any layout.

torch's distributed checkpoint reads the folder through its Hugging Face reader: each rank asks for its
parameters as they are laid out (whole, or DTensor shards under fsdp2, tp, tp_fsdp and the pipeline) and
reads only those slices from the safetensors files, so no rank holds more of the model than its own share.
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

from project.hf.conversion import hf_name
from project.model.llama import Llama


@torch.no_grad()
def load_published_weights(model: Llama, folder: str | Path) -> None:
    """Fill every parameter this rank holds from `folder`; a pipeline stage holds only its own layers."""
    # A tied output matrix is the embedding parameter itself, which named_parameters lists once.
    state = {hf_name(name): param for name, param in model.named_parameters()}
    single_process = not (dist.is_available() and dist.is_initialized())
    with warnings.catch_warnings():  # said even when asked for: one process is what we mean
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(folder)), no_dist=single_process)
