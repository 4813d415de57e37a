"""Tests of the pure-PyTorch reference ladder (flashtile.reference) against independent float64 computations."""

import math
import zlib

import pytest
import torch
import torch.nn.functional as F

import flashtile.testing
from flashtile.reference import (attention_backward, causal_mask, merge_partials, naive_attention,
                                 naive_attention_varlen, online_softmax, online_softmax_states, safe_softmax,
                                 tiled_attention_backward, tiled_attention_fa1, tiled_attention_fa2)
from flashtile.reference.dropout import dropout_mask, dropout_threshold, philox_4x32
from flashtile.testing import judge_all, reference_fwd_bwd

F64 = torch.float64
NEG_INF = float("-inf")
# float64 round-off of O(1) values summed over a few hundred keys stays far below this; a wrong rescale or mask
# is off by O(1e-2) or more.
F64_TOL = dict(atol=1e-10, rtol=1e-10)
# float32 accumulation over ~50 keys: a few hundred ulps at most.
FP32_ATOL, FP32_RTOL = 1e-6, 1e-5

# (B, Sq, Sk, Hq, Hk, D): odd sizes, Sq != Sk both ways, GQA ratios 1, 4 and all-to-one, decode (Sq = 1).
SHAPES = [
    (1, 1, 1, 1, 1, 8),
    (2, 7, 17, 4, 2, 16),
    (2, 17, 7, 4, 4, 8),
    (1, 63, 129, 2, 1, 32),
    (2, 129, 63, 8, 2, 40),
    (1, 129, 129, 3, 3, 64),
    (1, 1, 129, 4, 1, 16),
    (1, 17, 1, 2, 1, 8),
]
SHAPE_PARAMS = [pytest.param(s, id="B{}-Sq{}-Sk{}-H{}-Hk{}-D{}".format(*s)) for s in SHAPES]
# (causal, diagonal_offset): none, bottom-right (default), top-left, and offsets that hide / reveal extra keys.
MASK_PARAMS = [
    pytest.param((False, None), id="full"),
    pytest.param((True, None), id="causal"),
    pytest.param((True, 0), id="causal-topleft"),
    pytest.param((True, -3), id="causal-off-3"),
    pytest.param((True, 5), id="causal-off+5"),
]
BLOCK_PARAMS = [pytest.param(b, id="bm{}-bn{}".format(*b)) for b in [(16, 16), (7, 13), (32, 64), (256, 256)]]
FORWARDS = [pytest.param(tiled_attention_fa1, id="fa1"), pytest.param(tiled_attention_fa2, id="fa2")]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Every tensor here is tiny: one intra-op thread is fastest, and ~10x faster when other jobs load the CPUs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def gen(request):
    """A generator seeded from the test id: every test draws its own inputs, reproducibly."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def make_qkv(shape, gen, dtype=F64, dv=None):
    b, sq, sk, hq, hk, d = shape
    q = torch.randn(b, sq, hq, d, generator=gen, dtype=F64)
    k = torch.randn(b, sk, hk, d, generator=gen, dtype=F64)
    v = torch.randn(b, sk, hk, d if dv is None else dv, generator=gen, dtype=F64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def drawn_mask(sq, sk, causal, offset):
    """The visibility rule written out element by element, independent of flashtile's causal_mask."""
    if not causal:
        return torch.ones(sq, sk, dtype=torch.bool)
    offset = sk - sq if offset is None else offset
    return torch.tensor([[j <= i + offset for j in range(sk)] for i in range(sq)], dtype=torch.bool).view(sq, sk)


def loop_oracle(q, k, v, scale, visible):
    """Attention one (batch, head) at a time with einsum and torch.softmax; rows with no visible key stay 0/-inf."""
    b, sq, hq, _ = q.shape
    hk = k.shape[2]
    out = q.new_zeros(b, sq, hq, v.shape[-1])
    lse = q.new_full((b, hq, sq), NEG_INF)
    rows = visible.any(dim=1)
    for bi in range(b):
        for h in range(hq):
            kv = h // (hq // hk)
            s = torch.einsum("id,jd->ij", q[bi, :, h], k[bi, :, kv]) * scale
            s = s.masked_fill(~visible, NEG_INF)[rows]
            lse[bi, h, rows] = torch.logsumexp(s, dim=1)
            out[bi, rows, h] = torch.softmax(s, dim=1) @ v[bi, :, kv]
    return out, lse


