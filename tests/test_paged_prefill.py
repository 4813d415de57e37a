"""Paged prefill: flash_attn_varlen_func(q, k_cache, v_cache, ..., block_table=..., seqused_k=...) (issue 28, item 4).

Sequence b's keys are its first n_b cache slots (n_b = seqused_k[b], or cu_seqlens_k's length), slot j being row
j % page of page block_table[b, j // page]; its queries align bottom-right on them (chunked prefill: the new queries
see the cached prefix and themselves). Judged against the float64 reference on keys gathered here by a plain Python
loop (not flashtile's own gather), each sequence on its own."""
import pytest
import torch

import flashtile
from flashtile import _ops, _values
from flashtile.dispatch import Target
from flashtile.kernels import configs
from flashtile.request import AttentionRequest
from flashtile.testing import check_varlen_against_reference, cu_seqlens

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _paged(lens_q, lens_k, page, h=4, hk=2, d=32, dtype=torch.float32, seed=0, spare_pages=3, device=DEVICE):
    """(q, k_cache, v_cache, block_table) with each sequence's pages shuffled through the pool, -1 past its pages
    (never read), and spare pages of NaN that no sequence names (a read of one would show)."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // page) for n in lens_k]
    width = max(max(per_seq), 1) + 1
    used = sum(per_seq)
    num_pages = used + spare_pages
    order = torch.randperm(num_pages, generator=gen)
    table = torch.full((len(lens_k), width), -1, dtype=torch.int32)
    i = 0
    for b, n in enumerate(per_seq):
        table[b, :n] = order[i:i + n].to(torch.int32)
        i += n
    k_cache = torch.randn((num_pages, page, hk, d), generator=gen)
    v_cache = torch.randn((num_pages, page, hk, d), generator=gen)
    for spare in order[used:]:
        k_cache[spare] = float("nan")
        v_cache[spare] = float("nan")
    q = torch.randn((sum(lens_q), h, d), generator=gen)
    return (q.to(dtype).to(device), k_cache.to(dtype).to(device), v_cache.to(dtype).to(device), table.to(device))


def _gather(k_cache, block_table, lens_k):
    """The oracle's contiguous keys: a Python loop over the slots."""
    page = k_cache.shape[1]
    rows = [k_cache[int(block_table[b, j // page]), j % page] for b, n in enumerate(lens_k) for j in range(n)]
    if not rows:
        return k_cache.new_zeros((0,) + tuple(k_cache.shape[2:]))
    return torch.stack(rows)


def _check(out, q, k_cache, v_cache, table, lens_q, lens_k, causal, lse, **features):
    k, v = _gather(k_cache, table, lens_k), _gather(v_cache, table, lens_k)
    check_varlen_against_reference((out.cpu(), lse.cpu(), None, None, None), q.cpu(), k.cpu(), v.cpu(), None,
                                   cu_seqlens(lens_q), cu_seqlens(lens_k), causal, **features)


def _run(q, k_cache, v_cache, table, lens_q, lens_k, causal=False, used=True, **kw):
    cu_q = cu_seqlens(lens_q, q.device)
    seqused = torch.tensor(lens_k, dtype=torch.int32, device=q.device) if used else None
    # Without seqused_k the lengths come from cu_seqlens_k; with it, cu_seqlens_k's values are not used (garbage).
    cu_k = cu_seqlens(lens_k, q.device) if not used else torch.zeros(len(lens_k) + 1, dtype=torch.int32,
                                                                      device=q.device)
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(lens_q), max(lens_k),
                                                   causal=causal, block_table=table, seqused_k=seqused,
                                                   return_attn_probs=True, **kw)
    return out, lse


# A chunked-prefill batch: a long cached prefix with a chunk of new queries, a decode step (1 query), a sequence
# without queries, one without keys, and self-attention (Sq = Sk).
LENS_Q = [7, 1, 0, 3, 33]
LENS_K = [70, 9, 5, 0, 33]


@pytest.mark.parametrize("page", [16, 32, 64, 48, 8])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_paged_against_reference(poison, page, causal):
    q, kc, vc, table = _paged(LENS_Q, LENS_K, page, seed=page)
    with torch.no_grad():
        out, lse = _run(q, kc, vc, table, LENS_Q, LENS_K, causal=causal, used=page != 32)
    _check(out, q, kc, vc, table, LENS_Q, LENS_K, causal, lse=lse)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_half_gqa(poison, dtype):
    lens_q, lens_k = [5, 1, 17], [40, 65, 17]
    q, kc, vc, table = _paged(lens_q, lens_k, 16, h=6, hk=2, d=64, dtype=dtype, seed=3)
    out, lse = _run(q, kc, vc, table, lens_q, lens_k, causal=True)
    _check(out, q, kc, vc, table, lens_q, lens_k, True, lse=lse)


@pytest.mark.parametrize("features", [
    pytest.param(dict(window_size=(9, 2)), id="window"),
    pytest.param(dict(window_size=(12, 0), softcap=4.0), id="causal-window-softcap"),
    pytest.param(dict(sinks=True, softcap=3.0), id="sinks-softcap"),
    pytest.param(dict(alibi_slopes=True), id="alibi"),
])
def test_paged_features(poison, features):
    features = dict(features)
    h = 4
    gen = torch.Generator().manual_seed(5)
    if features.pop("sinks", False):
        features["sinks"] = torch.randn(h, generator=gen).to(DEVICE)
    if features.pop("alibi_slopes", False):
        features["alibi_slopes"] = torch.rand(h, generator=gen).to(DEVICE)
    q, kc, vc, table = _paged(LENS_Q, LENS_K, 16, h=h, seed=11)
    out, lse = _run(q, kc, vc, table, LENS_Q, LENS_K, **features)
    judged = {name: (t.cpu() if isinstance(t, torch.Tensor) else t) for name, t in features.items()
              if name != "alibi_slopes"}
    _check(out, q, kc, vc, table, LENS_Q, LENS_K, False, lse=lse, alibi_slopes=features.get("alibi_slopes"),
           **judged)


def test_paged_equals_contiguous(poison):
    """The same keys gathered into a contiguous varlen batch give the same result, to rounding."""
    q, kc, vc, table = _paged(LENS_Q, LENS_K, 16, seed=21)
    out, lse = _run(q, kc, vc, table, LENS_Q, LENS_K, causal=True, window_size=(20, 0))
    k, v = _gather(kc, table, LENS_K), _gather(vc, table, LENS_K)
    cu_q, cu_k = cu_seqlens(LENS_Q, DEVICE), cu_seqlens(LENS_K, DEVICE)
    ref, ref_lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), causal=True,
                                                       window_size=(20, 0), return_attn_probs=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_paged_reference_path(monkeypatch):
    """CPU tensors without the interpreter take the reference (it gathers the pages)."""
    q, kc, vc, table = _paged(LENS_Q, LENS_K, 16, seed=4, device="cpu")
    monkeypatch.setattr(configs, "INTERPRETING", False)
    with pytest.warns(UserWarning, match="reference") if not _warned() else _nothing():
        out, lse = _run(q, kc, vc, table, LENS_Q, LENS_K, causal=True)
    _check(out, q, kc, vc, table, LENS_Q, LENS_K, True, lse=lse)


def _warned():
    from flashtile import dispatch
    return dispatch._warned_cpu_fallback


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("page, forward", [(16, "gluon-hopper"), (256, "gluon-hopper"), (48, "triton")])
def test_paged_explain(page, forward):
    """On Hopper the Gluon forward takes pages that divide its 128-row key blocks (8 rows or more) or are multiples
    of them; other sizes take the portable kernel."""
    q, kc, vc, table = _paged([4], [300], page, h=4, hk=2, d=64, dtype=torch.bfloat16, seed=2, device="cpu")
    cu_q, cu_k = cu_seqlens([4]), cu_seqlens([300])
    text = str(flashtile.explain(q, kc, vc, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=4, max_seqlen_k=300,
                                 block_table=table, target=Target("cuda", 90, False)))
    assert f"forward: {forward}" in text, text
    if forward == "triton":
        assert f"not gluon-hopper: pages of {page} rows" in text
    assert "paged" in text.splitlines()[0]


# ---------------------------------------------------------------------------------------------------------------
# Index values: checked on the host, clamped in the kernel


@pytest.mark.parametrize("mutate, match", [
    pytest.param(lambda t, u: t.__setitem__((0, 1), 99), r"block_table\[0, 1\] = 99 is outside", id="page-past"),
    pytest.param(lambda t, u: t.__setitem__((1, 0), -1), r"block_table\[1, 0\] = -1 is outside", id="page-negative"),
    pytest.param(lambda t, u: u.__setitem__(0, 1000), r"sequence 0 has 1000 keys \(seqused_k\[0\]\)",
                 id="seqused-past-capacity"),
    pytest.param(lambda t, u: u.__setitem__(1, -2), r"sequence 1 has -2 keys", id="seqused-negative"),
])
def test_paged_bad_values_raise(mutate, match):
    lens_q, lens_k = [3, 2], [30, 9]
    q, kc, vc, table = _paged(lens_q, lens_k, 16, seed=6, device="cpu")
    used = torch.tensor(lens_k, dtype=torch.int32)
    mutate(table, used)
    with pytest.raises(ValueError, match=match):
        flashtile.flash_attn_varlen_func(q, kc, vc, cu_seqlens(lens_q), cu_seqlens(lens_k), 3, 1000,
                                         block_table=table, seqused_k=used)


def test_paged_bad_lengths_raise():
    lens_q, lens_k = [3, 2], [30, 9]
    q, kc, vc, table = _paged(lens_q, lens_k, 16, seed=6, device="cpu")
    with pytest.raises(ValueError, match="max_seqlen_k=20 but sequence 0 has 30"):
        flashtile.flash_attn_varlen_func(q, kc, vc, cu_seqlens(lens_q), cu_seqlens(lens_k), 3, 20, block_table=table)
    with pytest.raises(ValueError, match="cu_seqlens_k decreases"):
        flashtile.flash_attn_varlen_func(q, kc, vc, cu_seqlens(lens_q), torch.tensor([0, 30, 9], dtype=torch.int32),
                                         3, 30, block_table=table)


@pytest.mark.skipif(not configs.INTERPRETING, reason="needs the kernels (TRITON_INTERPRET=1 on the CPU)")
@pytest.mark.parametrize("bad_page, bad_used", [(-5, 20), (10 ** 6, 20), (0, 10 ** 6), (1, -4)],
                         ids=["negative-page", "huge-page", "huge-seqused", "negative-seqused"])
def test_paged_bad_values_are_clamped(bad_page, bad_used):
    """Unchecked values (CUDA tensors by default; here the op is called below the public checks): sequence 1's bad
    page or key count spoils at most its own rows; sequence 0 is right and nothing reads past the cache."""
    lens_q, lens_k = [5, 4], [20, 20]
    q, kc, vc, table = _paged(lens_q, lens_k, 16, seed=8, device="cpu")
    table[1, 1] = bad_page if bad_page else table[1, 1]
    used = torch.tensor([20, bad_used], dtype=torch.int32)
    req = AttentionRequest(softmax_scale=32 ** -0.5, window_right=0, cu_seqlens_q=cu_seqlens(lens_q),
                           cu_seqlens_k=cu_seqlens(lens_k), max_seqlen_q=5, max_seqlen_k=10 ** 6, block_table=table,
                           seqused_k=used)
    out, lse = _ops.forward(q, kc, vc, req)
    _check(out[:5], q[:5], kc, vc, table[:1], [5], [20], True, lse=lse[:, :5])
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("kwargs, error, match", [
    pytest.param(dict(block_table="float"), TypeError, "block_table has dtype torch.float32", id="table-dtype"),
    pytest.param(dict(block_table="1d"), ValueError, r"block_table has shape \(3,\)", id="table-shape"),
    pytest.param(dict(seqused_k="wrong"), ValueError, r"seqused_k has shape \(3,\)", id="seqused-shape"),
    pytest.param(dict(cu_seqlens_k=None), TypeError, "cu_seqlens_k must be a torch.Tensor", id="no-cu_seqlens_k"),
    pytest.param(dict(k="3d"), ValueError, "4-D paged cache", id="k-not-paged"),
    pytest.param(dict(dropout_p=0.1), ValueError, "dropout_p=0.1 with block_table", id="dropout"),
    pytest.param(dict(grad=True), NotImplementedError, "backward through a paged cache", id="grad"),
    pytest.param(dict(block_table=None), ValueError, "seqused_k is supported together with block_table",
                 id="seqused-without-table"),
])
def test_paged_errors(kwargs, error, match):
    lens_q, lens_k = [3, 2], [30, 9]
    q, kc, vc, table = _paged(lens_q, lens_k, 16, seed=9, device="cpu")
    args = dict(q=q, k=kc, v=vc, cu_seqlens_q=cu_seqlens(lens_q), cu_seqlens_k=cu_seqlens(lens_k), max_seqlen_q=3,
                max_seqlen_k=30, block_table=table, seqused_k=torch.tensor(lens_k, dtype=torch.int32))
    replace = {"float": table.float(), "1d": table[0], "wrong": torch.tensor([1, 2, 3], dtype=torch.int32),
               "3d": kc.flatten(0, 1)}
    grad = kwargs.pop("grad", False)
    for name, value in kwargs.items():
        args[name] = replace.get(value, value) if isinstance(value, str) else value
    if grad:
        args["q"] = q.requires_grad_()
    with pytest.raises(error, match=match):
        flashtile.flash_attn_varlen_func(**args)


def test_paged_no_grad_allowed():
    """requires_grad inputs are fine outside grad mode (inference)."""
    q, kc, vc, table = _paged([2], [20], 16, seed=10, device=DEVICE)
    q.requires_grad_()
    with torch.inference_mode():
        out, lse = _run(q, kc, vc, table, [2], [20])
    _check(out, q.detach(), kc, vc, table, [2], [20], False, lse=lse)


def test_paged_compile_fullgraph(poison):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    lens_q, lens_k = [3, 1, 6], [20, 33, 6]
    q, kc, vc, table = _paged(lens_q, lens_k, 16, seed=12)
    cu_q, cu_k = cu_seqlens(lens_q, DEVICE), cu_seqlens(lens_k, DEVICE)
    used = torch.tensor(lens_k, dtype=torch.int32, device=DEVICE)

    def f(q, kc, vc, cu_q, cu_k, table, used):
        return flashtile.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, 6, 33, causal=True, block_table=table,
                                                seqused_k=used)

    with torch.no_grad():
        compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(q, kc, vc, cu_q, cu_k, table, used)
        eager = f(q, kc, vc, cu_q, cu_k, table, used)
    assert not torch._dynamo.utils.counters["graph_break"]
    torch.testing.assert_close(compiled, eager)
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------------------------
# GPU: larger sizes, every page size the serving engines use, against the reference and contiguous varlen


@pytest.mark.gpu
@pytest.mark.parametrize("page", [8, 16, 32, 64, 128, 256])
@pytest.mark.parametrize("dtype, d", [(torch.bfloat16, 128), (torch.float16, 64), (torch.bfloat16, 256),
                                      (torch.bfloat16, 96), (torch.bfloat16, 192), (torch.bfloat16, 80),
                                      (torch.float16, 160)])
def test_gpu_paged(page, dtype, d):
    lens_q, lens_k = [300, 1, 1, 700, 129, 0], [1500, 513, 77, 700, 1000, 40]
    q, kc, vc, table = _paged(lens_q, lens_k, page, h=16, hk=4, d=d, dtype=dtype, seed=page, device="cuda")
    sinks = torch.randn(16, device="cuda")
    for kw in (dict(causal=True), dict(causal=True, window_size=(256, 0), softcap=30.0, sinks=sinks)):
        _run(q, kc, vc, table, lens_q, lens_k, **kw)  # compiles; the second call takes the cached launch
        out, lse = _run(q, kc, vc, table, lens_q, lens_k, **kw)
        judged = {name: (t.cpu() if isinstance(t, torch.Tensor) else t) for name, t in kw.items() if name != "causal"}
        _check(out.cpu(), q.cpu(), kc.cpu(), vc.cpu(), table.cpu(), lens_q, lens_k, True, lse=lse.cpu(), **judged)
        k, v = _gather(kc, table, lens_k), _gather(vc, table, lens_k)
        ref = flashtile.flash_attn_varlen_func(q, k, v, cu_seqlens(lens_q, "cuda"), cu_seqlens(lens_k, "cuda"),
                                               max(lens_q), max(lens_k), **kw)
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    with flashtile.check_values():  # the full check reads the CUDA index tensors
        table[0, 0] = kc.shape[0]
        with pytest.raises(ValueError, match=r"block_table\[0, 0\]"):
            _run(q, kc, vc, table, lens_q, lens_k)


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 256])
@pytest.mark.parametrize("bad_page, bad_used", [(-5, 300), (10 ** 6, 300), (0, 10 ** 6), (1, -4)],
                         ids=["negative-page", "huge-page", "huge-seqused", "negative-seqused"])
