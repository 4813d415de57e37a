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


def _fp8_p_pipeline(q8, k8, v8, qd, kd, vd, scale, causal, window=(-1, -1), sinks=None):
    """Plain PyTorch at the Hopper FP8 kernel's precision, the yardstick of its error: scores and softmax in float32
    from the dequantized values, the probabilities rounded to float8_e4m3fn before they multiply V (float32 sums
    over the unrounded ones), bfloat16 out. [B, S, H, D] float8 inputs, (B, Hk) factors; sinks: (H,) logits."""
    q, k, v = (_dequantized(t, f).float() for t, f in ((q8, qd), (k8, kd), (v8, vd)))
    h, hk = q.shape[2], k.shape[2]
    k, v = (t.repeat_interleave(h // hk, dim=2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    sq, sk = s.shape[-2:]
    i = torch.arange(sq)[:, None] + sk - sq
    j = torch.arange(sk)[None, :]
    left, right = window[0], 0 if causal else window[1]
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        visible &= j <= i + right
    if left >= 0:
        visible &= j >= i - left
    s = s.masked_fill(~visible, float("-inf"))
    m = s.amax(-1, keepdim=True)
    if sinks is not None:
        m = torch.maximum(m, sinks.float()[None, :, None, None])
    m = torch.where(torch.isinf(m), 0.0, m)
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    if sinks is not None:
        l = l + torch.exp(sinks.float()[None, :, None, None] - m)
    out = torch.einsum("bhqk,bkhd->bqhd", p.to(FP8).float(), v) / l.transpose(1, 2).clamp_min(1e-30)
    return out.to(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_portable_forward_on_gpu(monkeypatch, causal):
    """The portable kernel's FP8 path on a GPU (compiled, not interpreted): B2 S1000 H8/2 d128 against float64."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from flashtile._settings import SETTINGS
    monkeypatch.setattr(SETTINGS, "gluon_forward", False)
    q8, k8, v8, qd, kd, vd = _inputs(2, 1000, 1000, 8, 2, 128, seed=21)
    out = flashtile.flash_attn_func(*(t.cuda() for t in (q8, k8, v8)), causal=causal, q_descale=qd.cuda(),
                                    k_descale=kd.cuda(), v_descale=vd.cuda())
    (ref, _), (plain, _) = _oracle_and_plain(q8, k8, v8, qd, kd, vd, softmax_scale=128 ** -0.5,
                                             window_size=(-1, 0 if causal else -1))
    assert out.dtype == torch.bfloat16
    assert_close("out", out.cpu(), ref, plain, torch.bfloat16)


def _vt_order(n):
    """The key order within each block of n keys of the Hopper kernel's copy of V (and of its P): position
    n / 4 q + 2 i + e holds key 8 i + 2 q + e, written out here independently of hopper_fwd._vt_keys."""
    return [8 * i + 2 * q + e for q in range(4) for i in range(n // 8) for e in range(2)]


VT_ORDER = _vt_order(128)


def _vt_blocks(v, n=128):
    """v [S, H, D] bytes -> [H, D, L]: keys padded with zeros to whole blocks of n, each block in _vt_order(n)."""
    total = -(-v.shape[0] // n) * n
    padded = torch.zeros((total,) + v.shape[1:], dtype=v.dtype)
    padded[:v.shape[0]] = v
    order = torch.tensor([n * blk + k for blk in range(total // n) for k in _vt_order(n)], dtype=torch.long)
    return padded[order].permute(1, 2, 0)


@pytest.mark.parametrize("block", [128, 256])
def test_transposed_v_for_the_hopper_kernel(poison, block):
    """The Hopper FP8 forward's copy of V with the keys contiguous (hopper_fwd._transposed_v, a Triton kernel):
    whole blocks of the kernel's 128 or 256 keys, each in its key order (_vt_order), zeros past Sk; odd key counts,
    a non-contiguous V, a poisoned buffer."""
    from flashtile.kernels import configs, hopper_fwd
    if not configs.INTERPRETING:
        pytest.skip("runs the Triton kernel in the interpreter (TRITON_INTERPRET=1)")
    assert sorted(_vt_order(block)) == list(range(block))
    gen = torch.Generator().manual_seed(2)
    wide = torch.randn(3, 203 + block, 2, 2 * 128, generator=gen).to(FP8)
    v = wide[..., :128]  # rows and heads strided
    vt = hopper_fwd._transposed_v(v, block_s=block)
    assert poison and vt.shape == (3, 2, 128, 2 * block if block == 256 else 3 * block) and vt.is_contiguous()
    for b in range(3):
        assert torch.equal(vt[b].view(torch.uint8), _vt_blocks(v[b].view(torch.uint8), block))


def test_fp8_key_blocks():
    """The float8 forward's keys per block (hopper_fwd.fp8_block_n): 256 for fixed-length calls with 2k keys or more
    (16k or more with a band: causal, a window), 128 for fewer, varlen batches and dropout; the GPU cases marked
    wide take 256."""
    from flashtile.kernels import hopper_fwd
    from flashtile.testing import cu_seqlens
    plain, causal = AttentionRequest(softmax_scale=0.1), AttentionRequest(softmax_scale=0.1, window_right=0)
    window = AttentionRequest(softmax_scale=0.1, window_left=300, window_right=300)
    assert [hopper_fwd.fp8_block_n(sk, plain) for sk in (1, 1000, 2047, 2048, 16384)] == [128] * 3 + [256] * 2
    assert [hopper_fwd.fp8_block_n(sk, causal) for sk in (2048, 8192, 16383, 16384)] == [128] * 3 + [256]
    assert hopper_fwd.fp8_block_n(4096, window) == 128
    assert hopper_fwd.fp8_block_n(20000, AttentionRequest(softmax_scale=0.1, dropout_p=0.1)) == 128
    varlen = AttentionRequest(softmax_scale=0.1, cu_seqlens_q=cu_seqlens([4096]), cu_seqlens_k=cu_seqlens([4096]),
                              max_seqlen_q=4096, max_seqlen_k=4096)
    assert hopper_fwd.fp8_block_n(4096, varlen) == 128
    for case in GLUON_CASES:
        b, sq, sk, h, hk, d, is_causal, win, sinks = case.values
        req = AttentionRequest(softmax_scale=0.1, diagonal_offset=sk - sq, window_right=0 if is_causal else win[1],
                               window_left=win[0])
        assert (hopper_fwd.fp8_block_n(sk, req) == 256) == ("wide" in case.id), case.id


def test_transposed_v_of_a_varlen_batch():
    """_transposed_v of packed sequences (the varlen FP8 forward): sequence b's whole key blocks, each in the
    kernel's key order, from column ceil16(cu_seqlens_k[b]) + 144 b of [1, Hk, D, L] (the kernel's _load_vt
    computes the same), zeros everywhere else; odd lengths, an empty sequence, a strided V."""
    from flashtile.kernels import configs, hopper_fwd
    from flashtile.testing import cu_seqlens
    if not configs.INTERPRETING:
        pytest.skip("runs the Triton kernel in the interpreter (TRITON_INTERPRET=1)")
    lens = [37, 0, 130, 5, 128]
    gen = torch.Generator().manual_seed(4)
    v = torch.randn(sum(lens), 2, 2 * 128, generator=gen).to(FP8)[..., 128:]
    vt = hopper_fwd._transposed_v(v, cu_seqlens(lens), max(lens))
    length = -(-sum(lens) // 16) * 16 + 144 * (len(lens) + 1)
    assert vt.shape == (1, 2, 128, length) and vt.is_contiguous()
    expect = torch.zeros(1, 2, 128, length, dtype=torch.uint8)
    start = 0
    for b, n in enumerate(lens):
        col = -(-start // 16) * 16 + 144 * b
        blocks = _vt_blocks(v[start:start + n].view(torch.uint8))
        assert (expect[0, :, :, col:col + blocks.shape[-1]] == 0).all()  # sequences' blocks do not overlap
        expect[0, :, :, col:col + blocks.shape[-1]] = blocks
        start += n
    assert torch.equal(vt.view(torch.uint8), expect)


GLUON_CASES = [
    # (b, sq, sk, h, hk, d, causal, window, sinks)
    pytest.param(2, 1000, 1000, 8, 2, 128, True, (-1, -1), False, id="d128-causal-gqa"),
    pytest.param(2, 1000, 1000, 8, 2, 128, False, (-1, -1), False, id="d128-gqa"),
    pytest.param(1, 777, 1290, 4, 4, 128, True, (-1, -1), False, id="d128-causal-sq<sk"),
    pytest.param(1, 1290, 777, 4, 1, 128, True, (-1, -1), False, id="d128-causal-sq>sk-mqa"),
    pytest.param(2, 1033, 1033, 4, 2, 64, True, (-1, -1), False, id="d64-causal"),
    pytest.param(1, 517, 1500, 4, 2, 64, False, (-1, -1), False, id="d64-sq<sk"),
    pytest.param(1, 900, 900, 4, 2, 128, False, (200, 57), True, id="d128-window-sinks"),
    # 256-key blocks (hopper_fwd.fp8_block_n): Sk past 2k without a band, past 16k causal (few rows, bottom-right).
    pytest.param(2, 700, 2600, 4, 2, 128, False, (-1, -1), False, id="d128-wide-sq<sk"),
    pytest.param(1, 2500, 2300, 2, 1, 128, False, (-1, -1), True, id="d128-wide-sq>sk-mqa-sinks"),
    pytest.param(1, 300, 16500, 2, 1, 128, True, (-1, -1), False, id="d128-wide-causal"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("b,sq,sk,h,hk,d,causal,window,sinks", GLUON_CASES)
def test_fp8_gluon_forward_on_gpu(poison, b, sq, sk, h, hk, d, causal, window, sinks):
    """The Hopper (Gluon) kernel's FP8 forward at d128 (d64: the portable kernel, which the dispatch must pick
    there): float8 products, P rounded to float8 for P V, bfloat16 out; odd sizes, Sq != Sk both ways, GQA/MQA, a
    window with sinks. Judged by the design's rule with, as plain PyTorch, the same computation at the Gluon
    kernel's precision (_fp8_p_pipeline), against the float64 attention of the dequantized values."""
    from flashtile import dispatch
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper GPU")
    q8, k8, v8, qd, kd, vd = _inputs(b, sq, sk, h, hk, d, seed=sq + 7 * sk + d)
    sink_logits = torch.randn(h, generator=torch.Generator().manual_seed(3)) if sinks else None
    args = [t.cuda() for t in (q8, k8, v8)]
    req = AttentionRequest(softmax_scale=d ** -0.5, diagonal_offset=sk - sq, window_right=0 if causal else window[1],
                           window_left=window[0], descale=torch.ones(b, hk, 3, device="cuda"),
                           sinks=None if sink_logits is None else sink_logits.cuda())
    expected = "gluon-hopper" if d in dispatch.GLUON_FP8_HEAD_DIMS else "triton"
    assert dispatch.choose_forward(*args, req).name == expected
    out, lse, _ = flashtile.flash_attn_func(*args, causal=causal, window_size=window, q_descale=qd.cuda(),
                                            k_descale=kd.cuda(), v_descale=vd.cuda(), return_attn_probs=True,
                                            sinks=None if sink_logits is None else sink_logits.cuda())
    assert out.dtype == torch.bfloat16 and not out.isnan().any() and not lse.isnan().any()
    kw = dict(window_size=(window[0], 0 if causal else window[1]))
    if sinks:
        kw["sinks"] = sink_logits.double()
    ref, ref_lse = naive_attention(*(_dequantized(t, f) for t, f in ((q8, qd), (k8, kd), (v8, vd))),
                                   softmax_scale=d ** -0.5, **kw)
    plain = _fp8_p_pipeline(q8, k8, v8, qd, kd, vd, d ** -0.5, causal, window, sink_logits)
    assert_close("out", out.cpu(), ref, plain, torch.bfloat16)
    # Hopper's float8 tensor cores add the products at less than float32 precision (the scores of a 1000-key row
    # came within 4e-3 of float64 here, where bfloat16 inputs give ~1e-5): LSE is held to 1e-2.
    torch.testing.assert_close(lse.cpu().double(), ref_lse, atol=1e-2, rtol=0)


@pytest.mark.gpu
def test_fp8_gluon_factors_of_any_sign_on_gpu():
    """The Hopper kernel's FP8 factors per (batch entry, kv head): negative, zero and positive ones at once give
    the float64 attention of the dequantized values (a zero q or k factor: uniform attention; a zero v factor: 0)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper GPU")
    q8, k8, v8, qd, kd, vd = _inputs(2, 600, 700, 4, 2, 128, seed=5)
    qd[0, 0], kd[0, 1], qd[1, 1], vd[1, 0] = -qd[0, 0], 0.0, -qd[1, 1], 0.0
    kd[1, 1] = -kd[1, 1]
    out = flashtile.flash_attn_func(*(t.cuda() for t in (q8, k8, v8)), causal=True, q_descale=qd.cuda(),
                                    k_descale=kd.cuda(), v_descale=vd.cuda())
    ref, _ = naive_attention(*(_dequantized(t, f) for t, f in ((q8, qd), (k8, kd), (v8, vd))),
                             softmax_scale=128 ** -0.5, window_size=(-1, 0))
    plain = _fp8_p_pipeline(q8, k8, v8, qd, kd, vd, 128 ** -0.5, True)
    assert not out.isnan().any()
    assert_close("out", out.cpu(), ref, plain, torch.bfloat16)
    assert (out[1, :, 0:2] == 0).all()  # v's factor 0 for kv head 0 of entry 1 (query heads 0 and 1)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_fp8_gluon_varlen_on_gpu(poison, causal):
    """flash_attn_varlen_func's FP8 forward on the Hopper kernel at d128: one factor per (sequence, kv head) with
    every sign, sequences of odd lengths with Sq != Sk both ways and an empty one on either side (causal: each
    aligned to its own bottom-right corner), GQA. Per sequence against the float64 attention of its dequantized
    values, plain PyTorch at the kernel's precision as the yardstick (_fp8_p_pipeline)."""
    from flashtile import dispatch
    from flashtile.testing import cu_seqlens
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper GPU")
    gen = torch.Generator().manual_seed(21 + causal)
    lens_q, lens_k, h, hk, d = [700, 0, 1290, 333, 129], [900, 50, 777, 0, 129], 8, 2, 128
    parts = [[_quantize(t, hk, gen) for t in (torch.randn(1, sq, h, d, generator=gen) * 2,
                                              torch.randn(1, sk, hk, d, generator=gen),
                                              torch.randn(1, sk, hk, d, generator=gen))]
             for sq, sk in zip(lens_q, lens_k)]
    q8, k8, v8 = (torch.cat([p[i][0][0] for p in parts]) for i in range(3))
    qd, kd, vd = (torch.cat([p[i][1] for p in parts]) for i in range(3))
    qd[0, 1], kd[2, 0], vd[3, 1] = -qd[0, 1], -kd[2, 0], 0.0
    cu_q, cu_k = cu_seqlens(lens_q).cuda(), cu_seqlens(lens_k).cuda()
    args = [t.cuda() for t in (q8, k8, v8)]
    req = AttentionRequest(softmax_scale=d ** -0.5, window_right=0 if causal else -1, cu_seqlens_q=cu_q,
                           cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
                           descale=torch.ones(len(lens_q), hk, 3, device="cuda"))
    assert dispatch.choose_forward(*args, req).name == "gluon-hopper"
    out, lse, _ = flashtile.flash_attn_varlen_func(*args, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                                   q_descale=qd.cuda(), k_descale=kd.cuda(), v_descale=vd.cuda(),
                                                   return_attn_probs=True)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    out, lse = out.cpu(), lse.cpu()
    row_q = row_k = 0
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        if sk == 0:  # a sequence with no key: out 0 and LSE -inf
            assert (lse[:, row_q:row_q + sq] == float("-inf")).all() and (out[row_q:row_q + sq] == 0).all()
            row_q += sq
            continue
        seq = [t[None] for t in (q8[row_q:row_q + sq], k8[row_k:row_k + sk], v8[row_k:row_k + sk])]
        factors = (qd[b:b + 1], kd[b:b + 1], vd[b:b + 1])
        ref, ref_lse = naive_attention(*(_dequantized(t, f) for t, f in zip(seq, factors)), softmax_scale=d ** -0.5,
                                       diagonal_offset=sk - sq, window_size=(-1, 0 if causal else -1))
        plain = _fp8_p_pipeline(*seq, *factors, d ** -0.5, causal)
        assert_close(f"out of sequence {b}", out[None, row_q:row_q + sq], ref, plain, torch.bfloat16)
        torch.testing.assert_close(lse[None, :, row_q:row_q + sq].double(), ref_lse, atol=1e-2, rtol=0)
        row_q, row_k = row_q + sq, row_k + sk


def test_repeated_calls_share_requests(monkeypatch):
    """An FP8 call with the options, head dim and lengths of an earlier one takes that call's request with its own
    descale factors swapped in (interface._flash_fp8): each request equals, field by field, the one the full checks
    build for the call (its factors included), whatever came before; a scale <= 0, folded into each call's factors,
    is never reused; bad factors are rejected every time."""
    from flashtile import _ops, interface
    seen = []
    real = _ops.attention

    def capture(q, k, v, req):
        seen.append(req)
        return real(q, k, v, req)

    def same(a, b):
        for name in AttentionRequest.field_names():
            x, y = getattr(a, name), getattr(b, name)
            if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
                assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y), name
            else:
                assert type(x) is type(y) and x == y, name

    monkeypatch.setattr(_ops, "attention", capture)
    swapped = []
    real_with = AttentionRequest.with_fields
    monkeypatch.setattr(AttentionRequest, "with_fields", lambda self, **kw: swapped.append(1) or real_with(self, **kw))
    q8, k8, v8, qd, kd, vd = _inputs(2, 9, 12, 4, 2, 32, seed=3)
    calls = [dict(causal=True), dict(causal=True, q_descale=qd * 2), dict(causal=False, k_descale=kd),
             dict(softmax_scale=0.25), dict(softmax_scale=-0.25), dict(softmax_scale=0.0), dict(softcap=3.0),
             dict(window_size=(4, 1)), dict(causal=True)]
    for kw in calls * 2:
        kw = {"q_descale": qd, "k_descale": kd, "v_descale": vd, **kw}
        out = flashtile.flash_attn_func(q8, k8, v8, **kw)
        remembered = dict(interface._REQUESTS)
        monkeypatch.setattr(interface, "_REQUESTS", {})
        fresh = flashtile.flash_attn_func(q8, k8, v8, **kw)
        same(seen[-2], seen[-1])
        assert seen[-2].descale is not seen[-1].descale
        assert torch.equal(out, fresh), kw
        assert len(interface._REQUESTS) == (kw.get("softmax_scale", 1.0) > 0), kw
        monkeypatch.setattr(interface, "_REQUESTS", {**remembered, **interface._REQUESTS})
    # The second pass's calls with a positive scale (7) took a shared request, and so did the first pass's repeats of
    # causal=True's options (2).
    assert len(swapped) == 9
    for bad in (dict(q_descale=qd[:1]), dict(k_descale=kd.double())):
        for _ in range(2):
            with pytest.raises((TypeError, ValueError)):
                flashtile.flash_attn_func(q8, k8, v8, **{"q_descale": qd, "k_descale": kd, "v_descale": vd, **bad})
