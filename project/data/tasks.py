"""Downstream tasks scored inside training (`eval.tasks`), read from lm-evaluation-harness's own task format: a task
YAML whose data are local JSON files (`dataset_path: json`, `dataset_kwargs.data_files`), so that a user's tasks and
the harness's definitions (their data saved as JSON lines) both work, and nothing is downloaded.

What the harness (0.4) does for a zero-shot task is done here the same way, so that the scores equal its scores of
the exported checkpoint: each document's context is the description and `doc_to_text`, each request a pair (context,
continuation): for `multiple_choice`, `target_delimiter` + each of `doc_to_choice`; for `loglikelihood`
(LAMBADA-style next-word prediction), `doc_to_target`. The fields are Jinja templates over a document's fields, or a
field's name, as the harness reads them. A request is encoded as its HF model does: the context's trailing spaces
moved to the continuation, context and continuation encoded as one text, the continuation's tokens those past the
context's; every row starts with the end-of-text token (a document's start, as in the shards and the export).

Metrics, as the harness computes them: multiple choice `acc` (the choice of highest log-likelihood is the answer)
and `acc_norm` (log-likelihood divided by the choice's length in characters); next word `acc` (the continuation is
the model's greedy one) and `perplexity` (exp of the mean negative log-likelihood of the documents).
"""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.pytorch.utilities import rank_zero_warn

from project.model.loss import IGNORED
from project.runtime.errors import ConfigError

KINDS = {"multiple_choice": ("acc", "acc_norm"), "loglikelihood": ("perplexity", "acc")}


@dataclass(frozen=True)
class Document:
    """One document's requests (context, continuation), and for multiple choice its answers' indices and each
    choice's length in characters."""

    requests: tuple[tuple[str, str], ...]
    gold: tuple[int, ...] = ()
    choice_lengths: tuple[int, ...] = ()


@dataclass(frozen=True)
class Task:
    name: str
    kind: str  # one of KINDS
    metrics: tuple[str, ...]
    documents: tuple[Document, ...]

    @property
    def requests(self) -> list[tuple[str, str]]:
        return [request for document in self.documents for request in document.requests]

    def scores(self, rows: Sequence[Sequence[float]]) -> dict[str, float]:
        """The task's metrics from its requests' rows (log-likelihood, targets, targets ranked first), in order."""
        results: dict[str, list[float]] = {metric: [] for metric in self.metrics}
        i = 0
        for document in self.documents:
            own = rows[i : i + len(document.requests)]
            i += len(document.requests)
            lls = [row[0] for row in own]
            if self.kind == "multiple_choice":
                per_char = [ll / length for ll, length in zip(lls, document.choice_lengths)]
                found = {"acc": _first_max(lls), "acc_norm": _first_max(per_char)}
                for metric in self.metrics:
                    results[metric].append(float(found[metric] in document.gold))
            else:
                [(ll, targets, first)] = own
                found_ll = {"perplexity": ll, "acc": float(first == targets)}
                for metric in self.metrics:
                    results[metric].append(found_ll[metric])
        means = {metric: sum(values) / len(values) for metric, values in results.items()}
        if "perplexity" in means:
            means["perplexity"] = math.exp(-means["perplexity"])
        return means


def _first_max(values: Sequence[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))  # the first of equal ones, as numpy's argmax


