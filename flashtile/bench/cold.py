"""Cold start: the time a fresh process takes to import flashtile and to run its first call, with an empty Triton
cache (cold: every kernel compiles) and again with the cache the cold run filled (warm: kernels load from disk).

    python -m flashtile bench cold [--out DIR] [--runs 2] [--cold-runs 3]    # on a CUDA GPU

Each run starts new Python processes (`python -c` of this module's child code): one with TRITON_CACHE_DIR set to a
fresh empty folder and the compile-ahead off (FLASHTILE_COMPILE_AHEAD=0: forward and backward compile one after the
other, flashtile/_ahead.py), --cold-runs each with another empty folder as flashtile runs by default, then --runs
with the first of those folders filled. A child times, in order: `import torch`, `import flashtile` on top of it,
CUDA's start (the first tensor on the GPU: the inputs), torch's own first autograd.grad on a tiny tensor (torch
imports sympy there, seconds where the installed packages have no cached bytecode: torch's cost, timed apart), the
first causal forward+backward at B4 S4096 H16 d128 bf16 (synchronised), and a second such call. It also records
what Triton compiled or loaded during the first call (triton.knobs.compilation.listener: each kernel's name, cache
hit, thread, and compile time by stage) and the time spent building launchers
(triton.runtime.build.compile_module_from_src), with a timeline of the first call (each compile's, launcher
build's, front end's and Triton key's thread, start and end; the log prints the cold runs'). The issue's bars: first
call at most 5 s cold (the median of the cold runs: a host's speed moves one process's compile by a second or more)
and 0.3 s warm; `import flashtile` at most 0.3 s on top of `import torch`. Writes <date>-<gpu>-cold.json to --out.

Python's compiled bytecode: an installed package has it (pip compiles every module when it installs), but an
environment with PYTHONDONTWRITEBYTECODE set and packages installed without it compiles each module from source in
every process, which a first call pays for Triton's modules (it imports Triton). --bytecode installed (the default)
gives the children the bytecode an installation has: they read and write it under a private PYTHONPYCACHEPREFIX,
primed by one untimed child that runs the same call first (with a Triton cache of its own, so the cold runs still
compile everything). --bytecode as-is runs the children in the environment as it is. --bytecode both measures both.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

from .decode import log
from .registry import dist_version
from .runner import DEFAULT_OUT, commit, report_bars

SHAPE = (4, 4096, 16, 128)  # batch, seqlen, heads, head dim: the first call
BAR_COLD_S = 5.0
BAR_WARM_S = 0.3
BAR_IMPORT_S = 0.3

# The child: prints one JSON line. Kept free of flashtile imports until it times them.
CHILD = r"""
import json, sys, threading, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import flashtile
t2 = time.perf_counter()
import triton
from triton.runtime import build

events, builds, timeline = [], [], []
started = [None]  # the first call's start
def listener(*, src, metadata, metadata_group, times, cache_hit):
    name = getattr(getattr(src, "fn", None), "__name__", None) or str(getattr(src, "name", "?"))
    events.append(dict(kernel=name, cache_hit=bool(cache_hit), total_s=times.total / 1e6,
                       thread=threading.current_thread().name,
                       stages={k: v / 1e6 for k, v in times.lowering_stages}))
    if started[0] is not None:
        end = time.perf_counter() - started[0]
        timeline.append(dict(what="compile " + name, thread=threading.current_thread().name,
                             start_s=end - times.total / 1e6, end_s=end))
triton.knobs.compilation.listener = listener
compile_src = build.compile_module_from_src
def timed_build(src, name, *args, **kwargs):
    start = time.perf_counter()
    try:
        return compile_src(src, name, *args, **kwargs)
    finally:
        end = time.perf_counter()
        builds.append(end - start)
        if started[0] is not None:
            timeline.append(dict(what="build " + name, thread=threading.current_thread().name,
                                 start_s=start - started[0], end_s=end - started[0]))
build.compile_module_from_src = timed_build
import triton.backends.nvidia.driver as driver
driver.compile_module_from_src = timed_build

