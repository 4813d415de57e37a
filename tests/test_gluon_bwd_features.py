"""The Hopper Gluon backward (kernels/hopper_bwd.py) with the attention features: sliding windows, softcap, ALiBi,
sinks, attn_mask (a float bias with its gradient or without, a bool mask), varlen batches and dropout (with the
Gluon forward), alone and combined,
against the float64 oracle with every buffer NaN-poisoned, and against the portable backward on the same inputs.
Each call is asserted to have taken the Gluon backward.

Gluon kernels do not run in Triton's interpreter, so all but the features_supported tests need a Hopper GPU
(`pytest -m gpu`).
"""

import random

import pytest
import torch

import flashtile
from flashtile._settings import SETTINGS
from flashtile.reference.dropout import dropout_mask
from flashtile.testing import (attention_op, check_against_reference, check_varlen_against_reference, cu_seqlens,
                               make_qkv)

# Fixtures bwd_spy / poison: tests/conftest.py.
DEVICE = "cuda"
DTYPE_IDS = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def _gen(seed):
    return torch.Generator(device=DEVICE).manual_seed(seed)


def _inputs(b, sq, sk, h, hk, d, dtype, seed, alibi=None, alibi_scale=1.0, sinks=False):
    """q, k, v, dout, and the ALiBi slopes (alibi: "H" or "BH", fp32 in [0, alibi_scale)) and sinks asked for."""
    q, k, v = make_qkv(b, sq, sk, h, hk, d, dtype, device=DEVICE, seed=seed)
    dout = torch.randn(q.shape, generator=_gen(seed + 1), device=DEVICE).to(dtype)
    slopes = None
    if alibi is not None:
        shape = (h,) if alibi == "H" else (b, h)
        slopes = torch.rand(shape, generator=_gen(seed + 2), device=DEVICE) * alibi_scale
    sink = torch.randn(h, generator=_gen(seed + 3), device=DEVICE).requires_grad_() if sinks else None
    return q, k, v, dout, slopes, sink


def _run(q, k, v, dout, slopes, sink, causal, window, softcap):
    """flash_attn_func forward + backward: (out, lse, dq, dk, dv), or with sinks (out, lse, dq, dk, dv, None,
    dsinks), the form flashtile.testing judges."""
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                            alibi_slopes=slopes, sinks=sink, return_attn_probs=True)
    wrt = [q, k, v] + ([sink] if sink is not None else [])
    grads = torch.autograd.grad((out * dout).sum(), wrt)
    got = (out.detach(), lse.detach(), *grads[:3])
    if sink is not None:
        got = got + (None, grads[3])
    return got


CASES = [
    # b, sq, sk, h, hk, d, dtype, causal, window, softcap, alibi ("H", "BH" or None), sinks
    (1, 700, 700, 2, 2, 128, torch.bfloat16, False, (100, -1), 0.0, None, False),     # left bound only
    (2, 555, 555, 4, 2, 64, torch.float16, False, (64, 32), 0.0, None, False),        # both bounds
    (1, 1000, 1100, 2, 1, 128, torch.bfloat16, True, (256, 0), 0.0, None, False),     # causal + left
    (1, 500, 300, 2, 2, 128, torch.float16, False, (10, 5), 0.0, None, False),        # first 195 rows see no key
    (1, 300, 900, 2, 1, 64, torch.bfloat16, False, (200, 50), 0.0, None, False),      # Sq < Sk
    (1, 333, 777, 2, 2, 128, torch.float16, False, (-1, 9), 0.0, None, False),        # right bound only
    (1, 1, 777, 2, 1, 128, torch.bfloat16, True, (100, 0), 0.0, None, False),         # one query row
    (2, 600, 600, 4, 4, 128, torch.bfloat16, False, (-1, -1), 5.0, None, False),      # softcap
    (1, 1000, 1000, 2, 2, 64, torch.float16, True, (-1, -1), 2.0, None, False),       # causal softcap
    (1, 333, 1, 2, 2, 64, torch.float16, False, (-1, -1), 1.0, None, False),          # one key
    (2, 513, 700, 4, 2, 128, torch.bfloat16, False, (-1, -1), 0.0, "H", False),       # ALiBi (H,)
    (2, 700, 513, 4, 4, 64, torch.float16, True, (-1, -1), 0.0, "BH", False),         # causal ALiBi (B, H)
    (1, 800, 800, 4, 2, 128, torch.bfloat16, True, (-1, -1), 0.0, None, True),        # sinks
    (1, 257, 513, 3, 1, 64, torch.float16, False, (-1, -1), 0.0, None, True),
    (2, 1000, 1234, 8, 2, 128, torch.bfloat16, True, (300, 0), 5.0, "H", True),       # all at once, GQA
    (1, 777, 555, 4, 1, 64, torch.float16, False, (200, 100), 3.0, "BH", True),
    (1, 129, 1000, 2, 2, 128, torch.float16, True, (500, 0), 4.0, "BH", False),
    # d96 on d128's tiles (hopper_bwd.TILE_DIM): plain, and everything at once.
    (2, 700, 900, 4, 2, 96, torch.bfloat16, False, (-1, -1), 0.0, None, False),
    (1, 1000, 1234, 8, 2, 96, torch.float16, True, (300, 0), 5.0, "BH", True),
    # d192 on d256's tiles and d256 (_bwd_step_wide: no ALiBi there): windows, softcap, sinks, GQA.
    (1, 700, 700, 2, 2, 256, torch.bfloat16, False, (100, -1), 0.0, None, False),
    (1, 500, 300, 2, 2, 256, torch.float16, False, (10, 5), 0.0, None, False),
    (2, 600, 600, 4, 4, 256, torch.bfloat16, False, (-1, -1), 5.0, None, False),
    (2, 1000, 1234, 8, 2, 256, torch.bfloat16, True, (300, 0), 5.0, None, True),
    (1, 777, 555, 4, 1, 192, torch.float16, False, (200, 100), 3.0, None, True),
    (1, 129, 1000, 2, 2, 192, torch.bfloat16, True, (500, 0), 4.0, None, False),
    # Head dims on the next kernel head dim's path (hopper_fwd.kernel_dim), everything each path takes at once.
    (1, 1000, 1234, 8, 2, 48, torch.bfloat16, True, (300, 0), 5.0, "BH", True),
    (1, 1000, 1234, 8, 2, 80, torch.float16, True, (300, 0), 5.0, "H", True),
    (1, 1000, 1234, 8, 2, 112, torch.bfloat16, True, (300, 0), 5.0, "BH", True),
    (1, 777, 555, 4, 1, 160, torch.float16, False, (200, 100), 3.0, None, True),
    (2, 1000, 1234, 8, 2, 224, torch.bfloat16, True, (300, 0), 5.0, None, True),
]


