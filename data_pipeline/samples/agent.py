"""Long-context agent sample corpus: multi-turn tool-using episodes whose tool results are the real
outputs of running the calls in a sandbox folder (:mod:`data_pipeline.samples.sandbox`).

An episode is ``{"messages": [...]}`` with system / user / assistant (optionally ``tool_calls``:
``[{"name", "arguments"}]``) / tool (``name``, ``content``) turns. Tasks read standard-library
sources, write and analyse data files, debug failing scripts and check computations, so lengths
range from a few hundred to tens of thousands of characters.
"""

from __future__ import annotations

import json
import os
import random
import tempfile

from data_pipeline.samples.sandbox import Sandbox
from data_pipeline.samples.stdlib_files import read_source, stdlib_files

SYSTEM = (
    "You are a careful software agent working in a sandbox folder. Tools: "
    "python(code) runs a Python snippet and returns its output; read_file(path); "
    "write_file(path, content); list_dir(path). Call tools to find facts, then answer from "
    "their results only."
)

AST_SUMMARY = """import ast
tree = ast.parse(open({path!r}, encoding="utf-8").read())
funcs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
print("functions:", len(funcs))
print("classes:", len(classes))
if funcs:
    longest = max(funcs, key=lambda n: (n.end_lineno - n.lineno, n.name))
    print("longest function:", longest.name, longest.end_lineno - longest.lineno + 1, "lines")
"""


class Episode:
    def __init__(self, sandbox: Sandbox, name: str, user: str):
        self.sandbox, self.name = sandbox, name
        self.messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]

    def call(self, thought: str, tool: str, **arguments) -> str:
        self.messages.append({"role": "assistant", "content": thought,
                              "tool_calls": [{"name": tool, "arguments": arguments}]})
        out = self.sandbox.call(self.name, tool, arguments)
        self.messages.append({"role": "tool", "name": tool, "content": out})
        return out

    def answer(self, text: str) -> dict:
        self.messages.append({"role": "assistant", "content": text})
        return {"messages": self.messages}


def _last_lines(text: str, n: int = 3) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


def explore_module(ep: Episode, r: random.Random, files: list) -> dict:
    rel, path = r.choice(files)
    name = os.path.basename(rel)
    ep.sandbox.setup(ep.name, name, read_source(path))
    ep.call("Let me check the folder.", "list_dir", path=".")
    ep.call(f"Now I'll read {name} to see how it is organised.", "read_file", path=name)
    out = ep.call("To count precisely I'll parse it with ast.", "python", code=AST_SUMMARY.format(path=name))
    return ep.answer(f"From the ast summary of {name}:\n{out.strip()}")


def csv_stats(ep: Episode, r: random.Random, files: list) -> dict:
    cols = r.sample(["temperature", "pressure", "load", "latency_ms", "price", "count"], 3)
    rows = [",".join(cols)] + [",".join(str(round(r.uniform(0, 500), 2)) for _ in cols)
                               for _ in range(r.randint(20, 300))]
    ep.call("I'll write the measurements to data.csv.", "write_file", path="data.csv", content="\n".join(rows) + "\n")
    code = ("import csv, statistics\nrows = list(csv.DictReader(open('data.csv')))\n"
            "print('rows:', len(rows))\nfor col in rows[0]:\n    vals = [float(x[col]) for x in rows]\n"
            "    print(f'{col}: mean={statistics.mean(vals):.3f} max={max(vals):.2f} min={min(vals):.2f}')\n")
    out = ep.call("Now compute per-column statistics.", "python", code=code)
    return ep.answer(f"The statistics of data.csv are:\n{out.strip()}")


BUGS = [
    ("values = [3, 1, 4, 1, 5, 9, 2, 6]\ntotal = 0\nfor i in range(len(values) + 1):\n    total += values[i]\nprint('sum', total)\n",
     "values = [3, 1, 4, 1, 5, 9, 2, 6]\ntotal = 0\nfor i in range(len(values)):\n    total += values[i]\nprint('sum', total)\n",
     "the loop ran one index past the end of the list"),
    ("def mean(xs):\n    return sum(xs) / len(xs)\n\nprint(mean([]))\n",
     "def mean(xs):\n    return sum(xs) / len(xs) if xs else 0.0\n\nprint(mean([]))\n",
     "mean() divided by zero for an empty list"),
    ("counts = {}\nfor word in 'a b a c b a'.split():\n    counts[word] += 1\nprint(sorted(counts.items()))\n",
     "counts = {}\nfor word in 'a b a c b a'.split():\n    counts[word] = counts.get(word, 0) + 1\nprint(sorted(counts.items()))\n",
     "the dict was incremented before a key existed"),
    ("import json\nconfig = json.loads('{\"steps\": 10, \"lr\": 0.1,}')\nprint(config['steps'])\n",
     "import json\nconfig = json.loads('{\"steps\": 10, \"lr\": 0.1}')\nprint(config['steps'])\n",
     "the JSON text had a trailing comma"),
    ("name = 'agent'\nprint(nmae.upper())\n", "name = 'agent'\nprint(name.upper())\n",
     "a variable name was misspelled"),
]


