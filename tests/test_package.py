"""The wheel: pure Python, holds the benchmark (flashtile/bench/), declares numpy (Triton's interpreter, and so
`python -m flashtile check` on a CPU machine, needs it), and runs `python -m flashtile bench --help` from another
directory when it is the only flashtile on the path. (.ci/run also installs it in a fresh venv and runs `check`.)"""
import importlib.metadata
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _setuptools_builds_here():
    """True when the installed setuptools satisfies pyproject's build requirement (no download needed)."""
    try:
        major = int(importlib.metadata.version("setuptools").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        return False
    return major >= 77


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    # Built from a copy of the checkout (benchmarks/, tests/ and docs/ included, which must stay out of the wheel), so
    # that setuptools' build/ and egg-info stay out of the checkout itself.
    src = tmp_path_factory.mktemp("src") / "flashtile-src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv", "venv", "build", "dist", "*.egg-info",
                                                             "__pycache__", ".whl", ".whl2", ".gl", ".pytest_cache"))
    out = tmp_path_factory.mktemp("dist")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(src)]
    if _setuptools_builds_here():
        cmd.insert(4, "--no-build-isolation")
    built = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr
    wheels = list(out.glob("flashtile-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_contents_and_requirements(wheel):
    assert wheel.name.endswith("-py3-none-any.whl")  # pure Python: no compiled extension
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    for module in ("__init__", "__main__", "registry", "runner", "plot", "features", "decode"):
        assert f"flashtile/bench/{module}.py" in names
    assert "flashtile/__main__.py" in names
    assert not [n for n in names if n.split("/")[0] in ("benchmarks", "tests", "docs")]
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    plain = {r.split(";")[0].split(">")[0].split("=")[0].strip() for r in requires if "extra ==" not in r}
    assert {"torch", "triton", "numpy"} <= plain
    assert any(r.startswith("matplotlib") and 'extra == "bench"' in r for r in requires)


def test_unpacked_wheel_runs_bench_help_elsewhere(wheel, tmp_path):
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    here = tmp_path / "elsewhere"
    here.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site))
    where = subprocess.run([sys.executable, "-c", "import flashtile.bench.runner as r; print(r.__file__); "
                            "print(r.checkout_root())"], cwd=here, env=env, capture_output=True, text=True,
                           timeout=300)
    assert where.returncode == 0, where.stderr
    file, root = where.stdout.split()
    assert Path(file).is_relative_to(site) and root == "None"   # the wheel's copy, which knows it is no checkout
    out = subprocess.run([sys.executable, "-m", "flashtile", "bench", "--help"], cwd=here, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "usage: python -m flashtile bench" in out.stdout
