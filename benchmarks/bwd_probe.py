"""Where the Gluon backward's time goes (benchmarks/NOTES.md, "Gluon backward"): the whole backward with the
portable kernels, then the Gluon kernel whole (dq_mode 2), without its dQ reductions but with the hand-offs to the
writer warp (3), without dQ at all (1: with its result unused the compiler drops the dQ product too), and with the
warpgroups free of each other's dS (4).
Modes 1, 3 and 4 give a wrong dQ on purpose; only their times mean anything. Prints TFLOP/s (bwd = 2.5x fwd
FLOPs). usage: bwd_probe.py [seqlen [batch]] (default 16384 1)."""
import functools
import sys

import torch
import triton

import flashtile
from flashtile.kernels import backward, hopper_bwd
from flashtile.kernels.features import Features


def main():
    seqlen = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    rows = []
    for d, heads in ((64, 32), (128, 16)):
        for causal in (False, True):
            q, k, v, dout = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16)
                             for _ in range(4))
            out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
            feats = Features(window_right=0 if causal else -1)
            flops = 2.5 * 4 * batch * heads * seqlen ** 2 * d * (0.5 if causal else 1.0)
            launch = hopper_bwd.attention_backward
            times = {}
            for name, enabled, mode in (("portable", False, 2), ("gluon", True, 2), ("hand-offs only", True, 3),
                                        ("no dQ at all", True, 1), ("warpgroups free", True, 4)):
                hopper_bwd.ENABLED = enabled
                hopper_bwd.attention_backward = functools.partial(launch, dq_mode=mode)
                fn = lambda: backward.attention_backward(dout, q, k, v, out, lse, None, d ** -0.5, 0, feats)
                times[name] = flops / triton.testing.do_bench(fn, warmup=25, rep=100) / 1e9
            hopper_bwd.attention_backward = launch
            rows.append((d, causal, times))
    print(f"seqlen {seqlen}, batch {batch}")
    print("| d | causal | " + " | ".join(rows[0][2]) + " |")
    for d, causal, times in rows:
        print(f"| {d} | {causal} | " + " | ".join(f"{t:.0f}" for t in times.values()) + " |")


if __name__ == "__main__":
    main()