def _cid(b, sq, sk, h, hk, d, dtype, causal, window, softcap, alibi, sinks):
    parts = [f"B{b}-Sq{sq}-Sk{sk}-H{h}-Hk{hk}-D{d}-{DTYPE_IDS[dtype]}"]
    if causal:
        parts.append("causal")
    if window != (-1, -1):
        parts.append(f"L{window[0]}-R{window[1]}")
    if softcap:
        parts.append(f"softcap{softcap:g}")
    if alibi:
        parts.append(f"alibi{alibi}")
    if sinks:
        parts.append("sinks")
    return "-".join(parts)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("b,sq,sk,h,hk,d,dtype,causal,window,softcap,alibi,sinks",
                         [pytest.param(*c, id=_cid(*c)) for c in CASES])
def test_against_reference(poison, bwd_spy, b, sq, sk, h, hk, d, dtype, causal, window, softcap, alibi, sinks):
    q, k, v, dout, slopes, sink = _inputs(b, sq, sk, h, hk, d, dtype, seed=sq * 7 + sk + d, alibi=alibi,
                                          sinks=sinks)
    got = _run(q, k, v, dout, slopes, sink, causal, window, softcap)
    assert len(bwd_spy) == 1, "the call did not take the Gluon backward"
    features = dict(window_size=window, softcap=softcap, alibi_slopes=slopes)
    if sinks:
        features["sinks"] = sink.detach()
    check_against_reference(got, q.detach(), k.detach(), v.detach(), dout, d ** -0.5, causal, sk - sq, **features)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("d", (64, 96, 128, 192, 256))
def test_one_key_per_row(poison, bwd_spy, d):
    # Window (0, 0) with Sq > Sk: each of the last Sk rows sees exactly one key, the others none. The exact output
    # is then v itself and dq is 0, so the judge allows no rounding in the output (P = exp2(0) = 1 in both
    # kernels; the Gluon forward keeps m = -inf through a row's fully masked first blocks for this).
    q, k, v, dout, _, _ = _inputs(1, 900, 300, 2, 2, d, torch.bfloat16, seed=d + 1)
    got = _run(q, k, v, dout, None, None, False, (0, 0), 0.0)
    assert len(bwd_spy) == 1
    check_against_reference(got, q.detach(), k.detach(), v.detach(), dout, d ** -0.5, False, -600,
                            window_size=(0, 0))


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("d", (64, 96, 128))
def test_alibi_small_slopes(poison, bwd_spy, d):
    # Slopes small enough that the bias matters over many tiles on both sides of the diagonal: the unmasked tiles'
    # split form (a term per query plus one per key) against the masked tiles' |i + diag - j|.
    q, k, v, dout, slopes, _ = _inputs(1, 2048, 2000, 2, 2, d, torch.bfloat16, seed=d, alibi="H", alibi_scale=0.01)
    got = _run(q, k, v, dout, slopes, None, False, (-1, -1), 0.0)
    assert len(bwd_spy) == 1
    check_against_reference(got, q.detach(), k.detach(), v.detach(), dout, d ** -0.5, False, -48,
                            alibi_slopes=slopes)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("d", (64, 96, 128))
def test_matches_portable_backward(monkeypatch, bwd_spy, d):
    q, k, v, dout, slopes, sink = _inputs(2, 1500, 1700, 4, 2, d, torch.bfloat16, seed=d, alibi="BH",
                                          alibi_scale=0.1, sinks=True)
    kw = dict(causal=True, window=(700, 0), softcap=10.0)
    fast = _run(q, k, v, dout, slopes, sink, **kw)
    assert len(bwd_spy) == 1
    monkeypatch.setattr(SETTINGS, "gluon_backward", False)
    portable = _run(q, k, v, dout, slopes, sink, **kw)
    assert len(bwd_spy) == 1
    # Same math, different accumulation order (and the Gluon dQ sums its key blocks in a varying order).
    for a, b in zip(portable[2:5], fast[2:5]):
        assert (a.float() - b.float()).abs().max().item() <= 2e-2 * a.float().abs().max().item()
    assert (portable[6] - fast[6]).abs().max().item() <= 1e-3 * portable[6].abs().max().item()


_CU = torch.tensor([0, 4], dtype=torch.int32)
_VARLEN = dict(cu_seqlens_q=_CU, cu_seqlens_k=_CU, max_seqlen_q=4, max_seqlen_k=4)


@pytest.mark.parametrize("kw,ok", [
    (dict(), True),
    (dict(window_left=100, window_right=0), True),
    (dict(window_left=5, window_right=7), True),
    (dict(window_right=3), True),
    (dict(softcap=30.0), True),
    (dict(alibi_slopes=torch.ones(2)), True),
    (dict(sinks=torch.zeros(2)), True),
    (dict(dropout_p=0.1), True),
    (dict(attn_bias=torch.zeros(1, 1, 4, 4)), True),
    (dict(attn_bias=torch.ones(1, 1, 4, 4, dtype=torch.bool), window_right=0, softcap=5.0), True),
    (dict(attn_bias=torch.zeros(1, 1, 4, 4), dropout_p=0.1), False),
    (dict(_VARLEN), True),
    (dict(_VARLEN, window_left=100, window_right=0, softcap=5.0, alibi_slopes=torch.ones(2), sinks=torch.zeros(2)),
     True),
    (dict(_VARLEN, dropout_p=0.1), True),
    (dict(_VARLEN, attn_bias=torch.zeros(1, 1, 4, 4)), False),
], ids=["plain", "causal-window", "window", "right-window", "softcap", "alibi", "sinks", "dropout", "bias",
        "mask-causal-softcap", "bias-dropout", "varlen", "varlen-features", "varlen-dropout", "varlen-bias"])
