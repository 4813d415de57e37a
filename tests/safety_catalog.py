"""The safety catalog: bad and edge argument values for flashtile's public functions (docs/safety.md).

Each case is a small call that must either raise a clear error (ValueError/TypeError whose message names the bad
value) or give the float64 reference's result; a bad value must never be accepted silently, read or write memory the
call does not own, or crash the process. Outputs of the kernels' launchers are NaN-poisoned, so rows a kernel leaves
unwritten fail. NaN or inf inputs may give NaN exactly where torch's own SDPA does.

tests/test_safety.py runs the catalog in subprocesses in both CPU modes, the pure-PyTorch reference path (no
TRITON_INTERPRET) and the real kernels in Triton's interpreter (TRITON_INTERPRET=1), so that a crash fails its case
instead of killing pytest. By hand:

    TRITON_INTERPRET=1 python tests/safety_catalog.py [--list] [name or prefix ...]

prints {"start": name} before each case and {"case": name, "status": ..., "detail": ...} after it, one JSON object a
line; status is "pass", "wrong" (a silently wrong result, or a bad value accepted) or "unclear" (an exception that is
not a clear ValueError/TypeError). A case that kills the process has a start line and no result.
"""
import json
import re
import sys
import traceback

import torch

import flashtile
from flashtile import reference, testing
from flashtile.reference import kvcache as ref_kv

F32 = torch.float32
BIG = 2 ** 63 - 1
CLEAR_ERRORS = (ValueError, TypeError)

CASES = {}  # name -> (class, function)


def case(cls, name=None):
    def register(fn):
        CASES[f"{cls}/{name or fn.__name__}"] = (cls, fn)
        return fn
    return register


def add(cls, name, fn):
    CASES[f"{cls}/{name}"] = (cls, fn)


# -----------------------------------------------------------------------------------------------------------------
# Judging


def raises(fn, match, types=CLEAR_ERRORS):
    """fn() must raise one of `types` whose message matches `match` (a regex naming the bad value)."""
    try:
        fn()
    except types as e:
        if not re.search(match, str(e)):
            raise AssertionError(f"the error does not name the problem ({match!r}): {type(e).__name__}: {e}")
        return e
    except Exception as e:  # noqa: BLE001 - anything else is not a clear error
        raise UnclearError(f"{type(e).__name__}: {e}") from e
    raise AssertionError("no error: the bad value was accepted silently")


class UnclearError(Exception):
    """An exception that is not a ValueError/TypeError naming the value."""


def close(name, got, ref64, plain):
    testing.assert_close(name, got, ref64, plain, plain.dtype)


def close_nan_like_sdpa(name, got, ref64, plain, sdpa):
    """got may be NaN exactly where torch's SDPA is NaN; everywhere else it must match the reference."""
    allowed = torch.isnan(sdpa)
    extra = torch.isnan(got) & ~allowed
    assert not extra.any(), f"{name}: NaN at {int(extra.sum())} elements where torch SDPA is finite"
    keep = ~allowed
    close(name, torch.where(keep, got, 0), torch.where(keep, ref64, 0), torch.where(keep, plain, 0))


def randn(*shape, seed=0, dtype=F32):
    gen = torch.Generator().manual_seed(seed + 17 * len(shape) + sum(shape))
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)


# -----------------------------------------------------------------------------------------------------------------
# Fixed length and windows


def qkv(b=1, sq=9, sk=13, h=2, hk=1, d=16, seed=0, grad=False):
    q, k, v = randn(b, sq, h, d, seed=seed), randn(b, sk, hk, d, seed=seed + 1), randn(b, sk, hk, d, seed=seed + 2)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def band(sq, sk, offset, left, right):
    """The visible keys of a (left, right) window, evaluated with Python's unbounded ints: independent of the
    reference's band_mask. -1 is unbounded."""
    keep = torch.zeros(sq, sk, dtype=torch.bool)
    for i in range(sq):
        for j in range(sk):
            keep[i, j] = (left < 0 or j >= i + offset - left) and (right < 0 or j <= i + offset + right)
    return keep


def oracle(q, k, v, mask=None, dout=None, **kw):
    """(out, grads or None) of the naive reference with an explicit bool mask, float64 and q's dtype."""
    results = []
    for dtype in (torch.float64, q.dtype):
        qq, kk, vv = (t.detach().to(dtype).requires_grad_(dout is not None) for t in (q, k, v))
        out, lse = reference.naive_attention(qq, kk, vv, attn_mask=mask, **kw)
        grads = None
        if dout is not None:
            grads = torch.autograd.grad((out * dout.to(dtype)).sum(), (qq, kk, vv))
        results.append((out.detach(), lse.detach(), grads))
    return results


def check_window(window, causal=False, sq=9, sk=13, grad=False, seed=0):
    q, k, v = qkv(sq=sq, sk=sk, seed=seed, grad=grad)
    right = 0 if causal else window[1]
    mask = band(sq, sk, sk - sq, window[0], right)
    out = flashtile.flash_attn_func(q, k, v, causal=causal, window_size=window)
    dout = randn(*out.shape, seed=seed + 5) if grad else None
    (ref, _, ref_g), (plain, _, plain_g) = oracle(q, k, v, mask, dout)
    close("out", out, ref, plain)
    if grad:
        got = torch.autograd.grad((out * dout).sum(), (q, k, v))
        for name, g, r, p in zip(("dq", "dk", "dv"), got, ref_g, plain_g):
            close(name, g, r, p)


WINDOWS = {
    "int64-max-both": ((BIG, BIG), False),
    "int64-max-left-causal": ((BIG, 0), True),
    "int64-max-right": ((3, BIG), False),
    "2^31-both": ((2 ** 31, 2 ** 31), False),
    "2^31-1-both": ((2 ** 31 - 1, 2 ** 31 - 1), False),
    "2^31-1-left-causal": ((2 ** 31 - 1, -1), True),
    "2^31-right-left0": ((0, 2 ** 31), False),
    "2^32+3-left": ((2 ** 32 + 3, 1), False),
    "2^64-beyond-int64": ((2 ** 64, 2 ** 64), False),
    "exactly-sk-1": ((12, 8), False),
    "one-short": ((11, 7), False),
}
for _name, (_window, _causal) in WINDOWS.items():
    add("window", f"func-{_name}", lambda w=_window, c=_causal: check_window(w, c))
for _name, _window, _sq, _sk in (("sq>sk", (2 ** 31, 0), 13, 5), ("sq<sk", (BIG, 2 ** 31 + 1), 4, 17)):
    add("window", f"func-{_name}", lambda w=_window, a=_sq, b=_sk: check_window(w, False, a, b))
add("window", "func-backward-int64-max", lambda: check_window((BIG, 0), True, grad=True))
add("window", "func-backward-2^31", lambda: check_window((2 ** 31, 2 ** 31 - 1), False, grad=True))


