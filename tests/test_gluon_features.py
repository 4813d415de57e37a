"""The Hopper Gluon forward (kernels/hopper_fwd.py) with the options it implements: sliding windows (left and
right bounds), softcap, ALiBi and sinks, alone and combined. Each call must take the Gluon kernel; its output and
LSE are judged against the float64 oracle with every buffer NaN-poisoned, and compared with the portable kernel.

Gluon kernels do not run in Triton's interpreter, so these tests need a Hopper GPU (`pytest -m gpu`).
"""
import pytest
import torch

import flashtile
from flashtile._settings import SETTINGS
from flashtile.testing import (attention_op, check_against_reference, check_varlen_against_reference, cu_seqlens,
                               make_qkv)

# Fixtures spy / poison: tests/conftest.py.
pytestmark = [pytest.mark.gpu, pytest.mark.hopper]
DEVICE = "cuda"


def _features(b, h, seed, alibi=None, sinks=False, **kw):
    """Keyword arguments shared by flashtile and the oracle: alibi "h" -> (H,) slopes, "bh" -> (B, H)."""
    gen = torch.Generator(DEVICE).manual_seed(seed)
    if alibi is not None:
        shape = (h,) if alibi == "h" else (b, h)
        kw["alibi_slopes"] = torch.rand(shape, device=DEVICE, generator=gen) * 0.3
    if sinks:
        kw["sinks"] = torch.randn(h, device=DEVICE, generator=gen) * 2
    return kw


CASES = [
    # b, sq, sk, h, hk, d, causal, dtype, features
    (2, 1000, 1100, 4, 2, 128, True, torch.bfloat16, dict(window_size=(200, 0))),
    (1, 1100, 1000, 4, 4, 64, False, torch.float16, dict(window_size=(300, 150))),
    (2, 777, 777, 2, 1, 128, False, torch.bfloat16, dict(window_size=(-1, 100))),
    (1, 700, 900, 2, 2, 64, False, torch.bfloat16, dict(window_size=(50, -1))),
    # A window that leaves the first rows with no key (Sq > Sk, bottom-right aligned) and bands narrower than a
    # block, so a warpgroup can see no key of a whole block.
    (1, 900, 400, 3, 3, 128, True, torch.float16, dict(window_size=(17, 0))),
    (2, 513, 2100, 2, 1, 64, False, torch.bfloat16, dict(window_size=(5, 3))),
    # One key per row: the output is v exactly (P = 1 before and after rounding).
    (1, 700, 900, 4, 2, 128, False, torch.bfloat16, dict(window_size=(0, 0))),
    (2, 1000, 1100, 4, 2, 128, False, torch.bfloat16, dict(softcap=20.0)),
    (1, 1500, 1400, 4, 2, 64, True, torch.float16, dict(softcap=5.0)),
    (2, 800, 1200, 4, 4, 64, False, torch.bfloat16, dict(softcap=30.0)),  # plain d64: the 3-warpgroup config
    (2, 600, 900, 4, 2, 128, False, torch.bfloat16, dict(alibi="h")),
    (2, 1200, 700, 4, 2, 64, True, torch.float16, dict(alibi="bh")),
    (1, 999, 999, 2, 2, 64, False, torch.bfloat16, dict(alibi="bh")),
    (2, 1000, 1100, 4, 2, 128, True, torch.bfloat16, dict(sinks=True)),
    (1, 300, 1300, 3, 1, 64, False, torch.float16, dict(sinks=True)),
    (1, 1000, 1000, 4, 2, 128, True, torch.bfloat16, dict(window_size=(300, 0), alibi="h", softcap=10.0,
                                                          sinks=True)),
    (2, 650, 1234, 4, 1, 64, False, torch.bfloat16, dict(window_size=(250, 60), alibi="bh", softcap=15.0,
                                                         sinks=True)),
    (1, 1, 3000, 4, 2, 128, False, torch.bfloat16, dict(window_size=(1000, 0), alibi="h", softcap=25.0)),
    # More work items than SMs: the persistent programs loop over several tiles.
    (2, 3000, 3100, 16, 4, 128, True, torch.bfloat16, dict(window_size=(1024, 0), softcap=30.0)),
    (2, 2100, 1900, 16, 8, 64, False, torch.float16, dict(alibi="h", sinks=True)),
    # Causal d128 with a softcap: two query buffers on the dynamic schedule (hopper_fwd.attention_forward), Sq > Sk.
    (2, 2000, 1900, 16, 4, 128, True, torch.bfloat16, dict(softcap=30.0)),
    # d256: 64-row key blocks, one query buffer, the output stored from registers.
    (2, 1000, 1100, 4, 2, 256, True, torch.bfloat16, dict(window_size=(200, 0))),
    (1, 1100, 1000, 4, 4, 256, False, torch.float16, dict(softcap=30.0, alibi="bh")),
    (2, 700, 900, 4, 2, 256, True, torch.bfloat16, dict(sinks=True, window_size=(-1, 0))),
    (1, 700, 900, 4, 2, 256, False, torch.bfloat16, dict(window_size=(0, 0))),
    # d96 and d192 on d128's and d256's tiles.
    (2, 1000, 1100, 4, 2, 96, True, torch.bfloat16, dict(window_size=(200, 0), softcap=20.0, sinks=True)),
    (1, 900, 700, 4, 2, 96, False, torch.float16, dict(alibi="h")),
    (2, 1000, 1100, 4, 2, 192, True, torch.bfloat16, dict(softcap=30.0, alibi="bh", sinks=True)),
]


