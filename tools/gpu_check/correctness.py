"""Does this machine train correctly? The debug model trained 20 steps through `python -m project.train` in each
precision and layout the devices allow, every run's per-step losses against a reference run's.

Each case is a real run of the platform, as a user starts it (its command is in the report), on generated text
prepared once. A case passes when every step's loss is finite, the loss fell over the run, and the largest
relative difference from its reference's loss at the same step is within its tolerance:

- fp32 layouts (ddp, tensor parallel, pipeline, a resume under FSDP2) against the one-device fp32 run: 1e-5 on
  CPU, as the parity tests hold it; 1e-4 on GPUs, where cuBLAS picks other kernels for other matrix shapes and
  the embedding's backward sums with atomics, in another order every run;
- compiled against eager, fp32: 1e-4 (inductor fuses the norms and the SwiGLU and reorders their sums);
- bf16-mixed, and FSDP2 with param_dtype=bfloat16, against fp32: 1e-2 (bf16 keeps 8 bits of mantissa; measured
  on CPU on 2026-11-25: 1e-4);
- bf16-true (weights and AdamW's moments in bf16 too) against fp32: 3e-2 (measured on CPU: 0.9%);
- document masking on a GPU (FlexAttention's fused kernel under a block mask) against the same run on the CPU
  (the dense mask), both fp32: 1e-3, two devices' kernels apart; on a CPU both are the dense path (1e-5);
- with `float8=` (gpu_check's option), each float8 recipe (`strategy.float8`, compiled on a GPU) against the same
  bf16-mixed run over FLOAT8_STEPS steps (200 on a GPU): TOLERANCE["float8"] (see there).
"""

from __future__ import annotations

import csv
import math
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.runner import ROOT

STEPS, RESUME_AT = 20, 10
SEQ_LEN, VOCAB_SIZE = 64, 512  # experiment=debug's
# Seconds a case needs at least (a cold start of project.train on a GPU node takes 10 to 20): with less left of
# the section's share of the budget, it is skipped rather than started and killed.
MIN_SECONDS = {"cuda": 30.0, "cpu": 5.0}
TOLERANCE = {
    "parity_cpu": 1e-5,
    "parity_cuda": 1e-4,
    "compiled": 1e-4,
    "bf16": 1e-2,
    "bf16_true": 3e-2,
    "device_against_cpu": 1e-3,
    # float8's products against bf16's over FLOAT8_STEPS steps. Measured emulated on the CPU (the values a GPU
    # rounds to, float32 products) against bf16-mixed, 2026-11-29, 200 steps: at most 7.1e-3 (tensorwise) and
    # 5.7e-3 (rowwise), largest in the first 20 steps and where the loss falls fastest, not growing with the steps.
    # float8 rounds each product's inputs to 3 bits of mantissa (bf16: 8); a GPU's kernels add their own order.
    "float8": 2e-2,
}
# A float8 case's steps: torchtitan's and torchao's loss curves are compared over hundreds; a CPU emulates float8
# products at float32's cost and runs the cases to check the plumbing (make test), in fewer.
FLOAT8_STEPS = {"cuda": 200, "cpu": 20}


@dataclass
class Case:
    name: str
    proves: str
    settings: list[str]
    devices: int = 1
    reference: str | None = None  # the case whose losses this one's are compared with
    tolerance: float = 0.0
    resume_from: str | None = None  # the case whose last checkpoint this one resumes
    steps: int = STEPS
    needs: str = ""  # why the case is skipped with fewer devices: "" when it always runs
    min_devices: int = 1  # the devices it needs (`needs` says so)
    on_cpu: bool = False  # runs on the CPU whatever the device checked: a reference from the CPU's code path


@dataclass
class Result:
    name: str
    proves: str
    status: str  # pass | fail | skip
    command: str = ""
    reference: str | None = None
    tolerance: float | None = None
    max_rel_diff: float | None = None
    seconds: float | None = None
    detail: str = ""
    losses: dict[int, float] = field(default_factory=dict)


