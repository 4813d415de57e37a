"""Host time of small eager calls: flashtile against torch SDPA (cuDNN and flash backends), in one run.

    python -m flashtile bench host [--out DIR] [--calls 300]       # on a CUDA GPU
    TRITON_INTERPRET=1 python -m flashtile bench host --cpu        # flashtile's Python alone, no GPU

At tiny shapes (batch 1, seqlen 128, 4 heads, bf16, causal; head dim 64 and 128) the GPU finishes each kernel long
before the host has issued the next one, so a loop of calls runs at the host's pace: the time per call of a loop
of --calls back-to-back calls without synchronising is the host cost of one call (Python, checks, autograd, the
launchers). The issue's bar: an eager forward+backward call costs no more host time than torch's SDPA with cuDNN.
Each provider runs: "fwd" (inputs without grad: no autograd) and "fwd+bwd" (inputs that require grad; the
gradients by torch.autograd.grad, so nothing accumulates into .grad). Each figure is the best of --repeats loops;
"wall" adds the final synchronisation, the GPU's time for whatever the host got ahead by. Writes
<date>-<gpu>-host.json to --out.

Besides flashtile and SDPA's backends, two rows that put the bar in context: "fa4" (flash-attn-4's
flash_attn_func, when it is importable: another attention library whose autograd is Python) and "python-function",
no attention at all: a torch.autograd.Function written in Python whose forward allocates an output and LSE rows and
saves its inputs, and whose backward allocates the three gradients. It is what autograd alone charges any attention
whose backward is Python (flashtile's, flash-attn's) on this host, SDPA's backward being a C++ node: the floor under
flashtile's fwd+bwd row. "flashtile-varlen" runs the same rows through flash_attn_varlen_func (one sequence per
batch entry, offsets on the device): what a varlen call adds, its offsets' clamp and tile map among it.

--cpu measures flashtile's side on a machine without a GPU: CPU tensors take the launch path CUDA tensors take
(flashtile.testing.fast_launch_on_cpu: the compile cache, the plans, the compiled kernels' launchers), with the
launchers stubbed out, so it counts flashtile's Python only (no Triton launcher, no CUDA allocator). "as on an
H100" also pretends the tensors' device is a Hopper GPU, so that the dispatch takes the Gluon kernels it would
take there (their launches stubbed too); "portable kernels" is what the CPU target dispatches to.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import sys
import time

import torch

from .decode import log
from .registry import dist_version
from .runner import DEFAULT_OUT, commit, report_bars

# (batch, seqlen, heads, head dim): the tiny shapes.
SHAPES = ((1, 128, 4, 64), (1, 128, 4, 128))
DTYPE = torch.bfloat16
CALLS = 300
REPEATS = 5
WARMUP = 50
# The bar: flashtile's fwd+bwd host time at most this multiple of SDPA cuDNN's.
BAR_VS_CUDNN = 1.0


def time_calls(fn, calls, repeats, sync=None):
    """(best host us per call, best wall us per call) of `repeats` loops of `calls` calls of fn; wall includes
    sync() after the loop."""
    host = wall = float("inf")
    for _ in range(repeats):
        if sync is not None:
            sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        issued = time.perf_counter()
        if sync is not None:
            sync()
        done = time.perf_counter()
        host = min(host, (issued - start) / calls * 1e6)
        wall = min(wall, (done - start) / calls * 1e6)
    return host, wall


def make_inputs(batch, seqlen, heads, head_dim, device, grad, layout="bshd", seed=0):
    """q, k, v (and dout) of one shape: (B, S, H, D) for flashtile, (B, H, S, D) for SDPA."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, seqlen, heads, head_dim) if layout == "bshd" else (batch, heads, seqlen, head_dim)
    q, k, v, dout = (torch.randn(shape, generator=gen, device=device).to(DTYPE) for _ in range(4))
    if grad:
        for t in (q, k, v):
            t.requires_grad_()
    return q, k, v, dout


def flashtile_calls(batch, seqlen, heads, head_dim, device):
    """{"fwd": fn, "fwd+bwd": fn} of flashtile.flash_attn_func, causal."""
    import flashtile
    q, k, v, _ = make_inputs(batch, seqlen, heads, head_dim, device, grad=False)
    qg, kg, vg, dout = make_inputs(batch, seqlen, heads, head_dim, device, grad=True)

    def fwd_bwd():
        out = flashtile.flash_attn_func(qg, kg, vg, causal=True)
        torch.autograd.grad(out, (qg, kg, vg), dout)

    return {"fwd": lambda: flashtile.flash_attn_func(q, k, v, causal=True), "fwd+bwd": fwd_bwd}


