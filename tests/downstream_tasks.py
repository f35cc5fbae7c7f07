"""Two small lm-evaluation-harness tasks written into a folder (for `--include_path`), with their data: nothing is
downloaded. Their shapes are those of the harness's own tasks: a multiple choice as ARC's or PIQA's (acc, acc_norm),
and a next word as lambada_openai.yaml (perplexity and acc of the last word after the rest of the text).

What lm-eval 0.4.13 asks the model for them (lm_eval/api/task.py, lm_eval/api/model.py):
- tiny_choice: one loglikelihood request per choice, context "Question: ...\\nAnswer:" and continuation
  " " + choice (target_delimiter, a space by default). acc: the choice of the highest log-likelihood is the answer;
  acc_norm: the same with each log-likelihood divided by len(choice) in characters, the delimiter not counted.
- tiny_next_word: one loglikelihood request, context the text without its last word, continuation " " + that
  word (target_delimiter ""). perplexity: the log-likelihood per sample (the aggregation is exp(-mean)); acc: 1 when
  every continuation token is the model's argmax (is_greedy).
A text whose last two words are separated by two spaces gives a context that ends with a space: the harness moves
it to the continuation before encoding. A question that ends with a space keeps it before "\\nAnswer:".
"""

from __future__ import annotations

import json
from pathlib import Path

CHOICE = "tiny_choice"
NEXT_WORD = "tiny_next_word"

# (question, choices, index of the answer): choices of different lengths, so that acc and acc_norm can differ.
QUESTIONS = [
    ("What do you use to cut bread?", ["a knife", "a spoon", "a very long piece of string"], 0),
    ("Where does a fish live?", ["in water", "in the desert sand", "on a hill"], 0),
    ("What color is the sky on a clear day? ", ["blue", "bright green with stripes", "red"], 0),
    ("How many legs does a cat have?", ["four", "two", "eleven and a half"], 0),
    ("What falls from clouds when it rains?", ["water", "small stones of many colors", "milk"], 0),
    ("Which animal says moo?", ["a cow", "a dog", "a small yellow bird"], 0),
    ("What do people do at night?", ["they sleep", "they fly to the moon and back", "they swim"], 0),
    ("Which is the largest?", ["a mouse", "an elephant", "an ant"], 1),
    ("What do you drink when you are thirsty? ", ["sand", "a glass of cold water", "paper"], 1),
    ("What comes after Monday?", ["Sunday", "Friday", "Tuesday"], 2),
    ("Which season is the coldest?", ["summer", "spring", "winter"], 2),
    ("What do bees make?", ["honey", "bread and butter in the morning", "glass"], 0),
]

# The last word is the target; "  " before it leaves a trailing space on the context.
TEXTS = [
    "The cat sat on the warm mat and fell asleep",
    "She opened the door and walked into the small kitchen",
    "After the long rain the children ran outside to play",
    "He wrote a letter to his old friend from school",
    "The sun rose over the hills and the birds began to  sing",
    "We took the train to the city and visited the museum",
    "The baker put the bread in the oven early in the morning",
    "At the end of the day the tired farmer went back  home",
    "The little boat moved slowly across the quiet lake",
    "They planted trees in the garden behind the house",
    "The teacher asked the class to open their books",
    "When the music started everyone in the room began to dance",
    "The old dog slept by the fire all through the winter night",  # 13: an odd count leaves two replicas a padding row
]


def _choice_yaml(data: Path) -> str:
    return f"""task: {CHOICE}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(str(data))}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def _next_word_yaml(data: Path) -> str:
    return f"""task: {NEXT_WORD}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(str(data))}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' '+text.split(' ')[-1]}}}}"
target_delimiter: ""
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def write_tasks(folder: Path | str) -> list[str]:
    """Write both tasks (a YAML and a JSONL each, data paths absolute) into `folder`; return their task names."""
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    choice_data, next_word_data = folder / f"{CHOICE}.jsonl", folder / f"{NEXT_WORD}.jsonl"
    _write_jsonl(choice_data, [{"question": q, "choices": c, "answer": a} for q, c, a in QUESTIONS])
    _write_jsonl(next_word_data, [{"text": text} for text in TEXTS])
    (folder / f"{CHOICE}.yaml").write_text(_choice_yaml(choice_data))
    (folder / f"{NEXT_WORD}.yaml").write_text(_next_word_yaml(next_word_data))
    return [CHOICE, NEXT_WORD]