# Two pieces of a compile the listener does not time apart: Triton's key (a hash of its installation, once per
# process) and each compile's front end (make_ir: Python walking the kernel into MLIR). Spans under 1 ms are left out.
def spanned(what, fn):
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            end = time.perf_counter()
            if started[0] is not None and end - start >= 1e-3:
                timeline.append(dict(what=what(args), thread=threading.current_thread().name,
                                     start_s=start - started[0], end_s=end - started[0]))
    return timed
def front_end(args):
    return "front end " + getattr(getattr(args[0], "fn", None), "__name__", "?")
try:
    import triton.runtime.cache as triton_cache
    triton_cache.triton_key = spanned(lambda args: "triton key", triton_cache.triton_key)
    from triton.compiler.compiler import ASTSource
    ASTSource.make_ir = spanned(front_end, ASTSource.make_ir)
    from triton.experimental.gluon._runtime import GluonASTSource
    GluonASTSource.make_ir = spanned(front_end, GluonASTSource.make_ir)
except (ImportError, AttributeError):
    pass

b, s, h, d = SHAPE
gen = torch.Generator("cuda").manual_seed(0)
q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(4))
for t in (q, k, v):
    t.requires_grad_()
torch.cuda.synchronize()
t3 = time.perf_counter()
# torch's own first autograd.grad (it imports sympy, seconds where its bytecode is not cached): timed apart.
x = torch.ones(8, device="cuda", requires_grad=True)
torch.autograd.grad(x.exp(), x, torch.ones_like(x))
torch.cuda.synchronize()
t3b = time.perf_counter()

def call():
    out = flashtile.flash_attn_func(q, k, v, causal=True)
    torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()

started[0] = time.perf_counter()
call()
t4 = time.perf_counter()
first = list(events)
timeline.append(dict(what="first call", thread="MainThread", start_s=0.0, end_s=t4 - started[0]))
first_timeline = sorted(timeline, key=lambda e: e["start_s"])
call()
t5 = time.perf_counter()
print(json.dumps(dict(import_torch_s=t1 - t0, import_flashtile_s=t2 - t1, cuda_start_s=t3 - t2,
                      torch_first_grad_s=t3b - t3, first_call_s=t4 - t3b,
                      second_call_s=t5 - t4, compiled=first, launcher_builds_s=builds,
                      timeline=first_timeline)))
""".replace("SHAPE", repr(SHAPE))


def run_child(cache_dir, timeout, pycache=None, **env_extra):
    """The child's measurements (a dict) in a fresh process whose Triton cache is cache_dir (pycache: a folder for
    Python's bytecode, PYTHONPYCACHEPREFIX, written and read there; env_extra: more environment variables)."""
    env = dict(os.environ, TRITON_CACHE_DIR=cache_dir, **env_extra)
    if pycache is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = pycache
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summary(row):
    """One line of a child's result."""
    misses = [e for e in row["compiled"] if not e["cache_hit"]]
    return (f"import torch {row['import_torch_s']:.2f} s, flashtile +{row['import_flashtile_s']:.3f} s; first call "
            f"{row['first_call_s']:.2f} s after torch's first grad ({row['torch_first_grad_s']:.2f} s) "
            f"({len(misses)} kernels compiled, {sum(e['total_s'] for e in misses):.2f} s "
            f"in Triton's compiler; {len(row['launcher_builds_s'])} launchers built, "
            f"{sum(row['launcher_builds_s']):.2f} s); second call {row['second_call_s']:.3f} s")


def timeline(row):
    """The cold first call's timeline, one line per compile or build: start-end (s from the call's start), thread."""
    return "\n".join(f"  {e['start_s']:6.2f}-{e['end_s']:5.2f}  {e['thread']:34s} {e['what']}"
                     for e in row.get("timeline", ()))


def bars(colds, warm):
    """(description, passed, detail) of the issue's cold-start bars (colds: the cold runs; the bar takes the median's
    first call)."""
    cold = median_run(colds)
    worst_warm = max(r["first_call_s"] for r in warm)
    worst_import = max(r["import_flashtile_s"] for r in colds + warm)
    detail = f"{cold['first_call_s']:.2f} s"
    if len(colds) > 1:
        detail += f" (median of {len(colds)}: " + ", ".join(f"{r['first_call_s']:.2f}" for r in colds) + ")"
    return [(f"cold first call <= {BAR_COLD_S} s", cold["first_call_s"] <= BAR_COLD_S, detail),
            (f"warm first call <= {BAR_WARM_S} s", worst_warm <= BAR_WARM_S, f"{worst_warm:.3f} s (slowest run)"),
            (f"import flashtile <= {BAR_IMPORT_S} s on top of torch", worst_import <= BAR_IMPORT_S,
             f"{worst_import:.3f} s (slowest run)")]


