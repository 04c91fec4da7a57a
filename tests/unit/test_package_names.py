"""Installed, Sluice takes one top-level import name, `sluice_inference`; the repository's top-level folders
are reached through the links in `sluice_inference/` (its docstring says why).

A file imported under its old name (`common.client`) as well as its package name would load twice, with
two copies of every class and global, and an installed wheel has no `common` at all (or a user's own): so
no code, test, script, command or doc of the tree may name a module by an old top-level name.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "sluice_inference"
OLD = ("common", "router", "worker", "cli", "bench")
_OLD = "|".join(OLD)
# An import statement written in a string or a doc, `python -m OLD...`, and argv lists `"-m", "OLD..."`.
TEXT_PATTERNS = (
    re.compile(
        rf"^[ \t>#*`$]*(?:>>>\s+|\.\.\.\s+)?from[ \t]+(?:{_OLD})(?:\.\w+)*[ \t]+import\b", re.MULTILINE
    ),
    re.compile(
        rf"^[ \t>#*`$]*(?:>>>\s+|\.\.\.\s+)?import[ \t]+(?:{_OLD})(?:\.\w+)*(?:[ \t]+as\b|[ \t]*$)",
        re.MULTILINE,
    ),
    re.compile(rf"(?<![\w-])-m[ \t]+(?:{_OLD})(?:\.\w+)*(?![\w/-])"),
    re.compile(rf"([\"'])-m\1\s*,\s*([\"'])(?:{_OLD})(?:\.\w+)*\2"),
)
SKIPPED_DIRS = {".git", ".venv", "build", "node_modules", "__pycache__", ".mypy_cache", ".ruff_cache"}
BINARY = {".png", ".jpg", ".svg", ".pdf", ".pt", ".pt2", ".onnx", ".whl", ".gz"}
THIS = Path(__file__).resolve()


def _tree_files() -> list[Path]:
    """The checkout's files (tracked, and untracked ones git does not ignore); symlinks left out."""
    try:
        listed = subprocess.run(
            ["git", "-C", str(REPO), "ls-files", "-z", "-co", "--exclude-standard"],
            check=True, capture_output=True, timeout=60,
        ).stdout.decode()  # fmt: skip
        names = [n for n in listed.split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        names = []
        for root, dirs, files in os.walk(REPO):
            dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and not d.endswith(".egg-info")]
            names += [str((Path(root) / f).relative_to(REPO)) for f in files]
    paths = [REPO / n for n in names if not set(Path(n).parts) & SKIPPED_DIRS]
    return [p for p in paths if p.is_file() and not p.is_symlink() and p.suffix not in BINARY]


def _old_imports(path: Path) -> list[str]:
    """Absolute imports of an old top-level name in one Python file, as `file:line: module`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        else:
            continue
        rel = path.relative_to(REPO)
        found += [f"{rel}:{node.lineno}: {m}" for m in modules if m.split(".")[0] in OLD]
    return found


def test_no_python_file_imports_an_old_top_level_name() -> None:
    found = [hit for path in _tree_files() if path.suffix in (".py", ".pyi") for hit in _old_imports(path)]
    assert found == [], f"import these as {PACKAGE}.<name>"


def test_no_string_script_or_doc_names_a_module_by_an_old_top_level_name() -> None:
    found = []
    for path in _tree_files():
        if path == THIS:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for pattern in TEXT_PATTERNS:
            for match in pattern.finditer(text):
                line = text.count("\n", 0, match.start()) + 1
                found.append(f"{path.relative_to(REPO)}:{line}: {match.group(0).strip()}")
    assert found == [], f"name these modules {PACKAGE}.<name>"


def test_the_package_links_to_each_top_level_folder() -> None:
    package = REPO / PACKAGE
    assert (package / "__init__.py").is_file() and not (package / "__init__.py").is_symlink()
    for name in OLD:
        link = package / name
        assert link.is_symlink(), f"{link} must be a link, or the source would exist twice"
        assert os.readlink(link) == f"../{name}", "relative, so checkouts and the Docker context keep it"
        assert link.resolve() == (REPO / name).resolve()


def test_only_the_package_is_packaged_and_the_docker_build_copies_what_it_links_to() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["tool"]["setuptools"]["packages"]["find"]["include"] == [f"{PACKAGE}*"]
    assert pyproject["project"]["scripts"]["sluice"].startswith(f"{PACKAGE}.")
    dockerfile = re.sub(r"\\\n", " ", (REPO / "deploy" / "docker" / "Dockerfile").read_text())
    copied = {
        part.rstrip("/")
        for line in dockerfile.splitlines()
        if line.strip().upper().startswith("COPY ") and "--from" not in line
        for part in line.split()[1:-1]
    }
    assert {PACKAGE, *OLD} <= copied, "the links in the image must point at copied folders"
