"""The layering, read from the source: the core (``src/``) never imports an engine plugin, and no
module imports itself back through others (module-level and function-level imports alike: a lazy
import that closes a cycle is still a cycle)."""

from __future__ import annotations

import ast
import graphlib
import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

from tests.support.paths import ROOT

#: Where each top-level package lives; a module's name is its path below one of these.
#: Every plugin folder counts, so a new engine's plugin is checked without editing this file.
PLUGIN_ROOTS = tuple(sorted(path for path in (ROOT / "plugins").iterdir() if path.is_dir()))
SOURCE_ROOTS = (ROOT / "src", *PLUGIN_ROOTS)
CORE_ROOT = ROOT / "src"
PLUGIN_PACKAGES = tuple(
    package.name for root in PLUGIN_ROOTS for package in sorted(root.iterdir()) if (package / "__init__.py").is_file()
)


class Import(NamedTuple):
    module: str  # the importing module
    target: str  # the module (or module.attribute) it names, absolute
    line: int


def modules_under(roots) -> dict[str, Path]:
    """Every ``.py`` below the roots, by module name (package folders need an ``__init__.py``)."""
    found = {}
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if "__pycache__" not in path.parts:
                found[".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")] = path
    return found


def imports_of(name: str, path: Path) -> list[Import]:
    """Every import in the file, wherever it sits (module level, functions, ``if TYPE_CHECKING``),
    relative ones made absolute, plus ``importlib.import_module("...")`` / ``__import__("...")`` with a
    string literal."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(name, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            prefix = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
            # `from p import x` imports module p.x when there is one, else takes x from p (resolved in import_graph)
            found += [
                Import(name, prefix if alias.name == "*" else f"{prefix}.{alias.name}", node.lineno)
                for alias in node.names
            ]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                # import_module(".x", __package__) too
                found.append(Import(name, importlib.util.resolve_name(node.args[0].value, package), node.lineno))
    return found


def core_imports_of_plugins(core_root: Path, plugin_packages=PLUGIN_PACKAGES) -> list[Import]:
    return [
        imp
        for name, path in modules_under([core_root]).items()
        for imp in imports_of(name, path)
        if imp.target.split(".")[0] in plugin_packages
    ]


def import_graph(roots) -> dict[str, set[str]]:
    """Intra-project edges: module -> the project modules it imports (``from pkg import name`` counts
    as importing ``pkg.name`` when that is a module, else ``pkg``; imports of other projects are left out)."""
    modules = modules_under(roots)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for imp in imports_of(name, path):
            target = imp.target
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], each module importing the next, or None."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as err:  # its cycle lists each module before those that import it
        return err.args[1][::-1]
    return None


# ---- the project ---------------------------------------------------------------------------------------


def test_the_core_never_imports_a_plugin():
    found = core_imports_of_plugins(CORE_ROOT)
    listed = "\n".join(f"  {i.module}:{i.line} imports {i.target}" for i in found)
    assert not found, "src/ imports a plugin package:\n" + listed


def test_no_import_cycle():
    graph = import_graph(SOURCE_ROOTS)
    assert "eagle31_mla.serving.engines" in graph and "eagle31_mla_vllm" in graph  # the roots were read
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_engine_facts_and_rules_import_without_an_engine_or_torch():
    """The engine facts, the serve-time rules and ``serve-command`` load where neither engine (nor torch)
    is installed."""
    code = (
        "import sys\n"
        f"for name in ('vllm', 'sglang', 'tokenspeed', 'torch', 'transformers', *{PLUGIN_PACKAGES!r}):\n"
        "    sys.modules[name] = None\n"
        "import eagle31_mla.serving.engine_facts.vllm, eagle31_mla.serving.engine_facts.sglang\n"
        "import eagle31_mla.serving.engine_facts.tokenspeed\n"
        "import eagle31_mla.serving.compatibility, eagle31_mla.serving.engines, eagle31_mla.serving.command\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ---- the checker itself catches what it is for ------------------------------------------------------


def test_the_checker_finds_planted_violations(tmp_path):
    planted = {
        "src/eagle31_mla/__init__.py": "",
        "src/eagle31_mla/a.py": "from . import b\n",
        "src/eagle31_mla/b.py": "def later():\n    from .c import thing\n",
        "src/eagle31_mla/c.py": "import eagle31_mla.a\nthing = 1\n",  # a -> b -> c -> a, the middle edge lazy
        "src/eagle31_mla/d.py": "import importlib\nimportlib.import_module('eagle31_mla_vllm.x')\n",
        "src/eagle31_mla/e.py": "from eagle31_mla_sglang import register\n",
        "src/eagle31_mla/sub/__init__.py": "",
        "src/eagle31_mla/sub/f.py": "from ..e import register\n",
        "plugin/eagle31_mla_vllm/__init__.py": "from eagle31_mla import a\n",
        "plugin/eagle31_mla_vllm/model.py": "",
    }
    for relative, text in planted.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    core, roots = tmp_path / "src", [tmp_path / "src", tmp_path / "plugin"]
    found = {(i.module, i.target.split(".")[0]) for i in core_imports_of_plugins(core)}
    assert found == {("eagle31_mla.d", "eagle31_mla_vllm"), ("eagle31_mla.e", "eagle31_mla_sglang")}
    graph = import_graph(roots)
    assert "eagle31_mla.e" in graph["eagle31_mla.sub.f"]  # a relative import two levels up, resolved
    cycle = [f"eagle31_mla.{m}" for m in "abca"]
    assert find_cycle(graph) in (cycle, cycle[1:] + cycle[1:2], cycle[2:] + cycle[1:3])  # each imports the next
    (core / "eagle31_mla" / "b.py").write_text("def later():\n    pass\n")  # without the lazy import: no cycle
    assert find_cycle(import_graph(roots)) is None


# ---- no file reaches another through sys.path ---------------------------------------------------------
#
# Tests, benchmarks and scripts import the installed package (helpers the library ships live in
# eagle31_mla.testing; the suite's own in tests.support, found through pytest's rootdir), never a folder
# put on sys.path by hand.
CHECKED_FOR_SYS_PATH = ("src", "plugins", "tests", "benchmarks", "scripts")


def sys_path_edits(path: Path) -> list[int]:
    """Lines that change ``sys.path`` (a call on it, an assignment to it or an item of it), in code or in a
    string that a test runs as Python."""
    found = set()
    sources = [(path.read_text(), None)]  # (code, the file line of the string holding it)
    while sources:
        text, line = sources.pop()
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            target = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                target = node.func.value
            elif isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                target = next((t.value if isinstance(t, ast.Subscript) else t for t in targets), None)
            if target is not None and ast.unparse(target) == "sys.path":
                found.add(line or node.lineno)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "sys.path" in node.value:
                sources.append((node.value, line or node.lineno))
    return sorted(found)


def test_no_file_edits_sys_path():
    edits = {
        f"{path.relative_to(ROOT)}:{line}": line
        for folder in CHECKED_FOR_SYS_PATH
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line in sys_path_edits(path)
    }
    assert not edits, f"sys.path changed by hand at {sorted(edits)}: import the package or tests.support instead"


def test_the_sys_path_check_finds_planted_edits(tmp_path):
    planted = tmp_path / "planted.py"
    code = (  # SYS for sys: this file's own check must not see the planted edits
        "import SYS\n"
        "SYS.path.insert(0, 'x')\n"
        "SYS.path += ['y']\n"
        "SYS.path[:0] = ['z']\n"
        "SCRIPT = 'import SYS\\nSYS.path.append(1)\\n'\n"
        "print(SYS.path, SYS.argv)\n"
    )
    planted.write_text(code.replace("SYS", "sys"))
    assert sys_path_edits(planted) == [2, 3, 4, 5]