def test_features_supported(kw, ok):
    """The Gluon backward's allow-list (flashtile.dispatch.GluonHopper) on the options alone, as on an H100: bf16
    d128 inputs whose attn_mask (where there is one) TMA can read."""
    from flashtile.dispatch import GluonHopper, Target
    from flashtile.request import AttentionRequest
    kw = dict(kw)
    if "attn_bias" in kw:
        kw["attn_bias"] = torch.zeros((1, 1, 64, 4096), dtype=kw["attn_bias"].dtype).to(
            torch.bfloat16 if kw["attn_bias"].dtype != torch.bool else torch.bool)
    q = torch.empty((1, 64, 2, 128), dtype=torch.bfloat16)
    k = torch.empty((1, 4096, 2, 128), dtype=torch.bfloat16)
    if "cu_seqlens_q" in kw:
        q, k = q[0], k[0]
        kw.update(cu_seqlens_q=torch.tensor([0, 64], dtype=torch.int32),
                  cu_seqlens_k=torch.tensor([0, 4096], dtype=torch.int32), max_seqlen_q=64, max_seqlen_k=4096)
    req = AttentionRequest(softmax_scale=0.1, **kw)
    reason = GluonHopper().decline_backward(torch.empty_like(q), q, k, k, req, Target("cuda", 90, False))
    assert (reason is None) is ok, reason


# ---------------------------------------------------------------------------------------------------------------
# attn_mask: a float bias (no gradient) and a bool mask, read by TMA ([B|1, H|1, Sq, Sk], Sk a multiple of 8 for a
# 16-bit bias and of 16 for a bool mask: TMA's 16-byte row alignment)
# ---------------------------------------------------------------------------------------------------------------

def _run_masked(q, k, v, dout, mask, causal=False, window=(-1, -1), softcap=0.0, slopes=None):
    """Forward + backward with attn_mask (through the op every API shares, so that a mask can meet a window):
    (out, lse, dq, dk, dv)."""
    out, lse = attention_op(q, k, v, q.shape[-1] ** -0.5, causal, k.shape[1] - q.shape[1], window_size=window,
                            softcap=softcap, alibi_slopes=slopes, attn_bias=mask)
    grads = torch.autograd.grad((out * dout).sum(), [q, k, v])
    return (out.detach(), lse.detach(), *grads)


def _bias(shape, dtype, seed):
    """A float bias of O(1) with a fully hidden key (-inf) in every row."""
    bias = (torch.randn(shape, generator=_gen(seed), device=DEVICE) * 2).to(dtype)
    bias[..., 3] = float("-inf")
    return bias


def _check_masked(got, q, k, v, dout, mask, causal=False, window=(-1, -1), softcap=0.0, slopes=None):
    name = "attn_mask" if mask.dtype == torch.bool else "attn_bias"
    check_against_reference(got, q.detach(), k.detach(), v.detach(), dout, q.shape[-1] ** -0.5, causal,
                            k.shape[1] - q.shape[1], window_size=window, softcap=softcap, alibi_slopes=slopes,
                            **{name: mask})
    assert all(not torch.isnan(t).any() for t in got[2:])


def _bias_params(cases):
    """pytest params of (b, sq, sk, h, hk, dtype, bias (B, H) shape) cases, with readable ids."""
    return [pytest.param(*c, id=f"B{c[0]}-Sq{c[1]}-Sk{c[2]}-H{c[3]}-Hk{c[4]}-{DTYPE_IDS[c[5]]}-bias{c[6][0]}x{c[6][1]}")
            for c in cases]


BIAS_CASES = [
    # b, sq, sk, h, hk, dtype, bias shape (B, H broadcast flags)
    (2, 777, 1000, 4, 2, torch.bfloat16, (1, 1)),    # Sq < Sk, GQA
    (2, 1000, 696, 4, 4, torch.float16, (2, 4)),     # Sq > Sk
    (1, 513, 520, 4, 1, torch.bfloat16, (1, 4)),     # odd Sq, GQA 4:1
    (3, 300, 1024, 2, 2, torch.float16, (3, 1)),
    (1, 1, 264, 2, 2, torch.bfloat16, (1, 2)),       # one query row
    # Shared by the heads: kv heads launched in groups of hopper_bwd.HEAD_GROUP, the last one short.
    (1, 1000, 1104, 6, 6, torch.bfloat16, (1, 1)),
    (2, 600, 1200, 12, 6, torch.float16, (2, 1)),
]


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("b,sq,sk,h,hk,dtype,bshape", _bias_params(BIAS_CASES))
def test_float_bias(poison, bwd_spy, b, sq, sk, h, hk, dtype, bshape):
    q, k, v, dout, _, _ = _inputs(b, sq, sk, h, hk, 128, dtype, seed=sq + sk)
    bias = _bias((*bshape, sq, sk), dtype, seed=sq)
    got = _run_masked(q, k, v, dout, bias)
    assert len(bwd_spy) == 1, "the call did not take the Gluon backward"
    _check_masked(got, q, k, v, dout, bias)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("d", (64, 96, 128))
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=DTYPE_IDS.get)
@pytest.mark.parametrize("kind", ("random", "causal", "blocks"))
def test_bool_mask(poison, bwd_spy, kind, dtype, d):
    # random: ~40% hidden, plus a row that sees nothing (dq 0, LSE -inf) and a whole 128-key block hidden from a
    # band of rows (those query tiles leave that key block's list). causal: a bottom-right causal mask as a bool
    # tensor (the lists skip the tiles above the diagonal). blocks: document masking, 3 documents (tiles outside
    # them skipped; the rows before the first document see nothing).
    b, sq, sk, h, hk = 2, 701, 960, 4, 2
    q, k, v, dout, _, _ = _inputs(b, sq, sk, h, hk, d, dtype, seed=d + len(kind))
    rows = torch.arange(sq, device=DEVICE)[:, None] + sk - sq
    cols = torch.arange(sk, device=DEVICE)[None, :]
    if kind == "random":
        mask = torch.rand((b, 1, sq, sk), generator=_gen(7), device=DEVICE) > 0.4
        mask[:, :, 100] = False
        mask[:, :, 200:450, 256:384] = False
    elif kind == "causal":
        mask = (cols <= rows)[None, None]
    else:
        doc_q, doc_k = torch.bucketize(rows, torch.tensor([400, 700], device=DEVICE)), cols // 320
        mask = ((doc_q == doc_k) & (rows >= 300))[None, None].expand(1, h, sq, sk).contiguous()
    got = _run_masked(q, k, v, dout, mask)
    assert len(bwd_spy) == 1, "the call did not take the Gluon backward"
    _check_masked(got, q, k, v, dout, mask)
    hidden = ~mask.expand(b, h, sq, sk).any(dim=-1)  # rows that see no key: dq exactly 0
    assert torch.equal(got[2].transpose(1, 2)[hidden], torch.zeros_like(got[2].transpose(1, 2)[hidden]))


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("d", (48, 64, 80, 96, 112, 128))
def test_bool_mask_with_band(poison, bwd_spy, d):
    # A bool mask under a causal window: the listed tiles apply the band's edges elementwise too.
    b, sq, sk, h, hk = 1, 900, 1040, 4, 2
    q, k, v, dout, _, _ = _inputs(b, sq, sk, h, hk, d, torch.bfloat16, seed=d + 5)
    mask = torch.rand((1, h, sq, sk), generator=_gen(11), device=DEVICE) > 0.3
    got = _run_masked(q, k, v, dout, mask, causal=True, window=(300, 0))
    assert len(bwd_spy) == 1
    _check_masked(got, q, k, v, dout, mask, causal=True, window=(300, 0))


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("kind", ("float", "bool"))
def test_mask_with_features(poison, bwd_spy, kind):
    # Everything at once: the mask with a causal window, softcap and ALiBi (its split form in the unmasked tiles).
    b, sq, sk, h, hk = 2, 800, 1008, 4, 2
    q, k, v, dout, slopes, _ = _inputs(b, sq, sk, h, hk, 128, torch.bfloat16, seed=17, alibi="BH", alibi_scale=0.05)
    if kind == "float":
        mask = _bias((b, 1, sq, sk), torch.bfloat16, seed=18)
    else:
        mask = torch.rand((b, h, sq, sk), generator=_gen(19), device=DEVICE) > 0.2
    kw = dict(causal=True, window=(500, 0), softcap=8.0, slopes=slopes)
    got = _run_masked(q, k, v, dout, mask, **kw)
    assert len(bwd_spy) == 1
    _check_masked(got, q, k, v, dout, mask, **kw)


