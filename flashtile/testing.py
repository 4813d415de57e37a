"""How flashtile judges a result (used by its tests and by `python -m flashtile check`).

Against the naive reference in float64, the error must be at most K times the error of plain PyTorch computing the
same thing in the input dtype, plus the error of merely rounding the oracle to that dtype.
"""
import contextlib
import inspect
import itertools

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


# The score modifications naive_attention takes on top of (softmax_scale, causal, diagonal_offset), with the value
# that turns each off. The dense-delta backward (reference.attention_backward) knows none of them.
FEATURE_DEFAULTS = dict(window_size=(-1, -1), softcap=0.0, alibi_slopes=None, attn_bias=None, attn_mask=None,
                        sinks=None, dropout_p=0.0, dropout_mask=None)
# Names of the entries of a result: out, lse and the gradients; dbias and dsinks exist only with those features.
RESULT_NAMES = ("out", "lse", "dq", "dk", "dv", "dbias", "dsinks")


def features_on(features):
    """True when any feature in `features` (naive_attention keyword arguments) differs from its off value."""
    unknown = set(features) - set(FEATURE_DEFAULTS)
    if unknown:
        raise TypeError(f"unknown feature(s) {sorted(unknown)}; the judge takes {sorted(FEATURE_DEFAULTS)}.")
    for name, value in features.items():
        if isinstance(value, torch.Tensor):
            return True
        if name == "window_size":
            if tuple(value) != (-1, -1):
                return True
        elif value != FEATURE_DEFAULTS[name]:
            return True
    return False


def _float64_features(features):
    """The features for the float64 oracle: float tensors (bias, slopes, sinks) in float64, keeping requires_grad;
    bool masks (attn_mask, dropout_mask) shared as they are."""
    cast = {}
    for name, value in features.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            value = value.detach().double().requires_grad_(value.requires_grad)
        cast[name] = value
    return cast


def reference_fwd_bwd(q, k, v, dout, softmax_scale, causal, diagonal_offset, dlse=None, **features):
    """(out, lse, dq, dk, dv, dbias, dsinks) from autograd through the naive reference, computed in the dtype of
    q, k, v; features are naive_attention's keyword arguments (window_size, softcap, alibi_slopes, attn_bias,
    attn_mask, sinks, dropout_p, dropout_mask).

    dbias is None unless features["attn_bias"] is a tensor with requires_grad; it has the bias's shape (broadcast
    dims summed) and dtype. dsinks is None unless sinks are given; it has their shape and dtype.
    """
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    features = dict(features)
    wrt = [q, k, v]
    bias, sinks = features.get("attn_bias"), features.get("sinks")
    has_dbias = isinstance(bias, torch.Tensor) and bias.requires_grad
    has_dsinks = isinstance(sinks, torch.Tensor)
    if has_dbias:
        features["attn_bias"] = bias.detach().requires_grad_()
        wrt.append(features["attn_bias"])
    if has_dsinks:
        features["sinks"] = sinks.detach().requires_grad_()
        wrt.append(features["sinks"])
    out, lse = naive_attention(q, k, v, softmax_scale=softmax_scale, causal=causal, diagonal_offset=diagonal_offset,
                               **features)
    loss = (out * dout.to(out.dtype)).sum()
    if dlse is not None:
        loss = loss + (lse * dlse.to(lse.dtype)).sum()
    grads = list(torch.autograd.grad(loss, wrt))
    dq, dk, dv = grads[:3]
    dbias = grads.pop(3) if has_dbias else None
    dsinks = grads[3] if has_dsinks else None
    return out.detach(), lse.detach(), dq, dk, dv, dbias, dsinks


def attention_op(q, k, v, softmax_scale, causal, diagonal_offset, window_size=(-1, -1), **fields):
    """The op every public API shares, called in the judge's terms (causal, diagonal_offset, window_size, as
    reference_fwd_bwd takes them) so that tests can combine features no public signature offers together (an
    attn_mask with a window, say). fields: AttentionRequest's other fields (softcap, alibi_slopes, attn_bias,
    sinks, ...) and dropout_p / deterministic. -> (out, lse)."""
    from .interface import _attention
    left, right = window_size
    out, lse, _ = _attention(q, k, v, softmax_scale, diagonal_offset=diagonal_offset, window_left=left,
                             window_right=0 if causal else right, **fields)
    return out, lse


