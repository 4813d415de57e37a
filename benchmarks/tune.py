"""Tile sweep for flashtile's kernels on the GPU at hand: where the entries of flashtile/kernels/configs.py come from.

For each (head dim, causal) it times every candidate tile of one kernel family with the others at their defaults,
and prints TFLOP/s, registers and spills. Candidates that fail to compile or do not fit are listed as such.

    python benchmarks/tune.py --family fwd --headdim 64,128,256 --seqlen 16384 [--out DIR]
    python benchmarks/tune.py --family bwd_dkdv ...   (whole backward timed; only the dK/dV tiles vary)
    python benchmarks/tune.py --family bwd_dq ...
"""
import argparse
import datetime
import json
import os
import sys

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import flashtile  # noqa: E402
from flashtile.kernels import configs  # noqa: E402
from flashtile._settings import override  # noqa: E402
from flashtile.kernels.configs import TileConfig as T  # noqa: E402

HIDDEN = 2048  # model width: heads = HIDDEN // head_dim, as in the benchmark suite
TOKENS = 16384  # batch * seqlen

SWEEP = {
    "fwd": [T(128, 64, 4, 2), T(128, 64, 4, 3), T(128, 64, 4, 4), T(128, 64, 8, 2), T(128, 64, 8, 3),
            T(128, 128, 4, 2), T(128, 128, 8, 2), T(128, 128, 8, 3), T(64, 64, 4, 3), T(128, 32, 4, 3)],
    "bwd_dkdv": [T(64, 64, 4, 2), T(64, 64, 4, 3), T(64, 64, 8, 2), T(32, 64, 4, 2), T(64, 128, 8, 2),
                 T(64, 128, 8, 1), T(32, 128, 4, 2), T(32, 128, 8, 2), T(128, 64, 8, 2), T(64, 128, 4, 2)],
    "bwd_dq": [T(128, 64, 8, 3), T(128, 64, 8, 2), T(64, 64, 4, 3), T(64, 64, 4, 2), T(128, 32, 8, 2),
               T(128, 128, 8, 2), T(64, 128, 4, 2), T(128, 64, 4, 2), T(64, 32, 4, 3)],
}


def flops(b, h, s, d, causal, family):
    f = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
    return f if family == "fwd" else 2.5 * f


def sweep_one(family, d, causal, seqlen, dtype):
    b, h = max(1, TOKENS // seqlen), HIDDEN // d
    gen = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn((b, seqlen, h, d), device="cuda", generator=gen, dtype=dtype).requires_grad_()
               for _ in range(3))
    dout = torch.randn_like(q)
    rows = []
    for cfg in SWEEP[family]:
        configs._CHOSEN.clear()
        row = {"family": family, "head_dim": d, "causal": causal, "seqlen": seqlen, "tile": cfg.__dict__}
        try:
            with override(tiles={family: [cfg]}):
                ms, kern = _time_one(family, q, k, v, dout, causal)
            row["ms"] = ms
            row["tflops"] = flops(b, h, seqlen, d, causal, family) / ms * 1e-9
            if kern is not None:
                row["n_regs"] = getattr(kern, "n_regs", None)
                row["n_spills"] = getattr(kern, "n_spills", None)
        except Exception as err:  # a tile that does not fit is a result of the sweep, reported per row
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}"
        rows.append(row)
        t = cfg
        desc = f"{t.block_m}x{t.block_n} w{t.num_warps} s{t.num_stages}"
        result = row.get("error") or f"{row['tflops']:7.1f} TFLOP/s  regs {row.get('n_regs')} spills {row.get('n_spills')}"
        print(f"{family:9s} d{d:<4d} {'causal' if causal else 'full  '} {desc:22s} {result}", file=sys.stderr,
              flush=True)
    configs._CHOSEN.clear()
    return rows


def _time_one(family, q, k, v, dout, causal):
    """(median ms of forward or backward under the current tile override, the family's last compiled kernel or
    None)."""
    if family == "fwd":
        def fn():
            return flashtile.flash_attn_func(q, k, v, causal=causal)
    else:
        out = flashtile.flash_attn_func(q, k, v, causal=causal)

        def fn():
            out.backward(dout, retain_graph=True)
    fn()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(fn, warmup=20, rep=80, return_mode="median",
                                 grad_to_none=None if family == "fwd" else [q, k, v])
    kernels = configs.compiled_kernels(family, q.shape[-1])
    return ms, kernels[-1][2] if kernels else None


def profile_one(d, causal, seqlen, dtype, iters=5):
    """Per-kernel CUDA time of forward + backward with the default tiles (torch.profiler)."""
    b, h = max(1, TOKENS // seqlen), HIDDEN // d
    q, k, v = (torch.randn((b, seqlen, h, d), device="cuda", dtype=dtype).requires_grad_() for _ in range(3))
    dout = torch.randn_like(q)
    for _ in range(2):
        flashtile.flash_attn_func(q, k, v, causal=causal).backward(dout)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            flashtile.flash_attn_func(q, k, v, causal=causal).backward(dout)
        torch.cuda.synchronize()
    times = {}
    for e in prof.key_averages():
        if "kernel" in e.key and e.key.startswith("_"):
            times[e.key] = getattr(e, "device_time_total", None) or e.cuda_time_total
    fwd_flops = flops(b, h, seqlen, d, causal, "fwd")
    for name, us in sorted(times.items(), key=lambda kv: -kv[1]):
        ms = us / iters / 1e3
        share = fwd_flops * (1 if "fwd" in name else 2.5) if "preprocess" not in name else 0
        rate = f"{share / ms * 1e-9:7.1f} TFLOP/s (counted)" if share else ""
        print(f"profile d{d} {'causal' if causal else 'full  '} {name:28s} {ms:8.3f} ms {rate}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=sorted(SWEEP) + ["profile"], required=True,
                   help="a kernel family to sweep, or profile: per-kernel times with the default tiles")
    p.add_argument("--headdim", default="64,128,256")
    p.add_argument("--causal", choices=("0", "1", "both"), default="both")
    p.add_argument("--seqlen", type=int, default=16384)
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--out", default=None, help="directory for a JSON of all rows")
    args = p.parse_args(argv)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    causals = {"0": [False], "1": [True], "both": [False, True]}[args.causal]
    rows = []
    if args.family == "profile":
        for d in (int(x) for x in args.headdim.split(",")):
            for causal in causals:
                profile_one(d, causal, args.seqlen, dtype)
        return
    for d in (int(x) for x in args.headdim.split(",")):
        for causal in causals:
            rows += sweep_one(args.family, d, causal, args.seqlen, dtype)
    print("\n| family | d | causal | best tile | TFLOP/s | default tile | TFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    for d in sorted({r["head_dim"] for r in rows}):
        for causal in causals:
            ok = [r for r in rows if r["head_dim"] == d and r["causal"] == causal and "tflops" in r]
            if not ok:
                continue
            best = max(ok, key=lambda r: r["tflops"])
            first = ok[0]
            fmt = lambda t: f"{t['block_m']}x{t['block_n']} w{t['num_warps']} s{t['num_stages']}"  # noqa: E731
            print(f"| {args.family} | {d} | {causal} | {fmt(best['tile'])} | {best['tflops']:.1f} | "
                  f"{fmt(first['tile'])} | {first['tflops']:.1f} |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                "date": datetime.date.today().isoformat(), "args": vars(args)}
        with open(os.path.join(args.out, f"tune-{args.family}.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
