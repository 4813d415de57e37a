"""Every attention feature of the kernels against the float64 reference: sliding windows, softcap, ALiBi, float
biases and bool masks (with their gradient), sinks (with theirs), dropout, variable-length and packed inputs, MLA
and head dims to 512, and their combinations.

On the CPU they run in Triton's interpreter (conftest.py); on a GPU the same tests run compiled. Every buffer the
kernels allocate is NaN-poisoned, and each result is judged by flashtile.testing: error <= 3x plain PyTorch's
error in the same dtype + rounding, against float64.
"""
import pytest
import torch

import flashtile
from flashtile._settings import SETTINGS
from flashtile.kernels import configs
from flashtile.kernels.configs import TileConfig
from flashtile.request import AttentionRequest
from flashtile.kernels.features import Features
from flashtile.reference import naive_attention
from flashtile.reference.dropout import dropout_mask
from flashtile.testing import check_against_reference, check_varlen_against_reference, cu_seqlens, make_qkv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE_IDS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def _gen(seed):
    return torch.Generator(device=DEVICE).manual_seed(seed)


def _dout(q, seed, dv=None):
    shape = q.shape if dv is None else q.shape[:-1] + (dv,)
    return torch.randn(shape, generator=_gen(seed), device=DEVICE).to(q.dtype)


def _flash(q, k, v, dout, extra_grads=(), **kw):
    """flash_attn_func forward + backward: (out, lse, dq, dk, dv, *extra grads)."""
    out, lse, _ = flashtile.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    grads = torch.autograd.grad((out * dout).sum(), [q, k, v, *extra_grads])
    return (out.detach(), lse.detach(), *grads)


def _check_flash(b, sq, sk, h, hk, d, dtype, seed, causal=False, window=(-1, -1), softcap=0.0, alibi=None,
                 sinks=False, dv=None):
    q, k, v = make_qkv(b, sq, sk, h, hk, d, dtype, device=DEVICE, seed=seed)
    if dv is not None:
        v = torch.randn((b, sk, hk, dv), generator=_gen(seed + 2), device=DEVICE).to(dtype).requires_grad_()
    dout = _dout(q, seed + 1, dv)
    slopes = None
    if alibi is not None:
        slopes = torch.rand(alibi(b, h), generator=_gen(seed + 3), device=DEVICE)
    sink = None
    if sinks:
        sink = torch.randn(h, generator=_gen(seed + 4), device=DEVICE).requires_grad_()
    got = _flash(q, k, v, dout, extra_grads=[sink] if sinks else [], causal=causal, window_size=window,
                 softcap=softcap, alibi_slopes=slopes, sinks=sink)
    if sinks:
        got = got[:5] + (None, got[5])
    features = dict(window_size=window, softcap=softcap, alibi_slopes=slopes)
    if sinks:
        features["sinks"] = sink.detach()
    check_against_reference(got, q.detach(), k.detach(), v.detach(), dout, d ** -0.5, causal, sk - sq, **features)
    return got


WINDOWS = [
    # (sq, sk, window, causal)
    (64, 64, (16, 0), False),
    (37, 100, (20, 5), False),
    (100, 37, (3, 40), False),
    (70, 70, (-1, 9), False),
    (70, 129, (31, -1), False),
    (50, 90, (10, 10), True),  # causal clips the right side to 0
    (90, 50, (0, 0), False),  # each query sees one key (or none)
]


@pytest.mark.parametrize("sq,sk,window,causal", WINDOWS, ids=[f"Sq{w[0]}-Sk{w[1]}-L{w[2][0]}-R{w[2][1]}"
                                                               f"{'-causal' if w[3] else ''}" for w in WINDOWS])
def test_sliding_window(poison, sq, sk, window, causal):
    dtype = (torch.float16, torch.bfloat16, torch.float32)[(sq + sk) % 3]
    _check_flash(1, sq, sk, 4, 2, 32, dtype, seed=sq * 7 + sk, causal=causal, window=window)


@pytest.mark.parametrize("window", [(0, 0), (5, 3), (20, -1), (-1, 0)], ids=str)
def test_window_stages_small_tiles(poison, monkeypatch, window):
    """Small tiles put many key blocks left of, inside and right of the band: the masked left edge, the unmasked
    middle, the masked right edge and the skipped blocks all occur, with ragged ends."""
    monkeypatch.setattr(SETTINGS, "tiles", [TileConfig(16, 16, 4, 1)])
    monkeypatch.setattr(configs, "_CHOSEN", {})
    _check_flash(1, 75, 61, 2, 1, 16, torch.float32, seed=sum(window) + 40, window=window)