def judge_all(got, q, k, v, dout, softmax_scale, causal, diagonal_offset, dlse=None, **features):
    """{name: (error, bound)} for got = (out, lse, dq, dk, dv) or (out, lse, dq, dk, dv, dbias, dsinks) from
    flashtile, judged against float64 with plain PyTorch's error as the scale (entries of got that are None are
    skipped). features are naive_attention's keyword arguments (see reference_fwd_bwd); the float64 oracle gets
    float64 copies of the bias, slopes and sinks and the same bool masks.

    Without features, plain PyTorch computes the gradients two ways, autograd through the naive forward and the dense
    delta formula (reference.attention_backward, the kernels' formulation), and the larger error sets the scale:
    where one of them is exact by accident (one visible key makes autograd's dq exactly 0) the other still shows the
    fp32 cancellation in dP - delta that any delta-based backward has. With features only autograd runs (the dense
    formula knows none of them); FP32_ACCUM_FLOOR covers that case.

    out, dq, dk, dv are judged in the input dtype, lse in float32, dbias in the bias's dtype and dsinks in the sinks'.
    """
    if len(got) not in (5, 7):
        raise ValueError(f"got has {len(got)} entries; pass (out, lse, dq, dk, dv) or (out, lse, dq, dk, dv, dbias, "
                         f"dsinks), None for any not to judge.")
    dtype = q.dtype
    on = features_on(features)
    ref = reference_fwd_bwd(*(t.double() for t in (q, k, v, dout)), softmax_scale, causal, diagonal_offset,
                            None if dlse is None else dlse.double(), **_float64_features(features))
    plain = reference_fwd_bwd(q, k, v, dout, softmax_scale, causal, diagonal_offset, dlse, **features)
    plain_delta = None
    if not on:
        plain_delta = attention_backward(q, k, v, plain[0], plain[1], dout, softmax_scale=softmax_scale,
                                         causal=causal, diagonal_offset=diagonal_offset, dlse=dlse)
    dtypes = dict(out=dtype, lse=torch.float32, dq=dtype, dk=dtype, dv=dtype)
    if features.get("attn_bias") is not None:
        dtypes["dbias"] = features["attn_bias"].dtype
    if features.get("sinks") is not None:
        dtypes["dsinks"] = features["sinks"].dtype
    results = {}
    for i, (name, g, r) in enumerate(zip(RESULT_NAMES, got, ref)):
        if g is None:
            continue
        if r is None:
            raise ValueError(f"got a {name} but there is nothing to judge it against: "
                             + ("pass an attn_bias with requires_grad=True." if name == "dbias" else "pass sinks."))
        p = plain[i]
        if plain_delta is not None and 2 <= i <= 4 and max_err(plain_delta[i - 2], r) > max_err(p, r):
            p = plain_delta[i - 2]
        results[name] = judge(g, r, p, dtypes[name])
    return results


def check_against_reference(got, q, k, v, dout, softmax_scale, causal, diagonal_offset, dlse=None, **features):
    """Assert that every entry of got passes (see judge_all)."""
    for name, (err, bound) in judge_all(got, q, k, v, dout, softmax_scale, causal, diagonal_offset, dlse,
                                        **features).items():
        assert err <= bound, f"{name}: max error {err:.3e} > bound {bound:.3e}"


def cu_seqlens(lens, device="cpu"):
    """flash_attn_varlen_func's offsets for packed sequences of these lengths: int32 (B + 1,), starting at 0."""
    return torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device=device)