def test_gpu_paged_bad_values(page, bad_page, bad_used):
    """Unchecked values on the GPU (the public call reads no CUDA index tensor): sequence 1's bad page or key count
    spoils at most its own rows; sequence 0 is right, every output is finite, nothing reads past the cache."""
    lens_q, lens_k = [130, 4], [300, 300]
    q, kc, vc, table = _paged(lens_q, lens_k, page, h=8, hk=2, d=128, dtype=torch.bfloat16, seed=9, device="cuda")
    table[1, min(1, table.shape[1] - 1)] = bad_page if bad_page else table[1, 0]
    used = torch.tensor([300, bad_used], dtype=torch.int32, device="cuda")
    out, lse, _ = flashtile.flash_attn_varlen_func(q, kc, vc, cu_seqlens(lens_q, "cuda"), cu_seqlens(lens_k, "cuda"),
                                                   130, 300, causal=True, block_table=table, seqused_k=used,
                                                   return_attn_probs=True)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    _check(out[:130], q[:130], kc, vc, table[:1], [130], [300], True, lse=lse[:, :130])


def test_paged_values_unread_on_device(monkeypatch):
    """With unreadable index tensors (CUDA's default) the host checks nothing and the call still runs."""
    monkeypatch.setattr(_values, "readable", lambda t: False)
    q, kc, vc, table = _paged([3], [20], 16, seed=13)
    out, lse = _run(q, kc, vc, table, [3], [20])
    _check(out, q, kc, vc, table, [3], [20], False, lse=lse)