def cases(device_type: str, devices: int, float8: tuple[str, ...] = ()) -> list[Case]:
    """The cases for `devices` devices of `device_type`, in the order they run (references first); `float8`: the
    float8 recipes whose runs are compared with bf16's."""
    parity = TOLERANCE[f"parity_{device_type}"]
    fp32, bf16 = ["trainer.precision=32-true"], ["trainer.precision=bf16-mixed"]
    pair = "2 or more devices"
    against_cpu = TOLERANCE["device_against_cpu"] if device_type == "cuda" else parity
    # The reference first, then what needs several devices (the cases most worth a GPU node's time, should
    # the budget run short), the resume, and the one-device precisions and compilation.
    return [
        Case("fp32", "the one-device reference", fp32),
        Case(
            f"ddp x{devices}",
            "data parallel over every device",
            [*fp32, "strategy=ddp"],
            devices=devices,
            reference="fp32",
            tolerance=parity,
            needs=pair,
            min_devices=2,
        ),
        Case(
            "tp x2",
            "tensor parallel (and loss parallel) over 2 devices",
            [*fp32, "strategy=tp"],
            devices=2,
            reference="fp32",
            tolerance=parity,
            needs=pair,
            min_devices=2,
        ),
        Case(
            "pipeline x2",
            "a 2-stage 1F1B pipeline",
            [*fp32, "strategy=pipeline", "micro_batch_size=2"],
            devices=2,
            reference="fp32",
            tolerance=parity,
            needs=pair,
            min_devices=2,
        ),
        Case(
            f"fsdp2 x{devices} bf16",
            "FSDP2 with param_dtype=bfloat16 over every device",
            [*fp32, "strategy=fsdp2", "strategy.param_dtype=bfloat16"],
            devices=devices,
            reference="fp32",
            tolerance=TOLERANCE["bf16"],
        ),
        Case(
            f"fp32 to step {RESUME_AT}",
            "the first leg of the resume",
            fp32,
            reference="fp32",
            tolerance=parity,
            steps=RESUME_AT,
        ),
        Case(
            f"resumed under fsdp2 x{devices}",
            f"a one-device checkpoint resumes under FSDP2 over {devices} device(s), as if uninterrupted",
            [*fp32, "strategy=fsdp2"],
            devices=devices,
            reference="fp32",
            tolerance=parity,
            resume_from=f"fp32 to step {RESUME_AT}",
        ),
        Case("bf16-mixed", "autocast to bf16 trains like fp32", bf16, reference="fp32", tolerance=TOLERANCE["bf16"]),
        Case(
            "bf16-true",
            "bf16 weights and optimizer state train",
            ["trainer.precision=bf16-true"],
            reference="fp32",
            tolerance=TOLERANCE["bf16_true"],
        ),
        Case(
            "compiled",
            "torch.compile'd blocks give eager's losses",
            [*fp32, "strategy.compile=true"],
            reference="fp32",
            tolerance=TOLERANCE["compiled"],
        ),
        Case(
            "document mask, CPU",
            "the dense mask's losses, for the case below",
            [*fp32, "document_mask=true"],
            on_cpu=True,
        ),
        Case(
            "document mask",
            "document masking (on a GPU FlexAttention's block mask) gives the CPU's dense mask's losses",
            [*fp32, "document_mask=true"],
            reference="document mask, CPU",
            tolerance=against_cpu,
        ),
        Case(
            "document mask, compiled",
            "the block mask through torch.compile'd blocks",
            [*fp32, "document_mask=true", "strategy.compile=true"],
            reference="document mask, CPU",
            tolerance=max(against_cpu, TOLERANCE["compiled"]),
        ),
        Case(
            "document mask, tp x2",
            "the block mask through tensor parallelism's input hooks",
            [*fp32, "document_mask=true", "strategy=tp"],
            devices=2,
            reference="document mask, CPU",
            tolerance=against_cpu,
            needs=pair,
            min_devices=2,
        ),
        *multi_device_cases(device_type, devices),
        *float8_cases(device_type, float8),
    ]


# A run of this many steps, its replicated parameters compared every REPLICA_CHECK_EVERY (ReplicaCheck): on GPUs,
# kernels that add in another order per rank could part DDP's copies over a long run; a CPU's never do.
REPLICA_STEPS, REPLICA_CHECK_EVERY = 200, 50


