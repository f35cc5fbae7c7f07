"""Building a step's document mask: `python -m benchmarks.document_mask [seq_lens=2048,8192]
[batch=2] [document=512] [device=cpu|cuda] [out=experiments/benchmarks]`

For each sequence length, documents of random lengths (mean `document` tokens) packed into `batch` sequences,
and the mask of causal attention within each document built three ways, each in a fresh process (time, and the
growth of the peak resident memory over the build):
- dense: the [batch, 1, T, T] boolean mask SDPA takes (the CPU's path, and every path's before 2026-11-25);
- create_block_mask: FlexAttention's block mask as torch builds it, evaluating the rule on every (query, key) pair
  (the GPU's path until 2026-11-26);
- tile edges: project.model.document_mask.document_block_mask, the same block mask from the documents at the
  128-position tiles' edges (the GPU's path now).
With device=cuda, also attention itself, forward and backward in bfloat16 (32 query and 8 key/value heads of 128),
mask building included, as a training step runs it: SDPA with the dense mask against the compiled FlexAttention
with the block mask (project.model.document_mask): milliseconds per step and peak memory above the inputs. The
CPU has no FlexAttention backward, so these rows need a GPU. Writes new files
<date>-<host>[-<gpu>]-document-mask.{json,md}.
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
    "seq_lens": "2048,8192",
    "batch": "2",
    "document": "512",
    "device": "cpu",
    "out": "experiments/benchmarks",
}
METHODS = ("dense", "create_block_mask", "tile edges")
ATTENTION = ("attention, dense mask", "attention, block mask")  # device=cuda only

# The documents of a case: `batch` rows of random cuts, about `document` tokens apart (shared by both scripts).
DOCUMENTS = """
generator = torch.Generator().manual_seed(0)
rows = []
for _ in range(batch):
    cuts = torch.randperm(seq_len - 1, generator=generator)[: max(1, seq_len // document - 1)] + 1
    rows.append(torch.zeros(seq_len, dtype=torch.long).index_fill(0, cuts, 1).cumsum(0))
ids = torch.stack(rows)
"""

CASE = (
    RESIDENT
    + """
import sys, time
import torch
from torch.nn.attention.flex_attention import create_block_mask
from project.model.document_mask import dense_document_mask, document_block_mask
method, seq_len, batch, document = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(2)
"""
    + DOCUMENTS
    + """
def rule(b, h, q, kv):
    return (q >= kv) & (ids[b, q] == ids[b, kv])
def build():
    if method == "dense":
        return dense_document_mask(ids)
    if method == "create_block_mask":
        return create_block_mask(rule, batch, None, seq_len, seq_len, device="cpu")
    return document_block_mask(ids)
start_rss = resident_bytes()
build()  # warm-up: the same peak
start = time.perf_counter()
mask = build()
seconds = time.perf_counter() - start
print(seconds, max(0, peak_resident_bytes() - start_rss))
"""
)


ATTENTION_CASE = (
    """
import sys, time
import torch
import torch.nn.functional as F
from project.model.document_mask import dense_document_mask, document_block_mask
from project.model.kernels import flex_attend
method, seq_len, batch, document = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
"""
    + DOCUMENTS
    + """
ids = ids.cuda()
shape = dict(device="cuda", dtype=torch.bfloat16, requires_grad=True)
q = torch.randn(batch, 32, seq_len, 128, **shape)
k, v = torch.randn(batch, 8, seq_len, 128, **shape), torch.randn(batch, 8, seq_len, 128, **shape)
def step():
    if method == "attention, dense mask":  # SDPA's masked kernels take no grouped heads: repeated, as the model does
        out = F.scaled_dot_product_attention(
            q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1), attn_mask=dense_document_mask(ids)
        )
    else:
        out = flex_attend(q, k, v, document_block_mask(ids), enable_gqa=True)
    out.backward(torch.ones_like(out))
for _ in range(3):  # compilation, kernel selection
    step()
torch.cuda.synchronize()
base = torch.cuda.memory_allocated()
torch.cuda.reset_peak_memory_stats()
start = time.perf_counter()
for _ in range(10):
    step()
torch.cuda.synchronize()
print((time.perf_counter() - start) / 10, torch.cuda.max_memory_allocated() - base)
"""
)


def parse(argv: list[str]) -> dict:
    args = parse_key_values(argv, DEFAULTS, doc=__doc__)
    seq_lens = [s for s in args["seq_lens"].split(",") if s]
    if not seq_lens or not all(s.isdigit() and int(s) >= 128 for s in seq_lens):
        raise ConfigError(f"seq_lens={args['seq_lens']}: give sequence lengths of at least 128, separated by commas.")
    for key in ("batch", "document"):
        if not args[key].isdigit() or int(args[key]) < 1:
            raise ConfigError(f"{key}={args[key]}: give a whole number above 0.")
    if args["device"] not in ("cpu", "cuda"):
        raise ConfigError(f"device={args['device']}: choose cpu (the masks) or cuda (the masks and attention).")
    gpu = ""
    if args["device"] == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("device=cuda: this machine has no CUDA device; leave device=cpu for the masks alone.")
        gpu = torch.cuda.get_device_name()
    return {
        "seq_lens": [int(s) for s in seq_lens],
        "batch": int(args["batch"]),
        "document": int(args["document"]),
        "device": args["device"],
        "gpu": gpu,
        "out": out_folder(args["out"]),
    }


def measure(method: str, seq_len: int, batch: int, document: int) -> dict:
    script = ATTENTION_CASE if method in ATTENTION else CASE
    seconds, peak = fresh_process(script, [method, str(seq_len), str(batch), str(document)], f"{method} at {seq_len}")
    return {"method": method, "seq_len": seq_len, "seconds": round(float(seconds), 4), "peak_bytes": int(peak)}


def table(report: dict) -> str:
    lines = [
        f"# Building the document mask, {report['date']} on {report['host']}"
        + (f" ({report['gpu']})" if report.get("gpu") else ""),
        "",
        f"`{report['command']}`: {report['batch']} sequences of documents of about {report['document']} tokens; "
        "seconds of one build (after a warm-up) and the growth of the peak RSS, in a fresh process per case "
        "(2 threads). Attention rows (a GPU): seconds of one forward and backward, mask included, and the peak "
        "memory above the inputs.",
        "",
        "| sequence | method | seconds | peak (MiB) |",
        "|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(f"| {r['seq_len']:,} | {r['method']} | {r['seconds']} | {r['peak_bytes'] / 2**20:.1f} |")
    return "\n".join(lines) + "\n"


def rows(args: dict, scratch: Path) -> Iterator[dict]:
    for seq_len in args["seq_lens"]:
        for method in METHODS + (ATTENTION if args["device"] == "cuda" else ()):
            yield measure(method, seq_len, args["batch"], args["document"])


def header(args: dict) -> dict:
    gpu = {"gpu": args["gpu"]} if args["gpu"] else {}  # the attention rows are the GPU's: its name in the title
    return {"batch": args["batch"], "document": args["document"], **gpu}


def suffix(args: dict) -> str:
    slug = "".join(c if c.isalnum() else "-" for c in args["gpu"].lower())
    return f"-{slug}-document-mask" if slug else "-document-mask"


BENCHMARK = Benchmark("benchmarks.document_mask", suffix, parse, rows, table, header)


if __name__ == "__main__":
    main(BENCHMARK)