def test_window_skips_blocks(monkeypatch):
    """Blocks outside the band are never loaded: poisoning K and V outside it changes nothing."""
    sq = sk = 128
    q, k, v = make_qkv(1, sq, sk, 2, 2, 16, torch.float32, device=DEVICE, seed=3, grad=False)
    monkeypatch.setattr(SETTINGS, "tiles", [TileConfig(16, 16, 4, 1)])
    monkeypatch.setattr(configs, "_CHOSEN", {})
    window = (8, 0)
    clean = flashtile.flash_attn_func(q, k, v, window_size=window)
    # Query block [112, 128) sees keys >= 104: block [96, 112) is partly seen, everything before 96 is skipped for
    # it; poison keys [0, 64), which only query rows < 72 may see, and compare rows >= 96.
    k2, v2 = k.clone(), v.clone()
    k2[:, :64] = float("nan")
    v2[:, :64] = float("nan")
    poisoned = flashtile.flash_attn_func(q, k2, v2, window_size=window)
    assert torch.equal(poisoned[:, 96:], clean[:, 96:])


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16, torch.float32), ids=DTYPE_IDS.get)
def test_softcap(poison, dtype):
    _check_flash(2, 45, 77, 4, 2, 32, dtype, seed=5, softcap=3.0)


@pytest.mark.parametrize("per_batch", (False, True), ids=("slopes-H", "slopes-BH"))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_alibi(poison, per_batch, causal):
    shape = (lambda b, h: (b, h)) if per_batch else (lambda b, h: (h,))
    _check_flash(2, 50, 33, 4, 1, 32, torch.bfloat16, seed=9 + per_batch, causal=causal, alibi=shape)


def test_sinks(poison):
    """Causal with Sq > Sk: rows that see no key output 0 and their LSE is the sink itself."""
    got = _check_flash(1, 70, 40, 4, 2, 32, torch.float16, seed=13, causal=True, sinks=True)
    out, lse = got[0], got[1]
    assert torch.equal(out[:, :30], torch.zeros_like(out[:, :30]))
    assert torch.isfinite(lse).all()


def test_sinks_full(poison):
    _check_flash(2, 33, 65, 2, 2, 64, torch.float32, seed=17, sinks=True)


def test_combination(poison):
    """causal + window + ALiBi + softcap + sinks at once, GQA, Sq != Sk."""
    _check_flash(1, 67, 90, 6, 2, 48, torch.bfloat16, seed=21, causal=True, window=(25, 10), softcap=4.0,
                 alibi=lambda b, h: (h,), sinks=True)


# ---------------------------------------------------------------------------------------------------------------
# Dropout
# ---------------------------------------------------------------------------------------------------------------

def _seed_drawn_after(manual_seed):
    """The Philox key flashtile draws right after torch.manual_seed(manual_seed) (interface._draw_seed)."""
    torch.manual_seed(manual_seed)
    return int(torch.randint(0, 2 ** 62, (1,), dtype=torch.int64, device=DEVICE).item())


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_dropout_matches_reference_with_the_same_mask(poison, causal):
    b, sq, sk, h, hk, d, p = 2, 41, 66, 4, 2, 32, 0.3
    q, k, v = make_qkv(b, sq, sk, h, hk, d, torch.bfloat16, device=DEVICE, seed=31)
    dout = _dout(q, 32)
    torch.manual_seed(123)
    got = _flash(q, k, v, dout, dropout_p=p, causal=causal)
    mask = dropout_mask(_seed_drawn_after(123), b, h, sq, sk, p, device=DEVICE)
    check_against_reference(got, q.detach(), k.detach(), v.detach(), dout, d ** -0.5, causal, sk - sq,
                            dropout_p=p, dropout_mask=mask)


def test_dropout_fraction_and_reproducibility():
    """The dropped fraction is within 1% of p (S_dmask's negative entries); torch.manual_seed reproduces a run and
    a different seed gives a different mask."""
    p = 0.17
    q, k, v = make_qkv(1, 128, 160, 4, 4, 16, torch.float32, device=DEVICE, seed=1, grad=False)
    torch.manual_seed(7)
    out1, _, s_dmask = flashtile.flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True)
    dropped = (s_dmask < 0).float().mean().item()
    assert abs(dropped - p) < 0.01, dropped
    torch.manual_seed(7)
    out2 = flashtile.flash_attn_func(q, k, v, dropout_p=p)
    assert torch.equal(out1, out2)
    torch.manual_seed(8)
    out3 = flashtile.flash_attn_func(q, k, v, dropout_p=p)
    assert not torch.equal(out1, out3)
    # S_dmask holds the probabilities: |S_dmask| sums to 1 over each row.
    torch.testing.assert_close(s_dmask.abs().sum(-1), torch.ones_like(s_dmask[..., 0]))


