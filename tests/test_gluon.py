"""The Hopper Gluon kernels (kernels/hopper_fwd.py, hopper_bwd.py) on the GPU: which calls take them, their
results against the float64 oracle with every buffer NaN-poisoned, and against the portable Triton kernels on the
same inputs.

Gluon kernels do not run in Triton's interpreter, so these tests need a Hopper GPU (`pytest -m gpu`).
"""
import pytest
import torch

import flashtile
from flashtile import dispatch
from flashtile._settings import SETTINGS
from flashtile.kernels import hopper_bwd
from flashtile.testing import check_against_reference, make_qkv

# Fixtures spy / bwd_spy / call_counter: tests/conftest.py.
pytestmark = [pytest.mark.gpu, pytest.mark.hopper]
DEVICE = "cuda"


def _fwd_bwd(q, k, v, dout, causal, **kw):
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, **kw)
    dq, dk, dv = torch.autograd.grad((out * dout).sum(), (q, k, v))
    return out.detach(), lse.detach(), dq, dk, dv


SHAPES = [
    # b, sq, sk, h, hk, d, causal, dtype
    (1, 128, 128, 2, 2, 64, False, torch.bfloat16),
    (2, 1000, 1100, 4, 2, 128, True, torch.bfloat16),   # Sk > Sq: the diagonal crosses block edges
    (2, 1100, 1000, 4, 2, 64, True, torch.float16),     # Sq > Sk: the first 100 rows see no key
    (1, 1, 777, 2, 1, 128, False, torch.bfloat16),      # one query row
    (1, 1, 777, 2, 1, 128, True, torch.float16),
    (1, 333, 1, 2, 2, 64, True, torch.float16),         # one key
    (1, 300, 50, 2, 2, 128, False, torch.bfloat16),     # fewer keys than one block
    (3, 257, 513, 3, 1, 128, False, torch.float16),
    (2, 64, 4096, 2, 2, 128, True, torch.bfloat16),
    (1, 2048, 2048, 8, 2, 64, False, torch.bfloat16),
    (1, 4096, 4096, 4, 4, 128, True, torch.bfloat16),
    (1, 4096, 4096, 4, 4, 64, True, torch.float16),
    # More work items than SMs: each program of the persistent kernel loops over several tiles.
    (2, 3000, 3100, 16, 4, 128, False, torch.bfloat16),
    (2, 2100, 1900, 16, 8, 64, False, torch.float16),
    # Plain d64 rows that fill three warpgroups' 192-row tiles poorly take two (hopper_fwd.three_warpgroups_fill).
    (2, 1000, 1100, 8, 2, 64, False, torch.bfloat16),
    # and so does a plain bfloat16 d64 call that defers its check (hopper_fwd.defer_pays: 2^35 FLOPs or more).
    (1, 4096, 4100, 8, 2, 64, False, torch.bfloat16),
    # Head dims 96, 192 and 256 take the Gluon forward (d96 on d128's tiles and d192's V on d256's, zero-filled past the
    # head dim; d256 with 64-row key blocks) and the Gluon backward (d96 on d128's tiles, d192 on d256's).
    (2, 1000, 1100, 4, 2, 96, True, torch.bfloat16),
    (1, 777, 1500, 4, 2, 96, False, torch.float16),
    (2, 1000, 1100, 4, 2, 192, True, torch.bfloat16),
    (1, 1500, 777, 4, 4, 192, False, torch.float16),
    (2, 1000, 1100, 4, 2, 256, True, torch.bfloat16),
    (1, 1100, 1000, 4, 4, 256, True, torch.float16),
    (1, 1, 777, 2, 1, 256, False, torch.bfloat16),
    (1, 300, 50, 2, 2, 256, False, torch.float16),
    (2, 3000, 3100, 16, 4, 256, False, torch.bfloat16),
    (1, 4096, 4096, 8, 8, 256, True, torch.bfloat16),
    # Every other multiple of 8 from 40 to 256 runs the path of the next of those head dims (hopper_fwd.kernel_dim),
    # its columns past the head dim zero-filled: d40-d56 on d64's, d72-d88 on d96's, d104-d120 on d128's, d136-d184
    # on d192's, d200-d248 on d256's.
    (2, 1000, 1100, 4, 2, 48, True, torch.bfloat16),
    (1, 1500, 777, 4, 2, 40, False, torch.float16),
    (2, 1000, 1100, 4, 2, 80, True, torch.bfloat16),
    (1, 777, 1500, 4, 4, 72, False, torch.float16),
    (2, 3000, 3100, 16, 4, 80, False, torch.bfloat16),
    (2, 1100, 1000, 4, 2, 112, True, torch.bfloat16),
    (1, 1500, 777, 4, 2, 104, False, torch.float16),
    (2, 1000, 1100, 4, 2, 160, True, torch.bfloat16),
    (1, 777, 1500, 4, 4, 136, False, torch.float16),
    (2, 3000, 3100, 8, 4, 160, True, torch.bfloat16),
    (2, 1000, 1100, 4, 2, 224, True, torch.bfloat16),
    (1, 1100, 1000, 4, 4, 200, False, torch.float16),
]


