"""Context-parallel attention (flashtile.distributed) on the GPUs of one host: accuracy, speed and memory, one run.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --nproc-per-node 2 benchmarks/bench_context_parallel.py [--seqlens 16k,32k,64k] [--out DIR]

What it measures (issue 27's closing checks), all in bf16, B1 H16 d128 unless told otherwise:
- accuracy: max |error| against float64 of out, lse, dq, dk, dv for ring, zig-zag, varlen ring and Ulysses (causal
  and not), divided by the error of one GPU's flashtile on the same full inputs (bar: <= 1.2);
- speed: causal zig-zag fwd+bwd at 16k / 32k / 64k tokens per GPU, per-GPU TFLOP/s against one GPU's flashtile at
  the local length (bars: >= 0.90 at 16k, >= 0.95 at 32k and 64k), and the step time of torch's
  context_parallel over SDPA-cuDNN on the same shapes (bar: >= 1.05x slower than flashtile's); also Ulysses and
  torch's one-GPU cuDNN for scale;
- memory: peak bytes allocated per GPU during each fwd+bwd;
- the link: point-to-point bandwidth and latency between neighbours and all-to-all time, the inputs of the scaling
  model in docs/distributed.md.
FLOPs: fwd 4·B·H·S²·D / 2 for causal (the whole sequence's), fwd+bwd 3.5x; per GPU: divided by the world size.
Step time, timed three ways:
- throughput (the headline, `ms`): back to back with the host running ahead, as a training loop runs, the time from
  the end of the first iteration to the end of the last over the iterations between, on the slowest rank;
- `ms_median_of_max`: the same iterations, the median over iterations of the slowest rank's time for each. With
  ranks that wait for each other it counts each iteration's slower side: a rank's iteration ends when its last
  kernel does, and the rank that waited in one iteration starts the next one late, so the two ranks' times for an
  iteration vary in opposite directions while their sums do not (docs/distributed.md, "Measured");
- synced (`ms_synced`): every iteration starting on an idle GPU after a barrier (adds the call's launch latency),
  median over iterations of the slowest rank's.
The providers of one size take turns
--rounds times (default 3) and each reports its median round, since the GPUs' clocks drift as they warm. Rank 0
prints a table (each bar marked ok or BELOW BAR) and writes <out>/<date>-<gpu>-context-parallel-w<W>.json after
each section. On a cold Triton cache the
first calls compile about a dozen Gluon kernel variants (16-bit and float32 outputs, causal and unmasked, varlen):
minutes of the run; `--skip accuracy` keeps the speed checks alone.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

# NVLink multicast stays off in every process (NCCL reads these when its communicators start).
for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)

if __package__ in (None, ""):  # run as a script: import flashtile from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
FWD_BWD = 3.5  # fwd + bwd = 3.5 x fwd FLOPs (bwd 2.5x)
TARGET_S = 1.5  # seconds of timed iterations per provider and size
GiB = 2 ** 30
# "cuda", or "cpu" for --cpu-smoke (gloo, tiny sizes: checks the script's logic on a machine without GPUs).
DEVICE = "cuda"


def causal_flops(batch, heads, seqlen, dim):
    return FWD_BWD * 4.0 * batch * heads * seqlen * seqlen / 2 * dim


def _parse_len(text):
    text = text.strip().lower()
    return int(float(text[:-1]) * 1024) if text.endswith("k") else int(text)


# --------------------------------------------------------------------------------------------------------------
# timing


def _slowest(values):
    t = torch.tensor(values, dtype=torch.float64, device=DEVICE)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _timed(step):
    """ms of one step() (CUDA events on the GPU)."""
    if DEVICE != "cuda":
        t0 = time.perf_counter()
        step()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def _stream_times(step, iters):
    """ms of each of `iters` back-to-back steps, the host never waiting for the GPU (do_bench's way): CUDA events
    around each step on the current stream, one synchronisation after the loop. A step's time is then the GPU's
    time from the end of the step before to the end of this one (its kernels, its waits for transfers, any idle
    the host leaves), without the launch latency of a GPU that drained first."""
    if DEVICE != "cuda":
        return [_timed(step) for _ in range(iters)]
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    events[0].record()
    for i in range(iters):
        step()
        events[i + 1].record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in zip(events, events[1:])]


def time_step(step):
    """(throughput ms, iteration count, peak bytes, synced ms, median-of-max ms) of step():
    - throughput: over back-to-back iterations (_stream_times), the slowest rank's mean step time from the end of
      the first iteration to the end of the last: a training loop's, whose host runs ahead of its GPU; the
      headline number;
    - synced: the median over iterations that each start on an idle GPU after a barrier (CUDA events around one
      step, then a synchronisation) of the slowest rank's: adds each call's latency from the host to its first
      kernel;
    - peak: the memory allocated during the steps beyond what was allocated before them (bytes; 0 on the CPU);
    - median-of-max: the back-to-back iterations' median of the slowest rank's time per iteration (the module
      docstring says how it differs from the throughput for ranks that wait for each other)."""
    step()
    _sync()
    dist.barrier()
    once = _slowest([_timed(step) / 1e3])[0]
    iters = max(3, min(30, int(TARGET_S / max(once, 1e-4))))
    cuda = DEVICE == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    synced = []
    for _ in range(iters):
        dist.barrier()
        synced.append(_timed(step))
    _sync()
    dist.barrier()
    stream = _stream_times(step, iters)
    peak = torch.cuda.max_memory_allocated() - base if cuda else 0
    throughput = _slowest([sum(stream[1:]) / (iters - 1)])[0]
    return throughput, iters, peak, statistics.median(_slowest(synced)), statistics.median(_slowest(stream))


# --------------------------------------------------------------------------------------------------------------
# providers: each returns a step() running fwd+bwd on this rank's inputs


def _grads(out, inputs, dout):
    torch.autograd.grad(out, inputs, dout)


def flashtile_single(q, k, v, dout):
    import flashtile
    return lambda: _grads(flashtile.flash_attn_func(q, k, v, causal=True), (q, k, v), dout)


def flashtile_cp(fn):
    def make(q, k, v, dout):
        return lambda: _grads(fn(q, k, v, causal=True), (q, k, v), dout)
    return make


def _sdpa_layout(*ts):
    return [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in ts]


def torch_single_cudnn(q, k, v, dout):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qt, kt, vt, dt = _sdpa_layout(q, k, v, dout)

    def step():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        _grads(out, (qt, kt, vt), dt)
    return step


_CACHE = {}


def torch_cp_cudnn(q, k, v, dout):
    """torch.distributed.tensor.experimental.context_parallel over SDPA-cuDNN, its defaults (head-tail load
    balancing for causal, all-gather rotation). The local tensors are this rank's shards; a dummy buffer of the
    full length tells context_parallel the sequence length. The context is entered once, around all the timed
    steps (time_step's `context`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel
    world = dist.get_world_size()
    if "mesh" not in _CACHE:
        _CACHE["mesh"] = init_device_mesh("cuda", (world,))
    mesh = _CACHE["mesh"]
    qt, kt, vt, dt = _sdpa_layout(q, k, v, dout)
    marker = torch.zeros(1, 1, q.shape[1] * world, 1, device=q.device)

    def step():
        out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        _grads(out, (qt, kt, vt), dt)

    @contextlib.contextmanager
    def context():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), context_parallel(mesh, buffers=[marker], buffer_seq_dims=[2]):
            yield
    step.context = context
    return step


def speed(args, rank, world):
    import flashtile.distributed as fd
    providers = {
        "flashtile-1gpu": (flashtile_single, 1),
        "zigzag": (flashtile_cp(fd.zigzag_ring_flash_attn_func), world),
        "ring": (flashtile_cp(fd.ring_flash_attn_func), world),
        "ulysses": (flashtile_cp(fd.ulysses_flash_attn_func), world),
        "torch-cp-cudnn": (torch_cp_cudnn, world),
        "cudnn-1gpu": (torch_single_cudnn, 1),
    }
    rows = []
    for seqlen in args.seqlens:
        gen = torch.Generator(device=DEVICE).manual_seed(1 + rank)
        shape = (args.batch, seqlen, args.heads, args.dim)
        q, k, v, dout = (torch.randn(shape, generator=gen, device=DEVICE, dtype=torch.bfloat16) for _ in range(4))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        timings = {name: [] for name in args.providers}  # (ms, iters, peak) per round
        errors = {}
        # The providers take turns, args.rounds times, and each reports its median round: the GPUs' clocks drift
        # as they warm (a kernel can run several percent slower a minute into a run), which would otherwise
        # charge every provider for the ones timed before it.
        for _ in range(args.rounds):
            for name in args.providers:
                if name in errors:
                    continue
                make, _ranks = providers[name]
                try:
                    step = make(q, k, v, dout)
                    with getattr(step, "context", contextlib.nullcontext)():
                        timings[name].append(time_step(step))
                except Exception as err:  # noqa: BLE001 - recorded in the results and printed, never a silent NaN
                    errors[name] = f"{type(err).__name__}: {err}".splitlines()[0][:300]
                    if rank == 0:
                        traceback.print_exc()
                if DEVICE == "cuda":
                    torch.cuda.empty_cache()
        for name in args.providers:
            ranks = providers[name][1]
            row = dict(provider=name, seqlen_per_gpu=seqlen, world=ranks, batch=args.batch, heads=args.heads,
                       dim=args.dim)
            if name in errors:
                row.update(error=errors[name])
            else:
                ms = statistics.median(t[0] for t in timings[name])
                per_gpu = causal_flops(args.batch, args.heads, seqlen * ranks, args.dim) / ranks
                synced = statistics.median(t[3] for t in timings[name])
                row.update(ms=ms, ms_rounds=[t[0] for t in timings[name]], iters=timings[name][0][1],
                           tflops_per_gpu=per_gpu / ms / 1e9, peak_gib=max(t[2] for t in timings[name]) / GiB,
                           ms_synced=synced, ms_synced_rounds=[t[3] for t in timings[name]],
                           ms_median_of_max=statistics.median(t[4] for t in timings[name]),
                           ms_median_of_max_rounds=[t[4] for t in timings[name]],
                           tflops_per_gpu_synced=per_gpu / synced / 1e9)
            rows.append(row)
            if rank == 0:
                print(f"  {name:15s} {seqlen // 1024:3d}k/GPU  " + (f"{row['ms']:9.2f} ms {row['tflops_per_gpu']:6.1f} "
                      f"TFLOP/s/GPU (synced {row['ms_synced']:.2f} ms)  peak {row['peak_gib']:.2f} GiB" if "ms" in row
                      else row["error"]),
                      file=sys.stderr, flush=True)
    return rows


# --------------------------------------------------------------------------------------------------------------
# accuracy


def _reference64(q, k, v, dout, causal, lens=None):
    """float64 (out, lse, dq, dk, dv) on this GPU, one head (and one sequence) at a time."""
    from flashtile.testing import reference_fwd_bwd
    names = ("out", "lse", "dq", "dk", "dv")
    result = {n: [] for n in names}
    bounds = [0] + list(torch.tensor(lens).cumsum(0).tolist()) if lens else [0, q.shape[1]]
    for h in range(q.shape[2]):
        parts = []
        for a, b in zip(bounds, bounds[1:]):
            sl = (slice(None), slice(a, b), slice(h, h + 1))
            parts.append(reference_fwd_bwd(*(t[sl].double() for t in (q, k, v, dout)), q.shape[-1] ** -0.5, causal,
                                           0)[:5])
        for i, n in enumerate(names):
            result[n].append(torch.cat([p[i] for p in parts], dim=2 if n == "lse" else 1))
    return {n: torch.cat(result[n], dim=1 if n == "lse" else 2) for n in names}


def _gather(x, dim, zigzag):
    import flashtile.distributed as fd
    if zigzag:
        return fd.zigzag_unshard(x, dim)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def _run(fn, q, k, v, dout, **kw):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse, _ = fn(q, k, v, return_attn_probs=True, **kw)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)


