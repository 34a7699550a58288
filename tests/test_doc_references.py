"""README.md and docs/*.md name only what exists: every repository path (`miles/...`,
`scripts/...`, `configs/...`, `tests/...`, `docs/...`), every entry of the README's file
tree, every dotted `miles.` module (and the top-level name after it), every `make` target,
and every relative link and anchor; and the README has a line for every page of docs/.

Plain text and `ast` only (no import of the package, no model, no Ray): it runs in well
under a second.

    .venv/bin/python -m pytest tests/test_doc_references.py
"""

from __future__ import annotations

import ast
import itertools
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
UPSTREAM_PATHS = {
    "miles/backends/training_utils/loss_hub/",
    "miles/rollout/rm_hub/",
    "scripts/models/qwen3-4B.py",
}
"""Paths of radixark/miles that docs/MILES_COMPAT.md cites as its reference, not ours."""

PATH_RE = re.compile(r"(?<![\w./@:~-])((?:miles|scripts|configs|tests|docs)/[\w./{},*-]*)")
"""A repository path: one of the top-level folders, not inside a longer path or a URL."""
MODULE_RE = re.compile(r"(?<![\w./-])(miles(?:\.\w+)+)")
RUN_MODULE_RE = re.compile(r"python\s+-m\s+(miles(?:\.\w+)*)")
"""`python -m miles...`: a module that must run (a `.py` file, or a package with `__main__.py`)."""
MAKE_RE = re.compile(r"(?:^|[\s;&|(`])make\s+([A-Za-z][\w-]*)")
LINK_RE = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE_RE = re.compile(r"^```.*?^```", re.S | re.M)
INLINE_CODE_RE = re.compile(r"`([^`\n]+)`")
TREE_ENTRY_RE = re.compile(r"^( *)((?:[\w.-]+/)+|[\w-]*\.[\w.-]+(?:, [\w-]*\.[\w.-]+)*)(?: {2,}.*)?$")
"""A file-tree line: indentation, then a folder (`name/`, `a/b/`) or files (`name.ext`, or
`a.py, b.py`) alone or followed by two spaces and its note (a note's continuation line
never looks like this)."""


def doc_id(doc: Path) -> str:
    return str(doc.relative_to(ROOT))


def expand(path: str) -> list[str]:
    """`a/{b,c}.py` -> `a/b.py`, `a/c.py` (the docs' shorthand for sibling files)."""
    parts = re.split(r"\{([^{}]*)\}", path)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def exists(path: str) -> bool:
    if "*" in path:
        return any(ROOT.glob(path.rstrip("/")))
    return (ROOT / path).exists()


def clean(path: str) -> str:
    """A path as written in prose, without the sentence's punctuation around it."""
    path = path.split("::")[0]
    return path.rstrip(".,:;")


def named_paths(text: str) -> set[str]:
    paths: set[str] = set()
    for match in PATH_RE.finditer(text):
        path = clean(match.group(1))
        if "{" in path and "}" not in path:  # a brace list cut by the end of a line: not checkable
            continue
        paths.update(expand(path))
    return paths


def code_texts(text: str) -> list[str]:
    """The fenced blocks and inline code spans of a markdown text."""
    fences = [m.group(0) for m in FENCE_RE.finditer(text)]
    rest = FENCE_RE.sub("", text)
    return fences + INLINE_CODE_RE.findall(rest)


def tree_paths(text: str) -> set[str]:
    """The paths of each file tree (a fenced block whose first line is a top-level folder),
    rebuilt from the indentation of its entries."""
    paths: set[str] = set()
    for block in FENCE_RE.finditer(text):
        lines = block.group(0).splitlines()[1:-1]
        if not lines or not re.match(r"^(miles|scripts|configs|tests|docs)/(?: {2,}|$)", lines[0]):
            continue
        stack: list[tuple[int, str]] = []
        for line in lines:
            entry = TREE_ENTRY_RE.match(line)
            if not entry:
                continue
            indent, names = len(entry.group(1)), entry.group(2).split(", ")
            while stack and stack[-1][0] >= indent:
                stack.pop()
            parent = "".join(part for _, part in stack)
            paths.update(parent + name for name in names)
            if names[0].endswith("/"):
                stack.append((indent, names[0]))
    return paths


@cache
def makefile_targets() -> set[str]:
    targets: set[str] = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        rule = re.match(r"^([\w. /$()-]+?)\s*:(?!=)", line)
        if rule and not line.startswith("\t"):
            targets.update(t for t in rule.group(1).split() if not t.startswith("."))
    return targets


