"""CUDA-graph capture (GPU only): the forward, the backward and KV-cache decoding record into a torch.cuda.CUDAGraph
and its replays compute what eager calls compute on the same inputs.

Each test warms the call up eagerly on a side stream (compiling its kernels and building its plans, as torch's
recipe asks), captures it over static input buffers, then copies new values into those buffers, replays, and
compares the graph's outputs with an eager call on the new values. A call that syncs the host, allocates outside
the graph's pool or keeps a pointer from the capture fails here: capture raises, or the replay reads stale data.
"""
import pytest
import torch

import flashtile
from flashtile.kvcache import flash_attn_with_kvcache
from flashtile.testing import cu_seqlens

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


def _warm_up(fn, times=2):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(times):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def _capture(fn):
    """(graph, the outputs fn returned while captured)."""
    _warm_up(fn)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs


def _refill(*tensors, seed):
    gen = torch.Generator(DEVICE).manual_seed(seed)
    for t in tensors:
        t.copy_(torch.randn(t.shape, device=DEVICE, generator=gen, dtype=torch.float32).to(t.dtype))


def _same(got, want, exact=True):
    for g, w in zip(got, want):
        if exact:
            assert torch.equal(g, w), (g - w).abs().max().item()
        else:
            torch.testing.assert_close(g, w, rtol=0, atol=2 * torch.finfo(w.dtype).eps * w.abs().max().item())


def _qkv(b, sq, sk, h, hk, d, dtype, grad=False):
    q = torch.empty(b, sq, h, d, device=DEVICE, dtype=dtype, requires_grad=grad)
    k = torch.empty(b, sk, hk, d, device=DEVICE, dtype=dtype, requires_grad=grad)
    v = torch.empty(b, sk, hk, d, device=DEVICE, dtype=dtype, requires_grad=grad)
    with torch.no_grad():
        _refill(q, k, v, seed=0)
    return q, k, v


# d64 and d128 take the Hopper Gluon kernels at these lengths, d256 the Gluon forward and the portable backward,
# fp16 d40 the portable kernels.
FWD_CASES = [
    (2, 1024, 1024, 8, 2, 128, True, torch.bfloat16),
    (1, 777, 1500, 4, 4, 64, True, torch.float16),
    (2, 300, 300, 4, 1, 256, False, torch.bfloat16),
    (1, 513, 257, 6, 3, 40, True, torch.float16),
]


def _ids(cases):
    return [f"B{b}-Sq{sq}-Sk{sk}-H{h}-Hk{hk}-D{d}-{'causal' if c else 'full'}-{str(t)[6:]}"
            for b, sq, sk, h, hk, d, c, t in cases]


@pytest.mark.parametrize("b,sq,sk,h,hk,d,causal,dtype", FWD_CASES, ids=_ids(FWD_CASES))
def test_forward_replays(b, sq, sk, h, hk, d, causal, dtype):
    q, k, v = _qkv(b, sq, sk, h, hk, d, dtype)

    def call():
        return flashtile.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)[:2]

    graph, (out, lse) = _capture(call)
    for seed in (1, 2):
        _refill(q, k, v, seed=seed)
        graph.replay()
        _same((out, lse), call())


@pytest.mark.parametrize("b,sq,sk,h,hk,d,causal,dtype", FWD_CASES, ids=_ids(FWD_CASES))
def test_forward_backward_replays(b, sq, sk, h, hk, d, causal, dtype):
    """The backward in the same graph: gradients land in static .grad buffers (zeroed before capture, as torch's
    whole-network recipe does). dq may be summed with atomics, so gradients compare to eager within 2 ulps."""
    q, k, v = _qkv(b, sq, sk, h, hk, d, dtype, grad=True)
    dout = torch.empty(b, sq, h, d, device=DEVICE, dtype=dtype)
    _refill(dout, seed=10)

    def step():
        out = flashtile.flash_attn_func(q, k, v, causal=causal)
        out.backward(dout)
        return out.detach()

    _warm_up(step)
    for t in (q, k, v):
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    grads = (q.grad, k.grad, v.grad)
    for seed in (3, 4):
        with torch.no_grad():
            _refill(q, k, v, dout, seed=seed)
        graph.replay()
        got = [out.clone()] + [g.clone() for g in grads]
        eager_out = flashtile.flash_attn_func(q, k, v, causal=causal)
        want = [eager_out.detach()] + list(torch.autograd.grad(eager_out, (q, k, v), dout))
        _same(got[:1], want[:1])
        _same(got[1:], want[1:], exact=False)


