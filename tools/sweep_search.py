"""Where a sweep's points come from: a grid's combinations and random draws are known before the first point runs;
`method: bayes` asks Optuna's TPE sampler (tree-structured Parzen estimators) for each point as the one before it
ends, told that point's metric, so that after a few random start-up draws each point is chosen from the results
so far. Optuna, not our own model: a well-kept search with a seed, which needs no server and no scipy.

A wandb spec's bounded distributions map onto Optuna's: `values` (categorical, any values: asked by index),
`int_uniform`, `uniform`, `log_uniform_values` (and `inv_log_uniform_values`, the same law), `log_uniform`
(exponents), and their `q_` forms (the value quantized after it is drawn). Unbounded laws (normal, beta) and
categorical probabilities have no counterpart in TPE's search space: refused under bayes, with `random` offered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

from project.runtime.errors import ConfigError

if TYPE_CHECKING:
    import optuna

# Optuna's default of 10 random start-up points would leave a 12-point sweep (learning_rate.yaml) two chosen from the
# results: a third of the points, 3 to 10, are random here.
MIN_STARTUP, MAX_STARTUP = 3, 10


def startup_points(count: int) -> int:
    """How many of `count` points TPE draws at random before it models the results."""
    return min(count, max(MIN_STARTUP, min(MAX_STARTUP, count // 3)))


class Search(Protocol):
    """The points of a sweep, one at a time, each told its result before the next is asked for."""

    count: int

    def points(self) -> Iterator[dict[str, Any]]: ...

    def tell(self, metric: float | None) -> None:
        """The last point's final metric; None where it failed or logged none."""


@dataclass
class FixedPoints:
    """Points chosen up front (a grid, random draws): results change nothing."""

    chosen: list[dict[str, Any]]

    @property
    def count(self) -> int:
        return len(self.chosen)

    def points(self) -> Iterator[dict[str, Any]]:
        yield from self.chosen

    def tell(self, metric: float | None) -> None:
        pass


@dataclass(frozen=True)
class Asked:
    """One varied parameter as Optuna asks for it, and how its value is read back."""

    distribution: Any  # an optuna.distributions.BaseDistribution
    value: Callable[[Any], Any]


def asked(name: str, config: dict, kind: str) -> Asked:
    """The Optuna distribution of a parameter with wandb's `kind`, or a refusal naming what bayes takes here (bounds
    Optuna cannot take, min above max or a log scale from 0, among them)."""
    try:
        return _asked(name, config, kind)
    except ValueError as error:
        raise ConfigError(f"parameter {name}: method bayes cannot search {config} ({error}).") from None


def _asked(name: str, config: dict, kind: str) -> Asked:
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    lo, hi = config.get("min"), config.get("max")
    q = config.get("q", 1.0)

    def quantized(x: float) -> float | int:
        return (int if isinstance(q, int) else float)(round(x / q) * q)

    plain = kind.removeprefix("q_")
    read = quantized if kind.startswith("q_") else (lambda x: x)
    if kind == "categorical":
        values = list(config["values"])
        return Asked(CategoricalDistribution(list(range(len(values)))), lambda i: values[i])
    if kind == "int_uniform":
        return Asked(IntDistribution(lo, hi), lambda x: x)
    if plain == "uniform":
        return Asked(FloatDistribution(lo, hi), read)
    if plain in ("log_uniform_values", "inv_log_uniform_values"):
        return Asked(FloatDistribution(lo, hi, log=True), read)
    if plain == "log_uniform":  # min and max are exponents (wandb's v1)
        return Asked(FloatDistribution(math.exp(lo), math.exp(hi), log=True), read)
    raise ConfigError(
        f"parameter {name}: method bayes (Optuna's TPE) searches values, int_uniform, uniform, log_uniform_values, "
        f"log_uniform and their q_ forms, not {kind}: give it min and max in one of those, or use method: random."
    )


class TreeParzenSearch:
    """`count` points from Optuna's TPE sampler, seeded, towards the metric's goal (`maximize`, else minimize).
    `parameters`: each parameter's wandb config and the kind of its distribution, in the order of the points."""

    def __init__(self, parameters: dict[str, tuple[dict, str]], maximize: bool, count: int, seed: int):
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)  # a line per trial would bury the sweep's own
        self.count = count
        self.names = list(parameters)
        self.constants: dict[str, Any] = {}
        self.varied: dict[str, Asked] = {}
        for name, (config, kind) in parameters.items():
            if kind == "constant" or len(config.get("values", ())) == 1:
                self.constants[name] = config["value"] if kind == "constant" else config["values"][0]
            else:
                self.varied[name] = asked(name, config, kind)
        sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup_points(count))
        self.maximize = maximize
        self.study = optuna.create_study(direction="maximize" if self.maximize else "minimize", sampler=sampler)
        self._trial: optuna.trial.Trial | None = None
        self._finished: list[float] = []  # the finite metrics told so far

    def points(self) -> Iterator[dict[str, Any]]:
        distributions = {name: asked.distribution for name, asked in self.varied.items()}
        for _ in range(self.count):
            self._trial = self.study.ask(distributions)
            chosen = {name: asked.value(self._trial.params[name]) for name, asked in self.varied.items()}
            yield {name: chosen[name] if name in chosen else self.constants[name] for name in self.names}

    def tell(self, metric: float | None) -> None:
        """A failed point (no finite metric: refused, out of memory, diverged) counts as the worst result so far:
        TPE leaves out failed trials, and would go on proposing the region where points fail (a learning rate that
        diverges). Before any point has finished it is left out."""
        from optuna.trial import TrialState

        assert self._trial is not None, "tell() follows a point"
        if metric is not None and math.isfinite(metric):
            self._finished.append(metric)
            self.study.tell(self._trial, metric)
        elif self._finished:
            self.study.tell(self._trial, min(self._finished) if self.maximize else max(self._finished))
        else:
            self.study.tell(self._trial, state=TrialState.FAIL)
        self._trial = None
