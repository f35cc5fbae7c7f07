"""How fast does one device train? The training step of a model preset (forward, float32 cross-entropy, backward,
clipping, AdamW, as project.train runs it), compiled block by block and eager, side by side, beside what the
planner predicts for the same model, micro batch and device.

Each measurement runs in a process of its own (`python -m tools.gpu_check.speed SETTINGS_JSON`): a
compiled model's caches and an out-of-memory error stay there. The micro batch starts at the largest the
planner's memory model fits into 90% of the device, and halves after an out-of-memory error. Random tokens, no
data loader (the data path is measured on its own): this is the step's speed, not a run's.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace

from benchmarks.runner import ROOT
from project.model.config import LlamaConfig
from project.model.flops import count_parameters, training_flops_per_token
from project.planning.candidates import Candidate
from project.planning.cluster import Cluster
from project.planning.memory import Allowance, peak_memory
from project.planning.planner import Workload, evaluate

MEMORY_SHARE = 0.9  # of the device's memory, for the planner's first micro batch
ACHIEVABLE_FRACTION = 0.5  # conf/plan.yaml's default


@dataclass
class Setting:
    """One measurement: what the child process builds and times."""

    preset: str
    seq_len: int
    micro_batch: int
    compile: bool
    precision: str  # bf16-mixed | 32-true
    device: str  # cuda | cpu
    steps: int
    warmup: int
    vocab_size: int  # for the presets that follow data.vocab_size
    profile: bool = False  # then two more steps under torch.profiler: where the time goes
    float8: str | None = None  # strategy.float8's recipe for the blocks' linear layers (project.parallel.float8)


def single_device_candidate(micro_batch: int) -> Candidate:
    """The layout the step runs in, as the planner names it: one device, nothing sharded, attention through a
    fused kernel (its scores recomputed in backward, nothing else: the planner's `selective`)."""
    return Candidate("fsdp2", 1, 1, 1, micro_batch, 1, recompute="selective")


def device_cluster(
    name: str, device_type: str, memory_bytes: float, peak_flops: dict, memory_gbps: float | None = None
) -> Cluster:
    """This one device as the planner's cluster; its links never matter to a one-device step. On a GPU the
    planner counts compiled blocks' activations, and an eager row's as eager blocks keep them (`prediction`)."""
    accelerator = "gpu" if device_type == "cuda" else "cpu"
    given = {dtype: (flops or 0.0) / 1e12 for dtype, flops in peak_flops.items()}
    peaks = {"bf16": given.get("bf16") or given["fp32"], "fp32": given["fp32"] or given.get("bf16", 0.0)}
    if given.get("fp8"):
        peaks["fp8"] = given["fp8"]
    return Cluster(name, accelerator, 1, 1, memory_bytes / 2**30, peaks, 1.0, 1.0, memory_gbps=memory_gbps)


def planned_micro_batch(config: LlamaConfig, seq_len: int, precision: str, cluster: Cluster, cap: int) -> int:
    """The largest power of two up to `cap` whose planned memory fits MEMORY_SHARE of the device; 0 if none."""
    best, micro = 0, 1
    while micro <= cap:
        need = peak_memory(config, single_device_candidate(micro), seq_len, precision, cluster.accelerator, Allowance())
        if need.total > MEMORY_SHARE * cluster.memory_bytes:
            break
        best, micro = micro, micro * 2
    return best


def prediction(
    config: LlamaConfig,
    seq_len: int,
    micro_batch: int,
    precision: str,
    cluster: Cluster,
    compiled: bool = True,
    float8: str | None = None,
) -> dict:
    """What the planner predicts for this step: tokens/s, MFU and memory on the device (an eager step's memory
    counted as eager blocks keep it)."""
    if not cluster.peak_tflops["fp32"] > 0:
        return {}
    if float8 and (float8 != "tensorwise" or not (cluster.peak_tflops.get("fp8") and cluster.memory_gbps)):
        return {}  # the planner models tensorwise float8, given the device's float8 peak and memory bandwidth
    candidate = replace(single_device_candidate(micro_batch), float8=float8)
    memory = peak_memory(config, candidate, seq_len, precision, cluster.accelerator, Allowance(), compiled)
    outcome = evaluate(
        Workload(config, seq_len, micro_batch, 1.0, precision),
        cluster,
        candidate,
        ACHIEVABLE_FRACTION,
        Allowance(),
        memory,
    )
    return {
        "tokens_per_sec": round(outcome.tokens_per_second, 1),
        "mfu": round(outcome.mfu, 4),
        "memory_gib": round(outcome.prediction.memory.total / 2**30, 2),
    }


def measure(setting: Setting, env: dict, timeout: float) -> dict:
    """Run `setting` in a child process: {"ok": True, ...figures} or {"ok": False, "oom": bool, "error": str}."""
    argv = [sys.executable, "-m", "tools.gpu_check.speed", json.dumps(asdict(setting))]
    try:
        finished = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "oom": False, "error": f"out of time (minutes=): stopped after {timeout:.0f} s"}
    lines = finished.stdout.strip().splitlines()
    if finished.returncode == 0 and lines:
        try:
            return json.loads(lines[-1])
        except ValueError:
            pass
    tail = "\n".join(finished.stderr.strip().splitlines()[-15:])
    return {"ok": False, "oom": False, "error": f"exit status {finished.returncode}:\n{tail}"}