def _sid(b, sq, sk, h, hk, d, causal, dtype):
    return f"B{b}-Sq{sq}-Sk{sk}-H{h}-Hk{hk}-D{d}-{'causal' if causal else 'full'}-{str(dtype)[6:]}"


@pytest.mark.parametrize("b,sq,sk,h,hk,d,causal,dtype", [pytest.param(*s, id=_sid(*s)) for s in SHAPES])
def test_against_reference(poison, spy, bwd_spy, b, sq, sk, h, hk, d, causal, dtype):
    q, k, v = make_qkv(b, sq, sk, h, hk, d, dtype, device=DEVICE, seed=sq * 7 + sk + d)
    dout = torch.randn(q.shape, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(sq)).to(dtype)
    got = _fwd_bwd(q, k, v, dout, causal)
    assert len(spy) == 1, "the call did not take the Gluon forward"
    gluon_bwd = dispatch.gluon_head_dim(d)
    assert len(bwd_spy) == gluon_bwd, f"head dim {d}: the Gluon backward {'not ' if gluon_bwd else ''}taken"
    # The backward reads the forward's LSE, so its gradients check that too.
    check_against_reference(got, q.detach(), k.detach(), v.detach(), dout, d ** -0.5, causal, sk - sq)


MLA_SHAPES = [
    # b, sq, sk, h, hk, causal, dtype: q and k at head dim 192, v at 128 (MLA's prefill)
    (2, 1000, 1100, 4, 2, True, torch.bfloat16),
    (1, 1500, 777, 4, 4, False, torch.float16),
    (1, 1, 777, 2, 1, True, torch.bfloat16),
    (2, 3000, 3100, 16, 16, True, torch.bfloat16),
]


@pytest.mark.parametrize("b,sq,sk,h,hk,causal,dtype", MLA_SHAPES,
                         ids=[f"B{b}-Sq{sq}-Sk{sk}-H{h}-Hk{hk}-{'causal' if c else 'full'}-{str(t)[6:]}"
                              for b, sq, sk, h, hk, c, t in MLA_SHAPES])
def test_mla_against_reference(poison, spy, bwd_spy, b, sq, sk, h, hk, causal, dtype):
    """MLA's head dims (q, k 192; v 128): the Gluon forward (Q and K on d256's tiles, V and the output on d128's)
    and the Gluon backward (HALVES: 128-key blocks in 32-query halves, Q and K in 64-column chunks), against
    float64."""
    q, k, _ = make_qkv(b, sq, sk, h, hk, 192, dtype, device=DEVICE, seed=sq + sk)
    v = torch.randn((b, sk, hk, 128), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(sk)).to(dtype)
    v.requires_grad_()
    dout = torch.randn((b, sq, h, 128), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(sq)).to(dtype)
    got = _fwd_bwd(q, k, v, dout, causal)
    assert got[0].shape == (b, sq, h, 128)
    assert len(spy) == 1 and len(bwd_spy) == 1, "MLA: the Gluon forward and backward"
    check_against_reference(got, q.detach(), k.detach(), v.detach(), dout, 192 ** -0.5, causal, sk - sq)


def test_mla_float32_block_gradients(bwd_spy):
    """MLA's Gluon backward into float32 gradient buffers (context parallelism's block gradients: HALVES stores them
    from the accumulators, where 16-bit ones go through its staging tiles): against float64 (causal, GQA, Sq < Sk), no
    further from it than the 16-bit path's gradients, and agreeing with them to their rounding."""
    from flashtile.distributed._local import Block, block_backward, block_forward
    from flashtile.testing import reference_fwd_bwd
    b, sq, sk, h, hk = 2, 700, 900, 4, 2
    gen = torch.Generator(DEVICE).manual_seed(23)
    q, k, v, dout = (torch.randn(shape, device=DEVICE, generator=gen).to(torch.bfloat16) for shape in (
        (b, sq, h, 192), (b, sk, hk, 192), (b, sk, hk, 128), (b, sq, h, 128)))
    block = Block(softmax_scale=192 ** -0.5, causal=True, diagonal_offset=sk - sq)
    out, lse = block_forward(q, k, v, block)
    grads = block_backward(dout, q, k, v, out, lse, None, block)
    assert len(bwd_spy) == 1 and all(g.dtype == torch.float32 for g in grads)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    o16 = flashtile.flash_attn_func(qg, kg, vg, causal=True)
    grads16 = torch.autograd.grad(o16, (qg, kg, vg), dout)
    ref = reference_fwd_bwd(*(t.double() for t in (q, k, v, dout)), 192 ** -0.5, True, sk - sq)[2:5]
    for name, got, got16, want in zip(("dq", "dk", "dv"), grads, grads16, ref):
        err = (got.double() - want).abs().max().item()
        err16 = (got16.double() - want).abs().max().item()
        assert err <= err16 + 1e-3, (name, err, err16)
        # The 16-bit gradients are these rounded, up to delta's rounding (out in float32 here, bf16 there).
        torch.testing.assert_close(got.to(torch.bfloat16), got16, atol=2e-2, rtol=2e-2, msg=name)