def _cid(b, sq, sk, h, hk, d, causal, dtype, feats):
    names = "-".join(f"{k}{v}" for k, v in feats.items()).replace(" ", "").replace("window_size", "w")
    return f"B{b}-Sq{sq}-Sk{sk}-H{h}-Hk{hk}-D{d}-{'causal' if causal else 'full'}-{str(dtype)[6:]}-{names}"


@pytest.mark.parametrize("b,sq,sk,h,hk,d,causal,dtype,feats", [pytest.param(*c, id=_cid(*c)) for c in CASES])
def test_against_reference(poison, spy, b, sq, sk, h, hk, d, causal, dtype, feats):
    q, k, v = make_qkv(b, sq, sk, h, hk, d, dtype, device=DEVICE, seed=sq + sk + d, grad=False)
    kw = _features(b, h, sq, **feats)
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, **kw)
    assert len(spy) == 1, "the call did not take the Gluon forward"
    assert out.isfinite().all()
    dout = torch.zeros_like(q)
    check_against_reference((out, lse, None, None, None), q, k, v, dout, d ** -0.5, causal, sk - sq, **kw)


@pytest.mark.parametrize("d", (64, 128, 256))
def test_matches_portable_kernel(monkeypatch, spy, d):
    q, k, v = make_qkv(2, 1500, 1700, 4, 2, d, torch.bfloat16, device=DEVICE, seed=d, grad=False)
    kw = _features(2, 4, d, alibi="bh", sinks=True, window_size=(400, 0), softcap=12.0)
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, **kw)
    monkeypatch.setattr(SETTINGS, "gluon_forward", False)
    out_p, lse_p, _ = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, **kw)
    assert len(spy) == 1
    assert (out.float() - out_p.float()).abs().max().item() <= 2 ** -7
    finite = torch.isfinite(lse_p)
    assert torch.equal(finite, torch.isfinite(lse))
    assert (lse[finite] - lse_p[finite]).abs().max().item() <= 1e-3


@pytest.mark.parametrize("d", (64, 96, 128, 192, 256))
def test_one_key_per_row_is_exact(spy, d):
    # window (0, 0): row i sees key i + Sk - Sq alone, so its output is that row of v, bit for bit. The rows' first
    # blocks are fully masked, which once let m = 0 join the max and scale P off 1.
    q, k, v = make_qkv(2, 500, 700, 4, 2, d, torch.bfloat16, device=DEVICE, seed=d, grad=False)
    out = flashtile.flash_attn_func(q, k, v, window_size=(0, 0))
    assert len(spy) == 1
    expect = v[:, 200:].repeat_interleave(2, dim=2)
    assert torch.equal(out, expect)


def test_rows_without_keys(poison, spy):
    # Sq > Sk with a narrow window: rows 0..Sq-Sk-w-1 see no key. Without sinks they output 0 with LSE -inf; with
    # a sink they output 0 with LSE = the sink.
    q, k, v = make_qkv(1, 600, 200, 2, 2, 128, torch.bfloat16, device=DEVICE, seed=2, grad=False)
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, window_size=(10, 0), return_attn_probs=True)
    empty = 600 - 200  # rows i < Sq - Sk see no key (causal, bottom-right)
    assert torch.equal(out[:, :empty], torch.zeros_like(out[:, :empty]))
    assert torch.isneginf(lse[:, :, :empty]).all() and torch.isfinite(lse[:, :, empty:]).all()
    sinks = torch.tensor([0.5, -1.0], device=DEVICE)
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, window_size=(10, 0), sinks=sinks,
                                            return_attn_probs=True)
    assert torch.equal(out[:, :empty], torch.zeros_like(out[:, :empty]))
    assert torch.allclose(lse[0, :, :empty], sinks[:, None].expand(2, empty))
    assert len(spy) == 2