def is_out_of_memory(error: BaseException) -> bool:
    """An allocation the device refused, also when it surfaces inside a compiler's error (autotuning, say)."""
    import torch

    text = str(error).lower()
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in text or "alloc_failed" in text


def step_in_this_process(setting: Setting) -> dict:
    """The child's work: build the model on the device, warm up, time `steps` optimizer steps, then (with
    `profile`) profile two more."""
    import torch

    from benchmarks.runner import load_preset
    from project.model.llama import Llama
    from project.parallel.compiled import compile_blocks

    device = torch.device(setting.device)
    config = load_preset(setting.preset, setting.vocab_size)
    torch.manual_seed(0)
    losses: list = []

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    try:
        with torch.device("meta"):
            model = Llama(config)
        # Drawn on the device: the platform's initialization draws every value on the host, at about 1e8 a
        # second (12 s for 1B, in every child here); a step's speed does not depend on which values it starts from.
        model.to_empty(device=device)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("norm.weight"):
                    parameter.fill_(1.0)
                else:
                    parameter.normal_(0.0, config.init_std)
        if setting.float8:  # as a run does it: before the blocks are compiled
            from project.parallel.float8 import apply_float8

            apply_float8(model, setting.float8, device, setting.compile, gather=False)
        if setting.compile:
            compile_blocks(model)
        # Fused, as project.train's default optimizer (module.optimizer.fused): one kernel over all tensors.
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        tokens = torch.randint(0, config.vocab_size, (setting.micro_batch, setting.seq_len + 1), device=device)
        bf16 = setting.precision == "bf16-mixed"

        def step() -> None:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = model(tokens[:, :-1], targets=tokens[:, 1:])  # the model's loss, as project.train computes it
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach())  # read once, at the end: no host synchronization within the steps

        for _ in range(setting.warmup):  # compilation, the allocator's first blocks, kernel selection
            step()
        synchronize()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        for _ in range(setting.steps):
            step()
        synchronize()
        seconds = (time.perf_counter() - start) / setting.steps
        profiled = profile_steps(step, synchronize, device.type) if setting.profile else None
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        return {"ok": False, "oom": True, "error": str(error).splitlines()[0]}
    last = float(losses[-1])
    return {
        "ok": True,
        "step_seconds": round(seconds, 5),
        "tokens_per_sec": round(setting.micro_batch * setting.seq_len / seconds, 1),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
        "loss": round(last, 4),
        "loss_finite": math.isfinite(last),
        "profile": profiled,
    }