@pytest.mark.parametrize("causal", [False, True], ids=("full", "causal"))
def test_mla_varlen_one_item_grid(monkeypatch, causal):
    """MLA's backward on varlen batches past the persistent grid's bound (a sequence of 9100 keys): the one-item grid
    of HALVES, each program's chunk descriptors based at its sequence; with a sequence shorter than a key block and
    one without queries; against float64 per sequence."""
    from flashtile.testing import check_varlen_against_reference, cu_seqlens
    plans = []
    build = hopper_bwd.gluon_plan

    def spy(*args, **kwargs):
        plans.append(build(*args, **kwargs))
        return plans[-1]
    monkeypatch.setattr(hopper_bwd, "gluon_plan", spy)
    lens_q, lens_k = [9000, 130, 0], [9100, 200, 7]
    gen = torch.Generator(DEVICE).manual_seed(5 + causal)
    q, k, v, dout = (torch.randn(shape, device=DEVICE, generator=gen).to(torch.bfloat16) for shape in (
        (sum(lens_q), 4, 192), (sum(lens_k), 2, 192), (sum(lens_k), 2, 128), (sum(lens_q), 4, 128)))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    cu_q, cu_k = cu_seqlens(lens_q, DEVICE), cu_seqlens(lens_k, DEVICE)
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                                   return_attn_probs=True)
    grads = torch.autograd.grad((out * dout).sum(), (q, k, v))
    # (The forward may build the backward's plan ahead too: every plan of the call is the one-item HALVES grid.)
    assert plans and all(not p.persistent and p.launch.constexprs["HALVES"] for p in plans)
    check_varlen_against_reference((out.detach(), lse.detach(), *grads), q.detach(), k.detach(), v.detach(), dout,
                                   cu_q, cu_k, causal)


@pytest.mark.parametrize("varlen", [False, True], ids=("fixed", "varlen"))
def test_mla_features(poison, bwd_spy, varlen):
    """MLA's head dims on the Gluon backward with a window, softcap and sinks at once, GQA; fixed-length (Sq > Sk)
    or a varlen batch with empty and one-row sequences; against float64 (per sequence for varlen)."""
    from flashtile.testing import check_varlen_against_reference, cu_seqlens
    lens_q, lens_k = ([513, 0, 1, 250], [600, 9, 1, 250]) if varlen else ([900], [700])
    gen = torch.Generator(DEVICE).manual_seed(7 + varlen)
    q, k, v, dout = (torch.randn(shape, device=DEVICE, generator=gen).to(torch.bfloat16) for shape in (
        (sum(lens_q), 8, 192), (sum(lens_k), 2, 192), (sum(lens_k), 2, 128), (sum(lens_q), 8, 128)))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    sink = torch.randn(8, device=DEVICE, generator=gen).requires_grad_()
    kw = dict(causal=True, window_size=(200, 0), softcap=5.0, sinks=sink, return_attn_probs=True)
    if varlen:
        cu_q, cu_k = cu_seqlens(lens_q, DEVICE), cu_seqlens(lens_k, DEVICE)
        out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **kw)
    else:
        out, lse, _ = flashtile.flash_attn_func(*(t[None] for t in (q, k, v)), **kw)
        out, lse = out[0], lse[0]
    grads = torch.autograd.grad((out * dout).sum(), (q, k, v, sink))
    assert len(bwd_spy) == 1
    got = (out.detach(), lse.detach(), *grads[:3])
    feats = dict(window_size=(200, 0), softcap=5.0, sinks=sink.detach())
    if varlen:
        check_varlen_against_reference(got, q.detach(), k.detach(), v.detach(), dout, cu_q, cu_k, True,
                                       dsinks=grads[3], **feats)
    else:
        check_against_reference((got[0][None], got[1][None], *(g[None] for g in got[2:]), None, grads[3]),
                                *(t.detach()[None] for t in (q, k, v)), dout[None], 192 ** -0.5, True,
                                lens_k[0] - lens_q[0], **feats)


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("d", (64, 80, 96, 112, 128, 160, 192, 224, 256))
def test_matches_portable_kernel(monkeypatch, causal, d):
    q, k, v = make_qkv(2, 1500, 1700, 4, 2, d, torch.bfloat16, device=DEVICE, seed=d, grad=False)
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    monkeypatch.setattr(SETTINGS, "gluon_forward", False)
    out_p, lse_p, _ = flashtile.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    # Same math, different accumulation order: bf16 rounding of the output, fp32 rounding of the LSE.
    assert (out.float() - out_p.float()).abs().max().item() <= 2 ** -7
    finite = torch.isfinite(lse_p)
    assert torch.equal(finite, torch.isfinite(lse))
    assert (lse[finite] - lse_p[finite]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("trend", ("rising", "falling"))
@pytest.mark.parametrize("d,causal,dtype", [(64, True, torch.float16), (64, False, torch.bfloat16),
                                            (128, False, torch.float16), (128, True, torch.bfloat16),
                                            (256, True, torch.bfloat16)],
                         ids=("d64-causal-fp16", "d64-full-bf16", "d128-full-fp16", "d128-causal-bf16",
                              "d256-causal-bf16"))
def test_scores_that_drift_across_key_blocks(monkeypatch, poison, spy, trend, d, causal, dtype):
    # The forward takes a block's exponentials against the reference its rows already have (SETTINGS.lazy_max)
    # and redoes a block with the maximum when a row's sum passes LAZY_LIMIT. Keys scaled up (rising) along the
    # sequence push every later block's scores well past the earlier maximum, so that path runs over and over,
    # in fp16 too, where P must stay below 65504; falling scores leave the early maximum far above later ones.
    b, sq, sk, h = 1, 700, 1900, 2
    q, k, v = make_qkv(b, sq, sk, h, h, d, dtype, device=DEVICE, seed=d + causal, grad=False)
    ramp = torch.linspace(0.2, 4.0, sk, device=DEVICE)
    ramp = ramp if trend == "rising" else ramp.flip(0)
    k = (k.float() * ramp[None, :, None, None]).to(dtype)
    q = (q.float() * 2.0).to(dtype)
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert len(spy) == 1, "the call did not take the Gluon forward"
    check_against_reference((out, lse, None, None, None), q, k, v, torch.zeros_like(q), d ** -0.5, causal, sk - sq)
    monkeypatch.setattr(SETTINGS, "lazy_max", False)
    out_m, lse_m, _ = flashtile.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    # The same exponentials up to the reference they were taken against: rounding of P, O and the LSE (outputs
    # up to ~4 here, where one bf16 step is 2^-6).
    torch.testing.assert_close(out.float(), out_m.float(), rtol=2 ** -7, atol=2 ** -7)
    torch.testing.assert_close(lse, lse_m, rtol=0, atol=1e-4)


def test_strided_inputs(spy):
    # (B, H, S, D) tensors seen as (B, S, H, D): no copy, the descriptors take the strides.
    b, s, h, d = 2, 700, 4, 128
    gen = torch.Generator(DEVICE).manual_seed(3)
    q, k, v = (torch.randn(b, h, s, d, device=DEVICE, generator=gen).to(torch.bfloat16).transpose(1, 2)
               for _ in range(3))
    out = flashtile.flash_attn_func(q, k, v, causal=True)
    assert len(spy) == 1
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2).double() for t in (q, k, v)), is_causal=True).transpose(1, 2)
    assert (out.double() - ref).abs().max().item() < 2e-2