def flashtile_varlen_calls(batch, seqlen, heads, head_dim, device):
    """{"fwd": fn, "fwd+bwd": fn} of flashtile.flash_attn_varlen_func over the same rows packed as `batch` sequences
    of `seqlen` (the "flashtile-varlen" row: what a varlen call adds to a fixed-length one's host time), causal, with
    the offsets on the device as a training loop or a serving engine holds them."""
    import flashtile
    rows = (batch * seqlen, heads, head_dim)
    q, k, v, _ = (t.reshape(rows) for t in make_inputs(batch, seqlen, heads, head_dim, device, grad=False))
    qg, kg, vg, dout = (t.reshape(rows) for t in make_inputs(batch, seqlen, heads, head_dim, device, grad=False))
    for t in (qg, kg, vg):
        t.requires_grad_()
    cu = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=device)

    def fwd_bwd():
        out = flashtile.flash_attn_varlen_func(qg, kg, vg, cu, cu, seqlen, seqlen, causal=True)
        torch.autograd.grad(out, (qg, kg, vg), dout)

    return {"fwd": lambda: flashtile.flash_attn_varlen_func(q, k, v, cu, cu, seqlen, seqlen, causal=True),
            "fwd+bwd": fwd_bwd}


def sdpa_calls(batch, seqlen, heads, head_dim, device, backend):
    """{"fwd": fn, "fwd+bwd": fn} of torch's SDPA with one backend (torch.nn.attention.SDPBackend), causal."""
    from torch.nn.attention import sdpa_kernel
    import torch.nn.functional as F
    q, k, v, _ = make_inputs(batch, seqlen, heads, head_dim, device, grad=False, layout="bhsd")
    qg, kg, vg, dout = make_inputs(batch, seqlen, heads, head_dim, device, grad=True, layout="bhsd")

    def fwd():
        with sdpa_kernel(backend):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def fwd_bwd():
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
        torch.autograd.grad(out, (qg, kg, vg), dout)

    return {"fwd": fwd, "fwd+bwd": fwd_bwd}


def fa4_calls(batch, seqlen, heads, head_dim, device):
    """{"fwd": fn, "fwd+bwd": fn} of flash-attn-4's flash_attn_func, causal (it returns (out, lse))."""
    from .registry import _fa4_import
    fa4 = _fa4_import()
    q, k, v, _ = make_inputs(batch, seqlen, heads, head_dim, device, grad=False)
    qg, kg, vg, dout = make_inputs(batch, seqlen, heads, head_dim, device, grad=True)

    def fwd_bwd():
        out = fa4(qg, kg, vg, causal=True)[0]
        torch.autograd.grad(out, (qg, kg, vg), dout)

    return {"fwd": lambda: fa4(q, k, v, causal=True), "fwd+bwd": fwd_bwd}


class _NoAttention(torch.autograd.Function):
    """The "python-function" row (module docstring): autograd's cost for a Python backward, with no kernel."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def python_function_calls(batch, seqlen, heads, head_dim, device):
    """{"fwd": fn, "fwd+bwd": fn} of _NoAttention (the floor row)."""
    q, k, v, _ = make_inputs(batch, seqlen, heads, head_dim, device, grad=False)
    qg, kg, vg, dout = make_inputs(batch, seqlen, heads, head_dim, device, grad=True)

    def fwd_bwd():
        out = _NoAttention.apply(qg, kg, vg)[0]
        torch.autograd.grad(out, (qg, kg, vg), dout)

    return {"fwd": lambda: _NoAttention.apply(q, k, v), "fwd+bwd": fwd_bwd}


def providers():
    from torch.nn.attention import SDPBackend
    from .registry import _fa4_available
    found = {"flashtile": flashtile_calls, "flashtile-varlen": flashtile_varlen_calls,
             "sdpa-cudnn": lambda *a: sdpa_calls(*a, SDPBackend.CUDNN_ATTENTION),
             "sdpa-flash": lambda *a: sdpa_calls(*a, SDPBackend.FLASH_ATTENTION)}
    if _fa4_available() is None:
        found["fa4"] = fa4_calls
    found["python-function"] = python_function_calls
    return found


def measure_gpu(calls, repeats):
    """Rows {shape, provider, call, host_us, wall_us} (or an error) of every shape, provider and call kind."""
    rows = []
    for batch, seqlen, heads, head_dim in SHAPES:
        shape = f"B{batch} S{seqlen} H{heads} d{head_dim} causal bf16"
        for name, make in providers().items():
            for kind, fn in make(batch, seqlen, heads, head_dim, "cuda").items():
                row = dict(shape=shape, provider=name, call=kind)
                try:
                    for _ in range(WARMUP):
                        fn()
                    torch.cuda.synchronize()
                    host, wall = time_calls(fn, calls, repeats, torch.cuda.synchronize)
                except Exception as exc:  # noqa: BLE001 - a backend that cannot run the shape is a row, not a crash
                    row.update(status="error", note=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
                else:
                    row.update(status="ok", host_us=host, wall_us=wall)
                rows.append(row)
                log(f"  {shape:<28} {name:<15} {kind:<8} " + (f"host {row['host_us']:7.1f} us  wall "
                                                               f"{row['wall_us']:7.1f} us" if row["status"] == "ok"
                                                               else row["note"]))
    return rows


def bars(rows):
    """The issue's bar per shape: (description, passed or None, detail)."""
    by = {(r["shape"], r["provider"], r["call"]): r for r in rows if r.get("status") == "ok"}
    result = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        ft, cudnn = by.get((shape, "flashtile", "fwd+bwd")), by.get((shape, "sdpa-cudnn", "fwd+bwd"))
        if ft is None or cudnn is None:
            result.append((f"{shape}: fwd+bwd host time <= SDPA cuDNN's", None, "not measured"))
            continue
        ratio = ft["host_us"] / cudnn["host_us"]
        context = "".join(f"; {name} {row['host_us']:.1f} us" for name in ("fa4", "python-function")
                          if (row := by.get((shape, name, "fwd+bwd"))) is not None)
        result.append((f"{shape}: fwd+bwd host time <= SDPA cuDNN's", ratio <= BAR_VS_CUDNN,
                       f"{ft['host_us']:.1f} us vs {cudnn['host_us']:.1f} us ({ratio:.2f}x){context}"))
    return result