@case("window")
def window_negative():
    q, k, v = qkv()
    raises(lambda: flashtile.flash_attn_func(q, k, v, window_size=(-2, 0)), r"window_size")


@case("window")
def window_float():
    q, k, v = qkv()
    raises(lambda: flashtile.flash_attn_func(q, k, v, window_size=(4.0, 0)), r"window_size")


@case("window")
def reference_naive_int64_max():
    """flashtile.reference.naive_attention itself with windows past int64's reach of i + offset + right."""
    q, k, v = qkv(sq=7, sk=11)
    for window, causal in (((BIG, BIG), False), ((BIG, 0), True), ((2 ** 31, 2 ** 62), False), ((0, BIG), False)):
        right = 0 if causal else window[1]
        mask = band(7, 11, 4, window[0], right)
        got, _ = reference.naive_attention(q.double(), k.double(), v.double(), causal=causal, window_size=window)
        want, _ = reference.naive_attention(q.double(), k.double(), v.double(), attn_mask=mask)
        close(f"window {window}", got, want, want)


@case("window")
def reference_naive_huge_offset():
    """A diagonal_offset far past the sequences (every key visible under causal) in the reference."""
    q, k, v = qkv(sq=5, sk=6)
    got, _ = reference.naive_attention(q.double(), k.double(), v.double(), causal=True, diagonal_offset=BIG)
    want, _ = reference.naive_attention(q.double(), k.double(), v.double())
    close("out", got, want, want)
    # offset + right = 0: top-left causal; offset - left far below every key: no left edge.
    got, _ = reference.naive_attention(q.double(), k.double(), v.double(), window_size=(BIG, BIG),
                                       diagonal_offset=-BIG)
    want, _ = reference.naive_attention(q.double(), k.double(), v.double(), causal=True, diagonal_offset=0)
    close("out", got, want, want)


def varlen_inputs(lens_q, lens_k, h=2, hk=1, d=16, seed=0, grad=False):
    q = randn(sum(lens_q), h, d, seed=seed)
    k, v = randn(sum(lens_k), hk, d, seed=seed + 1), randn(sum(lens_k), hk, d, seed=seed + 2)
    q, k, v = (t.requires_grad_(grad) for t in (q, k, v))
    return q, k, v, testing.cu_seqlens(lens_q), testing.cu_seqlens(lens_k), max(lens_q), max(lens_k)


def check_varlen_window(window, causal, lens_q=(5, 0, 7), lens_k=(6, 3, 4), grad=False):
    q, k, v, cu_q, cu_k, mq, mk = varlen_inputs(lens_q, lens_k, grad=grad)
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=causal, window_size=window,
                                                   return_attn_probs=True)
    grads = (None, None, None)
    dout = None
    if grad:
        dout = randn(*out.shape, seed=9)
        grads = torch.autograd.grad((out * dout).sum(), (q, k, v))
    # Unbounded sides are unbounded: the reference with (-1, -1) sides and causal.
    testing.check_varlen_against_reference((out, lse, *grads), q, k, v, dout, cu_q, cu_k, causal)


add("window", "varlen-int64-max-causal", lambda: check_varlen_window((BIG, BIG), True))
add("window", "varlen-2^31-both", lambda: check_varlen_window((2 ** 31, 2 ** 31), False))
add("window", "varlen-backward-2^31-1", lambda: check_varlen_window((2 ** 31 - 1, BIG), False, grad=True))


@case("window")
def reference_varlen_int64_max():
    q, k, v, cu_q, cu_k, _, _ = varlen_inputs((4, 6), (7, 2))
    got, _ = reference.naive_attention_varlen(q.double(), k.double(), v.double(), cu_q, cu_k, causal=True,
                                              window_size=(BIG, BIG))
    want, _ = reference.naive_attention_varlen(q.double(), k.double(), v.double(), cu_q, cu_k, causal=True)
    close("out", got, want, want)


# -----------------------------------------------------------------------------------------------------------------
# Varlen offsets

BASE_Q, BASE_K = (5, 4, 3), (6, 1, 3)  # cu_q [0, 5, 9, 12], cu_k [0, 6, 7, 10]
BAD_CU = {
    "decreasing": ([0, 9, 5, 12], [0, 7, 6, 10]),
    "negative": ([0, -2, 9, 12], [0, -1, 7, 10]),
    "start-not-0": ([2, 5, 9, 12], [1, 6, 7, 10]),
    "start-negative": ([-3, 5, 9, 12], [-4, 6, 7, 10]),
    "end-before-rows": ([0, 5, 9, 11], [0, 6, 7, 9]),
    "end-after-rows": ([0, 5, 9, 13], [0, 6, 7, 11]),
    "end-far-after": ([0, 5, 9, 100000], [0, 6, 7, 100000]),
    "int32-max": ([0, 5, 9, 2 ** 31 - 1], [0, 6, 7, 2 ** 31 - 1]),
    "all-zero": ([0, 0, 0, 0], [0, 0, 0, 0]),
}


def bad_cu(which, name, fn_name="varlen"):
    q, k, v, cu_q, cu_k, mq, mk = varlen_inputs(BASE_Q, BASE_K)
    bad = torch.tensor(BAD_CU[name][0 if which == "q" else 1], dtype=torch.int32)
    arg = f"cu_seqlens_{which}"
    if which == "q":
        cu_q = bad
    else:
        cu_k = bad
    if fn_name == "varlen":
        call = lambda: flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 12, 12)  # noqa: E731
    elif fn_name == "kvpacked":
        kv = torch.stack((k, v), dim=1)
        call = lambda: flashtile.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, 12, 12)  # noqa: E731
    else:  # qkvpacked: q, k, v share cu_seqlens (q's rows)
        qkv_ = randn(12, 3, 2, 16)
        arg = "cu_seqlens"
        call = lambda: flashtile.flash_attn_varlen_qkvpacked_func(qkv_, bad, 12)  # noqa: E731
    raises(call, arg)


for _name in BAD_CU:
    add("varlen", f"cu_q-{_name}", lambda n=_name: bad_cu("q", n))
    add("varlen", f"cu_k-{_name}", lambda n=_name: bad_cu("k", n))
for _name in ("decreasing", "end-after-rows", "negative"):
    add("varlen", f"qkvpacked-{_name}", lambda n=_name: bad_cu("q", n, "qkvpacked"))
    add("varlen", f"kvpacked-cu_k-{_name}", lambda n=_name: bad_cu("k", n, "kvpacked"))


def bad_max(which, value, match):
    q, k, v, cu_q, cu_k, mq, mk = varlen_inputs(BASE_Q, BASE_K)
    kw = dict(max_seqlen_q=mq, max_seqlen_k=mk)
    kw[f"max_seqlen_{which}"] = value
    raises(lambda: flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, **kw), match)


