"""The offline GPU node's route (``make gpu-wheels``, ``make gpu-check`` through
``benchmarks/gpu_check/node.py``): what the wheelhouse keeps of a resolution, the version gate,
and an install from a wheels folder with no index that leaves the image's torch alone."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest

from benchmarks.gpu_check import node, wheelhouse
from tests.support.launch import REPO


def _item(name: str, *requires: str) -> dict:
    return {"metadata": {"name": name, "version": "1.0", "requires_dist": list(requires)}}


def test_wheelhouse_keeps_the_closure_less_the_image():
    """Roots' requirements are followed, but not through torch, numpy, triton or nvidia-*, and
    what torch requires is the image's too; requirements behind an extra are not followed."""
    items = [_item("megatron-core", "torch>=2.6", "numpy", "packaging>=24.2"),
             _item("hydra-core", "omegaconf<2.4,>=2.2", "packaging", "typing_extensions"),
             _item("omegaconf", "PyYAML>=5.1.0", "antlr4-python3-runtime==4.9.*"),
             _item("torch", "typing-extensions>=4.10", "sympy>=1.13", "nvidia-nccl-cu13==2.29.7; platform_system == 'Linux'",
                   "triton==3.9.0"),
             _item("sympy", "mpmath<1.4"), _item("mpmath"), _item("typing-extensions"), _item("numpy"),
             _item("triton"), _item("nvidia-nccl-cu13"), _item("packaging"), _item("PyYAML"),
             _item("antlr4-python3-runtime"), _item("psutil", "pytest; extra == 'test'"), _item("pytest")]
    kept = [i["metadata"]["name"] for i in wheelhouse.node_closure(items, ["megatron-core", "hydra-core", "psutil"])]
    assert kept == ["antlr4-python3-runtime", "hydra-core", "megatron-core", "omegaconf", "packaging", "psutil",
                    "PyYAML"]


def test_wheelhouse_reads_the_pins_of_the_gpu_path():
    pins = wheelhouse.pins()
    assert all(name in pins for name in wheelhouse.GPU_PATH)
    assert pins["torch"] == "2.13.0" and all(v[0].isdigit() for v in pins.values())


@pytest.mark.parametrize("torch_version, triton_version, ok", [
    ("2.13.0+cpu", "3.9.0", True), ("2.11.0a0+gitabc", "3.6.0", True), ("2.10.0", "3.9.0", False),
    ("2.14.0", "3.9.0", False), ("2.13.0", "3.5.1", False), (None, "3.9.0", False)])
def test_version_gate_names_both_versions(torch_version, triton_version, ok):
    found = {"torch": torch_version and [torch_version, "/x"], "triton": [triton_version, "/y"]}
    refusal = node.unsupported(found)
    assert (refusal is None) == ok
    if not ok:
        assert refusal.startswith("error: ") and "\n" not in refusal
        assert f"torch {torch_version or 'not installed'}, triton {triton_version}" in refusal
        assert "torch >=2.11,<2.14 and triton >=3.6,<3.10" in refusal


def _wheel(folder, name: str, version: str) -> str:
    """A minimal pure-Python wheel of a module ``name`` that knows its version."""
    path = os.path.join(folder, f"{name}-{version}-py3-none-any.whl")
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}.py", f"VERSION = {version!r}\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def test_install_takes_only_missing_wheels_with_no_index(tmp_path):
    """From a wheels folder (its requirements.txt naming torch too, which is never installed):
    the missing package lands in the target folder, one already at its version is left, and
    torch's version and path are what they were."""
    import importlib.metadata as md

    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    _wheel(wheels, "gpu_node_probe", "1.2.3")
    have = md.version("psutil")
    (wheels / wheelhouse.REQUIREMENTS).write_text(f"# test\ngpu_node_probe==1.2.3\npsutil=={have}\ntorch==0.0.1\n")
    before = node.installed(["torch"])
    take, there, seconds = node.install(str(wheels), str(site))
    assert take == ["gpu-node-probe==1.2.3"] and there == [f"psutil=={have}"], (take, there)
    assert node.installed(["torch"], str(site)) == before and not list(site.glob("torch*"))
    out = subprocess.run([sys.executable, "-c", "import gpu_node_probe; print(gpu_node_probe.VERSION)"],
                         env=node.with_packages(str(site)), capture_output=True, text=True, cwd=REPO)
    assert out.stdout.strip() == "1.2.3", out.stderr
    assert node.install(str(wheels), str(site))[0] == []  # the second time: nothing to take