def check_varlen_against_reference(got, q, k, v, dout, cu_q, cu_k, causal, alibi_slopes=None, dsinks=None,
                                   **features):
    """Assert that a packed varlen result passes: each sequence against check_against_reference on that sequence
    alone, aligned to its own bottom-right corner (softmax scale d^-1/2). got = (out, lse [H, total_q], dq, dk, dv),
    gradients None to judge the forward only (dout then unused: None). alibi_slopes: (H,) or (B, H). A sequence
    without queries must have dk = dv = 0, one without keys out = 0 and dq = 0 (and LSE -inf without sinks).
    dsinks: the sinks' gradient, a sum over the sequences, judged against the oracle's sum with plain PyTorch's,
    summed the same way, as the scale."""
    out, lse, dq, dk, dv = got
    q, k, v = q.detach(), k.detach(), v.detach()
    if dout is None:
        dout = torch.zeros_like(q)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    zero = lambda t, r: t is None or torch.equal(t[r], torch.zeros_like(t[r]))  # noqa: E731
    seq = lambda t, r: None if t is None else t[r].unsqueeze(0)  # noqa: E731
    ref_dsinks, plain_dsinks = 0.0, 0.0
    for i in range(len(bq) - 1):
        rq, rk = slice(bq[i], bq[i + 1]), slice(bk[i], bk[i + 1])
        if bq[i + 1] == bq[i]:
            assert zero(dk, rk) and zero(dv, rk), f"sequence {i} has no queries but nonzero dk or dv"
            continue
        if bk[i + 1] == bk[i]:
            assert zero(out, rq) and zero(dq, rq), f"sequence {i} has no keys but nonzero out or dq"
            assert features.get("sinks") is not None or torch.isneginf(lse[:, rq]).all()
            continue
        seq_features = dict(features, alibi_slopes=alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1
                            else alibi_slopes[i])
        args = (seq(q, rq), seq(k, rk), seq(v, rk), seq(dout, rq), q.shape[-1] ** -0.5, causal,
                (bk[i + 1] - bk[i]) - (bq[i + 1] - bq[i]))
        check_against_reference((seq(out, rq), lse[:, rq].unsqueeze(0), seq(dq, rq), seq(dk, rk), seq(dv, rk)),
                                *args, **seq_features)
        if dsinks is not None:
            ref_dsinks = ref_dsinks + reference_fwd_bwd(*(t.double() for t in args[:4]), *args[4:],
                                                        **_float64_features(seq_features))[6]
            plain_dsinks = plain_dsinks + reference_fwd_bwd(*args, **seq_features)[6]
    if dsinks is not None:
        assert_close("dsinks", dsinks, ref_dsinks, plain_dsinks, features["sinks"].dtype)


@contextlib.contextmanager
def fast_launch_on_cpu(execute=True):
    """Within the block, launches of CPU tensors take the path CUDA tensors take (kernels/_launch.py): a stand-in
    stream from fast_stream, the compile cache, and bound launches calling a compiled kernel's launcher. A JIT
    launch hands back a stand-in compiled kernel whose launcher runs the kernel in Triton's interpreter
    (execute=True: tests of the fast path's arguments, needs TRITON_INTERPRET=1) or does nothing (execute=False:
    the host time of the Python around the launches, `python -m flashtile bench host --cpu`). The compile cache and
    dispatch's plans made inside are dropped at the end; those from before are kept aside. (The decode kernels
    keep their own reference to fast_stream and stay on the JIT path.)"""
    from . import dispatch
    from ._settings import SETTINGS
    from .kernels import _launch

    class Compiled:  # what _launch needs of a compiled kernel: run, function, packed_metadata
        function = packed_metadata = None

        def __init__(self, kernel):
            self.kernel = kernel

        def run(self, grid_0, grid_1, grid_2, stream, function, metadata, hook_0, hook_1, hook_2, *params):
            if execute:
                self.kernel[(grid_0, grid_1, grid_2)](*params)

    def jit_launch(kernel, grid, args, constexprs, options, key=None, stream=None):
        if execute:
            kernel[grid](*args, **constexprs, **options)
        key = _launch._key(kernel, args, constexprs, options) if key is None else key
        defaults = inspect.signature(getattr(kernel, "fn", kernel)).parameters
        tail = tuple(constexprs[name] if name in constexprs else defaults[name].default
                     for name in kernel.arg_names[len(args):])
        entry = _launch._COMPILED[(_launch._device(), key)] = (Compiled(kernel), tail)
        return entry[0], entry

    saved = (_launch.fast_stream, _launch._jit_launch, _launch._COMPILED, dispatch._PLANS)
    _launch.fast_stream = lambda device_index: 0 if SETTINGS.fast_launch else None
    _launch._jit_launch = jit_launch
    _launch._COMPILED, dispatch._PLANS = {}, {}
    try:
        yield
    finally:
        _launch.fast_stream, _launch._jit_launch, _launch._COMPILED, dispatch._PLANS = saved
