"""The forward and backward kernels against the float64 reference, through the public API and its autograd.

On the CPU they run in Triton's interpreter (conftest.py); on a GPU the same tests run compiled.
Every test draws fresh random inputs and NaN-poisons every buffer the kernels allocate.
"""
import itertools
import random

import pytest
import torch

import flashtile
from flashtile._settings import SETTINGS
from flashtile.kernels import configs
from flashtile.kernels.configs import TileConfig

from flashtile.testing import check_against_reference, cu_seqlens, make_qkv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SEQLENS = (1, 17, 64, 129, 257)
HEAD_DIMS = (16, 40, 64, 96, 128, 256)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_GROUPS = ((2, 2), (8, 2), (3, 1))  # (Hq, Hk): plain, GQA ratio 4, all query heads on one kv head
DTYPE_IDS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def _case_id(b, sq, sk, h, hk, d, causal, dtype):
    return f"B{b}-Sq{sq}-Sk{sk}-H{h}-Hk{hk}-D{d}-{'causal' if causal else 'full'}-{DTYPE_IDS[dtype]}"


def _run(q, k, v, dout, causal, softmax_scale=None, dlse=None):
    """flashtile forward + backward through autograd: (out, lse, dq, dk, dv)."""
    out, lse, _ = flashtile.flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                            return_attn_probs=True)
    loss = (out * dout).sum()
    if dlse is not None:
        loss = loss + (lse * dlse).sum()
    dq, dk, dv = torch.autograd.grad(loss, (q, k, v))
    return out.detach(), lse.detach(), dq, dk, dv


def _check(b, sq, sk, h, hk, d, causal, dtype, seed, dlse=False):
    q, k, v = make_qkv(b, sq, sk, h, hk, d, dtype, device=DEVICE, seed=seed)
    gen = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    dout = torch.randn(q.shape, generator=gen, device=DEVICE).to(dtype)
    g_lse = torch.randn((b, h, sq), generator=gen, device=DEVICE) if dlse else None
    scale = d ** -0.5
    got = _run(q, k, v, dout, causal, dlse=g_lse)
    check_against_reference(got, q.detach(), k.detach(), v.detach(), dout, scale, causal, sk - sq, dlse=g_lse)


def _shape_cases():
    """Every (Sq, Sk) pair in both orders, causal and not; head dim, dtype, head grouping and batch drawn per case
    (seeded) so that the pairs also cover those axes. The full head-dim x dtype product is test_head_dims."""
    pick = random.Random(20261121)
    cases = []
    for sq in SEQLENS:
        for sk in SEQLENS:
            for causal in (False, True):
                d, dtype = pick.choice(HEAD_DIMS), pick.choice(DTYPES)
                (h, hk) = pick.choice(HEAD_GROUPS)
                # The interpreter's cost grows with batch * heads; batch 2 only where there are few heads.
                b = pick.choice((1, 2)) if h <= 3 else 1
                cases.append(pytest.param(b, sq, sk, h, hk, d, causal, dtype,
                                          id=_case_id(b, sq, sk, h, hk, d, causal, dtype)))
    return cases


@pytest.mark.parametrize("b,sq,sk,h,hk,d,causal,dtype", _shape_cases())
def test_shapes(poison, b, sq, sk, h, hk, d, causal, dtype):
    _check(b, sq, sk, h, hk, d, causal, dtype, seed=sq * 1000 + sk)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_head_dims(poison, d, dtype, causal):
    h, hk = HEAD_GROUPS[HEAD_DIMS.index(d) % len(HEAD_GROUPS)]
    _check(1, 63, 129, h, hk, d, causal, dtype, seed=d)


@pytest.mark.parametrize("d", (8, 24, 72, 200), ids=lambda d: f"D{d}")
def test_other_head_dims(poison, d):
    """Any multiple of 8 up to 256: padded to a power-of-two tile, the padding never leaks."""
    _check(1, 33, 47, 2, 1, d, True, torch.float16, seed=d)


@pytest.mark.parametrize("tiles", [TileConfig(32, 16, 4, 1), TileConfig(16, 32, 4, 1)],
                         ids=("M32-N16", "M16-N32"))