@pytest.mark.gpu
@pytest.mark.hopper
def test_expanded_bias(poison, bwd_spy):
    # A bias broadcast by expand() (stride 0 along batch and heads) is read as the broadcast it is.
    b, sq, sk, h = 2, 500, 512, 4
    q, k, v, dout, _, _ = _inputs(b, sq, sk, h, h, 128, torch.float16, seed=23)
    bias = _bias((1, 1, sq, sk), torch.float16, seed=24).expand(b, h, sq, sk)
    got = _run_masked(q, k, v, dout, bias)
    assert len(bwd_spy) == 1
    _check_masked(got, q, k, v, dout, bias)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("case", ("d64-float", "d64-bias-grad", "fp32-bias", "unaligned"))
def test_mask_portable_cases(poison, bwd_spy, case):
    # What stays on the portable backward: a float bias at d64 (its tiles do not fit the ring), with its gradient
    # or not, a bias of another dtype than q's, and an Sk whose rows TMA cannot load (not 16-byte aligned).
    d, sk, dtype = (64 if case.startswith("d64") else 128), (300 if case == "unaligned" else 320), torch.bfloat16
    q, k, v, dout, _, _ = _inputs(1, 257, sk, 2, 2, d, dtype, seed=29)
    bias = _bias((1, 2, 257, sk), torch.float32 if case == "fp32-bias" else dtype, seed=30)
    if case == "d64-bias-grad":
        bias.requires_grad_()
    got = _run_masked(q, k, v, dout, bias)
    assert len(bwd_spy) == 0
    _check_masked(got, q, k, v, dout, bias.detach())


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("kind", ("float", "bool"))
def test_mask_matches_portable_backward(monkeypatch, bwd_spy, kind):
    b, sq, sk, h, hk = 2, 1500, 1600, 4, 2
    q, k, v, dout, _, _ = _inputs(b, sq, sk, h, hk, 128, torch.bfloat16, seed=31)
    if kind == "float":
        mask = _bias((1, h, sq, sk), torch.bfloat16, seed=32)
    else:
        mask = torch.rand((b, h, sq, sk), generator=_gen(33), device=DEVICE) > 0.5
    fast = _run_masked(q, k, v, dout, mask)
    assert len(bwd_spy) == 1
    monkeypatch.setattr(SETTINGS, "gluon_backward", False)
    portable = _run_masked(q, k, v, dout, mask)
    assert len(bwd_spy) == 1
    for a, b_ in zip(portable[2:5], fast[2:5]):
        assert (a.float() - b_.float()).abs().max().item() <= 2e-2 * a.float().abs().max().item()


# ---------------------------------------------------------------------------------------------------------------
# The float bias's gradient (DBIAS): dS written by the Gluon backward in the bias's dtype over [B, H, Sq, Sk] and
# summed over the bias's broadcast dims. Without a band every element of that buffer is NaN-poisoned first, so an
# element the kernel skips fails the test.
# ---------------------------------------------------------------------------------------------------------------

def _run_bias_grad(q, k, v, dout, bias, causal=False, window=(-1, -1), softcap=0.0, slopes=None):
    """Forward + backward with a float bias that requires grad: (out, lse, dq, dk, dv, dbias, None), the form
    flashtile.testing judges."""
    out, lse = attention_op(q, k, v, q.shape[-1] ** -0.5, causal, k.shape[1] - q.shape[1], window_size=window,
                            softcap=softcap, alibi_slopes=slopes, attn_bias=bias)
    grads = torch.autograd.grad((out * dout).sum(), [q, k, v, bias])
    return (out.detach(), lse.detach(), *grads, None)


def _check_bias_grad(got, q, k, v, dout, bias, causal=False, window=(-1, -1), softcap=0.0, slopes=None):
    assert got[5].shape == bias.shape and got[5].dtype == bias.dtype
    check_against_reference(got, q.detach(), k.detach(), v.detach(), dout, q.shape[-1] ** -0.5, causal,
                            k.shape[1] - q.shape[1], window_size=window, softcap=softcap, alibi_slopes=slopes,
                            attn_bias=bias)
    assert all(not torch.isnan(t).any() for t in got[2:6])


