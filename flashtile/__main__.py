"""Command line: `python -m flashtile VERB [arguments]`, one entry per verb in VERBS.

check: runs the kernels forward and backward against the float64 reference on the device present (a CUDA GPU, or
    Triton's interpreter on the CPU with small shapes), plain attention over a set of shapes and then each feature
    (window, softcap, ALiBi, sinks, dropout, bias, bool mask) on one shape, and prints a pass/fail table; exit
    status 1 on any failure.
bench: the benchmark (flashtile/bench/): flashtile against torch SDPA, FlexAttention and FA4 in the same run on a
    CUDA GPU; `bench --help` lists its options and its other benchmarks (features, decode, plot).
explain: which backend (Gluon Hopper kernels, portable Triton kernels, PyTorch reference) runs a call of the given
    shape and options, forward and backward, and why the ones before it decline; `explain --help` lists the options
    (--arch 90 asks about an H100 from any machine).
"""
import os
import sys

import torch

# (where, batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, causal, dtype): GPU cases cover the Gluon and the
# portable kernels' head dims and odd sizes; CPU cases are small enough for Triton's interpreter.
_CASES = [
    ("gpu", 2, 1024, 1024, 16, 16, 64, False, torch.bfloat16),
    ("gpu", 2, 1024, 1024, 16, 16, 64, True, torch.float16),
    ("gpu", 1, 4096, 4096, 16, 4, 128, True, torch.bfloat16),
    ("gpu", 1, 4096, 4096, 16, 16, 128, False, torch.float16),
    ("gpu", 1, 2048, 2048, 8, 8, 256, True, torch.bfloat16),
    ("gpu", 2, 1000, 3000, 8, 2, 96, True, torch.bfloat16),
    ("gpu", 2, 3000, 1000, 8, 1, 40, True, torch.float16),
    ("gpu", 2, 777, 777, 4, 4, 32, False, torch.float32),
    ("gpu", 4, 1, 4096, 32, 8, 128, True, torch.bfloat16),
    ("cpu", 1, 17, 33, 2, 1, 16, False, torch.float32),
    ("cpu", 1, 33, 17, 4, 2, 32, True, torch.float16),
    ("cpu", 2, 65, 65, 2, 2, 64, True, torch.bfloat16),
    ("cpu", 1, 1, 40, 4, 1, 40, True, torch.bfloat16),
    ("cpu", 1, 70, 129, 2, 1, 128, True, torch.float32),
]
_DTYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def check():
    import flashtile
    from flashtile.kernels import configs
    from flashtile.testing import judge_all, make_qkv

    on_gpu = torch.cuda.is_available() and not configs.INTERPRETING
    device = "cuda" if on_gpu else "cpu"
    where = torch.cuda.get_device_name() if on_gpu else "CPU, Triton interpreter"
    print(f"flashtile {flashtile.__version__} check on {where}: forward and backward against the float64 reference")
    print("each column: max error / bound, where bound = 3x plain PyTorch's error in the same dtype + rounding;\n"
          "<= 1 passes\n")
    header = f"{'case':44s} {'out':>6s} {'lse':>6s} {'dq':>6s} {'dk':>6s} {'dv':>6s}  result"
    print(header)
    print("-" * len(header))
    failures = 0
    cases = [case[1:] for case in _CASES if case[0] == ("gpu" if on_gpu else "cpu")]
    for i, (b, sq, sk, h, hk, d, causal, dtype) in enumerate(cases):
        q, k, v = make_qkv(b, sq, sk, h, hk, d, dtype, device=device, seed=i)
        dout = torch.randn(q.shape, device=device, generator=torch.Generator(device).manual_seed(100 + i)).to(dtype)
        out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        dq, dk, dv = torch.autograd.grad((out * dout).sum(), (q, k, v))
        results = judge_all((out.detach(), lse.detach(), dq, dk, dv), q.detach(), k.detach(), v.detach(), dout,
                            d ** -0.5, causal, sk - sq)
        ratios = [err / bound if bound else (0.0 if err == 0 else float("inf")) for err, bound in results.values()]
        ok = all(err <= bound for err, bound in results.values())
        failures += not ok
        name = f"B{b} Sq{sq} Sk{sk} H{h}/{hk} D{d} {'causal' if causal else 'full'} {_DTYPE[dtype]}"
        print(f"{name:44s} " + " ".join(f"{r:6.2f}" for r in ratios) + f"  {'PASS' if ok else 'FAIL'}")
    failures += _check_features(on_gpu, device)
    print(f"\n{'all passed' if not failures else f'{failures} case(s) FAILED'}")
    return 1 if failures else 0


