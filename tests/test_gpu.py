"""GPU-only checks (`pytest -m gpu` on a machine with a CUDA GPU): large shapes, the Hopper pitfall shapes, every
head dim compiled, fp32 with and without tf32, the two memory paths against each other, 64-bit offsets.

Judged like the CPU suite (flashtile.testing): float64 oracle, error at most 3x plain PyTorch's in the same dtype.
"""
import pytest
import torch

import flashtile
from flashtile._settings import SETTINGS
from flashtile.kernels import configs

from flashtile.testing import assert_close, check_against_reference, cu_seqlens, make_qkv, max_err, reference_fwd_bwd

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
DTYPE_IDS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def _fwd_bwd(q, k, v, dout, causal, **kw):
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, **kw)
    dq, dk, dv = torch.autograd.grad((out * dout).sum(), (q, k, v))
    return out.detach(), lse.detach(), dq, dk, dv


def _check(b, sq, sk, h, hk, d, causal, dtype, seed=0):
    q, k, v = make_qkv(b, sq, sk, h, hk, d, dtype, device=DEVICE, seed=seed)
    dout = torch.randn(q.shape, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(seed + 1)).to(dtype)
    got = _fwd_bwd(q, k, v, dout, causal)
    check_against_reference(got, q.detach(), k.detach(), v.detach(), dout, d ** -0.5, causal, sk - sq)


def _pid(b, sq, sk, h, hk, d, causal, dtype):
    return f"B{b}-Sq{sq}-Sk{sk}-H{h}-Hk{hk}-D{d}-{'causal' if causal else 'full'}-{DTYPE_IDS[dtype]}"


LARGE = [
    (2, 1024, 1024, 16, 16, 64, False, torch.bfloat16),
    (2, 1024, 1024, 16, 4, 128, True, torch.float16),
    (1, 4096, 4096, 8, 8, 128, True, torch.bfloat16),
    (1, 4096, 4096, 4, 1, 256, False, torch.bfloat16),
    (1, 3001, 5003, 4, 2, 96, True, torch.bfloat16),
    (1, 5003, 3001, 4, 2, 64, True, torch.float16),
    (1, 16384, 16384, 2, 2, 128, True, torch.bfloat16),
    (1, 16384, 16384, 2, 1, 64, False, torch.float16),
]


@pytest.mark.parametrize("b,sq,sk,h,hk,d,causal,dtype", [pytest.param(*c, id=_pid(*c)) for c in LARGE])
def test_large_shapes(b, sq, sk, h, hk, d, causal, dtype):
    _check(b, sq, sk, h, hk, d, causal, dtype, seed=sq + d)


# Hopper pitfalls reported for wgmma: head dim <= 32 with 4+ warps, and backward tiles (BLOCK_M = 128, 4 warps).
@pytest.mark.parametrize("d", (8, 16, 24, 32))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=DTYPE_IDS.get)
def test_small_head_dims(d, causal, dtype):
    _check(2, 1000, 1100, 4, 2, d, causal, dtype, seed=d)


# Every multiple of 8 in bf16 (each is its own compiled kernel set); fp32 at the tile-size edges.
_HEAD_DIM_CASES = [(d, torch.bfloat16) for d in range(8, 257, 8)] + [
    (d, torch.float32) for d in (8, 40, 64, 128, 136, 256)]


@pytest.mark.parametrize("d,dtype", _HEAD_DIM_CASES, ids=[f"D{d}-{DTYPE_IDS[t]}" for d, t in _HEAD_DIM_CASES])
def test_every_head_dim(d, dtype):
    _check(1, 300, 333, 2, 1, d, True, dtype, seed=d)


@pytest.mark.parametrize("d", (64, 128, 256))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=DTYPE_IDS.get)
def test_preferred_tiles_compile(monkeypatch, d, causal, dtype):
    """The tuned tiles (first candidate) must compile on this GPU; a fallback would silently cost speed. The
    portable kernels' tiles are checked with the Hopper Gluon kernels switched off (they take these calls)."""
    from flashtile.kernels.features import Features
    from flashtile.request import AttentionRequest
    monkeypatch.setattr(SETTINGS, "gluon_forward", False)
    monkeypatch.setattr(SETTINGS, "gluon_backward", False)
    _check(1, 1024, 1024, 4, 4, d, causal, dtype, seed=1)
    # Only this call's (featureless) launches: other tests in the same process launch feature variants, whose
    # own first candidates may not fit.
    plain = Features(AttentionRequest(softmax_scale=1.0, window_right=0 if causal else -1)).variant()
    for kind in ("fwd", "bwd_dkdv", "bwd_dq"):
        settled = configs.chosen(kind, d, causal, dtype, plain)
        assert settled, f"no {kind} launch recorded"
        for tile, index in settled:
            assert index == 0, f"{kind} d{d} causal={causal} {dtype} fell back to candidate {index} ({tile})"


