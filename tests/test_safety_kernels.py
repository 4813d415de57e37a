"""The kernels' own clamps (docs/safety.md): index values the host did not check (CUDA tensors, by default) spoil at
most their own sequence's rows, never another sequence's data or memory the call does not own.

The public functions check CPU tensors' values on the host, so these tests go one level down (the op
implementations, flashtile._ops.forward / backward and flashtile.kvcache.append / attention, with requests built by
hand) and run the real kernels in Triton's interpreter, which reports out-of-bounds accesses as crashes."""
import pytest
import torch

from flashtile import _ops, kvcache
from flashtile.kernels import configs
from flashtile.reference import naive_attention
from flashtile.request import AttentionRequest, KVCacheRequest

pytestmark = pytest.mark.skipif(not configs.INTERPRETING, reason="needs the kernels (TRITON_INTERPRET=1 on the CPU)")


def _packed(lens, h=2, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lens)
    return [torch.randn((total, h, d), generator=gen) for _ in range(3)]


def _cu(values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize("cu_bad, max_len", [
    pytest.param([0, 20, 1000], 50, id="end-past-the-rows"),
    pytest.param([0, 20, -3], 50, id="negative-end"),
    pytest.param([0, 20, 45], 20, id="max_seqlen-too-small"),
    pytest.param([0, 20, 2 ** 31 - 1], 2 ** 20, id="huge-offset"),
])
def test_varlen_offsets_are_clamped(cu_bad, max_len):
    """Sequence 0 (rows [0, 20)) is right whatever sequence 1's bad offsets say; nothing crashes, forward or
    backward."""
    q, k, v = _packed([20, 25])
    req = AttentionRequest(softmax_scale=0.25, window_right=0, cu_seqlens_q=_cu(cu_bad), cu_seqlens_k=_cu(cu_bad),
                           max_seqlen_q=max_len, max_seqlen_k=max_len)
    out, lse = _ops.forward(q, k, v, req)
    ref, ref_lse = naive_attention(q[None, :20], k[None, :20], v[None, :20], softmax_scale=0.25, causal=True)
    torch.testing.assert_close(out[:20], ref[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse[:, :20], ref_lse[0], atol=2e-5, rtol=1e-4)
    dq, dk, dv = _ops.backward(torch.ones_like(out), q, k, v, out, lse, None, req)
    assert torch.isfinite(dq[:20]).all() and torch.isfinite(dk[:20]).all()


def _cache(num_pages=6, page=16, hk=1, d=16, seed=1):
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn((num_pages, page, hk, d), generator=gen)
    return k_cache, torch.randn(k_cache.shape, generator=gen)


@pytest.mark.parametrize("bad_entry", [-7, 6, 10 ** 6], ids=["negative", "one-past", "huge"])
def test_paged_cache_bad_page(bad_entry):
    """Sequence 1's block table names a page that does not exist: its append writes nothing, sequence 0's pages
    are untouched and its attention is right."""
    k_cache, v_cache = _cache()
    table = torch.tensor([[0, 1], [2, bad_entry]], dtype=torch.int32)
    seqlens = torch.tensor([10, 14], dtype=torch.int32)
    gen = torch.Generator().manual_seed(2)
    k_new, v_new = torch.randn((2, 4, 1, 16), generator=gen), torch.randn((2, 4, 1, 16), generator=gen)
    q = torch.randn((2, 1, 2, 16), generator=gen)
    before = k_cache.clone()
    req = KVCacheRequest(cache_seqlens=seqlens, seqlen_new=4, block_table=table, softmax_scale=0.25, causal=True)
    kvcache.append(k_cache, v_cache, k_new, v_new, req)
    # Sequence 0 wrote rows 10..13 of page 0; sequence 1 rows 14, 15 of page 2, then nothing for the bad page.
    untouched = torch.ones(6, dtype=torch.bool)
    untouched[[0, 2]] = False
    assert torch.equal(k_cache[untouched], before[untouched])
    assert torch.equal(k_cache[0, 10:14], k_new[0]) and torch.equal(k_cache[2, 14:16], k_new[1, :2])
    out, lse = kvcache.attention(q, k_cache, v_cache, req)
    keys = torch.cat([k_cache[0], k_cache[1]])[:14]
    vals = torch.cat([v_cache[0], v_cache[1]])[:14]
    ref, _ = naive_attention(q[:1], keys[None], vals[None], softmax_scale=0.25, causal=True)
    torch.testing.assert_close(out[:1], ref, atol=2e-5, rtol=1e-4)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("bad_row", [-1, 3, 2 ** 40], ids=["negative", "one-past", "huge"])
def test_cache_batch_idx_out_of_range(bad_row):
    """A cache row that does not exist: no keys (output 0, LSE -inf) and no write; sequence 0 is right."""
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.randn((3, 32, 1, 16), generator=gen), torch.randn((3, 32, 1, 16), generator=gen)
    batch_idx = torch.tensor([2, bad_row], dtype=torch.int64)
    seqlens = torch.tensor([5, 7], dtype=torch.int32)
    k_new, v_new = torch.randn((2, 2, 1, 16), generator=gen), torch.randn((2, 2, 1, 16), generator=gen)
    q = torch.randn((2, 2, 2, 16), generator=gen)
    before = k_cache.clone()
    req = KVCacheRequest(cache_seqlens=seqlens, seqlen_new=2, cache_batch_idx=batch_idx, softmax_scale=0.25,
                         causal=True)
    kvcache.append(k_cache, v_cache, k_new, v_new, req)
    assert torch.equal(k_cache[:2], before[:2]) and torch.equal(k_cache[2, 7:], before[2, 7:])
    out, lse = kvcache.attention(q, k_cache, v_cache, req)
    ref, _ = naive_attention(q[:1], k_cache[2:3, :7], v_cache[2:3, :7], softmax_scale=0.25, causal=True)
    torch.testing.assert_close(out[:1], ref, atol=2e-5, rtol=1e-4)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isinf(lse[1]).all()


@pytest.mark.parametrize("bad_len", [-5, 31, 2 ** 31 - 1], ids=["negative", "past-capacity", "huge"])
def test_cache_seqlens_out_of_range(bad_len):
    """Lengths are clamped into [0, capacity]: appends past the end are dropped, no other row is written."""
    gen = torch.Generator().manual_seed(4)
    k_cache, v_cache = torch.randn((2, 32, 1, 16), generator=gen), torch.randn((2, 32, 1, 16), generator=gen)
    seqlens = torch.tensor([5, bad_len], dtype=torch.int32)
    leftpad = torch.tensor([0, -3], dtype=torch.int32)
    k_new, v_new = torch.randn((2, 3, 1, 16), generator=gen), torch.randn((2, 3, 1, 16), generator=gen)
    q = torch.randn((2, 1, 2, 16), generator=gen)
    before = k_cache.clone()
    req = KVCacheRequest(cache_seqlens=seqlens, seqlen_new=3, cache_leftpad=leftpad, softmax_scale=0.25, causal=True)
    kvcache.append(k_cache, v_cache, k_new, v_new, req)
    assert torch.equal(k_cache[0, 8:], before[0, 8:]) and torch.equal(k_cache[0, 5:8], k_new[0])
    written = 0 if bad_len < 0 else min(bad_len, 32)
    assert torch.equal(k_cache[1, :written], before[1, :written])
    out, _ = kvcache.attention(q, k_cache, v_cache, req)
    ref, _ = naive_attention(q[:1], k_cache[:1, :8], v_cache[:1, :8], softmax_scale=0.25, causal=True)
    torch.testing.assert_close(out[:1], ref, atol=2e-5, rtol=1e-4)
    assert torch.isfinite(out).all()