add("varlen", "max_seqlen_q-too-small", lambda: bad_max("q", 4, r"max_seqlen_q"))
add("varlen", "max_seqlen_k-too-small", lambda: bad_max("k", 5, r"max_seqlen_k"))
add("varlen", "max_seqlen_q-zero", lambda: bad_max("q", 0, r"max_seqlen_q"))
add("varlen", "max_seqlen_k-zero", lambda: bad_max("k", 0, r"max_seqlen_k"))
add("varlen", "max_seqlen_q-negative", lambda: bad_max("q", -1, r"max_seqlen_q"))
add("varlen", "max_seqlen_k-float", lambda: bad_max("k", 6.0, r"max_seqlen_k"))
add("varlen", "max_seqlen_q-tensor", lambda: bad_max("q", torch.tensor(5), r"max_seqlen_q"))


def check_varlen(lens_q, lens_k, causal=False, max_q=None, max_k=None, grad=False, window=(-1, -1), cu=None,
                 alibi=False):
    q, k, v, cu_q, cu_k, mq, mk = varlen_inputs(lens_q, lens_k, grad=grad)
    if cu is not None:
        cu_q, cu_k = cu(cu_q), cu(cu_k)
    slopes = torch.rand(len(lens_q), 2) if alibi else None
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q or mq, max_k or mk, causal=causal,
                                                   window_size=window, alibi_slopes=slopes, return_attn_probs=True)
    grads, dout = (None, None, None), None
    if grad:
        dout = randn(*out.shape, seed=3)
        grads = torch.autograd.grad((out * dout).sum(), (q, k, v))
    testing.check_varlen_against_reference((out, lse, *grads), q, k, v, dout, cu_q.contiguous(), cu_k.contiguous(),
                                           causal, alibi_slopes=slopes)


add("varlen", "max_seqlen-larger", lambda: check_varlen(BASE_Q, BASE_K, causal=True, max_q=40, max_k=33))
add("varlen", "max_seqlen-huge", lambda: check_varlen(BASE_Q, BASE_K, max_q=2 ** 31 - 1, max_k=BIG))
add("varlen", "len0-q-middle", lambda: check_varlen((5, 0, 3), (6, 2, 3), causal=True))
add("varlen", "len0-k-middle", lambda: check_varlen((5, 2, 3), (6, 0, 3), causal=True))
add("varlen", "len0-both-first", lambda: check_varlen((0, 4, 3), (0, 5, 2)))
add("varlen", "len0-q-last", lambda: check_varlen((4, 3, 0), (5, 2, 6), causal=True))
add("varlen", "len0-many-k", lambda: check_varlen((3, 2, 4, 1), (0, 0, 5, 0)))
add("varlen", "len0-backward", lambda: check_varlen((5, 0, 3, 2), (6, 2, 0, 3), causal=True, grad=True))
add("varlen", "len0-alibi-per-seq", lambda: check_varlen((5, 0, 3), (6, 2, 0), causal=True, alibi=True))
add("varlen", "sq>sk-causal", lambda: check_varlen((9, 2), (3, 2), causal=True, grad=True))
add("varlen", "non-contiguous-cu", lambda: check_varlen((5, 4, 3), (6, 1, 3), cu=lambda c: torch.stack(
    (c, torch.full_like(c, -7)), dim=1)[:, 0]))
add("varlen", "one-sequence", lambda: check_varlen((11,), (7,), causal=True))


def cu_type(value, match):
    q, k, v, cu_q, cu_k, mq, mk = varlen_inputs(BASE_Q, BASE_K)
    raises(lambda: flashtile.flash_attn_varlen_func(q, k, v, value(cu_q), cu_k, mq, mk), match)


add("types", "cu-int64", lambda: cu_type(lambda c: c.long(), r"cu_seqlens_q.*int32"))
add("types", "cu-float", lambda: cu_type(lambda c: c.float(), r"cu_seqlens_q.*int32"))
add("types", "cu-bool", lambda: cu_type(lambda c: c.bool(), r"cu_seqlens_q.*int32"))
add("types", "cu-2d", lambda: cu_type(lambda c: c[None], r"cu_seqlens_q.*1-D"))
add("types", "cu-list", lambda: cu_type(lambda c: c.tolist(), r"cu_seqlens_q must be a torch.Tensor"))
add("types", "cu-batch0", lambda: cu_type(lambda c: c[:1], r"cu_seqlens_q"))
add("types", "cu-q-k-lengths-differ", lambda: cu_type(lambda c: c[:3], r"cu_seqlens_q has 3 entries"))


# -----------------------------------------------------------------------------------------------------------------
# KV cache

def kv_setup(batch=2, sq=1, h=2, hk=1, d=16, capacity=24, page=None, cache_batch=None, seed=0):
    """q, k_cache, v_cache (NaN outside every sequence's valid rows is the caller's business) and a block table."""
    q = randn(batch, sq, h, d, seed=seed)
    if page is None:
        rows = cache_batch or batch
        k_cache, v_cache = randn(rows, capacity, hk, d, seed=seed + 1), randn(rows, capacity, hk, d, seed=seed + 2)
        table = None
    else:
        per_seq = capacity // page
        pages = batch * per_seq + 2  # two spare pages
        k_cache, v_cache = randn(pages, page, hk, d, seed=seed + 1), randn(pages, page, hk, d, seed=seed + 2)
        gen = torch.Generator().manual_seed(seed)
        table = torch.randperm(pages, generator=gen)[:batch * per_seq].view(batch, per_seq).to(torch.int32)
    return q, k_cache, v_cache, table


def new_kv(batch, new, hk=1, d=16, seed=7):
    return randn(batch, new, hk, d, seed=seed), randn(batch, new, hk, d, seed=seed + 1)


def kv_call(q, k_cache, v_cache, **kw):
    return flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True, **kw)


def kv_check(q, k_cache, v_cache, **kw):
    """flash_attn_with_kvcache against the reference (float64, on copies of the caches): out, lse and the caches."""
    k64, v64 = k_cache.double(), v_cache.double()
    ref_kw = {name: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
              for name, t in kw.items() if name != "num_splits"}
    ref_out, ref_lse, ref_k, ref_v = ref_kv.kvcache_forward(q.double(), k64, v64, **ref_kw)
    plain_kw = {name: t for name, t in kw.items() if name != "num_splits"}
    plain_out, plain_lse, _, _ = ref_kv.kvcache_forward(q, k_cache, v_cache, **plain_kw)
    out, lse = kv_call(q, k_cache, v_cache, **kw)
    close("out", out, ref_out, plain_out)
    close("lse", lse, ref_lse, plain_lse)
    close("k_cache", k_cache, ref_k, ref_k.to(k_cache.dtype))
    close("v_cache", v_cache, ref_v, ref_v.to(v_cache.dtype))


def kv_args(setup, kw):
    """(q, k_cache, v_cache, kwargs): the setup's tensors, with paged=True meaning its block table and callables in
    kw called with the table."""
    q, k_cache, v_cache, table = kv_setup(**(setup or {}))
    if kw.pop("paged", False):
        kw["block_table"] = table
    kw = {name: value(table) if callable(value) else value for name, value in kw.items()}
    return q, k_cache, v_cache, kw


