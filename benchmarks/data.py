"""The data path at scale, measured: `make bench` or

    python -m benchmarks.data [blocks=1e6,1e8,1e10] [chunk_blocks=8192] [before_up_to=1e8]
                                 [corpus_mb=16] [loader_batches=200] [out=experiments/benchmarks]

1. The order's start-up: seconds and memory (growth of the peak RSS of a fresh process) to the first global
   batch, for each corpus size in `blocks` (the order alone, no data: chunks of `chunk_blocks` blocks), with
   this platform's BlockOrder and, up to `before_up_to` blocks, the permutation of every block it replaced.
2. Locality: per 1,000 blocks a replica reads, how often the chunk changes from one read to the next and how
   many chunk loads an LRU cache of `shuffle_window` chunks would make, before and after.
3. project.prepare: MB of source text per second per worker, with 1 and 2 workers, on `corpus_mb` MB of text.
4. The training loader: tokens/s of TokenShardDataModule's train loader from the prepared folder and from the
   same shards on an S3-compatible server on loopback (moto), against the tokens/s that training the small10m
   preset consumes on this machine (benchmarks.model_step's step, random tokens).
Writes new files <date>-<host>-data.json and .md into `out`; no file there is edited.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import random
import shlex
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

from benchmarks.runner import ROOT, result_stem, write_report
from project.runtime.arguments import parse_key_values
from project.runtime.errors import exit_on_config_error

DEFAULTS = {
    "blocks": "1e6,1e8,1e10",
    "chunk_blocks": "8192",
    "before_up_to": "1e8",
    "corpus_mb": "16",
    "loader_batches": "200",
    "out": "experiments/benchmarks",
}
GLOBAL_BATCH, REPLICAS, MICRO_BATCH, SEQ_LEN, WINDOW = 512, 8, 8, 256, 8

# Run in a fresh process per case, so that its peak RSS is the order's alone.
STARTUP_CASE = """
import resource, sys, time
import numpy as np
kind, blocks, chunk_blocks, batch = sys.argv[1], int(float(sys.argv[2])), int(sys.argv[3]), int(sys.argv[4])
import torch
from project.data.sampler import BlockOrder
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
if kind == "after":
    full, rest = divmod(blocks, chunk_blocks)
    sizes = np.full(full + (rest > 0), chunk_blocks, dtype=np.int64)
    if rest:
        sizes[-1] = rest
    first = BlockOrder(sizes, seed=1234).take(0, batch)
else:  # what GlobalBatchSampler did before: a permutation of every block, each epoch
    first = torch.randperm(blocks, generator=torch.Generator().manual_seed(1234))[:batch].tolist()
