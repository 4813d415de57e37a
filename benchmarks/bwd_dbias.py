"""The float bias's gradient in the Gluon backward (benchmarks/NOTES.md, "Gluon backward: the bias gradient"):
fwd+bwd and the backward alone at 16k, d128, 16 heads, bf16, B1, for no bias, a bias (1, H, S, S) without its
gradient, the same bias with its gradient on the Gluon backward and on the portable kernels (hopper_bwd.ENABLED
off), and a bias (1, 1, S, S) with its gradient both ways, in one run. The backward alone is
kernels/backward.attention_backward on a saved forward (the bias's gradient summed over its broadcast dims
included). Also the largest difference between the two backwards' bias gradients, and the time of the (1, 1)
bias's sum over the heads alone. Writes JSON to argv[1]."""
import json
import sys
import time

import torch
import triton

import flashtile
from bwd_mask import DTYPE, D, H, S, _bench, inputs  # same shape, timer and inputs (run from benchmarks/)
from flashtile.kernels import backward, hopper_bwd
from flashtile.kernels.features import Features


def main(path):
    q, k, v, dout = inputs()
    bias_h = torch.randn(1, H, S, S, device="cuda").to(DTYPE)
    bias_1 = torch.randn(1, 1, S, S, device="cuda").to(DTYPE)
    cases = [  # name, bias, its gradient, Gluon backward
        ("plain", None, False, True),
        ("bias-1HSS", bias_h, False, True),
        ("bias-1HSS-grad", bias_h, True, True),
        ("bias-1HSS-grad", bias_h, True, False),
        ("bias-11SS-grad", bias_1, True, True),
        ("bias-11SS-grad", bias_1, True, False),
    ]
    rows, dbias, diffs = [], {}, {}
    for name, bias, grad, gluon_bwd in cases:
        hopper_bwd.ENABLED = gluon_bwd
        mask = None if bias is None else bias.detach().requires_grad_(grad)
        wrt = (q, k, v) + ((mask,) if grad else ())

        def fwd():
            return flashtile.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                          attn_mask=mask)

        def fwd_bwd():
            return torch.autograd.grad(fwd(), wrt, dout.transpose(1, 2))

        with torch.no_grad():
            out, lse, _ = flashtile.interface._attention(q, k, v, D ** -0.5, False, 0, attn_bias=bias)
        feats = Features(attn_bias=bias)

        def bwd():
            return backward.attention_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, None, D ** -0.5, 0,
                                               feats, bias_grad=grad)

        calls = []
        launch = hopper_bwd.attention_backward
        hopper_bwd.attention_backward = lambda *a, **kw: calls.append(1) or launch(*a, **kw)
        grads = fwd_bwd()
        hopper_bwd.attention_backward = launch
        if grad:
            if name in dbias:  # the other backward's: compare, then free (each is 8.6 GB for the (1, H) bias)
                a, b = dbias.pop(name).float(), grads[3].float()
                diffs[name] = dict(max_abs_diff=(a - b).abs().max().item(), max_abs=a.abs().max().item())
                print(name, "dbias Gluon vs portable", diffs[name], flush=True)
                del a, b
            else:
                dbias[name] = grads[3]
        del grads
        row = dict(case=name, bias_grad=grad, gluon_bwd=gluon_bwd, took_gluon_bwd=bool(calls),
                   fwd_bwd_ms=_bench(fwd_bwd), bwd_ms=_bench(bwd), fwd_ms=_bench(fwd))
        rows.append(row)
        print(json.dumps(row), flush=True)
    hopper_bwd.ENABLED = True
    # The (1, 1, S, S) bias's host step alone: dS over [1, H, S, S] summed over the heads, two ways.
    ds = torch.randn(1, H, S, S, device="cuda").to(DTYPE)
    reduce_ms = dict(sum_fp32_out_then_cast=_bench(lambda: ds.sum(dim=1, keepdim=True, dtype=torch.float32).to(DTYPE)),
                     sum_16bit_out=_bench(lambda: ds.sum(dim=1, keepdim=True)))
    print("reduce over heads (ms)", reduce_ms, flush=True)
    props = torch.cuda.get_device_properties(0)
    result = dict(date=time.strftime("%Y-%m-%d %H:%M:%S"), gpu=props.name, torch=torch.__version__,
                  triton=triton.__version__, shape=dict(B=1, S=S, H=H, D=D, dtype=str(DTYPE)), rows=rows,
                  dbias_gluon_vs_portable=diffs, reduce_ms=reduce_ms)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    plain = rows[0]
    print(f"{props.name} torch {torch.__version__} triton {triton.__version__}")
    print("| case | backward | fwd (ms) | bwd (ms) | fwd+bwd (ms) | bwd / plain | fwd+bwd / plain |")
    for r in rows:
        kind = "Gluon" if r["took_gluon_bwd"] else "portable"
        print(f"| {r['case']} | {kind} | {r['fwd_ms']:.2f} | {r['bwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | "
              f"{r['bwd_ms'] / plain['bwd_ms']:.3f} | {r['fwd_bwd_ms'] / plain['fwd_bwd_ms']:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bwd_dbias.json")