def kv_bad(match, setup=None, **kw):
    """The call must raise and leave the caches as they were (no partial append)."""
    q, k_cache, v_cache, kw = kv_args(setup, kw)
    before = k_cache.clone(), v_cache.clone()
    raises(lambda: kv_call(q, k_cache, v_cache, **kw), match)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1]), "the failed call wrote the cache"


I32 = torch.int32
PAGED = dict(page=8, capacity=24)


def _seqlens(*values, dtype=I32):
    return torch.tensor(values, dtype=dtype)


KV_BAD = {
    "seqlens-negative": (r"cache_seqlens", {}, dict(cache_seqlens=_seqlens(-1, 4))),
    "seqlens-negative-large": (r"cache_seqlens", {}, dict(cache_seqlens=_seqlens(3, -2 ** 31))),
    "seqlens-beyond-capacity": (r"cache_seqlens", {}, dict(cache_seqlens=_seqlens(5, 25))),
    "seqlens-int32-max": (r"cache_seqlens", {}, dict(cache_seqlens=_seqlens(2 ** 31 - 1, 0))),
    "seqlens-int64-huge": (r"cache_seqlens", {}, dict(cache_seqlens=_seqlens(2 ** 40, 0, dtype=torch.int64))),
    "append-past-end": (r"cache_seqlens", {}, dict(cache_seqlens=_seqlens(20, 3), k=new_kv(2, 5)[0],
                                                   v=new_kv(2, 5)[1])),
    "append-past-end-paged": (r"cache_seqlens", PAGED, dict(cache_seqlens=_seqlens(2, 22), k=new_kv(2, 3)[0],
                                                            v=new_kv(2, 3)[1], paged=True)),
    "append-seqlens-negative": (r"cache_seqlens", {}, dict(cache_seqlens=_seqlens(-3, 1), k=new_kv(2, 2)[0],
                                                          v=new_kv(2, 2)[1])),
    "int-seqlens-append-past-end": (r"cache_seqlens", {}, dict(cache_seqlens=22, k=new_kv(2, 3)[0],
                                                               v=new_kv(2, 3)[1])),
    "int-seqlens-negative": (r"cache_seqlens", {}, dict(cache_seqlens=-1)),
    "batch_idx-out-of-range": (r"cache_batch_idx", dict(cache_batch=3),
                               dict(cache_seqlens=_seqlens(4, 4), cache_batch_idx=_seqlens(0, 3))),
    "batch_idx-negative": (r"cache_batch_idx", dict(cache_batch=3),
                           dict(cache_seqlens=_seqlens(4, 4), cache_batch_idx=_seqlens(-1, 1))),
    "batch_idx-far": (r"cache_batch_idx", dict(cache_batch=3),
                      dict(cache_seqlens=_seqlens(4, 4), cache_batch_idx=_seqlens(1, 2 ** 31 - 1))),
    "batch_idx-out-of-range-append": (r"cache_batch_idx", dict(cache_batch=3),
                                      dict(cache_seqlens=_seqlens(4, 4), cache_batch_idx=_seqlens(2, 5),
                                           k=new_kv(2, 2)[0], v=new_kv(2, 2)[1])),
    "batch_idx-duplicate-append": (r"cache_batch_idx", dict(cache_batch=3),
                                   dict(cache_seqlens=_seqlens(4, 4), cache_batch_idx=_seqlens(1, 1),
                                        k=new_kv(2, 2)[0], v=new_kv(2, 2)[1])),
    "block_table-out-of-range": (r"block_table", PAGED,
                                 dict(cache_seqlens=_seqlens(20, 9),
                                      block_table=lambda t: torch.where(t == t[0, 1], 8, t).to(I32))),
    "block_table-negative": (r"block_table", PAGED,
                             dict(cache_seqlens=_seqlens(20, 9), block_table=lambda t: torch.where(
                                 t == t[1, 0], -1, t).to(I32))),
    "block_table-int32-min": (r"block_table", PAGED,
                              dict(cache_seqlens=_seqlens(20, 9), block_table=lambda t: torch.where(
                                  t == t[0, 0], -2 ** 31, t).to(I32))),
    "block_table-out-of-range-append": (r"block_table", PAGED,
                                        dict(cache_seqlens=_seqlens(6, 9), k=new_kv(2, 4)[0], v=new_kv(2, 4)[1],
                                             block_table=lambda t: torch.where(t == t[0, 1], 99, t).to(I32))),
    "block_table-shared-page-append": (r"block_table", PAGED,
                                       dict(cache_seqlens=_seqlens(3, 3), k=new_kv(2, 2)[0], v=new_kv(2, 2)[1],
                                            block_table=lambda t: torch.cat((t[:1], t[:1])))),
    "leftpad-negative": (r"cache_leftpad", {}, dict(cache_seqlens=_seqlens(6, 7), cache_leftpad=_seqlens(-1, 0))),
    "leftpad-past-end": (r"cache_leftpad", {}, dict(cache_seqlens=_seqlens(6, 7), cache_leftpad=_seqlens(2, 8))),
    "leftpad-past-end-append": (r"cache_leftpad", {}, dict(cache_seqlens=_seqlens(6, 7), k=new_kv(2, 2)[0],
                                                           v=new_kv(2, 2)[1], cache_leftpad=_seqlens(9, 0))),
    "leftpad-beyond-capacity": (r"cache_leftpad", {}, dict(cache_leftpad=_seqlens(30, 0))),
    "rotary-too-short": (r"rotary_cos", {}, dict(cache_seqlens=_seqlens(10, 3), k=new_kv(2, 2)[0],
                                                 v=new_kv(2, 2)[1], rotary_cos=torch.ones(8, 4),
                                                 rotary_sin=torch.zeros(8, 4))),
    "rotary-too-short-int": (r"rotary_cos", {}, dict(cache_seqlens=10, k=new_kv(2, 2)[0], v=new_kv(2, 2)[1],
                                                     rotary_cos=torch.ones(8, 4), rotary_sin=torch.zeros(8, 4))),
    "num_splits-negative": (r"num_splits", {}, dict(num_splits=-1)),
    "num_splits-huge": (r"num_splits", {}, dict(num_splits=10 ** 6)),
}
for _name, (_match, _setup, _kw) in KV_BAD.items():
    add("kvcache", _name, lambda m=_match, s=_setup, kw=_kw: kv_bad(m, s, **dict(kw)))


def kv_types(match, **kw):
    q, k_cache, v_cache, kw = kv_args(PAGED if "block_table" in kw else {}, kw)
    raises(lambda: kv_call(q, k_cache, v_cache, **kw), match)


