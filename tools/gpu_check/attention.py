"""Ring attention's kernels against torch's fused attention on one device: a causal attention's forward and backward
over a whole sequence (a ring of one rank: `strategy.context_parallel_kv=ring` with cp=1, project.parallel.
ring_attention), and the same through `scaled_dot_product_attention`, which the gather path runs. Llama 3 8B's heads
(32 query heads sharing 8 key/value heads of 128), one sequence; their times and peak memory side by side, and the
largest difference of their outputs (the ring computes in float32, the fused kernel in the inputs' dtype).

What it tells: how much slower the ring's written-out math is than a fused kernel, which a ring across nodes must
hide behind what its transfers save. Each length runs in a process of its own (`python -m tools.gpu_check.attention
SETTINGS_JSON`): an out-of-memory error stays there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from benchmarks.runner import ROOT, free_port

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # llama3_8b's
LENGTHS = {"cuda": [32768, 131072], "cpu": [256]}  # the CPU's: the plumbing in a second


def measure(device_type: str, length: int, steps: int, env: dict, timeout: float) -> dict:
    """Time both at `length` tokens in a child process; its outcome ({"ok": False, "error": ...} where it failed)."""
    port = free_port()
    setting = json.dumps({"device": device_type, "length": length, "steps": steps})
    child_env = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tools.gpu_check.attention", setting],
            cwd=ROOT,
            env=child_env,
            capture_output=True,
            text=True,
            timeout=max(timeout, 1),
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "skipped": True, "error": "out of time (minutes=)"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        said = (done.stderr or done.stdout or "no output")[-2000:]
        # Too long for the device: said, not failed (as the speed section says of a step that does not fit).
        return {"ok": False, "skipped": "OutOfMemoryError" in said, "error": said}
    return {"ok": True, **json.loads(lines[-1])}


def row(length: int, outcome: dict) -> dict:
    """The report's row: each kernel's milliseconds and peak memory, the ring's time over the fused one's."""
    status = "measured" if outcome["ok"] else "skipped" if outcome.get("skipped") else "failed"
    found = {"length": length, "status": status, "error": outcome.get("error")}
    if outcome["ok"]:
        found |= {k: outcome[k] for k in ("ring_ms", "fused_ms", "ring_peak_gib", "fused_peak_gib", "max_abs_diff")}
        found["ring_over_fused"] = round(outcome["ring_ms"] / outcome["fused_ms"], 2)
    return found


def child(setting: dict) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from project.parallel.ring_attention import Ring, ring_attention

    cuda = setting["device"] == "cuda"
    device = torch.device("cuda" if cuda else "cpu")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    ring = Ring(dist.group.WORLD, 0, 1)
    dtype = torch.bfloat16 if cuda else torch.float32
    generator = torch.Generator(device=device).manual_seed(0)
    length = setting["length"]

    shapes = [(1, HEADS, length, HEAD_DIM), *[(1, KV_HEADS, length, HEAD_DIM)] * 2]
    drawn = [torch.randn(s, device=device, dtype=dtype, generator=generator) for s in shapes]

    def inputs():  # the same values for both, each its own leaves
        return [t.clone().requires_grad_() for t in drawn]

    def fused(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def ringed(q, k, v):
        return ring_attention(q, k, v, None, ring)

    def timed(attention) -> tuple[float, float, torch.Tensor]:
        q, k, v = inputs()
        out = attention(q, k, v)  # warm-up
        out.backward(torch.ones_like(out))
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for _ in range(setting["steps"]):
            out = attention(q, k, v)
            out.backward(torch.ones_like(out))
        if cuda:
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / setting["steps"]
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
        return seconds * 1e3, peak, out.detach().float()

    fused_ms, fused_peak, expected = timed(fused)
    ring_ms, ring_peak, found = timed(ringed)
    result = {"fused_ms": round(fused_ms, 2), "ring_ms": round(ring_ms, 2)}
    result |= {"fused_peak_gib": round(fused_peak, 2), "ring_peak_gib": round(ring_peak, 2)}
    result["max_abs_diff"] = float((found - expected).abs().max())
    print(json.dumps(result), flush=True)
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    child(json.loads(sys.argv[1]))
