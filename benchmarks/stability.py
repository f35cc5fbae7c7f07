"""What the loss-spike actions do to real runs: `python -m benchmarks.stability
[corpora=shakespeare,prose,poisoned] [actions=log,skip,rollback] [steps=300] [seeds=2] [out=experiments/benchmarks]`

Each corpus trains under each action of conf/stability with the group's own defaults and nothing else changed, and
the runs are set side by side: final validation loss, and that of the clean text's whole validation split (against
`log`'s), the spikes each action acted on, the
gradient-norm excursions it only logged, the rollbacks and whether a run stopped. The corpora:
- shakespeare: `make train`'s experiment as it is (the 4.0M-parameter small4m, 256-token sequences), `steps` steps;
- prose: the debug model (0.1M parameters, 64-token sequences, BPE 512) on English prose this machine has, Python's
  own documentation (`pydoc_data.topics`, about 200 documents);
- poisoned: the same prose with documents of random printable characters among its documents, about 5% of the
  text, each kept together in the data order as a corrupt file's would be (chunks of 20 KB, data.shuffle_window=1,
  the data settings alone changed): runs of batches the model cannot predict, where the loss spikes.
With `seeds` (2) the log runs of the prose corpora are repeated from other initial weights (seed=1235, ...): the
spread a difference between actions is set against (shakespeare's are left out for time). Writes new files
<date>-<host>-stability.{json,md}; docs/stability.md gives what they showed.
"""

from __future__ import annotations

import csv
import json
import os
import random
import string
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from benchmarks.runner import (
    ROOT,
    Benchmark,
    main,
    out_folder,
)
from project.runtime.arguments import parse_key_values
from project.runtime.errors import ConfigError

DEFAULTS = {
    "corpora": "shakespeare,prose,poisoned",
    "actions": "log,skip,rollback",
    "steps": "300",
    "seeds": "2",
    "out": "experiments/benchmarks",
}
CORPORA = ("shakespeare", "prose", "poisoned")
ACTIONS = ("log", "skip", "rollback")
SEED = 1234  # conf/train.yaml's seed: the initial weights of the runs compared
POISON_SHARE = 0.05  # of the prose's characters, in documents of random characters


def parse(argv: list[str]) -> dict:
    args = parse_key_values(argv, DEFAULTS, doc=__doc__)
    chosen = {}
    for key, known in (("corpora", CORPORA), ("actions", ACTIONS)):
        chosen[key] = [name for name in args[key].split(",") if name]
        if not chosen[key] or set(chosen[key]) - set(known):
            raise ConfigError(f"{key}={args[key]}: choose among {', '.join(known)}, separated by commas.")
    if not args["steps"].isdigit() or int(args["steps"]) < 2:
        raise ConfigError(f"steps={args['steps']}: give a whole number of at least 2.")
    if not args["seeds"].isdigit():
        raise ConfigError(f"seeds={args['seeds']}: give a whole number of other seeds, 0 or more.")
    steps, seeds = int(args["steps"]), int(args["seeds"])
    return {**chosen, "steps": steps, "seeds": seeds, "out": out_folder(args["out"])}


def write_prose(folder: Path, poisoned: bool) -> Path:
    """Python's documentation topics as documents (one .txt each), with random-character documents if `poisoned`."""
    from pydoc_data.topics import topics

    if folder.is_dir():  # written for the corpus's first action: the same files for the others
        return folder
    folder.mkdir(parents=True)
    texts = [text for text in topics.values() if len(text) > 200]
    for i, text in enumerate(texts):
        (folder / f"topic{i:03d}.txt").write_text(text)
    if poisoned:
        rng = random.Random(0)
        total = sum(len(text) for text in texts)
        characters = string.ascii_letters + string.digits + string.punctuation + " "
        count = round(total * POISON_SHARE / 4000)
        for i in range(count):  # named to fall among the topics (prepare reads files in order), evenly spread
            after = (i + 1) * len(texts) // (count + 1)
            (folder / f"topic{after:03d}-noise.txt").write_text("".join(rng.choice(characters) for _ in range(4000)))
    return folder


def data_settings(corpus: str, scratch: Path) -> list[str]:
    """The data.* settings of a prose corpus; the poisoned one is tokenized by the clean prose's tokenizer, so that
    its runs are judged on the clean prose's validation split too."""
    raw = write_prose(scratch / f"raw-{corpus}", poisoned=corpus == "poisoned")
    data = [f"data.dir={scratch / f'shards-{corpus}'}", f"data.sources=[{raw}]", "data.fetch=null"]
    data += ["data.vocab_size=512", "data.seq_len=64"]
    if corpus == "poisoned":
        data += [
            "data.chunk_mb=0.02",
            "data.shuffle_window=1",
            f"data.tokenizer={prose_shards(scratch)}/tokenizer.json",
        ]
    return data


def prose_shards(scratch: Path) -> Path:
    """The clean prose's shards, prepared here unless a prose run prepared them."""
    shards = scratch / "shards-prose"
    if not (shards / "manifest.json").is_file():
        argv = [sys.executable, "-m", "project.prepare", *data_settings("prose", scratch)]
        subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=True)
    return shards


def clean_val_loss(checkpoint: Path, shards: Path, seq_len: int) -> float:
    """The mean loss of the final weights over the whole validation split of `shards` (clean text)."""
    import torch

    from project.data.datamodule import TokenShardDataModule
    from project.model.loss import IGNORED
    from project.training.lit_module import LlamaLitModule

    module = LlamaLitModule.load_from_checkpoint(checkpoint, map_location="cpu").eval()
    data = TokenShardDataModule(str(shards), seq_len=seq_len, global_batch_size=8, micro_batch_size=8, num_workers=0)
    data.setup("fit")
    total, count = 0.0, 0
    with torch.no_grad():
        for inputs, targets in data.val_dataloader():
            total += float(module.loss(inputs, targets)) * inputs.shape[0]  # the sum over real rows' tokens / T
            count += int((targets[:, 0] != IGNORED).sum())  # a short last batch's padding rows left out
    return total / count


