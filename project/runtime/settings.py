"""Settings declared with what they accept, once: a dataclass field says it (`setting`), the dataclass refuses other
values when built (`check_fields`), and the settings check reads the same rules before torch is imported
(project.config.values), so that a typo on the command line is answered in about a second."""

from __future__ import annotations

from dataclasses import field, fields
from typing import Any, Callable

Accepts = Callable[[Any], bool]
Rule = tuple[str, Accepts, str]  # (key, accepts, what it must be)


def whole(minimum: int) -> Accepts:
    return lambda v: isinstance(v, int) and v >= minimum


def above(minimum: float) -> Accepts:
    return lambda v: v > minimum


def at_least(minimum: float) -> Accepts:
    return lambda v: v >= minimum


def or_null(accepts: Accepts) -> Accepts:
    return lambda v: v is None or accepts(v)


def setting(default: Any, accepts: Accepts, must: str) -> Any:
    """A dataclass field whose values `accepts` tells apart; `must` says what it must be, for the error."""
    return field(default=default, metadata={"accepts": accepts, "must": must})


def accepted(value: Any, accepts: Accepts) -> bool:
    try:  # true and false are numbers to Python, never to a setting
        return not isinstance(value, bool) and accepts(value)
    except TypeError:  # a string or a list where a number belongs, or a null where none is allowed
        return False


def out_of_range(key: str, value: Any, must: str, takes_words: bool = False) -> str:
    """The refusal of a value: a word (or true, false) where a number belongs is no number, not out of range."""
    if not takes_words and isinstance(value, (str, bool)):
        return f"{key}={value} is not a number: it must be {must}."
    return f"{key}={value} is out of range: it must be {must}."


def switch(default: bool) -> Any:
    """A dataclass field that is true or false."""
    return field(default=default, metadata={"switch": True})


def check_fields(settings: Any, prefix: str) -> None:
    """ValueError for the first field of the dataclass instance `settings` that its rule refuses."""
    for f in fields(settings):
        if f.metadata.get("switch"):
            if not isinstance(value := getattr(settings, f.name), bool):
                raise ValueError(f"{prefix}.{f.name}={value} must be true or false.")
            continue
        if f.metadata and not accepted(value := getattr(settings, f.name), f.metadata["accepts"]):
            # A setting whose default is a word (stability.action) takes words: another word is out of its range.
            raise ValueError(out_of_range(f"{prefix}.{f.name}", value, f.metadata["must"], isinstance(f.default, str)))