def test_dropout_sdpa():
    """SDPA's dropout_p goes through the same kernels (top-left causal)."""
    b, s, h, d, p = 1, 50, 2, 16, 0.25
    q, k, v = make_qkv(b, s, s, h, h, d, torch.float32, device=DEVICE, seed=4, grad=False)
    torch.manual_seed(99)
    out = flashtile.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 dropout_p=p, is_causal=True).transpose(1, 2)
    mask = dropout_mask(_seed_drawn_after(99), b, h, s, s, p, device=DEVICE)
    ref, _ = naive_attention(q.double(), k.double(), v.double(), causal=True, diagonal_offset=0, dropout_p=p,
                             dropout_mask=mask)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# attn_mask: float bias and bool mask through scaled_dot_product_attention
# ---------------------------------------------------------------------------------------------------------------

def _sdpa(q, k, v, dout, mask, extra_grads=()):
    out = flashtile.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 attn_mask=mask, enable_gqa=True).transpose(1, 2)
    grads = torch.autograd.grad((out * dout).sum(), [q, k, v, *extra_grads])
    return out.detach(), grads


BIAS_SHAPES = [(2, 4, 37, 70), (1, 4, 37, 70), (2, 1, 37, 70), (37, 70), (2, 4, 1, 70), (1, 1, 37, 1)]


