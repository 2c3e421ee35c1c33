"""The project's import graph, read from the source (every ``import``, inside functions too): no
cycle between modules, packages import one way (docs/design.md, "Packages and the import
direction"), apart from the named exceptions below, each with the reason it is still there, and
no module uses another package's private names (``from pkg.mod import _name``, ``mod._name``)."""

import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("pretrain", "planner", "checkpointing", "model_providers", "parallel", "data_pipeline", "benchmarks")

#: package -> the packages it may import (docs/design.md)
MAY_IMPORT = {
    "benchmarks": set(PACKAGES),
    "planner": {"pretrain", "checkpointing", "model_providers", "parallel"},
    "pretrain": {"checkpointing", "model_providers", "data_pipeline", "parallel"},
    "model_providers": {"checkpointing", "parallel"},
    "checkpointing": {"parallel"},
    "parallel": set(),
    "data_pipeline": set(),
}
#: (importing module, imported module) -> why it is allowed for now
EXCEPTIONS = {
    ("data_pipeline.prepare", "parallel.megatron_compat"):
        "an entry point: its bootstrap() precedes megatron's import",
    ("data_pipeline.preprocess", "parallel.megatron_compat"):
        "an entry point: its bootstrap() precedes megatron's import",
    ("data_pipeline.prepare", "pretrain.data_prep"):
        "python -m data_pipeline.prepare is an entry point: it prepares a run's stages",
    ("model_providers.glm5.hf.cli", "pretrain.config.numbers"):
        "the HF tool checks its numbers with the run's Rule table (to move below both: issue 59)",
}


def modules(root: str) -> dict:
    """Dotted module name -> file, for the project's packages under ``root``."""
    out = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(root, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    dotted = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                    out[dotted.removesuffix(".__init__")] = path
    return out


def import_graph(root: str) -> dict:
    """Module -> the project modules it imports (``from a.b import c`` is a.b.c where that is a
    module, else a.b); relative imports are resolved against the module's package."""
    mods = modules(root)

    def known(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for mod, path in mods.items():
        package = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
        targets = set()
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets |= {known(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).strip(".")
                targets |= {known(f"{base}.{a.name}") or known(base) for a in node.names}
        graph[mod] = targets - {"", mod}
    return graph


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def upward_imports(graph: dict) -> list:
    """(module, imported module) pairs that cross packages against :data:`MAY_IMPORT`."""
    return sorted((m, t) for m, targets in graph.items() for t in targets
                  if m.split(".")[0] != t.split(".")[0] and t.split(".")[0] not in MAY_IMPORT[m.split(".")[0]])


def private_uses(root: str) -> list:
    """(module, imported module, name) for each private name (one underscore) a module takes from
    another package's module, imported by name or read as an attribute of the imported module."""
    mods = modules(root)
    found = set()
    for mod, path in mods.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        aliases = {}  #: local name -> the project module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in mods:
                        aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in mods:
                for a in node.names:
                    if f"{node.module}.{a.name}" in mods:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                    elif a.name.startswith("_") and not a.name.startswith("__"):
                        found.add((mod, node.module, a.name))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                found.add((mod, aliases[node.value.id], node.attr))
    return sorted((m, t, n) for m, t, n in found if m.split(".")[0] != t.split(".")[0])


def test_no_module_imports_itself_through_others():
    assert cycles(import_graph(REPO)) == []


def test_packages_import_one_way():
    upward = upward_imports(import_graph(REPO))
    assert [e for e in upward if e not in EXCEPTIONS] == []
    assert set(EXCEPTIONS) <= set(upward)  # an exception that is gone is taken off the list


def test_no_package_uses_another_packages_private_names():
    assert private_uses(REPO) == []


def test_nothing_outside_the_tests_imports_test_code():
    """benchmarks/ and the packages run where tests/ may not be (a GPU node, an installed copy)."""
    found = []
    for mod, path in modules(REPO).items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        found += [(mod, n.module or "") for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0
                  and (n.module or "").split(".")[0] == "tests"]
        found += [(mod, a.name) for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
                  if a.name.split(".")[0] == "tests"]
    assert found == []


@pytest.fixture
def planted(tmp_path):
    """A copy of two packages' files with a cycle and an upward import planted."""
    for package, files in {"parallel": {"__init__.py": "", "a.py": "from parallel import b\n",
                                        "b.py": "def f():\n    from parallel.a import x\n"},
                           "pretrain": {"__init__.py": "", "run.py": "import parallel.a\n",
                                        "step.py": "from parallel.b import _hidden\nimport parallel.a as a\n"
                                                   "x = a._state\n"}}.items():
        (tmp_path / package).mkdir()
        for name, text in files.items():
            (tmp_path / package / name).write_text(text)
    (tmp_path / "parallel" / "c.py").write_text("from ..pretrain import run\n")
    return tmp_path


def test_the_checks_find_a_planted_cycle_and_upward_import(planted):
    graph = import_graph(str(planted))
    assert cycles(graph) == [["parallel.a", "parallel.b"]]
    assert upward_imports(graph) == [("parallel.c", "pretrain.run")]


def test_the_check_finds_planted_private_uses(planted):
    assert private_uses(str(planted)) == [("pretrain.step", "parallel.a", "_state"),
                                          ("pretrain.step", "parallel.b", "_hidden")]