@pytest.mark.parametrize("sq,sk", [(70, 45), (45, 70), (64, 64)])
def test_causal_stages_small_tiles(poison, monkeypatch, tiles, sq, sk):
    """Small, unequal tiles put many blocks on each side of the diagonal: the unmasked stage, the masked diagonal
    stage and the skipped blocks all occur, for both signs of Sk - Sq."""
    monkeypatch.setattr(SETTINGS, "tiles", [tiles])
    monkeypatch.setattr(configs, "_CHOSEN", {})
    _check(1, sq, sk, 4, 2, 32, True, torch.float32, seed=sq + sk)


@pytest.mark.parametrize("b,sq,sk,h,hk,d,causal,dtype", [
    pytest.param(2, 17, 129, 4, 2, 40, False, torch.float16, id="B2-Sq17-Sk129-H4-Hk2-D40-full-fp16"),
    pytest.param(1, 129, 64, 3, 1, 64, True, torch.bfloat16, id="B1-Sq129-Sk64-H3-Hk1-D64-causal-bf16"),
    pytest.param(1, 100, 257, 4, 4, 96, True, torch.float32, id="B1-Sq100-Sk257-H4-Hk4-D96-causal-fp32"),
])
def test_tma_path(poison, monkeypatch, b, sq, sk, h, hk, d, causal, dtype):
    """The tensor-descriptor path (what Hopper runs), forced on: zero-filled edges must behave like masked loads."""
    monkeypatch.setattr(SETTINGS, "tma", True)
    _check(b, sq, sk, h, hk, d, causal, dtype, seed=7)


@pytest.mark.parametrize("use_tma", (False, True), ids=("pointers", "tma"))
def test_strided_inputs(poison, monkeypatch, use_tma):
    """q, k, v as slices of one packed (B, S, 3, H, D) tensor: only the last dimension is contiguous."""
    monkeypatch.setattr(SETTINGS, "tma", use_tma)
    b, s, h, d = 2, 37, 4, 32
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    qkv = torch.randn((b, s, 3, h, d), generator=gen, device=DEVICE).to(torch.float16)
    q, k, v = (qkv[:, :, i].requires_grad_() for i in range(3))
    dout = torch.randn((b, s, h, d), generator=gen, device=DEVICE).to(torch.float16)
    got = _run(q, k, v, dout, causal=True)
    check_against_reference(got, q.detach(), k.detach(), v.detach(), dout, d ** -0.5, True, 0)


def test_lse_gradient(poison):
    """A loss that uses the returned LSE gets its gradient (folded into the backward's delta)."""
    _check(2, 65, 33, 4, 2, 32, True, torch.float32, seed=11, dlse=True)


def test_fully_masked_rows_are_zero(poison):
    """Causal with Sq > Sk: the first Sq - Sk rows see no key. Output 0, LSE -inf, gradients 0, nothing NaN."""
    sq, sk = 129, 17
    q, k, v = make_qkv(1, sq, sk, 2, 1, 32, torch.float16, device=DEVICE, seed=5)
    dout = torch.randn(q.shape, device=DEVICE).to(torch.float16)
    out, lse, dq, dk, dv = _run(q, k, v, dout, causal=True)
    empty = sq - sk
    assert torch.equal(out[:, :empty], torch.zeros_like(out[:, :empty]))
    assert torch.isneginf(lse[:, :, :empty]).all() and torch.isfinite(lse[:, :, empty:]).all()
    assert torch.equal(dq[:, :empty], torch.zeros_like(dq[:, :empty]))
    for g in (out, dq, dk, dv):
        assert not torch.isnan(g).any()


def test_backward_is_deterministic(poison):
    """No atomics: two backward passes give bit-identical gradients (GQA sums included)."""
    q, k, v = make_qkv(2, 77, 91, 8, 2, 64, torch.bfloat16, device=DEVICE, seed=9)
    dout = torch.randn(q.shape, device=DEVICE).to(torch.bfloat16)
    first = _run(q, k, v, dout, causal=True)[2:]
    second = _run(q, k, v, dout, causal=True)[2:]
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_softmax_scale(poison):
    q, k, v = make_qkv(1, 40, 50, 2, 2, 16, torch.float32, device=DEVICE, seed=13)
    dout = torch.randn(q.shape, device=DEVICE)
    got = _run(q, k, v, dout, causal=False, softmax_scale=0.37)
    check_against_reference(got, q.detach(), k.detach(), v.detach(), dout, 0.37, False, 10)


