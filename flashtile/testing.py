"""How flashtile judges a result (used by its tests and by `python -m flashtile check`).

Against the naive reference in float64, the error must be at most K times the error of plain PyTorch computing the
same thing in the input dtype, plus the error of merely rounding the oracle to that dtype.
"""
import torch

from .reference import attention_backward, naive_attention

# flash-attn's test rule uses 2; 3 leaves room for fp32 accumulation-order differences on tiny errors.
K = 3
# fp32: plain PyTorch and the kernels can agree to the last bit; allow a few ulps of the largest value.
FP32_ULPS = 8
# The kernels compute in fp32 whatever the input dtype. Where the exact answer is 0 (one visible key: dq = 0),
# plain PyTorch may hit it exactly while the backward's dP - delta cancels fp32 terms of size ~sqrt(headdim),
# leaving ~1e-6. A real indexing or masking bug is orders of magnitude above this floor.
FP32_ACCUM_FLOOR = 1e-5


def make_qkv(batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, dtype, device="cpu", seed=0, grad=True):
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = [(batch, seqlen_q, heads, head_dim), (batch, seqlen_k, kv_heads, head_dim),
              (batch, seqlen_k, kv_heads, head_dim)]
    return [torch.randn(s, generator=gen, device=device, dtype=torch.float32).to(dtype).requires_grad_(grad)
            for s in shapes]


def rounding_atol(ref, dtype):
    """Error of just storing the float64 oracle in `dtype` (2x, as flash-attn's tests)."""
    finite = ref[torch.isfinite(ref)]
    if finite.numel() == 0:
        return FP32_ACCUM_FLOOR
    err = (finite.to(dtype).double() - finite).abs().max().item()
    if dtype == torch.float32:
        err = max(err, FP32_ULPS * torch.finfo(torch.float32).eps * finite.abs().max().item())
    return max(2 * err, FP32_ACCUM_FLOOR)


def max_err(x, ref):
    """Max abs difference; -inf == -inf counts as equal (LSE of rows that see no key); any NaN is infinite error."""
    x = x.double()
    if torch.isnan(x).any():
        return float("inf")
    both_inf = torch.isinf(x) & torch.isinf(ref) & (torch.sign(x) == torch.sign(ref))
    diff = torch.where(both_inf, torch.zeros_like(ref), (x - ref).abs())
    return diff.max().item() if diff.numel() else 0.0


def judge(got, ref64, plain, dtype):
    """(error, bound) for a kernel result; it passes when error <= bound. ref64: float64 oracle; plain: plain
    PyTorch in `dtype`."""
    if got.shape != ref64.shape or plain.shape != ref64.shape:
        raise AssertionError(f"shapes differ: got {tuple(got.shape)}, plain {tuple(plain.shape)}, oracle "
                             f"{tuple(ref64.shape)}")
    return max_err(got, ref64), K * max_err(plain, ref64) + rounding_atol(ref64, dtype)


def assert_close(name, got, ref64, plain, dtype):
    err, bound = judge(got, ref64, plain, dtype)
    assert err <= bound, f"{name}: max error {err:.3e} > bound {bound:.3e} (plain PyTorch {dtype})"


def reference_fwd_bwd(q, k, v, dout, softmax_scale, causal, diagonal_offset, dlse=None):
    """(out, lse, dq, dk, dv) from autograd through the naive reference, in the dtype of q, k, v."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = naive_attention(q, k, v, softmax_scale=softmax_scale, causal=causal, diagonal_offset=diagonal_offset)
    loss = (out * dout.to(out.dtype)).sum()
    if dlse is not None:
        loss = loss + (lse * dlse.to(lse.dtype)).sum()
    dq, dk, dv = torch.autograd.grad(loss, (q, k, v))
    return out.detach(), lse.detach(), dq, dk, dv


def judge_all(got, q, k, v, dout, softmax_scale, causal, diagonal_offset, dlse=None):
    """{name: (error, bound)} for got = (out, lse, dq, dk, dv) from flashtile, judged against float64 with plain
    PyTorch's error as the scale (entries of got that are None are skipped).

    Plain PyTorch computes the gradients two ways, autograd through the naive forward and the dense delta formula
    (reference.attention_backward, the kernels' formulation), and the larger error sets the scale: where one of
    them is exact by accident (one visible key makes autograd's dq exactly 0) the other still shows the fp32
    cancellation in dP - delta that any delta-based backward has.
    """
    dtype = q.dtype
    ref = reference_fwd_bwd(*(t.double() for t in (q, k, v, dout)), softmax_scale, causal, diagonal_offset,
                            None if dlse is None else dlse.double())
    plain = reference_fwd_bwd(q, k, v, dout, softmax_scale, causal, diagonal_offset, dlse)
    plain_delta = attention_backward(q, k, v, plain[0], plain[1], dout, softmax_scale=softmax_scale, causal=causal,
                                     diagonal_offset=diagonal_offset, dlse=dlse)
    results = {}
    for i, (name, g, r) in enumerate(zip(("out", "lse", "dq", "dk", "dv"), got, ref)):
        if g is None:
            continue
        p = plain[i]
        if i >= 2 and max_err(plain_delta[i - 2], r) > max_err(p, r):
            p = plain_delta[i - 2]
        # The LSE is fp32 whatever the inputs; judge it as such.
        results[name] = judge(g, r, p, torch.float32 if name == "lse" else dtype)
    return results


def check_against_reference(got, q, k, v, dout, softmax_scale, causal, diagonal_offset, dlse=None):
    """Assert that every entry of got passes (see judge_all)."""
    for name, (err, bound) in judge_all(got, q, k, v, dout, softmax_scale, causal, diagonal_offset, dlse).items():
        assert err <= bound, f"{name}: max error {err:.3e} > bound {bound:.3e}"
