"""callbacks.* settings (conf/callbacks): every callback of a run checked before it trains, each mistake one paragraph.

Two parts. `check_callbacks`, part of the settings check before torch and Lightning are imported (preflight): each
callback has a `_target_` whose package exists, and every `monitor` argument names a metric the run logs where a
callback reads it (LOGGED_METRICS). `build_callback`, where the callbacks are built once Lightning is imported
(project.training.trainer.build_callbacks; `check_callback_arguments` checks the same and builds nothing): the target
imports, its arguments are ones its signature takes, with the values its annotations allow where they are simple
(int, float, bool, str, Literal, Optional of these), and its constructor's own refusal of a value is a ConfigError.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import types
import typing
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Callable, Iterator

from omegaconf import DictConfig, OmegaConf

from project.config.values import model_config
from project.runtime.errors import ConfigError, config_error_behind


def _has_mixtures(cfg: DictConfig) -> bool:
    model = model_config(cfg)
    return any(model.mixture(i) is not None for i in range(model.n_layers))


def always(cfg: DictConfig) -> bool:
    return True


def with_callback(class_name: str) -> Callable[[DictConfig], bool]:
    """Whether the run has a callback of that class (by its target's last name: the package's or a module's path)."""
    return lambda cfg: any(str(node.get("_target_", "")).split(".")[-1] == class_name for _, node in callbacks_of(cfg))


def knows_peak_flops(cfg: DictConfig) -> bool:
    """Whether TokenThroughput can know the device's peak FLOP/s: given, or a GPU's (Lightning's table); `auto` may be
    one, so only a CPU run without the setting is sure not to."""
    return cfg.get("peak_flops_per_device") is not None or str(cfg.trainer.get("accelerator", "auto")) != "cpu"


@dataclass(frozen=True)
class LoggedMetrics:
    """Names one part of a run logs; a `*` in a name stands for any text (a layer's, a corpus', a set's name)."""

    names: tuple[str, ...]
    by: str  # what logs them, as an error says it
    # Logged through LightningModule.log (self.log, pl_module.log): in trainer.callback_metrics, which a callback's
    # `monitor` reads. The others are written to the loggers (metrics.csv, wandb) only.
    monitorable: bool = True
    when: Callable[[DictConfig], bool] = always  # whether this run logs them
    unless: str = ""  # why this run does not, with what would make it


# Every name a run logs, in one place: a callback's `monitor` is checked against these before training, and
# tests/test_train_end_to_end.py checks that every column of a run's metrics.csv is one of them. A new self.log (or
# logger.log_metrics) in the module or a callback adds its name here.
LOGGED_METRICS: tuple[LoggedMetrics, ...] = (
    LoggedMetrics(("train/loss", "train/lr", "train/grad_norm"), "the module (project.training.lit_module)"),
    LoggedMetrics(
        ("stability/loss_z", "stability/grad_norm_z", "stability/spikes", "stability/excursions"),
        "the module's spike watch (project.training.stability)",
    ),
    LoggedMetrics(
        ("stability/rollbacks",),
        "the module",
        when=lambda cfg: cfg.stability.get("action") == "rollback",
        unless="it is logged under stability=rollback only",
    ),
    LoggedMetrics(
        ("train/skipped_steps",),
        "the module",
        when=lambda cfg: bool(cfg.optim.get("max_skipped_steps")),
        unless="it is logged with optim.max_skipped_steps above 0 only",
    ),
    LoggedMetrics(
        ("moe/aux_loss", "moe/layer*/load_max", "moe/layer*/load_min", "moe/layer*/top_share"),
        "a mixture of experts (project.model.families.moe.model)",
        when=lambda cfg: _has_mixtures(cfg),
        unless="it is logged by a mixture of experts only (model.family=moe)",
    ),
    # At each validation (every val_every_n_steps steps): a callback judging then sees them. A run validating never
    # (val_every_n_steps above trainer.max_steps) judges nothing by them either, so they are not refused there.
    LoggedMetrics(("val/loss", "val/ppl"), "the module at each validation"),
    LoggedMetrics(
        ("val/loss/*",),
        "the module at each validation, per corpus of a mixture",
        when=lambda cfg: bool(cfg.data.get("mix")),
        unless="it is logged per corpus of a mixture only (data=mix)",
    ),
    LoggedMetrics(
        ("train/tokens_per_sec", "train/tokens_seen"),
        "callbacks.throughput (TokenThroughput)",
        when=with_callback("TokenThroughput"),
        unless="it is logged by callbacks.throughput, which this run leaves out",
    ),
    LoggedMetrics(
        ("train/mfu",),
        "callbacks.throughput (TokenThroughput), where the device's peak FLOP/s is known",
        when=lambda cfg: with_callback("TokenThroughput")(cfg) and knows_peak_flops(cfg),
        unless="it is logged by callbacks.throughput where the device's peak FLOP/s is known: on a CPU, set "
        "peak_flops_per_device=...",
    ),
    LoggedMetrics(
        (
            "memory/param_bytes",
            "memory/grad_bytes",
            "memory/optimizer_bytes",
            "memory/activation_bytes",
            "memory/peak_bytes",
            "memory/max_peak_bytes",
        ),
        "callbacks.memory (MemoryMonitor)",
        when=with_callback("MemoryMonitor"),
        unless="it is logged by callbacks.memory, which this run leaves out",
    ),
    LoggedMetrics(
        ("train/step_time_max_over_min",),
        "callbacks.stragglers (StragglerWatch)",
        when=with_callback("StragglerWatch"),
        unless="it is logged by callbacks.stragglers, which this run leaves out",
    ),
    LoggedMetrics(("step", "epoch"), "Lightning (ModelCheckpoint ranks by them too)"),
    # Written to the loggers only.
    LoggedMetrics(("time/seconds_to_first_step",), "callbacks.throughput (TokenThroughput)", monitorable=False),
    LoggedMetrics(
        ("eval/seconds", "eval/*/loss", "eval/*/bits_per_byte", "eval/*/*"),
        "callbacks.evaluation (HeldOutEvaluation)",
        monitorable=False,
    ),
    LoggedMetrics(("numerics/*",), "callbacks.numerics (NumericsMonitor)", monitorable=False),
    LoggedMetrics(
        ("checkpoint/gigabytes", "checkpoint/seconds", "checkpoint/gigabytes_per_second", "checkpoint/stall_seconds"),
        "callbacks.last_checkpoint (StepCheckpoint)",
        monitorable=False,
    ),
    LoggedMetrics(("layout/*",), "the run's layout facts (LayoutFacts)", monitorable=False),
    LoggedMetrics(("lr-*",), "Lightning's LearningRateMonitor (callbacks=lr_monitor)", monitorable=False),
)


def logged_by(name: str) -> LoggedMetrics | None:
    """The entry of LOGGED_METRICS that names `name`, if any."""
    return next((logged for logged in LOGGED_METRICS if any(fnmatchcase(name, n) for n in logged.names)), None)


def callbacks_of(cfg: DictConfig) -> Iterator[tuple[str, Any]]:
    """(name, node) for each callback the config lists (None: dropped with callbacks.NAME=null)."""
    for name, node in (cfg.get("callbacks") or {}).items():
        if node is not None:
            yield str(name), node


def shown(value: Any) -> str:
    """A value as the command line writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


# The packages whose callbacks log no names of their own, or only those listed above.
KNOWN_PACKAGES = ("project", "lightning", "pytorch_lightning")


def check_callbacks(cfg: DictConfig) -> None:
    """Torch-free: each callback has a target in an installed package, and each `monitor` names a metric the run logs
    where a callback reads it."""
    for name, node in callbacks_of(cfg):
        if not isinstance(node, DictConfig) or "_target_" not in node:
            raise ConfigError(
                f"callbacks.{name} has no _target_: a callback is a class with its arguments, e.g. "
                f"+callbacks.{name}._target_=lightning.pytorch.callbacks.Timer; or drop it with ~callbacks.{name}."
            )
        target = str(node._target_)
        package = target.split(".")[0]
        if not package or importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"callbacks.{name}._target_={target}: there is no package {package!r} here. Give the class by its "
                f"module's path (e.g. lightning.pytorch.callbacks.EarlyStopping), or install the package."
            )
    own_callbacks = any(str(node._target_).split(".")[0] not in KNOWN_PACKAGES for _, node in callbacks_of(cfg))
    for name, node in callbacks_of(cfg):
        if "monitor" in node and node.monitor is not None:
            check_monitor(cfg, f"callbacks.{name}.monitor", str(node.monitor), may_be_own=own_callbacks)


def monitorable_names(cfg: DictConfig) -> list[str]:
    return [n for logged in LOGGED_METRICS if logged.monitorable and logged.when(cfg) for n in logged.names]


def check_monitor(cfg: DictConfig, setting: str, metric: str, may_be_own: bool = False) -> None:
    """`metric` is logged by this run through the module (where a monitor reads it). `may_be_own`: a callback of the
    user's own may log names of its own, unknown here; only a near miss of a known name is refused then."""
    names = monitorable_names(cfg)
    logged = logged_by(metric)
    if logged is not None and logged.monitorable and logged.when(cfg):
        return
    close = difflib.get_close_matches(metric, names, n=1)
    if logged is None and may_be_own and not close:
        return
    listed = ", ".join(names)
    fix = f" Did you mean {close[0]}? Set {setting}={close[0]}." if close else f" Set {setting} to one of those."
    if logged is None:
        why = "the run logs no metric of that name"
    elif not logged.monitorable:
        why = (
            f"{logged.by} writes it to the loggers (metrics.csv) only, not to the metrics a callback's monitor "
            "reads (trainer.callback_metrics)"
        )
    else:
        why = logged.unless
    raise ConfigError(
        f"{setting}={metric}: {why}. A callback's monitor reads what the run logs through the module, here: "
        f"{listed}.{fix}"
    )


# ---- Once Lightning is imported: the targets, their arguments and values, and their construction. ----


def check_callback_arguments(cfg: DictConfig) -> None:
    """Every callback's target imports and takes the arguments given (names and simple values); nothing is built."""
    for name, node in callbacks_of(cfg):
        check_arguments(name, node)


def build_callback(name: str, node: DictConfig) -> Any:
    """The callback of callbacks.NAME, its arguments checked first; what its constructor refuses (ValueError,
    TypeError, Lightning's MisconfigurationException) as a ConfigError naming the callback."""
    from hydra.utils import instantiate
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    check_arguments(name, node)
    try:
        callback = instantiate(node)
    except Exception as error:  # Hydra's InstantiationException around what the constructor raised
        if isinstance(error, ConfigError):
            raise
        if (config_error := config_error_behind(error)) is not None:
            raise config_error from None
        cause = error.__cause__ or error
        # A user's value refused by a library's constructor; the project's own callbacks check their settings
        # before, so what theirs raise is a bug, kept with its traceback.
        if not isinstance(cause, (ValueError, TypeError, MisconfigurationException)) or node._target_.startswith(
            "project."
        ):
            raise
        raise ConfigError(
            f"callbacks.{name} ({node._target_}) refused its arguments: {str(cause).rstrip('.')}. Fix the value in "
            f"callbacks.{name}."
        ) from None
    if not isinstance(callback, Callback):
        raise ConfigError(
            f"callbacks.{name}._target_={node._target_} is not a Lightning callback (a lightning.pytorch.callbacks."
            f"Callback): give a callback's class, or drop it with ~callbacks.{name}."
        )
    return callback


def check_arguments(name: str, node: DictConfig) -> Any:
    """The target of callbacks.NAME, once its arguments are checked against its signature."""
    typed = str(node._target_)
    target = located(name, typed)
    given = OmegaConf.to_container(node, resolve=True)
    assert isinstance(given, dict)
    arguments = {str(k): v for k, v in given.items() if not str(k).startswith("_")}
    parameters, takes_any, hints = accepted_parameters(target)
    for key in arguments:
        if key not in parameters and not takes_any:
            match = difflib.get_close_matches(key, list(parameters), n=1)
            hint = f" Did you mean {match[0]}?" if match else ""
            raise ConfigError(
                f"callbacks.{name}.{key} is not an argument of {typed}.{hint} It takes: "
                f"{', '.join(parameters) or 'none'}."
            )
    positional = len(given.get("_args_") or [])
    if not given.get("_partial_"):
        for index, (key, parameter) in enumerate(parameters.items()):
            if parameter.default is inspect.Parameter.empty and key not in arguments and index >= positional:
                raise ConfigError(f"callbacks.{name}: {typed} needs {key}: add +callbacks.{name}.{key}=VALUE.")
    for key, value in arguments.items():
        if key in hints and (expected := simple_expectation(hints[key])) is not None:
            fits, said = expected
            if not fits(value):
                default = parameters[key].default if key in parameters else inspect.Parameter.empty
                example = (
                    f", e.g. callbacks.{name}.{key}={shown(default)} (its default)"
                    if default is not inspect.Parameter.empty and fits(default)
                    else ""
                )
                raise ConfigError(
                    f"callbacks.{name}.{key}={shown(value)} is not {said}, which {typed}'s {key} takes: give "
                    f"{said}{example}."
                )
    return target


def located(name: str, target: str) -> Any:
    """The object `target` names (a module's path, then attributes), or a ConfigError naming what is missing."""
    parts = target.split(".")
    for count in range(len(parts), 0, -1):  # the longest path that imports is the module
        path = ".".join(parts[:count])
        try:
            found: Any = importlib.import_module(path)
            break
        except ModuleNotFoundError as error:
            if error.name != path and not path.startswith(f"{error.name}."):  # one the target's module imports
                raise ConfigError(
                    f"callbacks.{name}._target_={target}: importing it needs the package {error.name!r}, which is "
                    f"not installed: install it, or drop the callback with ~callbacks.{name}."
                ) from None
    else:
        raise ConfigError(f"callbacks.{name}._target_={target}: there is no module {parts[0]!r}.")
    for index in range(count, len(parts)):
        if not hasattr(found, parts[index]):
            owner = ".".join(parts[:index])
            raise ConfigError(
                f"callbacks.{name}._target_={target}: {owner} has no {parts[index]}."
                f"{suggested_names(found, parts[index], modules=index < len(parts) - 1)}"
            )
        found = getattr(found, parts[index])
    return found


def suggested_names(owner: Any, missing: str, modules: bool) -> str:
    """A close public name of `owner` (`modules`: its modules too, where the target goes on past it), or else the
    callbacks it holds (lightning.pytorch.callbacks': two dozen)."""
    from lightning.pytorch.callbacks import Callback

    public = [n for n in dir(owner) if not n.startswith("_") and (modules or not inspect.ismodule(getattr(owner, n)))]
    match = difflib.get_close_matches(missing, public, n=3)
    if match:
        return f" Did you mean {' or '.join(match)}?"
    callbacks = [n for n in public if inspect.isclass(c := getattr(owner, n)) and issubclass(c, Callback)]
    return f" Its callbacks: {', '.join(callbacks)}." if callbacks else ""


def accepted_parameters(target: Any) -> tuple[dict[str, inspect.Parameter], bool, dict[str, Any]]:
    """The keyword arguments `target` takes, whether it takes any other too, and their annotations where they read.
    A class whose __init__ passes **kwargs on is followed up its bases' __init__ (BestCheckpoint's go to
    ModelCheckpoint's); one whose next __init__ is object's keeps them itself, so takes any (ModelSummary's)."""
    functions = (
        [vars(c)["__init__"] for c in target.__mro__ if "__init__" in vars(c)] if inspect.isclass(target) else [target]
    )
    parameters: dict[str, inspect.Parameter] = {}
    hints: dict[str, Any] = {}
    for function in functions:
        if function is object.__init__:
            return parameters, True, hints
        try:
            signature = inspect.signature(function)
        except (TypeError, ValueError):  # a builtin without one: nothing to check against
            return parameters, True, hints
        try:
            hints = {**typing.get_type_hints(function), **hints}
        except Exception:  # an annotation that does not resolve here: values go unchecked
            pass
        listed = list(signature.parameters.values())[1 if function is not target else 0 :]  # not self
        for parameter in listed:
            if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY):
                parameters.setdefault(parameter.name, parameter)
        if not any(p.kind is p.VAR_KEYWORD for p in listed):
            return parameters, False, hints
    return parameters, True, hints


def simple_expectation(annotation: Any) -> tuple[Callable[[Any], bool], str] | None:
    """(accepts, what it must be) for an annotation of plain values (int, float, bool, str, Literal, None and unions
    of these); None for any other (a path, a timedelta, a class): its values are the constructor's to refuse."""
    if annotation is type(None) or annotation is None:
        return (lambda v: v is None), "null"
    if annotation is bool:
        return (lambda v: isinstance(v, bool)), "true or false"
    if annotation is int:
        return (lambda v: isinstance(v, int) and not isinstance(v, bool)), "a whole number"
    if annotation is float:
        return (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)), "a number"
    if annotation is str:
        return (lambda v: isinstance(v, str)), "a string"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return (lambda v: any(v == a and type(v) is type(a) for a in args)), " or ".join(shown(a) for a in args)
    if origin is typing.Union or origin is types.UnionType:  # Optional[X], X | None
        parts = [simple_expectation(a) for a in args]
        if any(p is None for p in parts):
            return None
        checks = [p for p in parts if p is not None]
        return (lambda v: any(accepts(v) for accepts, _ in checks)), " or ".join(said for _, said in checks)
    return None
