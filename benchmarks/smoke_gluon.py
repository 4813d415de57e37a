"""Quick GPU smoke test of the Gluon forward: one small call per variant under a time limit (a missing mbarrier
arrive shows up as a hang, not an error), with its error against SDPA in float64. Prints one line per variant."""
import sys
import time

import torch

import flashtile
from flashtile.kernels import hopper_fwd
from flashtile.kernels.features import Features


def main():
    torch.manual_seed(0)
    for d in (64, 128):
        for causal in (False, True):
            for sq, sk in ((256, 256), (1000, 1100), (1100, 1000)):
                q = torch.randn(2, sq, 4, d, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(2, sk, 2, d, device="cuda", dtype=torch.bfloat16)
                v = torch.randn(2, sk, 2, d, device="cuda", dtype=torch.bfloat16)
                t = time.time()
                out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
                torch.cuda.synchronize()
                kk, vv = (x.repeat_interleave(2, dim=2) for x in (k, v))
                mask = None
                if causal:
                    mask = torch.ones(sq, sk, dtype=torch.bool, device="cuda").tril(sk - sq)
                ref = torch.nn.functional.scaled_dot_product_attention(
                    *(x.transpose(1, 2).double() for x in (q, kk, vv)), attn_mask=mask).transpose(1, 2)
                ref = torch.nan_to_num(ref)
                err = (out.double() - ref).abs().max().item()
                print(f"d{d} causal={causal} {sq}x{sk}: err {err:.2e} nan {out.isnan().any().item()} "
                      f"({time.time() - t:.1f} s, gluon={hopper_fwd.supports(q, k, v, Features(window_right=0 if causal else -1), d ** -0.5)})",
                      flush=True)


if __name__ == "__main__":
    sys.exit(main())