def test_varlen_forward_replays():
    lens = [300, 1, 0, 1024, 77]
    cu = cu_seqlens(lens, device=DEVICE)
    total, h, hk, d = sum(lens), 8, 2, 128
    q = torch.empty(total, h, d, device=DEVICE, dtype=torch.bfloat16)
    k = torch.empty(total, hk, d, device=DEVICE, dtype=torch.bfloat16)
    v = torch.empty_like(k)
    _refill(q, k, v, seed=0)

    def call():
        return flashtile.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                                                return_attn_probs=True)[:2]

    graph, (out, lse) = _capture(call)
    _refill(q, k, v, seed=5)
    graph.replay()
    _same((out, lse), call())


def test_dropout_replays_draw_new_masks():
    """Each replay draws a new Philox key from torch's generator (graph-safe): two replays over the same inputs
    differ from each other and from the output without dropout, and stay finite."""
    q, k, v = _qkv(1, 256, 256, 4, 4, 64, torch.bfloat16)

    def call():
        return flashtile.flash_attn_func(q, k, v, dropout_p=0.3)

    graph, out = _capture(call)
    graph.replay()
    first = out.clone()
    graph.replay()
    assert torch.isfinite(first).all() and torch.isfinite(out).all()
    assert not torch.equal(first, out)
    assert not torch.equal(first, flashtile.flash_attn_func(q, k, v))


@pytest.mark.parametrize("paged", (False, True), ids=("contiguous", "paged"))
def test_decode_replays_with_new_lengths(paged):
    """flash_attn_with_kvcache appending one token per sequence, cache_seqlens read on the device only: replays
    with new lengths (copied into the captured tensor) match eager calls, cache writes included."""
    b, h, hk, d, capacity, page = 3, 8, 2, 128, 1024, 64
    dtype = torch.bfloat16
    gen = torch.Generator(DEVICE).manual_seed(0)
    if paged:
        pages = b * capacity // page
        k_cache = torch.randn(pages, page, hk, d, device=DEVICE, generator=gen).to(dtype)
        block_table = torch.randperm(pages, device=DEVICE, generator=gen).to(torch.int32).view(b, -1)
    else:
        k_cache = torch.randn(b, capacity, hk, d, device=DEVICE, generator=gen).to(dtype)
        block_table = None
    v_cache = torch.randn_like(k_cache)
    q = torch.empty(b, 1, h, d, device=DEVICE, dtype=dtype)
    k_new = torch.empty(b, 1, hk, d, device=DEVICE, dtype=dtype)
    v_new = torch.empty_like(k_new)
    seqlens = torch.tensor([5, 600, 1000], dtype=torch.int32, device=DEVICE)
    _refill(q, k_new, v_new, seed=1)

    def call(kc, vc):
        return flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens, block_table=block_table,
                                       causal=True, return_softmax_lse=True)

    caches = (k_cache.clone(), v_cache.clone())
    graph, (out, lse) = _capture(lambda: call(*caches))
    for lengths in ([0, 17, 1022], [1023, 1, 512]):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        _refill(q, k_new, v_new, seed=sum(lengths))
        start = [c.clone() for c in caches]
        graph.replay()
        eager = [c.clone() for c in start]
        want = call(*eager)
        _same((out, lse) + caches, tuple(want) + tuple(eager))
        for c, s in zip(caches, start):
            c.copy_(s)