@pytest.mark.parametrize("scale", (-0.3, 0.0), ids=("negative", "zero"))
def test_nonpositive_softmax_scale(poison, scale):
    """The kernels take the row max before scaling, so they need scale > 0; the API maps other scales exactly."""
    q, k, v = make_qkv(1, 33, 40, 2, 1, 16, torch.float32, device=DEVICE, seed=17)
    dout = torch.randn(q.shape, device=DEVICE)
    got = _run(q, k, v, dout, causal=True, softmax_scale=scale)
    check_against_reference(got, q.detach(), k.detach(), v.detach(), dout, scale, True, 7)


# ---------------------------------------------------------------------------------------------------------------
# The varlen work list of the Hopper forward (a plain Triton kernel: it runs in the interpreter too)
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("block_m,reverse,used", [(64, False, False), (128, True, False), (192, False, False),
                                                  (192, True, False), (128, True, True)])
def test_varlen_tile_map(block_m, reverse, used):
    """Every query tile of every sequence listed once, in sequence order, with its sequence's bounds; rows past
    the last tile carry sequence -1. 150 sequences: more than one chunk of the kernel's count. used: a paged
    batch's key counts (seqused_k) give Sk, k_start 0, and cu_seqlens_k is not read."""
    from flashtile.kernels.hopper_fwd import varlen_tile_map
    rng = random.Random(block_m + reverse)
    lens_q = [rng.choice([0, 1, 63, 64, 65, 191, 192, 193, rng.randrange(400)]) for _ in range(150)]
    lens_k = [rng.randrange(300) for _ in range(150)]
    cu_q, cu_k = cu_seqlens(lens_q, DEVICE), cu_seqlens(lens_k, DEVICE)
    seqused = torch.tensor(lens_k, dtype=torch.int32, device=DEVICE) if used else None
    tile_map, n_upper = varlen_tile_map(cu_q, torch.full_like(cu_k, -7) if used else cu_k, sum(lens_q), block_m,
                                        reverse, seqused)
    expect = []
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        n = -(-lq // block_m)
        for m in (reversed(range(n)) if reverse else range(n)):
            expect.append([b, m * block_m, int(cu_q[b]), lq, 0 if used else int(cu_k[b]), lk, 0, 0])
    assert n_upper >= len(expect)
    got = tile_map.cpu().tolist()
    assert got[:len(expect)] == expect
    assert all(row[0] == -1 for row in got[len(expect):])


def test_three_warpgroups_fill():
    """The plain d64 forward's consumers by query length (hopper_fwd.three_warpgroups_fill): two warpgroups' 128-row
    tiles where three's 192-row tiles would leave a head's last tile mostly empty (1k: its sixth tile holds 64 rows),
    three where 192 divides Sq or the last tile is nearly full."""
    from flashtile.kernels import hopper_fwd
    assert not any(hopper_fwd.three_warpgroups_fill(s) for s in (1, 100, 128, 256, 512, 1000, 1024))
    assert all(hopper_fwd.three_warpgroups_fill(s) for s in (0, 190, 192, 384, 1536, 2048, 3000, 4096, 16384))


@pytest.mark.parametrize("d, path, pad_d, qk_width", [
    (64, 64, 0, 64), (48, 64, 64, 64), (72, 96, 96, 128), (96, 96, 96, 128), (112, 128, 128, 128), (128, 128, 0, 128),
    (136, 192, 192, 192), (192, 192, 192, 192), (224, 256, 256, 256), (256, 256, 0, 256)])
def test_forward_head_dim_paths(monkeypatch, d, path, pad_d, qk_width):
    """Which path of the Gluon forward a head dim takes (hopper_fwd.kernel_dim: the next of TILE_DIM's keys), as the
    plan's constexprs say it: PAD_D, 0 where the head dim fills its tile, else the path (d96's sums Q K^T over 96
    columns, d192's takes Q and K in 64-column chunks and P V over 192: FwdConfig), HEAD_DIM the width of Q and K in
    shared memory, HEAD_DIM_V the tile's."""
    from flashtile import dispatch
    from flashtile.kernels import hopper_fwd
    from flashtile.request import AttentionRequest
    if not hopper_fwd.AVAILABLE:
        pytest.skip("Gluon is not importable here")
    monkeypatch.setattr(hopper_fwd, "_num_sms", lambda device_index: 132)
    q, k, v = (torch.empty(1, 256, 2, d, dtype=torch.bfloat16) for _ in range(3))
    plan = hopper_fwd._fwd_plan(q, k, v, AttentionRequest(softmax_scale=d ** -0.5, window_right=0), torch.bfloat16)
    constexprs = plan.launch.constexprs
    assert hopper_fwd.kernel_dim(d) == path and dispatch.gluon_head_dim(d)
    assert constexprs["PAD_D"] == pad_d and constexprs["HEAD_DIM"] == qk_width
    assert constexprs["HEAD_DIM_V"] == hopper_fwd.tile_dim(d) == hopper_fwd.TILE_DIM[path]


@pytest.mark.parametrize("d, dv, owners, halves", [(192, 128, False, True), (192, 192, True, False),
                                                   (256, 256, False, False), (128, 128, False, False),
                                                   (160, 160, True, False), (136, 136, True, False),
                                                   (224, 224, False, False), (112, 112, False, False)])
def test_wide_backward_roles(d, dv, owners, halves):
    """Which Gluon backward launches split dK and dV by owner and keep K in registers (hopper_bwd.WIDE_OWNERS,
    WIDE_K_REGS: d192), which take d256's roles, and which run 128-key blocks in 32-query halves (HALVES_DIMS: MLA's
    192/128, on 128-key blocks); the plan is built without a launch (one program per item past the persistent
    grid's bound, so no GPU is asked for its SM count). Head dims between the kernels' take the next one's path
    (hopper_fwd.kernel_dim): d136 and d160 d192's, d224 d256's, d112 d128's."""
    from flashtile.kernels import hopper_bwd, hopper_fwd
    from flashtile.request import AttentionRequest
    if not hopper_bwd.AVAILABLE:
        pytest.skip("Gluon is not importable here")
    b, s, h = 1, hopper_bwd.PERSISTENT_MAX_SEQLEN_K + 1, 2
    q, k = (torch.empty(b, s, h, d, dtype=torch.bfloat16) for _ in range(2))
    v, dout = (torch.empty(b, s, h, dv, dtype=torch.bfloat16) for _ in range(2))
    req = AttentionRequest(softmax_scale=d ** -0.5, window_right=0)
    pad = -(-s // 128) * 128  # (the preprocess's rows: backward.ROW_PAD)
    plan = hopper_bwd.gluon_plan(q, k, v, dout, (None, None, None), (b, h, pad), req, False)
    constexprs = plan.launch.constexprs
    assert not plan.persistent
    assert constexprs["OWNERS"] is owners and constexprs["K_REGS"] is owners
    assert constexprs["ROLES"] is (hopper_fwd.kernel_dim(d) == 256)
    assert constexprs["HALVES"] is halves
    tile = hopper_fwd.tile_dim(d)
    assert constexprs["BLOCK_N"] == (128 if halves else hopper_bwd.BLOCK_NS[tile])
    assert plan.launch.grid == (-(-s // constexprs["BLOCK_N"]), b * h, 1)
    assert constexprs["HEAD_DIM"] == tile and constexprs["D"] == d and constexprs["D_V"] == dv
    # The fixed-length dQ buffer: three [64, 64] shares per 64 query rows on d192's path and MLA's, not the tile's
    # four.
    assert plan.acc_shape == (b * h * pad * (192 if 128 < d <= 192 else tile) // 256, 256)


@pytest.mark.parametrize("d, dv, band, bias, skips", [
    (128, 128, "causal", 0, True), (96, 96, "causal", 0, True), (128, 128, "left", 0, True),
    (128, 128, None, 0, False), (128, 128, "causal", 1, False), (128, 128, "causal", 2, False),
    (64, 64, "causal", 0, False), (256, 256, "causal", 0, False), (192, 128, "causal", 0, False)])
def test_backward_skips_dead_warpgroups_on_d128_tiles(d, dv, band, bias, skips):
    """Which Gluon backward kernels let a warpgroup skip a masked tile that sees none of its keys (BwdConfig's
    SKIP_DEAD, hopper_bwd._dead_keys): banded calls on d128's tiles (d96, d128) without an attn_mask; not d64 (whose
    kernels stay as they were measured), d192/d256 (WIDE) or MLA (HALVES), nor calls without a band."""
    from flashtile.kernels import hopper_bwd
    if not hopper_bwd.AVAILABLE:
        pytest.skip("Gluon is not importable here")
    from flashtile.kernels._gluon import gl
    tile = hopper_bwd.TILE_DIM[d]
    cfg = hopper_bwd.BwdConfig(tile, hopper_bwd.BLOCK_M[tile], 128, hopper_bwd.STAGES, band == "left",
                               band == "causal", False, False, bias, False, False, False, True, d, dv, gl.bfloat16,
                               HALVES=(d, dv) == (192, 128))
    assert bool(cfg.SKIP_DEAD.value) is skips


# ---------------------------------------------------------------------------------------------------------------
# The Hopper backward's dQ tile buffer, put back in dQ's layout (a plain Triton kernel: it runs in the interpreter)
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256, 48, 80, 112, 136, 224])
def test_dq_from_tiles(head_dim):
    """hopper_bwd.dq_from_tiles against the buffer's layout written out with torch views: per (batch, head) and
    query tile of BLOCK_M rows, [64, 64] shares (two column shares at d128, three at d192, four at d256, two row
    shares at d64), each stored in the order [i, j, w, r, q, e] of row w*16 + i*8 + r, column j*8 + q*2 + e
    (hopper_bwd._stage_dq). Rows past Sq are padding and must not be written; values are bf16-exact so the cast is
    exact. d96 runs d128's tiles (hopper_bwd.TILE_DIM): its columns from 96 on must not be written either (in a
    contiguous dq they would land on the next head's first columns); d192's buffer holds its three shares only
    (hopper_bwd.dq_width). Other head dims take the next kernel head dim's buffer (hopper_fwd.kernel_dim), their
    columns past the head dim unwritten the same way (d48 on d64's rows of 64 columns, d136 on d192's shares)."""
    from flashtile.kernels import hopper_bwd, hopper_fwd
    batch, heads, seqlen_q, seqlen_q_pad = 2, 3, 200, 256
    tile_dim = hopper_bwd.dq_width(head_dim)
    block_m = hopper_bwd.BLOCK_M[hopper_fwd.tile_dim(head_dim)]
    n_tiles = seqlen_q_pad // block_m
    n_shares = block_m * tile_dim // 4096
    acc = torch.randn(batch * heads * seqlen_q_pad * tile_dim // 256, 256, device=DEVICE)
    acc = acc.to(torch.bfloat16).float()
    shares = acc.view(batch, heads, n_tiles, n_shares, 2, 8, 4, 8, 4, 2).permute(0, 1, 2, 3, 6, 4, 7, 5, 8, 9)
    shares = shares.reshape(batch, heads, n_tiles, n_shares, 64, 64)
    if block_m == 64:
        full = shares.permute(0, 1, 2, 4, 3, 5).reshape(batch, heads, seqlen_q_pad, tile_dim)[..., :head_dim]
    else:
        full = shares.reshape(batch, heads, seqlen_q_pad, 64)[..., :head_dim]
    expect = full[:, :, :seqlen_q].permute(0, 2, 1, 3).to(torch.bfloat16)
    dq = torch.full((batch, seqlen_q, heads, head_dim), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    hopper_bwd.dq_from_tiles(acc, dq, seqlen_q_pad)
    assert torch.equal(dq, expect)
    # With an addend (the ring's running dQ, here rows of a wider tensor): the tile plus the addend, summed in
    # float32 and stored in dq's dtype (float32 here, so the expected sum is exact in torch too).
    wide = torch.randn(batch, seqlen_q, heads, 2 * head_dim, device=DEVICE)
    addend = wide[..., head_dim:]
    dq32 = torch.full((batch, seqlen_q, heads, head_dim), float("nan"), device=DEVICE)
    hopper_bwd.dq_from_tiles(acc, dq32, seqlen_q_pad, addend)
    assert torch.equal(dq32, full[:, :, :seqlen_q].permute(0, 2, 1, 3) + addend)


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256, 80, 160])
def test_preprocess_zeroes_dq_buffer(head_dim):
    """The backward's preprocess with the Gluon kernel's fixed-length dQ buffer (zero_width > 0): every row of the
    buffer, padding included, comes out 0 (the kernel adds into it), and its Rows are those of the preprocess
    without a buffer. Buffer and rows start poisoned with NaN."""
    import triton
    from flashtile.kernels import _launch, backward, hopper_bwd
    batch, heads, seqlen_q, head_dim_v = 2, 3, 200, head_dim
    pad = 256
    tile_dim = hopper_bwd.dq_width(head_dim)
    out = torch.randn(batch, seqlen_q, heads, head_dim_v, device=DEVICE).to(torch.bfloat16)
    dout = torch.randn_like(out)
    lse = torch.randn(batch, heads, seqlen_q, device=DEVICE)
    results = []
    for zero_width in (tile_dim, 0):
        rows = backward.Rows(torch.full((batch, heads, pad), float("nan"), device=DEVICE),
                             torch.full((batch, heads, pad), float("nan"), device=DEVICE), pad)
        acc = torch.full((batch * heads * pad * tile_dim // 256, 256), float("nan"), device=DEVICE)
        launch = backward._preprocess_launch(out, dout, lse, None, False, seqlen_q, batch, 0.5,
                                             triton.next_power_of_2(head_dim_v), pad,
                                             zero_width)
        launch(_launch.stream_for(out.get_device()), out, dout, lse, lse, rows, lse, acc if zero_width else lse)
        results.append((rows, acc))
    (rows, acc), (plain, untouched) = results
    assert torch.equal(acc, torch.zeros_like(acc))
    assert torch.isnan(untouched).all()  # without a width the buffer is a placeholder, never written
    assert torch.equal(rows.lse_log2, plain.lse_log2) and torch.equal(rows.delta, plain.delta)
    delta = (out.float() * dout.float()).sum(-1).transpose(1, 2) * 0.5
    torch.testing.assert_close(rows.delta[..., :seqlen_q], delta)


@pytest.mark.parametrize("lens, max_seqlen, total", [
    pytest.param([50, 0, 120], 120, 170, id="valid"),
    pytest.param([50, 0, 120], 120, 200, id="rows-past-the-last-sequence"),
    pytest.param([50, 300], 40, 350, id="lengths-past-max_seqlen"),
    pytest.param([1], 1, 1, id="one-row"),
])
def test_preprocess_zeroes_varlen_dq_buffer(lens, max_seqlen, total):
    """The varlen preprocess zeroes the Gluon kernel's whole dQ buffer ([total_q, heads, tile width]), rows that no
    sequence owns included (their dQ is copied out too), and leaves its Rows as without the buffer. Buffer and rows
    start poisoned with NaN."""
    from flashtile.kernels import _launch, backward
    heads, head_dim, tile = 3, 96, 128
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device=DEVICE)
    batch, pad = len(lens), 128 * -(-max_seqlen // 128)
    out = torch.randn(total, heads, head_dim, device=DEVICE).to(torch.bfloat16)
    dout, lse = torch.randn_like(out), torch.randn(heads, total, device=DEVICE)
    results = []
    for zero_width in (tile, 0):
        rows = backward.Rows(torch.full((batch, heads, pad), float("nan"), device=DEVICE),
                             torch.full((batch, heads, pad), float("nan"), device=DEVICE), pad)
        acc = torch.full((total, heads, tile), float("nan"), device=DEVICE)
        launch = backward._preprocess_launch(out, dout, lse, None, True, max_seqlen, batch, 0.5, tile, pad, zero_width)
        launch(_launch.stream_for(out.get_device()), out, dout, lse, lse, rows, cu, acc if zero_width else lse)
        results.append((rows, acc))
    (rows, acc), (plain, untouched) = results
    assert torch.equal(acc, torch.zeros_like(acc))
    assert torch.isnan(untouched).all()
    for a, b in ((rows.lse_log2, plain.lse_log2), (rows.delta, plain.delta)):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())


def test_interpreter_scalar_index():
    """The interpreter's scalars convert to int (range bounds) whatever the shape of their one-element data: Triton
    3.6's own `__index__`, `int(data)`, fails on the (1,) arrays of kernel arguments under NumPy 2.4. Run over a
    stand-in of 3.6's tensor patch, the wrapper must leave the element's `__index__` in place during the run and
    the original after it."""
    np = pytest.importorskip("numpy")
    from flashtile.kernels import _common
    interpreter = pytest.importorskip("triton.runtime.interpreter")

    class Handle:
        def __init__(self, data):
            self.data = data

    class Scalar:
        def __init__(self, data):
            self.handle = Handle(data)

    def patch_of_triton_36(tensor, scope):  # what Triton 3.6's _patch_lang_tensor sets
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))

    saved = interpreter._patch_lang_tensor
    interpreter._patch_lang_tensor = patch_of_triton_36
    try:
        _common._patch_interpreter_index()
        scope = interpreter._LangPatchScope()
        interpreter._patch_lang_tensor(Scalar, scope)
        assert [range(Scalar(np.array(a, np.int32)))[-1] for a in ([7], 5, [[3]])] == [6, 4, 2]
        scope.restore()
        assert not hasattr(Scalar, "__index__")
    finally:
        interpreter._patch_lang_tensor = saved
