"""Memory and time of one training step's loss, forward and backward: `python -m benchmarks.loss
[vocab=128256] [dim=512] [seq_len=2048] [micro_batch=2] [chunks=512,1024,2048] [out=experiments/benchmarks]`

The output head and the cross-entropy of `micro_batch x seq_len` tokens (float32, on the CPU), from the final
hidden states to their gradient and the head's:
- whole logits: the way project.training.lit_module computed the loss until 2026-11-25, the head's logits of
  every token at once, then their float32 cross-entropy;
- chunks of N tokens: project.model.loss, as Llama.head_loss computes it now (no more than N tokens' logits at once).
Each case runs in a fresh process, whose peak resident memory (ru_maxrss) is read before and after two steps
(the second timed): the growth is a step's own peak, the head's gradient included. Large allocations are mapped
apart (glibc's MALLOC_MMAP_THRESHOLD_), so that freed tensors leave the resident set.
Writes new files <date>-<host>-loss.{json,md}.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from benchmarks.runner import (
    RESIDENT,
    Benchmark,
    fresh_process,
    main,
    out_folder,
)
from project.runtime.arguments import parse_key_values
from project.runtime.errors import ConfigError

DEFAULTS = {
    "vocab": "128256",
    "dim": "512",
    "seq_len": "2048",
    "micro_batch": "2",
    "chunks": "512,1024,2048",
    "out": "experiments/benchmarks",
}

# One case in a fresh process: its peak RSS is that of the step alone. Weights and inputs are drawn in place,
# so that setting them up leaves no high-water mark above what they hold.
CASE = (
    RESIDENT
    + """
import sys, time
import torch
import torch.nn.functional as F
from project.model.loss import chunked_cross_entropy
vocab, dim, seq_len, rows, chunk = map(int, sys.argv[1:6])
torch.set_num_threads(2)
head = torch.nn.Linear(dim, vocab, bias=False)
with torch.no_grad():
    head.weight.normal_(0, 0.02, generator=torch.Generator().manual_seed(0))
hidden = torch.empty(rows, seq_len, dim).normal_(generator=torch.Generator().manual_seed(1)).requires_grad_()
targets = torch.randint(0, vocab, (rows, seq_len), generator=torch.Generator().manual_seed(2))
def step():
    if chunk == 0:
        loss = F.cross_entropy(head(hidden).flatten(0, 1).float(), targets.flatten())
    else:
        loss = chunked_cross_entropy(hidden, head, targets, chunk)
    loss.backward()
    return loss.item()
start_rss = resident_bytes()
step()  # warm-up: the same peak as the timed step
start = time.perf_counter()
loss = step()
seconds = time.perf_counter() - start
print(loss, seconds, max(0, peak_resident_bytes() - start_rss))
"""
)


def parse(argv: list[str]) -> dict:
    args = parse_key_values(argv, DEFAULTS, doc=__doc__)
    sizes = {}
    for key in ("vocab", "dim", "seq_len", "micro_batch"):
        if not args[key].isdigit() or int(args[key]) < 1:
            raise ConfigError(f"{key}={args[key]}: give a whole number above 0.")
        sizes[key] = int(args[key])
    chunks = [c for c in args["chunks"].split(",") if c]
    if not all(c.isdigit() and int(c) > 0 for c in chunks):
        raise ConfigError(f"chunks={args['chunks']}: give whole numbers of tokens above 0, separated by commas.")
    return {**sizes, "chunks": [int(c) for c in chunks], "out": out_folder(args["out"])}


def measure(vocab: int, dim: int, seq_len: int, micro_batch: int, chunk: int | None) -> dict:
    """One step of the loss in a fresh process: `chunk` tokens at a time, or (None) whole logits."""
    argv = [str(x) for x in (vocab, dim, seq_len, micro_batch, chunk or 0)]
    loss, seconds, peak = fresh_process(CASE, argv, f"the loss case {argv}")
    return {
        "method": "whole logits" if chunk is None else f"chunks of {chunk} tokens",
        "chunk_tokens": chunk,
        "loss": float(loss),
        "seconds": round(float(seconds), 2),
        "peak_bytes": int(peak),
    }


def table(report: dict) -> str:
    whole = report["rows"][0]["peak_bytes"]
    lines = [
        f"# The loss's memory, {report['date']} on {report['host']}",
        "",
        f"`{report['command']}`: one step's output head and cross-entropy, forward and backward, over "
        f"{report['micro_batch']} x {report['seq_len']} tokens, vocabulary {report['vocab']:,}, dim {report['dim']}, "
        "float32 on the CPU (2 threads). Peak: growth of the resident high-water mark over the step, in a fresh "
        "process per case (the head's gradient, "
        f"{report['vocab'] * report['dim'] * 4 / 2**30:.2f} GiB, included in every case).",
        "",
        "| method | loss | seconds | peak (GiB) | peak / whole logits' |",
        "|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['method']} | {r['loss']:.6f} | {r['seconds']} | {r['peak_bytes'] / 2**30:.2f} "
            f"| {r['peak_bytes'] / whole:.2f} |"
        )
    return "\n".join(lines) + "\n"


SIZES = ("vocab", "dim", "seq_len", "micro_batch")


def rows(args: dict, scratch: Path) -> Iterator[dict]:
    for chunk in [None, *args["chunks"]]:
        yield measure(**{key: args[key] for key in SIZES}, chunk=chunk)


BENCHMARK = Benchmark("benchmarks.loss", "-loss", parse, rows, table, lambda args: {key: args[key] for key in SIZES})


if __name__ == "__main__":
    main(BENCHMARK)
