"""``make gpu-wheels PYTHON_VERSION=3.12``: the wheels a GPU node without a package index needs.

Run where the package index is reachable. It resolves the GPU path's packages (:data:`GPU_PATH`,
at the versions ``pyproject.toml`` pins) for the node's Python and platform, and downloads, as
wheels into ``wheels/``, every package of that closure that a CUDA PyTorch image lacks: not
torch, triton, numpy, ``nvidia-*``, nor what torch itself requires (the image has torch, so it has
those). A package published only as an sdist is built into a wheel here (with the node's Python
where the wheel is not pure Python). ``wheels/requirements.txt`` lists what the folder holds;
``make gpu-check`` on the node installs exactly that, with no index
(:mod:`benchmarks.gpu_check.node`). Prints the list and the size; refuses more than 60 MiB.

Standard library and pip only: it runs with whatever ``python3`` the machine has.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: what ``python -m benchmarks.gpu_check`` imports, as distributions (read off a CPU run's
#: ``sys.modules``); versions come from pyproject.toml's pins
GPU_PATH = ("megatron-core", "hydra-core", "omegaconf", "psutil")
#: what a CUDA PyTorch image has: never downloaded, never installed on the node
IMAGE = ("torch", "triton", "numpy")
MAX_MIB = 60
REQUIREMENTS = "requirements.txt"


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def in_image(name: str) -> bool:
    name = normalize(name)
    return name in IMAGE or name.startswith("nvidia-")


def pins(pyproject: str = os.path.join(REPO, "pyproject.toml")) -> dict[str, str]:
    """{normalized name: exact version} of the project's ``==`` dependencies."""
    with open(pyproject, "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    out = {}
    for dep in deps:
        m = re.fullmatch(r"\s*([A-Za-z0-9._-]+)\s*==\s*([^;\s]+)\s*", dep.split("#")[0])
        if m:
            out[normalize(m.group(1))] = m.group(2)
    return out


def platforms(arch: str) -> list[str]:
    return [f"manylinux_2_{v}_{arch}" for v in range(39, 16, -1)] + [f"manylinux2014_{arch}"]


def _pip(python: str) -> list[str]:
    return [python, "-m", "pip", "--disable-pip-version-check"]


def _target_args(python_version: str, arch: str) -> list[str]:
    args = ["--python-version", python_version, "--implementation", "cp", "--only-binary=:all:"]
    for p in platforms(arch):
        args += ["--platform", p]
    return args


def resolve(requirements: list[str], constraints: str | None, python_version: str, arch: str,
            find_links: str) -> list[dict]:
    """pip's resolution of ``requirements`` under ``constraints`` (a file, or None) for the target Python
    and platform (its ``--report``'s install list), wheels only, ``find_links`` searched beside
    the index."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        cmd = [*_pip(sys.executable), "install", "--dry-run", "--ignore-installed", "--quiet",
               "--report", report, "--target", os.path.join(tmp, "t"), "--find-links", find_links,
               *(["--constraint", constraints] if constraints else []), *_target_args(python_version, arch),
               *requirements]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            missing = re.search(r"satisfies the requirement (\S+)", proc.stderr)
            raise LookupError(missing.group(1) if missing else proc.stderr.strip()[-2000:])
        with open(report) as f:
            return json.load(f)["install"]


def _requires(item: dict) -> list[str]:
    """Names of an item's unconditional and version-marker requirements (extras left out: the
    resolver installed what the GPU path's roots need, so a marker that did not apply names a
    package the report does not hold)."""
    names = []
    for req in item["metadata"].get("requires_dist") or []:
        if "extra ==" in req.replace("extra==", "extra =="):
            continue
        names.append(normalize(re.match(r"\s*([A-Za-z0-9._-]+)", req).group(1)))
    return names


def node_closure(items: list[dict], roots: list[str]) -> list[dict]:
    """The items reachable from ``roots`` without passing through the image's packages, less
    what torch requires (transitively): what the node must be given."""
    by_name = {normalize(i["metadata"]["name"]): i for i in items}

    def reach(starts, blocked) -> set[str]:
        seen, todo = set(), [n for n in starts if n in by_name]
        while todo:
            n = todo.pop()
            if n in seen or blocked(n):
                continue
            seen.add(n)
            todo += [r for r in _requires(by_name[n]) if r in by_name]
        return seen

    image = reach(["torch"], lambda n: False) | {n for n in by_name if in_image(n)}
    needed = reach(roots, lambda n: n in image)
    return [by_name[n] for n in sorted(needed)]


def _builder(python_version: str) -> str:
    """The node's Python on this machine if it runs, else this one."""
    exe = shutil.which(f"python{python_version}")
    if exe and subprocess.run([exe, "-c", ""], capture_output=True).returncode == 0:
        return exe
    return sys.executable