@pytest.mark.parametrize("shape", BIAS_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_float_bias_with_grad(poison, shape):
    b, sq, sk, h, hk, d = 2, 37, 70, 4, 2, 32
    dtype = torch.bfloat16 if len(shape) == 4 else torch.float16
    q, k, v = make_qkv(b, sq, sk, h, hk, d, dtype, device=DEVICE, seed=len(shape) + sum(shape))
    dout = _dout(q, 3)
    bias = torch.randn(shape, generator=_gen(4), device=DEVICE).to(dtype)
    if shape[-1] > 1:
        bias[..., 5] = float("-inf")  # -inf entries act as a mask
    bias.requires_grad_()
    out, grads = _sdpa(q, k, v, dout, bias, extra_grads=[bias])
    assert grads[3].shape == bias.shape and grads[3].dtype == bias.dtype
    check_against_reference((out, None, *grads[:3], grads[3], None), q.detach(), k.detach(), v.detach(), dout,
                            d ** -0.5, False, 0, attn_bias=bias)


@pytest.mark.parametrize("bias_shape", [(1, 5, 37, 70), (3, 1, 37, 70), (1, 1, 37, 70), (3, 5, 37, 70)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=DTYPE_IDS.get)
def test_dbias_sum_over_broadcast_dims(bias_shape, dtype):
    """backward._reduce_dbias sums dS [B, H, Sq, Sk] (rows padded, as the Gluon backward leaves them) over the
    bias's broadcast batch/head dims in fp32 and rounds once to the bias's dtype: within one ulp of the float64
    sum (Triton's interpreter truncates fp32 -> bf16) plus fp32's rounding of the partial sums, and the same on
    every call."""
    from flashtile.kernels.backward import _reduce_dbias
    full = torch.randn(3, 5, 37, 72, generator=_gen(61), device=DEVICE).to(dtype)[..., :70]
    bias = torch.zeros(bias_shape, dtype=dtype, device=DEVICE)
    out = _reduce_dbias(full, AttentionRequest(1.0, attn_bias=bias))
    assert out.shape == bias.shape and out.dtype == dtype and out.is_contiguous()
    dims = tuple(i for i in range(2) if bias_shape[i] == 1)
    ref = full.double().sum(dim=dims, keepdim=True) if dims else full.double()
    mag = full.double().abs().sum(dim=dims, keepdim=True) if dims else full.double().abs()
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -23
    n_terms = full.shape[0] * full.shape[1]  # at most this many partial sums, each rounded to fp32
    assert ((out.double() - ref).abs() <= ref.abs() * ulp + mag * n_terms * 2.0 ** -24).all()
    assert torch.equal(out, _reduce_dbias(full, AttentionRequest(1.0, attn_bias=bias)))


@pytest.mark.parametrize("shape", [(2, 4, 45, 60), (2, 1, 45, 60), (45, 60)], ids=lambda s: "x".join(map(str, s)))
def test_bool_mask(poison, shape):
    b, sq, sk, h, d = 2, 45, 60, 4, 32
    q, k, v = make_qkv(b, sq, sk, h, h, d, torch.float16, device=DEVICE, seed=51)
    dout = _dout(q, 52)
    mask = torch.rand(shape, generator=_gen(53), device=DEVICE) > 0.4
    mask[..., 7, :] = False  # a row that attends nothing: 0, not NaN
    out, grads = _sdpa(q, k, v, dout, mask)
    check_against_reference((out, None, *grads), q.detach(), k.detach(), v.detach(), dout, d ** -0.5, False, 0,
                            attn_mask=mask)
    assert torch.equal(out[:, 7], torch.zeros_like(out[:, 7]))


def test_mask_tiles_skipped(poison, monkeypatch):
    """Tiles a bool mask hides entirely are skipped (block map), and the result still matches: a block-sparse
    mask (document masking) with small tiles, values poisoned in the skipped tiles' keys for the rows they
    cannot reach."""
    monkeypatch.setattr(SETTINGS, "tiles", [TileConfig(16, 16, 4, 1)])
    monkeypatch.setattr(configs, "_CHOSEN", {})
    s, h, d = 80, 2, 16
    docs = torch.arange(s, device=DEVICE) // 32  # documents of 32 tokens: 0, 0, ..., 1, 1, ..., 2
    mask = (docs[:, None] == docs[None, :]) & (torch.arange(s, device=DEVICE)[None, :]
                                              <= torch.arange(s, device=DEVICE)[:, None])
    q, k, v = make_qkv(1, s, s, h, h, d, torch.float32, device=DEVICE, seed=61)
    dout = _dout(q, 62)
    out, grads = _sdpa(q, k, v, dout, mask)
    check_against_reference((out, None, *grads), q.detach(), k.detach(), v.detach(), dout, d ** -0.5, False, 0,
                            attn_mask=mask)
    v2 = v.detach().clone()
    v2[:, :32] = float("nan")  # document 0's values: only rows < 32 may read them
    out2 = flashtile.scaled_dot_product_attention(q.detach().transpose(1, 2), k.detach().transpose(1, 2),
                                                  v2.transpose(1, 2), attn_mask=mask).transpose(1, 2)
    assert torch.equal(out2[:, 32:], out[:, 32:])


def _naive_block_lists(mask, bm, bn, mark_full):
    """Features.block_lists without the word tricks: per tile, visited iff any element is True (all True and inside
    Sq x Sk: listed as -1 - index with mark_full)."""
    b, h, sq, sk = mask.shape
    nm, nn = -(-sq // bm), -(-sk // bn)
    counts = torch.zeros(b, h, nm, dtype=torch.int32)
    rows = []
    for i in range(b):
        for j in range(h):
            for m in range(nm):
                listed = []
                for n in range(nn):
                    tile = mask[i, j, m * bm:(m + 1) * bm, n * bn:(n + 1) * bn]
                    if tile.any():
                        inside = (m + 1) * bm <= sq and (n + 1) * bn <= sk
                        listed.append(-1 - n if mark_full and inside and tile.all() else n)
                counts[i, j, m] = len(listed)
                rows.append(listed)
    return counts, rows


@pytest.mark.parametrize("sq,sk", [(64, 128), (45, 70)], ids=["tiled", "padded"])
@pytest.mark.parametrize("mark_full", [False, True], ids=["any", "full"])
def test_block_lists_match_tiles(sq, sk, mark_full):
    """The bool mask's tile lists (the words view and its one-pass min/max, or the padded copy) against a tile by
    tile scan: empty, partial and entirely visible tiles, the last ones cut by Sq and Sk."""
    torch.manual_seed(71)
    mask = torch.rand(2, 3, sq, sk) > 0.97  # sparse: some tiles empty
    mask[:, :, :16, :16] = True  # tile (0, 0) entirely visible
    mask[1, 2] = False  # a head that attends nothing
    mask[0, 0, -3:, -5:] = True  # the corner tile, cut by Sq and Sk: never "entirely visible"
    lists = Features(AttentionRequest(1.0, attn_bias=mask)).block_lists(16, 16, False, sq, sk, mark_full=mark_full)
    counts, indices, _, cols = lists
    want_counts, want_rows = _naive_block_lists(mask, 16, 16, mark_full)
    assert torch.equal(counts.cpu(), want_counts)
    got = indices.cpu().reshape(-1, cols)
    for r, listed in enumerate(want_rows):
        assert got[r, :len(listed)].tolist() == listed


def test_block_lists_reused_across_calls():
    """A bool mask's block lists are built once per mask (and per version of it): a second call, through another
    view of the same tensor, reuses them; an in-place write rebuilds them; freeing the mask drops them."""
    from flashtile.kernels import features
    mask = torch.rand(40, 48, generator=torch.Generator().manual_seed(72)) > 0.5
    view = lambda: mask.reshape(1, 1, 40, 48)  # noqa: E731 -- what check_attn_mask hands the kernels
    first = Features(AttentionRequest(1.0, attn_bias=view())).block_lists(16, 16, True, 40, 48)
    again = Features(AttentionRequest(1.0, attn_bias=view())).block_lists(16, 16, True, 40, 48)
    assert again[1] is first[1]
    # another key: its own lists
    other = Features(AttentionRequest(1.0, attn_bias=view())).block_lists(16, 16, False, 40, 48)
    assert other[1] is not first[1]
    mask[:16, :16] = False
    mask[0, 0] = True
    rebuilt = Features(AttentionRequest(1.0, attn_bias=view())).block_lists(16, 16, True, 40, 48)
    assert rebuilt[1] is not first[1]
    want_counts, _ = _naive_block_lists(view().transpose(2, 3), 16, 16, False)
    assert torch.equal(rebuilt[0].cpu(), want_counts)
    mask[:16, :16] = False  # the same lists again, but written since: rebuilt
    assert Features(AttentionRequest(1.0, attn_bias=view())).block_lists(16, 16, True, 40, 48)[0] is not rebuilt[0]
    key = id(mask)
    assert key in features._mask_lists_cache
    mask = None  # the last reference: the mask is freed
    assert key not in features._mask_lists_cache


# ---------------------------------------------------------------------------------------------------------------
# Variable length and packed inputs
# ---------------------------------------------------------------------------------------------------------------

def _varlen_inputs(lens_q, lens_k, h, hk, d, dtype, seed):
    cu_q, cu_k = cu_seqlens(lens_q, DEVICE), cu_seqlens(lens_k, DEVICE)
    q, k, v = make_qkv(1, sum(lens_q), sum(lens_k), h, hk, d, dtype, device=DEVICE, seed=seed, grad=False)
    return [t[0].requires_grad_() for t in (q, k, v)], cu_q, cu_k


VARLEN_CASES = [
    # lens_q, lens_k, causal, window
    ([5, 0, 1, 70, 33], [5, 9, 1, 70, 80], True, (-1, -1)),
    ([17, 64, 3], [40, 64, 0], False, (-1, -1)),
    ([90, 1, 45], [60, 30, 45], True, (12, 0)),
    ([31, 40], [31, 97], False, (20, 7)),
]


@pytest.mark.parametrize("lens_q,lens_k,causal,window", VARLEN_CASES, ids=[f"case{i}" for i in range(4)])
def test_varlen(poison, lens_q, lens_k, causal, window):
    """Ragged batches with sequences of length 0 and 1, GQA, each aligned to its own bottom-right corner."""
    h, hk, d = 4, 2, 32
    (q, k, v), cu_q, cu_k = _varlen_inputs(lens_q, lens_k, h, hk, d, torch.bfloat16, seed=sum(lens_q))
    dout = _dout(q, 71)
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                                   window_size=window, return_attn_probs=True)
    assert lse.shape == (h, q.shape[0])
    grads = torch.autograd.grad((out * dout).sum(), [q, k, v])
    check_varlen_against_reference((out.detach(), lse.detach(), *grads), q, k, v, dout, cu_q, cu_k, causal,
                               window_size=window)


def test_varlen_alibi_softcap(poison):
    lens_q, lens_k = [20, 0, 33], [25, 4, 33]
    (q, k, v), cu_q, cu_k = _varlen_inputs(lens_q, lens_k, 2, 2, 16, torch.float16, seed=3)
    dout = _dout(q, 72)
    slopes = torch.rand((3, 2), generator=_gen(73), device=DEVICE)
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 33, 33, causal=True, softcap=2.0,
                                                   alibi_slopes=slopes, return_attn_probs=True)
    grads = torch.autograd.grad((out * dout).sum(), [q, k, v])
    check_varlen_against_reference((out.detach(), lse.detach(), *grads), q, k, v, dout, cu_q, cu_k, True,
                               alibi_slopes=slopes, softcap=2.0)


def test_varlen_dropout(poison):
    """Sequence b draws the dropout bits of batch entry b (the same counters as a fixed-length batch)."""
    lens = [30, 1, 47]
    p = 0.2
    (q, k, v), cu, _ = _varlen_inputs(lens, lens, 2, 1, 16, torch.float32, seed=5)
    dout = _dout(q, 74)
    torch.manual_seed(11)
    out, lse, s_dmask = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 47, 47, dropout_p=p,
                                                         return_attn_probs=True)
    grads = torch.autograd.grad((out * dout).sum(), [q, k, v])
    seed = _seed_drawn_after(11)
    bounds = cu.tolist()
    assert s_dmask.shape == (3, 2, 47, 47)
    for i in range(3):
        s = slice(bounds[i], bounds[i + 1])
        n = bounds[i + 1] - bounds[i]
        mask = dropout_mask(seed, 1, 2, n, n, p, device=DEVICE, batch_offset=i)
        seq = lambda t: t[s].unsqueeze(0)  # noqa: E731
        check_against_reference((seq(out.detach()), lse.detach()[:, s].unsqueeze(0), *(seq(g) for g in grads)),
                                seq(q).detach(), seq(k).detach(), seq(v).detach(), seq(dout), 16 ** -0.5, False, 0,
                                dropout_p=p, dropout_mask=mask)