@pytest.mark.serial
def test_window_skips_blocks(spy):
    # A causal window of 1024 at 16k keys visits ~1/8 of the key blocks of causal attention: well over 3x faster.
    # (serial: a timing, which other tests' kernels on the same GPU can skew.)
    import triton
    q, k, v = make_qkv(1, 16384, 16384, 16, 16, 128, torch.bfloat16, device=DEVICE, seed=0, grad=False)
    full = triton.testing.do_bench(lambda: flashtile.flash_attn_func(q, k, v, causal=True), warmup=5, rep=20)
    band = triton.testing.do_bench(lambda: flashtile.flash_attn_func(q, k, v, causal=True, window_size=(1024, 0)),
                                   warmup=5, rep=20)
    assert full / band > 3.0, (full, band)
    assert len(spy) > 0


# ---------------------------------------------------------------------------------------------------------------
# attn_mask: a float bias or a bool mask, by TMA into a ring of its own (bool: only the listed key blocks)
# ---------------------------------------------------------------------------------------------------------------

def _mask(kind, shape, seed, device=DEVICE):
    """A bool mask of the given kind: "random" (60% attended), "causal" (bottom-right), "docs" (documents of 300
    keys, causal inside: whole key blocks invisible to whole query tiles), "ones" (all attended: no tile read but
    for the row below). Whole blocks under the diagonal are entirely visible (no tile read either)."""
    gen = torch.Generator(device).manual_seed(seed)
    sq, sk = shape[-2:]
    i = torch.arange(sq, device=device)[:, None] + sk - sq
    j = torch.arange(sk, device=device)[None, :]
    if kind == "random":
        mask = torch.rand(shape, generator=gen, device=device) < 0.6
    elif kind == "causal":
        mask = (j <= i).expand(shape).clone()
    elif kind == "ones":
        mask = torch.ones(shape, dtype=torch.bool, device=device)
    else:
        mask = ((j // 300 == i.clamp(min=0) // 300) & (j <= i)).expand(shape).clone()
    if sq > 3:
        mask[..., 3, :] = False  # a row that attends nothing: 0 and LSE -inf, not NaN
    return mask


BIAS_CASES = [
    # b, sq, sk, h, hk, d, causal, dtype, attn_mask (kind, shape over (B, H)), features
    (2, 1000, 1104, 4, 2, 128, False, torch.bfloat16, ("float", (2, 4)), {}),
    (1, 1100, 1000, 4, 4, 64, False, torch.float16, ("float", (1, 1)), {}),
    (2, 777, 784, 4, 2, 128, True, torch.bfloat16, ("float", (1, 4)), dict(softcap=15.0, alibi="h")),
    (2, 600, 904, 2, 1, 64, False, torch.bfloat16, ("float", (2, 1)), dict(window_size=(300, 50), sinks=True)),
    (1, 1, 3000, 4, 2, 128, False, torch.float16, ("float", (1, 4)), {}),
    (2, 1000, 1104, 4, 2, 128, False, torch.bfloat16, ("random", (2, 4)), {}),
    (1, 1500, 1504, 4, 2, 64, False, torch.float16, ("causal", (1, 1)), {}),
    (2, 1300, 1504, 4, 1, 128, False, torch.bfloat16, ("docs", (1, 1)), dict(alibi="bh", sinks=True)),
    (1, 1200, 1008, 2, 2, 128, True, torch.bfloat16, ("random", (1, 2)), dict(window_size=(200, 0))),
    (2, 900, 1600, 4, 2, 64, False, torch.bfloat16, ("docs", (2, 1)), dict(softcap=20.0)),
    (1, 1000, 1024, 4, 2, 128, False, torch.bfloat16, ("ones", (1, 1)), dict(alibi="h")),
    # More work items than SMs.
    (2, 3000, 3008, 16, 4, 128, False, torch.bfloat16, ("float", (1, 16)), {}),
    # A float mask shared by the heads: items in groups of hopper_fwd.HEAD_GROUP heads, the last group short (12
    # heads), under causal (tiles last first) with more items than SMs, and at d64.
    (2, 1000, 1104, 12, 4, 128, False, torch.bfloat16, ("float", (2, 1)), {}),
    (1, 3000, 3008, 16, 16, 128, True, torch.bfloat16, ("float", (1, 1)), {}),
    (2, 700, 712, 6, 3, 64, False, torch.float16, ("float", (1, 1)), dict(softcap=10.0)),
    (2, 2100, 2112, 16, 8, 64, True, torch.float16, ("random", (2, 16)), {}),
    # Head dims on d96's and d128's paths (hopper_fwd.kernel_dim).
    (2, 777, 784, 4, 2, 80, True, torch.bfloat16, ("float", (1, 4)), dict(softcap=15.0, alibi="h")),
    (2, 1300, 1504, 4, 1, 112, False, torch.bfloat16, ("docs", (1, 1)), dict(alibi="bh", sinks=True)),
]


def _bias_cid(b, sq, sk, h, hk, d, causal, dtype, mask, feats):
    return _cid(b, sq, sk, h, hk, d, causal, dtype, feats) + f"-{mask[0]}{mask[1][0]}x{mask[1][1]}"


def _attn_mask(kind, bh, sq, sk, dtype, seed):
    """(attn_mask tensor, the oracle's keyword for it)."""
    if kind == "float":
        gen = torch.Generator(DEVICE).manual_seed(seed)
        bias = (torch.randn((*bh, sq, sk), generator=gen, device=DEVICE) * 2).to(dtype)
        bias[..., 5] = float("-inf")  # -inf entries mask keys too
        if sq > 2:
            bias[..., 2, :] = float("-inf")  # a row that attends nothing
        return bias, "attn_bias"
    return _mask(kind, (*bh, sq, sk), seed), "attn_mask"


@pytest.mark.parametrize("b,sq,sk,h,hk,d,causal,dtype,mask,feats",
                         [pytest.param(*c, id=_bias_cid(*c)) for c in BIAS_CASES])
def test_attn_mask_against_reference(poison, spy, b, sq, sk, h, hk, d, causal, dtype, mask, feats):
    q, k, v = make_qkv(b, sq, sk, h, hk, d, dtype, device=DEVICE, seed=sq + sk + d, grad=False)
    kw = _features(b, h, sq, **feats)
    bias, name = _attn_mask(*mask, sq, sk, dtype, seed=sq * d)
    window = kw.pop("window_size", (-1, -1))
    out, lse = attention_op(q, k, v, d ** -0.5, causal, sk - sq, window_size=window, attn_bias=bias, **kw)
    assert len(spy) == 1, "the call did not take the Gluon forward"
    assert out.isfinite().all()
    empty_row = 2 if name == "attn_bias" else 3
    if sq > empty_row:
        assert torch.equal(out[:, empty_row], torch.zeros_like(out[:, empty_row]))
        if "sinks" not in kw:
            assert torch.isneginf(lse[:, :, empty_row]).all()
    check_against_reference((out, lse, None, None, None), q, k, v, torch.zeros_like(q), d ** -0.5, causal, sk - sq,
                            window_size=window, **kw, **{name: bias})


@pytest.mark.parametrize("kind", ("float", "docs"))
def test_attn_mask_matches_portable_kernel(monkeypatch, spy, kind):
    q, k, v = make_qkv(2, 1500, 1700 - 4, 4, 2, 128, torch.bfloat16, device=DEVICE, seed=7, grad=False)
    bias, _ = _attn_mask(kind, (2, 1), 1500, 1696, torch.bfloat16, seed=8)
    sdpa = (lambda: flashtile.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           attn_mask=bias, enable_gqa=True))
    out = sdpa()
    monkeypatch.setattr(SETTINGS, "gluon_forward", False)
    out_p = sdpa()
    assert len(spy) == 1
    assert (out.float() - out_p.float()).abs().max().item() <= 2 ** -7


def test_bool_mask_skips_blocks(spy):
    # Documents of 300 keys: the values of the first document are NaN, and the query tiles of later documents
    # must not load them (a visited block multiplies its NaNs by P = 0 and gets NaN).
    q, k, v = make_qkv(1, 2000, 2000, 4, 4, 128, torch.bfloat16, device=DEVICE, seed=3, grad=False)
    mask = _mask("docs", (1, 1, 2000, 2000), 4)
    v[:, :256] = float("nan")  # key blocks 0 and 1 (of 128): reached only by query rows < 600
    out = flashtile.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 attn_mask=mask).transpose(1, 2)
    assert len(spy) == 1
    assert out[:, 640:].isfinite().all()  # query tiles of 128 rows from row 640 on see neither block


