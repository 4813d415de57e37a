"""attn_mask in the Gluon backward (benchmarks/NOTES.md, "Gluon backward: attn_mask"): fwd+bwd and the backward
alone at 16k, d128, 16 heads, bf16, for no mask, a float bias (1, H, S, S) and (1, 1, S, S) without its gradient,
and a bool causal mask (S, S) against the causal kernel, each with the Gluon backward off (the portable kernels)
and on, in one run. The backward alone is kernels/backward.attention_backward on a saved forward, with a fresh
Features per call (so a bool mask's tile lists are built each time, as in training). Writes JSON to argv[1]."""
import json
import sys
import time

import torch
import triton

import flashtile
from flashtile.kernels import backward, hopper_bwd, hopper_fwd
from flashtile.kernels.features import Features

S, H, D, DTYPE = 16384, 16, 128, torch.bfloat16


def _bench(fn):
    return triton.testing.do_bench(fn, warmup=100, rep=1000, return_mode="median")


def inputs():
    """q, k, v (requiring grad) and dout, [1, S, H, D], seeded."""
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(1, S, H, D, device="cuda", dtype=DTYPE) for _ in range(4))
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    return q, k, v, dout


def main(path):
    q, k, v, dout = inputs()
    causal_mask = torch.ones(S, S, device="cuda", dtype=torch.bool).tril()
    cases = {
        "plain": dict(mask=None, causal=False),
        "bias-1HSS": dict(mask=torch.randn(1, H, S, S, device="cuda").to(DTYPE), causal=False),
        "bias-11SS": dict(mask=torch.randn(1, 1, S, S, device="cuda").to(DTYPE), causal=False),
        "causal": dict(mask=None, causal=True),
        "bool-causal-SS": dict(mask=causal_mask, causal=False),
    }
    fwd_calls = []
    launch = hopper_fwd.attention_forward
    hopper_fwd.attention_forward = lambda *a, **kw: fwd_calls.append(1) or launch(*a, **kw)
    rows = []
    for name, case in cases.items():
        mask, causal = case["mask"], case["causal"]

        def fwd():
            return flashtile.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                          attn_mask=mask, is_causal=causal)

        def fwd_bwd():
            torch.autograd.grad(fwd(), (q, k, v), dout.transpose(1, 2))

        mask4 = mask.view(1, 1, S, S) if mask is not None and mask.dim() == 2 else mask  # as SDPA passes it on
        with torch.no_grad():
            fwd_calls.clear()
            out, lse, _ = flashtile.interface._attention(q, k, v, D ** -0.5, causal, 0, attn_bias=mask4)
            gluon_fwd = bool(fwd_calls)

        def bwd():
            feats = Features(window_right=0 if causal else -1, attn_bias=mask4)
            backward.attention_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, None, D ** -0.5, 0,
                                        feats)

        for gluon_bwd in (False, True):
            hopper_bwd.ENABLED = gluon_bwd
            bwd_calls = []
            blaunch = hopper_bwd.attention_backward
            hopper_bwd.attention_backward = lambda *a, **kw: bwd_calls.append(1) or blaunch(*a, **kw)
            bwd()
            took_gluon = bool(bwd_calls)
            hopper_bwd.attention_backward = blaunch
            row = dict(case=name, gluon_bwd=gluon_bwd, took_gluon_bwd=took_gluon, gluon_fwd=gluon_fwd,
                       fwd_bwd_ms=_bench(fwd_bwd), bwd_ms=_bench(bwd), fwd_ms=_bench(fwd))
            rows.append(row)
            print(json.dumps(row), flush=True)
    hopper_bwd.ENABLED = True
    props = torch.cuda.get_device_properties(0)
    result = dict(date=time.strftime("%Y-%m-%d %H:%M:%S"), gpu=props.name, torch=torch.__version__,
                  triton=triton.__version__, shape=dict(B=1, S=S, H=H, D=D, dtype=str(DTYPE)), rows=rows)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    by = {(r["case"], r["gluon_bwd"]): r for r in rows}
    print(f"{props.name} torch {torch.__version__} triton {triton.__version__}")
    print("| case | fwd (ms) | bwd portable | bwd Gluon | fwd+bwd portable | fwd+bwd Gluon | bwd Gluon / plain "
          "| fwd+bwd Gluon / plain |")
    for name in cases:
        base = "causal" if name.startswith("bool-causal") or name == "causal" else "plain"
        p, g, b = by[(name, False)], by[(name, True)], by[(base, True)]
        print(f"| {name} | {g['fwd_ms']:.2f} | {p['bwd_ms']:.2f} | {g['bwd_ms']:.2f}"
              f"{'' if g['took_gluon_bwd'] else ' (portable)'} | {p['fwd_bwd_ms']:.2f} | {g['fwd_bwd_ms']:.2f} | "
              f"{g['bwd_ms'] / b['bwd_ms']:.3f} | {g['fwd_bwd_ms'] / b['fwd_bwd_ms']:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bwd_mask.json")