def test_qkvpacked_matches_unpacked(poison):
    b, s, h, d = 2, 45, 4, 32
    qkv = torch.randn((b, s, 3, h, d), generator=_gen(81), device=DEVICE).to(torch.float16).requires_grad_()
    dout = torch.randn((b, s, h, d), generator=_gen(82), device=DEVICE).to(torch.float16)
    out = flashtile.flash_attn_qkvpacked_func(qkv, causal=True, window_size=(9, 0))
    (dqkv,) = torch.autograd.grad((out * dout).sum(), [qkv])
    q, k, v = (qkv.detach()[:, :, i].clone().requires_grad_() for i in range(3))
    got = _flash(q, k, v, dout, causal=True, window_size=(9, 0))
    assert torch.equal(out.detach(), got[0])
    assert torch.equal(dqkv, torch.stack(got[2:5], dim=2))


def test_packed_backward_writes_one_tensor():
    """The packed backward op returns one gradient tensor for qkv (and one for kv): no per-slice gradients that
    autograd would have to scatter into a zero-filled copy."""
    b, s, h, d = 1, 20, 2, 16
    qkv = torch.randn((b, s, 3, h, d), device=DEVICE)
    out, lse = torch.ops.flashtile.attn_fwd(qkv, None, None, 0.25)
    grads = torch.ops.flashtile.attn_bwd(torch.randn_like(out), qkv, None, None, out, lse, None, False, 0.25)
    assert len(grads) == 1 and grads[0].shape == qkv.shape and grads[0].is_contiguous()
    q, kv = qkv[:, :, 0].contiguous(), qkv[:, :, 1:].contiguous()
    out, lse = torch.ops.flashtile.attn_fwd(q, kv, None, 0.25)
    grads = torch.ops.flashtile.attn_bwd(torch.randn_like(out), q, kv, None, out, lse, None, False, 0.25)
    assert [g.shape for g in grads] == [q.shape, kv.shape]