def _check_features(on_gpu, device):
    """Each feature on one shape (GQA, Sq != Sk), judged like the plain cases; returns the number of failures."""
    import flashtile
    from flashtile.reference.dropout import dropout_mask
    from flashtile.testing import judge_all, make_qkv

    b, sq, sk, h, hk, d, dtype = (1, 1500, 2000, 8, 2, 128, torch.bfloat16) if on_gpu else \
        (1, 33, 47, 4, 2, 32, torch.float16)
    gen = torch.Generator(device).manual_seed(7)
    slopes = torch.rand(h, device=device, generator=gen) * 0.2
    sinks = torch.randn(h, device=device, generator=gen)
    bias = torch.randn((1, h, sq, sk), device=device, generator=gen).to(dtype)
    keep = torch.rand((b, 1, sq, sk), device=device, generator=gen) > 0.3
    window = (256, 0) if on_gpu else (8, 0)
    cases = [
        ("causal + window", dict(causal=True, window_size=window), dict(window_size=window)),
        ("softcap", dict(softcap=20.0), dict(softcap=20.0)),
        ("causal + ALiBi", dict(causal=True, alibi_slopes=slopes), dict(alibi_slopes=slopes)),
        ("causal + sinks", dict(causal=True, sinks=sinks), dict(sinks=sinks)),
        ("dropout 0.2", dict(dropout_p=0.2), None),
        ("float bias (SDPA)", None, dict(attn_bias=bias)),
        ("bool mask (SDPA)", None, dict(attn_mask=keep)),
    ]
    print(f"\nfeatures on B{b} Sq{sq} Sk{sk} H{h}/{hk} D{d} {_DTYPE[dtype]}")
    header = f"{'feature':44s} {'out':>6s} {'lse':>6s} {'dq':>6s} {'dk':>6s} {'dv':>6s}  result"
    print(header)
    print("-" * len(header))
    failures = 0
    for i, (name, flash_kw, ref_kw) in enumerate(cases):
        q, k, v = make_qkv(b, sq, sk, h, hk, d, dtype, device=device, seed=200 + i)
        dout = torch.randn(q.shape, device=device, generator=gen).to(dtype)
        causal = bool(flash_kw and flash_kw.get("causal"))
        extra = []
        if flash_kw is not None:
            kw = dict(flash_kw)
            if "sinks" in kw:
                kw["sinks"] = kw["sinks"].clone().requires_grad_()
                extra = [kw["sinks"]]
            torch.manual_seed(300 + i)
            out, lse, _ = flashtile.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
            offset = sk - sq
        else:
            mask = ref_kw.get("attn_bias", ref_kw.get("attn_mask"))
            if mask.is_floating_point():
                mask = mask.clone().requires_grad_()
                extra = [mask]
            out = flashtile.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         attn_mask=mask, enable_gqa=True).transpose(1, 2)
            lse, offset = None, 0
        grads = torch.autograd.grad((out * dout).sum(), [q, k, v] + extra)
        got = [out.detach(), None if lse is None else lse.detach(), *grads[:3], None, None]
        if ref_kw is None:  # dropout: the reference takes the kernel's mask, regenerated from the same seed
            torch.manual_seed(300 + i)
            seed = int(torch.randint(0, 2 ** 62, (1,), dtype=torch.int64, device=device).item())
            ref_kw = dict(dropout_p=0.2, dropout_mask=dropout_mask(seed, b, h, sq, sk, 0.2, device=device))
        ref_kw = dict(ref_kw)
        if "sinks" in ref_kw:
            got[6] = grads[3]
        if "attn_bias" in ref_kw:
            got[5] = grads[3]
            ref_kw["attn_bias"] = extra[0]
        results = judge_all(tuple(got), q.detach(), k.detach(), v.detach(), dout, d ** -0.5, causal, offset,
                            **ref_kw)
        ratios = {key: err / bound if bound else (0.0 if err == 0 else float("inf"))
                  for key, (err, bound) in results.items()}
        ok = all(err <= bound for err, bound in results.values())
        failures += not ok
        extra_names = [key for key in results if key in ("dbias", "dsinks")]
        label = name + (f" (+{', '.join(extra_names)})" if extra_names else "")
        cells = [f"{ratios[key]:6.2f}" if key in ratios else f"{'-':>6s}" for key in ("out", "lse", "dq", "dk", "dv")]
        print(f"{label:44s} " + " ".join(cells) + f"  {'PASS' if ok else 'FAIL'}")
    return failures


