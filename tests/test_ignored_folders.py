"""What the documented commands write stays out of git: a user following the docs never sees it as a change."""

import re
import subprocess

from conftest import ROOT

# The settings that name where a command writes, as the docs give them (`output_dir=exports/NAME`).
WRITTEN = re.compile(r"\b(?:output_dir|hydra\.run\.dir|paths\.log_dir|paths\.data_dir|data\.dir)=([A-Za-z0-9_.-]+)/")


def test_the_folders_the_documented_commands_write_are_ignored_by_git():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    folders = {match for page in pages for match in WRITTEN.findall(page.read_text())}
    assert {"outputs", "exports", "data"} <= folders, "the docs still write where this test looks"
    paths = [f"{folder}/a_run/file" for folder in sorted(folders)]
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", *paths], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    assert ignored == paths
