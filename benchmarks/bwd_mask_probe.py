# Run as: python benchmarks/bwd_mask_probe.py OUT.json (results/2026-11-21-h200-gluon-bwd-bias-probe.json)
"""Where the bool mask's backward time goes at 16k d128 H16 bf16 (and d64 H32): the tile lists' construction
(Features.block_lists) against the kernel with the lists cached; repeats of plain/bias for the run-to-run spread."""
import json, sys, time
import torch, triton
import flashtile
from flashtile.kernels import backward, hopper_bwd
from flashtile.kernels.features import Features
S = 16384
bench = lambda fn: triton.testing.do_bench(fn, warmup=100, rep=800, return_mode="median")
rows = []
for D, H in ((128, 16), (64, 32)):
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    mask = torch.ones(S, S, device="cuda", dtype=torch.bool).tril().view(1, 1, S, S)
    bias = torch.randn(1, H, S, S, device="cuda").to(torch.bfloat16) if D == 128 else None
    bm = hopper_bwd.BLOCK_M[D]
    cases = (("plain", False, None), ("bias-1HSS", False, bias), ("causal", True, None),
             ("bool-causal", False, mask))
    for name, causal, m in cases:
        if name == "bias-1HSS" and bias is None:
            continue
        out, lse, _ = flashtile.interface._attention(q, k, v, D ** -0.5, causal, 0, attn_bias=m)
        f = lambda: Features(window_right=0 if causal else -1, attn_bias=m)
        fresh = lambda: backward.attention_backward(dout, q, k, v, out, lse, None, D ** -0.5, 0, f())
        cached_feats = f()
        cached = lambda: backward.attention_backward(dout, q, k, v, out, lse, None, D ** -0.5, 0, cached_feats)
        row = dict(D=D, H=H, case=name, bwd_ms=bench(fresh), bwd_cached_lists_ms=bench(cached),
                   bwd_again_ms=bench(fresh))
        if m is not None and m.dtype == torch.bool:
            row["block_lists_ms"] = bench(lambda: f().block_lists(bm, 128, True, S, S))
        rows.append(row); print(json.dumps(row), flush=True)
props = torch.cuda.get_device_properties(0)
result = dict(date=time.strftime("%Y-%m-%d %H:%M:%S"), gpu=props.name, torch=torch.__version__,
              triton=triton.__version__, rows=rows)
json.dump(result, open(sys.argv[1], "w"), indent=1)
