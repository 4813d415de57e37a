"""Run one attention call for a profiler (Nsight Compute) to capture: warm-up first, then the call it profiles.

    ncu --clock-control none -k regex:_bwd_kernel -c 1 --set full -o rep \
        python benchmarks/profile_kernel.py --mode bwd --seqlen 8192 --heads 16 --headdim 128

Use --launch-skip in ncu or rely on the warm-up order: the warm-up runs the same call once, so profile the second
launch of the kernel (-s 1 -c 1).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import flashtile


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("fwd", "bwd"), default="bwd")
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--causal", action="store_true")
    a = p.parse_args()
    torch.manual_seed(0)
    shape = (a.batch, a.seqlen, a.heads, a.headdim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    for _ in range(2):
        out = flashtile.flash_attn_func(q, k, v, causal=a.causal)
        if a.mode == "bwd":
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