DBIAS_CASES = [
    # b, sq, sk, h, hk, dtype, bias shape (B, H broadcast flags)
    (1, 700, 704, 4, 4, torch.bfloat16, (1, 4)),     # (1, H, S, S): no reduction
    (2, 777, 1000, 4, 2, torch.float16, (2, 4)),     # (B, H, S, S), Sq < Sk, GQA
    (2, 1000, 696, 4, 4, torch.bfloat16, (1, 1)),    # (1, 1, S, S), Sq > Sk
    (3, 300, 1024, 2, 2, torch.float16, (3, 1)),     # (B, 1, S, S)
    (1, 513, 520, 8, 2, torch.bfloat16, (1, 1)),     # odd Sq, GQA 4:1
    (1, 1, 264, 2, 2, torch.float16, (1, 2)),        # one query row
]


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("b,sq,sk,h,hk,dtype,bshape", _bias_params(DBIAS_CASES))
def test_float_bias_grad(poison, bwd_spy, b, sq, sk, h, hk, dtype, bshape):
    q, k, v, dout, _, _ = _inputs(b, sq, sk, h, hk, 128, dtype, seed=sq + sk + 1)
    bias = _bias((*bshape, sq, sk), dtype, seed=sq + 1).requires_grad_()
    got = _run_bias_grad(q, k, v, dout, bias)
    assert len(bwd_spy) == 1, "the call did not take the Gluon backward"
    _check_bias_grad(got, q, k, v, dout, bias)
    # -inf entries hide their keys: no gradient reaches them.
    assert torch.equal(got[5][..., 3], torch.zeros_like(got[5][..., 3]))


DBIAS_FEATURE_CASES = [
    # causal, window, softcap, alibi, dtype, bias shape
    (True, (-1, -1), 0.0, None, torch.bfloat16, (1, 4)),       # causal: tiles above the diagonal stay 0
    (False, (200, 100), 0.0, None, torch.float16, (2, 1)),     # both bounds
    (False, (-1, -1), 6.0, None, torch.bfloat16, (2, 4)),      # softcap: dbias is dS before its factor
    (False, (-1, -1), 0.0, "BH", torch.float16, (1, 1)),       # ALiBi
    (True, (400, 0), 8.0, "H", torch.bfloat16, (1, 4)),        # all at once
]


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("causal,window,softcap,alibi,dtype,bshape", [
    pytest.param(*c, id=_cid(2, 800, 1008, 4, 2, 128, c[4], *c[:4], False) + f"-bias{c[5][0]}x{c[5][1]}")
    for c in DBIAS_FEATURE_CASES])
def test_float_bias_grad_with_features(poison, bwd_spy, causal, window, softcap, alibi, dtype, bshape):
    b, sq, sk, h, hk = 2, 800, 1008, 4, 2
    q, k, v, dout, slopes, _ = _inputs(b, sq, sk, h, hk, 128, dtype, seed=41, alibi=alibi, alibi_scale=0.05)
    bias = _bias((*bshape, sq, sk), dtype, seed=42).requires_grad_()
    kw = dict(causal=causal, window=window, softcap=softcap, slopes=slopes)
    got = _run_bias_grad(q, k, v, dout, bias, **kw)
    assert len(bwd_spy) == 1
    _check_bias_grad(got, q, k, v, dout, bias, **kw)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("sq,sk", [(600, 1001), (1001, 603)], ids=["Sq600-Sk1001", "Sq1001-Sk603"])
def test_float_bias_grad_padded_rows(poison, bwd_spy, sq, sk):
    # A bias whose rows are padded to TMA's 16 bytes (a view): an odd Sk reaches the Gluon backward, whose dS
    # buffer then pads its rows too.
    q, k, v, dout, _, _ = _inputs(2, sq, sk, 4, 2, 128, torch.bfloat16, seed=sq + 3)
    row = (sk + 7) // 8 * 8
    bias = _bias((1, 4, sq, row), torch.bfloat16, seed=44)[..., :sk].detach().requires_grad_()
    got = _run_bias_grad(q, k, v, dout, bias)
    assert len(bwd_spy) == 1
    _check_bias_grad(got, q, k, v, dout, bias)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("bshape", [(1, 4), (1, 1)], ids=["bias1xH", "bias1x1"])
def test_float_bias_grad_matches_portable(monkeypatch, bwd_spy, bshape):
    b, sq, sk, h, hk = 2, 1500, 1600, 4, 2
    q, k, v, dout, _, _ = _inputs(b, sq, sk, h, hk, 128, torch.bfloat16, seed=47)
    bias = _bias((*bshape, sq, sk), torch.bfloat16, seed=48).requires_grad_()
    fast = _run_bias_grad(q, k, v, dout, bias)
    assert len(bwd_spy) == 1
    monkeypatch.setattr(SETTINGS, "gluon_backward", False)
    portable = _run_bias_grad(q, k, v, dout, bias)
    assert len(bwd_spy) == 1
    for a, b_ in zip(portable[2:6], fast[2:6]):
        assert (a.float() - b_.float()).abs().max().item() <= 2e-2 * a.float().abs().max().item()


# ---------------------------------------------------------------------------------------------------------------
# Varlen (flash_attn_varlen_func): packed [total, H, D] sequences, each judged alone against the float64 oracle
# with its own bottom-right alignment. Lengths 0 and 1, lengths that are no multiple of the tiles, total_q != total_k.
# ---------------------------------------------------------------------------------------------------------------

def _varlen_inputs(lens_q, lens_k, h, hk, d, dtype, seed, alibi=None, alibi_scale=1.0, sinks=False):
    """q, k, v ([total, H, D] leaves), dout, cu_seqlens_q, cu_seqlens_k, and the ALiBi slopes and sinks asked for."""
    q, k, v = (t[0].detach().requires_grad_()
               for t in make_qkv(1, sum(lens_q), sum(lens_k), h, hk, d, dtype, device=DEVICE, seed=seed))
    dout = torch.randn(q.shape, generator=_gen(seed + 1), device=DEVICE).to(dtype)
    slopes = None
    if alibi is not None:
        shape = (h,) if alibi == "H" else (len(lens_q), h)
        slopes = torch.rand(shape, generator=_gen(seed + 2), device=DEVICE) * alibi_scale
    sink = torch.randn(h, generator=_gen(seed + 3), device=DEVICE).requires_grad_() if sinks else None
    return q, k, v, dout, cu_seqlens(lens_q, DEVICE), cu_seqlens(lens_k, DEVICE), slopes, sink


