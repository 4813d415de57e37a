"""The FP8 forward: flash_attn_func with float8_e4m3fn q, k, v and FA3's q_descale / k_descale / v_descale.

Inputs are quantized per (batch entry, kv head) as an inference engine does (amax / 448). The oracle is the float64
naive attention of the dequantized values (stored float8 value times factor); the bar is the design's rule
(flashtile.testing.judge: 3x plain PyTorch's error plus rounding), plain PyTorch computing the same dequantized
attention in bfloat16, the output's dtype. Every launch's outputs are poisoned before the kernel writes them.
"""
import pytest
import torch

import flashtile
from flashtile.reference import fallback, naive_attention
from flashtile.request import AttentionRequest
from flashtile.testing import assert_close

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def _quantize(x, kv_heads, gen=None):
    """(float8 x, fp32 (B, Hk) factors): each kv head's group of heads scaled so that its largest magnitude maps to
    448 (the factors times a random spread in [0.5, 1.5], so that they differ between entries and heads)."""
    b, s, h, d = x.shape
    grouped = x.unflatten(2, (kv_heads, h // kv_heads))
    amax = grouped.abs().amax(dim=(1, 3, 4)).clamp_min(1e-6) if s else torch.ones(b, kv_heads)  # (B, Hk)
    factor = amax / E4M3_MAX * (0.5 + torch.rand(amax.shape, generator=gen))
    stored = (grouped / factor[:, None, :, None, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return stored.flatten(2, 3), factor.float()


def _dequantized(x8, factor):
    h, hk = x8.shape[2], factor.shape[1]
    return x8.double() * factor.double().repeat_interleave(h // hk, dim=1)[:, None, :, None]


def _inputs(b, sq, sk, h, hk, d, seed, dv=None):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=gen) * 2
    k = torch.randn(b, sk, hk, d, generator=gen)
    v = torch.randn(b, sk, hk, dv or d, generator=gen)
    (q8, qd), (k8, kd), (v8, vd) = (_quantize(t, hk, gen) for t in (q, k, v))
    return q8, k8, v8, qd, kd, vd


def _oracle_and_plain(q8, k8, v8, qd, kd, vd, **kw):
    """(out, lse) in float64 and in plain bfloat16 PyTorch, of the dequantized values."""
    q, k, v = _dequantized(q8, qd), _dequantized(k8, kd), _dequantized(v8, vd)
    ref = naive_attention(q, k, v, **kw)
    plain = naive_attention(*(t.to(torch.bfloat16) for t in (q, k, v)),
                            **{n: (x.to(torch.bfloat16) if isinstance(x, torch.Tensor) else x) for n, x in kw.items()})
    return ref, plain


CASES = [
    # (b, sq, sk, h, hk, d, causal, features)
    pytest.param(2, 33, 47, 4, 2, 32, True, {}, id="B2-Sq33-Sk47-H4-Hk2-D32-causal"),
    pytest.param(1, 40, 17, 2, 1, 64, False, {}, id="B1-Sq40-Sk17-H2-Hk1-D64"),
    pytest.param(1, 17, 40, 2, 2, 40, True, {}, id="B1-Sq17-Sk40-H2-D40-causal"),
    pytest.param(1, 29, 29, 4, 2, 32, True, dict(window_size=(7, 0)), id="window"),
    pytest.param(1, 29, 37, 2, 1, 32, False, dict(softcap=5.0), id="softcap"),
    pytest.param(2, 23, 31, 2, 2, 32, True, dict(sinks=True), id="sinks"),
    pytest.param(1, 23, 31, 4, 2, 32, True, dict(alibi=True), id="alibi"),
]


@pytest.mark.parametrize("b,sq,sk,h,hk,d,causal,features", CASES)
def test_fp8_forward_against_float64(poison, b, sq, sk, h, hk, d, causal, features):
    q8, k8, v8, qd, kd, vd = _inputs(b, sq, sk, h, hk, d, seed=sq * 131 + sk)
    gen = torch.Generator().manual_seed(7)
    kw = dict(window_size=features.get("window_size", (-1, 0 if causal else -1)), softcap=features.get("softcap", 0.0))
    call = dict(window_size=features.get("window_size", (-1, -1)), softcap=kw["softcap"], causal=causal)
    if features.get("sinks"):
        kw["sinks"] = call["sinks"] = torch.randn(h, generator=gen)
    if features.get("alibi"):
        kw["alibi_slopes"] = call["alibi_slopes"] = torch.rand(h, generator=gen)
    out, lse, probs = flashtile.flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                                return_attn_probs=True, **call)
    assert out.dtype == torch.bfloat16 and out.shape == (b, sq, h, d) and probs is None
    assert poison, "the kernels ran (their outputs poisoned first), not the reference"
    (ref, ref_lse), (plain, plain_lse) = _oracle_and_plain(q8, k8, v8, qd, kd, vd, softmax_scale=d ** -0.5,
                                                           diagonal_offset=sk - sq, **kw)
    assert_close("out", out, ref, plain, torch.bfloat16)
    assert_close("lse", lse, ref_lse, plain_lse.float(), torch.float32)


@pytest.mark.parametrize("scale", [-0.3, 0.0], ids=["negative", "zero"])
def test_fp8_scale_of_any_sign(scale):
    """A negative softmax_scale moves its sign into q's factors, a zero one zeroes them (uniform attention), with the
    float8 tensors as they are."""
    q8, k8, v8, qd, kd, vd = _inputs(1, 19, 27, 2, 1, 32, seed=3)
    out = flashtile.flash_attn_func(q8, k8, v8, softmax_scale=scale, causal=True, q_descale=qd, k_descale=kd,
                                    v_descale=vd)
    (ref, _), (plain, _) = _oracle_and_plain(q8, k8, v8, qd, kd, vd, softmax_scale=scale, diagonal_offset=8,
                                             window_size=(-1, 0))
    assert_close("out", out, ref, plain, torch.bfloat16)


def test_fp8_factors_default_to_one():
    q8, k8, v8, *_ = _inputs(1, 16, 16, 2, 2, 32, seed=5)
    ones = torch.ones(1, 2)
    got = flashtile.flash_attn_func(q8, k8, v8, causal=True)
    assert torch.equal(got, flashtile.flash_attn_func(q8, k8, v8, causal=True, q_descale=ones, k_descale=ones,
                                                      v_descale=ones))


def test_fp8_reference_fallback_dequantizes():
    """The CPU fallback (no interpreter) dequantizes before its float32 reference: same rule."""
    q8, k8, v8, qd, kd, vd = _inputs(2, 21, 30, 4, 2, 32, seed=9)
    req = AttentionRequest(softmax_scale=32 ** -0.5, diagonal_offset=9, window_right=0,
                           descale=torch.stack((qd, kd, vd), dim=-1))
    out, lse = fallback.forward(q8, k8, v8, req)
    (ref, ref_lse), (plain, plain_lse) = _oracle_and_plain(q8, k8, v8, qd, kd, vd, softmax_scale=32 ** -0.5,
                                                           diagonal_offset=9, window_size=(-1, 0))
    assert out.dtype == torch.bfloat16
    assert_close("out", out, ref, plain, torch.bfloat16)
    assert_close("lse", lse, ref_lse, plain_lse.float(), torch.float32)


def test_fp8_errors_name_the_fix():
    q8, k8, v8, qd, kd, vd = _inputs(2, 8, 8, 2, 1, 32, seed=1)
    with pytest.raises(TypeError, match="float8_e4m3fn"):  # descale factors with 16-bit inputs
        flashtile.flash_attn_func(q8.to(torch.bfloat16), k8.to(torch.bfloat16), v8.to(torch.bfloat16), q_descale=qd)
    with pytest.raises(TypeError, match="must all be float8_e4m3fn"):  # mixed dtypes
        flashtile.flash_attn_func(q8, k8.to(torch.bfloat16), v8)
    with pytest.raises(TypeError, match="8-bit inputs are float8_e4m3fn"):  # e5m2, or float8 k under 16-bit q
        flashtile.flash_attn_func(q8.to(torch.bfloat16), k8, v8.to(torch.bfloat16))
    with pytest.raises(TypeError, match="must be float32"):
        flashtile.flash_attn_func(q8, k8, v8, k_descale=kd.double())
    with pytest.raises(ValueError, match=r"shape \(2, 1\)"):
        flashtile.flash_attn_func(q8, k8, v8, v_descale=vd[0])
    with pytest.raises(ValueError, match="dropout_p=0.1"):
        flashtile.flash_attn_func(q8, k8, v8, dropout_p=0.1)
    q_grad = q8.clone().requires_grad_()
    with pytest.raises(NotImplementedError, match="no backward"):
        flashtile.flash_attn_func(q_grad, k8, v8)
    with torch.no_grad():
        assert flashtile.flash_attn_func(q_grad, k8, v8).dtype == torch.bfloat16


def test_fp8_varlen_against_float64(poison):
    """flash_attn_varlen_func's FP8 forward: one factor per sequence and kv head; every sequence aligns causal to
    its own bottom-right corner; an empty sequence on either side."""
    from flashtile.testing import cu_seqlens
    gen = torch.Generator().manual_seed(11)
    lens_q, lens_k, h, hk, d = [5, 0, 17, 9], [9, 3, 17, 0], 4, 2, 32
    parts = []
    for sq, sk in zip(lens_q, lens_k):
        parts.append([_quantize(t, hk, gen) for t in (torch.randn(1, sq, h, d, generator=gen),
                                                      torch.randn(1, sk, hk, d, generator=gen),
                                                      torch.randn(1, sk, hk, d, generator=gen))])
    q8, k8, v8 = (torch.cat([p[i][0][0] for p in parts]) for i in range(3))
    qd, kd, vd = (torch.cat([p[i][1] for p in parts]) for i in range(3))
    out, lse, _ = flashtile.flash_attn_varlen_func(q8, k8, v8, cu_seqlens(lens_q), cu_seqlens(lens_k), max(lens_q),
                                                   max(lens_k), causal=True, q_descale=qd, k_descale=kd,
                                                   v_descale=vd, return_attn_probs=True)
    assert out.dtype == torch.bfloat16 and poison
    row_q = row_k = 0
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        (ref, ref_lse), (plain, plain_lse) = _oracle_and_plain(
            *(t[None] for t in (q8[row_q:row_q + sq], k8[row_k:row_k + sk], v8[row_k:row_k + sk])),
            qd[b:b + 1], kd[b:b + 1], vd[b:b + 1], softmax_scale=d ** -0.5, diagonal_offset=sk - sq,
            window_size=(-1, 0))
        assert_close(f"out of sequence {b}", out[None, row_q:row_q + sq], ref, plain, torch.bfloat16)
        assert_close(f"lse of sequence {b}", lse[None, :, row_q:row_q + sq], ref_lse, plain_lse.float(),
                     torch.float32)
        row_q, row_k = row_q + sq, row_k + sk


def test_fp8_under_torch_compile():
    """fullgraph torch.compile (aot_eager) sees the op, whose fake output is bfloat16, and gives the eager bits."""
    torch._dynamo.reset()
    try:
        q8, k8, v8, qd, kd, vd = _inputs(1, 16, 24, 2, 1, 32, seed=13)

        def call(q, k, v, qd, kd, vd):
            return flashtile.flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd)

        compiled = torch.compile(call, fullgraph=True, backend="aot_eager")(q8, k8, v8, qd, kd, vd)
        assert compiled.dtype == torch.bfloat16
        assert torch.equal(compiled, call(q8, k8, v8, qd, kd, vd))
    finally:
        torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_forward_on_gpu(causal):
    """The portable kernel's FP8 path on a GPU (compiled, not interpreted): B2 S1000 H8/2 d128 against float64."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    q8, k8, v8, qd, kd, vd = _inputs(2, 1000, 1000, 8, 2, 128, seed=21)
    out = flashtile.flash_attn_func(*(t.cuda() for t in (q8, k8, v8)), causal=causal, q_descale=qd.cuda(),
                                    k_descale=kd.cuda(), v_descale=vd.cuda())
    (ref, _), (plain, _) = _oracle_and_plain(q8, k8, v8, qd, kd, vd, softmax_scale=128 ** -0.5,
                                             window_size=(-1, 0 if causal else -1))
    assert out.dtype == torch.bfloat16
    assert_close("out", out.cpu(), ref, plain, torch.bfloat16)
