"""The configuration reference, docs/configuration-reference.md, generated from conf/ itself:

    python -m tools.config_reference [out=PATH] [check=true]

The page lists the three primary configs (train.yaml, prepare.yaml, plan.yaml) with their defaults lists and
every setting, then every config group (a folder of conf/, nested ones included, as `hydra/job_logging`) with
each option (a file): its description and every setting, under the key the composed config gives it (the
option's package: the group's name, or the top level for `# @package _global_`). Each setting comes with its
default and its comment. Groups and options are sorted by name, settings keep their order in the file, so the
same conf/ always gives the same page. `out=PATH` writes the page there instead; `check=true` writes nothing
and exits with status 2 and one `error:` line naming the sections that differ when the page at `out` is not
what conf/ gives now (tests/test_config_reference.py does the same).

What is read, and its limits. Values are OmegaConf's reading of each file, unresolved: an interpolation
(`${data.seq_len}`) is shown as written; a list is one setting, shown whole in flow style; a mapping's keys are
settings of their own, with dotted names (`optim.lr`); the defaults list is shown apart. Comments are read from
the file's lines, a key matched to its line by indentation (`key:` at the start of a line, after spaces): a
setting's description is the comment on its line or, where it has none, the block of comment lines just above
it (touching it); a comment on a key's line that starts with two spaces or more after `#` continues the one on
the line above it. The file's leading block of comment lines, `# @package` aside, describes the file. Keys of
mappings inside lists, quoted keys, block scalars (`|`, `>`) and flow collections spread over several lines are
not matched to comments: those settings keep their values, without a description. A defaults list's comments
are read for a block list (`- entry  # comment`) only.
"""

from __future__ import annotations

import difflib
import json
import re
import sys
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from project.runtime.arguments import parse_options, true_or_false
from project.runtime.errors import ConfigError, exit_on_config_error

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
PAGE = ROOT / "docs" / "configuration-reference.md"
PRIMARY = ("train", "prepare", "plan")
COMMAND = "python -m tools.config_reference"
OPTIONS: dict[str, str | None] = {"out": None, "check": "false"}
USAGE = f"usage: {COMMAND} [out=PATH] [check=true]"

_KEY = re.compile(r"(?P<indent> *)(?P<key>[A-Za-z_][\w.\-]*)\s*:(?:\s|$)")
_ITEM = re.compile(r"(?P<indent> *)-(?:\s|$)")
_CONTINUED = re.compile(r" {2,}\S")  # `#   ...`: the comment of the line above goes on
_CODE_SPAN = re.compile(r"(`+).+?\1")


@dataclass
class Setting:
    key: str  # dotted, from the top of its file
    value: Any
    comment: str
    mapping: bool = False  # a mapping's own row, for its comment; its keys follow as settings of their own


@dataclass
class ConfigFile:
    path: Path
    description: str
    package: str | None  # the `# @package` directive, if any
    defaults: list[tuple[str, str]] = field(default_factory=list)  # (entry, comment)
    settings: list[Setting] = field(default_factory=list)