@pytest.mark.parametrize("allow_tf32", (False, True), ids=("ieee", "tf32"))
def test_fp32_follows_allow_tf32(allow_tf32):
    """fp32 matmuls follow torch.backends.cuda.matmul.allow_tf32; the baseline is plain PyTorch under the same flag."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    try:
        _check(2, 513, 700, 4, 2, 64, True, torch.float32, seed=3)
        q, k, v = make_qkv(1, 256, 256, 2, 2, 64, torch.float32, device=DEVICE, seed=4, grad=False)
        out = flashtile.flash_attn_func(q, k, v)
        ref = flashtile.reference.naive_attention(q.double(), k.double(), v.double())[0]
        err = max_err(out, ref)
        # Full fp32 lands near 1e-6 here; tf32 (10-bit mantissa) near 1e-3.
        assert (err < 1e-5) if not allow_tf32 else (1e-5 < err < 1e-2), f"error {err:.2e} with tf32={allow_tf32}"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_pointer_path_matches_tma(monkeypatch, causal):
    """The pointer path (other GPUs, unaligned strides) computes what the TMA path computes."""
    q, k, v = make_qkv(2, 777, 1031, 8, 2, 128, torch.bfloat16, device=DEVICE, seed=6)
    dout = torch.randn(q.shape, device=DEVICE).to(torch.bfloat16)
    tma = _fwd_bwd(q, k, v, dout, causal)
    monkeypatch.setattr(SETTINGS, "tma", False)
    ptr = _fwd_bwd(q, k, v, dout, causal)
    for a, b in zip(tma, ptr):
        if a.dtype == torch.float32:  # the LSE
            torch.testing.assert_close(a, b, atol=0, rtol=0)
        else:
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


@pytest.mark.serial  # ~40 GB of device memory: run alone (pytest -m "gpu and serial"), not beside other workers
def test_int64_offsets_batch():
    """batch * seqlen * heads * headdim > 2^31: the per-(batch, head) base offsets must not wrap."""
    b, s, h, d = 2100, 512, 16, 128
    assert b * s * h * d > 2 ** 31
    q, k, v = make_qkv(b, s, s, h, h, d, torch.bfloat16, device=DEVICE, seed=8)
    dout = torch.randn(q.shape, device=DEVICE).to(torch.bfloat16)
    out, lse, dq, dk, dv = _fwd_bwd(q, k, v, dout, True)
    last = slice(b - 1, b)  # every batch element is independent: judge the last one, whose offsets are largest
    got = tuple(t[last] for t in (out, lse, dq, dk, dv))
    check_against_reference(got, q.detach()[last], k.detach()[last], v.detach()[last], dout[last], d ** -0.5,
                            True, 0)


@pytest.mark.serial  # ~30 GB (q, dout, out, dq at 4.5 GB each, the backward's fp32 dQ buffer at 9 GB): run alone
def test_int64_offsets_seqlen():
    """seqlen * heads * headdim > 2^31 inside one batch element: row offsets must not wrap. Rows of the output and
    of dq are independent of each other, so the last rows are judged on their own."""
    sq, sk, h, d = 1_100_000, 64, 16, 128
    assert sq * h * d > 2 ** 31
    q, k, v = make_qkv(1, sq, sk, h, h, d, torch.bfloat16, device=DEVICE, seed=10)
    dout = torch.randn(q.shape, device=DEVICE).to(torch.bfloat16)
    out, lse, dq, _, _ = _fwd_bwd(q, k, v, dout, False)
    rows = slice(sq - 300, sq)
    q_t, dout_t = q.detach()[:, rows], dout[:, rows]
    for name, got, idx in (("out", out, 0), ("lse", lse, 1), ("dq", dq, 2)):
        ref = reference_fwd_bwd(q_t.double(), k.detach().double(), v.detach().double(), dout_t.double(),
                                d ** -0.5, False, 0)[idx]
        plain = reference_fwd_bwd(q_t, k.detach(), v.detach(), dout_t, d ** -0.5, False, 0)[idx]
        g = got[:, :, rows] if name == "lse" else got[:, rows]
        assert_close(name, g, ref, plain, torch.float32 if name == "lse" else torch.bfloat16)


def test_backward_deterministic_large():
    """deterministic=True: bit-identical gradients over 30 runs (on Hopper the default backward's dQ is not)."""
    q, k, v = make_qkv(2, 4096, 4096, 16, 4, 128, torch.bfloat16, device=DEVICE, seed=12)
    dout = torch.randn(q.shape, device=DEVICE).to(torch.bfloat16)
    first = _fwd_bwd(q, k, v, dout, True, deterministic=True)[2:]
    for _ in range(29):
        again = _fwd_bwd(q, k, v, dout, True, deterministic=True)[2:]
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.parametrize("d,dtype", [(64, torch.bfloat16), (128, torch.float16), (128, torch.bfloat16)],
                         ids=("D64-bf16", "D128-fp16", "D128-bf16"))
def test_even_seqlen_non_causal(d, dtype):
    """Non-causal with Sk a multiple of every tile: the single-loop (EVEN_N) kernels, the shapes that exposed a
    wrong LSE under warp specialization."""
    _check(1, 4096, 4096, 16, 16, d, False, dtype, seed=d)


# --------------------------------------------------------------------------------------------------------------
# Features at sizes the interpreter cannot reach (tests/test_features.py runs the small ones compiled too)
# --------------------------------------------------------------------------------------------------------------

def _feature_check(b, sq, sk, h, hk, d, dtype, seed, causal=False, sinks=False, **kw):
    q, k, v = make_qkv(b, sq, sk, h, hk, d, dtype, device=DEVICE, seed=seed)
    gen = torch.Generator(DEVICE).manual_seed(seed + 1)
    dout = torch.randn(q.shape, device=DEVICE, generator=gen).to(dtype)
    sink = torch.randn(h, device=DEVICE, generator=gen).requires_grad_() if sinks else None
    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=causal, sinks=sink, return_attn_probs=True, **kw)
    grads = torch.autograd.grad((out * dout).sum(), [q, k, v] + ([sink] if sinks else []))
    got = (out.detach(), lse.detach(), *grads[:3], None, grads[3] if sinks else None)
    ref_kw = dict(kw)
    if sinks:
        ref_kw["sinks"] = sink.detach()
    check_against_reference(got, q.detach(), k.detach(), v.detach(), dout, d ** -0.5, causal, sk - sq, **ref_kw)