def test_unaligned_attn_mask_falls_back(spy):
    # Sk = 1001: the mask's rows are not 16-byte aligned for TMA, so the portable kernel takes the call.
    q, k, v = make_qkv(1, 300, 1001, 2, 2, 64, torch.bfloat16, device=DEVICE, seed=5, grad=False)
    bias, _ = _attn_mask("float", (1, 1), 300, 1001, torch.bfloat16, seed=6)
    out = flashtile.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 attn_mask=bias)
    assert len(spy) == 0 and out[:, :, 3:].isfinite().all()


@pytest.mark.parametrize("kind,softcap", [("float", 0.0), ("float", 20.0), ("random", 0.0)])
def test_attn_mask_reads_are_repeatable(spy, kind, softcap):
    # The mask ring's slots are refilled by TMA as soon as the consumers release them. A mask broadcast over
    # batch and heads stays in L2, so refills come back fast: a release that does not order the tile's read
    # before the refill (hopper_fwd._read_bias) gives rows of the next tile's values, differing run to run. Each
    # path once: the bias as the accumulator's start, the bias after a softcap, a bool mask.
    b, s, h, d = 2, 2048, 16, 128
    q, k, v = make_qkv(b, s, s, h, h, d, torch.bfloat16, device=DEVICE, seed=11, grad=False)
    bias, _ = _attn_mask(kind, (1, 1), s, s, torch.bfloat16, seed=12)
    first, _ = attention_op(q, k, v, d ** -0.5, False, 0, attn_bias=bias, softcap=softcap)
    first = first.clone()
    for _ in range(10):
        out, _ = attention_op(q, k, v, d ** -0.5, False, 0, attn_bias=bias, softcap=softcap)
        assert torch.equal(out, first)
    assert len(spy) == 11


