"""How long the first call at a shape takes: in a fresh process with an empty Triton cache (compiles everything),
and in a second process that finds the first one's compiled kernels on disk.

    python benchmarks/first_call.py [--seqlen 4096 --headdim 128 --causal]

Each measurement runs in its own Python process (imports excluded from the time): one forward + backward of
flash_attn_func, synchronised. Prints both times.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_CHILD = r"""
import sys, time, torch
sys.path.insert(0, {root!r})
import flashtile
b, s, h, d, causal = {shape!r}
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
torch.cuda.synchronize()
t0 = time.perf_counter()
out = flashtile.flash_attn_func(q, k, v, causal=causal)
out.sum().backward()
torch.cuda.synchronize()
print(f"{{time.perf_counter() - t0:.3f}}")
"""


def first_call_seconds(shape, cache_dir):
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, TRITON_CACHE_DIR=cache_dir)
    done = subprocess.run([sys.executable, "-c", _CHILD.format(root=root, shape=shape)], env=env,
                          capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args(argv)
    shape = (max(1, 16384 // args.seqlen), args.seqlen, 2048 // args.headdim, args.headdim, args.causal)
    with tempfile.TemporaryDirectory() as cache:
        cold = first_call_seconds(shape, cache)
        warm = first_call_seconds(shape, cache)
    print(f"shape (B, S, H, D, causal) = {shape}: first fwd+bwd call {cold:.2f} s with an empty Triton cache, "
          f"{warm:.2f} s in a second process")


if __name__ == "__main__":
    main()
