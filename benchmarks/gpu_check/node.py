"""``make gpu-check`` on a GPU node: the machine's own Python, torch and Triton, the rest from
``wheels/``, no package index.

Run by the node's interpreter (``python3`` on PATH, or ``GPU_PYTHON``):

1. stops in one line, before any work, if that Python's torch or Triton is outside
   :data:`SUPPORTED`;
2. installs from ``wheels/`` (``make gpu-wheels``) only what that Python lacks (or has at another
   version), with ``--no-index --no-deps``, into ``.gpu-packages/`` (``pip --target``): never torch,
   triton or numpy, and nothing into the image's own site-packages. No venv: a venv made from an
   image's Python that is itself a venv would not see that venv's torch. Prints what it took from
   where and how long it took, and checks that torch's version and path are unchanged;
3. runs ``python -m benchmarks.gpu_check`` on that Python, ``.gpu-packages`` first on its
   ``PYTHONPATH``, with the given arguments.

Standard library only: nothing of the project is importable before step 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

from benchmarks.gpu_check.wheelhouse import IMAGE, REPO, REQUIREMENTS, in_image, normalize

#: [lowest, first unsupported) (major, minor): torch 2.11 + Triton 3.6 are NVIDIA's CUDA 13 images'
#: (and the lent nodes'); torch 2.13 + Triton 3.9 are what the suite runs (CI)
SUPPORTED = {"torch": ((2, 11), (2, 14)), "triton": ((3, 6), (3, 10))}

_PROBE = """
import importlib.metadata as md, importlib.util, json, sys
out = {}
for name in sys.argv[1:]:
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        out[name] = None
        continue
    spec = importlib.util.find_spec(name.replace("-", "_")) if name in ("torch", "triton", "numpy") else None
    out[name] = [dist.version, (spec.origin if spec else None) or str(dist.locate_file(""))]
print(json.dumps(out))
"""


def with_packages(site: str | None) -> dict:
    """The environment that puts ``site`` first on the path (``None``: as it is)."""
    env = dict(os.environ)
    if site:
        env["PYTHONPATH"] = os.pathsep.join([site, *filter(None, [env.get("PYTHONPATH")])])
    return env


def installed(names: list[str], site: str | None = None) -> dict[str, list | None]:
    """{name: [version, path] or None} as this Python sees them with ``site`` first on its path
    (read in a fresh process; the packages are not imported)."""
    out = subprocess.run([sys.executable, "-c", _PROBE, *names], capture_output=True, text=True, check=True,
                         env=with_packages(site))
    return json.loads(out.stdout)


def _minor(version: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def unsupported(found: dict) -> str | None:
    """The one-line refusal for versions outside :data:`SUPPORTED` (or absent), else None."""
    def describe(name):
        lo, hi = SUPPORTED[name]
        return f"{name} >={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}"

    bad = [n for n in SUPPORTED if found.get(n) is None
           or not SUPPORTED[n][0] <= _minor(found[n][0]) < SUPPORTED[n][1]]
    if not bad:
        return None
    have = ", ".join(f"{n} {found[n][0] if found.get(n) else 'not installed'}" for n in SUPPORTED)
    return (f"error: {sys.executable} has {have}; gpu-check supports "
            f"{' and '.join(describe(n) for n in SUPPORTED)}")


def read_requirements(path: str) -> list[tuple[str, str]]:
    reqs = []
    with open(path) as f:
        for line in f:
            line = line.split("#")[0].strip()
            if line:
                name, _, version = line.partition("==")
                reqs.append((normalize(name), version))
    return reqs


def install(wheels: str, site: str) -> tuple[list[str], list[str], float]:
    """Install from ``wheels`` into ``site`` what this Python lacks (or has at another version):
    (taken from the wheels, already there, seconds)."""
    reqs = [r for r in read_requirements(os.path.join(wheels, REQUIREMENTS)) if not in_image(r[0])]
    have = installed([n for n, _ in reqs], site)
    there = [f"{n}=={v}" for n, v in reqs if have[n] and have[n][0] == v]
    take = [f"{n}=={v}" for n, v in reqs if not (have[n] and have[n][0] == v)]
    t0 = time.perf_counter()
    if take:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
        env["PIP_CONFIG_FILE"] = os.devnull  # no index, find-links or constraints from pip.conf
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                        "--no-index", "--no-deps", "--no-compile", "--upgrade", "--find-links", wheels,
                        "--target", site, *take], check=True, env=env)
    return take, there, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheels", default=os.path.join(REPO, "wheels"))
    ap.add_argument("--site", default=os.path.join(REPO, ".gpu-packages"))
    args, check_args = ap.parse_known_args(argv)
    found = installed(list(IMAGE))
    refusal = unsupported(found)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    if not os.path.exists(os.path.join(args.wheels, REQUIREMENTS)):
        print(f"error: {args.wheels}/{REQUIREMENTS} not found: run `make gpu-wheels PYTHON_VERSION="
              f"{sys.version_info[0]}.{sys.version_info[1]}` where a package index is reachable and copy "
              f"wheels/ here", file=sys.stderr)
        return 2
    take, there, seconds = install(args.wheels, args.site)
    after = installed(list(IMAGE), args.site)
    for name in IMAGE:
        print(f"from the image: {name} {found[name][0] if found[name] else '-'} ({found[name][1] if found[name] else '-'})")
        if after[name] != found[name]:
            print(f"error: {name} changed from {found[name]} to {after[name]}", file=sys.stderr)
            return 1
    print(f"already there: {', '.join(there) or 'nothing'}")
    print(f"from {args.wheels} (no index, {seconds:.1f} s): {', '.join(take) or 'nothing'}", flush=True)
    os.chdir(REPO)  # the check replaces this process: a time limit's signal reaches it
    os.execve(sys.executable, [sys.executable, "-m", "benchmarks.gpu_check", *check_args], with_packages(args.site))


if __name__ == "__main__":
    raise SystemExit(main())