add("types", "seqlens-float", lambda: kv_types(r"cache_seqlens", cache_seqlens=torch.tensor([1.0, 2.0])))
add("types", "seqlens-bool-scalar", lambda: kv_types(r"cache_seqlens", cache_seqlens=True))
add("types", "seqlens-0d", lambda: kv_types(r"cache_seqlens", cache_seqlens=torch.tensor(3, dtype=I32)))
add("types", "seqlens-wrong-batch", lambda: kv_types(r"cache_seqlens", cache_seqlens=_seqlens(1, 2, 3)))
add("types", "block_table-float", lambda: kv_types(r"block_table", cache_seqlens=3, block_table=lambda t: t.float()))
add("types", "block_table-1d", lambda: kv_types(r"block_table", cache_seqlens=3, block_table=lambda t: t[0]))
add("types", "batch_idx-float", lambda: kv_types(r"cache_batch_idx", cache_seqlens=3,
                                                 cache_batch_idx=torch.tensor([0.0, 1.0])))
add("types", "batch_idx-wrong-batch", lambda: kv_types(r"cache_batch_idx", cache_seqlens=3,
                                                       cache_batch_idx=_seqlens(0, 1, 1)))
add("types", "leftpad-bool", lambda: kv_types(r"cache_leftpad", cache_seqlens=3,
                                              cache_leftpad=torch.tensor([True, False])))
add("types", "batch_idx-with-block_table", lambda: kv_types(r"cache_batch_idx", cache_seqlens=3,
                                                            block_table=lambda t: t, cache_batch_idx=_seqlens(0, 1)))


def kv_good(setup=None, new=0, **kw):
    q, k_cache, v_cache, kw = kv_args(setup, kw)
    if new:
        kw["k"], kw["v"] = new_kv(q.shape[0], new)
    kv_check(q, k_cache, v_cache, **kw)


KV_GOOD = {
    "seqlens-zero": ({}, 0, dict(cache_seqlens=_seqlens(0, 0))),
    "seqlens-zero-append": ({}, 2, dict(cache_seqlens=_seqlens(0, 5))),
    "seqlens-full": ({}, 0, dict(cache_seqlens=_seqlens(24, 24))),
    "append-to-the-end": ({}, 3, dict(cache_seqlens=_seqlens(21, 2))),
    "append-to-the-end-paged": (PAGED, 3, dict(cache_seqlens=_seqlens(1, 21), paged=True)),
    "int-seqlens-to-the-end": ({}, 4, dict(cache_seqlens=20)),
    "seqlens-int64": ({}, 1, dict(cache_seqlens=_seqlens(7, 9, dtype=torch.int64))),
    "seqlens-non-contiguous": ({}, 0, dict(cache_seqlens=torch.tensor([[7, 0], [9, 0]], dtype=I32)[:, 0])),
    "block_table-non-contiguous": (PAGED, 0, dict(cache_seqlens=_seqlens(20, 9),
                                                  block_table=lambda t: t.t().contiguous().t())),
    "block_table-int64": (PAGED, 1, dict(cache_seqlens=_seqlens(20, 9), block_table=lambda t: t.long())),
    "block_table-unused-entry-bad": (PAGED, 0, dict(cache_seqlens=_seqlens(5, 9), block_table=lambda t: torch.cat(
        (t[:, :2], torch.tensor([[-1], [10 ** 6]], dtype=I32)), dim=1))),
    "block_table-shared-pages-read-only": (PAGED, 0, dict(cache_seqlens=_seqlens(20, 11),
                                                          block_table=lambda t: torch.cat((t[:1], t[:1])))),
    "batch_idx-duplicate-read-only": (dict(cache_batch=3), 0, dict(cache_seqlens=_seqlens(5, 9),
                                                                   cache_batch_idx=_seqlens(2, 2))),
    "batch_idx-permuted-append": (dict(cache_batch=3), 2, dict(cache_seqlens=_seqlens(5, 9),
                                                               cache_batch_idx=_seqlens(2, 0))),
    "leftpad-equal-length": ({}, 0, dict(cache_seqlens=_seqlens(6, 7), cache_leftpad=_seqlens(6, 0))),
    "leftpad-inside-append": ({}, 3, dict(cache_seqlens=_seqlens(6, 7), cache_leftpad=_seqlens(8, 9))),
    "leftpad-end-of-append": ({}, 3, dict(cache_seqlens=_seqlens(6, 7), cache_leftpad=_seqlens(9, 2))),
    "window-int64-max": ({}, 0, dict(cache_seqlens=_seqlens(6, 17), window_size=(BIG, BIG))),
    "window-2^31-causal": (dict(sq=3), 3, dict(cache_seqlens=_seqlens(6, 17), window_size=(2 ** 31, 0),
                                               causal=True)),
    "window-2^31-1-left": (dict(sq=2), 0, dict(cache_seqlens=_seqlens(6, 17), window_size=(2 ** 31 - 1, -1))),
    "window-2^63-right-0-left": (dict(sq=4), 0, dict(cache_seqlens=_seqlens(6, 17), window_size=(0, BIG))),
    "num_splits-past-the-blocks": ({}, 0, dict(cache_seqlens=_seqlens(6, 17), num_splits=40)),
    "rotary-just-long-enough": ({}, 2, dict(cache_seqlens=_seqlens(6, 3), rotary_cos=lambda t: torch.cos(
        torch.arange(8.0)[:, None] * torch.ones(4)), rotary_sin=lambda t: torch.sin(
        torch.arange(8.0)[:, None] * torch.ones(4)))),
}
for _name, (_setup, _new, _kw) in KV_GOOD.items():
    add("kvcache", _name, lambda s=_setup, n=_new, kw=_kw: kv_good(s, n, **dict(kw)))


@case("kvcache")
def nan_outside_valid_rows():
    """Rows outside [leftpad, seqlens + new) hold NaN: nothing may read them."""
    q, k_cache, v_cache, _ = kv_setup(capacity=40)
    seqlens, leftpad = _seqlens(9, 30), _seqlens(3, 0)
    rows = torch.arange(40)
    invalid = (rows[None] < leftpad[:, None]) | (rows[None] >= seqlens[:, None] + 2)
    k_cache[invalid] = float("nan")
    v_cache[invalid] = float("nan")
    k, v = new_kv(2, 2)
    kv_check(q, k_cache, v_cache, k=k, v=v, cache_seqlens=seqlens, cache_leftpad=leftpad)


def fast_path_bad(kw_good, kw_bad, match, setup=None):
    """A valid call first (it takes the repeated-call path's plan), then the same metadata with a bad value."""
    q, k_cache, v_cache, table = kv_setup(**(setup or {}))
    kw_good, kw_bad = ({name: value(table) if callable(value) else value for name, value in kw.items()}
                       for kw in (kw_good, kw_bad))
    kv_call(q, k_cache, v_cache, **kw_good)
    before = k_cache.clone()
    raises(lambda: kv_call(q, k_cache, v_cache, **kw_bad), match)
    assert torch.equal(k_cache, before), "the failed call wrote the cache"