seconds = time.perf_counter() - start
print(seconds, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)
"""


def startup(kind: str, blocks: float, chunk_blocks: int) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", STARTUP_CASE, kind, str(blocks), str(chunk_blocks), str(GLOBAL_BATCH)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if result.returncode:
        return {"order": kind, "blocks": int(blocks), "error": result.stderr.strip().splitlines()[-1:]}
    seconds, mib = map(float, result.stdout.split())
    return {
        "order": kind,
        "blocks": int(blocks),
        "seconds_to_first_batch": round(seconds, 4),
        "peak_rss_growth_mib": round(mib, 1),
    }


def locality(blocks: int, chunk_blocks: int, reads: int = 20_000) -> list[dict]:
    """Chunk changes and LRU chunk loads per 1,000 blocks, for replica 0 of REPLICAS, before and after."""
    import numpy as np
    import torch

    from project.data.sampler import BlockOrder, GlobalBatchSampler

    sizes = [chunk_blocks] * (blocks // chunk_blocks)
    after = BlockOrder(sizes, seed=1234, window_chunks=WINDOW)
    before_perm = torch.randperm(after.num_blocks, generator=torch.Generator().manual_seed(1234)).numpy()

    class Before:
        def take(self, start: int, count: int) -> list[int]:
            return before_perm[start % after.num_blocks :][:count].tolist()

    rows = []
    for name, order in (("before", Before()), ("after", after)):
        sampler = iter(GlobalBatchSampler(order, GLOBAL_BATCH, MICRO_BATCH, 0, REPLICAS))
        read = []
        while len(read) < reads:
            read += next(sampler)
        chunks = np.asarray(read[:reads]) // chunk_blocks
        changes = int((chunks[1:] != chunks[:-1]).sum())
        cache: OrderedDict[int, None] = OrderedDict()
        loads = 0
        for c in chunks.tolist():
            if c in cache:
                cache.move_to_end(c)
            else:
                loads += 1
                cache[c] = None
                if len(cache) > WINDOW:
                    cache.popitem(last=False)
        rows.append(
            {
                "order": name,
                "blocks": len(sizes) * chunk_blocks,
                "chunk_blocks": chunk_blocks,
                "replica_reads": reads,
                "chunk_changes_per_1000": round(1000 * changes / reads, 1),
                f"lru{WINDOW}_chunk_loads_per_1000": round(1000 * loads / reads, 1),
            }
        )
    return rows


def write_text(folder: Path, megabytes: float) -> int:
    rng = random.Random(0)
    words = (
        "the of and to in a is that for it as was with be by on not he this are or his from at which but "
        "have an they you were her she there been one all we their has would when what some if more"
    ).split()
    folder.mkdir(parents=True)
    written, n = 0, 0
    while written < megabytes * 1e6:
        text = "\n".join(
            " ".join(rng.choice(words) for _ in range(rng.randint(5, 20))).capitalize() + "." for _ in range(2000)
        )
        (folder / f"doc{n:05d}.txt").write_text(text)
        written += len(text.encode())
        n += 1
    return written


def prepare_rates(root: Path, megabytes: float) -> tuple[list[dict], Path]:
    from project.data.prepare import prepare_shards

    size = write_text(root / "raw", megabytes)
    prepare_shards(str(root / "raw"), root / "warm", vocab_size=320, seq_len=SEQ_LEN, num_workers=1)  # trains the BPE
    rows = []
    for workers in (1, 2):
        start = time.perf_counter()
        manifest = prepare_shards(
            str(root / "raw"),
            root / f"shards-{workers}",
            tokenizer=root / "warm" / "tokenizer.json",
            seq_len=SEQ_LEN,
            num_workers=workers,
        )
        seconds = time.perf_counter() - start
        tokens = sum(s["tokens"] for s in manifest["splits"].values())
        rows.append(
            {
                "workers": workers,
                "source_mb": round(size / 1e6, 2),
                "seconds": round(seconds, 2),
                "parts": manifest["parts"],
                "mb_per_s_per_worker": round(size / 1e6 / seconds / workers, 2),
                "tokens_per_s_per_worker": round(tokens / seconds / workers),
            }
        )
    return rows, root / "shards-1"


def loader_rate(data_dir: str, batches: int, seq_len: int = SEQ_LEN, micro_batch: int = 16, **storage) -> float:
    """Tokens/s of one replica's train loader (one worker process) over `batches` micro batches after the first."""
    from project.data.datamodule import TokenShardDataModule

    dm = TokenShardDataModule(
        data_dir,
        seq_len=seq_len,
        global_batch_size=micro_batch,
        micro_batch_size=micro_batch,
        num_workers=1,
        dp_rank=0,
        dp_size=1,
        allow_repeats=True,
        **storage,
    )
    dm.setup()
    loader = iter(dm.train_dataloader())
    next(loader)  # the worker's start and the first chunk fetch are start-up, not throughput
    start = time.perf_counter()
    for _ in range(batches):
        inputs, _ = next(loader)
    return inputs.numel() * batches / (time.perf_counter() - start)


def loader_rates(shards: Path, batches: int, root: Path) -> dict:
    import boto3
    from moto.server import ThreadedMotoServer

    from project.data.storage import upload_dataset

    rates = {"local_tokens_per_s": round(loader_rate(str(shards), batches))}
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options = {
        "endpoint_url": f"http://{host}:{port}",
        "aws_access_key_id": "bench",
        "aws_secret_access_key": "bench",
        "region_name": "us-east-1",
    }
    try:
        boto3.client("s3", **options).create_bucket(Bucket="bench")
        upload_dataset(shards, "s3://bench/shards", options)
        rates["s3_loopback_tokens_per_s"] = round(
            loader_rate("s3://bench/shards", batches, cache_dir=str(root / "cache"), storage_options=options)
        )
    finally:
        server.stop()
    return rates