def _errors(got, ref):
    return {n: (got[n].double() - ref[n]).abs().max().item() for n in ref}


def accuracy(args, rank, world):
    s, h, d = -(-args.acc_seqlen // (2 * world)) * 2 * world, args.acc_heads, args.dim  # zig-zag: 2W chunks
    gen = torch.Generator(device=DEVICE).manual_seed(0)  # the same full inputs on every rank
    q, k, v, dout = (torch.randn(1, s, h, d, generator=gen, device=DEVICE, dtype=torch.bfloat16) for _ in range(4))
    rows = []
    lens = [s * 2 // 5, s // 5, s - s * 2 // 5 - s // 5]  # sequences cross the shard boundaries
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=DEVICE)
    cases = [("ring", False), ("ring", True), ("zigzag", False), ("zigzag", True), ("varlen", True),
             ("ulysses", True)]
    refs = {}
    for name, causal in cases:
        key = (causal, name == "varlen")
        row = dict(function=name, causal=causal, seqlen=s, heads=h, dim=d)
        try:
            if key not in refs:
                refs[key] = _reference64(q, k, v, dout, causal, lens if name == "varlen" else None)
            ref = refs[key]
            single, got = _accuracy_case(name, causal, (q, k, v, dout), cu, lens, rank, world)
            e_single, e_cp = _errors(single, ref), _errors(got, ref)
            ratios = {n: e_cp[n] / e_single[n] if e_single[n] > 0 else float("inf") for n in ref}
            row.update(error_single=e_single, error_cp=e_cp, ratio=ratios,
                       worst_ratio=max(ratios[n] for n in ("out", "dq", "dk", "dv")))
            message = " ".join(f"{n} {r:.2f}" for n, r in ratios.items())
        except Exception as err:  # noqa: BLE001 - recorded and printed (the API raises on every rank alike)
            row.update(error=f"{type(err).__name__}: {err}".splitlines()[0][:300])
            message = row["error"]
        rows.append(row)
        if rank == 0:
            print(f"  {name:8s} causal={causal!s:5s} ratios {message}", file=sys.stderr, flush=True)
    return rows


def _accuracy_case(name, causal, full, cu, lens, rank, world):
    """(one GPU's result, the distributed result gathered) on the full inputs, as dicts of [1, S, H, D] / [1, H, S]."""
    import flashtile
    import flashtile.distributed as fd
    q, k, v, dout = full
    if name == "varlen":
        flat = [t[0] for t in (q, k, v, dout)]
        single = _run(lambda *a, **kw: flashtile.flash_attn_varlen_func(*a, cu, cu, max(lens), max(lens), **kw),
                      *flat[:3], flat[3], causal=causal)
        shard = [t.chunk(world, 0)[rank] for t in flat]
        got = _run(lambda *a, **kw: fd.ring_flash_attn_varlen_func(*a, cu, max(lens), **kw), *shard[:3], shard[3],
                   causal=causal)
        got = {n: _gather(t, 1 if n == "lse" else 0, False) for n, t in got.items()}
        return ({n: t.unsqueeze(0) for n, t in single.items()}, {n: t.unsqueeze(0) for n, t in got.items()})
    single = _run(flashtile.flash_attn_func, q, k, v, dout, causal=causal)
    zig = name == "zigzag"
    shard = [fd.zigzag_shard(t, 1) if zig else t.chunk(world, 1)[rank] for t in (q, k, v, dout)]
    fn = {"ring": fd.ring_flash_attn_func, "zigzag": fd.zigzag_ring_flash_attn_func,
          "ulysses": fd.ulysses_flash_attn_func}[name]
    got = _run(fn, *shard, causal=causal)
    return single, {n: _gather(t, 2 if n == "lse" else 1, zig) for n, t in got.items()}


# --------------------------------------------------------------------------------------------------------------
# the link


def link(rank, world):
    """Point-to-point bandwidth and latency between ring neighbours, and all-to-all time, NCCL, bf16 buffers."""
    result = {}
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    big = 64 * 2 ** 20 if DEVICE == "cuda" else 2 ** 16
    for label, numel in (("latency", 1), ("bandwidth", big)):
        send = torch.ones(numel, dtype=torch.bfloat16, device=DEVICE)
        recv = torch.empty_like(send)

        def exchange():
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt), dist.P2POp(dist.irecv, recv, prv)]):
                w.wait()
        ms = time_step(exchange)[0]
        result[f"p2p_{label}_ms"] = ms
        if label == "bandwidth":
            result["p2p_GBps"] = send.numel() * 2 / ms / 1e6
    x = torch.ones(big, dtype=torch.bfloat16, device=DEVICE)
    y = torch.empty_like(x)
    ms = time_step(lambda: dist.all_to_all_single(y, x))[0]
    result.update(all_to_all_ms=ms, all_to_all_bytes=x.numel() * 2, all_to_all_GBps=x.numel() * 2 * (world - 1) / world / ms / 1e6)
    return result


