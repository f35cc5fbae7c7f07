"""Downstream tasks' files (project.data.tasks): what the loop cannot honour is refused before training, naming the
setting; the scoring against lm-evaluation-harness itself is in tests/test_evaluation.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from downstream_tasks import CHOICE, write_tasks

from project.data.tasks import encode_request, encode_requests, load_task
from project.runtime.errors import ConfigError


def test_the_test_tasks_read_as_the_harness_builds_their_requests(tmp_path):
    write_tasks(tmp_path)
    task = load_task(tmp_path / f"{CHOICE}.yaml", "eval.tasks[0]")
    first = json.loads((tmp_path / f"{CHOICE}.jsonl").read_text().splitlines()[0])
    context = f"Question: {first['question']}\nAnswer:"
    assert task.documents[0].requests == tuple((context, " " + choice) for choice in first["choices"])
    assert task.documents[0].gold == (first["answer"],)
    assert task.documents[0].choice_lengths == tuple(len(choice) for choice in first["choices"])


def test_a_contexts_trailing_spaces_move_to_the_continuation():
    def encode(text):
        return [ord(c) for c in text]

    assert encode_request(encode, 0, "to  ", "be") == ([0, *encode("to  be")], 1 + len("to"))
    assert encode_request(encode, 0, "", " be") == ([0, *encode(" be")], 1)


def base_task(data) -> dict:
    return {
        "task": "t", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{q}}", "doc_to_choice": "{{c}}",
        "doc_to_target": "a",
    }  # fmt: skip


@pytest.mark.parametrize(
    "change, message",
    [
        ({"dataset_path": "allenai/ai2_arc"}, "reads dataset_path='allenai/ai2_arc'; the loop reads local files only"),
        ({"output_type": "generate_until"}, "output_type=generate_until; the loop scores multiple_choice"),
        ({"num_fewshot": 5}, "sets num_fewshot=5: the loop is zero-shot"),
        ({"process_docs": "x"}, "sets process_docs, which the loop does not do"),
        (
            {"metric_list": [{"metric": "f1"}]},
            r"asks for metric\(s\) \['f1'\]; the loop computes \['acc', 'acc_norm'\]",
        ),
        ({"test_split": "validation"}, "names no data file for its split 'validation'"),
        ({"doc_to_target": "{{wrong}}"}, "document 0: 'wrong' is undefined"),
        ({"doc_to_target": "3"}, r"document 0: the answer 3 is not one of the 2 choices"),
        ({"dataset_kwargs": {"data_files": {"test": "/nowhere.jsonl"}}}, "data file /nowhere.jsonl does not exist"),
        ({"output_type": None}, "output_type=generate_until"),  # the harness's default
        ({"gen_prefix": "Answer:"}, "sets gen_prefix, which the loop does not do"),
        ({"doc_to_choice": ["yes", ""]}, r"document 0: doc_to_choice gives \['yes', ''\], not a list of texts"),
        ({"dataset_kwargs": ["x"]}, "dataset_kwargs must be a mapping"),
        ({"dataset_kwargs": {"data_files": {"test": [1]}}}, "data files for split 'test' must be a path or a list"),
        ({"num_fewshot": "five"}, "has a setting of a shape the harness does not take"),
        ({"metric_list": "acc"}, "metric_list must be a list"),
        ({"doc_to_text": "{{a}}"}, r"document 0: doc_to_text gives '0': several contexts"),
    ],
)
def test_what_the_loop_cannot_honour_is_refused_naming_the_setting(tmp_path, change, message):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"q": "Is it?", "c": ["yes", "no"], "a": 0}) + "\n")
    path = tmp_path / "t.yaml"
    path.write_text(json.dumps({**base_task(data), **change}))  # JSON is YAML
    with pytest.raises(ConfigError, match=r"eval.tasks\[2\].*" + message):
        load_task(path, "eval.tasks[2]")


@pytest.mark.parametrize("layout", ["lines", "array"])
def test_a_broken_json_line_in_a_task_file_is_named_by_its_line_and_column(tmp_path, layout):
    good = json.dumps({"q": "Is it?", "c": ["yes", "no"], "a": 0})
    # A line separator (U+2028) inside a string is text, not a line's end: JSON lines end at a newline only.
    separated = json.dumps({"q": "Is\u2028it?", "c": ["yes", "no"], "a": 0}, ensure_ascii=False)
    broken = '{"q": "Is it?", "c": ["yes" "no"], "a": 0}'
    column = broken.index('"no"') + 1  # where the missing comma was due
    data = tmp_path / "d.jsonl"
    if layout == "lines":
        data.write_text(f"{good}\n\n{separated}\n{broken}\n{good}\n")  # a blank line is no document, still counted
        line = 4
    else:
        data.write_text(f"[\n{good},\n{broken}\n]\n")
        line = 3
    path = tmp_path / "t.yaml"
    path.write_text(json.dumps(base_task(data)))
    with pytest.raises(
        ConfigError, match=rf"d\.jsonl:{line}:{column} is not .*line {line}, column {column}: Expecting"
    ):
        load_task(path, "eval.tasks[0]")


def test_a_continuation_a_row_cannot_score_is_refused(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"q": "Is it?", "c": ["yes", "no " * 20], "a": 0}) + "\n")
    path = tmp_path / "t.yaml"
    path.write_text(json.dumps(base_task(data)))
    task = load_task(path, "eval.tasks[0]")

    def encode(text):
        return [ord(c) for c in text]

    with pytest.raises(ConfigError, match=r"eval.tasks\[0\]: task 't', request 1 .* its continuation is 61 tokens"):
        encode_requests(task, encode, 0, 32, "eval.tasks[0]")
    # a long context is cut from the left, the continuation whole
    [(tokens, scored_from), _] = encode_requests(task, encode, 0, 61, "eval.tasks[0]")
    assert tokens == [0, *encode("Is it? yes")] and scored_from == 7


def test_python_code_in_a_task_and_a_missing_file_are_refused(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("task: t\nprocess_docs: !function utils.process_docs\n")
    refused = r"eval.tasks\[0\]=.*, line 2: Python code in a task \(!function\) cannot run"
    with pytest.raises(ConfigError, match=refused):
        load_task(path, "eval.tasks[0]")
    with pytest.raises(ConfigError, match=r"eval.tasks\[0\]=.*missing.yaml: no such task file"):
        load_task(tmp_path / "missing.yaml", "eval.tasks[0]")
    path.write_text("include: t.yaml\n")
    with pytest.raises(ConfigError, match=r"eval.tasks\[0\]: .*t.yaml includes itself"):
        load_task(path, "eval.tasks[0]")


def test_an_included_file_gives_the_defaults(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"q": "Is it?", "c": ["yes", "no"], "a": 1}) + "\n")
    shared = {k: v for k, v in base_task(data).items() if k != "task"}
    (tmp_path / "_default.yaml").write_text(json.dumps(shared))
    (tmp_path / "t.yaml").write_text("include: _default.yaml\ntask: mine\ntarget_delimiter: ': '\n")
    task = load_task(tmp_path / "t.yaml", "eval.tasks[0]")
    assert task.name == "mine" and task.requests == [("Is it?", ": yes"), ("Is it?", ": no")]
    assert task.documents[0].gold == (1,)


HARNESS_TASKS = Path(sys.prefix) / "hf-reference" / "lm_eval" / "tasks"  # lm_eval beside the environment (Makefile)


def test_the_harnesss_own_definitions_read_once_their_data_are_local(tmp_path):
    """ARC-Challenge (which includes ARC-Easy's file: nested fields, the answer's index by a template) and PIQA (a
    list built by a template, the validation split), their YAML files as the harness ships them, pointed at local
    JSON lines."""
    if not HARNESS_TASKS.is_dir():
        pytest.skip("lm_eval is not installed beside the environment (make install puts it there)")
    arc = {"question": "Which is a gas?", "choices": {"text": ["ice", "steam", "rock"], "label": ["A", "B", "C"]},
           "answerKey": "B"}  # fmt: skip
    piqa = {"goal": "To dry a towel,", "sol1": "hang it in the sun.", "sol2": "put it in the sea.", "label": 0}
    cases = {"arc_challenge": ("arc/arc_challenge.yaml", "test", arc), "piqa": ("piqa/piqa.yaml", "validation", piqa)}
    for name, (definition, split, doc) in cases.items():
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(doc) + "\n")
        local = {"include": str(HARNESS_TASKS / definition), "dataset_path": "json",
                 "dataset_kwargs": {"data_files": {split: str(tmp_path / f"{name}.jsonl")}}}  # fmt: skip
        (tmp_path / f"{name}.yaml").write_text(json.dumps(local))
    arc_task = load_task(tmp_path / "arc_challenge.yaml", "eval.tasks[0]")
    assert arc_task.name == "arc_challenge" and arc_task.metrics == ("acc", "acc_norm")
    assert arc_task.requests == [("Question: Which is a gas?\nAnswer:", f" {c}") for c in arc["choices"]["text"]]
    assert arc_task.documents[0].gold == (1,)
    piqa_task = load_task(tmp_path / "piqa.yaml", "eval.tasks[1]")
    assert piqa_task.requests == [("Question: To dry a towel,\nAnswer:", f" {piqa[s]}") for s in ("sol1", "sol2")]
    assert piqa_task.documents[0].gold == (0,)