def command(corpus: str, action: str, steps: int, scratch: Path, seed: int | None = None) -> tuple[list[str], Path]:
    run_dir = scratch / f"{corpus}-{action}" if seed is None else scratch / f"{corpus}-{action}-seed{seed}"
    if corpus == "shakespeare":
        data = []  # make train's own data (prepared on first use)
        experiment = "experiment=shakespeare"
    else:
        data = data_settings(corpus, scratch)
        experiment = "experiment=debug"
    group = "default" if action == "log" else action
    argv = [
        sys.executable, "-m", "project.train", experiment, *data, f"stability={group}", f"trainer.max_steps={steps}",
        "trainer.log_every_n_steps=1", f"hydra.run.dir={run_dir}", "trainer.enable_progress_bar=false",
    ]  # fmt: skip
    return argv + ([f"seed={seed}"] if seed is not None else []), run_dir


def last_value(run_dir: Path, column: str) -> float | None:
    with open(run_dir / "metrics.csv", newline="") as f:
        values = [float(row[column]) for row in csv.DictReader(f) if row.get(column)]
    return values[-1] if values else None


def measure(corpus: str, action: str, steps: int, scratch: Path, seed: int | None = None) -> dict:
    argv, run_dir = command(corpus, action, steps, scratch, seed)
    env = {**os.environ, "WANDB_MODE": "offline"}
    result = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    stopped = result.returncode != 0
    if stopped and "training stopped" not in result.stderr:
        raise RuntimeError(f"{corpus}, {action}: project.train failed:\n{result.stderr[-3000:]}")
    records_file = run_dir / "stability.jsonl"
    records = [json.loads(line) for line in records_file.read_text().splitlines()] if records_file.exists() else []
    acted = [r for r in records if r["action"] in ("log", "skip", "rollback", "stopped")]
    shards = ROOT / "data" / "shakespeare" if corpus == "shakespeare" else prose_shards(scratch)
    clean = (
        None
        if stopped
        else clean_val_loss(run_dir / "checkpoints" / "last.ckpt", shards, 256 if corpus == "shakespeare" else 64)
    )
    return {
        "corpus": corpus,
        "action": action if seed is None else f"{action}, seed={seed}",
        "command": " ".join(["python", *argv[1:]]),
        "val_loss": last_value(run_dir, "val/loss"),
        "clean_val_loss": clean,
        "spikes": sorted({int(r["step"]) for r in acted}),
        "excursions_logged": sum(r["action"] == "logged" for r in records),
        "rollbacks": [
            (int(r["step"]), int(r["restart_step"]), int(r.get("attempt", 1)))
            for r in records
            if r["action"] == "rollback"
        ],
        "stopped": stopped,
        "steps_trained": int(last_value(run_dir, "step") or 0) + 1,
    }


def table(report: dict) -> str:
    lines = [
        f"# Loss-spike actions on real runs, {report['date']} on {report['host']}",
        "",
        f"`{report['command']}`: each corpus under each action with conf/stability's defaults, {report['steps']} "
        "steps. Final val/loss: the run's last validation (val_sequences of its own split, the poisoned corpus's "
        "holding noise documents too); clean val loss: the final weights over the whole validation split of the "
        "clean text (shakespeare's own, the prose's for both prose corpora), which `against log` compares. Spikes: "
        "the steps an action acted on (under log: would have); excursions: gradient norms out of their band with the "
        "loss in its own, logged only; rollbacks: (spike step, checkpoint step, attempt).",
        "",
        "| corpus | action | final val/loss | clean val loss | against log | spikes | excursions logged | rollbacks | "
        "stopped |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = {r["corpus"]: r["clean_val_loss"] for r in report["rows"] if r["action"] == "log"}
    for r in report["rows"]:
        clean = r["clean_val_loss"]
        against = (
            f"{100 * (clean / base[r['corpus']] - 1):+.2f}%"
            if clean is not None and base.get(r["corpus"]) and r["action"] != "log"
            else ""
        )
        spikes = ", ".join(map(str, r["spikes"][:8])) + (", ..." if len(r["spikes"]) > 8 else "") or "none"
        rollbacks = ", ".join(f"({s}, {c}, {a})" for s, c, a in r["rollbacks"][:4]) or "none"
        val = f"{r['val_loss']:.4f}" if r["val_loss"] is not None else "-"
        clean_said = f"{clean:.4f}" if clean is not None else "-"
        lines.append(
            f"| {r['corpus']} | {r['action']} | {val} | {clean_said} | {against} | {spikes} | "
            f"{r['excursions_logged']} | {rollbacks} | {'yes' if r['stopped'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def rows(args: dict, scratch: Path) -> Iterator[dict]:
    for corpus in args["corpora"]:
        for action in args["actions"]:
            yield measure(corpus, action, args["steps"], scratch)
        # The spread of log's runs from other initial weights: what a difference between actions is against.
        for seed in range(SEED + 1, SEED + 1 + args["seeds"]) if corpus != "shakespeare" else ():
            yield measure(corpus, "log", args["steps"], scratch, seed)


BENCHMARK = Benchmark("benchmarks.stability", "-stability", parse, rows, table, lambda args: {"steps": args["steps"]})


if __name__ == "__main__":
    main(BENCHMARK)