FEATURES_LARGE = [
    ("window-causal", dict(causal=True, window_size=(300, 0))),
    ("window-both", dict(window_size=(200, 333))),
    ("softcap", dict(softcap=20.0)),
    ("alibi-causal", dict(causal=True, alibi_slopes="slopes")),
    ("sinks-causal", dict(causal=True, sinks=True)),
    ("all", dict(causal=True, window_size=(500, 0), softcap=15.0, alibi_slopes="slopes", sinks=True)),
]


@pytest.mark.parametrize("name,kw", FEATURES_LARGE, ids=[f[0] for f in FEATURES_LARGE])
@pytest.mark.parametrize("d", (64, 128))
def test_features_large(name, kw, d):
    kw = dict(kw)
    if kw.get("alibi_slopes") == "slopes":
        kw["alibi_slopes"] = torch.rand(8, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(d)) * 0.1
    _feature_check(1, 2000, 2500, 8, 2, d, torch.bfloat16, seed=d + len(name), **kw)


def test_dropout_large():
    """Dropped fraction within 1% of p at 2k x 2k x 8 heads, and the output and grads against the reference
    with the same (independently generated) Philox mask."""
    from flashtile.reference.dropout import dropout_mask
    b, s, h, d, p = 1, 1024, 8, 64, 0.15
    q, k, v = make_qkv(b, s, s, h, h, d, torch.bfloat16, device=DEVICE, seed=3)
    dout = torch.randn(q.shape, device=DEVICE).to(torch.bfloat16)
    torch.manual_seed(5)
    out, lse, s_dmask = flashtile.flash_attn_func(q, k, v, dropout_p=p, causal=True, return_attn_probs=True)
    grads = torch.autograd.grad((out * dout).sum(), [q, k, v])
    torch.manual_seed(5)
    seed = int(torch.randint(0, 2 ** 62, (1,), dtype=torch.int64, device=DEVICE).item())
    mask = dropout_mask(seed, b, h, s, s, p, device=DEVICE)
    visible = torch.ones(s, s, dtype=torch.bool, device=DEVICE).tril()
    assert abs((~mask[..., visible]).float().mean().item() - p) < 0.01
    assert torch.equal(s_dmask < 0, ~mask & visible)
    check_against_reference((out.detach(), lse.detach(), *grads), q.detach(), k.detach(), v.detach(), dout,
                            d ** -0.5, True, 0, dropout_p=p, dropout_mask=mask)