def multi_device_cases(device_type: str, devices: int) -> list[Case]:
    """What a node of 4 or more devices proves beyond a pair (HSDP, a ring of 4 for context parallelism, 2-D
    tensor x FSDP2), each against the one-device fp32 run; on GPUs, also that DDP's copies stay bit for bit equal
    over REPLICA_STEPS steps."""
    fp32, four = ["trainer.precision=32-true"], "4 or more devices"
    parity = TOLERANCE[f"parity_{device_type}"]
    found = [
        Case(
            "hsdp 2x2",
            "HSDP: sharded within pairs of devices, replicated across them, all-reduced after the last micro batch",
            [*fp32, "strategy=fsdp2", "strategy.data_parallel_shard_size=2", "micro_batch_size=1",
             "strategy.gradient_sync=replicas_at_last"],
            devices=4, reference="fp32", tolerance=parity, needs=four, min_devices=4,
        ),
        Case(
            "context ring x4",
            "ring attention: every sequence split over 4 devices, keys and values passed around them",
            [*fp32, "strategy=fsdp2", "strategy.context_parallel_size=4", "strategy.context_parallel_kv=ring"],
            devices=4, reference="fp32", tolerance=parity, needs=four, min_devices=4,
        ),
        Case(
            "tp_fsdp 2x2",
            "2-D: tensor parallel within pairs, FSDP2 across them",
            [*fp32, "strategy=tp_fsdp"],
            devices=4, reference="fp32", tolerance=parity, needs=four, min_devices=4,
        ),
    ]  # fmt: skip
    if device_type == "cuda":
        found.append(
            Case(
                f"replicas equal x{devices}",
                f"DDP's copies of the model stay bit for bit equal over {REPLICA_STEPS} steps (ReplicaCheck)",
                [*fp32, "strategy=ddp", f"stability.replica_check_every_n_steps={REPLICA_CHECK_EVERY}"],
                devices=devices,
                steps=REPLICA_STEPS,
                needs="2 or more devices",
                min_devices=2,
            )  # fmt: skip
        )
    return found


def float8_cases(device_type: str, recipes: tuple[str, ...]) -> list[Case]:
    """bf16-mixed over FLOAT8_STEPS steps, then each recipe's run of the same settings with its blocks' linear
    layers in float8, compiled on a GPU as float8 is run there (on a CPU, compiling costs more than the check
    takes: eager)."""
    if not recipes:
        return []
    steps = FLOAT8_STEPS[device_type]
    bf16 = ["trainer.precision=bf16-mixed", *(["strategy.compile=true"] if device_type == "cuda" else [])]
    reference = f"bf16-mixed, {steps} steps"
    return [
        Case(reference, "float8's reference", bf16, steps=steps),
        *(
            Case(
                f"float8 {recipe}",
                f"the blocks' linear layers in float8 ({recipe} scales) track bf16 over {steps} steps",
                [*bf16, f"strategy.float8={recipe}"],
                reference=reference,
                tolerance=TOLERANCE["float8"],
                steps=steps,
            )
            for recipe in recipes
        ),
    ]


def global_batch(devices: int) -> int:
    """The global batch every case trains: 8 sequences (experiment=debug's), or a multiple that splits evenly."""
    return math.lcm(8, devices)


def command(case: Case, device_type: str, data: dict, devices: int, run_dir: Path, ckpt: Path | None) -> list[str]:
    """`python -m project.train ...` for `case`: experiment=debug on the prepared data, 20 steps, no validation."""
    trainer = "gpu" if device_type == "cuda" and not case.on_cpu else "cpu"
    return [
        sys.executable,
        "-m",
        "project.train",
        "experiment=debug",
        "logger=csv",
        f"data.dir={data['dir']}",
        f"data.sources=[{data['sources']}]",
        "data.fetch=null",
        f"data.seq_len={SEQ_LEN}",
        f"data.vocab_size={VOCAB_SIZE}",
        f"trainer={trainer}",
        f"trainer.devices={case.devices}",
        f"global_batch_size={global_batch(devices)}",
        f"trainer.max_steps={case.steps}",
        f"optim.decay_steps={max(STEPS, case.steps)}",  # the resumed leg's schedule is the whole run's
        "trainer.log_every_n_steps=1",
        "val_every_n_steps=1000000",
        "ckpt_every_n_steps=1000000",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        *case.settings,
        *([f"ckpt_path={ckpt}"] if ckpt else []),
        f"hydra.run.dir={run_dir}",
    ]


