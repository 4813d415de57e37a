"""The FP8 forward against the bf16 forward and torch SDPA (cuDNN), in one run.

    python -m flashtile bench fp8 [--seqlen 1k,4k,16k] [--rounds 5] [--out DIR]

Head dim 128, 16 heads (2048 hidden), batch x seqlen = 16k tokens, causal and not. The float8_e4m3fn inputs are
the bf16 ones quantized as an inference engine does: per (batch entry, kv head), scaled so that the largest
magnitude maps to 448, the factors passed as q_descale, k_descale, v_descale. Providers: flashtile's FP8 forward
(`flash_attn_func` with the float8 inputs and their factors; the call includes its per-call copy of V with the keys
contiguous), flashtile's bf16 forward and SDPA cuDNN on the bf16 inputs. Each round times every provider once, the
order rotating by one each round; the figure is the median over the rounds (triton.testing.do_bench's median time
within each). TFLOP/s count 4·B·H·S²·D, halved for causal.

The check before timing compares sampled rows with an fp32 reference: the bf16 rows against the inputs' attention
(the suite's tolerance), the FP8 rows against the attention of the dequantized inputs with FP8_ATOL, which only
catches wrong or non-finite outputs (the accuracy rule of the FP8 forward is tests/test_fp8.py's). The issue's bar:
the FP8 forward at BAR_RATIO x the bf16 forward's TFLOP/s at 16k without a causal mask. Writes
<date>-<gpu>-fp8.json to --out.
"""
from __future__ import annotations

import argparse
import sys

import torch

from . import host
from .decode import log
from .runner import ATOL, DEFAULT_OUT, check_rows, flops, parse_list, reference_rows, report_bars

HEAD_DIM = 128
HEADS = 16
TOTAL_TOKENS = 16 * 1024
SEQLENS = (1024, 4096, 16384)
ROUNDS = 5
E4M3_MAX = 448.0
# Largest abs difference of a sampled FP8 output row from the fp32 attention of the dequantized inputs that passes
# the check: P is rounded to float8 (3 mantissa bits) before P V, so short rows with a few keys of weight carry
# errors of several percent of |v| (~2^-4 x 4 for N(0, 1) values).
FP8_ATOL = 0.25
# The bar: the FP8 forward's TFLOP/s over the bf16 forward's at BAR_SEQLEN without a causal mask.
BAR_RATIO = 1.4
BAR_SEQLEN = 16384
PROVIDERS = ("flashtile-fp8", "flashtile", "sdpa-cudnn")


