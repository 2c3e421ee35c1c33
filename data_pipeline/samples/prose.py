"""General prose sample corpus: the Python language reference topics shipped with every
Python (``pydoc_data.topics``) and the English docstrings of standard-library modules, classes
and functions (read with ``ast``, nothing imported)."""

from __future__ import annotations

import ast
import json
import os
import random

from data_pipeline.samples.stdlib_files import read_source, stdlib_files

MIN_DOCSTRING = 200


def module_prose(source: str, module: str) -> str:
    """The module's long docstrings as one document, headed by what each one documents."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ""
    parts = []
    doc = ast.get_docstring(tree)
    if doc and len(doc) >= MIN_DOCSTRING:
        parts.append(f"{module}\n\n{doc}")
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= MIN_DOCSTRING:
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                parts.append(f"The {kind} {node.name} of {module}.\n\n{doc}")
    return "\n\n".join(parts)


def generate(out_path: str, seed: int, max_bytes: int = 1_500_000) -> None:
    from pydoc_data.topics import topics

    docs = [{"text": topics[k].strip(), "source": f"pydoc_data.topics:{k}"} for k in sorted(topics)]
    files = sorted(stdlib_files(), key=lambda f: (-os.path.getsize(f[1]), f[0]))  # docstring-rich first
    total = sum(len(d["text"]) for d in docs)
    for rel, path in files:
        if total >= max_bytes:
            break
        module = rel[:-3].replace("/", ".").removesuffix(".__init__")
        text = module_prose(read_source(path), module)
        if text:
            docs.append({"text": text, "source": rel})
            total += len(text)
    random.Random(seed + 1).shuffle(docs)
    with open(out_path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d) + "\n")