def test_kvpacked_gqa(poison):
    b, sq, sk, h, hk, d = 1, 33, 50, 4, 2, 32
    q = torch.randn((b, sq, h, d), generator=_gen(91), device=DEVICE).to(torch.bfloat16).requires_grad_()
    kv = torch.randn((b, sk, 2, hk, d), generator=_gen(92), device=DEVICE).to(torch.bfloat16).requires_grad_()
    dout = _dout(q, 93)
    out = flashtile.flash_attn_kvpacked_func(q, kv, causal=True, softcap=5.0)
    dq, dkv = torch.autograd.grad((out * dout).sum(), [q, kv])
    check_against_reference((out.detach(), None, dq, dkv[:, :, 0], dkv[:, :, 1]), q.detach(),
                            kv.detach()[:, :, 0], kv.detach()[:, :, 1], dout, d ** -0.5, True, sk - sq, softcap=5.0)


def test_varlen_packed(poison):
    lens = [12, 0, 40]
    cu = torch.tensor([0, 12, 12, 52], dtype=torch.int32, device=DEVICE)
    qkv = torch.randn((52, 3, 2, 16), generator=_gen(95), device=DEVICE).to(torch.float16).requires_grad_()
    dout = torch.randn((52, 2, 16), generator=_gen(96), device=DEVICE).to(torch.float16)
    out = flashtile.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), causal=True)
    (dqkv,) = torch.autograd.grad((out * dout).sum(), [qkv])
    q, k, v = (qkv.detach()[:, i].clone().requires_grad_() for i in range(3))
    out2 = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 40, 40, causal=True)
    grads = torch.autograd.grad((out2 * dout).sum(), [q, k, v])
    assert torch.equal(out.detach(), out2.detach())
    assert torch.equal(dqkv, torch.stack(grads, dim=1))
    kv = qkv.detach()[:, 1:].clone().requires_grad_()
    out3 = flashtile.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 40, 40, causal=True)
    (dkv,) = torch.autograd.grad((out3 * dout).sum(), [kv])
    assert torch.equal(dkv, torch.stack(grads[1:], dim=1))