# --------------------------------------------------------------------------------------------------------------


# Issue 27's bars: zig-zag per-GPU TFLOP/s over one GPU's at the local length (by tokens per GPU, 0.95 above 16k),
# torch's context_parallel step time over flashtile's, and the error ratio against one GPU's.
SPEED_BAR = {16384: 0.90}
SPEED_BAR_DEFAULT = 0.95
TORCH_CP_BAR = 1.05
ERROR_BAR = 1.2


def _mark(ok):
    return "ok" if ok else "BELOW BAR"


def _table(results):
    lines = []
    speed_rows = [r for r in results["speed"] if "ms" in r]
    for s in sorted({r["seqlen_per_gpu"] for r in speed_rows}):
        by = {r["provider"]: r for r in speed_rows if r["seqlen_per_gpu"] == s}
        base, zig, tcp = by.get("flashtile-1gpu"), by.get("zigzag"), by.get("torch-cp-cudnn")
        line = f"{s // 1024:4d}k/GPU"
        if base and zig:
            ratio, bar = zig["tflops_per_gpu"] / base["tflops_per_gpu"], SPEED_BAR.get(s, SPEED_BAR_DEFAULT)
            synced = zig["tflops_per_gpu_synced"] / base["tflops_per_gpu_synced"]
            per_iter = base["ms_median_of_max"] * zig["world"] / zig["ms_median_of_max"]
            line += (f"  zigzag/1-GPU {ratio:.3f} (>= {bar}: {_mark(ratio >= bar)}; median of max {per_iter:.3f};"
                     f" synced calls {synced:.3f})")
        if zig and tcp:
            ratio = tcp["ms"] / zig["ms"]
            line += f"  torch-CP time/zigzag {ratio:.3f} (>= {TORCH_CP_BAR}: {_mark(ratio >= TORCH_CP_BAR)})"
        lines.append(line)
        lines.append("          TFLOP/s/GPU " + "  ".join(f"{n} {by[n]['tflops_per_gpu']:.0f}" for n in by)
                     + "   peak GiB " + "  ".join(f"{n} {by[n]['peak_gib']:.2f}" for n in by))
    for r in results["accuracy"]:
        if "error" in r:
            lines.append(f"error ratio {r['function']:8s} causal={r['causal']!s:5s} {r['error']}")
            continue
        worst = r["worst_ratio"]
        lines.append(f"error ratio {r['function']:8s} causal={r['causal']!s:5s} worst of out/dq/dk/dv {worst:.3f} "
                     f"(<= {ERROR_BAR}: {_mark(worst <= ERROR_BAR)})")
    for r in results["speed"]:
        if "error" in r:
            lines.append(f"{r['provider']} at {r['seqlen_per_gpu']}: {r['error']}")
    if results.get("link"):
        lines.append("link: " + "  ".join(f"{k} {v:.4g}" for k, v in results["link"].items()))
    return "\n".join(lines)


