"""Cost of the default value checks (docs/safety.md), against the same calls with the checks stubbed out and,
with --baseline, against another flashtile tree (main before the checks).

    python benchmarks/safety_cost.py                                  # GPU
    python benchmarks/safety_cost.py --baseline /tmp/flashtile-base   # + a tree without the checks
    TRITON_INTERPRET=1 python benchmarks/safety_cost.py --host-cpu    # no GPU: host time, kernel launches stubbed

A baseline tree is any directory holding a `flashtile` package, e.g.
`mkdir /tmp/flashtile-base && git archive 02fed7d flashtile | tar -x -C /tmp/flashtile-base`.

Measured (issue 25's bars: <= 1% at the 16k training rows, <= 2 us of host time per decode call):
- decode host us: wall time per call of 2000 back-to-back flash_attn_with_kvcache calls without synchronising
  (batch 1, 256 cached keys, so that the GPU keeps up and the host is what is timed), contiguous and paged (16), with
  a cache_seqlens tensor: the repeated-call path. On the CPU (--host-cpu) the launches are stubbed out, so only
  flashtile's Python is timed; there the index tensors are CPU tensors, whose values are checked on every call,
  and the "gpu-default" variant times the path CUDA tensors take (values not read).
- train ms (GPU): forward + backward of flash_attn_varlen_func over 16384 rows (8 sequences of 2048, 16 heads, head
  dim 128, bf16, causal), median of triton.testing.do_bench; and of flash_attn_func at (1, 16384).
- check alone us (CPU): the value check the repeated-call path runs for CPU index tensors, timed by itself.
Each variant runs in its own process, the variants alternating for --rounds rounds; host times are the best round,
GPU times the median round. Writes benchmarks/results/<date>-<gpu>-safety-cost.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("checks", "stubbed")
DECODE_CALLS = 2000


def _stub_checks():
    """The checks of this tree replaced by no-ops (what a call costs without them)."""
    from flashtile import _values
    _values.varlen_lengths = lambda *args: None
    _values.kvcache = lambda *args: None
    _values.readable = lambda t: False


def _decode_cases(device, dtype):
    import torch
    from flashtile import flash_attn_with_kvcache
    heads, kv_heads, head_dim, kv_len = 32, 8, 128, 256  # bench_decode's heads; few keys: the host is timed
    q = torch.randn(1, 1, heads, head_dim, device=device, dtype=dtype)
    k = torch.randn(1, kv_len, kv_heads, head_dim, device=device, dtype=dtype)
    pool = k.view(kv_len // 16, 16, kv_heads, head_dim)
    table = torch.arange(kv_len // 16, device=device, dtype=torch.int32).view(1, -1)
    seqlens = torch.full((1,), kv_len, device=device, dtype=torch.int32)
    return {
        "decode contiguous": lambda: flash_attn_with_kvcache(q, k, k, cache_seqlens=seqlens),
        "decode paged 16": lambda: flash_attn_with_kvcache(q, pool, pool, cache_seqlens=seqlens, block_table=table),
    }


def _host_us(fn, sync):
    for _ in range(200):
        fn()
    sync()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(DECODE_CALLS):
            fn()
        sync()
        best = min(best, (time.perf_counter() - start) / DECODE_CALLS * 1e6)
    return best


def _train_ms():
    import torch
    import triton
    import flashtile
    lens, heads, head_dim = [2048] * 8, 16, 128
    total = sum(lens)
    q, k, v = (torch.randn(total, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], device="cuda", dtype=torch.int32)
    dout = torch.randn_like(q)
    qf, kf, vf = (t.detach().view(1, total, heads, head_dim).requires_grad_() for t in (q, k, v))

    def varlen():
        out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 2048, 2048, causal=True)
        out.backward(dout)

    def fixed():
        out = flashtile.flash_attn_func(qf, kf, vf, causal=True)
        out.backward(dout.view(1, total, heads, head_dim))

    return {"train varlen 16k fwd+bwd": triton.testing.do_bench(varlen, warmup=100, rep=500),
            "train fixed 16k fwd+bwd": triton.testing.do_bench(fixed, warmup=100, rep=500)}


def worker(variant, host_cpu):
    """One variant's numbers, as JSON on stdout."""
    import torch
    if variant == "stubbed":
        _stub_checks()
    if variant == "gpu-default":
        # CPU tensors, but the repeated-call path as CUDA ones take it: values not read.
        from flashtile import kvcache
        original = kvcache._remember

        def remember(*args, **kwargs):
            original(*args, **kwargs)
            for call in kvcache._CALLS.values():
                call.host_values = False
        kvcache._remember = remember
    result = {}
    if host_cpu:
        from flashtile.bench.decode import host_overhead_cpu
        # `python -m flashtile bench decode`'s host cases (batch 1, 4k keys, paged 16: 256 table entries),
        # launches stubbed out.
        result.update({name + " host us": us for name, us in host_overhead_cpu(progress=lambda text: None).items()})
        if variant == "checks":
            from flashtile import _values
            # The paged case's check: 4096 keys in 256 pages of 16.
            table = torch.arange(256, dtype=torch.int32).view(1, -1)
            layout = _values.CacheLayout(4096, 256, 16, 0, 0, 1)
            seqlens = torch.full((1,), 4096, dtype=torch.int32)
            result["paged 16 check alone host us"] = _host_us(
                lambda: _values.kvcache(layout, 1, seqlens, 4096, None, None, table), lambda: None)
    else:
        for name, fn in _decode_cases("cuda", torch.bfloat16).items():
            result[name + " host us"] = _host_us(fn, torch.cuda.synchronize)
        result.update({name + " ms": ms for name, ms in _train_ms().items()})
    print(json.dumps(result))


