"""The package's import graph: no cycles (function-level imports included, so none can hide one;
modules loaded by name with importlib, as the task registry does, are not edges here), and the
layers import only downwards; no exemptions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mlxlab"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the mlxlab modules it imports anywhere in its body (`from a import b` counts as
    a.b when that is a module, else as a)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in node.names
                ]
            else:
                continue
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "mlxlab.serve.engine.gateway" in graph and graph["mlxlab.serve.engine.gateway"]
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize(
    "below,above",
    [
        ("mlxlab.serve.engine", ("mlxlab.serve.",)),  # the engine knows no protocol, router or HTTP
        ("mlxlab.lora", ("mlxlab.serve", "mlxlab.train")),
        # vision-language models: shared by serve and generate, above models only
        ("mlxlab.vision", ("mlxlab.serve", "mlxlab.train", "mlxlab.lora", "mlxlab.generate")),
        ("mlxlab.models", ("mlxlab.lora", "mlxlab.serve", "mlxlab.train")),
        # the compiled kernel's loader sits below the models that use it
        ("mlxlab.kernels", ("mlxlab.models", "mlxlab.lora", "mlxlab.serve", "mlxlab.train")),
        # the trainer knows no task and no server (nor the decoder: test below)
        ("mlxlab.train", ("mlxlab.tasks", "mlxlab.serve")),
        # the one batched decoder sits below the server and the tasks, above models and LoRA
        ("mlxlab.decode", ("mlxlab.serve", "mlxlab.tasks", "mlxlab.train", "mlxlab.cli")),
        # a task sits above the trainer and the decoder, beside the server: it knows neither
        # the server nor another task
        ("mlxlab.tasks", ("mlxlab.serve",)),
        # the registry and the settings every config reads know no command, task or server
        ("mlxlab.registry", ("mlxlab.tasks", "mlxlab.serve", "mlxlab.train", "mlxlab.cli")),
        ("mlxlab.config", ("mlxlab.tasks", "mlxlab.serve", "mlxlab.train", "mlxlab.cli")),
        # speech and embeddings sit on models, below the server; models know neither
        ("mlxlab.audio", ("mlxlab.serve", "mlxlab.train", "mlxlab.lora", "mlxlab.embed")),
        ("mlxlab.embed", ("mlxlab.serve", "mlxlab.train", "mlxlab.lora", "mlxlab.audio")),
        ("mlxlab.models", ("mlxlab.audio", "mlxlab.embed")),
    ],
)
def test_layers_import_only_downwards(below, above):
    """Modules under `below` import nothing under `above`."""
    graph = import_graph()
    bad = sorted(
        (m, t)
        for m, targets in graph.items()
        if m == below or m.startswith(below + ".")
        for t in targets
        if t.startswith(above) and not t.startswith(below)
    )
    assert not bad, bad


def test_only_command_entries_use_the_hydra_glue():
    """mlxlab/cli.py (Hydra) is imported only by the modules `python -m mlxlab <command>` runs
    (mlxlab/__main__.py COMMANDS); everything else takes typed dataclasses."""
    from mlxlab.__main__ import COMMANDS

    entries = {target.partition(":")[0] for target, _ in COMMANDS.values()}
    graph = import_graph()
    users = {m for m, targets in graph.items() if "mlxlab.cli" in targets}
    assert users and users <= entries, sorted(users - entries)


def test_no_module_below_a_task_imports_one():
    """Tasks register themselves (mlxlab/registry.py imports them by name): no module outside a
    task's package imports it."""
    graph = import_graph()

    def package(module: str) -> str:  # mlxlab.tasks.chunk.windows -> mlxlab.tasks.chunk
        return ".".join(module.split(".")[:3])

    bad = sorted(
        (m, t)
        for m, targets in graph.items()
        for t in targets
        if t.startswith("mlxlab.tasks.") and package(m) != package(t)
    )
    assert not bad, bad


def test_the_trainer_knows_no_decoder_but_grpos_rollouts():
    """GRPO's rollouts (mlxlab/train/grpo/rollout.py) sample on the batched decoder, which sits
    below the trainer; nothing else of mlxlab.train imports it."""
    graph = import_graph()
    users = sorted(
        m
        for m, targets in graph.items()
        if m.startswith("mlxlab.train")
        and any(t == "mlxlab.decode" or t.startswith("mlxlab.decode.") for t in targets)
    )
    assert users == ["mlxlab.train.grpo.rollout"], users


def notebook_imports() -> list[tuple[str, str]]:
    """(notebook, import line) for every `mlxlab` import in the notebooks' code cells: the
    notebooks run only in the slow tier, so a moved name would otherwise surface only in CI."""
    import json

    lines = []
    for nb in sorted((PACKAGE.parent / "notebooks").glob("*.ipynb")):
        for cell in json.loads(nb.read_text())["cells"]:
            if cell["cell_type"] != "code":
                continue
            source = "".join(cell["source"])
            code = "\n".join(
                x for x in source.splitlines() if not x.lstrip().startswith(("%", "!"))
            )
            for node in ast.walk(ast.parse(code)):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and "mlxlab" in ast.unparse(node):
                    lines.append((nb.name, ast.unparse(node)))
    return lines


@pytest.mark.parametrize(("notebook", "line"), notebook_imports())
def test_notebook_imports_resolve(notebook, line):
    exec(line, {})


def test_the_notebooks_import_mlxlab():
    assert len({nb for nb, _ in notebook_imports()}) >= 2  # both notebooks were read
