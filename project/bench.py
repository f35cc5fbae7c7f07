"""Training-step throughput of a model preset on this machine: `make bench` or

    python -m project.bench [model=small10m] [batch=8] [seq_len=256] [steps=5] [precision=32] [compile=false]

Times forward + backward + AdamW steps of the plain model (no Lightning, no data loading) after one
warm-up step and appends a JSON line (device, date, tokens/s, model TFLOP/s, MFU when the device's
peak is known, peak memory) to experiments/benchmarks/results.jsonl.
"""

from __future__ import annotations

import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from lightning.fabric.utilities.throughput import get_available_flops

from project.errors import ConfigError, exit_on_config_error
from project.model import Llama, LlamaConfig, count_parameters, training_flops_per_token

ROOT = Path(__file__).resolve().parents[1]
DEFAULTS = {"model": "small10m", "vocab_size": "4096", "batch": "8", "seq_len": "256", "steps": "5", "precision": "32", "compile": "false"}
DTYPES = {"32": torch.float32, "bf16": torch.bfloat16}


def parse_key_values(argv: list[str], defaults: dict[str, str]) -> dict[str, str]:
    """`key=value` arguments over `defaults`; an unknown key is a ConfigError."""
    args = dict(defaults)
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in defaults:
            raise ConfigError(f"unknown argument {arg!r}: expected key=value with key in {list(defaults)}.")
        args[key] = value
    return args


def parse(argv: list[str]) -> dict[str, str]:
    args = parse_key_values(argv, DEFAULTS)
    if args["precision"] not in DTYPES:
        raise ConfigError(f"precision={args['precision']}: choose one of {list(DTYPES)}.")
    return args


def load_preset(name: str, vocab_size: int) -> LlamaConfig:
    path = ROOT / "conf" / "model" / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"model={name}: no preset {path}; choose one of {sorted(p.stem for p in path.parent.glob('*.yaml'))}.")
    fields = yaml.safe_load(path.read_text())
    if not isinstance(fields["vocab_size"], int):  # the small presets follow data.vocab_size
        fields["vocab_size"] = vocab_size
    return LlamaConfig(**fields)


def bench(args: dict[str, str]) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[args["precision"]]
    config = load_preset(args["model"], int(args["vocab_size"]))
    batch, seq_len, steps = int(args["batch"]), int(args["seq_len"]), int(args["steps"])
    model = Llama(config).to(device)
    step_model = torch.compile(model) if args["compile"] == "true" else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, config.vocab_size, (batch, seq_len + 1), device=device)

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            logits = step_model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up: allocation, kernel selection, compilation
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    tokens_per_sec = batch * seq_len / seconds
    model_flops = training_flops_per_token(config, seq_len) * tokens_per_sec
    peak = get_available_flops(device, dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.processor() or platform.machine()} CPU x{torch.get_num_threads()} threads"
    return {
        "date": datetime.date.today().isoformat(),
        "device": name,
        "torch": torch.__version__,
        "model": args["model"],
        "parameters": count_parameters(config),
        "batch": batch,
        "seq_len": seq_len,
        "precision": args["precision"],
        "compile": args["compile"] == "true",
        "step_seconds": round(seconds, 4),
        "tokens_per_sec": round(tokens_per_sec, 1),
        "model_tflops": round(model_flops / 1e12, 4),
        "mfu": round(model_flops / peak, 4) if peak else None,
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if device.type == "cuda" else None,
    }


@exit_on_config_error()
def main() -> None:
    result = bench(parse(sys.argv[1:]))
    print(json.dumps(result))
    out = ROOT / "experiments" / "benchmarks" / "results.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
