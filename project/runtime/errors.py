"""Errors caused by bad input (settings, files), reported as one paragraph instead of a traceback.

A traceback is the right answer to a bug in our code, the wrong one to a typo in a config file: the
entry points raise `ConfigError` for the latter and wrap their `main` in `exit_on_config_error()`.
"""

import contextlib
import sys


class ConfigError(ValueError):
    """A setting or input file is wrong; the message says which setting and how to fix it."""


class TrainingStopped(RuntimeError):
    """Training stopped on purpose (a non-finite loss or gradient, say); the message says why and what to do."""


def config_error_behind(error: BaseException) -> "ConfigError | None":
    """The ConfigError that `error` was raised from, if any: Hydra's `instantiate` wraps whatever the object
    it builds raises (a strategy refusing a setting) in an InstantiationException of its own."""
    cause = error.__cause__
    while cause is not None and not isinstance(cause, ConfigError):
        cause = cause.__cause__
    return cause


class exit_on_config_error(contextlib.ContextDecorator):
    """Print a `ConfigError` as `error: <message>` on stderr and exit with status 2 (usage error);
    a `TrainingStopped` likewise, with status 1.

    Works as a decorator (`@exit_on_config_error()`) or a `with` block; other exceptions pass
    through untouched so real bugs keep their traceback.
    """

    def __enter__(self) -> "exit_on_config_error":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if (
            exc is not None
            and not isinstance(exc, (ConfigError, TrainingStopped))
            and (cause := config_error_behind(exc))
        ):
            exc_type, exc = ConfigError, cause
        if exc_type is not None and issubclass(exc_type, (ConfigError, TrainingStopped)):
            print(f"error: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(2 if issubclass(exc_type, ConfigError) else 1) from None
        return False
