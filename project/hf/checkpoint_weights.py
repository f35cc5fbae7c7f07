"""A checkpoint's model weights, read a few tensors at a time, and written as Hugging Face safetensors files.

From a single file the tensors are memory-mapped; from a sharded folder (fsdp, fsdp2, tp, tp_fsdp, pipeline)
torch's distributed checkpoint assembles each tensor from the ranks' pieces when it is asked for. The export
asks for one output file's tensors at a time, so it never holds more of the model than `max_shard_size`,
whatever the model's size: the scaling that gathering the whole model on one process lacks.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from project.checkpoint.files import verify_sharded_checkpoint
from project.checkpoint.locations import Location, storage_reader
from project.hf.conversion import hf_pieces, hf_tensors, weight_names
from project.hf.folder import INDEX
from project.model.config import LlamaConfig
from project.runtime.errors import ConfigError

# Where the model's weights are in a sharded folder: ModelParallelStrategy's "state_dict", FSDP1's "model".
FOLDER_PREFIXES = ("state_dict.model.", "model.model.")


@dataclass
class CheckpointWeights:
    """Our parameter names -> (shape, dtype), and `read(names)`, which returns those tensors."""

    shapes: dict[str, tuple[torch.Size, torch.dtype]]
    read: Callable[[list[str]], dict[str, torch.Tensor]]


def checkpoint_weights(path: Location, state_dict: dict[str, torch.Tensor] | None = None) -> CheckpointWeights:
    """The model weights of a checkpoint file (its `state_dict`, memory-mapped, given) or of a sharded folder."""
    if state_dict is not None:
        tensors = {k.removeprefix("model."): v for k, v in state_dict.items() if k.startswith("model.")}
        return CheckpointWeights(
            {k: (v.shape, v.dtype) for k, v in tensors.items()}, lambda names: {n: tensors[n] for n in names}
        )
    verify_sharded_checkpoint(path)
    metadata = storage_reader(path).read_metadata()
    stored = {k: m for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    prefix = next((p for p in FOLDER_PREFIXES if any(k.startswith(p) for k in stored)), None)
    if prefix is None:
        raise ConfigError(
            f"{path} holds no model weights (no {' or '.join(FOLDER_PREFIXES)}* entries): pass a checkpoint of this "
            "platform."
        )
    shapes = {k.removeprefix(prefix): (m.size, m.properties.dtype) for k, m in stored.items() if k.startswith(prefix)}

    def read(names: list[str]) -> dict[str, torch.Tensor]:
        state = {prefix + n: torch.empty(shapes[n][0], dtype=shapes[n][1]) for n in names}
        try:
            with warnings.catch_warnings():  # one process reading a folder is what we mean
                warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
                dcp.load(state, storage_reader=storage_reader(path), no_dist=True)
        except Exception as error:  # a damaged shard: which exception depends on the damage
            reason = " ".join(f"{type(error).__name__}: {error}".split())[:500]
            raise ConfigError(
                f"ckpt_path={path}: could not read its weights ({reason}); pass another checkpoint."
            ) from None
        return {n: state[prefix + n] for n in names}

    return CheckpointWeights(shapes, read)


def plan_files(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Tensors in order, a new file whenever the next would pass `max_bytes` (a larger tensor gets a file of its
    own)."""
    files: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if files[-1] and used + size > max_bytes:
            files.append([])
            used = 0
        files[-1].append(name)
        used += size
    return files


def write_safetensors(
    weights: CheckpointWeights, config: LlamaConfig, dtype: torch.dtype, out: Path, max_shard_size: int
) -> list[str]:
    """The model's weights under HF names in `out`: `model.safetensors`, or `model-0000N-of-0000M.safetensors` with
    an index once they pass `max_shard_size`, as transformers writes them. Returns the file names."""
    names = weight_names(config)  # a tied output matrix is the embedding, not written twice
    missing = [n for n in names if n not in weights.shapes]
    unexpected = sorted(set(weights.shapes) - set(names) - {"output.weight"})
    if missing or unexpected:
        raise ConfigError(
            f"the checkpoint's weights do not fit its own model config: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}."
        )
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = {n: weights.shapes[n][0].numel() * itemsize for n in names}
    # Weights that are parts of one HF tensor (Llama 4's experts' w1 and w3) go to one file together.
    together: dict[str, list[str]] = {}
    for n in names:
        together.setdefault(hf_pieces(n, config)[0][0], []).append(n)
    unit_sizes = {first: sum(sizes[n] for n in group) for first, group in together.items()}
    groups = [[n for first in file for n in together[first]] for file in plan_files(unit_sizes, max_shard_size)]
    files = (
        ["model.safetensors"]
        if len(groups) == 1
        else [f"model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)]
    )
    for group, file in zip(groups, files):
        tensors = {hf: t.detach().to(dtype).contiguous() for hf, t in hf_tensors(weights.read(group), config).items()}
        # transformers refuses safetensors files whose metadata does not name the framework.
        save_file(tensors, out / file, metadata={"format": "pt"})
        del tensors
    if len(files) > 1:
        weight_map = {hf: file for group, file in zip(groups, files) for n in group for hf, _ in hf_pieces(n, config)}
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        files.append(INDEX)
    return files
