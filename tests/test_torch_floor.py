"""The oldest torch the platform runs on is the one pyproject.toml asks for, and every module imports under it.

`make check-torch-floor` installs that torch (TORCH_FLOOR in the Makefile) into an environment of its own and runs
this file and FLOOR_TESTS there: the import check below, then the tests of the newest torch APIs the code calls
(PipelineStage's given gradients, torch.nn.functional.grouped_mm, the collectives context parallelism uses). In the
suite, under the pinned torch, the same import check runs."""

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def makefile_setting(name: str) -> str:
    found = re.search(rf"^{name} \?= (.+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert found, f"the Makefile sets no {name}"
    return found.group(1).strip()


def module_names() -> list[str]:
    names = []
    for package in ("project", "tools", "benchmarks"):
        root = importlib.import_module(package)
        names += [package] + [m.name for m in pkgutil.walk_packages(root.__path__, f"{package}.")]
    return names


@pytest.mark.parametrize("name", module_names())
def test_every_module_of_the_product_its_tools_and_benchmarks_imports(name):
    importlib.import_module(name)


def test_the_torch_floor_is_the_one_make_check_torch_floor_runs_on():
    floor = re.search(r'^    "torch>=([\d.]+)",$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert floor, "pyproject.toml's dependencies ask for no torch>=VERSION"
    assert makefile_setting("TORCH_FLOOR") == f"torch=={floor.group(1)}.0"
    for test in makefile_setting("FLOOR_TESTS").split():  # what that target runs is still there
        assert (ROOT / test.partition("::")[0]).is_file(), test
