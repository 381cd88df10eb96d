"""The package as installed: every subpackage listed, configs and data files shipped, CI = README."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = Path(__file__).resolve().parents[1]


def _pyproject():
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_every_subpackage_is_listed():
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "mlxlab").rglob("__init__.py")
    }
    assert found | {"mlxlab.configs"} == listed


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    test_command = blocks[1].strip()
    assert test_command.endswith('python -m pytest -m "slow or not slow"')  # both tiers
    ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines


@pytest.mark.slow  # builds the wheel with pip in a subprocess
def test_wheel_ships_configs_and_data(tmp_path):
    """A non-editable install must find its configs and the tiny tokenizer corpus."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(REPO)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    wheel = next(tmp_path.glob("mlxlab-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for yaml in (REPO / "configs").rglob("*.yaml"):
        assert f"mlxlab/configs/{yaml.relative_to(REPO / 'configs').as_posix()}" in names
    assert "mlxlab/models/tiny_corpus.txt" in names
    # The CPU decode kernel: compiled into the wheel (where a compiler is), sources beside it.
    from tests.helpers.kernel import HAS_COMPILER

    if HAS_COMPILER:
        assert any(n.startswith("mlxlab/kernels/_kernels") for n in names), sorted(names)
    kernel_sources = (
        "matvec.cpp",
        "ce.cpp",
        "layer.cpp",
        "module.cpp",
        "common.h",
        "vexp.h",
        "kernels.h",
        "CMakeLists.txt",
    )
    assert {f"mlxlab/kernels/{name}" for name in kernel_sources} <= names
    assert {"mlxlab/data/quickstart/train.jsonl", "mlxlab/data/quickstart/valid.jsonl"} <= names
    # the browser pages (GET /, /runs): every static file
    for page in (REPO / "mlxlab" / "serve" / "web" / "static").iterdir():
        assert f"mlxlab/serve/web/static/{page.name}" in names