_K2, _V2 = new_kv(2, 2)
add("kvcache", "repeat-seqlens-beyond", lambda: fast_path_bad(
    dict(cache_seqlens=_seqlens(3, 4), k=_K2, v=_V2), dict(cache_seqlens=_seqlens(3, 23), k=_K2, v=_V2),
    r"cache_seqlens"))
add("kvcache", "repeat-seqlens-negative", lambda: fast_path_bad(
    dict(cache_seqlens=_seqlens(3, 4)), dict(cache_seqlens=_seqlens(-5, 4)), r"cache_seqlens"))
add("kvcache", "repeat-int-seqlens-past-end", lambda: fast_path_bad(
    dict(cache_seqlens=3, k=_K2, v=_V2), dict(cache_seqlens=23, k=_K2, v=_V2), r"cache_seqlens"))
add("kvcache", "repeat-block_table-bad", lambda: fast_path_bad(
    dict(cache_seqlens=_seqlens(9, 9), block_table=lambda t: t),
    dict(cache_seqlens=_seqlens(9, 9), block_table=lambda t: torch.where(t == t[1, 1], 50, t).to(I32)),
    r"block_table", PAGED))
add("kvcache", "repeat-batch_idx-bad", lambda: fast_path_bad(
    dict(cache_seqlens=_seqlens(9, 9), cache_batch_idx=_seqlens(0, 2)),
    dict(cache_seqlens=_seqlens(9, 9), cache_batch_idx=_seqlens(0, 3)), r"cache_batch_idx", dict(cache_batch=3)))
add("kvcache", "repeat-leftpad-bad", lambda: fast_path_bad(
    dict(cache_seqlens=_seqlens(9, 9), cache_leftpad=_seqlens(1, 2)),
    dict(cache_seqlens=_seqlens(9, 9), cache_leftpad=_seqlens(1, 12)), r"cache_leftpad"))


@case("kvcache")
def reference_kvcache_int64_window():
    q, k_cache, v_cache, _ = kv_setup(sq=3)
    seqlens = _seqlens(6, 17)
    got = ref_kv.kvcache_forward(q.double(), k_cache.double(), v_cache.double(), cache_seqlens=seqlens, causal=True,
                                 window_size=(BIG, BIG))[0]
    want = ref_kv.kvcache_forward(q.double(), k_cache.double(), v_cache.double(), cache_seqlens=seqlens,
                                  causal=True)[0]
    close("out", got, want, want)


@case("kvcache")
def reference_kvcache_bad_block_table():
    """The reference itself refuses a block table entry past the pages (Python would wrap a negative index)."""
    q, k_cache, v_cache, table = kv_setup(**PAGED)
    table[0, 0] = -1
    raises(lambda: ref_kv.kvcache_forward(q, k_cache, v_cache, cache_seqlens=_seqlens(9, 9), block_table=table),
           r"block_table")


# -----------------------------------------------------------------------------------------------------------------
# Lengths 0 and empty tensors


def empty_case(shapes, match):
    q, k, v = (randn(*s) for s in shapes)
    raises(lambda: flashtile.flash_attn_func(q, k, v), match)


add("empty", "func-sq0", lambda: empty_case([(1, 0, 2, 16), (1, 5, 2, 16), (1, 5, 2, 16)], r"q is empty"))
add("empty", "func-sk0", lambda: empty_case([(1, 5, 2, 16), (1, 0, 2, 16), (1, 0, 2, 16)], r"k is empty"))
add("empty", "func-batch0", lambda: empty_case([(0, 5, 2, 16)] * 3, r"q is empty"))
add("empty", "func-heads0", lambda: empty_case([(1, 5, 0, 16)] * 3, r"q is empty"))
add("empty", "func-headdim0", lambda: empty_case([(1, 5, 2, 0)] * 3, r"q is empty"))


@case("empty")
def sdpa_sq0():
    q, k, v = randn(1, 2, 0, 16), randn(1, 2, 4, 16), randn(1, 2, 4, 16)
    raises(lambda: flashtile.scaled_dot_product_attention(q, k, v), r"query is empty")


@case("empty")
def varlen_total_q0():
    q, k, v = randn(0, 2, 16), randn(5, 1, 16), randn(5, 1, 16)
    cu_q, cu_k = testing.cu_seqlens([0, 0]), testing.cu_seqlens([2, 3])
    raises(lambda: flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 0, 3), r"q is empty")


@case("empty")
def kvcache_batch0():
    q, k_cache, v_cache = randn(0, 1, 2, 16), randn(0, 8, 1, 16), randn(0, 8, 1, 16)
    raises(lambda: kv_call(q, k_cache, v_cache, cache_seqlens=0), r"q is empty")


@case("empty")
def kvcache_seqlen_q0():
    q, k_cache, v_cache, _ = kv_setup()
    raises(lambda: kv_call(q[:, :0], k_cache, v_cache, cache_seqlens=3), r"q is empty")


@case("empty")
def kvcache_append_0_tokens():
    q, k_cache, v_cache, _ = kv_setup()
    k, v = new_kv(2, 0)
    kv_check(q, k_cache, v_cache, k=k, v=v, cache_seqlens=_seqlens(4, 9))


@case("empty")
def causal_rows_without_keys():
    """Sq > Sk under bottom-right causal: the first rows see no key: output 0, LSE -inf, zero gradients."""
    q, k, v = qkv(sq=11, sk=3, grad=True)
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    dout = randn(*out.shape, seed=4)
    grads = torch.autograd.grad((out * dout).sum(), (q, k, v))
    testing.check_against_reference((out, lse, *grads), q.detach(), k.detach(), v.detach(), dout, 16 ** -0.5, True,
                                    None)


# -----------------------------------------------------------------------------------------------------------------
# NaN and inf inputs (NaN where torch's SDPA has NaN is fine)


def nan_case(poison, causal=False, sq=9, sk=13, h=2):
    q, k, v = qkv(sq=sq, sk=sk, h=h, hk=h)
    poison(q, k, v)
    out = flashtile.flash_attn_func(q, k, v, causal=causal)
    mask = band(sq, sk, sk - sq, -1, 0 if causal else -1)
    (ref, _, _), (plain, _, _) = oracle(q, k, v, mask)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2).double() for t in (q, k, v)), attn_mask=mask).transpose(1, 2)
    close_nan_like_sdpa("out", out, ref, plain, sdpa)


def _set(index, value, which):
    def poison(q, k, v):
        (q, k, v)[which][index] = value
    return poison


NAN_CASES = {
    "q-row-nan": (_set((0, 3, 1), float("nan"), 0), False),
    "q-element-nan": (_set((0, 3, 1, 5), float("nan"), 0), True),
    "k-row-nan": (_set((0, 4, 0), float("nan"), 1), False),
    "k-row-nan-causal": (_set((0, 12, 0), float("nan"), 1), True),
    "v-row-nan-causal": (_set((0, 12, 1), float("nan"), 2), True),
    "q-inf": (_set((0, 2, 0, 0), float("inf"), 0), False),
    "k-neg-inf": (_set((0, 5, 1, 3), float("-inf"), 1), True),
    "v-inf": (_set((0, 7, 0, 2), float("inf"), 2), False),
    "all-nan-v": (_set((0,), float("nan"), 2), False),
}
for _name, (_poison, _causal) in NAN_CASES.items():
    add("nan", _name, lambda p=_poison, c=_causal: nan_case(p, c))