@contextlib.contextmanager
def _as_on_hopper():
    """CPU tensors dispatched as on an H100: the Gluon kernels' allow-lists see a sm_90 CUDA target (with 132
    SMs); their launches must be stubbed (fast_launch_on_cpu(execute=False))."""
    from flashtile import dispatch
    from flashtile.kernels import hopper_fwd
    saved = dispatch.Target.of, hopper_fwd._num_sms
    dispatch.Target.of = classmethod(lambda cls, t: cls("cuda", 90, False))
    hopper_fwd._num_sms = lambda device_index: 132
    try:
        yield
    finally:
        dispatch.Target.of, hopper_fwd._num_sms = saved


def measure_cpu(calls, repeats):
    """Rows like measure_gpu's, flashtile only, on CPU tensors with the launches stubbed (module docstring)."""
    from flashtile import _values
    from flashtile.kernels import _common
    from flashtile.testing import fast_launch_on_cpu
    if not _common.INTERPRETING:
        raise SystemExit("--cpu needs TRITON_INTERPRET=1 (it stubs the interpreted kernels' launches out)")
    rows = []
    for target, context in (("as on an H100", _as_on_hopper), ("portable kernels", contextlib.nullcontext)):
        for batch, seqlen, heads, head_dim in SHAPES:
            shape = f"B{batch} S{seqlen} H{heads} d{head_dim} causal bf16, {target}"
            # The constexprs wrapped as on a GPU (the interpreter takes them plain): their cost is part of a launch.
            # (Varlen offsets unread, as those of CUDA tensors are: _values.readable.)
            with fast_launch_on_cpu(execute=False), context(), _settings(_common, "INTERPRETING", False), \
                    _settings(_values, "readable", lambda t: False):
                for name, make in (("flashtile", flashtile_calls), ("flashtile-varlen", flashtile_varlen_calls)):
                    for kind, fn in make(batch, seqlen, heads, head_dim, "cpu").items():
                        for _ in range(WARMUP):
                            fn()
                        host, _ = time_calls(fn, calls, repeats)
                        rows.append(dict(shape=shape, provider=name, call=kind, status="ok", host_us=host))
                        log(f"  {shape:<46} {name:<16} {kind:<8} {host:7.1f} us per call")
    return rows


@contextlib.contextmanager
def _settings(module, name, value):
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def metadata(argv, cpu):
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": "cpu (launches stubbed)" if cpu else torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": dist_version("triton"),
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "flashtile_commit": commit(),
        "timing": "best of the repeats of a loop of back-to-back calls without synchronising: host us per call; "
                  "wall adds the synchronisation after the loop",
        "argv": argv,
    }


def build_parser(prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help=f"results folder (default ./{DEFAULT_OUT})")
    p.add_argument("--calls", type=int, default=CALLS, help=f"calls per timed loop (default {CALLS})")
    p.add_argument("--repeats", type=int, default=REPEATS, help=f"timed loops; the best counts (default {REPEATS})")
    p.add_argument("--cpu", action="store_true", help="flashtile's Python on the CPU, launches stubbed (see above)")
    return p


def main(argv=None, prog=None):
    """Run the host-time benchmark; returns the exit status (2 without a GPU unless --cpu)."""
    args = build_parser(prog).parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        log("error: no CUDA device; run with --cpu (and TRITON_INTERPRET=1) to time flashtile's Python alone")
        return 2
    meta = metadata(sys.argv[1:] if argv is None else list(argv), args.cpu)
    rows = measure_cpu(args.calls, args.repeats) if args.cpu else measure_gpu(args.calls, args.repeats)
    checks = [] if args.cpu else bars(rows)
    out_path = report_bars(checks, args.out, meta["gpu"], "host-cpu" if args.cpu else "host", meta["date"][:10],
                           {"metadata": meta, "results": rows})
    log(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