def build_parser(prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help=f"results folder (default ./{DEFAULT_OUT})")
    p.add_argument("--runs", type=int, default=2, help="warm runs after the cold ones (default 2)")
    p.add_argument("--cold-runs", type=int, default=3,
                   help="cold runs, each with an empty Triton cache; the bar takes their median (default 3)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a child may take (default 300)")
    p.add_argument("--bytecode", choices=("installed", "as-is", "both"), default="installed",
                   help="Python bytecode as an installation has it, the environment as it is, or both (see below)")
    return p


def median_run(rows):
    """The run whose first call is the median (the lower middle one of an even count)."""
    return sorted(rows, key=lambda r: r["first_call_s"])[(len(rows) - 1) // 2]


def measure(root, runs, timeout, pycache=None, cold_runs=1):
    """{cold_compile_ahead_off, cold (the median cold run), cold_runs: [...], warm: [...]} of one bytecode setting,
    Triton caches under root."""
    off = run_child(root + "/ahead-off", timeout, pycache, FLASHTILE_COMPILE_AHEAD="0")
    log(f"cold, compile-ahead off: {summary(off)}\n{timeline(off)}")
    colds = []
    for i in range(max(1, cold_runs)):
        colds.append(run_child(root + ("/default" if i == 0 else f"/cold-{i}"), timeout, pycache))
        log(f"cold {i + 1}: {summary(colds[-1])}\n{timeline(colds[-1])}")
    cold = median_run(colds)
    if len(colds) > 1:
        times = ", ".join(f"{r['first_call_s']:.2f}" for r in colds)
        log(f"cold first calls: {times} s; median {cold['first_call_s']:.2f} s")
    warm = []
    for i in range(runs):
        warm.append(run_child(root + "/default", timeout, pycache))
        log(f"warm {i + 1}: {summary(warm[-1])}")
    return {"cold_compile_ahead_off": off, "cold": cold, "cold_runs": colds, "warm": warm}


def main(argv=None, prog=None):
    """Run the cold-start benchmark; returns the exit status (2 without a GPU)."""
    import torch
    args = build_parser(prog).parse_args(argv)
    if not torch.cuda.is_available():
        log("error: no CUDA device; the cold start is measured on a GPU")
        return 2
    results = {}
    with tempfile.TemporaryDirectory(prefix="flashtile-cold-") as cache_dir:
        if args.bytecode in ("installed", "both"):
            pycache = cache_dir + "/pycache"
            log("priming the children's bytecode (one untimed call)")
            run_child(cache_dir + "/prime", args.timeout, pycache)
            log("bytecode as installed:")
            results["installed"] = measure(cache_dir + "/installed", args.runs, args.timeout, pycache, args.cold_runs)
        if args.bytecode in ("as-is", "both"):
            log(f"bytecode as the environment has it (PYTHONDONTWRITEBYTECODE="
                f"{os.environ.get('PYTHONDONTWRITEBYTECODE', '')!r}):")
            results["as-is"] = measure(cache_dir + "/as-is", args.runs, args.timeout, cold_runs=args.cold_runs)
    main_result = results.get("installed", results.get("as-is"))
    cold, off, warm = main_result["cold"], main_result["cold_compile_ahead_off"], main_result["warm"]
    cold_runs = main_result["cold_runs"]
    checks = bars(cold_runs, warm)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": dist_version("triton"), "flashtile_commit": commit(),
            "shape": dict(zip(("batch", "seqlen", "heads", "head_dim"), SHAPE), dtype="bf16", causal=True),
            "argv": sys.argv[1:] if argv is None else list(argv),
            "bytecode": "installed" if "installed" in results else "as-is"}
    out_path = report_bars(checks, args.out, meta["gpu"], "cold", meta["date"][:10],
                           {"metadata": meta, "cold": cold, "cold_runs": cold_runs, "cold_compile_ahead_off": off,
                            "warm": warm, "by_bytecode": results})
    log(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