def _run_varlen(q, k, v, dout, cu_q, cu_k, causal, window, softcap, slopes, sink, extra_max=0):
    """flash_attn_varlen_func forward + backward: (out, lse, dq, dk, dv, dsinks or None). extra_max: added to the
    max_seqlen arguments (a grid longer than any sequence)."""
    max_q = int((cu_q[1:] - cu_q[:-1]).max()) + extra_max
    max_k = int((cu_k[1:] - cu_k[:-1]).max()) + extra_max
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                                                   window_size=window, softcap=softcap, alibi_slopes=slopes,
                                                   sinks=sink, return_attn_probs=True)
    wrt = [q, k, v] + ([sink] if sink is not None else [])
    grads = torch.autograd.grad((out * dout).sum(), wrt)
    return out.detach(), lse.detach(), *grads[:3], (grads[3] if sink is not None else None)


def _check_varlen(got, q, k, v, dout, cu_q, cu_k, causal, window=(-1, -1), softcap=0.0, slopes=None, sink=None):
    """got = (out, lse, dq, dk, dv, dsinks or None), judged per sequence (flashtile.testing); the sinks' gradient,
    summed over the sequences, against the oracle's sum."""
    sinks = {} if sink is None else dict(sinks=sink.detach())
    check_varlen_against_reference(got[:5], q, k, v, dout, cu_q, cu_k, causal, alibi_slopes=slopes, dsinks=got[5],
                                   window_size=window, softcap=softcap, **sinks)


VARLEN_CASES = [
    # lens_q, lens_k, h, hk, d, dtype, causal, window, softcap, alibi ("H", "BH" or None), sinks
    ([0, 1, 130, 300, 64, 257], [5, 1, 130, 200, 0, 700], 4, 2, 128, torch.bfloat16, True, (-1, -1), 0.0, None,
     False),
    ([77, 0, 513, 1, 200], [300, 129, 64, 1, 200], 4, 1, 64, torch.float16, False, (-1, -1), 0.0, None, False),
    ([333, 700, 17], [333, 650, 190], 2, 2, 128, torch.float16, False, (100, 20), 0.0, None, False),
    ([400, 1, 129], [450, 64, 129], 4, 2, 64, torch.bfloat16, True, (64, 0), 0.0, None, False),
    ([256, 100, 0, 381], [256, 300, 10, 381], 2, 2, 128, torch.bfloat16, False, (-1, -1), 5.0, None, False),
    ([300, 45, 600], [310, 45, 500], 4, 4, 64, torch.float16, True, (-1, -1), 0.0, "BH", False),
    ([129, 1000], [1000, 129], 2, 1, 128, torch.float16, False, (-1, -1), 0.0, "H", False),
    ([200, 0, 450], [200, 33, 451], 4, 2, 128, torch.bfloat16, True, (-1, -1), 0.0, None, True),
    ([513, 7, 250], [600, 9, 250], 8, 2, 64, torch.float16, True, (200, 0), 3.0, "H", True),       # all at once
    ([513, 7, 250], [600, 9, 250], 8, 2, 96, torch.bfloat16, True, (200, 0), 3.0, "BH", True),
    ([0, 1, 130, 300, 64, 257], [5, 1, 130, 200, 0, 700], 4, 2, 256, torch.bfloat16, True, (-1, -1), 0.0, None,
     False),
    ([513, 7, 250], [600, 9, 250], 8, 2, 256, torch.float16, True, (200, 0), 3.0, None, True),
    ([333, 700, 17], [333, 650, 190], 2, 2, 192, torch.bfloat16, False, (100, 20), 5.0, None, False),
    ([513, 7, 250], [600, 9, 250], 8, 2, 80, torch.bfloat16, True, (200, 0), 3.0, "H", True),
    ([0, 1, 130, 300, 64, 257], [5, 1, 130, 200, 0, 700], 4, 2, 112, torch.float16, True, (-1, -1), 0.0, None,
     False),
    ([333, 700, 17], [333, 650, 190], 2, 2, 160, torch.bfloat16, False, (100, 20), 5.0, None, False),
    ([513, 7, 250], [600, 9, 250], 8, 2, 224, torch.float16, True, (200, 0), 3.0, None, True),
]


def _varlen_id(lens_q, lens_k, h, hk, d, dtype, causal, window, softcap, alibi, sinks):
    head = f"q{'_'.join(map(str, lens_q))}-k{'_'.join(map(str, lens_k))}-"
    return head + _cid(len(lens_q), sum(lens_q), sum(lens_k), h, hk, d, dtype, causal, window, softcap, alibi, sinks)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("lens_q,lens_k,h,hk,d,dtype,causal,window,softcap,alibi,sinks",
                         [pytest.param(*c, id=_varlen_id(*c)) for c in VARLEN_CASES])
def test_varlen_against_reference(poison, bwd_spy, lens_q, lens_k, h, hk, d, dtype, causal, window, softcap, alibi,
                                  sinks):
    q, k, v, dout, cu_q, cu_k, slopes, sink = _varlen_inputs(lens_q, lens_k, h, hk, d, dtype, seed=sum(lens_k) + d,
                                                              alibi=alibi, sinks=sinks)
    got = _run_varlen(q, k, v, dout, cu_q, cu_k, causal, window, softcap, slopes, sink)
    assert len(bwd_spy) == 1, "the call did not take the Gluon backward"
    _check_varlen(got, q, k, v, dout, cu_q, cu_k, causal, window, softcap, slopes, sink)


@pytest.mark.gpu
@pytest.mark.hopper
def test_varlen_longer_grid(poison, bwd_spy):
    # max_seqlen larger than every sequence (allowed, as in flash-attn): the extra key blocks have nothing to do,
    # and delta / LSE are padded to the larger length.
    q, k, v, dout, cu_q, cu_k, _, _ = _varlen_inputs([90, 0, 300], [100, 20, 260], 4, 2, 128, torch.bfloat16, seed=5)
    got = _run_varlen(q, k, v, dout, cu_q, cu_k, True, (-1, -1), 0.0, None, None, extra_max=300)
    assert len(bwd_spy) == 1
    _check_varlen(got, q, k, v, dout, cu_q, cu_k, True)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("d,causal", [(64, True), (96, False), (128, True), (128, False), (192, False),
                                      (256, True)])