def training_rate() -> dict:
    from benchmarks.model_step import bench, parse

    settings = parse(["presets=small10m", "steps=3"])["presets"][0]
    result = bench(settings)
    return {
        "preset": "small10m",
        "batch": result["batch"],
        "seq_len": result["seq_len"],
        "tokens_per_s": result["tokens_per_sec"],
    }


def table(report: dict) -> str:
    lines = [
        f"# Data path benchmarks, {report['date']} on {report['machine']['hostname']}",
        "",
        f"{report['machine']['platform']}, {report['machine']['cpu_count']} CPUs, torch {report['torch']}. "
        f"Command: `{report['command']}`",
        "",
        f"## Order start-up (first global batch of {GLOBAL_BATCH}; fresh process each)",
        "",
        "| order | blocks | seconds | peak RSS growth (MiB) |",
        "|---|---|---|---|",
    ]
    for r in report["startup"]:
        lines.append(
            f"| {r['order']} | {r['blocks']:.0e} | {r.get('seconds_to_first_batch', '-')} | "
            f"{r.get('peak_rss_growth_mib', r.get('note') or r.get('error'))} |"
        )
    lines += [
        "",
        f"## Locality (replica 0 of {REPLICAS}, global batch {GLOBAL_BATCH}, window {WINDOW} chunks)",
        "",
        "| order | blocks | blocks per chunk | chunk changes per 1,000 reads | loads per 1,000 reads, LRU cache of "
        f"{WINDOW} chunks |",
        "|---|---|---|---|---|",
    ]
    for r in report["locality"]:
        lines.append(
            f"| {r['order']} | {r['blocks']:,} | {r['chunk_blocks']} | {r['chunk_changes_per_1000']} | "
            f"{r[f'lru{WINDOW}_chunk_loads_per_1000']} |"
        )
    lines += [
        "",
        "## project.prepare",
        "",
        "| workers | source MB | parts | seconds | MB/s per worker | tokens/s per worker |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["prepare"]:
        lines.append(
            f"| {r['workers']} | {r['source_mb']} | {r['parts']} | {r['seconds']} | {r['mb_per_s_per_worker']} | "
            f"{r['tokens_per_s_per_worker']:,} |"
        )
    loader, train = report["loader"], report["training"]
    lines += [
        "",
        "## Training loader (one loader worker, micro batch 16 x 256 tokens)",
        "",
        f"Local folder: {loader['local_tokens_per_s']:,} tokens/s; S3 on loopback: "
        f"{loader['s3_loopback_tokens_per_s']:,} tokens/s; training {train['preset']} consumes "
        f"{train['tokens_per_s']:,} tokens/s here (ratios {loader['local_tokens_per_s'] / train['tokens_per_s']:.0f}x "
        f"and {loader['s3_loopback_tokens_per_s'] / train['tokens_per_s']:.0f}x).",
    ]
    return "\n".join(lines) + "\n"


@exit_on_config_error()
def main() -> None:
    args = parse_key_values(sys.argv[1:], DEFAULTS)
    import torch

    report = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "command": shlex.join(sys.orig_argv),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "hostname": platform.node()},
        "startup": [],
        "locality": [],
        "prepare": [],
        "loader": {},
        "training": {},
    }
    chunk_blocks, before_up_to = int(args["chunk_blocks"]), float(args["before_up_to"])
    for blocks in (float(b) for b in args["blocks"].split(",")):
        for kind in ("before", "after"):
            if kind == "before" and blocks > before_up_to:
                row = {
                    "order": kind,
                    "blocks": int(blocks),
                    "note": f"not run: {blocks * 8 / 2**30:.0f} GiB for the permutation",
                }
            else:
                row = startup(kind, blocks, chunk_blocks)
            report["startup"].append(row)
            print(json.dumps(row), flush=True)
    report["locality"] = locality(10**6, chunk_blocks)
    print(json.dumps(report["locality"]), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        report["prepare"], shards = prepare_rates(Path(tmp), float(args["corpus_mb"]))
        print(json.dumps(report["prepare"]), flush=True)
        report["loader"] = loader_rates(shards, int(args["loader_batches"]), Path(tmp))
        print(json.dumps(report["loader"]), flush=True)
    report["training"] = training_rate()
    stem = write_report(result_stem(ROOT / args["out"], "-data"), report, table(report))
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