# ---------------------------------------------------------------------------------------------------------------
# Head dims: MLA's unequal q/k and v dims, and up to 512
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("d,dv", [(192, 128), (40, 24), (128, 256)], ids=lambda x: str(x))
def test_unequal_value_head_dim(poison, d, dv):
    _check_flash(1, 29, 41, 2, 1, d, torch.bfloat16, seed=d + dv, causal=True, dv=dv)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=DTYPE_IDS.get)
def test_head_dim_512(poison, dtype):
    _check_flash(1, 20, 37, 2, 1, 512, dtype, seed=512, causal=True)


# ---------------------------------------------------------------------------------------------------------------
# Determinism, compile, errors
# ---------------------------------------------------------------------------------------------------------------

def test_features_backward_deterministic():
    q, k, v = make_qkv(1, 60, 70, 4, 2, 32, torch.bfloat16, device=DEVICE, seed=101)
    bias = torch.randn((1, 4, 60, 70), generator=_gen(102), device=DEVICE).to(torch.bfloat16).requires_grad_()
    dout = _dout(q, 103)
    runs = [_sdpa(q, k, v, dout, bias, extra_grads=[bias])[1] for _ in range(3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


def test_compile_fullgraph_with_features():
    q, k, v = make_qkv(1, 24, 24, 2, 2, 16, torch.float32, device=DEVICE, seed=111)
    sinks = torch.randn(2, device=DEVICE, requires_grad=True)

    def f(q, k, v, sinks):
        return flashtile.flash_attn_func(q, k, v, causal=True, window_size=(6, 0), softcap=3.0, sinks=sinks)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    out = compiled(q, k, v, sinks)
    out.sum().backward()
    torch.testing.assert_close(out, f(q, k, v, sinks))
    assert sinks.grad is not None and q.grad is not None


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(window_size=(4,)), TypeError, "window_size"),
    (dict(window_size=(-2, 0)), ValueError, "window_size"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(dropout_p=1.0), ValueError, "dropout_p"),
    (dict(dropout_p="0.1"), TypeError, "dropout_p"),
    (dict(alibi_slopes="slopes"), TypeError, "alibi_slopes"),
    (dict(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=torch.ones(2, dtype=torch.float64)), TypeError, "float32"),
    (dict(sinks=torch.ones(5)), ValueError, "sinks"),
    (dict(sinks=torch.ones(2, dtype=torch.float16)), TypeError, "float32"),
], ids=lambda x: str(x)[:30] if not isinstance(x, type) else x.__name__)
def test_flash_errors(kwargs, error, match):
    q, k, v = make_qkv(1, 8, 8, 2, 2, 16, torch.float32, device=DEVICE, grad=False)
    kwargs = {name: (val.to(DEVICE) if isinstance(val, torch.Tensor) else val) for name, val in kwargs.items()}
    with pytest.raises(error, match=match):
        flashtile.flash_attn_func(q, k, v, **kwargs)


def test_sdpa_mask_errors():
    q, k, v = (t.transpose(1, 2) for t in make_qkv(2, 8, 9, 2, 2, 16, torch.float32, device=DEVICE, grad=False))
    with pytest.raises(ValueError, match="broadcast"):
        flashtile.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(3, 8, 9, dtype=torch.bool,
                                                                             device=DEVICE))
    with pytest.raises(TypeError, match="bool"):
        flashtile.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(8, 9, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="is_causal"):
        flashtile.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(8, 9, dtype=torch.bool, device=DEVICE),
                                               is_causal=True)


def test_varlen_errors():
    q, k, v = (t[0] for t in make_qkv(1, 10, 10, 2, 2, 16, torch.float32, device=DEVICE, grad=False))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="int32"):
        flashtile.flash_attn_varlen_func(q, k, v, cu.long(), cu, 6, 6)
    with pytest.raises(ValueError, match="3-D"):
        flashtile.flash_attn_varlen_func(q[None], k, v, cu, cu, 6, 6)
    with pytest.raises(TypeError, match="max_seqlen_q"):
        flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 6.0, 6)
    with pytest.raises(ValueError, match="4-D paged cache"):  # block_table takes paged caches (test_paged_prefill)
        flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, block_table=torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="qkv"):
        flashtile.flash_attn_qkvpacked_func(torch.zeros(1, 4, 2, 2, 16, device=DEVICE))


