"""A run's data settings against the prepared shards they name: sources, tokenizer, sizes, the shards' state."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf

from project.checkpoint.urls import is_remote
from project.data.corpus import NoSourcesError, resolve_sources
from project.data.provenance import files_said, shards_origin
from project.data.shards import MANIFEST_NAME, read_manifest, shards_present
from project.data.storage import check_prepared_shards
from project.runtime.console import launch_rank
from project.runtime.errors import ConfigError


def data_on_this_machine(cfg: DictConfig) -> bool:
    """False for a local data.dir that does not exist here: a dry run of a job for another machine, whose
    shards are there, cannot check them (a real start prepares them, or refuses)."""
    return bool(cfg.data.get("mix")) or is_remote(cfg.data.dir) or Path(cfg.data.dir).exists()


def check_data(cfg: DictConfig, shards: bool = True, prepared: bool = False) -> None:
    """The model against the prepared shards, and the shards themselves, when they exist (they may yet be
    prepared by the run). `shards=False`: the sequence length against the model only. `prepared`: the run has
    just prepared them, so their settings must now be the run's, data.overwrite or not."""
    if cfg.data.seq_len > cfg.model.max_seq_len:
        raise ConfigError(
            f"data.seq_len={cfg.data.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}, the longest sequence "
            f"the model's positions are built for: raise model.max_seq_len={cfg.data.seq_len} (or more), or lower "
            f"data.seq_len to {cfg.model.max_seq_len} or less."
        )
    if not shards:
        return
    options = (cfg.data.get("cache_dir"), cfg.data.get("storage_options"))
    if cfg.data.get("mix"):  # corpora prepared one by one beforehand; the datamodule checks their tokenizers agree
        for entry in cfg.data.mix:
            data_dir = entry.get("dir") if isinstance(entry, Mapping) else None
            if data_dir is None:
                raise ConfigError(
                    f"data.mix entry {entry!r} needs a `dir` (prepared shards) and a `weight`, e.g. "
                    f"{{dir: data/web, weight: 0.7}}."
                )
            check_prepared_shards(data_dir, cfg.data.seq_len, *options)
    if is_remote(cfg.data.dir):  # training does not prepare into object storage: the shards must be there
        _check_vocabulary(cfg, check_prepared_shards(cfg.data.dir, cfg.data.seq_len, *options)[1])
        return
    data_dir = Path(cfg.data.dir)
    if not (data_dir / MANIFEST_NAME).is_file():
        if cfg.data.get("mix") or not cfg.data.get("auto_prepare", False):
            read_manifest(data_dir)  # refuses
        elif data_dir.is_dir() and any(data_dir.iterdir()):
            # Said by project.data.prepare too, but only once it has the sources, which it may first download.
            raise ConfigError(
                f"data.dir={data_dir} exists, is not empty and holds no {MANIFEST_NAME}, so it is not a prepared "
                "dataset and will not be prepared into; point data.dir at prepared shards, or a new or empty folder."
            )
        return
    # A mixture's corpora are prepared one by one with settings of their own, which data.* does not describe.
    manifest = {} if cfg.data.get("mix") else read_manifest(data_dir)
    differences = data_settings_differ(cfg, manifest) if manifest else []
    if differences:
        if cfg.data.get("overwrite") and cfg.data.get("auto_prepare") and not prepared:
            return  # training prepares them again from this run's settings, then checks again (prepared=True)
        raise ConfigError(_other_settings_refusal(cfg, manifest, differences))
    _check_vocabulary(cfg, check_prepared_shards(data_dir, cfg.data.seq_len)[1])


def refuse_shards_of_other_settings(cfg: DictConfig) -> None:
    """`python -m project.prepare`'s check, before it reads or fetches its sources: shards in data.dir prepared from
    other settings are refused as training refuses them, naming the experiment that sets data.dir and a folder of
    the user's own (data.overwrite=true replaces them, saying whose they were)."""
    data_dir = Path(str(cfg.data.dir))
    if cfg.data.get("overwrite") or cfg.data.get("mix") or is_remote(cfg.data.dir):
        return
    if (
        (data_dir / MANIFEST_NAME).is_file()
        and shards_present(data_dir)
        and (differences := data_settings_differ(cfg, manifest := read_manifest(data_dir)))
    ):
        raise ConfigError(_other_settings_refusal(cfg, manifest, differences, preparing=True))


def _other_settings_refusal(
    cfg: DictConfig, manifest: Mapping[str, Any], differences: list[str], preparing: bool = False
) -> str:
    """The paragraph for shards of other settings in data.dir: a folder of the user's own first, since data.dir may be
    shared (an experiment's, another corpus's); data.overwrite=true last, saying whose shards it would replace.
    `preparing`: said to python -m project.prepare, not to a run."""
    experiment = _experiment_setting_data_dir()
    set_by = f", which experiment={experiment} sets," if experiment else ""
    trained_on = f" experiment={experiment} trains on" if experiment else ""
    first = "" if preparing or cfg.data.get("auto_prepare") else " (python -m project.prepare with the same settings)"
    than = "these" if preparing else "this run's"
    on_them = "use them as they are" if preparing else "train on them as they are"
    when = "" if preparing else " (with data.auto_prepare=true, training does it first)"
    return (
        f"data.dir={cfg.data.dir}{set_by} holds shards prepared from other data settings than {than}: "
        f"{'; '.join(differences)}. Point data.dir at a folder of your own to prepare yours there{first} and keep "
        f"both, e.g. data.dir={_folder_of_your_own(cfg)}, or give the settings the shards were prepared from to "
        f"{on_them}. Only if those shards are yours to lose: data.overwrite=true prepares them again in place{when}, "
        f"replacing the shards{trained_on} ({shards_origin(manifest)})."
    )


