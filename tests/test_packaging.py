"""The package as installed: every subpackage listed, configs and data files shipped, CI = README."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (requires-python allows it): tomli, which the dev extra installs there
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]


def _pyproject():
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_the_toml_reader_exists_on_every_python_the_package_allows():
    """These tests read pyproject.toml on every Python that requires-python allows: the standard
    library's tomllib from 3.11, before it the dev extra's tomli (they used to skip on 3.10)."""
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    project = _pyproject()["project"]
    allowed = SpecifierSet(project["requires-python"])
    before_tomllib = [v for v in ("3.8", "3.9", "3.10") if v in allowed]
    dev = [Requirement(r) for r in project["optional-dependencies"]["dev"]]
    tomli = [r for r in dev if r.name == "tomli"]
    for version in before_tomllib:
        assert any(
            r.marker is None or r.marker.evaluate({"python_version": version}) for r in tomli
        ), (
            f"requires-python allows {version}, which has no tomllib: the dev extra needs tomli there"
        )
    for r in tomli:  # and only there: 3.11 has tomllib
        assert r.marker is not None and not r.marker.evaluate({"python_version": "3.11"}), r


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
