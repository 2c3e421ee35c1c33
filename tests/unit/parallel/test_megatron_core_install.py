"""The installed megatron-core runs on this interpreter: its sources compile and every megatron
module the project imports loads. megatron-core 0.17+ declares Python >= 3.12, and the upgrade to
0.19.2 installs it past that floor on 3.11 (docs/megatron_upgrade.md): nothing but this test would
say that its sources are valid there."""

import ast
import importlib
import os
import sys

from tests.unit.test_import_graph import modules, REPO


def _megatron_imports() -> set[str]:
    """Every ``megatron...`` module the project's packages, tests and benchmarks import (a ``from
    m import n`` counts as ``m.n`` where that is a module, else ``m``)."""
    files = list(modules(REPO).values())
    for folder, _, names in os.walk(os.path.join(REPO, "tests")):
        files += [os.path.join(folder, n) for n in names if n.endswith(".py")]
    found = set()
    for path in files:
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.split(".")[0] == "megatron"}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "megatron":
                found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return found


def test_every_megatron_core_source_compiles_on_this_python():
    """Every source under megatron/core compiles, and none takes ``typing.override`` (Python 3.12;
    megatron/training, unused here, does): a module doing so fails to import on 3.11."""
    import megatron.core

    root = os.path.dirname(megatron.core.__file__)
    bad, count = [], 0
    for folder, _, names in os.walk(root):
        for name in names:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                source = f.read()
            count += 1
            try:
                tree = ast.parse(source, path)
                compile(tree, path, "exec", dont_inherit=True)
            except SyntaxError as e:
                bad.append(f"{os.path.relpath(path, root)}:{e.lineno}: {e.msg}")
                continue
            bad += [f"{os.path.relpath(path, root)}:{n.lineno}: typing.override" for n in ast.walk(tree)
                    if isinstance(n, ast.ImportFrom) and n.module == "typing"
                    and any(a.name == "override" for a in n.names)]
    assert count > 300, f"only {count} sources under {root}"  # 366 in 0.16.1, 495 in 0.19.2
    assert not bad, f"megatron-core sources that Python {sys.version.split()[0]} cannot run: {bad}"


def test_every_megatron_module_the_project_imports_loads():
    names = _megatron_imports()
    assert "megatron.core.dist_checkpointing" in names and len(names) > 40
    failed = []
    for name in sorted(names):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:  # ``from m import f``: f is a name in m, not a module
                failed.append(f"{name}: {e}")
        except Exception as e:  # noqa: BLE001 -- every failure is reported, with its module
            failed.append(f"{name}: {type(e).__name__}: {e}")
    assert not failed, failed