def autograd_reference(q, k, v, dout, dlse, **mask):
    """(out, lse, dq, dk, dv) by torch.autograd through naive_attention in float64."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = naive_attention(q, k, v, **mask)
    outputs, grads = (out, lse), (dout, dlse if dlse is not None else torch.zeros_like(lse))
    dq, dk, dv = torch.autograd.grad(outputs, (q, k, v), grads)
    return out.detach(), lse.detach(), dq, dk, dv


# ---------------------------------------------------------------------------------------------------- naive


@pytest.mark.parametrize("mask", MASK_PARAMS)
@pytest.mark.parametrize("shape", SHAPE_PARAMS)
def test_naive_matches_loop_oracle(shape, mask, gen):
    causal, offset = mask
    q, k, v = make_qkv(shape, gen)
    scale = 0.3
    out, lse = naive_attention(q, k, v, softmax_scale=scale, causal=causal, diagonal_offset=offset)
    ref_out, ref_lse = loop_oracle(q, k, v, scale, drawn_mask(shape[1], shape[2], causal, offset))
    torch.testing.assert_close(out, ref_out, **F64_TOL)
    torch.testing.assert_close(lse, ref_lse, **F64_TOL)


# SDPA's is_causal is top-left aligned: it agrees with the default bottom-right mask only when Sq == Sk.
SDPA_CASES = [
    pytest.param(s.values[0], m.values[0], id=f"{s.id}-{m.id}")
    for s in SHAPE_PARAMS for m in MASK_PARAMS[:3] if m.values[0] != (True, None) or s.values[0][1] == s.values[0][2]
]


@pytest.mark.parametrize("shape, mask", SDPA_CASES)
def test_naive_matches_sdpa(shape, mask, gen):
    causal, offset = mask
    hq, hk = shape[3], shape[4]
    q, k, v = make_qkv(shape, gen)
    out, _ = naive_attention(q, k, v, causal=causal, diagonal_offset=offset)
    group = hq // hk
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(group, dim=1),
                                         v.transpose(1, 2).repeat_interleave(group, dim=1), is_causal=causal)
    torch.testing.assert_close(out, ref.transpose(1, 2), **F64_TOL)


MASK_DRAWINGS = [
    pytest.param(2, 5, None, "11110/11111", id="Sq2-Sk5-bottomright"),
    pytest.param(2, 5, 0, "10000/11000", id="Sq2-Sk5-topleft"),
    pytest.param(5, 2, None, "00/00/00/10/11", id="Sq5-Sk2-bottomright"),
    pytest.param(5, 2, 0, "10/11/11/11/11", id="Sq5-Sk2-topleft"),
    pytest.param(3, 3, None, "100/110/111", id="Sq3-Sk3-bottomright"),
    pytest.param(3, 4, -1, "0000/1000/1100", id="Sq3-Sk4-off-1"),
]


def parse_drawing(drawing):
    return torch.tensor([[c == "1" for c in row] for row in drawing.split("/")])


@pytest.mark.parametrize("sq, sk, offset, drawing", MASK_DRAWINGS)
def test_causal_mask_drawing(sq, sk, offset, drawing):
    torch.testing.assert_close(causal_mask(sq, sk, offset), parse_drawing(drawing))


@pytest.mark.parametrize("sq, sk, offset, drawing", MASK_DRAWINGS)
def test_naive_attends_to_drawn_keys(sq, sk, offset, drawing, gen):
    # With v = identity, out[i, j] = P_ij, which is > 0 exactly where query i sees key j.
    q = torch.randn(1, sq, 1, 4, generator=gen, dtype=F64)
    k = torch.randn(1, sk, 1, 4, generator=gen, dtype=F64)
    v = torch.eye(sk, dtype=F64).view(1, sk, 1, sk)
    out, lse = naive_attention(q, k, v, causal=True, diagonal_offset=offset)
    expected = parse_drawing(drawing)
    torch.testing.assert_close(out[0, :, 0] > 0, expected)
    torch.testing.assert_close(torch.isinf(lse[0, 0]), ~expected.any(dim=1))


@pytest.mark.parametrize("sq, sk, offset", [
    pytest.param(9, 4, None, id="Sq9-Sk4-bottomright"),
    pytest.param(8, 8, -3, id="Sq8-Sk8-off-3"),
    pytest.param(4, 6, -10, id="Sq4-Sk6-all-masked"),
])
def test_naive_fully_masked_rows(sq, sk, offset, gen):
    q, k, v = make_qkv((2, sq, sk, 4, 2, 8), gen)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = naive_attention(q, k, v, causal=True, diagonal_offset=offset)
    empty = ~drawn_mask(sq, sk, True, offset).any(dim=1)                   # [Sq]
    assert empty.any()
    assert torch.equal(out[:, empty], torch.zeros_like(out[:, empty]))
    assert torch.isneginf(lse[..., empty]).all()
    assert torch.isfinite(out).all() and torch.isfinite(lse[..., ~empty]).all()
    # Gradients through both out and lse, with nonzero upstream gradients on the empty rows too.
    dout = torch.randn(out.shape, generator=gen, dtype=F64)
    dlse = torch.randn(lse.shape, generator=gen, dtype=F64)
    dq, dk, dv = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert torch.equal(dq[:, empty], torch.zeros_like(dq[:, empty]))


def test_forward_no_keys(gen):
    q, k, v = make_qkv((2, 5, 0, 4, 2, 8), gen)
    for forward in (naive_attention, tiled_attention_fa1, tiled_attention_fa2):
        out, lse = forward(q, k, v)
        assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


@pytest.mark.parametrize("dtype, lse_dtype", [
    (torch.float64, torch.float64), (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32), (torch.float16, torch.float32),
])
def test_naive_dtypes(dtype, lse_dtype, gen):
    q, k, v = make_qkv((1, 17, 33, 2, 1, 16), gen, dtype)
    out, lse = naive_attention(q, k, v, causal=True)
    assert out.dtype == dtype and lse.dtype == lse_dtype


def test_naive_bf16_computes_in_bf16(gen):
    # naive_attention on bf16 inputs is the "plain PyTorch in that dtype" baseline: its error against the float64
    # oracle on the same (already rounded) inputs must look like bf16 arithmetic, neither 0 nor garbage.
    q, k, v = make_qkv((2, 65, 65, 4, 2, 32), gen, torch.bfloat16)
    out, _ = naive_attention(q, k, v, causal=True)
    ref, _ = naive_attention(q.double(), k.double(), v.double(), causal=True)
    err = (out.double() - ref).abs().max().item()
    bf16_eps = torch.finfo(torch.bfloat16).eps
    assert bf16_eps / 16 < err < 8 * bf16_eps


def test_naive_value_dim_differs(gen):
    shape = (2, 9, 13, 4, 2, 16)
    q, k, v = make_qkv(shape, gen, dv=24)
    out, lse = naive_attention(q, k, v, causal=True)
    ref_out, ref_lse = loop_oracle(q, k, v, 1 / math.sqrt(16), drawn_mask(9, 13, True, None))
    torch.testing.assert_close(out, ref_out, **F64_TOL)
    torch.testing.assert_close(lse, ref_lse, **F64_TOL)
    for forward in (tiled_attention_fa1, tiled_attention_fa2):
        torch.testing.assert_close(forward(q, k, v, causal=True, block_m=4, block_n=5), (out, lse), **F64_TOL)
    dout = torch.randn(out.shape, generator=gen, dtype=F64)
    _, _, *grads = autograd_reference(q, k, v, dout, None, causal=True)
    for backward in (attention_backward, tiled_attention_backward):
        torch.testing.assert_close(backward(q, k, v, out, lse, dout, causal=True), tuple(grads), **F64_TOL)


# ---------------------------------------------------------------------------------------------------- softmax


STREAMS = {
    "random": lambda g: torch.randn(37, generator=g, dtype=F64) * 3,
    "increasing": lambda g: torch.arange(12, dtype=F64) * 2.5,
    "decreasing": lambda g: torch.arange(12, 0, -1, dtype=F64) * 2.5,
    "neg-inf-entries": lambda g: torch.tensor([NEG_INF, NEG_INF, 1.0, NEG_INF, 3.0, -2.0, NEG_INF], dtype=F64),
    "huge": lambda g: torch.tensor([1000.0, 1001.0, 999.0, 1003.0], dtype=F64),
    "single": lambda g: torch.randn(1, generator=g, dtype=F64),
    "all-neg-inf": lambda g: torch.full((5,), NEG_INF, dtype=F64),
}
STREAM_PARAMS = [pytest.param(name, id=name) for name in STREAMS]


@pytest.mark.parametrize("stream", STREAM_PARAMS)
def test_online_softmax_invariant(stream, gen):
    x = STREAMS[stream](gen)
    states = online_softmax_states(x)
    assert len(states) == len(x)
    for i, (m_i, l_i) in enumerate(states):
        prefix = x[: i + 1]
        assert m_i == prefix.max().item()
        expected_l = 0.0 if m_i == NEG_INF else torch.exp(prefix - m_i).sum().item()
        assert l_i == pytest.approx(expected_l, rel=1e-12, abs=0.0)


@pytest.mark.parametrize("stream", STREAM_PARAMS)
def test_online_softmax_matches_softmax(stream, gen):
    x = STREAMS[stream](gen)
    probs = online_softmax(x)
    if torch.isneginf(x).all():
        expected = torch.zeros_like(x)                                      # torch.softmax would give NaN here
    else:
        expected = torch.softmax(x, dim=0)
    torch.testing.assert_close(probs, expected, atol=1e-14, rtol=1e-12)
    torch.testing.assert_close(safe_softmax(x), expected, atol=1e-14, rtol=1e-12)


def test_safe_softmax_rows_and_dim(gen):
    x = torch.randn(4, 6, generator=gen, dtype=F64) * 50
    x[1] = NEG_INF
    x[2, :3] = NEG_INF
    for dim in (0, 1, -1):
        expected = torch.softmax(x, dim=dim).nan_to_num(nan=0.0)
        torch.testing.assert_close(safe_softmax(x, dim=dim), expected, atol=1e-14, rtol=1e-12)
    assert torch.equal(safe_softmax(x)[1], torch.zeros(6, dtype=F64))


def test_safe_softmax_no_overflow():
    x = torch.tensor([[100.0, 101.0, 102.0]], dtype=torch.float32)
    assert torch.isnan(torch.exp(x) / torch.exp(x).sum()).all()             # the unsafe form overflows in fp32
    torch.testing.assert_close(safe_softmax(x), torch.softmax(x.double(), dim=-1).float())


# ---------------------------------------------------------------------------------------------------- tiled forward


TILED_SHAPES = SHAPE_PARAMS[1:6]


@pytest.mark.parametrize("forward", FORWARDS)
@pytest.mark.parametrize("blocks", BLOCK_PARAMS)
@pytest.mark.parametrize("mask", MASK_PARAMS[:4])
@pytest.mark.parametrize("shape", TILED_SHAPES)
def test_tiled_forward_matches_naive(shape, mask, blocks, forward, gen):
    causal, offset = mask
    q, k, v = make_qkv(shape, gen)
    kw = dict(softmax_scale=0.2, causal=causal, diagonal_offset=offset)
    out, lse = forward(q, k, v, block_m=blocks[0], block_n=blocks[1], **kw)
    ref_out, ref_lse = naive_attention(q, k, v, **kw)
    torch.testing.assert_close(out, ref_out, **F64_TOL)
    torch.testing.assert_close(lse, ref_lse, **F64_TOL)


@pytest.mark.parametrize("forward", FORWARDS)
@pytest.mark.parametrize("shape", [SHAPE_PARAMS[0], SHAPE_PARAMS[6], SHAPE_PARAMS[7]])
def test_tiled_forward_degenerate_shapes(shape, forward, gen):
    q, k, v = make_qkv(shape, gen)
    for causal in (False, True):
        torch.testing.assert_close(forward(q, k, v, causal=causal, block_m=16, block_n=16),
                                   naive_attention(q, k, v, causal=causal), **F64_TOL)


@pytest.mark.parametrize("forward", FORWARDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_forward_dtypes(forward, dtype, gen):
    q, k, v = make_qkv((1, 33, 47, 4, 2, 16), gen, dtype)
    out, lse = forward(q, k, v, causal=True, block_m=16, block_n=16)
    assert out.dtype == dtype and lse.dtype == torch.float32
    ref_out, ref_lse = naive_attention(q.double(), k.double(), v.double(), causal=True)
    # Accumulation is float32 whatever the input dtype, so bf16 out is off only by its final rounding (half an ulp).
    rtol = torch.finfo(dtype).eps if dtype == torch.bfloat16 else FP32_RTOL
    torch.testing.assert_close(out.double(), ref_out, atol=FP32_ATOL, rtol=rtol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=0.0)


@pytest.mark.parametrize("forward", FORWARDS)
def test_tiled_skips_blocks_above_diagonal(forward, gen):
    # Top-left causal with Sq = 16 < Sk = 64: no query sees keys 16..63. If those K/V blocks were loaded, their NaN
    # would reach out through p @ v (0 * NaN = NaN) even though the scores are masked.
    q, k, v = make_qkv((1, 16, 64, 2, 1, 8), gen)
    k_poisoned, v_poisoned = k.clone(), v.clone()
    k_poisoned[:, 16:] = float("nan")
    v_poisoned[:, 16:] = float("nan")
    kw = dict(causal=True, diagonal_offset=0, block_m=8, block_n=16)
    out, lse = forward(q, k_poisoned, v_poisoned, **kw)
    torch.testing.assert_close((out, lse), naive_attention(q, k, v, causal=True, diagonal_offset=0), **F64_TOL)
    dout = torch.randn(out.shape, generator=gen, dtype=F64)
    dq, dk, dv = tiled_attention_backward(q, k_poisoned, v_poisoned, out, lse, dout, **kw)
    assert torch.isfinite(dq).all()
    assert not dk[:, 16:].any() and not dv[:, 16:].any()


# ---------------------------------------------------------------------------------------------------- backward


BACKWARD_MASKS = [MASK_PARAMS[0], MASK_PARAMS[1], MASK_PARAMS[3]]
BACKWARDS = [
    pytest.param(attention_backward, id="dense"),
    pytest.param(lambda *a, **kw: tiled_attention_backward(*a, block_m=16, block_n=16, **kw), id="tiled-16x16"),
    pytest.param(lambda *a, **kw: tiled_attention_backward(*a, block_m=7, block_n=13, **kw), id="tiled-7x13"),
]


@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("with_dlse", [pytest.param(False, id="out-only"), pytest.param(True, id="out-and-lse")])
@pytest.mark.parametrize("mask", BACKWARD_MASKS)
@pytest.mark.parametrize("shape", SHAPE_PARAMS[1:6] + [SHAPE_PARAMS[7]])
def test_backward_matches_autograd(shape, mask, with_dlse, backward, gen):
    causal, offset = mask
    q, k, v = make_qkv(shape, gen)
    kw = dict(softmax_scale=0.25, causal=causal, diagonal_offset=offset)
    out, lse = naive_attention(q, k, v, **kw)
    dout = torch.randn(out.shape, generator=gen, dtype=F64)
    dlse = torch.randn(lse.shape, generator=gen, dtype=F64) if with_dlse else None
    _, _, *expected = autograd_reference(q, k, v, dout, dlse, **kw)
    grads = backward(q, k, v, out, lse, dout, dlse=dlse, **kw)
    torch.testing.assert_close(grads, tuple(expected), **F64_TOL)


def test_backward_fully_masked_rows_are_zero(gen):
    q, k, v = make_qkv((2, 9, 4, 4, 2, 8), gen)
    out, lse = naive_attention(q, k, v, causal=True)
    dout, dlse = torch.randn(out.shape, generator=gen, dtype=F64), torch.randn(lse.shape, generator=gen, dtype=F64)
    empty = ~drawn_mask(9, 4, True, None).any(dim=1)
    for backward in (attention_backward, tiled_attention_backward):
        dq, dk, dv = backward(q, k, v, out, lse, dout, causal=True, dlse=dlse)
        assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
        assert torch.equal(dq[:, empty], torch.zeros_like(dq[:, empty]))


# float32: accumulation over ~50 keys (measured ~5 ulps); bf16: rounding of the grads (half an ulp of values < 4).
BACKWARD_ATOL = {torch.float32: 16 * torch.finfo(torch.float32).eps,
                 torch.bfloat16: 2 * torch.finfo(torch.bfloat16).eps}


@pytest.mark.parametrize("backward", [attention_backward, tiled_attention_backward], ids=["dense", "tiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_dtypes(backward, dtype, gen):
    q, k, v = make_qkv((1, 33, 47, 4, 2, 16), gen, dtype)
    out, lse = naive_attention(q.double(), k.double(), v.double(), causal=True)
    dout = torch.randn(out.shape, generator=gen, dtype=F64).to(dtype)
    grads = backward(q, k, v, out.to(dtype), lse.float(), dout, causal=True)
    _, _, *expected = autograd_reference(q.double(), k.double(), v.double(), dout.double(), None, causal=True)
    for g, e in zip(grads, expected):
        assert g.dtype == dtype
        # Inputs are exact in float64; the only errors are float32 accumulation and rounding out and the grads.
        torch.testing.assert_close(g.double(), e, atol=BACKWARD_ATOL[dtype], rtol=0.0)


# ---------------------------------------------------------------------------------------------------- merge


def split_and_merge(q, k, v, bounds, causal, offset):
    """Run naive attention on each key chunk [bounds[c], bounds[c + 1]) and merge. Returns (merged, partial lses)."""
    sq, sk = q.shape[1], k.shape[1]
    full_offset = (sk - sq if offset is None else offset) if causal else None
    outs, lses = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        # Key j of the whole is key j - a of the chunk, so the chunk's diagonal sits a further left.
        chunk_offset = full_offset - a if causal else None
        o, lse = naive_attention(q, k[:, a:b], v[:, a:b], causal=causal, diagonal_offset=chunk_offset)
        outs.append(o)
        lses.append(lse)
    return merge_partials(outs, lses), outs, lses


@pytest.mark.parametrize("n_chunks", [2, 3, 4])
@pytest.mark.parametrize("mask", MASK_PARAMS[:4])
@pytest.mark.parametrize("shape", [SHAPE_PARAMS[1], SHAPE_PARAMS[3], SHAPE_PARAMS[4], SHAPE_PARAMS[6]])
def test_merge_random_splits(shape, mask, n_chunks, gen):
    causal, offset = mask
    q, k, v = make_qkv(shape, gen)
    sk = shape[2]
    cuts = torch.randperm(sk - 1, generator=gen)[: n_chunks - 1] + 1
    bounds = [0, *sorted(cuts.tolist()), sk]
    merged, _, _ = split_and_merge(q, k, v, bounds, causal, offset)
    torch.testing.assert_close(merged, naive_attention(q, k, v, causal=causal, diagonal_offset=offset), **F64_TOL)


def test_merge_skips_invisible_chunk(gen):
    # Top-left causal with Sq = 7: no query sees keys >= 7, so chunk [20, 33) has lse -inf everywhere and an empty
    # chunk [5, 5) has no keys at all. Their outputs are poisoned to show they are never read.
    q, k, v = make_qkv((2, 7, 33, 4, 2, 8), gen)
    (out, lse), outs, lses = split_and_merge(q, k, v, [0, 5, 5, 20, 33], True, 0)
    assert torch.isneginf(lses[1]).all() and torch.isneginf(lses[3]).all()
    outs[1] = torch.full_like(outs[1], float("nan"))
    outs[3] = torch.full_like(outs[3], float("nan"))
    torch.testing.assert_close(merge_partials(outs, lses), (out, lse), **F64_TOL)
    torch.testing.assert_close((out, lse), naive_attention(q, k, v, causal=True, diagonal_offset=0), **F64_TOL)


def test_merge_all_partials_empty(gen):
    # Bottom-right causal with Sq = 9 > Sk = 4: rows 0-4 see no key in any chunk.
    q, k, v = make_qkv((1, 9, 4, 2, 1, 8), gen)
    (out, lse), _, _ = split_and_merge(q, k, v, [0, 2, 4], True, None)
    assert torch.equal(out[:, :5], torch.zeros_like(out[:, :5])) and torch.isneginf(lse[..., :5]).all()
    torch.testing.assert_close((out, lse), naive_attention(q, k, v, causal=True), **F64_TOL)


def test_merge_dtypes(gen):
    q, k, v = make_qkv((1, 5, 20, 2, 2, 8), gen)
    outs, lses = [], []
    for a, b in ((0, 8), (8, 20)):
        o, lse = naive_attention(q, k[:, a:b], v[:, a:b])
        outs.append(o.to(torch.bfloat16))
        lses.append(lse.float())
    out, lse = merge_partials(outs, lses)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref_out, ref_lse = naive_attention(q, k, v)
    torch.testing.assert_close(out.double(), ref_out, atol=2 * torch.finfo(torch.bfloat16).eps, rtol=0.0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-6, rtol=0.0)


# ---------------------------------------------------------------------------------------------------- errors


ATTENTION_FUNCS = [
    pytest.param(naive_attention, id="naive"),
    pytest.param(tiled_attention_fa1, id="fa1"),
    pytest.param(tiled_attention_fa2, id="fa2"),
]


def _t(*shape, dtype=F64):
    return torch.zeros(shape, dtype=dtype)


BAD_INPUTS = [
    pytest.param((_t(1, 4, 3, 8), _t(1, 4, 2, 8), _t(1, 4, 2, 8)), {}, ValueError, "multiple", id="heads-not-multiple"),
    pytest.param((_t(4, 3, 8), _t(1, 4, 3, 8), _t(1, 4, 3, 8)), {}, ValueError, "4 dims", id="q-3d"),
    pytest.param((_t(2, 4, 2, 8), _t(1, 4, 2, 8), _t(1, 4, 2, 8)), {}, ValueError, "batch", id="batch-mismatch"),
    pytest.param((_t(1, 4, 2, 8), _t(1, 4, 2, 16), _t(1, 4, 2, 8)), {}, ValueError, "head dim", id="headdim-mismatch"),
    pytest.param((_t(1, 4, 2, 8), _t(1, 4, 2, 8), _t(1, 5, 2, 8)), {}, ValueError, "agree", id="kv-seqlen-mismatch"),
    pytest.param((_t(1, 4, 2, 8), _t(1, 4, 2, 8, dtype=torch.float32), _t(1, 4, 2, 8)), {}, TypeError, "one dtype",
                 id="mixed-dtypes"),
    pytest.param((_t(1, 4, 2, 8, dtype=torch.int64),) * 3, {}, TypeError, "floating", id="int-dtype"),
    pytest.param(([0.0], _t(1, 4, 2, 8), _t(1, 4, 2, 8)), {}, TypeError, "torch.Tensor", id="not-a-tensor"),
    pytest.param((_t(1, 4, 2, 8),) * 3, dict(causal=True, diagonal_offset=1.5), TypeError, "diagonal_offset",
                 id="float-offset"),
    pytest.param((_t(1, 4, 2, 8),) * 3, dict(softmax_scale="0.1"), TypeError, "softmax_scale", id="str-scale"),
]


@pytest.mark.parametrize("func", ATTENTION_FUNCS)
@pytest.mark.parametrize("args, kwargs, error, match", BAD_INPUTS)
def test_attention_rejects_bad_inputs(func, args, kwargs, error, match):
    with pytest.raises(error, match=match):
        func(*args, **kwargs)


@pytest.mark.parametrize("func", FORWARDS + [pytest.param(tiled_attention_backward, id="backward")])
def test_tiled_rejects_bad_blocks(func):
    q = _t(1, 4, 2, 8)
    args = (q, q, q) if func is not tiled_attention_backward else (q, q, q, q, _t(1, 2, 4), q)
    with pytest.raises(ValueError, match="block_m"):
        func(*args, block_m=0)


@pytest.mark.parametrize("backward", [attention_backward, tiled_attention_backward], ids=["dense", "tiled"])
def test_backward_rejects_bad_shapes(backward):
    q, lse = _t(1, 4, 2, 8), _t(1, 2, 4)
    with pytest.raises(ValueError, match="dout"):
        backward(q, q, q, q, lse, _t(1, 4, 2, 7))
    with pytest.raises(ValueError, match="lse"):
        backward(q, q, q, q, _t(1, 4, 2), q)


def test_merge_rejects_bad_inputs():
    o, lse = _t(1, 4, 2, 8), _t(1, 2, 4)
    with pytest.raises(ValueError, match="one LSE per output"):
        merge_partials([o, o], [lse])
    with pytest.raises(ValueError, match="lses\\[1\\]"):
        merge_partials([o, o], [lse, _t(1, 4, 2)])
    with pytest.raises(ValueError, match="same shape"):
        merge_partials([o, _t(1, 4, 2, 4)], [lse, lse])
    with pytest.raises(TypeError, match="sequences"):
        merge_partials(o, lse)


@pytest.mark.parametrize("stream", STREAM_PARAMS)
def test_online_softmax_with_a_kept_reference(stream, gen):
    # A reference kept while every term stays at most limit: the invariant holds for it, no term passes the limit,
    # the reference never exceeds the maximum, and the softmax is the same.
    x = STREAMS[stream](gen)
    for limit in (1.0, 8.0, 2.0 ** 15):
        states = online_softmax_states(x, limit=limit)
        for i, (m_i, l_i) in enumerate(states):
            prefix = x[: i + 1]
            assert m_i <= prefix.max().item()
            if m_i == NEG_INF:
                assert l_i == 0.0 and torch.isneginf(prefix).all()
                continue
            terms = torch.exp(prefix - m_i)
            assert terms.max().item() <= limit * (1 + 1e-12)
            assert l_i == pytest.approx(terms.sum().item(), rel=1e-12, abs=0.0)
        expected = torch.zeros_like(x) if torch.isneginf(x).all() else torch.softmax(x, dim=0)
        torch.testing.assert_close(online_softmax(x, limit=limit), expected, atol=1e-14, rtol=1e-12)
    # Rising scores move the reference; with limit 1 it is the maximum at every step.
    rising = torch.arange(10, dtype=torch.float64)
    assert [m for m, _ in online_softmax_states(rising, limit=1.0)] == rising.tolist()
    assert [m for m, _ in online_softmax_states(rising, limit=math.e ** 3)] == [0.0] * 4 + [4.0] * 4 + [8.0] * 2
    with pytest.raises(ValueError, match="limit"):
        online_softmax_states(x, limit=0.5)


def test_online_softmax_rejects_2d():
    with pytest.raises(ValueError, match="1-D"):
        online_softmax_states(_t(2, 3))
    with pytest.raises(ValueError, match="1-D"):
        online_softmax(_t(2, 3))


# ---------------------------------------------------------------------------------------------------- masks and score
# modifications (docs/derivation.md, ch. 8). Each is checked against feature_oracle, which builds the additive bias
# and the visibility mask by hand (Python loops over i, j) and runs one (batch, head) at a time with torch.softmax.


# (B, Sq, Sk, Hq, Hk, D): Sq < Sk, Sq > Sk, decode, square; GQA 2:1, 1:1, 4:1, 2:1.
FEATURE_SHAPES = [
    pytest.param(s, id="B{}-Sq{}-Sk{}-H{}-Hk{}-D{}".format(*s))
    for s in [(2, 7, 17, 4, 2, 16), (2, 17, 7, 4, 4, 8), (1, 1, 33, 4, 1, 16), (1, 23, 23, 2, 1, 8)]
]


def alibi_bias_drawn(slopes, b, hq, sq, sk, offset):
    """-slope_h * |i + offset - j| as a full [B, Hq, Sq, Sk] matrix, from a distance table written out by hand."""
    distance = torch.tensor([[abs(i + offset - j) for j in range(sk)] for i in range(sq)], dtype=F64).view(sq, sk)
    slopes = slopes.double().expand(b, hq)                                   # (Hq,) or (B, Hq)
    return -slopes[:, :, None, None] * distance


def window_drawn(sq, sk, offset, left, right, causal):
    """Visibility under window (left, right) and causal, element by element; -1 means unbounded."""
    def sees(i, j):
        return ((left < 0 or j >= i + offset - left) and (right < 0 or j <= i + offset + right)
                and (not causal or j <= i + offset))
    return torch.tensor([[sees(i, j) for j in range(sk)] for i in range(sq)], dtype=torch.bool).view(sq, sk)


def feature_oracle(q, k, v, scale, *, softcap=0.0, add=None, visible=None, sinks=None, keep=None, dropout_p=0.0):
    """Attention one (batch, head) at a time: softcap with an explicit tanh, then the full additive matrix `add`
    [B, Hq, Sq, Sk], then -inf where `visible` [B, Hq, Sq, Sk] is False. Sinks join as an extra score column that is
    dropped after the softmax; `keep` [B, Hq, Sq, Sk] drops entries of P with 1 / (1 - dropout_p) rescaling. Rows
    with no finite score stay out 0 / lse -inf. Differentiable (autograd) wherever no row is fully masked."""
    b, sq, hq, _ = q.shape
    sk, hk = k.shape[1], k.shape[2]
    outs, lses = [], []
    for bi in range(b):
        for h in range(hq):
            kv = h // (hq // hk)
            s = torch.einsum("id,jd->ij", q[bi, :, h], k[bi, :, kv]) * scale
            if softcap > 0:
                s = softcap * torch.tanh(s / softcap)
            if add is not None:
                s = s + add[bi, h]
            if visible is not None:
                s = s.masked_fill(~visible[bi, h], NEG_INF)
            if sinks is not None:
                s = torch.cat([s, sinks[h].expand(sq, 1)], dim=1)           # the sink column, no value row
            rows = torch.isfinite(s).any(dim=1)
            lse = torch.full((sq,), NEG_INF, dtype=F64)
            lse[rows] = torch.logsumexp(s[rows], dim=1)
            probs = torch.zeros(sq, sk, dtype=F64)
            probs[rows] = torch.softmax(s[rows], dim=1)[:, :sk]
            if keep is not None:
                probs = probs * keep[bi, h] / (1 - dropout_p)
            outs.append(probs @ v[bi, :, kv])
            lses.append(lse)
    out = torch.stack(outs).view(b, hq, sq, -1).transpose(1, 2)
    return out, torch.stack(lses).view(b, hq, sq)


def assert_matches_oracle(got, expected):
    torch.testing.assert_close(got[0], expected[0], **F64_TOL)
    torch.testing.assert_close(got[1], expected[1], **F64_TOL)


@pytest.mark.parametrize("softcap", [0.5, 3.0, 50.0])
@pytest.mark.parametrize("shape", FEATURE_SHAPES)
def test_softcap_matches_oracle(shape, softcap, gen):
    q, k, v = make_qkv(shape, gen)
    q = q * 3                                                                # scores well past the cap
    got = naive_attention(q, k, v, softmax_scale=0.5, softcap=softcap)
    assert_matches_oracle(got, feature_oracle(q, k, v, 0.5, softcap=softcap))


@pytest.mark.parametrize("per_batch", [pytest.param(False, id="slopes-H"), pytest.param(True, id="slopes-BH")])
@pytest.mark.parametrize("mask", MASK_PARAMS)
@pytest.mark.parametrize("shape", FEATURE_SHAPES)
def test_alibi_matches_oracle(shape, mask, per_batch, gen):
    causal, offset = mask
    b, sq, sk, hq = shape[:4]
    q, k, v = make_qkv(shape, gen)
    slopes = torch.rand((b, hq) if per_batch else (hq,), generator=gen) * 0.5   # float32, as the API takes them
    got = naive_attention(q, k, v, causal=causal, diagonal_offset=offset, alibi_slopes=slopes)
    # ALiBi measures distance from the same diagonal as the causal mask: bottom-right by default, even when causal
    # is False.
    off = sk - sq if offset is None else offset
    visible = drawn_mask(sq, sk, causal, offset).expand(b, hq, sq, sk)
    expected = feature_oracle(q, k, v, 1 / math.sqrt(shape[5]), add=alibi_bias_drawn(slopes, b, hq, sq, sk, off),
                              visible=visible)
    assert_matches_oracle(got, expected)


BIAS_SHAPES = [
    pytest.param(lambda b, h, sq, sk: (1, 1, sq, sk), id="11SqSk"),
    pytest.param(lambda b, h, sq, sk: (b, 1, sq, sk), id="B1SqSk"),
    pytest.param(lambda b, h, sq, sk: (sq, sk), id="SqSk"),
    pytest.param(lambda b, h, sq, sk: (b, h, 1, sk), id="BH1Sk"),
    pytest.param(lambda b, h, sq, sk: (b, h, sq, sk), id="BHSqSk"),
]


def sdpa_gqa(q, k, v, **kw):
    """torch SDPA in the flash-attn layout, with the kv heads repeated for grouped-query attention."""
    group = q.shape[2] // k.shape[2]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(group, dim=1),
                                         v.transpose(1, 2).repeat_interleave(group, dim=1), **kw)
    return out.transpose(1, 2)


@pytest.mark.parametrize("bias_shape", BIAS_SHAPES)
@pytest.mark.parametrize("shape", FEATURE_SHAPES)
def test_bias_matches_sdpa(shape, bias_shape, gen):
    b, sq, sk, hq = shape[:4]
    q, k, v = make_qkv(shape, gen)
    bias = torch.randn(bias_shape(b, hq, sq, sk), generator=gen, dtype=F64) * 2
    out, lse = naive_attention(q, k, v, attn_bias=bias)
    torch.testing.assert_close(out, sdpa_gqa(q, k, v, attn_mask=bias), **F64_TOL)
    add = bias.expand(b, hq, sq, sk)
    torch.testing.assert_close(lse, feature_oracle(q, k, v, 1 / math.sqrt(shape[5]), add=add)[1], **F64_TOL)


@pytest.mark.parametrize("bias_shape", BIAS_SHAPES)
@pytest.mark.parametrize("shape", FEATURE_SHAPES)
def test_bool_mask_matches_sdpa(shape, bias_shape, gen):
    b, sq, sk, hq = shape[:4]
    q, k, v = make_qkv(shape, gen)
    mask = torch.rand(bias_shape(b, hq, sq, sk), generator=gen) < 0.6
    mask[..., 0] = True                                                      # SDPA returns NaN for an empty row
    out, lse = naive_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, sdpa_gqa(q, k, v, attn_mask=mask), **F64_TOL)
    visible = mask.expand(b, hq, sq, sk)
    torch.testing.assert_close(lse, feature_oracle(q, k, v, 1 / math.sqrt(shape[5]), visible=visible)[1],
                               **F64_TOL)


WINDOWS = [(2, 0), (0, 0), (3, 5), (-1, 2), (4, -1), (0, -1), (100, 100)]
WINDOW_PARAMS = [pytest.param(w, id="win{}_{}".format(*w)) for w in WINDOWS]


@pytest.mark.parametrize("causal", [pytest.param(False, id="local"), pytest.param(True, id="local-causal")])
@pytest.mark.parametrize("offset", [None, 0, 3], ids=["off-default", "off0", "off3"])
@pytest.mark.parametrize("window", WINDOW_PARAMS)
@pytest.mark.parametrize("shape", FEATURE_SHAPES[:3])
def test_window_matches_oracle(shape, window, offset, causal, gen):
    b, sq, sk, hq = shape[:4]
    q, k, v = make_qkv(shape, gen)
    got = naive_attention(q, k, v, causal=causal, diagonal_offset=offset, window_size=window)
    off = sk - sq if offset is None else offset
    visible = window_drawn(sq, sk, off, *window, causal).expand(b, hq, sq, sk)
    assert_matches_oracle(got, feature_oracle(q, k, v, 1 / math.sqrt(shape[5]), visible=visible))


WINDOW_DRAWINGS = [
    pytest.param(3, 5, (1, 0), False, "01100/00110/00011", id="Sq3-Sk5-win1_0"),
    pytest.param(4, 4, (1, 1), False, "1100/1110/0111/0011", id="Sq4-Sk4-win1_1"),
    pytest.param(4, 4, (0, 2), True, "1000/0100/0010/0001", id="Sq4-Sk4-win0_2-causal"),
    pytest.param(5, 2, (0, 1), False, "00/00/10/11/01", id="Sq5-Sk2-win0_1"),
]


@pytest.mark.parametrize("sq, sk, window, causal, drawing", WINDOW_DRAWINGS)
def test_window_attends_to_drawn_keys(sq, sk, window, causal, drawing, gen):
    # As test_naive_attends_to_drawn_keys: with v = identity, out[i, j] = P_ij > 0 exactly where i sees j.
    q = torch.randn(1, sq, 1, 4, generator=gen, dtype=F64)
    k = torch.randn(1, sk, 1, 4, generator=gen, dtype=F64)
    v = torch.eye(sk, dtype=F64).view(1, sk, 1, sk)
    out, lse = naive_attention(q, k, v, causal=causal, window_size=window)
    expected = parse_drawing(drawing)
    torch.testing.assert_close(out[0, :, 0] > 0, expected)
    torch.testing.assert_close(torch.isinf(lse[0, 0]), ~expected.any(dim=1))


@pytest.mark.parametrize("mask", MASK_PARAMS[:3])
@pytest.mark.parametrize("shape", FEATURE_SHAPES)
def test_sinks_match_oracle(shape, mask, gen):
    causal, offset = mask
    b, sq, sk, hq = shape[:4]
    q, k, v = make_qkv(shape, gen)
    sinks = torch.randn(hq, generator=gen) * 2                               # float32, as the API takes them
    got = naive_attention(q, k, v, causal=causal, diagonal_offset=offset, sinks=sinks)
    visible = drawn_mask(sq, sk, causal, offset).expand(b, hq, sq, sk)
    expected = feature_oracle(q, k, v, 1 / math.sqrt(shape[5]), visible=visible, sinks=sinks.double())
    assert_matches_oracle(got, expected)
    # The sink takes weight: each row's output weights sum to 1 - exp(sink - lse) < 1.
    weights = naive_attention(q, k, torch.ones_like(v[..., :1]), causal=causal, diagonal_offset=offset,
                              sinks=sinks)[0][..., 0]                       # [B, Sq, Hq]
    torch.testing.assert_close(weights, 1 - torch.exp(sinks.double()[:, None] - got[1]).transpose(1, 2),
                               **F64_TOL)


@pytest.mark.parametrize("dropout_p", [0.0, 0.25, 0.6])
@pytest.mark.parametrize("shape", FEATURE_SHAPES)
def test_dropout_matches_oracle(shape, dropout_p, gen):
    b, sq, sk, hq = shape[:4]
    q, k, v = make_qkv(shape, gen)
    keep = torch.rand(b, hq, sq, sk, generator=gen) >= dropout_p
    got = naive_attention(q, k, v, causal=True, dropout_p=dropout_p, dropout_mask=keep)
    visible = drawn_mask(sq, sk, True, None).expand(b, hq, sq, sk)
    expected = feature_oracle(q, k, v, 1 / math.sqrt(shape[5]), visible=visible, keep=keep, dropout_p=dropout_p)
    assert_matches_oracle(got, expected)
    # lse ignores dropout.
    torch.testing.assert_close(got[1], naive_attention(q, k, v, causal=True)[1], **F64_TOL)


def test_dropout_by_hand(gen):
    # One query, three keys, the middle one dropped: out = (P_0 v_0 + P_2 v_2) / (1 - p).
    q = torch.randn(1, 1, 1, 4, generator=gen, dtype=F64)
    k = torch.randn(1, 3, 1, 4, generator=gen, dtype=F64)
    v = torch.randn(1, 3, 1, 5, generator=gen, dtype=F64)
    keep = torch.tensor([True, False, True]).view(1, 1, 1, 3)
    out, _ = naive_attention(q, k, v, softmax_scale=1.0, dropout_p=0.4, dropout_mask=keep)
    p = torch.softmax(k[0, :, 0] @ q[0, 0, 0], dim=0)
    torch.testing.assert_close(out[0, 0, 0], (p[0] * v[0, 0, 0] + p[2] * v[0, 2, 0]) / 0.6, **F64_TOL)


# Random123's known-answer vectors for Philox-4x32-10: (counter, key) -> outputs.
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, expected", PHILOX_KAT)
def test_philox_known_answers(counter, key, expected):
    got = philox_4x32(key[0] | key[1] << 32, *(torch.tensor([c], dtype=torch.int64) for c in counter))
    assert [int(x) for x in got] == list(expected)


def test_dropout_mask_layout():
    """The documented draw: element (b, h, i, j) takes output 2 * (bit 3 of i) + (bit 3 of j) of the Philox call at
    counter (g(j), g(i), b * H + h, 0), g(x) = (x >> 4) * 8 + (x & 7); checked element by element."""
    seed, p, batch, heads, sq, sk = 0x1234_5678_9ABC_DEF0, 0.5, 2, 3, 37, 45
    mask = dropout_mask(seed, batch, heads, sq, sk, p, batch_offset=5)
    threshold = dropout_threshold(p)
    g = lambda x: (x >> 4) * 8 + (x & 7)  # noqa: E731
    gen = torch.Generator().manual_seed(3)
    for _ in range(200):
        b, h, i, j = (int(torch.randint(n, (1,), generator=gen)) for n in (batch, heads, sq, sk))
        outs = philox_4x32(seed, *(torch.tensor([c], dtype=torch.int64) for c in (g(j), g(i), (b + 5) * heads + h, 0)))
        bits = int(outs[2 * ((i >> 3) & 1) + ((j >> 3) & 1)])
        assert bool(mask[b, h, i, j]) == ((bits >> 1) >= threshold), (b, h, i, j)
    assert abs(mask.float().mean().item() - (1 - p)) < 0.03


COMBO_PARAMS = [
    pytest.param(dict(causal=True, window_size=(5, -1)), id="causal-window"),
    pytest.param(dict(causal=True, window_size=(4, 2), diagonal_offset=2), id="causal-window-off2"),
    pytest.param(dict(causal=False, window_size=(3, 6)), id="window"),
    pytest.param(dict(causal=False, window_size=(-1, -1)), id="full"),
]


@pytest.mark.parametrize("with_dropout", [pytest.param(False, id="no-dropout"), pytest.param(True, id="dropout")])
@pytest.mark.parametrize("combo", COMBO_PARAMS)
@pytest.mark.parametrize("shape", FEATURE_SHAPES)
def test_combination_matches_oracle(shape, combo, with_dropout, gen):
    """causal + window + softcap + ALiBi + bias + bool mask + sinks (+ dropout), values and gradients."""
    b, sq, sk, hq = shape[:4]
    q, k, v = make_qkv(shape, gen)
    slopes = torch.rand(b, hq, generator=gen) * 0.3
    bias = torch.randn(b, 1, sq, sk, generator=gen, dtype=F64)
    mask = torch.rand(1, hq, sq, sk, generator=gen) < 0.8
    sinks = torch.randn(hq, generator=gen, dtype=F64)
    dropout_p = 0.3 if with_dropout else 0.0
    keep = torch.rand(b, hq, sq, sk, generator=gen) >= dropout_p if with_dropout else None
    kw = dict(combo, softmax_scale=0.4, softcap=2.5, alibi_slopes=slopes, attn_mask=mask, dropout_p=dropout_p,
              dropout_mask=keep)
    off = sk - sq if combo.get("diagonal_offset") is None else combo["diagonal_offset"]
    visible = window_drawn(sq, sk, off, *combo["window_size"], combo["causal"]) & mask
    oracle_kw = dict(softcap=2.5, visible=visible.expand(b, hq, sq, sk), keep=keep, dropout_p=dropout_p)

    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias, sinks)]
    out, lse = naive_attention(*leaves[:3], attn_bias=leaves[3], sinks=leaves[4], **kw)
    leaves_ref = [t.clone().requires_grad_() for t in (q, k, v, bias, sinks)]
    add = alibi_bias_drawn(slopes, b, hq, sq, sk, off) + leaves_ref[3].expand(b, hq, sq, sk)
    out_ref, lse_ref = feature_oracle(*leaves_ref[:3], 0.4, add=add, sinks=leaves_ref[4], **oracle_kw)
    assert_matches_oracle((out, lse), (out_ref, lse_ref))

    dout = torch.randn(out.shape, generator=gen, dtype=F64)
    dlse = torch.randn(lse.shape, generator=gen, dtype=F64)
    grads = torch.autograd.grad((out, lse), leaves, (dout, dlse))
    # The oracle's logsumexp over an all -inf row has a NaN gradient; with sinks no row is empty.
    grads_ref = torch.autograd.grad((out_ref, lse_ref), leaves_ref, (dout, dlse))
    for name, g, r in zip(("dq", "dk", "dv", "dbias", "dsinks"), grads, grads_ref):
        torch.testing.assert_close(g, r, **F64_TOL, msg=lambda m, name=name: f"{name}: {m}")


FULLY_MASKED = [
    pytest.param(dict(causal=True), id="causal-Sq>Sk"),
    pytest.param(dict(window_size=(0, 0), diagonal_offset=-7), id="window-off-7"),
    pytest.param(dict(window_size=(1, -1), diagonal_offset=-3), id="window-left"),
    pytest.param(dict(attn_mask="rows"), id="bool-mask"),
    pytest.param(dict(attn_bias="rows"), id="bias-neg-inf"),
]


@pytest.mark.parametrize("with_sinks", [pytest.param(False, id="no-sinks"), pytest.param(True, id="sinks")])
@pytest.mark.parametrize("how", FULLY_MASKED)
def test_fully_masked_rows_with_features(how, with_sinks, gen):
    b, sq, sk, hq, hk = 2, 9, 4, 4, 2
    q, k, v = make_qkv((b, sq, sk, hq, hk, 8), gen)
    kw = dict(how)
    if kw.get("attn_mask") == "rows":
        kw["attn_mask"] = torch.rand(b, 1, sq, sk, generator=gen) < 0.5
        kw["attn_mask"][:, :, ::2] = False                                   # even rows see nothing
    if kw.get("attn_bias") == "rows":
        kw["attn_bias"] = torch.randn(b, hq, sq, sk, generator=gen, dtype=F64)
        kw["attn_bias"][:, :, ::2] = NEG_INF
        kw["attn_bias"][:, :, 1, :2] = NEG_INF                               # partly -inf rows stay finite
    if "window_size" in kw:
        kw["causal"] = False
    leaves = [q, k, v] + ([kw.pop("attn_bias")] if "attn_bias" in kw else [])
    leaves = [t.clone().requires_grad_() for t in leaves]
    sinks = torch.randn(hq, generator=gen, dtype=F64).requires_grad_() if with_sinks else None
    out, lse = naive_attention(*leaves[:3], attn_bias=leaves[3] if len(leaves) > 3 else None, sinks=sinks,
                               softcap=3.0, alibi_slopes=torch.rand(hq, generator=gen), **kw)
    dout = torch.randn(out.shape, generator=gen, dtype=F64)
    dlse = torch.randn(lse.shape, generator=gen, dtype=F64)
    wrt = leaves + ([sinks] if with_sinks else [])
    grads = torch.autograd.grad((out, lse), wrt, (dout, dlse))

    # The empty rows of the reference without features, recomputed from the rule that made them empty.
    ref = naive_attention(q, k, torch.ones_like(v[..., :1]), attn_mask=kw.get("attn_mask"),
                          attn_bias=leaves[3].detach() if len(leaves) > 3 else None, causal=kw.get("causal", False),
                          window_size=kw.get("window_size", (-1, -1)),
                          diagonal_offset=kw.get("diagonal_offset"))[1]
    empty = torch.isneginf(ref)                                              # [B, Hq, Sq]
    assert empty.any() and (~empty).any()
    empty_bshd = empty.transpose(1, 2)                                       # [B, Sq, Hq]
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    assert torch.equal(out[empty_bshd], torch.zeros_like(out[empty_bshd]))
    if with_sinks:
        torch.testing.assert_close(lse[empty], sinks.detach().expand(b, sq, hq).transpose(1, 2)[empty], **F64_TOL)
    else:
        assert torch.isneginf(lse[empty]).all()
    assert torch.isfinite(lse[~empty]).all()
    dq = grads[0]
    assert torch.equal(dq[empty_bshd], torch.zeros_like(dq[empty_bshd]))
    if len(leaves) > 3:
        dbias = grads[3]
        assert torch.equal(dbias[empty], torch.zeros_like(dbias[empty]))
        assert not dbias[torch.isneginf(leaves[3].detach())].any()


@pytest.mark.parametrize("bias_shape", BIAS_SHAPES)
def test_gradcheck_bias(bias_shape, gen):
    b, sq, sk, hq, hk = 2, 3, 5, 2, 1
    q, k, v = make_qkv((b, sq, sk, hq, hk, 4), gen)
    bias = torch.randn(bias_shape(b, hq, sq, sk), generator=gen, dtype=F64)
    sinks = torch.randn(hq, generator=gen, dtype=F64)
    mask = torch.ones(sq, sk, dtype=torch.bool)
    mask[0, 1] = False

    def f(q, k, v, bias, sinks):
        return naive_attention(q, k, v, attn_bias=bias, sinks=sinks, attn_mask=mask, causal=True, softcap=2.0,
                               window_size=(2, -1), alibi_slopes=torch.tensor([0.3, 0.1]))

    inputs = tuple(t.requires_grad_() for t in (q, k, v, bias, sinks))
    assert torch.autograd.gradcheck(f, inputs)


def test_gradcheck_sinks_and_dropout(gen):
    b, sq, sk, hq, hk = 1, 4, 4, 4, 2
    q, k, v = make_qkv((b, sq, sk, hq, hk, 4), gen)
    sinks = torch.randn(hq, generator=gen, dtype=F64) * 2
    keep = torch.rand(b, hq, sq, sk, generator=gen) >= 0.3

    def f(q, k, v, sinks):
        return naive_attention(q, k, v, sinks=sinks, dropout_p=0.3, dropout_mask=keep, causal=True,
                               diagonal_offset=-1)                           # row 0 sees no key: the sink alone

    assert torch.autograd.gradcheck(f, tuple(t.requires_grad_() for t in (q, k, v, sinks)))


def test_sinks_gradient_formula(gen):
    # dsink_h = -sum_{b,i} exp(sink_h - lse_i) * (rowsum(dO * O)_i - dlse_i)   (docs/derivation.md, ch. 8)
    q, k, v = make_qkv((2, 9, 6, 4, 2, 8), gen)
    sinks = torch.randn(4, generator=gen, dtype=F64).requires_grad_()
    out, lse = naive_attention(q, k, v, sinks=sinks, causal=True)
    dout = torch.randn(out.shape, generator=gen, dtype=F64)
    dlse = torch.randn(lse.shape, generator=gen, dtype=F64)
    (dsinks,) = torch.autograd.grad((out, lse), sinks, (dout, dlse))
    delta = (dout * out.detach()).sum(-1).transpose(1, 2) - dlse            # [B, Hq, Sq]
    p_sink = torch.exp(sinks.detach()[:, None] - lse.detach())              # [B, Hq, Sq]
    torch.testing.assert_close(dsinks, -(p_sink * delta).sum(dim=(0, 2)), **F64_TOL)


def test_bias_gradient_is_ds(gen):
    # With a full [B, Hq, Sq, Sk] bias, dbias = dS = P * (dP - delta)   (docs/derivation.md, ch. 8)
    b, sq, sk, hq = 2, 5, 7, 2
    q, k, v = make_qkv((b, sq, sk, hq, hq, 8), gen)
    bias = torch.randn(b, hq, sq, sk, generator=gen, dtype=F64).requires_grad_()
    out, lse = naive_attention(q, k, v, attn_bias=bias)
    dout = torch.randn(out.shape, generator=gen, dtype=F64)
    (dbias,) = torch.autograd.grad(out, bias, dout)
    s = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(8) + bias.detach()
    p = torch.softmax(s, dim=-1)
    dp = torch.einsum("bihd,bjhd->bhij", dout, v)
    delta = (dout * out.detach()).sum(-1).transpose(1, 2)[..., None]
    torch.testing.assert_close(dbias, p * (dp - delta), **F64_TOL)


def test_features_off_is_plain_attention(gen):
    q, k, v = make_qkv((2, 7, 17, 4, 2, 16), gen)
    off = dict(window_size=(-1, -1), softcap=0.0, alibi_slopes=None, attn_bias=None, attn_mask=None, sinks=None,
               dropout_p=0.0, dropout_mask=None)
    for causal in (False, True):
        assert_matches_oracle(naive_attention(q, k, v, causal=causal, **off),
                              loop_oracle(q, k, v, 1 / 4, drawn_mask(7, 17, causal, None)))


def test_features_bf16_computes_in_bf16(gen):
    # The plain-dtype baseline with features: error of bf16 arithmetic, neither 0 nor garbage.
    b, sq, sk, hq = 2, 65, 65, 4
    q, k, v = make_qkv((b, sq, sk, hq, 2, 32), gen, torch.bfloat16)
    bias = torch.randn(1, hq, sq, sk, generator=gen)
    sinks, slopes = torch.randn(hq, generator=gen), torch.rand(hq, generator=gen) * 0.1
    kw = dict(causal=True, window_size=(20, -1), softcap=5.0)
    out, lse = naive_attention(q, k, v, attn_bias=bias, sinks=sinks, alibi_slopes=slopes, **kw)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref, _ = naive_attention(q.double(), k.double(), v.double(), attn_bias=bias.double(), sinks=sinks.double(),
                             alibi_slopes=slopes.double(), **kw)
    err = (out.double() - ref).abs().max().item()
    bf16_eps = torch.finfo(torch.bfloat16).eps
    assert bf16_eps / 16 < err < 8 * bf16_eps


# ---------------------------------------------------------------------------------------------------- varlen


def pack(tensors):
    return torch.cat([t[0] for t in tensors], dim=0)


def cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


VARLEN_CASES = [
    pytest.param([5, 0, 1, 9], [7, 3, 1, 0], id="with-empty-and-single"),
    pytest.param([1, 1, 1], [4, 1, 9], id="decode"),
    pytest.param([8, 13], [13, 8], id="both-ways"),
]


@pytest.mark.parametrize("kw", [
    pytest.param(dict(), id="full"),
    pytest.param(dict(causal=True), id="causal"),
    pytest.param(dict(causal=True, window_size=(3, -1), softcap=2.0), id="causal-window-softcap"),
    pytest.param(dict(window_size=(2, 1), diagonal_offset=1), id="window-off1"),
    pytest.param(dict(causal=True, alibi="BH", sinks=True), id="causal-alibiBH-sinks"),
    pytest.param(dict(alibi="H"), id="alibiH"),
])
@pytest.mark.parametrize("len_q, len_k", VARLEN_CASES)
def test_varlen_matches_per_sequence(len_q, len_k, kw, gen):
    hq, hk, d = 4, 2, 8
    kw = dict(kw)
    if kw.pop("alibi", None):
        kw["alibi_slopes"] = torch.rand((len(len_q), hq) if kw.get("causal") else (hq,), generator=gen)
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(hq, generator=gen, dtype=F64)
    seqs = [make_qkv((1, a, b, hq, hk, d), gen) for a, b in zip(len_q, len_k)]
    q, k, v = (pack([s[i] for s in seqs]) for i in range(3))
    out, lse = naive_attention_varlen(q, k, v, cu(len_q), cu(len_k), **kw)
    assert out.shape == (sum(len_q), hq, d) and lse.shape == (hq, sum(len_q))
    start = 0
    for i, (sq_i, (q_i, k_i, v_i)) in enumerate(zip(len_q, seqs)):
        kw_i = dict(kw)
        slopes = kw.get("alibi_slopes")
        if slopes is not None and slopes.dim() == 2:
            kw_i["alibi_slopes"] = slopes[i]
        out_i, lse_i = naive_attention(q_i, k_i, v_i, **kw_i)
        torch.testing.assert_close(out[start:start + sq_i], out_i[0], **F64_TOL)
        torch.testing.assert_close(lse[:, start:start + sq_i], lse_i[0], **F64_TOL)
        start += sq_i


def test_varlen_gradients_flow(gen):
    len_q, len_k = [3, 0, 4], [5, 2, 0]
    q, k, v = make_qkv((1, 7, 7, 2, 1, 8), gen)
    q, k, v = q[0].requires_grad_(), k[0].requires_grad_(), v[0].requires_grad_()
    out, lse = naive_attention_varlen(q, k, v, cu(len_q), cu(len_k), causal=True)
    grads = torch.autograd.grad((out.sum() + lse[torch.isfinite(lse)].sum()), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.isneginf(lse[:, 3:]).all() and not out[3:].any()          # sequence 2 has no keys


def test_varlen_empty_batch():
    q = torch.zeros(0, 2, 8, dtype=F64)
    out, lse = naive_attention_varlen(q, q, q, cu([]), cu([]))
    assert out.shape == (0, 2, 8) and lse.shape == (2, 0)


# ---------------------------------------------------------------------------------------------------- judge


def judge_case(gen, dtype=torch.bfloat16):
    b, sq, sk, hq, hk, d = 2, 33, 47, 4, 2, 16
    q, k, v = make_qkv((b, sq, sk, hq, hk, d), gen, dtype)
    dout = torch.randn(q.shape, generator=gen, dtype=F64).to(dtype)
    features = dict(window_size=(9, 4), softcap=3.0, alibi_slopes=torch.rand(hq, generator=gen) * 0.2,
                    attn_bias=torch.randn(b, 1, sq, sk, generator=gen).requires_grad_(),
                    attn_mask=torch.rand(sq, sk, generator=gen) < 0.9, sinks=torch.randn(hq, generator=gen),
                    dropout_p=0.2, dropout_mask=torch.rand(b, hq, sq, sk, generator=gen) >= 0.2)
    return q, k, v, dout, features


def oracle_rounded(q, k, v, dout, features, dtype, **override):
    """The float64 reference rounded to the output dtypes: what a correct kernel could return at best."""
    feats64 = {n: (t.detach().double().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor)
                   and t.is_floating_point() else t) for n, t in dict(features, **override).items()}
    ref = reference_fwd_bwd(q.double(), k.double(), v.double(), dout.double(), 0.3, True, None, **feats64)
    out, lse, dq, dk, dv, dbias, dsinks = ref
    return [out.to(dtype), lse.float(), dq.to(dtype), dk.to(dtype), dv.to(dtype),
            None if dbias is None else dbias.float(), None if dsinks is None else dsinks.float()]


def test_judge_passes_and_fails_with_features(gen):
    q, k, v, dout, features = judge_case(gen)
    good = oracle_rounded(q, k, v, dout, features, torch.bfloat16)
    results = judge_all(good, q, k, v, dout, 0.3, True, None, **features)
    assert set(results) == {"out", "lse", "dq", "dk", "dv", "dbias", "dsinks"}
    assert all(err <= bound for err, bound in results.values()), results
    # A result computed without the bias (or with the bias but another modification missing) must fail.
    for wrong in (dict(attn_bias=None), dict(softcap=0.0), dict(sinks=None), dict(window_size=(-1, -1)),
                  dict(dropout_mask=None, dropout_p=0.0), dict(alibi_slopes=None), dict(attn_mask=None)):
        bad = oracle_rounded(q, k, v, dout, features, torch.bfloat16, **wrong)
        results = judge_all(bad[:5], q, k, v, dout, 0.3, True, None, **features)
        assert results["out"][0] > results["out"][1], wrong
    # A wrong dbias or dsinks alone fails too.
    for i, name in ((5, "dbias"), (6, "dsinks")):
        bad = list(good)
        bad[i] = bad[i] * 1.1
        err, bound = judge_all(bad, q, k, v, dout, 0.3, True, None, **features)[name]
        assert err > bound, name


def test_judge_features_skip_the_dense_delta_baseline(gen, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("attention_backward knows no features and must not be used as their baseline")

    monkeypatch.setattr(flashtile.testing, "attention_backward", refuse)
    q, k, v, dout, features = judge_case(gen, torch.float32)
    results = judge_all(oracle_rounded(q, k, v, dout, features, torch.float32), q, k, v, dout, 0.3, True, None,
                        **features)
    assert all(err <= bound for err, bound in results.values()), results
    with pytest.raises(AssertionError, match="knows no features"):
        judge_all(oracle_rounded(q, k, v, dout, {}, torch.float32)[:5], q, k, v, dout, 0.3, True, None)


def test_judge_rejects_unjudgeable_entries(gen):
    q, k, v, dout, features = judge_case(gen)
    good = oracle_rounded(q, k, v, dout, features, torch.bfloat16)
    with pytest.raises(ValueError, match="requires_grad"):
        judge_all(good, q, k, v, dout, 0.3, True, None, **dict(features, attn_bias=features["attn_bias"].detach()))
    with pytest.raises(ValueError, match="5 or 7|entries"):
        judge_all(good[:6], q, k, v, dout, 0.3, True, None, **features)
    with pytest.raises(TypeError, match="unknown feature"):
        judge_all(good[:5], q, k, v, dout, 0.3, True, None, bias=features["attn_bias"])


def test_reference_fwd_bwd_grads(gen):
    q, k, v, dout, features = judge_case(gen, F64)
    features = dict(features, attn_bias=features["attn_bias"].detach().double().requires_grad_(),
                    sinks=features["sinks"].double())
    out, lse, dq, dk, dv, dbias, dsinks = reference_fwd_bwd(q, k, v, dout, 0.3, True, None, **features)
    assert dbias.shape == features["attn_bias"].shape and dsinks.shape == features["sinks"].shape
    assert features["attn_bias"].grad is None                                # the caller's tensors are untouched
    no_grad_bias = reference_fwd_bwd(q, k, v, dout, 0.3, True, None,
                                     **dict(features, attn_bias=features["attn_bias"].detach()))
    assert no_grad_bias[5] is None
    torch.testing.assert_close(no_grad_bias[:5], (out, lse, dq, dk, dv), **F64_TOL)


# ---------------------------------------------------------------------------------------------------- feature errors


def _qkv():
    return _t(2, 4, 2, 8), _t(2, 6, 1, 8), _t(2, 6, 1, 8)                    # B 2, Sq 4, Sk 6, Hq 2, Hk 1


BAD_FEATURES = [
    pytest.param(dict(softcap=-1.0), ValueError, "softcap", id="softcap-negative"),
    pytest.param(dict(softcap="1"), TypeError, "softcap", id="softcap-str"),
    pytest.param(dict(softcap=float("nan")), ValueError, "softcap", id="softcap-nan"),
    pytest.param(dict(dropout_p=1.0, dropout_mask=torch.ones(2, 2, 4, 6, dtype=torch.bool)), ValueError,
                 "dropout_p", id="dropout-p-1"),
    pytest.param(dict(dropout_p=-0.1), ValueError, "dropout_p", id="dropout-p-negative"),
    pytest.param(dict(dropout_p=0.1), ValueError, "needs dropout_mask", id="dropout-without-mask"),
    pytest.param(dict(dropout_p=0.1, dropout_mask=torch.ones(2, 2, 4, 5, dtype=torch.bool)), ValueError,
                 "dropout_mask has shape", id="dropout-mask-shape"),
    pytest.param(dict(dropout_p=0.1, dropout_mask=torch.ones(2, 2, 4, 6)), TypeError, "torch.bool",
                 id="dropout-mask-float"),
    pytest.param(dict(window_size=(-2, 0)), ValueError, "window_size", id="window-below-minus-1"),
    pytest.param(dict(window_size=(1.5, 0)), TypeError, "not an int", id="window-float"),
    pytest.param(dict(window_size=(True, 0)), TypeError, "not an int", id="window-bool"),
    pytest.param(dict(window_size=3), TypeError, "pair", id="window-not-pair"),
    pytest.param(dict(window_size=(1, 2, 3)), TypeError, "pair", id="window-triple"),
    pytest.param(dict(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes has shape", id="slopes-shape"),
    pytest.param(dict(alibi_slopes=torch.ones(2, 2, 1)), ValueError, "alibi_slopes", id="slopes-3d"),
    pytest.param(dict(alibi_slopes=torch.ones(2, dtype=torch.int32)), TypeError, "alibi_slopes", id="slopes-int"),
    pytest.param(dict(attn_bias=torch.ones(4, 5)), ValueError, "does not broadcast", id="bias-shape"),
    pytest.param(dict(attn_bias=torch.ones(1, 2, 2, 4, 6)), ValueError, "does not broadcast", id="bias-5d"),
    pytest.param(dict(attn_bias=torch.ones(4, 6, dtype=torch.bool)), TypeError, "attn_bias", id="bias-bool"),
    pytest.param(dict(attn_bias=[[0.0]]), TypeError, "attn_bias", id="bias-list"),
    pytest.param(dict(attn_mask=torch.ones(4, 6)), TypeError, "attn_bias instead", id="mask-float"),
    pytest.param(dict(attn_mask=torch.ones(3, 4, 6, dtype=torch.bool)), ValueError, "does not broadcast",
                 id="mask-shape"),
    pytest.param(dict(sinks=torch.ones(1)), ValueError, "sinks has shape", id="sinks-shape"),
    pytest.param(dict(sinks=torch.ones(2, dtype=torch.int64)), TypeError, "sinks", id="sinks-int"),
    pytest.param(dict(window_size=(1, 1), diagonal_offset=0.5), TypeError, "diagonal_offset",
                 id="window-float-offset"),
]


@pytest.mark.parametrize("kwargs, error, match", BAD_FEATURES)
def test_naive_rejects_bad_features(kwargs, error, match):
    with pytest.raises(error, match=match):
        naive_attention(*_qkv(), **kwargs)


BAD_VARLEN = [
    pytest.param(dict(q=_t(1, 4, 2, 8)), {}, ValueError, "3 dims", id="q-4d"),
    pytest.param(dict(cu_q=torch.tensor([0, 4])), {}, TypeError, "int32", id="cu-int64"),
    pytest.param(dict(cu_q=torch.tensor([0, 3], dtype=torch.int32)), {}, ValueError, "end at", id="cu-short"),
    pytest.param(dict(cu_q=torch.tensor([0, 5, 4], dtype=torch.int32)), {}, ValueError, "never decrease",
                 id="cu-decreasing"),
    pytest.param(dict(cu_q=torch.tensor([0, 2, 4], dtype=torch.int32)), {}, ValueError, "batch \\+ 1",
                 id="cu-lengths-differ"),
    pytest.param({}, dict(attn_bias=_t(4, 6)), ValueError, "attn_bias is not supported", id="bias"),
    pytest.param({}, dict(attn_mask=torch.ones(4, 6, dtype=torch.bool)), ValueError, "attn_mask is not supported",
                 id="mask"),
    pytest.param({}, dict(dropout_p=0.1), ValueError, "dropout_p", id="dropout"),
    pytest.param({}, dict(alibi_slopes=torch.ones(3, 2)), ValueError, "alibi_slopes", id="slopes-batch"),
]


@pytest.mark.parametrize("inputs, kwargs, error, match", BAD_VARLEN)
def test_varlen_rejects_bad_inputs(inputs, kwargs, error, match):
    q, k = inputs.get("q", _t(4, 2, 8)), _t(6, 1, 8)
    cu_q, cu_k = inputs.get("cu_q", torch.tensor([0, 4], dtype=torch.int32)), torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(error, match=match):
        naive_attention_varlen(q, k, k, cu_q, cu_k, **kwargs)