def _split_comment(line: str) -> tuple[str, str | None]:
    """(the line before its comment, the comment's text after `#`, or None): a `#` starts a comment at the
    line's start or after a space, outside a quoted scalar."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            if char == quote:
                quote = None
        elif char in "'\"" and (i == 0 or line[i - 1] in " \t:[{,"):
            quote = char
        elif char == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i].rstrip(), line[i + 1 :]
    return line.rstrip(), None


def _comments(lines: list[str]) -> tuple[str, str | None, dict[str, str], list[str]]:
    """(the file's description, its `# @package`, each dotted key's comment, the defaults list items' comments)."""
    description, package, start = [], None, 0
    while start < len(lines) and lines[start].lstrip().startswith("#"):
        text = lines[start].strip()[1:].strip()
        if text.startswith("@package"):
            package = text.removeprefix("@package").strip()
        elif text:
            description.append(text)
        start += 1
    comments: dict[str, str] = {}
    defaults: list[str] = []
    stack: list[tuple[int, str]] = []  # (indent, key) of the mappings the current line is in
    above: list[str] = []  # comment lines just above the current line
    list_indent: int | None = None  # the indent of the block list the lines are in, if any
    last: str | None = None  # the last key given a comment, which a continued comment extends
    in_defaults = False
    for line in lines[start:]:
        body, comment = _split_comment(line)
        if not body.strip():
            above = above + [comment.strip()] if comment is not None else []
            continue
        inline = (comment or "").strip()
        item, key = _ITEM.match(body), _KEY.match(body)
        if item:
            indent = len(item["indent"])
            list_indent = indent if list_indent is None else min(list_indent, indent)
            if in_defaults:
                defaults.append(inline)
        elif key:
            indent = len(key["indent"])
            if list_indent is not None and indent > list_indent:
                above = []
                continue  # a key of a mapping inside a list
            list_indent = None
            while stack and stack[-1][0] >= indent:
                stack.pop()
            path = ".".join([k for _, k in stack] + [key["key"]])
            stack.append((indent, key["key"]))
            in_defaults = path == "defaults"
            if comment is not None and _CONTINUED.match(comment) and last is not None:
                comments[last] = f"{comments[last]} {inline}".strip()
                inline = ""
            text = inline or " ".join(part for part in above if part)
            if text:
                comments[path] = text
                last = path
        above = []
    return " ".join(description), package, comments, defaults


def _defaults_entry(entry: Any) -> str:
    if isinstance(entry, dict):
        return ", ".join(f"{key}: {render_value(value)}" for key, value in entry.items())
    return str(entry)


def _settings(values: dict, comments: dict[str, str], prefix: str = "") -> list[Setting]:
    settings = []
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            if path in comments:
                settings.append(Setting(path, None, comments[path], mapping=True))
            settings.extend(_settings(value, comments, f"{path}."))
        else:
            settings.append(Setting(path, value, comments.get(path, "")))
    return settings


def read_config(path: Path) -> ConfigFile:
    """One file of conf/: its description, package, defaults list and settings (see the module's docstring)."""
    values = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    assert isinstance(values, dict), f"{path}: a config file holds a mapping"
    description, package, comments, default_comments = _comments(path.read_text().splitlines())
    entries = values.pop("defaults", None) or []
    if len(default_comments) != len(entries):
        default_comments = [""] * len(entries)  # a flow list: its comments are not read
    return ConfigFile(
        path=path,
        description=description,
        package=package,
        defaults=[(_defaults_entry(entry), text) for entry, text in zip(entries, default_comments)],
        settings=_settings(values, comments),
    )


def config_groups(conf: Path = CONF) -> dict[str, list[Path]]:
    """Each group of conf/ (its folder's path, `/`-separated) with its option files, sorted by name."""
    groups: dict[str, list[Path]] = {}
    for path in sorted(conf.rglob("*.yaml")):
        if path.parent != conf:
            groups.setdefault(path.parent.relative_to(conf).as_posix(), []).append(path)
    return {group: sorted(groups[group], key=lambda p: p.stem) for group in sorted(groups)}


def package_prefix(package: str | None, group: str) -> str:
    """The dotted prefix Hydra puts an option's keys under: the group's path by default (`_group_`), none for
    `_global_`."""
    package = package or "_group_"
    parts = []
    for part in package.split("."):
        if part == "_group_":
            parts.extend(group.split("/"))
        elif part != "_global_":
            parts.append(part)
    return "".join(f"{part}." for part in parts)


# Rendering.


def _float(value: float) -> str:
    if value != value:
        return ".nan"
    if value in (float("inf"), float("-inf")):
        return "-.inf" if value < 0 else ".inf"
    text = repr(value)
    if "e" not in text and abs(value) < 1e6:
        return text
    number = Decimal(text).normalize()
    digits = "".join(map(str, number.as_tuple().digits))
    sign = "-" if value < 0 else ""
    return f"{sign}{digits[0]}.{digits[1:] or '0'}e{number.adjusted()}"  # 1.0e12, 1.0e-8: as conf/ writes them


def _string(value: str) -> str:
    reads_otherwise = value.lower() in {"", "~", "null", "true", "false", "yes", "no", "on", "off"} or re.fullmatch(
        r"[-+]?(\d[\d_]*\.?\d*|\.\d+)([eE][-+]?\d+)?", value
    )
    if reads_otherwise or value != value.strip() or value[0] in "[]{}!&*#?|>'\"%@`" or ": " in value:
        return json.dumps(value)
    return value


def render_value(value: Any) -> str:
    """A default as YAML's flow style writes it (a string quoted only where it would read as something else)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return _float(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, list):
        return "[" + ", ".join(render_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {render_value(item)}" for key, item in value.items()) + "}"
    return str(value)


def _code(text: str) -> str:
    if "`" not in text:
        return f"`{text}`"
    return f"`` {text} ``"


def _escape(text: str) -> str:
    text = text.replace("\\", "\\\\")
    for char in "`*_[]|":
        text = text.replace(char, "\\" + char)
    return text.replace("<", "&lt;")


def prose(text: str) -> str:
    """A comment as Markdown: its code spans as written, the rest escaped (so that `|` cannot end a table
    cell, nor `*`, `_` or `<` start markup)."""
    out, position = [], 0
    for match in _CODE_SPAN.finditer(text):
        out.append(_escape(text[position : match.start()]))
        out.append(match.group(0))
        position = match.end()
    out.append(_escape(text[position:]))
    return "".join(out)


def _settings_table(config: ConfigFile, prefix: str) -> list[str]:
    if not config.settings:
        return ["No settings of its own."]
    rows = ["| setting | default | description |", "|---|---|---|"]
    for setting in config.settings:
        default = "" if setting.mapping else _code(render_value(setting.value))
        rows.append(f"| {_code(prefix + setting.key)} | {default} | {prose(setting.comment)} |")
    return rows


def _defaults_table(config: ConfigFile) -> list[str]:
    if not config.defaults:
        return []
    rows = ["Its defaults list, in order:", "", "| entry | comment |", "|---|---|"]
    rows += [f"| {_code(entry)} | {prose(comment)} |" for entry, comment in config.defaults]
    return rows + [""]


def _describe(config: ConfigFile) -> list[str]:
    return [prose(config.description) if config.description else "No description (no leading comment).", ""]


def _chosen(group: str, primaries: dict[str, ConfigFile]) -> str:
    """Where the primary configs' defaults lists pick an option of `group`."""
    choices = []
    for name, config in primaries.items():
        for entry, _ in config.defaults:
            key, sep, option = entry.partition(": ")
            if sep and key.removeprefix("override ").strip().lstrip("/") == group:
                choices.append(f"{_code(option)} in `{name}.yaml`")
    return f" Chosen by default: {'; '.join(choices)}." if choices else ""


def render(conf: Path = CONF) -> str:
    """The reference page for the configs of `conf` (see the module's docstring)."""
    primaries = {name: read_config(conf / f"{name}.yaml") for name in PRIMARY}
    lines = [
        "# Configuration reference",
        "",
        f"<!-- Generated from conf/ by `{COMMAND}`: edit conf/ and run it again, not this page. -->",
        "",
        f"Every setting of conf/, generated from its files by `{COMMAND}` (see [Configuration](configuration.md)"
        " for how the configs fit together). A setting is named by its key in the composed config, as the command"
        " line writes it (`data.seq_len=128`); defaults are as conf/ writes them, interpolations (`${...}`)"
        " unresolved; descriptions are the files' comments.",
        "",
        "## Primary configs",
        "",
    ]
    for name, config in primaries.items():
        lines += [f"### `{name}.yaml`", ""] + _describe(config) + _defaults_table(config)
        lines += _settings_table(config, "") + [""]
    lines += [
        "## Config groups",
        "",
        "Each folder of conf/ is a group and each file in it an option, picked with `GROUP=OPTION` on the command"
        " line (`model=small10m`) or in a defaults list.",
        "",
    ]
    for group, paths in config_groups(conf).items():
        options = ", ".join(_code(path.stem) for path in paths)
        lines += [f"### `{group}`", "", f"Options: {options}.{_chosen(group, primaries)}", ""]
        for path in paths:
            config = read_config(path)
            lines += [f"#### `{group}={path.stem}`", ""] + _describe(config) + _defaults_table(config)
            lines += _settings_table(config, package_prefix(config.package, group)) + [""]
    return "\n".join(lines).rstrip("\n") + "\n"


def _section_at(lines: list[str], index: int) -> str:
    for line in reversed(lines[: min(index, len(lines) - 1) + 1]):
        if line.startswith("#"):
            return line.lstrip("#").strip()
    return "the top"


def differing_sections(old: str, new: str) -> list[str]:
    """The headings of the sections where `old` and `new` differ, in order: those of the sections a change adds or
    removes, else the one it falls in."""
    old_lines, new_lines = old.splitlines(), new.splitlines()
    sections: list[str] = []
    matcher = difflib.SequenceMatcher(None, old_lines, new_lines, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        changed = old_lines[i1:i2] + new_lines[j1:j2]
        headings = [line.lstrip("#").strip() for line in changed if line.startswith("#")]
        inside = _section_at(old_lines, i1) if tag == "delete" else _section_at(new_lines, j1)
        for section in headings or [inside]:
            if section not in sections:
                sections.append(section)
    return sections


def check(page: Path, shown: str, conf: Path = CONF) -> None:
    """A ConfigError naming what differs, unless `page` is what conf/ gives now."""
    if not page.is_file():
        raise ConfigError(f"{shown} does not exist: write it with `{COMMAND}`.")
    sections = differing_sections(page.read_text(), render(conf))
    if sections:
        named = ", ".join(sections[:8]) + (f" and {len(sections) - 8} more" if len(sections) > 8 else "")
        raise ConfigError(f"{shown} is out of date with conf/ (it differs in {named}): regenerate it with `{COMMAND}`.")


@exit_on_config_error()
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    options, _ = parse_options(argv, OPTIONS, doc=__doc__, usage=USAGE)
    page = Path(options["out"]) if options["out"] else PAGE
    shown = options["out"] or PAGE.relative_to(ROOT).as_posix()
    if true_or_false("check", options["check"]):
        check(page, shown)
        print(f"{shown} is up to date with conf/")
        return 0
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(render())
    print(f"wrote {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