@case("nan")
def sdpa_bias_nan_element():
    q, k, v = randn(1, 2, 7, 16), randn(1, 2, 9, 16), randn(1, 2, 9, 16)
    bias = randn(1, 2, 7, 9, seed=5)
    bias[0, 1, 3, 4] = float("nan")
    out = flashtile.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=bias.double())
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    close_nan_like_sdpa("out", out, ref, plain, ref)


@case("nan")
def sdpa_bias_row_neg_inf():
    """A float bias of -inf over a whole row: that row sees no key; flashtile documents 0 there (torch gives NaN)."""
    q, k, v = randn(1, 2, 7, 16), randn(1, 2, 9, 16), randn(1, 2, 9, 16)
    bias = randn(1, 2, 7, 9, seed=5)
    bias[0, 0, 2] = float("-inf")
    out = flashtile.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    ref, _ = reference.naive_attention(*(t.transpose(1, 2).double() for t in (q, k, v)), attn_bias=bias.double())
    plain, _ = reference.naive_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_bias=bias)
    close("out", out.transpose(1, 2), ref, plain)
    assert torch.equal(out[0, 0, 2], torch.zeros_like(out[0, 0, 2]))


@case("nan")
def kvcache_q_nan():
    q, k_cache, v_cache, _ = kv_setup(sq=2)
    q[1, 0, 1] = float("nan")
    seqlens = _seqlens(6, 17)
    out = flashtile.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)
    assert torch.isnan(out[1, 0, 1]).all() and not torch.isnan(out[0]).any() and not torch.isnan(out[1, 1]).any()
    ref = ref_kv.kvcache_forward(q.double(), k_cache.double(), v_cache.double(), cache_seqlens=seqlens)[0]
    plain = ref_kv.kvcache_forward(q, k_cache, v_cache, cache_seqlens=seqlens)[0]
    close("out", out[0], ref[0], plain[0])


@case("nan")
def sinks_neg_inf():
    """A sink logit of -inf adds nothing: the result without sinks (rows without keys included)."""
    q, k, v = qkv(sq=11, sk=4)
    sinks = torch.full((2,), float("-inf"))
    got = flashtile.flash_attn_func(q, k, v, causal=True, sinks=sinks)
    (ref, _, _), (plain, _, _) = oracle(q, k, v, band(11, 4, -7, -1, 0))
    close("out", got, ref, plain)


def scalar_bad(match, **kw):
    q, k, v = qkv()
    raises(lambda: flashtile.flash_attn_func(q, k, v, **kw), match)


add("nan", "scale-nan", lambda: scalar_bad(r"softmax_scale must be finite", softmax_scale=float("nan")))
add("nan", "scale-inf", lambda: scalar_bad(r"softmax_scale must be finite", softmax_scale=float("inf")))
add("nan", "softcap-nan", lambda: scalar_bad(r"softcap", softcap=float("nan")))
add("nan", "softcap-inf", lambda: scalar_bad(r"softcap", softcap=float("inf")))
add("nan", "softcap-negative", lambda: scalar_bad(r"softcap", softcap=-1.0))
add("nan", "dropout-nan", lambda: scalar_bad(r"dropout_p", dropout_p=float("nan")))
add("nan", "dropout-one", lambda: scalar_bad(r"dropout_p", dropout_p=1.0))


@case("nan")
def kvcache_scale_nan():
    q, k_cache, v_cache, _ = kv_setup()
    raises(lambda: kv_call(q, k_cache, v_cache, cache_seqlens=3, softmax_scale=float("nan")), r"softmax_scale")


def scale_good(scale):
    q, k, v = qkv()
    got = flashtile.flash_attn_func(q, k, v, softmax_scale=scale, causal=True)
    (ref, _, _), (plain, _, _) = oracle(q, k, v, band(9, 13, 4, -1, 0), softmax_scale=scale)
    close("out", got, ref, plain)


add("nan", "scale-zero", lambda: scale_good(0.0))
add("nan", "scale-negative", lambda: scale_good(-0.3))


# -----------------------------------------------------------------------------------------------------------------
# Types and other arguments


@case("types")
def packed_qkv_message():
    err = raises(lambda: flashtile.flash_attn_qkvpacked_func(randn(1, 5, 2, 2, 16)), r"qkv must be 5-D")
    assert "packed qk)" not in str(err) and "q, k and v" in str(err), str(err)
    err = raises(lambda: flashtile.flash_attn_kvpacked_func(randn(1, 5, 2, 16), randn(1, 5, 3, 2, 16)),
                 r"kv must be 5-D")
    assert "k and v" in str(err), str(err)


@case("types")
def q_float64():
    q, k, v = (t.double() for t in qkv())
    raises(lambda: flashtile.flash_attn_func(q, k, v), r"q has dtype torch.float64")


@case("types")
def attn_mask_int():
    q, k, v = randn(1, 2, 7, 16), randn(1, 2, 9, 16), randn(1, 2, 9, 16)
    raises(lambda: flashtile.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(7, 9, dtype=torch.int32)),
           r"attn_mask")


@case("types")
def window_numpy_ints():
    import numpy as np
    q, k, v = qkv()
    raises(lambda: flashtile.flash_attn_func(q, k, v, window_size=(np.int64(3), np.int64(0))), r"window_size")


# -----------------------------------------------------------------------------------------------------------------
# torch.func transforms and higher-order gradients


@case("transform")
def func_grad():
    """torch.func.grad (one level) works and matches the reference."""
    q, k, v = qkv(sq=7, sk=9)
    dq = torch.func.grad(lambda q_: flashtile.flash_attn_func(q_, k, v, causal=True).square().sum())(q)
    mask = band(7, 9, 2, -1, 0)
    ref = torch.func.grad(lambda q_: reference.naive_attention(
        q_, k.double(), v.double(), attn_mask=mask)[0].square().sum())(q.double())
    plain = torch.func.grad(lambda q_: reference.naive_attention(q_, k, v, attn_mask=mask)[0].square().sum())(q)
    close("dq", dq, ref, plain)


@case("transform")
def func_grad_of_grad():
    q, k, v = qkv(sq=5, sk=6)

    def inner(q_):
        return torch.func.grad(lambda x: flashtile.flash_attn_func(x, k, v).square().sum())(q_).sum()
    raises(lambda: torch.func.grad(inner)(q), r"(?i)second derivative|double backward|not differentiable",
           types=(RuntimeError,))


@case("transform")
def func_jvp():
    q, k, v = qkv(sq=5, sk=6)
    raises(lambda: torch.func.jvp(lambda x: flashtile.flash_attn_func(x, k, v), (q,), (torch.ones_like(q),)),
           r"(?i)forward-mode", types=(RuntimeError,))