def _run_worker(variant, tree, host_cpu):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(REPO)]))
    cmd = [sys.executable, __file__, "--worker", variant] + (["--host-cpu"] if host_cpu else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"{variant} ({tree}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host-cpu", action="store_true", help="host time per decode call on the CPU (no GPU)")
    p.add_argument("--baseline", type=Path, help="a directory holding a flashtile package without the checks")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.host_cpu)
        return 0
    runs = [(v, REPO) for v in VARIANTS]
    if args.host_cpu:
        runs.append(("gpu-default", REPO))
    if args.baseline:
        runs.append(("baseline", args.baseline))
    rounds = {variant: [] for variant, _ in runs}
    for r in range(args.rounds):
        for variant, tree in runs:
            rounds[variant].append(_run_worker(variant, tree, args.host_cpu))
            print(f"round {r + 1}: {variant}: {rounds[variant][-1]}", file=sys.stderr)
    # Host times: the best round (load on the machine only ever adds); GPU times: the median round.
    medians = {v: {name: (min if name.endswith("us") else statistics.median)(run[name] for run in rs)
                   for name in rs[0]} for v, rs in rounds.items()}
    names = list(medians["checks"])
    print(f"{'':<34}" + "".join(f"{v:>14}" for v in medians))
    for name in names:
        print(f"{name:<34}" + "".join(f"{medians[v].get(name, float('nan')):>14.2f}" for v in medians))
    for other in [v for v in medians if v != "checks"]:
        for name in [n for n in names if n in medians[other]]:
            delta = medians["checks"][name] - medians[other][name]
            unit = "us" if name.endswith("us") else "ms"
            print(f"checks - {other}, {name}: {delta:+.3f} {unit} ({delta / medians[other][name]:+.2%})")
    import torch
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.host_cpu else "cpu"
    slug = gpu.lower().replace("nvidia", "").strip().split()[0] if gpu != "cpu" else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{datetime.date.today().isoformat()}-{slug}-safety-cost.json"
    path.write_text(json.dumps(dict(device=gpu, torch=torch.__version__, rounds=rounds, medians=medians,
                                    baseline=str(args.baseline) if args.baseline else None), indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
