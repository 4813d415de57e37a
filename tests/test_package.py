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


# A fresh process: `import flashtile` (and the modules a user imports beside it) loads neither Triton nor a kernel
# module (issue 28: they cost 0.4-0.6 s on top of `import torch`; docs/design-record.md, "Import: the kernels on first
# use"); the first calls then import them, are judged against the reference, and leave the modules in place of their
# stand-ins (flashtile/_lazy.py). argv[1]: the backend the forward must take; argv[2]: the device.
_FIRST_CALLS = r"""
import sys
import types

import torch

import flashtile
import flashtile.integrations.sdpa
import flashtile.integrations.transformers
import flashtile.testing
from flashtile.reference.kvcache import kvcache_attention

def kernel_modules():
    return sorted(m for m in sys.modules if m.split(".")[0] == "triton" or m.startswith("flashtile.kernels"))

assert not kernel_modules(), f"{len(kernel_modules())} modules, e.g. {kernel_modules()[:3]}"
device = sys.argv[2]
q, k, v = flashtile.testing.make_qkv(1, 33, 17, 4, 2, 32, torch.float32, device=device, seed=0)
dout = torch.randn(q.shape, generator=torch.Generator(device).manual_seed(1), device=device)
assert flashtile.explain(q, k, v, causal=True).forward_backend == sys.argv[1]
out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
dq, dk, dv = torch.autograd.grad((out * dout).sum(), (q, k, v))
flashtile.testing.check_against_reference((out.detach(), lse.detach(), dq, dk, dv), q.detach(), k.detach(),
                                          v.detach(), dout, 32 ** -0.5, True, 17 - 33)

gen = torch.Generator(device).manual_seed(2)
q1, k_cache, v_cache = (torch.randn(shape, generator=gen, device=device)
                        for shape in ((2, 1, 4, 32), (2, 24, 2, 32), (2, 24, 2, 32)))
seqlens = torch.tensor([5, 20], dtype=torch.int32, device=device)
for _ in range(2):  # the second call takes the repeated-call path (the kernels' plans)
    out = flashtile.flash_attn_with_kvcache(q1, k_cache, v_cache, cache_seqlens=seqlens)
ref, _ = kvcache_attention(q1.double(), k_cache.double(), v_cache.double(), seqlens)
assert (out.double() - ref).abs().max() < 1e-5
# The stand-ins gave way to the modules they stood for.
assert type(flashtile.kvcache._decode) is types.ModuleType and type(flashtile.dispatch.configs) is types.ModuleType
assert "triton" in sys.modules and "flashtile.kernels.decode" in sys.modules
"""


@pytest.mark.parametrize("interpret, device, backend", [
    (False, "cpu", "reference"), (True, "cpu", "triton"),
    pytest.param(False, "cuda", "triton", marks=pytest.mark.gpu)], ids=["reference", "interpreter", "gpu"])
def test_import_loads_no_kernels_and_first_calls_work(interpret, device, backend):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    run = subprocess.run([sys.executable, "-c", _FIRST_CALLS, backend, device], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]


def test_lazy_module_binds_the_module_in_its_place(monkeypatch):
    from flashtile import _lazy, request

    namespace = {"__package__": "flashtile"}
    namespace["req"] = namespace["alias"] = stand_in = _lazy.lazy_module(".request", namespace)
    assert repr(stand_in) == "<module 'flashtile.request' (imported on first use)>"
    assert stand_in.AttentionRequest is request.AttentionRequest
    assert namespace["req"] is request and namespace["alias"] is request
    monkeypatch.setattr(stand_in, "MARK", 1, raising=False)  # set through the stand-in: on the module
    assert request.MARK == 1
    monkeypatch.undo()
    assert not hasattr(request, "MARK")
