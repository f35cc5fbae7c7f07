"""Prove that this machine's GPUs train, and measure them: `make gpu-check` or

    python -m tools.gpu_check [device=auto|cuda|cpu] [devices=N] [minutes=10] [out=experiments/benchmarks]
                                [sections=correctness,speed,data] [float8=tensorwise,rowwise]

In at most `minutes` (progress on the console):
1. environment: Python, torch, Lightning, CUDA, the driver, NCCL, the GPUs and their memory, the peak FLOP/s
   Lightning knows for them;
2. correctness: the debug model trained 20 steps through `python -m project.train` in fp32, bf16-mixed, bf16-true,
   compiled, FSDP2 with param_dtype=bfloat16 over every device, and with 2 or more devices DDP, tensor parallel
   and a 2-stage pipeline, and a one-device checkpoint resumed under FSDP2; with 4 or more, HSDP, ring attention
   over 4 and 2-D tensor x FSDP2; each run's per-step losses against the fp32 run's, within stated tolerances
   (tools.gpu_check.correctness); on 2 or more GPUs, DDP over every GPU for 200 steps with its copies compared bit
   for bit (ReplicaCheck); with `float8=`, 200 steps in each float8 recipe against the same run in bf16;
3. speed: with 2 or more devices, an all-reduce over all of them, its bus bandwidth beside the planner's link figure
   (tools.gpu_check.links); ring attention's kernels against torch's fused attention on one device at 32k and 128k
   tokens (tools.gpu_check.attention); the training step of a ~1B Llama (llama3_2_1b) at 2,048 and 8,192 tokens,
   bf16-mixed, micro batch filling the memory, compiled and eager side by side: tokens/s, MFU and peak memory
   beside the planner's prediction; with `float8=` (strategy.float8's recipes, comma-separated), each compiled
   step again in each float8 recipe;
4. the data path: the train loader's tokens/s against what that step consumes.
`sections=` runs some of the last three alone, within the same `minutes`. Writes new files
experiments/benchmarks/<date>-<gpu name>-gpu.{json,md} and prints the Markdown. Exit status 0 when every check
that ran passed, 1 when one failed.

Without a GPU, device=auto says so in one line and exits 0, writing nothing; device=cpu runs the same plumbing
on the CPU in about a minute (the debug model, fp32; files <date>-<host>-cpu-check.*). On a GPU node without a
package index, scripts/gpu_check_offline.sh runs it from wheels fetched beforehand (docs/performance.md).
"""

from __future__ import annotations

import datetime
import shlex
import sys
from pathlib import Path

from project.runtime.arguments import parse_key_values
from project.runtime.errors import ConfigError, exit_on_config_error

DEFAULTS = {
    "device": "auto",
    "devices": "",
    "minutes": "10",
    "out": "experiments/benchmarks",
    "sections": "correctness,speed,data",
    "float8": "",
}
SECTIONS = ("correctness", "speed", "data")
ROOT = Path(__file__).resolve().parents[2]


def parse(argv: list[str]) -> dict:
    """The options, checked before torch is imported."""
    args = parse_key_values(argv, DEFAULTS, doc=__doc__)
    if args["device"] not in ("auto", "cuda", "cpu"):
        raise ConfigError(f"device={args['device']}: choose auto (the GPUs if there are any), cuda or cpu.")
    try:
        minutes = float(args["minutes"])
    except ValueError:
        minutes = 0.0
    if not minutes > 0:
        raise ConfigError(f"minutes={args['minutes']}: give the time budget as a positive number of minutes.")
    if args["devices"] and (not args["devices"].isdigit() or int(args["devices"]) < 1):
        raise ConfigError(f"devices={args['devices']}: give a positive number of devices, or leave it out for all.")
    sections = tuple(name for name in SECTIONS if name in args["sections"].split(","))
    unknown = sorted(set(args["sections"].split(",")) - set(SECTIONS))
    if unknown or not sections:
        raise ConfigError(
            f"sections={args['sections']}: name one or more of {','.join(SECTIONS)}, separated by commas."
        )
    float8 = tuple(name for name in args["float8"].split(",") if name)
    if set(float8) - {"tensorwise", "rowwise"}:
        raise ConfigError(f"float8={args['float8']}: name tensorwise, rowwise or both, separated by commas.")
    out = Path(args["out"])
    return {
        "device": args["device"],
        "devices": int(args["devices"]) if args["devices"] else None,
        "minutes": minutes,
        "out": out if out.is_absolute() else ROOT / out,
        "sections": sections,
        "float8": float8,
    }


@exit_on_config_error()
def main() -> None:
    args = parse(sys.argv[1:])
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args["device"] == "auto" and gpus == 0:
        print(
            "no GPU here (torch sees none): nothing checked, nothing written; "
            "`python -m tools.gpu_check device=cpu` runs the same checks on the CPU with a tiny model"
        )
        return
    device = "cuda" if args["device"] == "auto" else args["device"]
    available = gpus if device == "cuda" else 1
    if device == "cuda" and gpus == 0:
        raise ConfigError("device=cuda: torch sees no GPU here. Use device=cpu to check the plumbing on the CPU.")
    devices = args["devices"] or available
    if device == "cuda" and devices > gpus:
        raise ConfigError(f"devices={devices}: torch sees {gpus} GPU(s) here; give at most {gpus}.")
    if args["float8"] and device == "cuda":  # refused now, not after minutes of runs that would each be refused
        from project.parallel.float8 import without_float8

        if reason := without_float8(torch.device("cuda", 0)):
            raise ConfigError(f"float8={','.join(args['float8'])}: {reason}. Leave float8= out on this node.")

    from tools.gpu_check import report
    from tools.gpu_check.check import Options, run

    result = run(Options(device, devices, args["minutes"], args["out"], args["sections"], args["float8"]))
    result["command"] = shlex.join(["python", "-m", "tools.gpu_check", *sys.argv[1:]])
    result["date"] = datetime.date.today().isoformat()
    target = report.write(result, args["out"])
    print("\n" + report.markdown(result))
    print(f"wrote {target}.json and .md")
    if report.failures(result):
        raise SystemExit(1)
