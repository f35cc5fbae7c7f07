"""Export a training checkpoint as a Hugging Face model folder (LlamaForCausalLM, or MixtralForCausalLM for a
mixture of experts, + tokenizer).

    python -m project.export ckpt_path=PATH [output_dir=DIR] [tokenizer=PATH] [dtype=float32|bfloat16|float16]
                             [max_shard_size=5GB] [overwrite=true]

The default output_dir is `outputs/hf/<run>-<checkpoint>` under $PROJECT_ROOT (as conf/paths), e.g.
outputs/hf/r1-last for outputs/runs/r1/checkpoints/last.ckpt: generated files stay out of the source tree.

Writes config.json, model.safetensors (past max_shard_size: model-0000N-of-0000M.safetensors and
model.safetensors.index.json, as transformers does), generation_config.json and the tokenizer files, so that
`LlamaForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)` load offline. Needs no
transformers. The weights are read one output file at a time (project.hf.checkpoint_weights), so exporting
never holds more of the model than max_shard_size, from a file or a sharded folder. The tokenizer is the one the
checkpoint carries (the run's, whatever was prepared into its data directory since), or `tokenizer=`; a checkpoint
from before checkpoints carried it takes the one in the manifest.json of its data directory. Either is refused
where its vocabulary is not the one the checkpoint records. A sentencepiece model is exported
for transformers' LlamaTokenizer, which reads it as a Llama-style BPE with byte fallback and needs `protobuf`
installed to load it.

In the shards every document follows the end-of-text token that ends the one before, and no BOS the model could
have learned exists; project.generate therefore puts that token before a prompt. The export says so in the terms
other programs read (transformers, lm-evaluation-harness, llama.cpp's convert_hf_to_gguf.py): the end-of-text
token is also the `bos_token` (tokenizer_config.json; `bos_token_id` in config.json and generation_config.json),
and `add_bos_token: true`, with the same template in tokenizer.json's post-processor, puts it before every text
the tokenizer encodes with its special tokens. A model trained with `document_mask=true` never attended across an
end-of-text token, so its export adds none (as project.generate, which gives it one only for an empty prompt).

Arguments are Hydra-style `key=value` for symmetry with project.train, parsed here without Hydra because
there is nothing to compose. The checkpoint is unpickled (it holds hyper-parameters): export only files
you trust.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError

from project.checkpoint.files import checkpoint_metadata, refuse_older_format
from project.checkpoint.locations import (
    Location,
    check_reachable,
    check_url,
    exists,
    is_folder,
    is_remote,
    location,
    parent_of,
)
from project.data.shards import MANIFEST_NAME
from project.data.tokenizer import CHECKPOINT_TOKENIZER, load_tokenizer, write_tokenizer_record
from project.hf.checkpoint_weights import CheckpointWeights, checkpoint_weights, write_safetensors
from project.hf.conversion import hf_config_dict
from project.hf.export_settings import DEFAULTS, USAGE, check_output_dir, default_output_dir, parse_args
from project.model.config import LlamaConfig
from project.model.families import model_config, without_hf_format
from project.runtime.arguments import parse_size
from project.runtime.errors import ConfigError, exit_on_config_error

__all__ = ["USAGE", "default_output_dir", "export", "main", "parse_args"]  # the command's settings, where tests look
PASS_TOKENIZER = "Pass tokenizer=PATH (a HF tokenizer.json or a sentencepiece .model)."


def load_checkpoint(path: Location) -> tuple[LlamaConfig, CheckpointWeights, Mapping]:
    """(model config, its weights to read, the checkpoint's other records) from a Lightning checkpoint of our
    module: a `.ckpt` file (memory-mapped) or, from a sharded strategy, a distributed-checkpoint folder, whose
    tensors are read only as they are written out; either in object storage too (an s3:// URL)."""
    path = location(path)
    if is_remote(path):  # said as settings errors: a URL we cannot keep checkpoints at, a bucket not reached
        check_url(str(path), "ckpt_path")
        check_reachable(str(parent_of(path)), "ckpt_path")
    if not exists(path):
        raise ConfigError(
            f"checkpoint {path} does not exist; pass ckpt_path= a Lightning .ckpt file or sharded checkpoint folder."
        )
    try:
        ckpt = checkpoint_metadata(path)
        hparams = ckpt.get("hyper_parameters", {}) if isinstance(ckpt, Mapping) else {}
        folder = is_folder(path)
        if not isinstance(ckpt, Mapping) or "model" not in hparams or not (folder or "state_dict" in ckpt):
            found = sorted(ckpt) if isinstance(ckpt, Mapping) else type(ckpt).__name__
            raise ConfigError(
                f"{path} is not a checkpoint of our LightningModule: it needs 'state_dict' (the model under the "
                f"'model.' prefix) and 'hyper_parameters' -> 'model' (the LlamaConfig as a dict); found {found}."
            )
        weights = checkpoint_weights(path, None if folder else ckpt["state_dict"])
    except ConfigError as e:  # a damaged file, said by project.checkpoint.files
        raise ConfigError(f"ckpt_path={path}: {e}") from None
    except Exception as e:  # a damaged sharded folder: which exception depends on the damage
        reason = " ".join(f"{type(e).__name__}: {e}".split())  # one paragraph, however many lines it had
        raise ConfigError(
            f"ckpt_path={path}: could not read the checkpoint ({reason}); pass another checkpoint."
        ) from None
    refuse_older_format(ckpt, path)
    try:
        config = model_config(dict(hparams["model"]))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"hyper_parameters['model'] in {path} is not a valid model config: {e}") from e
    return config, weights, ckpt


@contextlib.contextmanager
def checkpoint_tokenizer(
    ckpt: Mapping, override: str | None, source: object = "the checkpoint"
) -> Iterator[tuple[Path, int | None, int | None]]:
    """(tokenizer file, bos id, eos id) of the tokenizer checkpoint `ckpt` (read from `source`) was trained with, for
    the length of the block: `override` if given, else the one the checkpoint carries (written into a temporary
    folder), else, for a checkpoint from before they carried one, the tokenizer in its data directory's manifest.json.
    One whose vocabulary is not the one the checkpoint records is refused: its ids would stand for other tokens."""
    record = ckpt.get(CHECKPOINT_TOKENIZER)
    if override or not isinstance(record, Mapping):
        path, bos_id, eos_id = resolve_tokenizer(ckpt, override)
        check_trained_with(path, ckpt, source, bool(override))
        yield path, bos_id, eos_id
        return
    with tempfile.TemporaryDirectory(prefix="checkpoint-tokenizer-") as folder:
        yield write_tokenizer_record(record, folder), record.get("bos_id"), record.get("eos_id")


def check_trained_with(path: Path, ckpt: Mapping, source: object, override: bool) -> None:
    """Refuse the tokenizer at `path` (`override`: given as tokenizer=) where the checkpoint records the digest of
    another vocabulary (a fit that read no token shards records none: nothing to compare)."""
    given = f"tokenizer={path}" if override else f"the tokenizer file {path}"
    recorded = (ckpt.get("tokenizer") or {}).get("vocabulary_sha256")
    if not recorded or path.suffix not in (".json", ".model"):
        return  # the suffix is said by write_tokenizer
    try:
        digest = load_tokenizer(path).vocabulary_digest()
    except ConfigError:  # no end-of-text token, say: no tokenizer the platform trains with
        digest = "unreadable"
    if digest != recorded:
        data_dir = (ckpt.get("datamodule_hyper_parameters") or {}).get("data_dir")
        since = f" (the shards in {data_dir} were prepared again since?)" if data_dir and not override else ""
        fix = (
            "Leave out tokenizer= to use the one the checkpoint carries"
            if isinstance(ckpt.get(CHECKPOINT_TOKENIZER), Mapping)
            else "Pass tokenizer=PATH, the tokenizer.json or .model the run trained with"
        )
        raise ConfigError(
            f"{given} is not the tokenizer {source} was trained with: its vocabulary's digest {digest[:12]} differs "
            f"from the {recorded[:12]} the checkpoint records{since}, so its ids would stand for other tokens. {fix}."
        )


def resolve_tokenizer(ckpt: Mapping, override: str | None) -> tuple[Path, int | None, int | None]:
    """(tokenizer file, bos id, eos id): `override` if given, else the data directory's manifest.json."""
    data = ckpt.get("datamodule_hyper_parameters") or {}
    data_dir = data.get("data_dir")
    if data_dir and is_remote(data_dir):  # shards in object storage: their manifest and tokenizer, fetched
        from project.data.storage import local_view

        data_dir = local_view(data_dir, data.get("cache_dir"), data.get("storage_options"))
    manifest_path = Path(data_dir) / MANIFEST_NAME if data_dir else None
    try:
        manifest = json.loads(manifest_path.read_text()) if manifest_path and manifest_path.is_file() else None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{manifest_path} is not valid JSON ({e}). Pass tokenizer=PATH to bypass it.") from e
    info = (manifest or {}).get("tokenizer") or {}
    bos_id, eos_id = info.get("bos_id"), info.get("eos_id")
    if override:
        path = Path(override)
    elif manifest is None:
        where = f"{manifest_path} does not exist" if manifest_path else "the checkpoint names no data_dir"
        raise ConfigError(f"cannot find the tokenizer: {where}. {PASS_TOKENIZER}")
    elif not info.get("file"):
        raise ConfigError(f"{manifest_path} names no tokenizer file. {PASS_TOKENIZER}")
    else:
        path = Path(data_dir) / info["file"]
    if not path.is_file():
        given = f"tokenizer={path}" if override else f"tokenizer file {path} (from {manifest_path})"
        raise ConfigError(f"{given} does not exist. {PASS_TOKENIZER}")
    return path, bos_id, eos_id


def write_tokenizer(
    path: Path, bos_id: int | None, eos_id: int | None, config: LlamaConfig, out: Path, prefix_documents: bool = True
) -> tuple[int | None, int | None, int]:
    """Write the tokenizer files AutoTokenizer needs into `out`; returns the (bos, eos) ids to write into the
    model's configs and the tokenizer's size (its largest id + 1). Where the end-of-text id is known it is both
    ids, and, with `prefix_documents`, the tokenizer puts it before every text it encodes with special tokens:
    what the model saw before each document in training."""
    if path.suffix == ".json":
        from tokenizers import Tokenizer, processors

        tok = Tokenizer.from_file(str(path))
        # Ids may have gaps (added tokens placed far out): sized by the largest, as project.data.tokenizer does.
        vocab_size, to_token = max(tok.get_vocab(with_added_tokens=True).values()) + 1, tok.id_to_token
        if eos_id is None:  # no manifest: the token found by name, as project.generate finds it
            try:
                eos_id = load_tokenizer(path).eos_id
            except ConfigError:
                pass
        if eos_id is not None:
            # transformers 5 builds this template from add_bos_token itself; transformers 4's
            # PreTrainedTokenizerFast, and every other program that reads tokenizer.json, take it from here.
            # It replaces any template the file had (Llama 3's adds <|begin_of_text|>, which the shards lack).
            eos = to_token(eos_id)
            tok.post_processor = (
                processors.TemplateProcessing(
                    single=f"{eos}:0 $A:0", pair=f"{eos}:0 $A:0 {eos}:1 $B:1", special_tokens=[(eos, eos_id)]
                )
                if prefix_documents
                else None
            )
            tok.save(str(out / "tokenizer.json"))
        else:
            shutil.copyfile(path, out / "tokenizer.json")
        tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    elif path.suffix == ".model":
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(path))
        vocab_size, to_token = sp.get_piece_size(), sp.id_to_piece
        # sentencepiece marks an absent special token with -1.
        bos_id = bos_id if bos_id is not None else (sp.bos_id() if sp.bos_id() >= 0 else None)
        eos_id = eos_id if eos_id is not None else (sp.eos_id() if sp.eos_id() >= 0 else None)
        shutil.copyfile(path, out / "tokenizer.model")
        tokenizer_config = {"tokenizer_class": "LlamaTokenizer", "legacy": False}
        if sp.unk_id() >= 0:
            tokenizer_config["unk_token"] = sp.id_to_piece(sp.unk_id())
    else:
        raise ConfigError(f"tokenizer {path} is neither a HF tokenizer.json (.json) nor a sentencepiece .model.")
    if vocab_size > config.vocab_size:
        raise ConfigError(
            f"tokenizer {path} has {vocab_size} tokens but the model only {config.vocab_size} embeddings: "
            "is it the tokenizer this model was trained with?"
        )
    if eos_id is not None:
        # The BOS that transformers, lm-evaluation-harness (its prefix_token_id) and llama.cpp put first is the
        # end-of-text token; the tokenizer's own BOS never occurs in the shards, so its embedding is untrained.
        bos_id = eos_id
    # Said false as well as true for sentencepiece: LlamaTokenizer adds its own BOS unless told not to.
    if eos_id is not None or path.suffix == ".model":
        tokenizer_config |= {"add_bos_token": prefix_documents and eos_id is not None, "add_eos_token": False}
    for name, token_id in (("bos_token", bos_id), ("eos_token", eos_id)):
        if token_id is not None:
            tokenizer_config[name] = to_token(token_id)
    tokenizer_config |= {"model_max_length": config.max_seq_len, "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return bos_id, eos_id, vocab_size


def write_model(
    config: LlamaConfig,
    weights: CheckpointWeights,
    dtype: str,
    bos_id: int | None,
    eos_id: int | None,
    out: Path,
    max_shard_size: int,
    tokenizer_size: int,
) -> None:
    write_safetensors(weights, config, getattr(torch, dtype), out, max_shard_size)
    hf_config = hf_config_dict(config, bos_token_id=bos_id, eos_token_id=eos_id, torch_dtype=dtype)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    generation: dict = {k: v for k, v in {"bos_token_id": bos_id, "eos_token_id": eos_id}.items() if v is not None}
    if tokenizer_size < config.vocab_size:
        # Rows past the tokenizer's ids pad the embedding table; no text has them, and project.generate never
        # chooses them: neither does transformers' generate.
        generation["suppress_tokens"] = list(range(tokenizer_size, config.vocab_size))
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def give_default_modes(folder: Path) -> None:
    """The modes a plain mkdir and open would give (0777 and 0666 less the umask): mkdtemp makes
    the folder 0700, which would keep an exported model from colleagues sharing its directory."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        path.chmod(0o666 & ~umask)


def export(
    ckpt_path: str,
    output_dir: str,
    tokenizer: str | None = None,
    dtype: str = "float32",
    overwrite: bool = False,
    max_shard_size: str = DEFAULTS["max_shard_size"],
) -> list[Path]:
    """Export `ckpt_path` into `output_dir`; returns the files written."""
    max_bytes = parse_size(max_shard_size, "max_shard_size")
    out = Path(output_dir)
    check_output_dir(out, overwrite)  # before the checkpoint is read (project.export: before torch is imported too)
    config, weights, ckpt = load_checkpoint(location(ckpt_path))
    if refusal := without_hf_format(config, "project.export"):
        raise ConfigError(refusal)
    document_mask = bool((ckpt.get("hyper_parameters") or {}).get("document_mask"))
    with checkpoint_tokenizer(ckpt, tokenizer, f"ckpt_path={ckpt_path}") as (tokenizer_path, bos_id, eos_id):
        return _write_export(out, config, weights, dtype, max_bytes, tokenizer_path, bos_id, eos_id, document_mask)


def _write_export(
    out: Path,
    config: LlamaConfig,
    weights: CheckpointWeights,
    dtype: str,
    max_bytes: int,
    tokenizer_path: Path,
    bos_id: int | None,
    eos_id: int | None,
    document_mask: bool,
) -> list[Path]:
    """Write the export into `out`, its tokenizer from `tokenizer_path`; returns the files written."""
    # Build everything in a sibling temp folder (same filesystem), so a failed export leaves no half-written model.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        bos_id, eos_id, tokenizer_size = write_tokenizer(
            tokenizer_path, bos_id, eos_id, config, tmp, prefix_documents=not document_mask
        )
        write_model(config, weights, dtype, bos_id, eos_id, tmp, max_bytes, tokenizer_size)
        if eos_id is None:
            print("warning: no manifest or tokenizer names an eos token, so generation will not stop by itself.",
                  file=sys.stderr)  # fmt: skip
        written = sorted(p.name for p in tmp.iterdir())
        give_default_modes(tmp)
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        if out.exists():  # overwrite=true into a folder with other files: replace ours one by one, keep theirs
            for name in written:
                os.replace(tmp / name, out / name)
            tmp.rmdir()
        else:
            os.replace(tmp, out)
    except (OSError, SafetensorError) as error:
        raise _unwritten(error, out) from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return [out / name for name in written]


def _unwritten(error: Exception, out: Path) -> Exception:
    """A ConfigError for a write that failed for want of space or permission; other errors as they are."""
    code = getattr(error, "errno", None)
    if code is None and (match := re.search(r"os error (\d+)", str(error))):  # safetensors' Rust I/O errors
        code = int(match[1])
    reason = getattr(error, "strerror", None) or str(error)
    if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return ConfigError(
            f"output_dir={out}: could not write the export ({reason}): free space on that disk, or choose another "
            f"output_dir, and run again; {out} was left as it was."
        )
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return ConfigError(
            f"output_dir={out}: could not write the export ({reason}); choose an output_dir you can write to."
        )
    return error


@exit_on_config_error()
def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv, __doc__)
    overwrite = args["overwrite"].lower() == "true"
    files = export(
        args["ckpt_path"], args["output_dir"], args["tokenizer"], args["dtype"], overwrite, args["max_shard_size"]
    )
    print(f"exported {args['ckpt_path']} to {args['output_dir']}:")
    for path in files:
        print(f"  {path}  ({path.stat().st_size:,} bytes)")
