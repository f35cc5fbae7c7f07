"""The planner: every candidate layout's memory and step time, and which fit, best throughput first."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from project.model.config import LlamaConfig
from project.model.flops import training_flops_per_token
from project.parallel.float8_rules import FLOAT8_MULTIPLE
from project.planning.candidates import Candidate, SearchSpace, candidates
from project.planning.cluster import GIB, Cluster
from project.planning.memory import STORAGE_BYTES, Allowance, MemoryEstimate, peak_memory
from project.planning.parameters import float8_weights
from project.planning.step_time import StepTime, step_time
from project.runtime.errors import ConfigError

SECONDS_PER_DAY = 86_400


@dataclass(frozen=True)
class Workload:
    """What is trained: the model, the sequences, the batch, the tokens, the precision."""

    model: LlamaConfig
    seq_len: int
    global_batch_size: int  # sequences per optimizer step
    train_tokens: float
    precision: str = "bf16-mixed"
    float8: str | None = None  # strategy.float8 of the planned runs: tensorwise, auto (each layout both ways), None

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len

    @functools.cached_property
    def flops_per_token(self) -> float:
        """The model's training FLOPs per token (project.model.flops): the same for every layout, counted once."""
        return training_flops_per_token(self.model, self.seq_len)


@dataclass
class Prediction:
    candidate: Candidate
    memory: MemoryEstimate
    time: StepTime
    capacity: float  # bytes per device

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.capacity

    @property
    def reason(self) -> str:
        m, gib = self.memory, GIB
        need = f"{m.total / gib:.1f} of {self.capacity / gib:.1f} GiB"
        if self.fits:
            return f"fits: {need}"
        parts = {"activations": m.activations, "model states": m.states, "working copies": m.working}
        largest = max(parts, key=parts.get)
        return f"needs {need}; largest: {largest} {parts[largest] / gib:.1f} GiB"


@dataclass
class Outcome:
    """A prediction's throughput figures for the workload on the cluster."""

    prediction: Prediction
    tokens_per_second: float
    tflops_per_device: float
    mfu: float
    days: float


def evaluate(
    workload: Workload,
    cluster: Cluster,
    candidate: Candidate,
    achievable_fraction: float,
    allowance: Allowance,
    memory: MemoryEstimate | None = None,
) -> Outcome:
    """The candidate's prediction; `memory`, which no fraction changes, where it was estimated already."""
    if memory is None:
        memory = peak_memory(
            workload.model, candidate, workload.seq_len, workload.precision, cluster.accelerator, allowance
        )
    time = step_time(workload.model, candidate, workload.seq_len, workload.precision, cluster, achievable_fraction)
    tokens_per_second = workload.tokens_per_step / time.total
    flops = workload.flops_per_token * tokens_per_second / cluster.devices
    dtype = "fp32" if workload.precision == "32-true" else "bf16"
    return Outcome(
        Prediction(candidate, memory, time, cluster.memory_bytes),
        tokens_per_second,
        flops / 1e12,
        flops / cluster.peak_flops(dtype),
        workload.train_tokens / tokens_per_second / SECONDS_PER_DAY,
    )


def layouts(workload: Workload, cluster: Cluster, space: SearchSpace) -> list[Candidate]:
    """The candidates of `space`, after checking the settings they are built from: at least one."""
    if workload.precision not in STORAGE_BYTES:
        raise ConfigError(f"precision={workload.precision}: choose one of {list(STORAGE_BYTES)}.")
    space.check()
    found = list(
        candidates(
            workload.model, cluster.devices, cluster.gpus_per_node, workload.global_batch_size, workload.seq_len, space
        )
    )
    if not found:
        raise ConfigError(
            f"no layout of {cluster.devices} devices can take global_batch_size={workload.global_batch_size} with the "
            "search settings given: each data-parallel replica needs whole micro batches. Choose a global batch "
            "divisible by the device count, or widen search.micro_batch_sizes and search.strategies."
        )
    return with_float8(found, workload, cluster)


FLOAT8_CHOICES = (None, "tensorwise", "auto")


def with_float8(found: list[Candidate], workload: Workload, cluster: Cluster) -> list[Candidate]:
    """The candidates in float8 (`tensorwise`), or each both ways (`auto`: the table then shows where it pays);
    strategy=fsdp takes no float8 setting and stays as it is."""
    if workload.float8 not in FLOAT8_CHOICES:
        shown = ", ".join("null" if c is None else c for c in FLOAT8_CHOICES)
        raise ConfigError(
            f"float8={workload.float8}: choose one of {shown} (the planner models tensorwise, the faster recipe)."
        )
    if workload.float8 is None:
        return found
    cluster.check_float8()
    if workload.precision == "32-true":
        raise ConfigError("float8 with precision=32-true: float8 runs train in bf16-mixed (precision=bf16-mixed).")
    converted, kept = [], []
    for c in found:
        as_float8 = dataclasses.replace(c, float8="tensorwise")
        # strategy=fsdp takes no float8 setting; a layout whose ranks hold no projection float8 can take gains
        # nothing; a rank's tokens of a sequence must be a multiple of 16 too (project.config.float8)
        tokens = workload.seq_len // c.context_parallel
        takes = (
            c.strategy != "fsdp" and any(float8_weights(workload.model, as_float8)) and tokens % FLOAT8_MULTIPLE == 0
        )
        converted += [as_float8] if takes else []
        kept += [c] if not takes or workload.float8 == "auto" else []
    if workload.float8 == "tensorwise" and not converted:
        raise ConfigError(
            "float8=tensorwise: no layout has a block projection whose sides float8 can take (multiples of 16 as each "
            "tensor-parallel rank holds it) and a multiple of 16 tokens of a sequence on each rank: plan with "
            "float8=null."
        )
    return converted + kept