@cache
def top_level_names(module_file: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(module_file.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def module_problem(dotted: str) -> str | None:
    """None if `dotted` is a module or package of ours, or such a module and one name it
    defines at top level (a class, function or constant); else what is missing."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:n])
        module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if not module.is_file():
            continue
        rest = parts[n:]
        if not rest:
            return None
        if len(rest) == 1 and rest[0] in top_level_names(module):
            return None
        return f"{'.'.join(rest)} is not defined at the top of {module.relative_to(ROOT)}"
    return "no such module"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(doc: Path) -> set[str]:
    text = FENCE_RE.sub("", doc.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} +(.+?) *#*$", text, re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_named_paths_exist(doc: Path):
    text = doc.read_text()
    missing = sorted(p for p in named_paths(text) | tree_paths(text) if not exists(p) and p not in UPSTREAM_PATHS)
    assert not missing, (f"{doc_id(doc)} names paths that do not exist: {missing} (a path of upstream Miles "
                         "cited on purpose goes in UPSTREAM_PATHS)")


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_named_modules_exist(doc: Path):
    problems = {m: module_problem(m) for m in set(MODULE_RE.findall(doc.read_text()))}
    problems = {m: p for m, p in problems.items() if p}
    assert not problems, f"{doc_id(doc)} names modules that do not exist: {problems}"


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_modules_run_with_python_m_exist(doc: Path):
    named = set(RUN_MODULE_RE.findall(doc.read_text()))
    runnable = {m for m in named if ROOT.joinpath(*m.split(".")).with_suffix(".py").is_file()
                or ROOT.joinpath(*m.split("."), "__main__.py").is_file()}
    assert named == runnable, f"{doc_id(doc)} runs modules that cannot run: {sorted(named - runnable)}"


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_make_targets_exist(doc: Path):
    named = {t for code in code_texts(doc.read_text()) for t in MAKE_RE.findall(code)}
    missing = sorted(named - makefile_targets())
    assert not missing, f"{doc_id(doc)} names make targets the Makefile lacks: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_relative_links_resolve(doc: Path):
    broken = []
    for target in LINK_RE.findall(FENCE_RE.sub("", doc.read_text())):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(target)
    assert not broken, f"{doc_id(doc)} has links to nothing: {broken}"


def test_the_readme_links_every_doc():
    """The README's "Read on" list has one line per page of docs/."""
    readme = (ROOT / "README.md").read_text()
    unlisted = [doc_id(d) for d in DOCS[1:] if f"- [{doc_id(d)}]({doc_id(d)}):" not in readme]
    assert not unlisted, f"README.md has no line for {unlisted}"


def test_the_checks_see_what_the_docs_write():
    """The patterns find paths, tree entries, modules and targets as the docs write them."""
    text = (
        "See `miles/lora/layer.py`, [the doc](docs/RELIABILITY.md) and configs/adapters/{add,sub}.yaml.\n"
        "Not https://github.com/o/r/blob/main/miles/x.py nor .cache/tiny_base/miles/y.py.\n"
        "```\nmiles/\n  lora/                 the layer\n    layer.py            notes,\n"
        "                        continued notes.py here\n  ray/multi_lora/       paths\n"
        "  a.py, b.py            two files\nscripts/              tools\n```\n"
        "Run `python -m miles.recipes.tiny_base` or `make demo`; `miles.backends.base.TrainingBackend`.\n"
    )
    assert named_paths(text) == {"miles/lora/layer.py", "docs/RELIABILITY.md", "configs/adapters/add.yaml",
                                 "configs/adapters/sub.yaml", "miles/", "scripts/"}
    assert tree_paths(text) == {"miles/", "miles/lora/", "miles/lora/layer.py", "miles/ray/multi_lora/",
                                "miles/a.py", "miles/b.py", "scripts/"}
    assert set(MODULE_RE.findall(text)) == {"miles.recipes.tiny_base", "miles.backends.base.TrainingBackend"}
    assert {t for c in code_texts(text) for t in MAKE_RE.findall(c)} == {"demo"}
    assert module_problem("miles.backends.base.TrainingBackend") is None
    assert module_problem("miles.backends.base.NoSuchThing") is not None
    assert not exists("miles/no_such_file.py")
    assert {"demo", "test", "install"} <= makefile_targets()
    assert slug("Status of the GPU paths") == "status-of-the-gpu-paths"
