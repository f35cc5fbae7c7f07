"""A model of ours written as a Hugging Face folder and read back, for the families' tests against transformers."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from project.hf.conversion import from_hf_state_dict, hf_config_dict, to_hf_state_dict
from project.hf.folder import check_weights, model_settings
from project.model.families import build_model, model_config
from project.model.llama import Llama


def write_hf_folder(model: Llama, folder: Path) -> dict[str, torch.Tensor]:
    """`model` as a folder transformers' own loader reads (our config.json and one safetensors file); the tensors
    written, by their HF names."""
    exported = to_hf_state_dict(model.state_dict(), model.config)
    save_file({k: v.contiguous() for k, v in exported.items()}, folder / "model.safetensors", {"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf_config_dict(model.config)))
    return exported


def assert_folder_reads_back(folder: Path, model: Llama, exported: dict[str, torch.Tensor]) -> None:
    """The folder's config.json reads back as `model`'s settings (but those a run sets), its weights as its tensors."""
    settings = model_settings(folder, json.loads((folder / "config.json").read_text()))
    assert model_config({**settings, "max_seq_len": 256, "init_std": 0.02}) == model.config
    check_weights(folder, model.config)
    restored = build_model(model.config, init_seed=4)
    restored.load_state_dict(from_hf_state_dict(exported, model.config), strict=True)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(restored.state_dict()[name], tensor, atol=0, rtol=0, msg=name)