def debug_script(ep: Episode, r: random.Random, files: list) -> dict:
    bad, good, why = r.choice(BUGS)
    ep.call("I'll save the script as it was given.", "write_file", path="script.py", content=bad)
    run = "import runpy\nrunpy.run_path('script.py', run_name='__main__')\n"
    err = ep.call("Run it to see the failure.", "python", code=bad)
    ep.call(f"The error was:\n{_last_lines(err, 1)}\nThe cause: {why}. I'll fix the script.",
            "write_file", path="script.py", content=good)
    out = ep.call("Run the fixed script.", "python", code=run)
    return ep.answer(f"Fixed: {why}. The script now prints:\n{out.strip()}")


def word_count(ep: Episode, r: random.Random, files: list) -> dict:
    from pydoc_data.topics import topics

    key = r.choice(sorted(topics))
    ep.sandbox.setup(ep.name, "topic.txt", topics[key])
    ep.call("Let me look at the text first.", "read_file", path="topic.txt")
    k = r.randint(3, 8)
    code = ("import collections, re\nwords = re.findall(r'[a-z]+', open('topic.txt').read().lower())\n"
            f"print('words:', len(words))\nfor w, c in collections.Counter(words).most_common({k}):\n"
            "    print(w, c)\n")
    out = ep.call(f"Count the {k} most common words.", "python", code=code)
    return ep.answer(f"Top {k} words in the '{key}' topic:\n{out.strip()}")


def number_check(ep: Episode, r: random.Random, files: list) -> dict:
    n = r.randint(50, 5000)
    sieve = (f"n = {n}\nflags = [True] * (n + 1)\nflags[0:2] = [False, False]\nfor i in range(2, int(n ** 0.5) + 1):\n"
             "    if flags[i]:\n        flags[i * i::i] = [False] * len(flags[i * i::i])\n"
             "primes = [i for i, f in enumerate(flags) if f]\nprint(len(primes), primes[-5:])\n")
    first = ep.call(f"Count primes up to {n} with a sieve.", "python", code=sieve)
    check = (f"def is_prime(k):\n    return k > 1 and all(k % d for d in range(2, int(k ** 0.5) + 1))\n"
             f"print(sum(is_prime(k) for k in range(2, {n} + 1)))\n")
    second = ep.call("Cross-check with trial division.", "python", code=check)
    return ep.answer(f"Sieve: {first.strip()}\nTrial division count: {second.strip()}")


def search_project(ep: Episode, r: random.Random, files: list) -> dict:
    chosen = r.sample(files, r.randint(2, 4))
    for rel, path in chosen:
        ep.sandbox.setup(ep.name, f"src/{os.path.basename(rel)}", read_source(path))
    ep.call("List the project.", "list_dir", path="src")
    word = r.choice(["return", "self", "raise", "import", "yield", "lambda"])
    code = ("import os\nfor name in sorted(os.listdir('src')):\n    text = open(os.path.join('src', name)).read()\n"
            f"    print(name, text.count({word!r}), len(text.splitlines()))\n")
    out = ep.call(f"Count '{word}' and lines per file.", "python", code=code)
    best = max(out.strip().splitlines(), key=lambda line: int(line.split()[1]))
    target = best.split()[0]
    ep.call(f"{target} uses it most; I'll read it.", "read_file", path=f"src/{target}")
    return ep.answer(f"Occurrences of '{word}' (count, lines) per file:\n{out.strip()}\n{target} has the most.")


TASKS = [
    (explore_module, "How many top-level functions and classes does {m} define, and which function is longest?"),
    (csv_stats, "Record these sensor readings in a CSV file and report each column's mean, max and min."),
    (debug_script, "This script crashes. Find the bug, fix it, and show the fixed output."),
    (word_count, "Which words are most frequent in topic.txt?"),
    (number_check, "How many primes are there below a bound? Verify the count two ways."),
    (search_project, "Which file of the project in src/ uses a keyword most?"),
]


def generate(out_path: str, seed: int, episodes: int = 600) -> None:
    r = random.Random(seed)
    files = [f for f in stdlib_files() if os.path.getsize(f[1]) <= 40_000]
    with tempfile.TemporaryDirectory(prefix="agent-sandbox-") as root, Sandbox(root) as sandbox, \
            open(out_path, "w", encoding="utf-8") as f:
        for i in range(episodes):
            task, prompt = r.choice(TASKS)
            m = os.path.basename(r.choice(files)[0])
            ep = Episode(sandbox, f"ep{i:05d}", prompt.format(m=m))
            if task is explore_module:
                files_m = [x for x in files if os.path.basename(x[0]) == m]
                record = task(ep, r, files_m)
            else:
                record = task(ep, r, files)
            f.write(json.dumps(record) + "\n")