def test_varlen_persistent_work_list(poison, bwd_spy, bwd_grids, d, causal):
    """Varlen batches whose longest sequence has up to hopper_bwd.PERSISTENT_MAX_SEQLEN_K keys take the persistent
    grid: many short sequences (more work items than SMs, most key blocks of the longest sequence's list past a
    sequence's keys), Sq != Sk both ways, empty sequences on either side, GQA; every sequence against the float64
    oracle, and the schedule counters read 0 after."""
    from flashtile.kernels import hopper_fwd
    rng = random.Random(d + causal)
    lens_q = [rng.choice([0, 1, 63, 129, 300, 777]) for _ in range(40)]
    lens_k = [max(n + rng.choice([0, 0, 5, 200, -60]), 0) if n else rng.choice([0, 9]) for n in lens_q]
    lens_k[3], lens_q[7] = 1500, 0  # one long sequence: most items of the others are past their keys
    q, k, v, dout, cu_q, cu_k, _, _ = _varlen_inputs(lens_q, lens_k, 8, 2, d, torch.bfloat16, seed=d + 71)
    got = _run_varlen(q, k, v, dout, cu_q, cu_k, causal, (-1, -1), 0.0, None, None)
    assert len(bwd_spy) == 1 and bwd_grids == [True]
    _check_varlen(got, q, k, v, dout, cu_q, cu_k, causal)
    torch.cuda.synchronize()
    assert hopper_fwd._COUNTERS and all(int(c.item()) == 0 for c in hopper_fwd._COUNTERS.values())


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("d", (64, 96, 128, 256))
def test_varlen_qkvpacked(poison, bwd_spy, d):
    # One packed qkv (total, 3, H, D): q, k, v and their gradients are strided views (row stride 3 * H * D).
    lens = [300, 0, 129, 1, 64]
    cu = cu_seqlens(lens, DEVICE)
    gen = _gen(d)
    qkv = torch.randn((sum(lens), 3, 4, d), generator=gen, device=DEVICE).to(torch.float16).requires_grad_()
    dout = torch.randn((sum(lens), 4, d), generator=_gen(d + 1), device=DEVICE).to(torch.float16)
    out, lse, _ = flashtile.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), causal=True, return_attn_probs=True)
    (dqkv,) = torch.autograd.grad((out * dout).sum(), [qkv])
    assert len(bwd_spy) == 1
    q, k, v = qkv.detach().unbind(1)
    _check_varlen((out.detach(), lse.detach(), *dqkv.unbind(1), None), q, k, v, dout, cu, cu, True)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("d", (64, 96, 128))
def test_varlen_matches_portable_backward(monkeypatch, bwd_spy, d):
    lens_q, lens_k = [1500, 0, 777, 1, 1024, 333], [1600, 50, 777, 1, 900, 1200]
    q, k, v, dout, cu_q, cu_k, slopes, sink = _varlen_inputs(lens_q, lens_k, 4, 2, d, torch.bfloat16, seed=d,
                                                              alibi="BH", alibi_scale=0.1, sinks=True)
    kw = dict(causal=True, window=(700, 0), softcap=10.0, slopes=slopes, sink=sink)
    fast = _run_varlen(q, k, v, dout, cu_q, cu_k, **kw)
    assert len(bwd_spy) == 1
    monkeypatch.setattr(SETTINGS, "gluon_backward", False)
    portable = _run_varlen(q, k, v, dout, cu_q, cu_k, **kw)
    assert len(bwd_spy) == 1
    for a, b_ in zip(portable[2:5], fast[2:5]):
        assert (a.float() - b_.float()).abs().max().item() <= 2e-2 * a.float().abs().max().item()
    assert (portable[5] - fast[5]).abs().max().item() <= 1e-3 * portable[5].abs().max().item()


# ---------------------------------------------------------------------------------------------------------------
# Dropout on both Gluon kernels: the keep-mask they draw (kernels/_gluon.dropout_keep) must be
# reference.dropout.dropout_mask's, bit for bit, or these judgements against the oracle given that mask fail.
# ---------------------------------------------------------------------------------------------------------------

def _seed_drawn_after(manual_seed):
    """The Philox key a call draws right after torch.manual_seed(manual_seed) (interface._draw_seed)."""
    torch.manual_seed(manual_seed)
    return int(torch.randint(0, 2 ** 62, (1,), dtype=torch.int64, device=DEVICE).item())


DROPOUT_CASES = [
    # b, sq, sk, h, hk, d, dtype, causal, p, window, softcap, alibi, sinks
    (2, 1000, 1100, 4, 2, 128, torch.bfloat16, True, 0.1, (-1, -1), 0.0, None, False),
    (1, 1100, 1000, 4, 4, 64, torch.float16, False, 0.3, (-1, -1), 0.0, None, False),
    (1, 777, 1234, 4, 1, 128, torch.bfloat16, False, 0.2, (300, 100), 10.0, "H", True),
    (2, 1000, 1000, 4, 2, 64, torch.bfloat16, True, 0.15, (256, 0), 0.0, "BH", False),
    (1, 513, 257, 2, 2, 128, torch.float16, False, 0.5, (-1, -1), 5.0, None, True),
    # More work items than SMs (the forward's persistent programs take several tiles each).
    (2, 3000, 3100, 16, 4, 128, torch.bfloat16, True, 0.1, (-1, -1), 0.0, None, False),
    (1, 777, 1234, 4, 2, 96, torch.bfloat16, False, 0.2, (300, 100), 10.0, "H", True),
    # Head dims on d96's and d128's paths (hopper_fwd.kernel_dim).
    (1, 777, 1234, 4, 2, 80, torch.bfloat16, False, 0.2, (300, 100), 10.0, "H", True),
    (2, 1000, 1000, 4, 2, 112, torch.float16, True, 0.15, (256, 0), 0.0, "BH", False),
]


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("b,sq,sk,h,hk,d,dtype,causal,p,window,softcap,alibi,sinks", [
    pytest.param(*c, id=_cid(*c[:8], *c[9:]) + f"-p{c[8]}") for c in DROPOUT_CASES])