def _experiment_setting_data_dir() -> str | None:
    """The chosen experiment (experiment=NAME) whose config sets this run's data.dir, where Hydra says which was
    chosen and data.dir is not on the command line; None otherwise."""
    from hydra.core.hydra_config import HydraConfig

    from project.config.command_line import CONF

    if not HydraConfig.initialized():
        return None
    hydra = HydraConfig.get()
    if any(str(override).lstrip("+~").split("=", 1)[0] == "data.dir" for override in hydra.overrides.task):
        return None
    name = hydra.runtime.choices.get("experiment")
    path = CONF / "experiment" / f"{name}.yaml"
    if not name or not path.is_file():
        return None
    data = OmegaConf.select(OmegaConf.load(path), "data")
    return str(name) if isinstance(data, Mapping) and "dir" in data else None


def _folder_of_your_own(cfg: DictConfig) -> Path:
    """A folder under paths.data_dir named for data.name (with the sequence length, or a number, where that is
    data.dir itself or holds other shards): new or empty, or holding shards of this run's settings."""
    data = cfg.data
    data_root = OmegaConf.select(cfg, "paths.data_dir")
    root = Path(str(data_root)) if data_root else Path(str(data.dir)).parent
    name = str(data.get("name") or Path(str(data.dir)).name)
    names = [name, f"{name}-seq{data.seq_len}", *(f"{name}-{n}" for n in range(2, 10))]
    for folder in (root / n for n in names):
        if folder.absolute() == Path(str(data.dir)).absolute():
            continue
        if not folder.exists() or folder.is_dir() and not any(folder.iterdir()):
            return folder
        try:
            if (folder / MANIFEST_NAME).is_file() and not data_settings_differ(cfg, read_manifest(folder)):
                return folder
        except ConfigError:  # a damaged manifest: not a folder to send anyone to
            continue
    return root / names[-1]


def data_settings_differ(cfg: DictConfig, manifest: Mapping[str, Any]) -> list[str]:
    """What of data.sources, data.text_field, data.tokenizer, data.vocab_size and data.seq_len differs from what
    the shards' manifest records they were prepared from, each as `setting: there, here`.

    Sources are compared on the first process only (a glob of a large corpus on every rank of a job would
    flood a shared file system), and only where the shards' own source files are on this machine: shards
    copied, or moved with their project, without their raw text are taken as they are. The tokenizer is
    compared by its file's content, the rest where the manifest records them (older shards are taken on trust).
    """
    data, differences = cfg.data, []
    if manifest.get("block_size") != data.seq_len + 1:
        differences.append(f"data.seq_len: {int(manifest['block_size']) - 1} there, {data.seq_len} here")
    there = {str(s.get("path")): s.get("bytes") for s in manifest.get("sources", []) if isinstance(s, Mapping)}
    if there and any(Path(path).exists() for path in there) and launch_rank(cfg.trainer.get("num_nodes", 1)) == 0:
        patterns = [data.sources] if isinstance(data.sources, str) else list(data.get("sources") or [])
        try:
            here = {str(path): path.stat().st_size for path in resolve_sources(patterns)}
        except NoSourcesError:
            here = {}
        if here.keys() != there.keys():
            differences.append(f"data.sources: {files_said(there)} there, {files_said(here)} here")
        elif changed := sorted(path for path in here if here[path] != there[path]):
            differences.append(
                f"data.sources: {changed[0]} held {there[changed[0]]} bytes when prepared, {here[changed[0]]} now"
            )
    settings = manifest.get("settings")
    if not isinstance(settings, Mapping):
        return differences
    if settings.get("text_field") != data.text_field:
        differences.append(f"data.text_field: {settings.get('text_field')} there, {data.text_field} here")
    given, recorded = data.get("tokenizer"), settings.get("tokenizer")
    if (
        (given is None) != (recorded is None)
        or given is not None
        and not _same_tokenizer(given, settings.get("tokenizer_sha256"))
    ):
        differences.append(f"tokenizer: {_tokenizer_said(recorded)} there, {_tokenizer_said(given)} here")
    elif given is None and settings.get("vocab_size") != data.vocab_size:
        differences.append(f"data.vocab_size: {settings.get('vocab_size')} there, {data.vocab_size} here")
    return differences


def _same_tokenizer(given: str, sha256: str | None) -> bool:
    from project.data.tokenizer import (
        file_sha256,
        tokenizer_file,
    )  # tokenizers and sentencepiece: only when one is given

    path = tokenizer_file(given)
    return path.is_file() and file_sha256(path) == sha256


def _tokenizer_said(tokenizer: str | None) -> str:
    return f"data.tokenizer={tokenizer}" if tokenizer else "a BPE trained on the sources (data.tokenizer=null)"


def _check_vocabulary(cfg: DictConfig, manifest: Mapping[str, Any]) -> None:
    tokenizer_vocab = int(manifest["tokenizer"]["vocab_size"])
    if cfg.model.vocab_size < tokenizer_vocab and cfg.get("init_from") is not None:
        raise ConfigError(
            f"the shards in data.dir={cfg.data.dir} were made with a tokenizer of {tokenizer_vocab} tokens, more than "
            f"the {cfg.model.vocab_size} of the model in init_from={cfg.init_from}: prepare your text with the "
            f"folder's own tokenizer (python -m project.prepare data.tokenizer={cfg.init_from} ...) and train on those "
            "shards."
        )
    if cfg.model.vocab_size < tokenizer_vocab:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {tokenizer_vocab} "
            f"(shards in {cfg.data.dir}): set model.vocab_size={tokenizer_vocab} or more."
        )
