"""Real tools for generated agent trajectories: a child Python process (isolated mode, fixed hash
seed) that runs snippets and file operations inside a sandbox folder and returns their actual
output. Tracebacks keep only the snippet's own frames so outputs do not depend on the machine.

Protocol: one JSON request per line on stdin, one JSON reply per line on stdout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

READ_LIMIT = 16_000  #: read_file returns at most this many characters (then says how many are left)
OUTPUT_LIMIT = 6_000


class Sandbox:
    """Tool calls against one root folder; each episode works in its own sub-folder."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)
        env = {"PATH": os.environ.get("PATH", ""), "PYTHONHASHSEED": "0", "LC_ALL": "C.UTF-8"}
        self.proc = subprocess.Popen([sys.executable, "-I", "-u", __file__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, encoding="utf-8", env=env,
                                     cwd=self.root)

    def call(self, episode: str, name: str, arguments: dict) -> str:
        cwd = os.path.join(self.root, episode)
        os.makedirs(cwd, exist_ok=True)
        self.proc.stdin.write(json.dumps({"cwd": cwd, "tool": name, "args": arguments}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"sandbox process died (exit code {self.proc.poll()})")
        return json.loads(line)["output"]

    def setup(self, episode: str, path: str, content: str) -> None:
        """Put a file into the episode's folder before it starts (the task's environment)."""
        full = os.path.join(self.root, episode, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w", encoding="utf-8") as f:
            f.write(content)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# --- the child side (stdlib only) ---------------------------------------------------------------


def _run_python(code: str) -> str:
    import contextlib
    import io
    import signal
    import traceback

    out = io.StringIO()
    signal.alarm(10)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            exec(compile(code, "<cell>", "exec"), {"__name__": "__main__"})
    except BaseException as e:  # the snippet's own error is the tool's output
        tb = e.__traceback__
        frames = [f for f in traceback.extract_tb(tb) if f.filename == "<cell>"]
        lines = code.splitlines()
        out.write("Traceback (most recent call last):\n")
        for f in frames:
            out.write(f'  File "<cell>", line {f.lineno}, in {f.name}\n')
            if 0 < f.lineno <= len(lines):
                out.write(f"    {lines[f.lineno - 1].strip()}\n")
        out.write("".join(traceback.format_exception_only(type(e), e)))
    finally:
        signal.alarm(0)
    text = out.getvalue()
    return text if len(text) <= OUTPUT_LIMIT else text[:OUTPUT_LIMIT] + f"\n... [{len(text) - OUTPUT_LIMIT} more characters]"


def _serve_one(req: dict) -> str:
    os.chdir(req["cwd"])
    args = req["args"]
    tool = req["tool"]
    if tool == "python":
        return _run_python(args["code"])
    if tool == "write_file":
        os.makedirs(os.path.dirname(args["path"]) or ".", exist_ok=True)
        with open(args["path"], "w", encoding="utf-8") as f:
            f.write(args["content"])
        return f"wrote {len(args['content'].encode())} bytes to {args['path']}"
    if tool == "read_file":
        try:
            with open(args["path"], encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            return f"error: {e.strerror}: {args['path']}"
        if len(text) > READ_LIMIT:
            return text[:READ_LIMIT] + f"\n... [truncated: {len(text) - READ_LIMIT} more characters]"
        return text
    if tool == "list_dir":
        path = args.get("path", ".")
        try:
            names = sorted(os.listdir(path))
        except OSError as e:
            return f"error: {e.strerror}: {path}"
        rows = [f"{n}/" if os.path.isdir(os.path.join(path, n)) else f"{n}  {os.path.getsize(os.path.join(path, n))} bytes"
                for n in names]
        return "\n".join(rows) if rows else "(empty)"
    return f"error: unknown tool {tool!r}"


def serve() -> None:
    for line in sys.stdin:
        reply = {"output": _serve_one(json.loads(line))}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve()