@pytest.mark.parametrize("kind", ("float", "random"))
def test_expanded_attn_mask(poison, spy, kind):
    # Batch and head dims expanded from size 1 (stride 0: no TMA stride) are read as broadcast ones; a mask
    # expanded along the queries has no valid row stride for TMA and takes the portable kernel.
    b, sq, sk, h, d = 2, 700, 912, 4, 128
    q, k, v = make_qkv(b, sq, sk, h, 2, d, torch.bfloat16, device=DEVICE, seed=9, grad=False)
    bias, name = _attn_mask(kind, (1, 1), sq, sk, torch.bfloat16, seed=10)
    full = bias.expand(b, h, sq, sk)
    out, lse = attention_op(q, k, v, d ** -0.5, False, 0, attn_bias=full)
    assert len(spy) == 1
    check_against_reference((out, lse, None, None, None), q, k, v, torch.zeros_like(q), d ** -0.5, False, 0,
                            **{name: bias})
    rows = bias[:, :, :1].expand(b, h, sq, sk)  # every query sees the first query's keys
    out, lse = attention_op(q, k, v, d ** -0.5, False, 0, attn_bias=rows)
    assert len(spy) == 1, "a mask expanded along the queries must take the portable kernel"
    check_against_reference((out, lse, None, None, None), q, k, v, torch.zeros_like(q), d ** -0.5, False, 0,
                            **{name: rows})


# Varlen: packed [total, H, D] sequences, each judged against the oracle on that sequence alone.

def _varlen_qkv(lens_q, lens_k, h, hk, d, dtype, seed):
    q, k, v = make_qkv(1, sum(lens_q), sum(lens_k), h, hk, d, dtype, device=DEVICE, seed=seed, grad=False)
    return q[0], k[0], v[0], cu_seqlens(lens_q, DEVICE), cu_seqlens(lens_k, DEVICE)