def build_sdist_wheel(requirement: str, constraints: str, python_version: str, dest: str) -> str:
    """Build ``requirement`` (a pip requirement, as the resolver asked for it) from its sdist into
    ``dest``: with the node's Python if this machine has it, else with this one, accepting only a
    pure-Python result."""
    builder = _builder(python_version)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([*_pip(builder), "wheel", "--quiet", "--no-deps", "--no-binary", ":all:",
                        "--constraint", constraints, "--wheel-dir", tmp, requirement], check=True)
        (wheel,) = os.listdir(tmp)
        tag = wheel[:-4].split("-")[-3:]
        if tag[2] != "any" and builder == sys.executable and \
                f"cp{python_version.replace('.', '')}" not in tag[0]:
            raise SystemExit(f"error: {requirement} has no wheel for Python {python_version} and builds a "
                             f"platform wheel ({wheel}); run with python{python_version} on PATH")
        shutil.move(os.path.join(tmp, wheel), os.path.join(dest, wheel))
        return wheel


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python-version", default="3.12", help="the node's Python (NVIDIA's images: 3.12)")
    ap.add_argument("--arch", default="x86_64", choices=["x86_64", "aarch64"], help="the node's CPU")
    ap.add_argument("--dest", default=os.path.join(REPO, "wheels"))
    args = ap.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python_version):
        print(f"error: --python-version {args.python_version!r}: expected 3.N, e.g. 3.12", file=sys.stderr)
        return 2
    pinned = pins()
    missing = [n for n in GPU_PATH if n not in pinned]
    if missing:
        print(f"error: pyproject.toml pins no version of {', '.join(missing)}", file=sys.stderr)
        return 2
    roots = [f"{n}=={pinned[n]}" for n in GPU_PATH]
    staging = tempfile.mkdtemp(prefix="wheels-", dir=os.path.dirname(os.path.abspath(args.dest)))
    # every pin of pyproject.toml but the image's (its CUDA torch has its own triton pin)
    constraints = os.path.join(staging, "constraints.txt")
    with open(constraints, "w") as f:
        f.writelines(f"{n}=={v}\n" for n, v in pinned.items() if not in_image(n))
    try:
        built: set[str] = set()
        # first without the pins (pip then names a package it finds no wheel of, which is built
        # here from its sdist, with the pins), then with them: every pinned package at its pin
        for pinned_resolve in (False, True):
            while True:
                try:
                    items = resolve(roots, constraints if pinned_resolve else None, args.python_version,
                                    args.arch, staging)
                    break
                except LookupError as e:
                    name = str(e)
                    if pinned_resolve or "\n" in name or name in built:
                        print(f"error: pip could not resolve the GPU path for Python {args.python_version}:\n"
                              f"{name}", file=sys.stderr)
                        return 1
                    built.add(name)
                    print(f"building {name} from its sdist (no wheel for Python {args.python_version})")
                    build_sdist_wheel(name, constraints, args.python_version, staging)
        needed = node_closure(items, [normalize(r.split("==")[0]) for r in roots])
        reqs = [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in needed]
        local = {normalize(f.split("-")[0]) for f in os.listdir(staging)}
        fetch = [r for r in reqs if normalize(r.split("==")[0]) not in local]
        if fetch:
            subprocess.run([*_pip(sys.executable), "download", "--quiet", "--no-deps", "--dest", staging,
                            *_target_args(args.python_version, args.arch), *fetch], check=True)
        os.remove(constraints)
        for f in os.listdir(staging):  # built wheels the closure does not hold
            if normalize(f.split("-")[0]) not in {normalize(r.split("==")[0]) for r in reqs}:
                os.remove(os.path.join(staging, f))
        with open(os.path.join(staging, REQUIREMENTS), "w") as f:
            f.write(f"# make gpu-wheels for Python {args.python_version} {args.arch}: installed on the node "
                    f"with no index and no dependencies (benchmarks/gpu_check/node.py)\n")
            f.writelines(r + "\n" for r in reqs)
        files = sorted(f for f in os.listdir(staging) if f.endswith(".whl"))
        size = sum(os.path.getsize(os.path.join(staging, f)) for f in files)
        for f in files:
            print(f"  {os.path.getsize(os.path.join(staging, f)) / 2**20:7.2f} MiB  {f}")
        print(f"{len(files)} wheels, {size / 2**20:.1f} MiB, for Python {args.python_version} {args.arch} "
              f"(not included, the image's: {', '.join(IMAGE)}, nvidia-*, torch's requirements)")
        if size > MAX_MIB * 2**20:
            print(f"error: the wheels take {size / 2**20:.1f} MiB, more than {MAX_MIB} MiB", file=sys.stderr)
            return 1
        if os.path.exists(args.dest):
            shutil.rmtree(args.dest)
        os.replace(staging, args.dest)
        print(f"wrote {args.dest}")
        return 0
    finally:
        shutil.rmtree(staging, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