_FALLBACK_SCRIPT = r"""
import warnings
import torch
import flashtile
from flashtile.testing import check_against_reference, make_qkv
warnings.simplefilter("ignore")
q, k, v = make_qkv(2, 20, 30, 4, 2, 16, torch.float32, seed=3)
dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(4))
sinks = torch.randn(4, generator=torch.Generator().manual_seed(5)).requires_grad_()
slopes = torch.rand(4, generator=torch.Generator().manual_seed(6))
kw = dict(causal=True, window_size=(5, 0), softcap=2.0, alibi_slopes=slopes)
out, lse, _ = flashtile.flash_attn_func(q, k, v, sinks=sinks, return_attn_probs=True, **kw)
dq, dk, dv, dsinks = torch.autograd.grad((out * dout).sum(), [q, k, v, sinks])
check_against_reference((out.detach(), lse.detach(), dq, dk, dv, None, dsinks), q.detach(), k.detach(), v.detach(),
                        dout, 0.25, True, 10, window_size=(5, 0), softcap=2.0, alibi_slopes=slopes,
                        sinks=sinks.detach())
bias = torch.randn((1, 4, 20, 30), generator=torch.Generator().manual_seed(7)).requires_grad_()
o = flashtile.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias,
                                           enable_gqa=True).transpose(1, 2)
grads = torch.autograd.grad((o * dout).sum(), [q, k, v, bias])
check_against_reference((o.detach(), None, *grads, None), q.detach(), k.detach(), v.detach(), dout, 0.25, False, 0,
                        attn_bias=bias)
print("fallback ok")
"""


def test_cpu_fallback_runs_the_features():
    """Without the interpreter, CPU tensors run the reference (forward and the dense backward with every
    feature); its results pass the same judge."""
    import os
    import subprocess
    import sys
    if DEVICE != "cpu":
        pytest.skip("the fallback is the CPU path")
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _FALLBACK_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "fallback ok" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize("kind", ("float", "bool"))
def test_mask_tma_path(poison, monkeypatch, kind):
    """attn_mask tiles read through TMA descriptors (what Hopper runs for a full, aligned mask), forced on."""
    monkeypatch.setattr(SETTINGS, "tma", True)
    b, sq, sk, h, d = 2, 50, 64, 2, 32
    q, k, v = make_qkv(b, sq, sk, h, h, d, torch.bfloat16, device=DEVICE, seed=121)
    dout = _dout(q, 122)
    if kind == "float":
        mask = torch.randn((b, h, sq, sk), generator=_gen(123), device=DEVICE).to(torch.bfloat16)
        mask[..., 9] = float("-inf")
        mask.requires_grad_()
        out, grads = _sdpa(q, k, v, dout, mask, extra_grads=[mask])
        check_against_reference((out, None, *grads, None), q.detach(), k.detach(), v.detach(), dout, d ** -0.5,
                                False, 0, attn_bias=mask)
    else:
        mask = torch.rand((b, h, sq, sk), generator=_gen(124), device=DEVICE) > 0.5
        out, grads = _sdpa(q, k, v, dout, mask)
        check_against_reference((out, None, *grads), q.detach(), k.detach(), v.detach(), dout, d ** -0.5, False, 0,
                                attn_mask=mask)


def test_mask_tma_needs_a_row_stride():
    """TMA takes no zero stride: a mask expanded along the queries reads its tiles through pointers, while
    expanded batch and head dims only offset the base and keep the descriptors."""
    rows = torch.ones((1, 1, 1, 64), dtype=torch.bool, device=DEVICE).expand(2, 2, 48, 64)
    assert not Features(AttentionRequest(1.0, attn_bias=rows))._bias_tma_ok(True, 48, 64)
    heads = torch.ones((1, 1, 48, 64), dtype=torch.bool, device=DEVICE).expand(2, 2, 48, 64)
    assert Features(AttentionRequest(1.0, attn_bias=heads))._bias_tma_ok(True, 48, 64)


def test_combination_with_dropout(poison):
    """causal + window + ALiBi + softcap + dropout at once (the issue's combination), GQA, Sq != Sk, against the
    reference given the same Philox mask."""
    b, sq, sk, h, hk, d, p = 1, 45, 70, 4, 2, 32, 0.2
    q, k, v = make_qkv(b, sq, sk, h, hk, d, torch.bfloat16, device=DEVICE, seed=131)
    dout = _dout(q, 132)
    slopes = torch.rand(h, generator=_gen(133), device=DEVICE)
    kw = dict(causal=True, window_size=(20, 0), softcap=5.0, alibi_slopes=slopes, dropout_p=p)
    torch.manual_seed(17)
    got = _flash(q, k, v, dout, **kw)
    mask = dropout_mask(_seed_drawn_after(17), b, h, sq, sk, p, device=DEVICE)
    check_against_reference(got, q.detach(), k.detach(), v.detach(), dout, d ** -0.5, True, sk - sq,
                            window_size=(20, 0), softcap=5.0, alibi_slopes=slopes, dropout_p=p, dropout_mask=mask)