def test_strided_inputs_backward(poison, spy, bwd_spy):
    # SDPA's (B, H, S, D) tensors seen as (B, S, H, D), with grad: the Gluon backward copies them into rows whose
    # heads are contiguous (hopper_bwd._rows) instead of leaving them to the portable kernels.
    b, s, h, d = 2, 700, 4, 128
    gen = torch.Generator(DEVICE).manual_seed(4)
    q, k, v, dout = (torch.randn(b, h, s, d, device=DEVICE, generator=gen).to(torch.bfloat16).transpose(1, 2)
                     for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    got = _fwd_bwd(q, k, v, dout, True)
    assert len(spy) == 1 and len(bwd_spy) == 1
    assert all(g.shape == t.shape for g, t in zip(got[2:], (q, k, v)))
    check_against_reference(got, q.detach(), k.detach(), v.detach(), dout, d ** -0.5, True, 0)


@pytest.mark.parametrize("d,causal", [(128, False), (128, True), (64, True), (256, True)])
def test_dq_reductions_hold_no_race(bwd_spy, d, causal):
    # dQ's partial tiles go through one staging tile per warpgroup, which the writer warp's bulk reduction reads
    # asynchronously; a warpgroup that restages before the read has finished corrupts a partial. The reductions'
    # order varies between runs, so dQ does too, but only by rounding: one bf16 ulp of the element, plus the fp32
    # sums' own spread (at most 64 terms here, each under max|dQ|: < 2^-18 max|dQ|; 2^-16 allowed) for elements
    # that cancel to near 0. A staging race moved elements of magnitude ~2 by 2.5 ulp (0.02) in a 4k backward.
    # Many programs at once, several runs: a guard, not a proof.
    q, k, v = make_qkv(4, 4096, 4096, 8, 8, d, torch.bfloat16, device=DEVICE, seed=11 + d + causal)
    out = flashtile.flash_attn_func(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, q, dout, retain_graph=True)[0].float()
    for _ in range(6):
        dq = torch.autograd.grad(out, q, dout, retain_graph=True)[0].float()
        # bf16 keeps 8 significant bits: one ulp of x is 2^(e - 8) for x = m * 2^e, 0.5 <= m < 1.
        ulp = torch.ldexp(torch.ones_like(dq), torch.frexp(torch.maximum(dq.abs(), first.abs()))[1] - 8)
        excess = ((dq - first).abs() - ulp - first.abs().max() * 2.0 ** -16).max().item()
        assert excess <= 0, f"dQ moved by {excess:.3g} beyond rounding between two runs"
    assert len(bwd_spy) == 7


def test_repeatable(spy):
    q, k, v = make_qkv(1, 3000, 3000, 8, 8, 128, torch.bfloat16, device=DEVICE, seed=5, grad=False)
    first = flashtile.flash_attn_func(q, k, v, causal=True)
    for _ in range(5):
        assert torch.equal(flashtile.flash_attn_func(q, k, v, causal=True), first)
    assert len(spy) == 6


def test_schedule_counter_returns_to_zero(spy):
    """The dynamic schedule's counter is zeroed once and set back to zero by each launch's last take: calls of
    different sizes in a row (fewer and more items than SMs, varlen) stay right, and the counters read 0 after."""
    from flashtile.kernels import hopper_fwd
    for sq, b, h in ((300, 1, 2), (2500, 2, 16), (1000, 1, 4), (2500, 2, 16)):
        q, k, v = make_qkv(b, sq, sq, h, h, 128, torch.bfloat16, device=DEVICE, seed=sq + b, grad=False)
        out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        check_against_reference((out, lse, None, None, None), q, k, v, torch.zeros_like(q), 128 ** -0.5, True, 0)
    lens = torch.tensor([0, 700, 1900, 2000], dtype=torch.int32, device=DEVICE)
    q, k, v = make_qkv(1, 2000, 2000, 4, 2, 64, torch.bfloat16, device=DEVICE, seed=9, grad=False)
    first = flashtile.flash_attn_varlen_func(q[0], k[0], v[0], lens, lens, 1200, 1200, causal=True)
    assert torch.equal(flashtile.flash_attn_varlen_func(q[0], k[0], v[0], lens, lens, 1200, 1200, causal=True), first)
    torch.cuda.synchronize()
    assert hopper_fwd._COUNTERS and all(int(c.item()) == 0 for c in hopper_fwd._COUNTERS.values())
    assert len(spy) == 6


def test_schedule_takes_are_relaxed(monkeypatch):
    """The schedule counter's takes (the forward's dynamic schedule, the persistent backward's work list) are only
    indices and order no data: they compile to relaxed atomic adds. An acq_rel add brought a GPU-scope fence
    (MEMBAR.ALL.GPU) and an L1 invalidation into the producer's step, which cost the forward's 1-block items 13%
    (docs/design-record.md, "The dynamic schedule's take is relaxed")."""
    from flashtile.kernels import hopper_fwd
    monkeypatch.setattr(dispatch, "_PLANS", {})
    q, k, v = make_qkv(2, 1000, 1000, 4, 4, 128, torch.bfloat16, device=DEVICE, seed=3)
    flashtile.flash_attn_func(q, k, v, causal=True).float().sum().backward()
    launches = [getattr(p, "launch", None) or getattr(getattr(p, "gluon", None), "launch", None)
                for p in dispatch._PLANS.values()]
    kernels = {b.kernel.fn.__name__: b.compiled.asm["ptx"] for b in launches if b is not None}
    assert set(kernels) == {hopper_fwd._fwd_kernel.fn.__name__, hopper_bwd._bwd_kernel.fn.__name__}
    for name, ptx in kernels.items():
        adds = [line for line in ptx.splitlines() if "atom.global" in line and ".add.u32" in line]
        assert adds and all(".relaxed." in line for line in adds), (name, adds)


def test_persistent_backward_work_list(poison, bwd_spy, bwd_grids):
    """The persistent backward (fixed-length calls up to hopper_bwd.PERSISTENT_MAX_SEQLEN_K keys) takes its work
    items from the schedule counter shared with the forward: calls in a row with fewer and more items than SMs,
    GQA, every tile width, causal and not, and longer calls on the one-item-per-program grid, each against the
    float64 oracle; the counters read 0 after."""
    from flashtile.kernels import hopper_fwd
    cases = [(1, 300, 300, 2, 2, 128, True), (2, 2500, 2600, 16, 4, 64, True), (3, 1000, 900, 8, 8, 128, False),
             (1, 200, 8300, 4, 2, 128, True), (2, 2500, 2600, 16, 4, 64, False), (2, 700, 777, 8, 2, 96, True),
             (1, 200, 8300, 2, 2, 96, False), (2, 1500, 1400, 8, 2, 256, True), (1, 300, 300, 2, 2, 192, False),
             (1, 200, 8300, 2, 1, 256, False)]
    for i, (b, sq, sk, h, hk, d, causal) in enumerate(cases):
        q, k, v = make_qkv(b, sq, sk, h, hk, d, torch.bfloat16, device=DEVICE, seed=31 + i)
        dout = torch.randn(q.shape, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(i)).to(q.dtype)
        got = _fwd_bwd(q, k, v, dout, causal)
        check_against_reference(got, q.detach(), k.detach(), v.detach(), dout, d ** -0.5, causal, sk - sq)
    torch.cuda.synchronize()
    assert len(bwd_spy) == len(cases)
    assert bwd_grids == [c[2] <= hopper_bwd.PERSISTENT_MAX_SEQLEN_K for c in cases]
    assert hopper_fwd._COUNTERS and all(int(c.item()) == 0 for c in hopper_fwd._COUNTERS.values())


@pytest.mark.parametrize("kw,d,dtype", [
    (dict(bias=True), 128, torch.bfloat16),
    ({}, 32, torch.bfloat16),
    ({}, 264, torch.float16),
    (dict(dropout_p=0.1), 256, torch.bfloat16),
    (dict(dropout_p=0.1), 192, torch.bfloat16),
    (dict(bias=True), 256, torch.bfloat16),
    ({}, 128, torch.float32),
])
def test_other_calls_take_the_portable_kernel(spy, kw, d, dtype):
    # (Windows, softcap, ALiBi, sinks and dropout take the Gluon forward: tests/test_gluon_features.py,
    # tests/test_gluon_bwd_features.py.)
    q, k, v = make_qkv(1, 300, 300, 2, 2, d, dtype, device=DEVICE, seed=1, grad=False)
    if kw.pop("bias", False):
        bias = torch.randn(1, 2, 300, 300, device=DEVICE, dtype=dtype)
        out = flashtile.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=bias)
    else:
        out = flashtile.flash_attn_func(q, k, v, causal=True, **kw)
    assert out.isfinite().all()
    assert spy == []


