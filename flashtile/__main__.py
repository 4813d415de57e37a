"""Command line: `python -m flashtile check` and `python -m flashtile bench [bench options]`.

check: runs the kernels forward and backward against the float64 reference on the device present (a CUDA GPU, or
    Triton's interpreter on the CPU with small shapes) and prints a pass/fail table; exit status 1 on any failure.
bench: the benchmark of benchmarks/bench.py (needs a flashtile checkout and a CUDA GPU); `bench --help` lists its
    options.
"""
import os
import pathlib
import sys

import torch

from .kernels import configs

# (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, causal, dtype)
_GPU_CASES = [
    (2, 1024, 1024, 16, 16, 64, False, torch.bfloat16),
    (2, 1024, 1024, 16, 16, 64, True, torch.float16),
    (1, 4096, 4096, 16, 4, 128, True, torch.bfloat16),
    (1, 4096, 4096, 16, 16, 128, False, torch.float16),
    (1, 2048, 2048, 8, 8, 256, True, torch.bfloat16),
    (2, 1000, 3000, 8, 2, 96, True, torch.bfloat16),
    (2, 3000, 1000, 8, 1, 40, True, torch.float16),
    (2, 777, 777, 4, 4, 32, False, torch.float32),
    (4, 1, 4096, 32, 8, 128, True, torch.bfloat16),
]
_CPU_CASES = [
    (1, 17, 33, 2, 1, 16, False, torch.float32),
    (1, 33, 17, 4, 2, 32, True, torch.float16),
    (2, 65, 65, 2, 2, 64, True, torch.bfloat16),
    (1, 1, 40, 4, 1, 40, True, torch.bfloat16),
    (1, 70, 129, 2, 1, 128, True, torch.float32),
]
_DTYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def check():
    import flashtile
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
    for i, (b, sq, sk, h, hk, d, causal, dtype) in enumerate(_GPU_CASES if on_gpu else _CPU_CASES):
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
    print(f"\n{'all passed' if not failures else f'{failures} case(s) FAILED'}")
    return 1 if failures else 0


def bench(argv):
    root = pathlib.Path(__file__).resolve().parent.parent
    if not (root / "benchmarks" / "bench.py").is_file():
        print("python -m flashtile bench runs benchmarks/bench.py from a flashtile checkout (pip install -e .); "
              f"none found next to {root}.", file=sys.stderr)
        return 2
    sys.path.insert(0, str(root))
    from benchmarks.bench import main as bench_main

    return bench_main(argv)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("check", "bench"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    if argv[0] == "check" and not torch.cuda.is_available() and not configs.INTERPRETING:
        # Without a GPU the kernels run only in Triton's interpreter, which must be chosen before triton is first
        # imported -- too late for this process. Start again with it.
        env = dict(os.environ, TRITON_INTERPRET="1")
        os.execve(sys.executable, [sys.executable, "-m", "flashtile", *argv], env)
    return check() if argv[0] == "check" else bench(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
