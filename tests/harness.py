"""lm-evaluation-harness run as its own process, its command line as a user types it, on an export: the reference
that downstream evaluation during training is compared with, sample by sample.

The harness and transformers lie beside the environment (Makefile): lm_eval, transformers and accelerate in
$(VENV)/hf-reference, and the libraries only the harness's command line needs (datasets, sacrebleu, pytablewriter
and what they depend on) in $(VENV)/lm-eval-deps. The process gets both APPENDED to sys.path, after the
environment's site-packages, so that the environment's own numpy, huggingface_hub, ... are the ones imported and the
copies pip put beside them are never used: a small bootstrap (`python -P -c`), not PYTHONPATH, whose entries would
come before site-packages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HF_REFERENCE = Path(sys.prefix) / "hf-reference"
LM_EVAL_DEPS = Path(sys.prefix) / "lm-eval-deps"
# argv[1:] are the harness's arguments; run_module puts lm_eval/__main__.py in argv[0] ('-c'), as `python -m` does.
BOOTSTRAP = (
    "import runpy, sys; sys.path += [{hf!r}, {deps!r}]; "
    "runpy.run_module('lm_eval', run_name='__main__', alter_sys=True)"
)


def harness_command(
    export_dir: Path, task_dir: Path, tasks: list[str], output_path: Path, max_length: int | None = None
) -> list[str]:
    """`python -m lm_eval run ...` with the two folders appended to sys.path: the model `hf` on the CPU in float32,
    one request at a time, every sample logged under output_path; `max_length`: the tokens a request is cut to from
    the left (the harness's model argument; by default the model's length)."""
    export = str(Path(export_dir).resolve())
    assert "," not in export and "=" not in export, f"the harness's --model_args cannot hold the path {export!r}"
    bootstrap = BOOTSTRAP.format(hf=str(HF_REFERENCE), deps=str(LM_EVAL_DEPS))
    return [
        sys.executable, "-P", "-c", bootstrap,
        "run", "--model", "hf", "--model_args", f"pretrained={export}", "dtype=float32",
        *([f"max_length={max_length}"] if max_length else []),
        "--tasks", ",".join(tasks), "--include_path", str(Path(task_dir).resolve()),
        "--device", "cpu", "--batch_size", "1", "--log_samples", "--output_path", str(output_path),
    ]  # fmt: skip


def harness_environment(out_dir: Path) -> dict[str, str]:
    """Offline, one thread, and every cache (the Hub's, datasets') inside out_dir."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_")) and key not in ("PYTHONPATH", "PYTHONHOME")
    }
    cache = out_dir / "cache"
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HOME=str(cache / "huggingface"),
        HF_DATASETS_CACHE=str(cache / "datasets"),
        XDG_CACHE_HOME=str(cache),
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_DISABLE_TELEMETRY="1",
    )
    return env


def _sample(raw: dict) -> dict:
    """One logged document: its requests' (context, continuation), log-likelihoods and greedy flags, and the
    metrics the harness computed from them. The log file holds each request's arguments as
    {"gen_args_I": {"arg_0": context, "arg_1": continuation}} and its responses as strings (of a float, of a bool)."""
    in_order = sorted((int(key.removeprefix("gen_args_")), args) for key, args in raw["arguments"].items())
    arguments = [tuple(args[f"arg_{j}"] for j in range(len(args))) for _, args in in_order]
    responses = [(float(ll), {"True": True, "False": False}[greedy]) for ll, greedy in raw["filtered_resps"]]
    return {
        "doc_id": raw["doc_id"],
        "doc": raw["doc"],
        "target": raw["target"],
        "arguments": arguments,
        "loglikelihoods": [ll for ll, _ in responses],
        "is_greedy": [greedy for _, greedy in responses],
        "metrics": {name: raw[name] for name in raw["metrics"]},
    }


def harness_samples(
    export_dir: Path | str, task_dir: Path | str, tasks: list[str], out_dir: Path | str, max_length: int | None = None
) -> dict[str, list[dict]]:
    """Run the harness's command line on an export and local tasks; return each task's samples sorted by doc_id.

    Each sample: doc_id, doc, target (a string, as the harness logs it), arguments (one (context, continuation)
    per request: one per choice of a multiple choice), loglikelihoods and is_greedy (per request, from the
    harness's filtered responses), and metrics (the per-sample values of the task's metric_list: acc, acc_norm,
    perplexity, ...). Everything it writes stays in out_dir.
    """
    missing = [str(folder) for folder in (HF_REFERENCE, LM_EVAL_DEPS) if not folder.is_dir()]
    assert not missing, f"lm-evaluation-harness needs {missing}: `make install` puts them there"
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    output_path = out_dir / "results"
    command = harness_command(Path(export_dir), Path(task_dir), tasks, output_path, max_length)
    result = subprocess.run(command, cwd=out_dir, env=harness_environment(out_dir), capture_output=True, text=True)
    assert result.returncode == 0, (
        f"lm-evaluation-harness exited with {result.returncode}: {' '.join(command)}\n"
        f"--- stderr ---\n{result.stderr[-8000:]}\n--- stdout ---\n{result.stdout[-2000:]}"
    )
    samples = {}
    for task in tasks:
        files = sorted(output_path.glob(f"*/samples_{task}_*.jsonl"))
        assert len(files) == 1, (
            f"expected one samples file of {task} under {output_path}, found {files}\n{result.stderr[-4000:]}"
        )
        raw = [json.loads(line) for line in files[0].read_text().splitlines() if line.strip()]
        samples[task] = sorted((_sample(row) for row in raw), key=lambda sample: sample["doc_id"])
    return samples
