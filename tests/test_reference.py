"""Tests of the pure-PyTorch reference ladder (flashtile.reference) against independent float64 computations."""

import math
import zlib

import pytest
import torch
import torch.nn.functional as F

from flashtile.reference import (attention_backward, causal_mask, merge_partials, naive_attention, online_softmax,
                                 online_softmax_states, safe_softmax, tiled_attention_backward, tiled_attention_fa1,
                                 tiled_attention_fa2)

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


def test_online_softmax_rejects_2d():
    with pytest.raises(ValueError, match="1-D"):
        online_softmax_states(_t(2, 3))
    with pytest.raises(ValueError, match="1-D"):
        online_softmax(_t(2, 3))