def test_deterministic_takes_the_portable_backward(bwd_spy):
    q, k, v = make_qkv(2, 2000, 2000, 8, 2, 128, torch.bfloat16, device=DEVICE, seed=9)
    dout = torch.randn(q.shape, device=DEVICE).to(torch.bfloat16)
    first = _fwd_bwd(q, k, v, dout, True, deterministic=True)[2:]
    for _ in range(3):
        for a, b in zip(first, _fwd_bwd(q, k, v, dout, True, deterministic=True)[2:]):
            assert torch.equal(a, b)
    assert bwd_spy == []
    # The Gluon backward (dQ by bulk reductions) agrees with it to rounding.
    fast = _fwd_bwd(q, k, v, dout, True)[2:]
    assert len(bwd_spy) == 1
    for a, b in zip(first, fast):
        assert (a.float() - b.float()).abs().max().item() <= 2e-2 * a.float().abs().max().item()


def test_short_d64_backward(monkeypatch, call_counter):
    """Short d64 calls take the Gluon backward (its persistent grid), fixed-length and varlen; a varlen batch whose
    longest sequence is past the persistent grid's bound and whose mean key length is below GLUON_BWD_MIN_SEQLEN_K
    the portable one; each against the float64 oracle."""
    monkeypatch.setattr(SETTINGS, "fast_launch", False)  # no plans: each call reaches the backend's choice
    calls = call_counter(hopper_bwd, "gluon_plan")
    sk = 700
    q, k, v = make_qkv(1, 300, sk, 2, 2, 64, torch.bfloat16, device=DEVICE, seed=sk)
    dout = torch.randn(q.shape, device=DEVICE).to(torch.bfloat16)
    got = _fwd_bwd(q, k, v, dout, False)
    assert len(calls) == 1
    check_against_reference(got, q.detach(), k.detach(), v.detach(), dout, 64 ** -0.5, False, sk - 300)
    cu_q = torch.tensor([0, 300], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, sk], dtype=torch.int32, device=DEVICE)
    out, lse, _ = flashtile.flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, 300, sk, return_attn_probs=True)
    grads = torch.autograd.grad((out * dout[0]).sum(), (q, k, v))
    assert len(calls) == 2
    check_against_reference((out.detach()[None], lse.detach()[None], *grads), q.detach(), k.detach(), v.detach(),
                            dout, 64 ** -0.5, False, sk - 300)
    # The persistent grid's bound lowered below its keys: one program per key block, and 700 keys per sequence
    # are below GLUON_BWD_MIN_SEQLEN_K[64].
    monkeypatch.setattr(hopper_bwd, "PERSISTENT_MAX_SEQLEN_K", sk - 1)
    out, lse, _ = flashtile.flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, 300, sk, return_attn_probs=True)
    grads = torch.autograd.grad((out * dout[0]).sum(), (q, k, v))
    assert len(calls) == 2
    check_against_reference((out.detach()[None], lse.detach()[None], *grads), q.detach(), k.detach(), v.detach(),
                            dout, 64 ** -0.5, False, sk - 300)