def _out_path(out_dir, gpu, world):
    slug = re.sub(r"[^a-z0-9]+", "-", re.sub(r"^nvidia\s+", "", gpu.lower())).strip("-")
    stem = f"{datetime.date.today().isoformat()}-{slug}-context-parallel-w{world}"
    path, n = Path(out_dir) / f"{stem}.json", 2
    while path.exists():
        path, n = Path(out_dir) / f"{stem}-{n}.json", n + 1
    return path


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_jsonable(v) for v in x]
    return x


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqlens", default="16k,32k,64k", help="tokens per GPU, comma-separated")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--providers", default="flashtile-1gpu,zigzag,ulysses,torch-cp-cudnn,cudnn-1gpu")
    ap.add_argument("--acc-seqlen", type=int, default=8192, help="whole sequence of the accuracy check")
    ap.add_argument("--acc-heads", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="turns the providers of one size take (medians reported)")
    ap.add_argument("--skip", default="", help="comma-separated: accuracy, speed, link")
    ap.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results"))
    ap.add_argument("--cpu-smoke", action="store_true", help="gloo on CPU at tiny sizes (TRITON_INTERPRET=1 runs "
                    "the kernels): checks this script without GPUs; its numbers mean nothing")
    args = ap.parse_args()
    if args.cpu_smoke:
        global DEVICE, TARGET_S
        DEVICE, TARGET_S = "cpu", 0.0
        args.seqlens, args.heads, args.dim, args.acc_seqlen, args.acc_heads = "256", 2, 32, 512, 2
        args.providers = "flashtile-1gpu,zigzag,ring,ulysses"
    args.seqlens = [_parse_len(x) for x in args.seqlens.split(",") if x]
    args.providers = [p for p in args.providers.split(",") if p]
    skip = set(args.skip.split(","))

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if DEVICE == "cuda":
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    import triton
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu-smoke"
    results = dict(gpu=gpu, world=world, torch=torch.__version__,
                   triton=triton.__version__, cuda=torch.version.cuda, date=datetime.datetime.now().isoformat(),
                   env={n: os.environ.get(n) for n in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                       "NVSHMEM_DISABLE_NVLS")},
                   args={k: v for k, v in vars(args).items()}, accuracy=[], speed=[], link={})
    t0 = time.time()
    path = _out_path(args.out, gpu, world) if rank == 0 else None
    # Speed first (the closing bars), then accuracy (it compiles more kernel variants on a cold Triton cache); the
    # JSON is rewritten after each section, so a run cut short keeps what it measured.
    sections = (("link", lambda: link(rank, world)), ("speed", lambda: speed(args, rank, world)),
                ("accuracy", lambda: accuracy(args, rank, world)))
    for name, run in sections:
        if name in skip:
            continue
        results[name] = run()
        results["wall_s"] = time.time() - t0
        if rank == 0:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(_jsonable(results), indent=1))
    if rank == 0:
        print(_table(results))
        print(f"wrote {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
