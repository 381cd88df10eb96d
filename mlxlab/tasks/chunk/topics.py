"""The chunk task's topics: real documentation text that ships with Python and the project's own
dependencies, cut into sections an assistant can answer with.

Three sources, all offline and deterministic for a given Python and NumPy:

- `pydoc_data.topics`: the language reference topics (`help("assert")`), one topic each, its
  sections the paragraphs;
- the standard library's modules (and their packages' submodules): one topic per module with a
  docstring, its sections the module docstring and each public function's or class's docstring
  (with its signature);
- NumPy's public functions with a long numpydoc docstring: one topic each, its sections the
  docstring's own (summary, Parameters, Returns, Notes, Examples, ...).

A topic knows its subject (what a user calls it), a one-line summary, and where it came from;
labels and user questions are written from those and from the sections' own words
(docs_chats.py).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import pkgutil
import re
import sys
import warnings
from dataclasses import dataclass
from functools import lru_cache

# Modules not imported (side effects, GUI, platform-only, tests, private) or not worth a topic.
_SKIP = (
    "__",
    "_",
    "antigravity",
    "this",
    "idlelib",
    "tkinter",
    "turtle",
    "turtledemo",
    "test",
    "lib2to3",
    "ensurepip",
    "distutils",
    "venv",
    "msilib",
    "winreg",
    "winsound",
    "nt",
    "encodings",
    "pydoc_data",
    "xxlimited",
    "xxsubtype",
    "sre_",
    "pip",
)


@dataclass(frozen=True)
class Section:
    subject: str  # what this section is about: 'json.dumps', 'Parameters', '' (more of the same)
    text: str  # markdown the assistant can say


@dataclass(frozen=True)
class Topic:
    key: str  # unique: 'ref:assert', 'py:json', 'np:argsort'
    kind: str  # 'ref' | 'module' | 'numpy'
    name: str  # what a user calls it: 'the assert statement', 'json', 'numpy.argsort'
    summary: str  # one line, without its final period
    sections: tuple[Section, ...]


def _words(text: str, n: int) -> str:
    return " ".join(text.split()[:n])


def _summary(doc: str) -> str:
    first = doc.strip().split("\n\n")[0]
    # reST heading underlines ("=====") are not words
    first = " ".join(w for w in first.split() if not re.fullmatch(r"[=~^*#-]{3,}", w))
    first = re.split(r"(?<=[a-z0-9)])\. ", first)[0]
    return first.rstrip(".:")


def _code_blocks(text: str) -> str:
    """Doctest lines (>>> / ...) and their output into ```python fences."""
    out, block = [], []

    def flush():
        if block:
            out.append("```python\n" + "\n".join(block).rstrip() + "\n```")
            block.clear()

    in_example = False
    for line in text.split("\n"):
        stripped = line.strip()
        if stripped.startswith((">>>", "...")):
            in_example = True
            block.append(stripped[4:] if len(stripped) > 3 else "")
        elif in_example and stripped:
            block.append("# " + stripped)
        else:
            in_example = False
            flush()
            out.append(line)
    flush()
    return "\n".join(out).strip()


def _numpydoc_sections(doc: str) -> list[tuple[str, str]]:
    """[(heading, body)] of a numpydoc docstring; the part before the first heading is ''."""
    lines = doc.split("\n")
    parts, heading, body = [], "", []
    i = 0
    while i < len(lines):
        if (
            i + 1 < len(lines)
            and lines[i].strip()
            and set(lines[i + 1].strip()) == {"-"}
            and len(lines[i + 1].strip()) >= 3
        ):
            parts.append((heading, "\n".join(body).strip()))
            heading, body = lines[i].strip(), []
            i += 2
            continue
        body.append(lines[i])
        i += 1
    parts.append((heading, "\n".join(body).strip()))
    return [(h, b) for h, b in parts if b]


def _numpy_body(heading: str, body: str) -> str:
    if heading in ("Parameters", "Returns", "Yields", "Raises", "Other Parameters", "Attributes"):
        items, cur = [], None
        for line in body.split("\n"):
            if line and not line.startswith(" "):
                cur = [f"- `{line.strip()}`"]
                items.append(cur)
            elif cur is not None and line.strip():
                cur.append(line.strip())
        return "\n".join(" ".join(it) if len(it) > 1 else it[0] for it in items) or body
    if heading == "See Also":
        return "\n".join(f"- {line.strip()}" for line in body.split("\n") if line.strip())
    return _code_blocks(body)


def _quiet_import(name: str):
    with (
        warnings.catch_warnings(),
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()),
    ):
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(name)
        except (Exception, SystemExit):  # a module that cannot be imported is not a topic
            return None


def _stdlib_modules() -> list:
    names = sorted(n for n in sys.stdlib_module_names if not n.startswith(_SKIP))
    mods = []
    for name in names:
        m = _quiet_import(name)
        if m is None:
            continue
        mods.append(m)
        if hasattr(m, "__path__"):
            for info in sorted(pkgutil.iter_modules(m.__path__, name + "."), key=lambda x: x.name):
                if any(p.startswith(_SKIP) for p in info.name.split(".")[1:]):
                    continue
                sub = _quiet_import(info.name)
                if sub is not None:
                    mods.append(sub)
    return mods


def _member_section(modname: str, key: str, value) -> Section | None:
    doc = inspect.getdoc(value) or ""
    if len(doc) < 60:
        return None
    try:
        # a default's repr may hold its address (`<object object at 0x7f...>`): drop it, or the
        # same build differs from one process to the next
        sig = re.sub(r" at 0x[0-9a-fA-F]+", "", str(inspect.signature(value)))
    except (TypeError, ValueError):
        sig = ""
    kind = "class" if inspect.isclass(value) else "function"
    head = f"`{modname}.{key}{sig}` ({kind})" if len(sig) < 120 else f"`{modname}.{key}` ({kind})"
    return Section(f"{modname}.{key}", f"{head}\n\n{_code_blocks(doc)}")


def module_topics() -> list[Topic]:
    out = []
    for m in _stdlib_modules():
        doc = inspect.getdoc(m) or ""
        summary = _summary(doc)
        if len(doc) < 40 or not 2 <= len(summary.split()) <= 30:
            continue
        sections = [Section(m.__name__, _code_blocks(doc))]
        for key, value in sorted(vars(m).items()):
            if key.startswith("_") or getattr(value, "__module__", None) != m.__name__:
                continue
            if not (
                inspect.isfunction(value) or inspect.isclass(value) or inspect.isbuiltin(value)
            ):
                continue
            s = _member_section(m.__name__, key, value)
            if s:
                sections.append(s)
        if len(sections) >= 3:
            out.append(Topic(f"py:{m.__name__}", "module", m.__name__, summary, tuple(sections)))
    return out


def numpy_topics() -> list[Topic]:
    try:
        import numpy as np
    except ImportError:
        return []
    out = []
    for key in sorted(dir(np)):
        value = getattr(np, key, None)
        if key.startswith("_") or not callable(value):
            continue
        doc = inspect.getdoc(value) or ""
        if len(doc) < 1200 or "Examples" not in doc:
            continue
        parts = _numpydoc_sections(doc)
        if not parts or parts[0][0]:
            continue
        lead = parts[0][1].split("\n\n")
        while lead and re.match(r"^\w[\w.]*\(.*\)(\s*--)?$", lead[0].strip(), re.S):
            lead = lead[1:]  # a C function's signature (over one line or several)
        if not lead:
            continue
        summary = _summary(lead[0])
        if not 2 <= len(summary.split()) <= 30:
            continue
        sections = [Section(f"numpy.{key}", _code_blocks("\n\n".join(lead)))]
        sections += [Section(h, _numpy_body(h, b)) for h, b in parts[1:] if h != "References"]
        if len(sections) >= 3:
            out.append(Topic(f"np:{key}", "numpy", f"numpy.{key}", summary, tuple(sections)))
    return out


def reference_topics() -> list[Topic]:
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        text = topics[key].strip()
        title, _, body = text.partition("\n")
        title = " ".join(title.replace('"', "").split())
        paragraphs = []
        for p in re.split(r"\n\s*\n", body):
            p = p.rstrip()
            if not p.strip() or set(p.strip()) <= set("*=-"):
                continue
            paragraphs.append(
                " ".join(p.split())
                if not p.startswith("   ")
                else "```python\n" + "\n".join(x[3:] for x in p.split("\n")) + "\n```"
            )
        if len(paragraphs) >= 3 and 2 <= len(title.split()) <= 10:
            name = title[0].lower() + title[1:] if title.startswith("The ") else title
            summary = _summary(paragraphs[0]) if not paragraphs[0].startswith("```") else title
            out.append(
                Topic(
                    f"ref:{key}",
                    "ref",
                    name,
                    summary,
                    tuple(Section("", p) for p in paragraphs),
                )
            )
    return out


@lru_cache(maxsize=1)
def load_topics() -> tuple[Topic, ...]:
    """Every topic, sorted by key (the order the seeded split shuffles)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated modules' docstrings (typing.io, ...)
        topics = reference_topics() + module_topics() + numpy_topics()
    seen, out = set(), []
    for t in sorted(topics, key=lambda t: t.key):
        # one topic per key and per name (pydoc's "else" and "if" are the same section)
        if t.key not in seen and ("name", t.name) not in seen:
            seen.update((t.key, ("name", t.name)))
            out.append(t)
    return tuple(out)
