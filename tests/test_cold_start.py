"""A process's first call: the backward compiled while the forward compiles (flashtile/_ahead.py), and kernels an
earlier process compiled found through flashtile's on-disk index (kernels/_index.py).

CPU: compile-only launches run nothing (Triton's interpreter skips a warmup), `prepare` leaves the backward's plan
for the real call, which then builds nothing and gives the same gradients; index keys that would not repeat in
another process are not indexed. GPU: in a fresh process with an empty Triton cache, the first forward+backward
compiles the backward's kernels in the helper thread and none in the backward itself; a second process with that
cache calls Triton's compiler for nothing (not even a cache lookup) and computes the same results.
"""
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import triton
import triton.language as tl

import flashtile
from flashtile import _ahead, _ops, dispatch
from flashtile._settings import override
from flashtile.kernels import _common, _compiling, _index, _launch
from flashtile.request import AttentionRequest
from flashtile.testing import make_qkv


@triton.jit
def _fill_kernel(X, n, value, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(X + o, value, mask=o < n)


def test_compile_only_launches_run_nothing():
    # (The interpreter runs kernels on CPU tensors; a compiled kernel, as on a GPU machine without it, on CUDA ones.)
    x = torch.zeros(40, device="cpu" if _common.INTERPRETING or not torch.cuda.is_available() else "cuda")
    with _launch.compile_only():
        assert _launch.dry()
        _launch.launch(_fill_kernel, (1,), (x, 40, 3.0), {"BLOCK": 64}, None)
    assert not _launch.dry()
    assert torch.equal(x, torch.zeros_like(x))
    _launch.launch(_fill_kernel, (1,), (x, 40, 3.0), {"BLOCK": 64}, None)
    assert torch.equal(x, torch.full_like(x, 3.0))


def test_background_launches_compile_aside_and_the_block_waits(monkeypatch):
    """Under compile_only a Bound launch made with background=True returns at once and compiles in a thread of its
    own (named after the caller's, at its rank at Triton's front end: kernels/_compiling.py), still compile-only; the
    block's end waits for it. Outside the block it launches as usual."""
    seen = []

    def slow_jit_launch(kernel, grid, args, constexprs, options, key=None, stream=None):
        time.sleep(0.2)
        seen.append((threading.current_thread().name, _launch.dry(), _compiling.rank(), args))
        return None, None

    x = torch.zeros(40)
    bound = _launch.Bound(_fill_kernel, (1,), (40, 3.0), {"BLOCK": 64}, {}, background=True)
    with monkeypatch.context() as patch:
        patch.setattr(_launch, "_jit_launch", slow_jit_launch)
        with _launch.compile_only(), _compiling.ranked(0):
            assert bound(None, x) is None
            assert not seen, "the launch waited for its compile"
        assert seen == [(f"{threading.current_thread().name}/compile", True, 0, (x, 40, 3.0))]
    assert not _launch.dry()
    bound(None, x)
    assert torch.equal(x, torch.full((40,), 3.0))


def test_compile_aside_after_waits_for_those_threads(monkeypatch):
    """compile_aside(after=threads) starts compiling only once those threads have ended (the forward's redo compile
    waits for the backward's compile-ahead helpers)."""
    order = []

    def jit_launch(kernel, grid, args, constexprs, options, key=None, stream=None):
        order.append("compile")
        return None, None

    def helper():
        time.sleep(0.3)
        order.append("helper")

    other = threading.Thread(target=helper)
    other.start()
    monkeypatch.setattr(_launch, "_jit_launch", jit_launch)
    bound = _launch.Bound(_fill_kernel, (1,), (40, 3.0), {"BLOCK": 64}, {})
    thread = bound.compile_aside(torch.zeros(40), after=[other])
    _launch.join_aside()
    assert not thread.is_alive() and order == ["helper", "compile"]


class _Src:
    """A stand-in of Triton's ASTSource: what a launcher is made from."""
    def __init__(self):
        self.fn = type("Fn", (), {"arg_names": ["desc", "n", "BLOCK"]})()
        self.signature = {"desc": "tensordesc<bf16[64, 64],shared>", "n": "i32", "BLOCK": "constexpr"}
        self.constants = {"BLOCK": 64}

    def make_ir(self, *args):  # (Triton's compile calls it: True when it runs in its turn, kernels/_compiling.py)
        return threading.get_ident() in _compiling.FRONT_ENDS._running


def test_launcher_builds_while_the_kernel_compiles(monkeypatch):
    """Where Triton builds a C launcher per kernel (3.6), a kernel's first compile first starts the launcher's build
    in a thread of its own, from the source's signature and constants with its descriptors taken as TMA ones, then
    compiles, its front end in its turn; a kernel is wrapped once (after Triton has made the device's caches, which
    set its compile), and not at all where Triton builds no launchers. A failing guess leaves the compile alone."""
    from triton.backends.nvidia import driver
    made, built, compiled = [], [], []
    monkeypatch.setattr(driver, "make_launcher", lambda *a: made.append(a) or "launcher source", raising=False)

    def build(src, name, **kwargs):
        time.sleep(0.2)
        built.append((src, name, threading.current_thread().name))
    monkeypatch.setattr(driver, "compile_module_from_src", build, raising=False)
    for name, value in (("library_dirs", lambda: []), ("include_dirs", []), ("libraries", [])):
        monkeypatch.setattr(driver, name, value, raising=False)

    def compile_fn(src, target=None, options=None):
        compiled.append((src, target, list(made), list(built)))
        return "kernel"
    kernel = type("Kernel", (), {})()

    class Caches(dict):
        def __missing__(self, device):  # Triton's create_binder sets the kernel's compile
            kernel.compile = compile_fn
            self[device] = "caches"
            return "caches"
    kernel.device_caches = Caches()
    kernel.compile = compile_fn
    monkeypatch.setattr(_launch, "_builds_launchers", lambda: False)
    _launch._LauncherAhead.wrap(kernel)
    assert kernel.compile is compile_fn
    monkeypatch.setattr(_launch, "_builds_launchers", lambda: True)
    _launch._LauncherAhead.wrap(kernel)
    wrapped = kernel.compile
    _launch._LauncherAhead.wrap(kernel)
    assert kernel.compile is wrapped and wrapped.compile is compile_fn
    src = _Src()
    kernel.device_caches[_launch._device()]  # (what the JIT's run does before it compiles)
    assert kernel.compile(src, target="sm90") == "kernel"
    # The launcher was made before the compile, and builds beside it.
    assert compiled == [(src, "sm90", [({(2, ): 64}, src.signature, [{}])], [])]
    assert src.make_ir("sm90") is True, "the compile's front end takes its turn"
    deadline = time.time() + 5
    while not built and time.time() < deadline:
        time.sleep(0.01)
    assert built == [("launcher source", "__triton_launcher", f"{threading.current_thread().name}/launcher")]
    monkeypatch.setattr(driver, "make_launcher", lambda *a: 1 / 0, raising=False)
    assert kernel.compile(src, target="sm90") == "kernel"


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_prepare_leaves_the_backward_plan(causal):
    q, k, v = make_qkv(2, 37, 45, 4, 2, 32, torch.float16, seed=3, grad=False)
    req = AttentionRequest(softmax_scale=32 ** -0.5, window_right=0 if causal else -1, diagonal_offset=45 - 37)
    out, lse = _ops.forward(q, k, v, req)
    dout = torch.randn_like(out)
    want = _ops.backward(dout, q, k, v, out, lse, None, req)
    dispatch._PLANS.clear()
    _ahead.prepare(q, k, v, req, False)
    plans = dict(dispatch._PLANS)
    assert len(plans) == 1, "prepare builds the backward's plan"
    got = _ops.backward(dout, q, k, v, out, lse, None, req)
    assert dispatch._PLANS == plans, "the real backward found the plan prepare built"
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_start_skips_cpu_tensors_and_the_setting():
    q, k, v = make_qkv(1, 16, 16, 2, 2, 16, torch.float16, grad=False)
    req = AttentionRequest(softmax_scale=0.25)
    _ahead.start(q, k, v, req, False)
    assert not _ahead._PENDING
    with override(compile_ahead=False):
        _ahead.start(q, k, v, req, False)
    assert not _ahead._PENDING


def test_index_keys_name_kernels_and_skip_addresses():
    key = (_fill_kernel, ((torch.float16, True), (False, False, True, True)), (("BLOCK", 64),), ())
    text = _index._stable_text(key)
    assert text.startswith(f"('{__name__}._fill_kernel'") and "float16" in text
    assert _index._stable_text(key[:3] + ((("hook", object()),),)) is None


_KEYS_CHILD = r"""
import json
import torch, flashtile
from flashtile.bench.host import _as_on_hopper, _settings, flashtile_calls
from flashtile.kernels import _common, _index, _launch
from flashtile.testing import fast_launch_on_cpu
with fast_launch_on_cpu(execute=False), _as_on_hopper(), _settings(_common, "INTERPRETING", False):
    for d in (64, 128):
        flashtile_calls(1, 128, 4, d, "cpu")["fwd+bwd"]()
    print(json.dumps(sorted(str(_index._stable_text(k)) for _, k in _launch._COMPILED)))
"""


def test_launch_keys_repeat_across_processes():
    """The launch keys of a fwd+bwd as on an H100 (Gluon forward and backward, portable backward kernels; launches
    stubbed) give the same index text in two processes, none of them left out: the index can find every one."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", _KEYS_CHILD], env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert runs[0] == runs[1]
    assert "None" not in runs[0]
    names = {text.split("'")[1] for text in runs[0]}
    assert {"flashtile.kernels.hopper_fwd._fwd_kernel", "flashtile.kernels.hopper_bwd._bwd_kernel"} <= names


def test_launch_keys_do_not_compute_tritons_cache_key():
    """A launch key hashes without Triton's cache key of the kernel (hashing a JITFunction computes it, walking the
    source of every function the kernel calls: ~0.1 s of a warm process's first call, which never needs it)."""
    def body(X, BLOCK: tl.constexpr):
        _fill_kernel(X, 1, 0.0, BLOCK)

    kernel = triton.runtime.jit.JITFunction(body)  # (not the interpreter's stand-in, which has no cache key)
    key = _launch._key(kernel, (torch.zeros(4), 3), {"BLOCK": 16}, {})
    assert key == _launch._key(kernel, (torch.zeros(4), 3), {"BLOCK": 16}, {})
    hash(key)
    assert kernel.hash is None, "the launch key computed Triton's cache key"
    assert _index._stable_text(key).startswith(f"('{__name__}.")


def test_index_stands_aside_when_triton_compiles_anew(monkeypatch):
    monkeypatch.setattr(triton.knobs.compilation, "always_compile", True)
    assert _index._path((_fill_kernel, (), (), ()), 0) is None


_CHILD = r"""
import json, threading, sys
import torch, triton, flashtile
events = []
def listener(*, src, metadata, metadata_group, times, cache_hit):
    events.append((getattr(getattr(src, "fn", None), "__name__", "?"), bool(cache_hit), threading.current_thread().name,
                   phase[0]))
triton.knobs.compilation.listener = listener
phase = ["forward"]
gen = torch.Generator("cuda").manual_seed(0)
q, k, v, dout = (torch.randn(2, 1024, 8, 128, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(4))
for t in (q, k, v):
    t.requires_grad_()
out = flashtile.flash_attn_func(q, k, v, causal=True)
phase[0] = "backward"
first = torch.autograd.grad(out, (q, k, v), dout)
phase[0] = "again"
out = flashtile.flash_attn_func(q, k, v, causal=True)
again = torch.autograd.grad(out, (q, k, v), dout)
diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(first, again))
print(json.dumps(dict(events=events, diff=diff, scale=max(a.float().abs().max().item() for a in first))))
"""


@pytest.mark.gpu
def test_first_backward_compiled_during_the_forward(tmp_path):
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"))
    proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    compiled = [e for e in result["events"] if not e[1]]
    # The helper thread, and the threads it compiles the backward's kernels in side by side ("<helper>/compile").
    in_helper = [name for name, _, thread, _ in compiled if thread.startswith("flashtile-compile-ahead")]
    in_backward = [name for name, _, thread, phase in compiled
                   if phase == "backward" and not thread.startswith("flashtile-compile-ahead")]
    assert in_helper, f"nothing compiled in the helper: {compiled}"
    assert not in_backward, f"the backward compiled {in_backward} itself"
    assert not [e for e in result["events"] if e[3] == "again"], "a second step compiles or looks up nothing"
    # The same kernels ran both steps; the backward sums dq in float32 with atomics, in any order.
    assert result["diff"] <= 1e-2 * result["scale"]


@pytest.mark.gpu
def test_compile_ahead_gradients_match_it_off():
    q, k, v = make_qkv(1, 700, 900, 8, 2, 64, torch.bfloat16, device="cuda", seed=5)
    dout = torch.randn(1, 700, 8, 64, device="cuda", dtype=torch.bfloat16)
    grads = []
    for on in (False, True):
        with override(compile_ahead=on):
            dispatch._PLANS.clear()
            _ahead._PREPARED.clear()
            out = flashtile.flash_attn_func(q, k, v, causal=True, deterministic=True)
            grads.append(torch.autograd.grad(out, (q, k, v), dout))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_warm_process_compiles_and_looks_up_nothing(tmp_path):
    """A second process with the first one's cache: the first step makes no call of Triton's compiler (the index
    hands the kernels over), and its results equal the first process's bit for bit (deterministic backward)."""
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"))
    child = _CHILD.replace("causal=True)", "causal=True, deterministic=True)").replace(
        "print(json.dumps(dict(", "torch.save([t.cpu() for t in (out,) + first], sys.argv[1]); print(json.dumps(dict(")
    results = []
    for name in ("cold", "warm"):
        proc = subprocess.run([sys.executable, "-c", child, str(tmp_path / f"{name}.pt")], env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert [e for e in results[0]["events"] if not e[1]], "the first process compiled its kernels"
    assert not results[1]["events"], f"the warm process went through Triton's compiler: {results[1]['events']}"
    assert list((tmp_path / "triton" / "flashtile-index").glob("*.json"))
    cold, warm = (torch.load(tmp_path / f"{n}.pt") for n in ("cold", "warm"))
    for a, b in zip(cold, warm):
        assert torch.equal(a, b)
