"""A published Hugging Face Llama folder (`init_from=DIR`), read without torch: its `config.json` as this
platform's model settings, and the names, shapes and types of its weights from the safetensors headers.

All of it runs in the settings check, before torch is imported, so that a folder that cannot be loaded
is one clear error within a second rather than a failure after the process group has started.
project.hf.published then reads the weights themselves, each rank its own slices.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path
from typing import Any, Mapping

from project.hf.conversion import LLAMA3_ROPE_KEYS, hf_weight_shapes
from project.model.config import LlamaConfig
from project.model.families import FAMILIES, family_of, model_config
from project.runtime.errors import ConfigError

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
# Weight types a published Llama comes in; quantized folders (int8, fp8) would need their scales applied.
DTYPES = ("F32", "BF16", "F16")
# Settings that would change the FFN width the folder fixes (model.ffn_dim wins over both).
FFN_RULE = ("multiple_of", "ffn_dim_multiplier")
# HF's model_type -> our model.family, for every family with a Hugging Face format.
MODEL_TYPES = {family.format().model_type: name for name, family in FAMILIES.items() if family.hf_format}


def _refuse(folder: Path, problem: str) -> ConfigError:
    return ConfigError(
        f"init_from={folder}: {problem} init_from takes a Hugging Face folder of {_architectures()} as published "
        f"(config.json, model.safetensors or model-0000N-of-0000M.safetensors with {INDEX})."
    )


def _architectures() -> str:
    return " or ".join(FAMILIES[name].format().architecture for name in MODEL_TYPES.values())


def read_config(folder: Path) -> dict[str, Any]:
    if not folder.is_dir():
        raise _refuse(folder, "no such folder.")
    path = folder / CONFIG
    if not path.is_file():
        raise _refuse(folder, f"it holds no {CONFIG}.")
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _refuse(folder, f"its {CONFIG} is not JSON ({error}).") from None
    if not isinstance(config, dict) or config.get("model_type") not in MODEL_TYPES:
        kind = config.get("model_type") if isinstance(config, dict) else None
        raise _refuse(
            folder,
            f"its {CONFIG} describes a model_type={kind!r} model; this platform reads "
            f"model_type {' or '.join(repr(t) for t in MODEL_TYPES)}.",
        )
    return config


def _rope(folder: Path, config: Mapping[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, Llama-3 rope_scaling or None), from transformers 4's `rope_theta` + `rope_scaling` or 5's
    `rope_parameters`."""
    parameters = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or (
        parameters if parameters.get("rope_type", "default") != "default" else None
    )
    theta = config.get("rope_theta", parameters.get("rope_theta", 10000.0))
    if scaling is None:
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3" or any(k not in scaling for k in LLAMA3_ROPE_KEYS):
        raise _refuse(
            folder,
            f"its RoPE scaling {dict(scaling)} is not one this model implements (none, or Llama 3's 'llama3' with "
            f"{list(LLAMA3_ROPE_KEYS)}).",
        )
    return float(theta), {k: scaling[k] for k in LLAMA3_ROPE_KEYS}


def model_settings(folder: Path, config: Mapping[str, Any]) -> dict[str, Any]:
    """Our `model.*` settings for the folder's config.json, as its family's format reads them; what the family's model
    cannot be (biases, another activation or head size) is refused."""
    family = MODEL_TYPES[config["model_type"]]
    form = FAMILIES[family].format()
    if unsupported := form.unsupported(dict(config)):
        said = ", ".join(f"{key}={config.get(key)!r}" for key in unsupported)
        raise _refuse(folder, f"its {CONFIG} has {said}, which {form.architecture} here does not take.")
    optional = ("rope_theta", "rope_scaling", "n_kv_heads", "tie_embeddings")
    missing = [hf for ours, hf in form.FIXED.items() if ours not in optional and hf not in config]
    if missing:
        raise _refuse(folder, f"its {CONFIG} lacks {missing}.")
    theta, scaling = _rope(folder, config)
    settings = {
        ours: config[hf]
        for ours, hf in form.FIXED.items()
        if hf in config and ours not in ("rope_theta", "rope_scaling")
    }
    settings.update(
        n_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        rope_theta=theta,
        rope_scaling=scaling,
    )
    if "max_position_embeddings" in config:
        settings["max_seq_len"] = config["max_position_embeddings"]
    if "initializer_range" in config:
        settings["init_std"] = config["initializer_range"]
    settings["family"] = family
    try:
        return settings | form.settings(dict(config))
    except ValueError as problem:
        raise _refuse(folder, f"its {CONFIG} {problem}") from None