def test_varlen_large():
    lens = [1, 0, 1500, 777, 3000, 64]
    cu = cu_seqlens(lens, DEVICE)
    total, h, hk, d = sum(lens), 8, 2, 128
    gen = torch.Generator(DEVICE).manual_seed(7)
    q = torch.randn((total, h, d), device=DEVICE, generator=gen).to(torch.bfloat16).requires_grad_()
    k, v = (torch.randn((total, hk, d), device=DEVICE, generator=gen).to(torch.bfloat16).requires_grad_()
            for _ in range(2))
    dout = torch.randn((total, h, d), device=DEVICE, generator=gen).to(torch.bfloat16)
    out, lse, _ = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                                                   window_size=(256, 0), return_attn_probs=True)
    grads = torch.autograd.grad((out * dout).sum(), [q, k, v])
    bounds = cu.tolist()
    for i in range(len(lens)):
        if lens[i] == 0:
            continue
        r = slice(bounds[i], bounds[i + 1])
        seq = lambda t: t[r].unsqueeze(0)  # noqa: E731
        check_against_reference((seq(out.detach()), lse.detach()[:, r].unsqueeze(0), *(seq(g) for g in grads)),
                                seq(q).detach(), seq(k).detach(), seq(v).detach(), seq(dout), d ** -0.5, True, 0,
                                window_size=(256, 0))


def test_bias_large():
    b, s, h, d = 2, 1500, 4, 64
    q, k, v = make_qkv(b, s, s, h, h, d, torch.float16, device=DEVICE, seed=8)
    bias = torch.randn((1, h, s, s), device=DEVICE).to(torch.float16)
    bias[..., :, 100:400] = float("-inf")
    bias.requires_grad_()
    dout = torch.randn(q.shape, device=DEVICE).to(torch.float16)
    out = flashtile.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=bias)
    out = out.transpose(1, 2)
    grads = torch.autograd.grad((out * dout).sum(), [q, k, v, bias])
    check_against_reference((out.detach(), None, *grads, None), q.detach(), k.detach(), v.detach(), dout,
                            d ** -0.5, False, 0, attn_bias=bias)


@pytest.mark.parametrize("d,dv", [(192, 128), (512, 512)], ids=("mla-192-128", "d512"))
def test_wide_head_dims(d, dv):
    q, k, _ = make_qkv(1, 700, 900, 4, 2, d, torch.bfloat16, device=DEVICE, seed=d)
    v = torch.randn((1, 900, 2, dv), device=DEVICE).to(torch.bfloat16).requires_grad_()
    dout = torch.randn((1, 700, 4, dv), device=DEVICE).to(torch.bfloat16)
    got = _fwd_bwd(q, k, v, dout, True)
    check_against_reference(got, q.detach(), k.detach(), v.detach(), dout, d ** -0.5, True, 200)


def test_deterministic_30_runs():
    """deterministic=True (always on): 30 backward passes give bit-identical gradients, GQA, window, ALiBi and a
    bias gradient included."""
    q, k, v = make_qkv(2, 2048, 2048, 16, 4, 128, torch.bfloat16, device=DEVICE, seed=30)
    dout = torch.randn(q.shape, device=DEVICE).to(torch.bfloat16)
    slopes = torch.rand(16, device=DEVICE) * 0.1

    def grads():
        out = flashtile.flash_attn_func(q, k, v, causal=True, window_size=(700, 0), alibi_slopes=slopes,
                                        deterministic=True)
        return torch.autograd.grad((out * dout).sum(), [q, k, v])

    first = grads()
    for _ in range(29):
        for a, b in zip(first, grads()):
            assert torch.equal(a, b)
    bias = torch.randn((1, 16, 512, 512), device=DEVICE).to(torch.bfloat16).requires_grad_()
    qs, ks, vs = (t.detach()[:, :512].transpose(1, 2).requires_grad_() for t in (q, k, v))

    def bias_grads():
        out = flashtile.scaled_dot_product_attention(qs, ks, vs, attn_mask=bias, enable_gqa=True)
        return torch.autograd.grad(out.float().square().sum(), [qs, ks, vs, bias])

    first = bias_grads()
    for _ in range(29):
        for a, b in zip(first, bias_grads()):
            assert torch.equal(a, b)