def encode_request(
    encode: Callable[[str], list[int]], eos_id: int, context: str, continuation: str
) -> tuple[list[int], int]:
    """(tokens, the index of the first continuation token) of a request, as the harness's HF model encodes it for
    our export: the end-of-text token first, the context's trailing spaces moved to the continuation."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    if not context:
        return [eos_id, *encode(continuation)], 1
    return [eos_id, *encode(context + continuation)], 1 + len(encode(context))


def load_task(path: str | Path, where: str, limit: int | None = None) -> Task:
    """The task a harness YAML describes (with the files it `include`s), its documents read and rendered: any
    setting the loop cannot honour is refused naming `where` (the config key) and the fix."""
    config = _read_yaml(Path(path), where, set())
    name = str(config.get("task") or Path(path).stem)
    try:
        return _task(config, name, where, limit)
    except ConfigError:
        raise
    except (TypeError, ValueError, AttributeError) as error:  # a setting of the wrong shape: name it, not a traceback
        raise ConfigError(f"{where}: task {name!r} ({path}) has a setting of a shape the harness does not take: "
                          f"{error}") from None  # fmt: skip


def _task(config: Mapping[str, Any], name: str, where: str, limit: int | None) -> Task:
    kind = config.get("output_type") or "generate_until"  # the harness's default
    if not isinstance(kind, str) or kind not in KINDS:
        raise ConfigError(
            f"{where}: task {name!r} has output_type={kind}; the loop scores multiple_choice and loglikelihood "
            "tasks (generation is left to lm-evaluation-harness on an export; a text's perplexity is eval.sets)."
        )
    for key in ("process_docs", "process_results", "doc_to_image", "doc_to_audio", "gen_prefix", "use_prompt"):
        if config.get(key) is not None:
            raise ConfigError(
                f"{where}: task {name!r} sets {key}, which the loop does not do: write the documents' fields as the "
                "task needs them into its JSON file, and the prompt as Jinja templates over them."
            )
    if int(config.get("num_fewshot") or 0) > 0:
        raise ConfigError(f"{where}: task {name!r} sets num_fewshot={config['num_fewshot']}: the loop is zero-shot.")
    metrics = _metrics(config, kind, name, where)
    docs = _read_documents(config, name, where)[:limit]
    documents = tuple(_document(config, kind, doc, name, where, i) for i, doc in enumerate(docs))
    if not documents:
        raise ConfigError(f"{where}: task {name!r} has no documents in its data files.")
    return Task(name, kind, metrics, documents)


def _read_yaml(path: Path, where: str, read: set[Path]) -> dict[str, Any]:
    if path.resolve() in read:
        raise ConfigError(f"{where}: {path} includes itself (through `include`).")
    read.add(path.resolve())
    if not path.is_file():
        raise ConfigError(f"{where}={path}: no such task file (a task YAML of lm-evaluation-harness's format).")
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.constructor.ConstructorError as error:
        raise ConfigError(
            f"{where}={path}, line {error.problem_mark.line + 1 if error.problem_mark else '?'}: Python code in a task "
            "(!function) cannot run in the loop; write the documents' fields as the task needs them into its JSON "
            "file, and the prompt as Jinja templates over them."
        ) from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{where}={path} is not valid YAML: {error}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{where}={path} is not a task (a YAML mapping with task, dataset_path, output_type, ...).")
    if "include" in config:  # the harness's shared defaults: the including file's own keys win
        return {**_read_yaml(path.parent / str(config.pop("include")), where, read), **config}
    return config


def _metrics(config: Mapping[str, Any], kind: str, name: str, where: str) -> tuple[str, ...]:
    entries = config.get("metric_list") or []
    if not isinstance(entries, list):
        raise ConfigError(f"{where}: task {name!r}'s metric_list must be a list of {{metric: NAME}} entries.")
    listed = [str(m.get("metric") if isinstance(m, Mapping) else m) for m in entries]
    unknown = [m for m in listed if m not in KINDS[kind]]
    if unknown:
        raise ConfigError(
            f"{where}: task {name!r} asks for metric(s) {unknown}; the loop computes {list(KINDS[kind])} for "
            f"{kind} tasks: list those in metric_list, or leave it out for both."
        )
    return tuple(listed) or KINDS[kind]


def _read_documents(config: Mapping[str, Any], name: str, where: str) -> list[dict[str, Any]]:
    if config.get("dataset_path") != "json":
        raise ConfigError(
            f"{where}: task {name!r} reads dataset_path={config.get('dataset_path')!r}; the loop reads local files "
            "only (nothing is downloaded): save the split as JSON lines and set dataset_path: json and "
            "dataset_kwargs: {data_files: {test: path/to/file.jsonl}} with test_split: test."
        )
    kwargs = config.get("dataset_kwargs") or {}
    if not isinstance(kwargs, Mapping):
        raise ConfigError(f"{where}: task {name!r}'s dataset_kwargs must be a mapping (data_files: {{test: FILE}}).")
    files = kwargs.get("data_files") or config.get("data_files")
    split = config.get("test_split") or config.get("validation_split")
    if isinstance(files, Mapping):
        files = files.get(split) if split else None
    elif split not in (None, "train"):  # the datasets library names a split given without a name "train"
        files = None
    if not files:
        raise ConfigError(
            f"{where}: task {name!r} names no data file for its split {split!r}: set dataset_kwargs.data_files."
            f"{split or 'test'} to a JSON lines file (and test_split: {split or 'test'})."
        )
    files = [files] if isinstance(files, str) else files
    if not isinstance(files, list) or not all(isinstance(file, str) for file in files):
        raise ConfigError(f"{where}: task {name!r}'s data files for split {split!r} must be a path or a list of them.")
    docs: list[dict[str, Any]] = []
    for file in files:
        docs.extend(_json_documents(Path(file), name, where))
    return docs


def _json_documents(path: Path, name: str, where: str) -> list[dict[str, Any]]:
    if not path.is_file():
        raise ConfigError(f"{where}: task {name!r}'s data file {path} does not exist (relative paths: to the cwd).")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"{where}: task {name!r}'s data file {path} is not UTF-8 text: {error}") from None
    if text.lstrip().startswith("["):  # one JSON array: json's own line and column are the file's
        try:
            docs = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(
                f"{where}: task {name!r}'s data file {path}:{error.lineno}:{error.colno} is not valid JSON "
                f"(line {error.lineno}, column {error.colno}: {error.msg})."
            ) from None
    else:
        docs = [_json_line(line, path, number, name, where) for number, line in enumerate(text.split("\n"), 1)]
        docs = [doc for doc in docs if doc is not None]
    if not all(isinstance(doc, dict) for doc in docs):
        raise ConfigError(f"{where}: task {name!r}'s data file {path} must hold one JSON object per document.")
    return docs


def _json_line(line: str, path: Path, number: int, name: str, where: str) -> Any:
    """One line of a JSON lines file (None for a blank one); a broken line is named by the file's line and column,
    where json alone would count them within the line."""
    if not line.strip():
        return None
    try:
        return json.loads(line)
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"{where}: task {name!r}'s data file {path}:{number}:{error.colno} is not JSON lines: line {number}, "
            f"column {error.colno}: {error.msg}. Each line holds one JSON object."
        ) from None


def _document(config: Mapping[str, Any], kind: str, doc: dict, name: str, where: str, index: int) -> Document:
    try:
        context = _render(config.get("description") or "", doc) + _text(
            config.get("doc_to_text"), doc, kind == "multiple_choice"
        )
        target = _target(config.get("doc_to_target"), doc, kind)
        if kind == "loglikelihood":
            if not isinstance(target, str) or not target:
                raise ValueError(f"doc_to_target gives {target!r}, not the continuation's text")
            return Document(((context, target),))
        choices = _choices(config.get("doc_to_choice"), doc)
        delimiter = str(config.get("target_delimiter", " "))
        golds = target if isinstance(target, list) else [target]
        gold = tuple(g if isinstance(g, int) else choices.index(g) for g in golds)
        if any(not 0 <= g < len(choices) for g in gold):
            raise ValueError(f"the answer {target!r} is not one of the {len(choices)} choices")
    except Exception as error:  # a template's or a field's fault: name the document
        raise ConfigError(f"{where}: task {name!r}, document {index}: {error}") from None
    return Document(tuple((context, delimiter + c) for c in choices), gold, tuple(len(c) for c in choices))


def _render(template: str, doc: Mapping[str, Any]) -> str:
    from jinja2 import BaseLoader, Environment, StrictUndefined

    # As the harness renders its fields: a missing field is an error, a trailing newline kept.
    environment = Environment(loader=BaseLoader(), undefined=StrictUndefined, keep_trailing_newline=True)
    return environment.from_string(template).render(**doc)


def _text(field: Any, doc: Mapping[str, Any], choices: bool) -> str:
    if not isinstance(field, str):
        raise ValueError(f"doc_to_text={field!r} must be a template or a field's name")
    text = doc[field] if field in doc else _render(field, doc)
    # With choices, the harness reads a template's digits as the index of one of several contexts.
    if not isinstance(text, str) or (choices and text.isdigit() and field not in doc):
        raise ValueError(f"doc_to_text gives {text!r}: several contexts for one answer are not supported")
    return text


def _target(field: Any, doc: Mapping[str, Any], kind: str) -> Any:
    if isinstance(field, int | list):
        return field
    if not isinstance(field, str):
        raise ValueError(f"doc_to_target={field!r} must be a template, a field's name, an index or a list")
    if field in doc:
        return doc[field]
    text = _render(field, doc)
    if text.isdigit() and kind == "multiple_choice":
        return int(text)
    if len(text) >= 2 and text[0] == "[" and text[-1] == "]":
        try:
            return ast.literal_eval(text)
        except (SyntaxError, ValueError):
            return text
    return text


def _choices(field: Any, doc: Mapping[str, Any]) -> list[str]:
    if isinstance(field, list):
        choices = field
    elif isinstance(field, Mapping):
        choices = list(field.values())
    elif isinstance(field, str):
        choices = doc[field] if field in doc else ast.literal_eval(_render(field, doc))
    else:
        raise ValueError(f"doc_to_choice={field!r} must be a template, a field's name or a list")
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"doc_to_choice gives {choices!r}, not a list of texts (none empty)")
    return choices


def encode_requests(
    task: Task, encode: Callable[[str], list[int]], eos_id: int, seq_len: int, where: str
) -> list[tuple[list[int], int]]:
    """Each request's tokens (`encode_request`), cut from the left to seq_len + 1 as the harness cuts at its model's
    length (`max_length`), and the index of its first continuation token. A continuation of no token, or of more
    than seq_len, cannot be scored (the harness asserts both)."""
    encoded, cut = [], 0
    for i, (context, continuation) in enumerate(task.requests):
        tokens, scored_from = encode_request(encode, eos_id, context, continuation)
        if not 0 < len(tokens) - scored_from <= seq_len:
            raise ConfigError(
                f"{where}: task {task.name!r}, request {i} ({continuation[:40]!r}): its continuation is "
                f"{len(tokens) - scored_from} tokens, which a row of data.seq_len={seq_len} cannot score."
            )
        excess = max(0, len(tokens) - (seq_len + 1))
        cut += excess > 0
        encoded.append((tokens[excess:], max(1, scored_from - excess)))
    if cut:
        rank_zero_warn(
            f"{where}: {cut} of task {task.name!r}'s {len(encoded)} requests are longer than data.seq_len + 1 = "
            f"{seq_len + 1} tokens: their contexts are cut from the left (lm-evaluation-harness does the same with "
            f"max_length={seq_len})."
        )
    return encoded


def request_rows(
    requests: Sequence[tuple[list[int], int]], seq_len: int, eos_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) [len(requests), seq_len] of encoded requests, one row each: the targets IGNORED but the
    continuation's; a request of no tokens ([], 1) is a padding row, IGNORED throughout."""
    inputs = torch.full((len(requests), seq_len), eos_id, dtype=torch.long)
    targets = torch.full((len(requests), seq_len), IGNORED, dtype=torch.long)
    for i, (tokens, scored_from) in enumerate(requests):
        if tokens:
            inputs[i, : len(tokens) - 1] = torch.tensor(tokens[:-1])
            targets[i, scored_from - 1 : len(tokens) - 1] = torch.tensor(tokens[scored_from:])
    return inputs, targets