# Where a step's time goes, by the names of the operators and kernels the profiler records (first match wins).
KINDS = (
    ("communication", r"nccl|all_?reduce|all_?gather|reduce_?scatter|gloo"),
    ("attention", r"flash|fmha|attention|sdpa"),
    ("loss", r"cross_entropy|log_?softmax|nll_loss"),
    ("optimizer and clipping", r"adam|foreach|multi_tensor"),
    ("matrix products", r"gemm|matmul|aten::mm\b|aten::addmm|aten::bmm|cutlass|xmma|nvjet|cublas|sm\d+_"),
)
PROFILED_STEPS = 2


def kind_of(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, pattern in KINDS if re.search(pattern, lowered)), "other (norms, element-wise, copies)")


def profile_steps(step, synchronize, device_type: str) -> dict:
    """PROFILED_STEPS more steps under torch.profiler: the self time of each operator (on a GPU, of each kernel
    on the device), as shares by kind and the largest ones."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if device_type == "cuda" else [])]
    with profile(activities=activities) as profiler:
        for _ in range(PROFILED_STEPS):
            step()
        synchronize()
    events = profiler.key_averages()
    if device_type == "cuda":
        # Only the kernels' own events, as torch's table sums them: an operator's device time includes the
        # kernels it launched, and annotated spans (a compiled region, the optimizer's step) cover others again.
        # torch 2.4 renamed the CUDA time fields to device time; the node's torch may be older.
        field = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
        from torch.autograd import DeviceType

        events = [e for e in events if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    else:
        field = "self_cpu_time_total"
    times = [(event.key, getattr(event, field)) for event in events if getattr(event, field) > 0]
    total = sum(t for _, t in times) or 1.0
    kinds: dict[str, float] = {}
    for name, t in times:
        kinds[kind_of(name)] = kinds.get(kind_of(name), 0.0) + t / total
    top = sorted(times, key=lambda item: -item[1])[:12]
    return {
        "clock": "device" if device_type == "cuda" else "host",
        "ms_per_step": round(total / 1000 / PROFILED_STEPS, 3),
        "kinds": {kind: round(share, 4) for kind, share in sorted(kinds.items(), key=lambda item: -item[1])},
        "top": [
            {
                "name": name[:90],
                "kind": kind_of(name),
                "ms_per_step": round(t / 1000 / PROFILED_STEPS, 3),
                "share": round(t / total, 4),
            }
            for name, t in top
        ],
    }


def implied_fraction(measured: float | None, planned: dict) -> float | None:
    """The achievable fraction at which the planner predicts the measured tokens/s: on one device its step time is
    all compute, inversely proportional to the fraction. `project.plan achievable_fraction=` takes it."""
    if not measured or not planned.get("tokens_per_sec"):
        return None
    return round(ACHIEVABLE_FRACTION * measured / planned["tokens_per_sec"], 4)


def row(setting: Setting, outcome: dict, config: LlamaConfig, peak: float | None, planned: dict) -> dict:
    """One line of the speed table: the setting, what was measured, MFU against `peak`, the planner's figures."""
    flops = training_flops_per_token(config, setting.seq_len)
    measured = outcome.get("tokens_per_sec")
    if outcome.get("ok"):
        status = "measured"
    elif outcome.get("oom") or outcome.get("error", "").startswith("out of time"):
        status = "skipped"  # does not fit at micro batch 1, or no time left: reported, not a failure
    else:
        status = "failed"
    return {
        "status": status,
        "preset": setting.preset,
        "parameters": count_parameters(config),
        "seq_len": setting.seq_len,
        "micro_batch": setting.micro_batch,
        "mode": ("compiled" if setting.compile else "eager") + (f", float8 {setting.float8}" if setting.float8 else ""),
        "precision": setting.precision,
        "steps": setting.steps,
        "flops_per_token": flops,
        "peak_flops": peak,
        **{k: outcome.get(k) for k in ("step_seconds", "tokens_per_sec", "peak_memory_gib", "loss", "loss_finite")},
        "profile": outcome.get("profile"),
        "mfu": round(flops * measured / peak, 4) if measured and peak else None,
        "planner": {**planned, "fraction": implied_fraction(measured, planned)},
        "error": outcome.get("error", ""),
    }


if __name__ == "__main__":
    print(json.dumps(step_in_this_process(Setting(**json.loads(sys.argv[1])))), flush=True)