def test_dropout(poison, spy, bwd_spy, b, sq, sk, h, hk, d, dtype, causal, p, window, softcap, alibi, sinks):
    q, k, v, dout, slopes, sink = _inputs(b, sq, sk, h, hk, d, dtype, seed=sq + sk + d, alibi=alibi,
                                          alibi_scale=0.1, sinks=sinks)
    torch.manual_seed(sq)
    out, lse, _ = flashtile.flash_attn_func(q, k, v, dropout_p=p, causal=causal, window_size=window,
                                            softcap=softcap, alibi_slopes=slopes, sinks=sink, return_attn_probs=True)
    wrt = [q, k, v] + ([sink] if sinks else [])
    grads = torch.autograd.grad((out * dout).sum(), wrt)
    assert len(spy) == 1 and len(bwd_spy) == 1, "the call did not take both Gluon kernels"
    got = (out.detach(), lse.detach(), *grads[:3]) + ((None, grads[3]) if sinks else ())
    mask = dropout_mask(_seed_drawn_after(sq), b, h, sq, sk, p, device=DEVICE)
    features = dict(window_size=window, softcap=softcap, alibi_slopes=slopes, dropout_p=p, dropout_mask=mask)
    if sinks:
        features["sinks"] = sink.detach()
    check_against_reference(got, q.detach(), k.detach(), v.detach(), dout, d ** -0.5, causal, sk - sq, **features)


@pytest.mark.gpu
@pytest.mark.hopper
def test_dropout_fraction_and_repeats(spy, bwd_spy):
    """The dropped fraction is within 1% of p, torch.manual_seed repeats a run bit for bit, another seed differs."""
    b, s, h, d, p = 1, 2048, 8, 128, 0.17
    q, k, v, dout, _, _ = _inputs(b, s, s, h, h, d, torch.bfloat16, seed=3)

    def run(manual_seed):
        torch.manual_seed(manual_seed)
        out = flashtile.flash_attn_func(q, k, v, dropout_p=p)
        return (out.detach(), *torch.autograd.grad((out * dout).sum(), [q, k, v]))

    first, again, other = run(7), run(7), run(8)
    assert len(spy) == 3 and len(bwd_spy) == 3
    # (out, dk and dv: dQ's key blocks are reduced in a varying order.)
    assert all(torch.equal(first[i], again[i]) for i in (0, 2, 3))
    assert not torch.equal(first[0], other[0])
    kept = dropout_mask(_seed_drawn_after(7), b, h, s, s, p, device=DEVICE)
    assert abs((~kept).float().mean().item() - p) < 0.01


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("d", (64, 96, 128))
def test_dropout_matches_portable_kernels(monkeypatch, spy, bwd_spy, d):
    q, k, v, dout, slopes, sink = _inputs(2, 1500, 1700, 4, 2, d, torch.bfloat16, seed=d, alibi="BH",
                                          alibi_scale=0.1, sinks=True)
    def run():
        torch.manual_seed(11)
        out, lse, _ = flashtile.flash_attn_func(q, k, v, dropout_p=0.2, causal=True, window_size=(700, 0),
                                                softcap=10.0, alibi_slopes=slopes, sinks=sink,
                                                return_attn_probs=True)
        return (out.detach(), lse.detach(), *torch.autograd.grad((out * dout).sum(), [q, k, v, sink]))

    fast = run()
    assert len(spy) == 1 and len(bwd_spy) == 1
    monkeypatch.setattr(SETTINGS, "gluon_backward", False)
    monkeypatch.setattr(SETTINGS, "gluon_forward", False)
    portable = run()
    assert len(spy) == 1 and len(bwd_spy) == 1
    # The same keep-mask: outputs to the rounding of P, gradients to their accumulation order.
    assert (portable[0].float() - fast[0].float()).abs().max().item() <= 2e-2 * portable[0].float().abs().max()
    for a, b_ in zip(portable[2:6], fast[2:6]):
        assert (a.float() - b_.float()).abs().max().item() <= 2e-2 * a.float().abs().max().item()


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("d", (64, 96, 128))
def test_varlen_dropout(poison, spy, bwd_spy, d):
    """Sequence i of a packed batch draws the mask of batch entry i (counter i * H + h), each from its own corner.
    p = 0.5: with 1 / (1 - p) a power of two the kept outputs v / (1 - p) are exact in bf16. Otherwise O's rounding
    enters delta = dO . O (FlashAttention's form of sum_j P dP), and the one-key sequence, whose exact dq is 0 and
    judged with a zero bound, shows it (p = 0.25: a dq of 7e-3 there, H100, Gluon kernels)."""
    lens_q, lens_k, h, hk, p = [300, 0, 129, 1, 700], [310, 64, 129, 1, 650], 4, 2, 0.5
    q, k, v, dout, cu_q, cu_k, _, _ = _varlen_inputs(lens_q, lens_k, h, hk, d, torch.bfloat16, seed=d + 5)
    torch.manual_seed(21)
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), dropout_p=p,
                                                   causal=True, return_attn_probs=True)
    dq, dk, dv = torch.autograd.grad((out * dout).sum(), [q, k, v])
    assert len(spy) == 1 and len(bwd_spy) == 1
    seed = _seed_drawn_after(21)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for i in range(len(lens_q)):
        if lens_q[i] == 0 or lens_k[i] == 0:
            continue
        rq, rk = slice(bq[i], bq[i + 1]), slice(bk[i], bk[i + 1])
        mask = dropout_mask(seed, 1, h, lens_q[i], lens_k[i], p, device=DEVICE, batch_offset=i)
        seq = lambda t, r: t[r].unsqueeze(0)  # noqa: E731
        got = (seq(out.detach(), rq), lse[:, rq].unsqueeze(0), seq(dq, rq), seq(dk, rk), seq(dv, rk))
        check_against_reference(got, seq(q.detach(), rq), seq(k.detach(), rk), seq(v.detach(), rk), seq(dout, rq),
                                d ** -0.5, True, lens_k[i] - lens_q[i], dropout_p=p, dropout_mask=mask)
