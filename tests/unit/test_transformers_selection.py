"""The engine-free suite runs once, on the transformers the main environment has; on the other transformers
versions (5.12, TokenSpeed's pin and this library's floor, and the newest 5.x) scripts/test.sh runs only the
tests marked ``transformers``: what depends on the version (remote code, config parsing and rope forms,
tokenizers and chat templates, cache and output classes, loading and saving).

What keeps that selection honest: every module of the library that imports transformers (or tokenizers) must
be imported by at least one test module that carries the marker, read from the sources themselves, so a new
module that uses transformers is not left out of the other versions' runs unnoticed."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from tests.support.paths import ROOT

VERSIONED = {"transformers", "tokenizers"}  # the libraries whose version the selection follows
PACKAGE = "eagle31_mla"
MARKER = "transformers"


def _imports(tree: ast.AST) -> list[tuple[str, list[str]]]:
    """(module, names) of every import statement, at any depth (imports inside functions count)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def modules_using_transformers(src: Path) -> set[str]:
    """Dotted names of the modules under ``src/eagle31_mla`` that import a versioned library."""
    using = set()
    for path in sorted((src / PACKAGE).rglob("*.py")):
        tree = ast.parse(path.read_text())
        if any(module.split(".")[0] in VERSIONED for module, _ in _imports(tree)):
            using.add(".".join(path.relative_to(src).with_suffix("").parts).removesuffix(".__init__"))
    return using


def is_marked(tree: ast.AST) -> bool:
    """Whether a test module carries ``pytest.mark.transformers`` (module ``pytestmark`` or a test's decorator)."""
    return any(
        isinstance(node, ast.Attribute) and node.attr == MARKER and getattr(node.value, "attr", None) == "mark"
        for node in ast.walk(tree)
    )


def _library_modules(module: str, names: list[str]) -> set[str]:
    """The library modules an import statement loads: ``from eagle31_mla import X`` is resolved to where X lives."""
    if module != PACKAGE:
        return {module} if module.startswith(PACKAGE + ".") else set()
    package = importlib.import_module(PACKAGE)
    loaded = set()
    for name in names:
        value = getattr(package, name, None)
        if value is None:  # a submodule imported by name
            loaded.add(f"{PACKAGE}.{name}")
        else:
            loaded.add(getattr(value, "__name__", None) if isinstance(value, type(package)) else value.__module__)
    return loaded


def _loaded_by_package(module: str, src: Path) -> set[str]:
    """The submodules a package's ``__init__`` imports at module level: importing the package loads them too
    (``from eagle31_mla.cli import main`` loads every subcommand module)."""
    init = src.joinpath(*module.split("."), "__init__.py")
    if not init.is_file():
        return set()
    loaded = set()
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            loaded |= {f"{module}.{node.module}"} if node.module else {f"{module}.{a.name}" for a in node.names}
    return loaded


def uncovered(src: Path, tests: Path) -> list[str]:
    """The modules using transformers that no marked test module imports (empty when the selection covers them)."""
    covered = set()
    for path in sorted(tests.rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        if is_marked(tree):
            for module, names in _imports(tree):
                for loaded in _library_modules(module, names):
                    covered |= {loaded, *_loaded_by_package(loaded, src)}
    return sorted(modules_using_transformers(src) - covered)


def test_every_module_that_imports_transformers_is_in_the_selection():
    assert modules_using_transformers(ROOT / "src") >= {
        f"{PACKAGE}.model.modeling_eagle31_mla",
        f"{PACKAGE}.cli.acceptance",
        f"{PACKAGE}.cli.capture",
        f"{PACKAGE}.cli.train",
    }
    missing = uncovered(ROOT / "src", ROOT / "tests")
    assert not missing, (
        f"these modules import transformers, but no test module marked `{MARKER}` imports them, so the other "
        f"transformers versions would not test them: {missing}"
    )


def test_the_check_can_fail(tmp_path):
    """A new module that imports transformers, imported only by an unmarked test, is reported; marking that test
    module covers it. A marked test importing a package covers the submodules the package's ``__init__`` imports
    (the CLI's subcommands), and only those."""
    package = tmp_path / "src" / PACKAGE / "tool"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from . import loaded\n\n\ndef main():\n    from . import lazy\n")
    for path in (package / "loaded.py", package / "lazy.py", package.parent / "brand_new.py"):
        path.write_text("def f():\n    from transformers import AutoConfig\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_tool.py").write_text(
        f"import pytest\nfrom {PACKAGE}.tool import main\n\npytestmark = pytest.mark.{MARKER}\n"
    )
    test = tmp_path / "tests" / "test_new.py"
    test.write_text(f"from {PACKAGE}.brand_new import f\n")
    assert uncovered(tmp_path / "src", tmp_path / "tests") == [f"{PACKAGE}.brand_new", f"{PACKAGE}.tool.lazy"]
    test.write_text(f"import pytest\nfrom {PACKAGE}.brand_new import f\n\npytestmark = pytest.mark.{MARKER}\n")
    assert uncovered(tmp_path / "src", tmp_path / "tests") == [f"{PACKAGE}.tool.lazy"]