def _header(path: Path) -> dict[str, Any]:
    """A safetensors file's header (name -> dtype, shape, data_offsets), checked against the file's size."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > path.stat().st_size - 8:
                raise ValueError("its header runs past the end of the file")
            header = json.loads(f.read(length))
        end = max((entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"), default=0)
    except (OSError, struct.error, ValueError, KeyError, TypeError, IndexError) as error:
        raise ConfigError(
            f"init_from: {path} is not a readable safetensors file ({error}): download it again."
        ) from None
    if 8 + length + end > path.stat().st_size:
        raise ConfigError(
            f"init_from: {path} is cut short ({path.stat().st_size} bytes of {8 + length + end}): download it again."
        )
    header.pop("__metadata__", None)
    return header


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files holding the weights: those the index names, or the one model.safetensors."""
    present = sorted(folder.glob("*.safetensors"))
    if (folder / INDEX).is_file():
        try:
            named = sorted({folder / name for name in json.loads((folder / INDEX).read_text())["weight_map"].values()})
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise _refuse(folder, f"its {INDEX} has no readable weight_map ({error}).") from None
        absent = [p.name for p in named if not p.is_file()]
        if absent:
            raise _refuse(folder, f"its {INDEX} names files that are not there: {absent[:5]}.")
    elif present == [folder / "model.safetensors"]:
        named = present
    else:
        found = [p.name for p in present] or sorted(p.name for p in folder.glob("*.bin"))
        raise _refuse(
            folder,
            f"it holds {found or 'no weight files'} and no {INDEX}: safetensors weights are needed (save them "
            "with transformers' save_pretrained, which writes safetensors).",
        )
    # torch's reader takes every safetensors file in the folder: one the index does not name would be read too.
    stray = [p.name for p in present if p not in named]
    if stray:
        raise _refuse(
            folder, f"it holds safetensors files its {INDEX} does not name ({stray[:5]}): move them out of the folder."
        )
    return named


def check_weights(folder: Path, config: LlamaConfig) -> None:
    """Every weight the model needs is in the folder with its shape, and nothing else is."""
    found: dict[str, dict[str, Any]] = {}
    for path in weight_files(folder):
        found.update(_header(path))
    expected = hf_weight_shapes(config)
    tied = config.tie_embeddings and "lm_head.weight" in found  # some tied models are saved with both copies
    extra = sorted(set(found) - set(expected) - ({"lm_head.weight"} if tied else set()))
    missing = sorted(set(expected) - set(found))
    if extra or missing:
        said = "; ".join(
            f"{what} {names[:4]}{' and more' if len(names) > 4 else ''}"
            for what, names in (("missing", missing), ("unexpected", extra))
            if names
        )
        raise _refuse(folder, f"its weights do not match its {CONFIG} ({said}).")
    for name, shape in expected.items():
        if tuple(found[name]["shape"]) != shape:
            raise _refuse(
                folder, f"its weight {name} has shape {found[name]['shape']}, where its {CONFIG} implies {list(shape)}."
            )
        if found[name]["dtype"] not in DTYPES:
            raise _refuse(
                folder,
                f"its weight {name} is of type {found[name]['dtype']}; this platform loads {list(DTYPES)} weights.",
            )


def _explicit_model_keys(overrides: list[str]) -> set[str]:
    """The model.* settings named on the command line (`model.dim=64`, `+model.x=1`)."""
    keys = (o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o)
    return {key.removeprefix("model.") for key in keys if key.startswith("model.")}


def apply_init_from(cfg: Any, overrides: list[str]) -> None:
    """Set `cfg.model` to the shape of the folder `cfg.init_from`, refusing command-line overrides that contradict
    it."""
    from omegaconf import open_dict

    folder = Path(str(cfg.init_from))
    hf_config = read_config(folder)
    settings = model_settings(folder, hf_config)
    explicit = _explicit_model_keys(overrides)
    named = family_of(settings).format().fixed()
    for key in sorted(explicit & (set(named) | set(FFN_RULE) | {"family"})):
        ours = cfg.model.get(key)
        theirs = settings.get(key)
        if key in FFN_RULE or ours != theirs:
            published = (
                f"{named[key]}={theirs}"
                if key in named
                else f"model_type={hf_config['model_type']}"
                if key == "family"
                else f"intermediate_size={settings['ffn_dim']}, which fixes the FFN width"
            )
            raise ConfigError(
                f"model.{key}={ours} contradicts init_from={folder}, whose {CONFIG} has {published}: the folder's "
                f"weights have its shape. Drop model.{key}, or train a model of your own without init_from."
            )
    fixed = set(named) | {"family"}
    fields = {f.name for f in dataclasses.fields(family_of(settings).config)}
    if stray := sorted(explicit - fields):
        raise ConfigError(
            f"model.{stray[0]} is not a setting of the model in init_from={folder} (model_type="
            f"{hf_config['model_type']}): drop it, or train a model of your own without init_from."
        )
    with open_dict(cfg):
        for key, value in settings.items():
            if key in fixed or key not in explicit:  # max_seq_len and init_std: the command line's, where it sets them
                cfg.model[key] = value
        # The folder's family decides the model: settings of another family's (a preset's n_experts) go.
        for key in [key for key in cfg.model if key not in fields]:
            del cfg.model[key]
    check_weights(folder, model_config(dict(cfg.model)))