def _check_verb(argv):
    if argv:
        if argv[0] in ("-h", "--help"):
            text = __doc__.split("check: ", 1)[1].split("\nbench: ")[0].replace("\n    ", " ")
            print(f"usage: python -m flashtile check\n\nRuns {text.removeprefix('runs ')}")
            return 0
        print(f"error: check takes no arguments, got {' '.join(argv)}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        # Without a GPU the kernels run only in Triton's interpreter, chosen by TRITON_INTERPRET=1 before they are
        # defined. `import flashtile` imports neither them nor triton, so it is chosen here; when triton is already
        # imported (by a caller), this process may have defined compiled kernels: start again with it.
        if "triton" not in sys.modules:
            os.environ["TRITON_INTERPRET"] = "1"
        from .kernels import configs
        if not configs.INTERPRETING:
            env = dict(os.environ, TRITON_INTERPRET="1")
            os.execve(sys.executable, [sys.executable, "-m", "flashtile", "check"], env)
    return check()


def _bench_verb(argv):
    from .bench import main as bench_main

    return bench_main(argv, prog="python -m flashtile bench")


_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def explain(argv):
    """Which backend runs a flash_attn_func call of the given shape and options, forward and backward, and why."""
    import argparse

    import flashtile
    from flashtile.dispatch import Target

    ap = argparse.ArgumentParser(prog="python -m flashtile explain", description=explain.__doc__)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seqlen", type=int, default=4096, help="query length (and key length unless --seqlen-k)")
    ap.add_argument("--seqlen-k", type=int)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, help="key/value heads (GQA); default: --heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--window", help="LEFT,RIGHT sliding window (-1 unbounded)")
    ap.add_argument("--softcap", type=float, default=0.0)
    ap.add_argument("--alibi", action="store_true")
    ap.add_argument("--sinks", action="store_true")
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--varlen", action="store_true", help="as one packed sequence of flash_attn_varlen_func")
    ap.add_argument("--arch", type=int, help="pretend a CUDA GPU of this compute capability (90: H100/H200)")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and args.arch is None else "cpu"
    sq, sk = args.seqlen, args.seqlen_k or args.seqlen
    hk = args.kv_heads or args.heads
    dtype = _DTYPES[args.dtype]
    # Uninitialised tensors: nothing runs, only shapes, dtypes, strides and alignment are read.
    q = torch.empty((args.batch, sq, args.heads, args.head_dim), dtype=dtype, device=device)
    k = torch.empty((args.batch, sk, hk, args.head_dim), dtype=dtype, device=device)
    v = torch.empty_like(k)
    kw = dict(causal=args.causal, softcap=args.softcap, dropout_p=args.dropout, deterministic=args.deterministic)
    if args.window:
        kw["window_size"] = tuple(int(x) for x in args.window.split(","))
    if args.alibi:
        kw["alibi_slopes"] = torch.rand(args.heads, device=device)
    if args.sinks:
        kw["sinks"] = torch.zeros(args.heads, device=device)
    if args.varlen:
        cu_q = torch.tensor([0, sq * args.batch], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, sk * args.batch], dtype=torch.int32, device=device)
        q, k, v = (t.flatten(0, 1) for t in (q, k, v))
        kw.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=sq * args.batch, max_seqlen_k=sk * args.batch)
    target = Target("cuda", args.arch, False) if args.arch is not None else None
    print(flashtile.explain(q, k, v, target=target, **kw))
    return 0


# verb -> (function of the remaining arguments that returns the exit status, one line for the usage text).
# A new verb is one entry here (and a paragraph in the module docstring).
VERBS = {
    "check": (_check_verb, "check the kernels against the float64 reference on this device (GPU or CPU)"),
    "bench": (_bench_verb, "benchmark flashtile against its peers on a CUDA GPU (bench --help for more)"),
    "explain": (explain, "which backend runs a call of this shape and these options, and why (explain --help)"),
}


def usage():
    lines = ["usage: python -m flashtile VERB [arguments]", "", "verbs:"]
    lines += [f"  {verb:<7} {text}" for verb, (_, text) in VERBS.items()]
    return "\n".join(lines)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in VERBS:
        help_asked = bool(argv) and argv[0] in ("-h", "--help")
        if argv and not help_asked:
            print(f"error: unknown verb {argv[0]!r}; the verbs are {', '.join(VERBS)}", file=sys.stderr)
        print(usage(), file=sys.stdout if help_asked else sys.stderr)
        return 0 if help_asked else 2
    return VERBS[argv[0]][0](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