def plan(
    workload: Workload,
    cluster: Cluster,
    space: SearchSpace,
    achievable_fraction: float,
    allowance: Allowance = Allowance(),
) -> list[Outcome]:
    """Every layout of `space` on `cluster`: those that fit first, fastest first; then the rest, smallest first."""
    if not 0 < achievable_fraction <= 1:
        raise ConfigError(
            f"achievable_fraction={achievable_fraction} must be in (0, 1]: the share of the peak FLOP/s that busy "
            "devices reach."
        )
    found = [evaluate(workload, cluster, c, achievable_fraction, allowance) for c in layouts(workload, cluster, space)]
    return sorted(
        found,
        key=lambda o: (not o.prediction.fits, -o.tokens_per_second if o.prediction.fits else o.prediction.memory.total),
    )


def calibrated_fraction(
    workload: Workload,
    cluster: Cluster,
    space: SearchSpace,
    mfu: float,
    layout: str | None = None,
    allowance: Allowance = Allowance(),
) -> tuple[float, Outcome]:
    """The achievable_fraction at which `layout` (a name as the table prints it; None: the fastest layout
    that fits) predicts an end-to-end MFU of `mfu`, and that layout's outcome there.

    A published or measured MFU is end to end: bubbles, recompute and exposed communication are inside it,
    where the planner counts them apart. Solving for the kernels' share that reproduces it on the layout it
    was measured on lets every other layout be predicted from it. A named layout may be one the formulas
    find too large: the measurement says it ran.

    Bisection relies on a step's time never growing with the fraction: compute shrinks, and the
    communication it hid is exposed by at most as much. (Where a pipeline's slowest rank changes with the
    fraction, the compute that hides data-parallel traffic changes with it; no layout scanned showed a rise.)
    """
    if not 0 < mfu < 1:
        raise ConfigError(f"calibrate.mfu={mfu} must be in (0, 1): an end-to-end MFU, 0.41 for 41%.")
    found = layouts(workload, cluster, space)
    if layout is not None:
        found = [c for c in found if c.name == layout]
        if not found:
            raise ConfigError(
                f"calibrate.layout={layout} is not a layout the search settings give for {cluster.devices} devices and "
                f"global_batch_size={workload.global_batch_size}: copy a name from the plan's table (run it without "
                "calibrate.mfu), or widen search.* to include it."
            )
    # Memory, and so whether a layout fits, does not depend on the fraction: estimated once, not in every
    # step of the bisection.
    predictions = {
        o.prediction.candidate: o.prediction for o in (evaluate(workload, cluster, c, 1.0, allowance) for c in found)
    }
    pool = [c for c, prediction in predictions.items() if layout is not None or prediction.fits]
    if not pool:
        raise ConfigError(
            "calibrate.mfu: no layout fits, so none is the fastest to calibrate on; name the measured one with "
            "calibrate.layout."
        )

    def reference(fraction: float) -> Outcome:
        return max(
            (evaluate(workload, cluster, c, fraction, allowance, predictions[c].memory) for c in pool),
            key=lambda o: o.tokens_per_second,
        )

    if (best := reference(1.0)).mfu < mfu:
        raise ConfigError(
            f"calibrate.mfu={mfu}: {best.prediction.candidate.name} predicts at most {best.mfu:.1%} MFU even at "
            "achievable_fraction=1, so the bubble, recompute and communication the planner counts leave no room for "
            "it. Check the layout, the cluster's peak FLOP/s and links, or set achievable_fraction directly."
        )
    low, high = 0.0, 1.0
    while high - low > 1e-9:
        middle = (low + high) / 2
        low, high = (middle, high) if reference(middle).mfu < mfu else (low, middle)
    return high, reference(high)


def training_days(tokens: float, flops_per_token: float, devices: int, flops_per_device: float) -> float:
    """Days to train `tokens` at `flops_per_device` FLOP/s each: Narayanan et al. 2021's end-to-end
    estimate, 8TP/(nX) with flops_per_token = 8P (full recompute)."""
    return tokens * flops_per_token / (devices * flops_per_device) / SECONDS_PER_DAY