def read_losses(metrics: Path) -> dict[int, float]:
    """{step: train/loss} from a run's metrics.csv."""
    with metrics.open(newline="") as f:
        return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}


def compare(losses: dict[int, float], reference: dict[int, float], tolerance: float) -> tuple[bool, float, str]:
    """(passed, largest relative difference, why not) of `losses` against `reference` at the steps `losses` has.

    Every loss finite, every step of `losses` in `reference`, the run's loss fallen from its first step to its
    last, and each step within `tolerance` of the reference's loss, relative to it."""
    if not losses:
        return False, math.nan, "no train/loss in metrics.csv"
    if not all(math.isfinite(v) for v in losses.values()):
        return False, math.nan, "a loss is not finite"
    missing = sorted(set(losses) - set(reference))
    if missing:
        return False, math.nan, f"the reference has no loss at steps {missing}"
    steps = sorted(losses)
    if len(steps) > 1 and not losses[steps[-1]] < losses[steps[0]]:
        return (
            False,
            math.nan,
            f"the loss did not fall: {losses[steps[0]]:.4f} at step {steps[0]}, then {losses[steps[-1]]:.4f}",
        )
    diff = max(abs(losses[s] - reference[s]) / abs(reference[s]) for s in steps)
    if not diff <= tolerance:
        worst = max(steps, key=lambda s: abs(losses[s] - reference[s]) / abs(reference[s]))
        return False, diff, f"step {worst}: {losses[worst]:.6f} against {reference[worst]:.6f}"
    return True, diff, ""


def folder_name(case_name: str) -> str:
    """A case's run directory: its name in letters, digits and dashes (Hydra reads a comma as a list)."""
    return re.sub(r"[^A-Za-z0-9]+", "-", case_name).strip("-")


def shown(argv: list[str]) -> str:
    """A command as a user types it: `python -m ...`, the run directory left out."""
    return shlex.join(["python", *[a for a in argv[1:] if not a.startswith("hydra.run.dir=")]])


def run_case(
    case: Case,
    device_type: str,
    devices: int,
    data: dict,
    work: Path,
    env: dict,
    done: dict[str, Result],
    timeout: float,
) -> Result:
    """Run one case (its reference and, for a resume, its first leg ran before it) and compare."""
    result = Result(case.name, case.proves, "skip", reference=case.reference, tolerance=case.tolerance or None)
    if devices < case.min_devices:
        result.detail = f"needs {case.needs}"
        return result
    for prior in filter(None, (case.reference, case.resume_from)):
        if done.get(prior) is None or done[prior].status == "skip" or not done[prior].losses:
            result.detail = f"{prior!r} did not run"
            return result
    if timeout < MIN_SECONDS[device_type]:
        result.detail = f"out of time (minutes=): {max(timeout, 0):.0f} s left"
        return result
    run_dir = work / folder_name(case.name)
    ckpt = work / folder_name(case.resume_from) / "checkpoints" / "last.ckpt" if case.resume_from else None
    argv = command(case, device_type, data, devices, run_dir, ckpt)
    result.command = shown(argv)
    start = time.monotonic()
    try:
        finished = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        result.status, result.seconds = "skip", round(time.monotonic() - start, 1)
        result.detail = f"out of time (minutes=): stopped after {result.seconds} s"
        return result
    result.seconds = round(time.monotonic() - start, 1)
    if finished.returncode != 0:
        tail = "\n".join(finished.stderr.strip().splitlines()[-15:])
        result.status, result.detail = "fail", f"exit status {finished.returncode}; the run's stderr ends:\n{tail}"
        return result
    result.losses = read_losses(run_dir / "metrics.csv")
    expected = set(range(RESUME_AT if case.resume_from else 0, case.steps))
    if set(result.losses) != expected:
        result.status = "fail"
        result.detail = f"losses logged at steps {sorted(result.losses)}, expected {min(expected)}..{max(expected)}"
        return result
    if case.reference is None:
        result.status = "pass"
        return result
    passed, diff, why = compare(result.losses, done[case.reference].losses, case.tolerance)
    result.status, result.max_rel_diff, result.detail = ("pass" if passed else "fail"), diff, why
    return result