def quantize(x, kv_heads):
    """(float8_e4m3fn x, fp32 (B, kv_heads) factors) of x (B, S, H, D): each kv head's group of heads scaled so that
    its largest magnitude maps to E4M3_MAX (all-zero groups keep a factor of 1)."""
    b, s, h, d = x.shape
    grouped = x.float().unflatten(2, (kv_heads, h // kv_heads))
    amax = grouped.abs().amax(dim=(1, 3, 4))
    factor = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    stored = (grouped / factor[:, None, :, None, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return stored.flatten(2, 3), factor


def dequantize(x8, factor):
    """The values x8 (B, S, H, D) stands for: each head's float8 values times its kv head's factor, in fp32."""
    h, hk = x8.shape[2], factor.shape[1]
    return x8.float() * factor.repeat_interleave(h // hk, dim=1)[:, None, :, None]


def calls(seqlen, causal, device="cuda", seed=0, total_tokens=TOTAL_TOKENS):
    """({provider: forward callable}, {provider: (output -> [B, S, H, D])}, the check's inputs per provider) of one
    shape: batch total_tokens / seqlen."""
    import flashtile
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    batch = max(1, total_tokens // seqlen)
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(batch, seqlen, HEADS, HEAD_DIM, generator=gen, device=device, dtype=torch.bfloat16)
               for _ in range(3))
    (q8, qd), (k8, kd), (v8, vd) = (quantize(t, HEADS) for t in (q, k, v))
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    fns = {"flashtile-fp8": lambda: flashtile.flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd,
                                                              k_descale=kd, v_descale=vd),
           "flashtile": lambda: flashtile.flash_attn_func(q, k, v, causal=causal),
           "sdpa-cudnn": cudnn}
    to_bshd = {"flashtile-fp8": lambda o: o, "flashtile": lambda o: o, "sdpa-cudnn": lambda o: o.transpose(1, 2)}
    dequantized = tuple(dequantize(t, f) for t, f in ((q8, qd), (k8, kd), (v8, vd)))
    inputs = {"flashtile-fp8": dequantized, "flashtile": (q, k, v), "sdpa-cudnn": (q, k, v)}
    return fns, to_bshd, inputs


def check(fns, to_bshd, inputs, seqlen, causal):
    """({provider: max abs diff of its sampled rows from its fp32 reference}, {provider: "ok" or "wrong"}): FP8
    against the dequantized inputs' attention with FP8_ATOL, the others against the inputs' with the suite's."""
    sampled, refs, diffs, status = check_rows(seqlen), {}, {}, {}
    for name, fn in fns.items():
        key = id(inputs[name][0])
        if key not in refs:
            refs[key] = reference_rows(*inputs[name], causal, HEAD_DIM ** -0.5, sampled)
        got = to_bshd[name](fn())
        diff = (got[:, sampled.to(got.device)].float() - refs[key]).abs().max().item()
        atol = FP8_ATOL if name == "flashtile-fp8" else ATOL[torch.bfloat16]
        diffs[name] = diff
        status[name] = "ok" if bool(torch.isfinite(got).all()) and diff <= atol else "wrong"
    return diffs, status


def measure(seqlens, rounds):
    """Rows {seqlen, batch, causal, provider, tflops, rounds, max_abs_diff, status} of every shape and provider."""
    import triton

    from .._ahead import wait_for_compiles

    rows = []
    for seqlen in seqlens:
        for causal in (False, True):
            fns, to_bshd, inputs = calls(seqlen, causal)
            batch = max(1, TOTAL_TOKENS // seqlen)
            n = flops(batch, HEADS, seqlen, seqlen, HEAD_DIM, causal, "fwd")
            diffs, status = check(fns, to_bshd, inputs, seqlen, causal)
            wait_for_compiles()  # (what the first calls left compiling in the background)
            times = {name: [] for name in fns}
            names = list(fns)
            for r in range(rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    times[name].append(triton.testing.do_bench(fns[name], warmup=25, rep=100,
                                                               return_mode="median"))
            for name in names:
                med = sorted(times[name])[len(times[name]) // 2]
                rows.append(dict(seqlen=seqlen, batch=batch, heads=HEADS, headdim=HEAD_DIM, causal=causal,
                                 provider=name, tflops=n / med / 1e9, ms=med, rounds_ms=times[name],
                                 max_abs_diff=diffs[name], status=status[name]))
    return rows


def ratios(rows):
    """{(seqlen, causal): FP8 TFLOP/s over bf16 flashtile's} of the shapes where both are ok."""
    by = {(r["seqlen"], r["causal"], r["provider"]): r for r in rows if r["status"] == "ok"}
    out = {}
    for seqlen, causal in dict.fromkeys((r["seqlen"], r["causal"]) for r in rows):
        fp8, bf16 = by.get((seqlen, causal, "flashtile-fp8")), by.get((seqlen, causal, "flashtile"))
        if fp8 is not None and bf16 is not None:
            out[(seqlen, causal)] = fp8["tflops"] / bf16["tflops"]
    return out


def bars(rows):
    """The issue's bar: (description, passed or None, detail)."""
    ratio = ratios(rows).get((BAR_SEQLEN, False))
    bar = f"FP8 forward >= {BAR_RATIO}x the bf16 forward's TFLOP/s at d{HEAD_DIM}, {BAR_SEQLEN // 1024}k"
    if ratio is None:
        return [(bar, None, "not measured")]
    return [(bar, ratio >= BAR_RATIO, f"{ratio:.2f}x")]


def format_table(rows):
    """One line per shape: each provider's TFLOP/s (or its status) and FP8 over bf16 and over cuDNN."""
    by = {(r["seqlen"], r["causal"], r["provider"]): r for r in rows}
    lines = [f"{'shape':<24}" + "".join(f"{p:>15}" for p in PROVIDERS) + f"{'fp8/bf16':>10}{'fp8/cudnn':>11}"]
    for seqlen, causal in dict.fromkeys((r["seqlen"], r["causal"]) for r in rows):
        batch = max(1, TOTAL_TOKENS // seqlen)
        cells, vals = [], {}
        for p in PROVIDERS:
            r = by.get((seqlen, causal, p))
            ok = r is not None and r["status"] == "ok"
            vals[p] = r["tflops"] if ok else None
            cells.append(f"{r['tflops']:>15.0f}" if ok else f"{(r or {}).get('status', 'missing'):>15}")
        rel = [f"{vals['flashtile-fp8'] / vals[b]:>{w}.2f}x" if vals["flashtile-fp8"] and vals[b] else f"{'':>{w + 1}}"
               for b, w in (("flashtile", 9), ("sdpa-cudnn", 10))]
        shape = f"B{batch} H{HEADS} S{seqlen // 1024}k D{HEAD_DIM}{' causal' if causal else ''}"
        lines.append(f"{shape:<24}" + "".join(cells) + "".join(rel))
    return "\n".join(lines)


def metadata(argv):
    """bench host's metadata (date, GPU, versions, commit, argv) with this benchmark's timing."""
    return dict(host.metadata(argv, cpu=False),
                timing="TFLOP/s of the median over the rounds of do_bench's median time, provider order rotating by "
                       "one each round; the FP8 call includes its copy of V")


def build_parser(prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=parse_list, default=SEQLENS, metavar="LIST",
                   help="sequence lengths, e.g. 1k,4k,16k (default 1k,4k,16k)")
    p.add_argument("--rounds", type=int, default=ROUNDS, help=f"rounds; the median counts (default {ROUNDS})")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help=f"results folder (default ./{DEFAULT_OUT})")
    return p


def main(argv=None, prog=None):
    """Run the FP8 benchmark; returns the exit status (2 without a GPU)."""
    args = build_parser(prog).parse_args(argv)
    if not torch.cuda.is_available():
        log("error: no CUDA device; the FP8 benchmark needs a Hopper GPU")
        return 2
    meta = metadata(sys.argv[1:] if argv is None else list(argv))
    rows = measure(args.seqlen, args.rounds)
    print(format_table(rows))
    out_path = report_bars(bars(rows), args.out, meta["gpu"], "fp8", meta["date"][:10],
                           {"metadata": meta, "results": rows})
    log(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