@case("transform")
def forward_ad_dual():
    import torch.autograd.forward_ad as fwAD
    q, k, v = qkv(sq=5, sk=6)

    def call():
        with fwAD.dual_level():
            flashtile.flash_attn_func(fwAD.make_dual(q, torch.ones_like(q)), k, v)
    raises(call, r"(?i)forward-mode", types=(RuntimeError,))


@case("transform")
def func_vmap():
    """vmap over a leading dim: the per-sample results, or a clear error; never a wrong result."""
    qs, ks, vs = randn(3, 1, 5, 2, 16), randn(3, 1, 6, 1, 16), randn(3, 1, 6, 1, 16)
    try:
        got = torch.vmap(lambda a, b, c: flashtile.flash_attn_func(a, b, c, causal=True))(qs, ks, vs)
    except RuntimeError as e:
        assert re.search(r"(?i)vmap", str(e)), f"unclear vmap error: {e}"
        return
    for i in range(3):
        (ref, _, _), (plain, _, _) = oracle(qs[i], ks[i], vs[i], band(5, 6, 1, -1, 0))
        close(f"out[{i}]", got[i], ref, plain)


@case("transform")
def func_hessian():
    q, k, v = qkv(b=1, sq=2, sk=3, h=1, d=8)
    raises(lambda: torch.func.hessian(lambda x: flashtile.flash_attn_func(x, k, v).sum())(q),
           r"(?i)second derivative|double backward|not differentiable|forward-mode", types=(RuntimeError,))


@case("transform")
def autograd_double_backward():
    q, k, v = qkv(sq=5, sk=6, grad=True)
    out = flashtile.flash_attn_func(q, k, v, causal=True)
    (dq,) = torch.autograd.grad(out.square().sum(), (q,), create_graph=True)
    raises(lambda: (out.sum() + dq.square().sum()).backward(), r"not differentiable", types=(RuntimeError,))


@case("transform")
def vmap_kvcache():
    q, k_cache, v_cache, _ = kv_setup()
    seqlens = _seqlens(6, 17)
    qs = torch.stack((q, 2 * q))
    try:
        got = torch.vmap(lambda x: flashtile.flash_attn_with_kvcache(x, k_cache, v_cache, cache_seqlens=seqlens))(qs)
    except RuntimeError as e:
        assert re.search(r"(?i)vmap", str(e)), f"unclear vmap error: {e}"
        return
    for i in range(2):
        ref = ref_kv.kvcache_forward(qs[i].double(), k_cache.double(), v_cache.double(), cache_seqlens=seqlens)[0]
        plain = ref_kv.kvcache_forward(qs[i], k_cache, v_cache, cache_seqlens=seqlens)[0]
        close(f"out[{i}]", got[i], ref, plain)


@case("transform")
def func_jacrev():
    """jacrev (vjp, vmapped over the output's basis): the reference's Jacobian, or a clear error."""
    q, k, v = qkv(b=1, sq=2, sk=3, h=1, d=8)
    try:
        got = torch.func.jacrev(lambda x: flashtile.flash_attn_func(x, k, v, causal=True))(q)
    except RuntimeError as e:
        assert re.search(r"(?i)vmap|not supported", str(e)), f"unclear jacrev error: {e}"
        return
    mask = band(2, 3, 1, -1, 0)
    ref = torch.func.jacrev(lambda x: reference.naive_attention(x, k.double(), v.double(), attn_mask=mask)[0])(
        q.double())
    plain = torch.func.jacrev(lambda x: reference.naive_attention(x, k, v, attn_mask=mask)[0])(q)
    close("jacobian", got, ref, plain)


@case("transform")
def vmap_of_grad():
    """Per-sample gradients: vmap(grad(f)) equals the gradients one sample at a time, or raises clearly."""
    qs, k, v = randn(3, 1, 5, 2, 16), randn(1, 6, 1, 16), randn(1, 6, 1, 16)

    def loss(x):
        return flashtile.flash_attn_func(x, k, v).square().sum()
    try:
        got = torch.vmap(torch.func.grad(loss))(qs)
    except RuntimeError as e:
        assert re.search(r"(?i)vmap|not supported", str(e)), f"unclear vmap error: {e}"
        return
    for i in range(3):
        ref = torch.func.grad(lambda x: reference.naive_attention(x, k.double(), v.double())[0].square().sum())(
            qs[i].double())
        plain = torch.func.grad(lambda x: reference.naive_attention(x, k, v)[0].square().sum())(qs[i])
        close(f"dq[{i}]", got[i], ref, plain)


@case("transform")
def func_grad_kvcache():
    """flash_attn_with_kvcache has no backward: torch.func.grad through it raises (an op without a derivative
    would give a zero gradient)."""
    q, k_cache, v_cache, _ = kv_setup()
    seqlens = _seqlens(6, 17)
    raises(lambda: torch.func.grad(lambda x: flashtile.flash_attn_with_kvcache(
        x, k_cache, v_cache, cache_seqlens=seqlens).sum())(q), r"no backward", types=(RuntimeError,))


# -----------------------------------------------------------------------------------------------------------------
# Runner


def _poison_outputs():
    """NaN-fill every buffer the kernel launchers allocate (as tests/conftest.py's poison fixture does)."""
    from flashtile.kernels import _common

    def nan_empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    _common.empty = nan_empty


class Hang(Exception):
    """A case ran past CASE_TIMEOUT_S."""


# Seconds a case may take before it counts as hung (the interpreter runs a small case in a few seconds).
CASE_TIMEOUT_S = 120


def _alarm(signum, frame):
    raise Hang(f"still running after {CASE_TIMEOUT_S} s")


def run(names):
    import signal
    import warnings
    warnings.simplefilter("ignore")
    _poison_outputs()
    signal.signal(signal.SIGALRM, _alarm)
    for name in names:
        print(json.dumps({"start": name}), flush=True)
        status, detail = "pass", ""
        signal.alarm(CASE_TIMEOUT_S)
        try:
            CASES[name][1]()
        except Hang as e:
            status, detail = "hang", str(e)
        except AssertionError as e:
            status, detail = "wrong", str(e)[:500]
        except UnclearError as e:
            status, detail = "unclear", str(e)[:500]
        except Exception as e:  # noqa: BLE001 - a case's own unexpected exception
            status, detail = "unclear", "".join(traceback.format_exception_only(type(e), e))[:500]
        signal.alarm(0)
        print(json.dumps({"case": name, "status": status, "detail": detail}), flush=True)


def select(patterns):
    if not patterns:
        return list(CASES)
    return [n for n in CASES if any(n == p or n.startswith(p.rstrip("/") + "/") or n.startswith(p)
                                     for p in patterns)]


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "--list":
        for n in select(args[1:]):
            print(n)
    else:
        torch.manual_seed(0)
        run(select(args))
    sys.stdout.flush()
