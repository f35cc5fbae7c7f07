"""The configuration reference (docs/configuration-reference.md) is generated from conf/ and kept in step with it:
a group option or a setting added, changed or removed without regenerating the page fails here."""

import functools
import re
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from project.runtime.errors import ConfigError
from tools import config_reference

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
PAGE = ROOT / "docs" / "configuration-reference.md"


def leaf_keys(node: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in node.items():
        if isinstance(value, dict) and value:
            keys += leaf_keys(value, f"{prefix}{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return keys


@functools.cache
def conf_files() -> list[tuple[str, bool, list[str]]]:
    """(the page's heading for each file of conf/, whether it is a primary config, its leaf settings), read with
    OmegaConf alone."""
    files = []
    for path in sorted(CONF.rglob("*.yaml")):
        values = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        values.pop("defaults", None)
        primary = path.parent == CONF
        heading = f"`{path.name}`" if primary else f"`{path.parent.relative_to(CONF).as_posix()}={path.stem}`"
        files.append((heading, primary, leaf_keys(values)))
    return files


def missing_from(page: str) -> list[str]:
    """Each file of conf/ whose section the page lacks, and each leaf setting of a file that no row of its section
    names: a primary config's keys as they are, an option's under any package prefix (`model.dim` for
    model/debug.yaml's `dim`)."""
    parts = re.split(r"^#{2,4} (.+)$", page, flags=re.MULTILINE)
    sections = {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}
    missing = []
    for heading, primary, keys in conf_files():
        if heading not in sections:
            missing.append(heading)
            continue
        prefix = "" if primary else r"(?:[\w.]+\.)?"
        missing += [
            f"{heading} {key}"
            for key in keys
            if not re.search(rf"^\| `{prefix}{re.escape(key)}` \|", sections[heading], flags=re.MULTILINE)
        ]
    return missing


def test_the_committed_reference_is_what_conf_gives_now():
    rendered = config_reference.render()
    committed = PAGE.read_text()
    assert committed == rendered, (
        f"docs/configuration-reference.md differs in {config_reference.differing_sections(committed, rendered)}: "
        "regenerate it with `python -m tools.config_reference`"
    )


def test_every_option_and_setting_of_conf_has_its_row_in_the_reference():
    assert missing_from(PAGE.read_text()) == []


def test_the_coverage_check_finds_a_missing_setting_and_a_missing_option():
    page = PAGE.read_text()
    without_row = re.sub(r"^\| `model\.dim` \|.*\n", "", page, count=1, flags=re.MULTILINE)  # model=debug's
    assert missing_from(without_row) == ["`model=debug` dim"]
    without_option = page.replace("#### `trainer=gpu`", "#### `trainer=gpu2`")
    assert missing_from(without_option) == ["`trainer=gpu`"]


def test_check_names_the_section_of_a_stale_page_and_exits_2(tmp_path, capsys):
    page = tmp_path / "reference.md"
    assert config_reference.main([f"out={page}"]) == 0
    assert config_reference.main([f"out={page}", "check=true"]) == 0
    page.write_text(page.read_text().replace("| `model.dim` | `64` |", "| `model.dim` | `32` |"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit:
        config_reference.main([f"out={page}", "check=true"])
    assert exit.value.code == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: ") and "`model=debug`" in errors[0], errors


def test_a_new_option_without_a_new_page_is_named(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "strategy" / "ddp_sum.yaml").write_text(
        "# DDP with summed gradients.\ndefaults:\n  - ddp\n  - _self_\n\ngrad_reduction: sum  # N x larger\n"
    )
    with pytest.raises(ConfigError, match=r"`strategy=ddp_sum`"):
        config_reference.check(PAGE, "docs/configuration-reference.md", conf)
    section = config_reference.render(conf).split("#### `strategy=ddp_sum`")[1].split("####")[0]
    assert "| `strategy.grad_reduction` | `sum` | N x larger |" in section


def test_comments_are_read_from_the_lines_above_on_and_after_a_key(tmp_path):
    path = tmp_path / "option.yaml"
    path.write_text(
        "# @package _global_\n"
        "# What the file is for,\n"
        "# in two lines.\n"
        "\n"
        "# Above the key.\n"
        "a: 1\n"
        "b:                # on the line, and\n"
        "  c: 'x # y'      #   on the next\n"
        "  d: 1.0e12\n"
        "list:\n"
        "  - name: one     # an item\n"
        "    c: 2\n"
        "e: null  # after the list | with a pipe\n"
    )
    config = config_reference.read_config(path)
    assert config.description == "What the file is for, in two lines."
    assert config.package == "_global_"
    rows = [(s.key, config_reference.render_value(s.value), s.comment) for s in config.settings]
    assert rows == [
        ("a", "1", "Above the key."),
        ("b", "null", "on the line, and on the next"),
        ("b.c", "x # y", ""),
        ("b.d", "1.0e12", ""),
        ("list", "[{name: one, c: 2}]", ""),
        ("e", "null", "after the list | with a pipe"),
    ]
    assert config_reference.prose("a | b with `c | d`") == "a \\| b with `c | d`"