_RAND = torch.Generator().manual_seed(5)
VARLEN_CASES = [
    # lens_q, lens_k, h, hk, d, causal, dtype, features
    ([300, 0, 1, 1000, 129, 64, 700], [300, 17, 1, 1000, 500, 0, 650], 4, 2, 128, True, torch.bfloat16, {}),
    ([300, 0, 1, 1000, 129, 64, 700], [300, 17, 1, 1000, 500, 0, 650], 4, 2, 128, False, torch.float16, {}),
    # Plain d64: 192-row tiles over three warpgroups, and a band.
    ([191, 192, 193, 5, 900], [200, 192, 1, 5, 1000], 4, 1, 64, False, torch.bfloat16, dict(window_size=(100, 20))),
    ([191, 192, 193, 5, 900], [200, 192, 1, 5, 1000], 2, 2, 64, True, torch.float16,
     dict(softcap=10.0, alibi="bh", sinks=True)),
    ([77, 640, 1, 333], [1000, 640, 64, 1], 4, 2, 128, True, torch.bfloat16,
     dict(window_size=(150, 0), alibi="h", sinks=True)),
    # Many sequences and heads: more items than SMs, and the map's count over several chunks.
    (torch.randint(0, 400, (90,), generator=_RAND).tolist(), torch.randint(0, 400, (90,), generator=_RAND).tolist(),
     16, 4, 128, False, torch.bfloat16, {}),
    (torch.randint(0, 300, (70,), generator=_RAND).tolist(), torch.randint(0, 300, (70,), generator=_RAND).tolist(),
     8, 8, 64, True, torch.bfloat16, dict(softcap=30.0)),
    (torch.randint(0, 500, (40,), generator=_RAND).tolist(), torch.randint(0, 500, (40,), generator=_RAND).tolist(),
     8, 2, 128, True, torch.bfloat16, dict(softcap=20.0)),
]


@pytest.mark.parametrize("lens_q,lens_k,h,hk,d,causal,dtype,feats", VARLEN_CASES,
                         ids=[f"varlen{i}-D{c[4]}-{'causal' if c[5] else 'full'}" for i, c in enumerate(VARLEN_CASES)])
def test_varlen_against_reference(poison, spy, lens_q, lens_k, h, hk, d, causal, dtype, feats):
    q, k, v, cu_q, cu_k = _varlen_qkv(lens_q, lens_k, h, hk, d, dtype, seed=len(lens_q) + d)
    kw = _features(len(lens_q), h, d, **feats)
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                                   return_attn_probs=True, **kw)
    assert len(spy) == 1, "the call did not take the Gluon forward"
    assert out.shape == q.shape and lse.shape == (h, q.shape[0])
    check_varlen_against_reference((out, lse, None, None, None), q, k, v, None, cu_q, cu_k, causal, **kw)


def test_varlen_matches_portable_and_padded(monkeypatch, spy):
    """The same sequences through the portable varlen kernel and, one at a time, the fixed-length Gluon kernel."""
    lens = [500, 3, 1, 257, 128, 1000]
    q, k, v, cu_q, cu_k = _varlen_qkv(lens, lens, 4, 2, 128, torch.bfloat16, seed=9)
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_q, 1000, 1000, causal=True,
                                                   return_attn_probs=True)
    bounds = cu_q.tolist()
    for i in range(len(lens)):
        s = slice(bounds[i], bounds[i + 1])
        o_i, lse_i, _ = flashtile.flash_attn_func(q[s][None], k[s][None], v[s][None], causal=True,
                                                  return_attn_probs=True)
        assert torch.equal(out[s], o_i[0]) and torch.equal(lse[:, s], lse_i[0])
    assert len(spy) == 1 + len(lens)
    monkeypatch.setattr(SETTINGS, "gluon_forward", False)
    out_p, lse_p, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_q, 1000, 1000, causal=True,
                                                       return_attn_probs=True)
    assert (out.float() - out_p.float()).abs().max().item() <= 2 ** -7
    assert (lse - lse_p).abs().max().item() <= 1e-3


def test_varlen_packed_qkv(poison, spy):
    """flash_attn_varlen_qkvpacked_func: q, k, v are strided views of one [total, 3, H, D] tensor."""
    lens = [130, 0, 700, 64]
    cu = cu_seqlens(lens, DEVICE)
    gen = torch.Generator(DEVICE).manual_seed(4)
    qkv = torch.randn(sum(lens), 3, 4, 64, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    out, lse, _ = flashtile.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), causal=True,
                                                             return_attn_probs=True)
    assert len(spy) == 1
    check_varlen_against_reference((out, lse, None, None, None), *qkv.unbind(1), None, cu, cu, True)