def test_torch_deterministic_mode_takes_the_portable_backward(bwd_spy):
    q, k, v = make_qkv(1, 1000, 1000, 4, 4, 64, torch.bfloat16, device=DEVICE, seed=3)
    dout = torch.randn(q.shape, device=DEVICE).to(torch.bfloat16)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        first = _fwd_bwd(q, k, v, dout, False)[2:]
        again = _fwd_bwd(q, k, v, dout, False)[2:]
    finally:
        torch.use_deterministic_algorithms(before)
    assert bwd_spy == []
    for a, b in zip(first, again):
        assert torch.equal(a, b)


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_packed_qkv(poison, spy, bwd_spy, causal):
    b, s, h, d = 2, 777, 4, 128
    qkv = torch.randn(b, s, 3, h, d, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(4))
    qkv = qkv.to(torch.bfloat16).requires_grad_(True)
    out = flashtile.flash_attn_qkvpacked_func(qkv, causal=causal)
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad((out * dout).sum(), (qkv,))
    assert len(spy) == 1 and len(bwd_spy) == 1
    q, k, v = (t.detach().double().requires_grad_(True) for t in qkv.unbind(2))
    mask = torch.ones(s, s, dtype=torch.bool, device=DEVICE).tril() if causal else None
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask).transpose(1, 2)
    ref_grads = torch.autograd.grad((ref * dout.double()).sum(), (q, k, v))
    assert (out.double() - ref).abs().max().item() < 2e-2
    for got, want in zip(dqkv.unbind(2), ref_grads):
        assert (got.double() - want).abs().max().item() < 4e-2 * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("causal,varlen", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("d", [64, 128])
def test_float32_outputs(spy, causal, varlen, d):
    # flashtile.distributed asks the forward for float32 block outputs (merged in fp32 across ranks); the Gluon
    # forward stores them from registers. Against the same call's 16-bit output: within one 16-bit rounding.
    from flashtile import dispatch
    from flashtile.request import AttentionRequest
    q, k, v = make_qkv(2, 700, 900, 4, 2, d, torch.bfloat16, device=DEVICE, seed=d + causal, grad=False)
    fields = dict(softmax_scale=d ** -0.5, window_right=0 if causal else -1)
    if varlen:
        q, k, v = (t.flatten(0, 1) for t in (q, k, v))
        cu_q = torch.tensor([0, 700, 1400], dtype=torch.int32, device=DEVICE)
        cu_k = torch.tensor([0, 900, 1800], dtype=torch.int32, device=DEVICE)
        fields.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=700, max_seqlen_k=900, diagonal_offset=0)
    else:
        fields.update(diagonal_offset=200)
    req = AttentionRequest(**fields)
    backend = dispatch.choose_forward(q, k, v, req)
    assert backend.name == "gluon-hopper", backend.name
    out16, lse16 = backend.forward(q, k, v, req)
    out32, lse32 = backend.forward(q, k, v, req, out_dtype=torch.float32)
    assert out32.dtype == torch.float32 and out32.isfinite().all()
    ulp = out16.float().abs() * 2.0 ** -7 + 1e-6
    assert ((out32 - out16.float()).abs() <= ulp).all()
    torch.testing.assert_close(lse32, lse16, rtol=0, atol=0)
    assert len(spy) == 2


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("d", [64, 96, 128, 256])
def test_backward_adds_dq_addend(monkeypatch, call_counter, varlen, d):
    """flashtile.distributed's last step: dispatch.backward's dq_addend is added to dQ in the Gluon backward's dQ
    pass (the tile pass, or the varlen buffer's copy) and the sum rounded once into dq's dtype; against the same
    call's float32 gradient plus the addend: within one bfloat16 rounding (dQ's reductions are atomic, so the
    float32 sums may differ in their last bits). Twice with plans on: the call that builds the plan and one that
    runs it."""
    from flashtile.request import AttentionRequest
    monkeypatch.setattr(SETTINGS, "gluon_backward", True)
    monkeypatch.setattr(SETTINGS, "fast_launch", True)
    monkeypatch.setattr(dispatch, "GLUON_BWD_MIN_SEQLEN_K", dict.fromkeys(dispatch.GLUON_KERNEL_DIMS, 0))
    plans = call_counter(hopper_bwd, "gluon_plan")
    q, k, v = make_qkv(2, 700, 900, 4, 2, d, torch.bfloat16, device=DEVICE, seed=d + varlen, grad=False)
    fields = dict(softmax_scale=d ** -0.5, window_right=0)
    if varlen:
        q, k, v = (t.flatten(0, 1) for t in (q, k, v))
        cu_q = torch.tensor([0, 700, 1400], dtype=torch.int32, device=DEVICE)
        cu_k = torch.tensor([0, 900, 1800], dtype=torch.int32, device=DEVICE)
        fields.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=700, max_seqlen_k=900)
    else:
        fields.update(diagonal_offset=200)
    req = AttentionRequest(**fields)
    gen = torch.Generator(DEVICE).manual_seed(d)
    dout = torch.randn(q.shape, device=DEVICE, generator=gen).to(torch.bfloat16)
    addend = torch.randn(q.shape, device=DEVICE, generator=gen) * 4
    out, lse = dispatch.forward(q, k, v, req)
    grads32 = [torch.empty(t.shape, device=DEVICE) for t in (q, k, v)]
    dispatch.backward(dout, q, k, v, out, lse, None, req, False, buffers=grads32)
    want = addend + grads32[0]
    for _ in range(2):
        dq = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device=DEVICE)
        dk, dv = (torch.full(t.shape, float("nan"), device=DEVICE) for t in (k, v))
        dispatch.backward(dout, q, k, v, out, lse, None, req, False, buffers=(dq, dk, dv), dq_addend=addend)
        assert ((dq.float() - want).abs() <= want.abs() * 2.0 ** -8 + 1e-5).all()
        assert ((dq.float() - grads32[0].to(torch.bfloat16).float()).abs().max() > 1e-2)  # the addend is in it
        torch.testing.assert_close(dk, grads32[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dv, grads32[2], rtol=0, atol=0)
    assert len(plans) == 2  # the float32 call's plan and the addend call's (its dq is bfloat16): Gluon both times


def _defer_plans():
    from flashtile.kernels import hopper_fwd
    return [p for p in dispatch._PLANS.values() if isinstance(p, hopper_fwd.GluonFwdPlan) and p.defer]


@pytest.mark.parametrize("d,causal,varlen", [(128, True, False), (64, False, False), (128, False, True),
                                             (64, True, True), (256, True, False), (96, True, False),
                                             (128, False, False)],
                         ids=("d128-causal", "d64-full", "d128-varlen", "d64-causal-varlen", "d256-causal",
                              "d96-causal", "d128-full-round-robin"))
def test_deferred_check_redoes_flagged_items(monkeypatch, poison, d, causal, varlen):
    """DEFER (bfloat16 under LAZY_MAX): blocks after an item's first are taken against the first block's maximum,
    unchecked, and a warpgroup part whose row sum passed DEFER_LIMIT flags its item for the redo pass (a second
    launch, of the kernel compiled with REDO).
    Head 0's keys grow along the sequence so that later scores pass the first block's maximum by 80-120 nats (64 bits
    is DEFER_LIMIT): its items overflow in the first pass, the other heads' do not. The result must match float64;
    without the redo pass (its launch dropped) the flagged rows are not finite, so the test sees that pass work;
    and the redo state reads zero after each call."""
    from flashtile.kernels import hopper_fwd
    monkeypatch.setattr(hopper_fwd, "DEFER_MIN_FLOPS", 0)
    monkeypatch.setattr(dispatch, "_PLANS", {})
    b, sq, sk, h, hk = 2, 1000, 1300, 4, 2  # (1000 rows: d64 on two warpgroups, three_warpgroups_fill)
    q, k, v = make_qkv(b, sq, sk, h, hk, d, torch.bfloat16, device=DEVICE, seed=d + 7 * causal + varlen, grad=False)
    q[:, :, 0] = 1.0 + 0.05 * q[:, :, 0].float()
    ramp = torch.linspace(0.0, 12.0, sk, device=DEVICE)[None, :, None]
    k[:, :, 0] = (ramp + 0.05 * k[:, :, 0].float()).to(k.dtype)  # kv head 0 serves query heads 0 and 1

    def call():
        if not varlen:
            return flashtile.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)[:2]
        cu_q = torch.tensor([0, sq, 2 * sq], dtype=torch.int32, device=DEVICE)
        cu_k = torch.tensor([0, sk, 2 * sk], dtype=torch.int32, device=DEVICE)
        out, lse, _ = flashtile.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k,
                                                      sq, sk, causal=causal, return_attn_probs=True)
        return out.view(q.shape[:3] + v.shape[3:]), lse.view(h, b, sq).transpose(0, 1)

    def state_is_zero():
        torch.cuda.synchronize()
        return all(int(s.count_nonzero()) == 0 for s in hopper_fwd._REDO.values())

    out, lse = call()
    assert len(_defer_plans()) == 1, "the call did not take DEFER"
    assert state_is_zero()
    check_against_reference((out, lse, None, None, None), q, k, v, torch.zeros_like(q), d ** -0.5, causal, sk - sq)
    plan = _defer_plans()[0]
    redo = plan.redo

    class Dropped:  # the redo pass's launch, compiled, doing nothing
        compiled = True

        def __call__(self, stream, *args):
            pass

    plan.redo = Dropped()
    first_pass = call()[0]
    plan.redo = redo
    assert not torch.isfinite(first_pass[:, :, :2]).all(), "no item overflowed: the test does not reach the redo"
    assert torch.isfinite(first_pass[:, :, 2:]).all()
    again = call()  # (its redo pass also clears what the dropped one left flagged)
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)
    assert state_is_zero()


def test_deferred_check_is_bfloat16_only(monkeypatch):
    """DEFER leans on bfloat16 P keeping fp32's range: float16 (P under 65504) and float8 keep LAZY_MAX's check
    per block, and small calls (DEFER_MIN_FLOPS) skip the redo pass's launch."""
    monkeypatch.setattr(dispatch, "_PLANS", {})
    for dtype, sq, expect in ((torch.bfloat16, 4096, True), (torch.float16, 4096, False), (torch.bfloat16, 256, False)):
        q, k, v = make_qkv(1, sq, sq, 8, 8, 128, dtype, device=DEVICE, seed=sq, grad=False)
        flashtile.flash_attn_func(q, k, v, causal=True)
        assert bool(_defer_plans()) == expect, (dtype, sq)
        dispatch._PLANS.clear()