def test_repeated_calls_skip_the_jit(monkeypatch):
    """A call with a key seen before launches the compiled kernels directly (kernels/_launch.py): no
    JITFunction.run at all in a repeated forward and backward, with the same results as the JIT path (dQ within
    rounding: the Hopper backward adds it in a varying order)."""
    import triton
    q, k, v = make_qkv(2, 1000, 1000, 4, 2, 128, torch.bfloat16, device=DEVICE, seed=5)
    dout = torch.randn(q.shape, device=DEVICE, dtype=torch.bfloat16)
    first = _fwd_bwd(q, k, v, dout, True)

    def no_jit(*args, **kwargs):
        raise AssertionError("a repeated call went through JITFunction.run")

    monkeypatch.setattr(triton.runtime.jit.JITFunction, "run", no_jit)
    cached = _fwd_bwd(q, k, v, dout, True)
    monkeypatch.undo()
    monkeypatch.setattr(SETTINGS, "fast_launch", False)
    jit = _fwd_bwd(q, k, v, dout, True)
    for name, a, b, c in zip(("out", "lse", "dq", "dk", "dv"), first, cached, jit):
        if name == "dq":
            torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)
            torch.testing.assert_close(a, c, atol=1e-2, rtol=1e-2)
        else:
            assert torch.equal(a, b) and torch.equal(a, c), name


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_tensors_on_another_gpu(varlen):
    """A model spread over GPUs in one process (device_map) calls attention on a GPU that is not the current device:
    the call switches to the tensors' GPU (Triton launches on the current one and refused the pointers before), and
    gives what the same call gives with that GPU current; the current device is left as it was."""
    gen = torch.Generator("cuda:1").manual_seed(3)
    lens = [300, 0, 701]
    shape = (sum(lens), 8, 128) if varlen else (2, 500, 8, 128)
    q, k, v, dout = (torch.randn(shape, device="cuda:1", generator=gen).to(torch.bfloat16) for _ in range(4))
    cu = cu_seqlens(lens, "cuda:1")

    def call():
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        if varlen:
            out = flashtile.flash_attn_varlen_func(qg, kg, vg, cu, cu, max(lens), max(lens), causal=True)
        else:
            out = flashtile.flash_attn_func(qg, kg, vg, causal=True)
        return [out] + list(torch.autograd.grad(out, (qg, kg, vg), dout))

    with torch.cuda.device(1):
        want = call()
    with torch.cuda.device(0):
        got = call()
        assert torch.cuda.current_device() == 0
    assert all(g.device == torch.device("cuda:1") for g in got)
    assert torch.equal(got[0], want[0])
    for g, w in zip(got[1:], want[1:]):  # dQ's reductions land in any order
        torch.testing.assert_close(g, w, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_same_calls_on_two_gpus(varlen):
    """Layers of one shape on two GPUs in one process (device_map): the second GPU's calls have the first's launch
    keys, and a compiled kernel is loaded on one GPU only, so each GPU must launch kernels loaded on it
    (_launch._COMPILED is per device). Each GPU's fwd+bwd, with that GPU current, gives what the other gives; GPU 1
    goes first, then GPU 0, then GPU 1 again with GPU 0's plans and kernels cached."""
    lens = [300, 0, 701, 2048]
    shape = (sum(lens), 8, 128) if varlen else (2, 1500, 8, 128)
    gen = torch.Generator("cuda:1").manual_seed(5)
    inputs = [torch.randn(shape, device="cuda:1", generator=gen).to(torch.bfloat16) for _ in range(4)]

    def call(device):
        q, k, v, dout = (t.to(device) for t in inputs)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        with torch.cuda.device(device):
            if varlen:
                cu = cu_seqlens(lens, device)
                out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
            else:
                out = flashtile.flash_attn_func(q, k, v, causal=True)
            grads = torch.autograd.grad(out, (q, k, v), dout)
        return [t.cpu() for t in (out, *grads)]

    first, other, again = call(torch.device("cuda:1")), call(torch.device("cuda:0")), call(torch.device("cuda:1"))
    for got in (other, again):
        assert torch.equal(got[0], first[0])
        for g, w in zip(got[1:], first[1:]):  # dQ's reductions land in any order
            torch.testing.assert_close(g, w, atol=2e-2, rtol=2e-2)
