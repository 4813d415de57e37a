"""Launch plans (flashtile/dispatch.py, "Plans"): a repeated eager call reuses the backend choice, tiles, grids,
scalar arguments and compiled kernels of the first call with its plan key.

On the CPU the plans run in Triton's interpreter; inside flashtile.testing.fast_launch_on_cpu they also take the
path CUDA tensors take (the compile cache, bound launches calling a compiled kernel's launcher, here one that runs
the interpreter), so the arguments a cached call hands to the launcher are checked. Each result is compared bit for
bit with the same call without plans (SETTINGS.fast_launch off: every call chooses and builds anew).
"""
import gc
import weakref

import pytest
import torch

import flashtile
from flashtile import dispatch
from flashtile._settings import SETTINGS, override
from flashtile.kernels import _launch
from flashtile.kernels.configs import TileConfig
from flashtile.request import AttentionRequest
from flashtile.testing import cu_seqlens, fast_launch_on_cpu

CUDA = torch.cuda.is_available()


def _randn(shape, dtype, device, seed, grad=True):
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype).requires_grad_(grad)


def _flash(device, dtype, b, sq, sk, h, hk, d, seed=0, **kw):
    """flash_attn_func forward and backward (the LSE in the loss too: dlse) -> out, lse, dq, dk, dv."""
    q = _randn((b, sq, h, d), dtype, device, seed)
    k, v = _randn((b, sk, hk, d), dtype, device, seed + 1), _randn((b, sk, hk, d), dtype, device, seed + 2)
    torch.manual_seed(seed)  # dropout's seed
    out, lse, _ = flashtile.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    dout = _randn(out.shape, dtype, device, seed + 3, grad=False)
    grads = torch.autograd.grad((out * dout).sum() + lse.sum(), (q, k, v))
    return (out, lse) + grads


def _strided(device, dtype, seed=0):
    """q, k, v as slices of one packed (B, S, 3, H, D) tensor, through the qkv-packed API and as views."""
    qkv = _randn((2, 37, 3, 2, 16), dtype, device, seed)
    out = flashtile.flash_attn_qkvpacked_func(qkv, causal=True)
    (dqkv,) = torch.autograd.grad(out.square().sum(), (qkv,))
    q, k, v = (qkv.detach()[:, :, i].requires_grad_() for i in range(3))
    out2 = flashtile.flash_attn_func(q, k, v, window_size=(4, 2))
    return (out, dqkv, out2) + torch.autograd.grad(out2.square().sum(), (q, k, v))


def _varlen(device, dtype, seed=0, lengths=(5, 0, 23, 17), d=16, **kw):
    cu = cu_seqlens(lengths, device)
    q = _randn((sum(lengths), 4, d), dtype, device, seed)
    k, v = _randn((sum(lengths), 2, d), dtype, device, seed + 1), _randn((sum(lengths), 2, d), dtype, device,
                                                                          seed + 2)
    torch.manual_seed(seed)
    out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), **kw)
    return (out,) + torch.autograd.grad(out.square().sum(), (q, k, v))


def _sdpa(device, dtype, mask_kind, seed=0):
    """scaled_dot_product_attention's (B, H, S, D) views with a float bias (with its gradient) or a bool mask."""
    q = _randn((1, 3, 40, 16), dtype, device, seed)
    k, v = _randn((1, 3, 33, 16), dtype, device, seed + 1), _randn((1, 3, 33, 16), dtype, device, seed + 2)
    if mask_kind == "bool":
        mask = torch.rand((1, 1, 40, 33), generator=torch.Generator(device).manual_seed(seed), device=device) > 0.3
    else:
        mask = _randn((1, 3, 40, 33), dtype, device, seed + 4)
    out = flashtile.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    inputs = (q, k, v) + ((mask,) if mask.requires_grad else ())
    return (out,) + torch.autograd.grad(out.square().sum(), inputs)


# A sequence of calls changing one ingredient of the plan key at a time: shapes (Sq != Sk both ways, GQA), dtype,
# strides, options, the request's tensors. Small enough for the interpreter.
CPU_CALLS = [
    ("causal-gqa", lambda dev: _flash(dev, torch.float16, 1, 33, 40, 4, 2, 16, causal=True)),
    ("Sq>Sk", lambda dev: _flash(dev, torch.float16, 1, 40, 33, 4, 2, 16, causal=True)),
    ("bf16", lambda dev: _flash(dev, torch.bfloat16, 1, 40, 33, 4, 2, 16, causal=True)),
    ("fp32-full", lambda dev: _flash(dev, torch.float32, 2, 17, 40, 2, 1, 24)),
    ("window-softcap", lambda dev: _flash(dev, torch.float16, 1, 33, 40, 4, 2, 16, window_size=(6, 3),
                                          softcap=5.0)),
    ("scale", lambda dev: _flash(dev, torch.float16, 1, 33, 40, 4, 2, 16, causal=True, softmax_scale=0.3)),
    ("alibi-sinks", lambda dev: _flash(dev, torch.float16, 1, 33, 40, 4, 2, 16, causal=True,
                                       alibi_slopes=torch.rand(4, device=dev),
                                       sinks=torch.randn(4, device=dev, requires_grad=True))),
    ("dropout", lambda dev: _flash(dev, torch.float16, 1, 33, 40, 4, 2, 16, dropout_p=0.25)),
    ("deterministic", lambda dev: _flash(dev, torch.float16, 1, 33, 40, 4, 2, 16, causal=True, deterministic=True)),
    ("strided-packed", lambda dev: _strided(dev, torch.float16)),
    ("varlen", lambda dev: _varlen(dev, torch.float16, causal=True)),
    ("varlen-dropout", lambda dev: _varlen(dev, torch.float16, dropout_p=0.2)),
    ("sdpa-float-bias", lambda dev: _sdpa(dev, torch.float32, "float")),
    ("sdpa-bool-mask", lambda dev: _sdpa(dev, torch.float16, "bool")),
    ("causal-gqa-again", lambda dev: _flash(dev, torch.float16, 1, 33, 40, 4, 2, 16, causal=True, seed=9)),
]


def _assert_identical(got, want, label):
    assert len(got) == len(want), label
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, (label, i)
        assert torch.equal(a.detach().nan_to_num(7.0), b.detach().nan_to_num(7.0)), (label, i)


def test_cached_calls_match_uncached():
    """Each call of the sequence, made twice with plans (the second one cached, through the compiled-kernel path),
    gives exactly what it gives without plans; every call kind leaves plans (no call falls back)."""
    with fast_launch_on_cpu():
        for name, call in CPU_CALLS:
            with override(fast_launch=False):
                want = call("cpu")
            before = len(dispatch._PLANS)
            first = call("cpu")
            built = len(dispatch._PLANS) - before
            second = call("cpu")
            assert len(dispatch._PLANS) - before == built, f"{name}: the second call built a plan again"
            assert built > 0 or name.endswith("again"), f"{name}: no plan was built"
            _assert_identical(first, want, name)
            _assert_identical(second, want, name)


def test_varlen_plan_takes_each_calls_offsets():
    """Varlen calls whose offsets differ in value only (same number of sequences, rows and longest length) share a
    plan, which takes each call's offsets (the backward swaps them into the arguments it built for the first call):
    each matches the same call without plans."""
    with fast_launch_on_cpu():
        for lengths in ((5, 0, 23, 17), (23, 17, 5, 0), (0, 23, 11, 11)):
            with override(fast_launch=False):
                want = _varlen("cpu", torch.float16, lengths=lengths, causal=True)
            before = len(dispatch._PLANS)
            got = _varlen("cpu", torch.float16, lengths=lengths, causal=True)
            assert lengths == (5, 0, 23, 17) or len(dispatch._PLANS) == before, "the offsets' values made a new plan"
            _assert_identical(got, want, str(lengths))


def test_cached_call_skips_choice_and_compile(monkeypatch):
    """A call whose key has a plan neither consults the dispatch nor reaches Triton's JIT: its launches call the
    compiled kernels' launchers directly."""
    with fast_launch_on_cpu():
        first = _flash("cpu", torch.float16, 1, 33, 40, 4, 2, 16, causal=True)
        jit_launches = []
        real_jit = _launch._jit_launch

        def counted(*args, **kwargs):
            jit_launches.append(args[0])
            return real_jit(*args, **kwargs)

        def refuse(*args, **kwargs):
            raise AssertionError("a cached call chose its backend again")

        monkeypatch.setattr(_launch, "_jit_launch", counted)
        monkeypatch.setattr(dispatch, "choose_forward", refuse)
        monkeypatch.setattr(dispatch, "choose_backward", refuse)
        second = _flash("cpu", torch.float16, 1, 33, 40, 4, 2, 16, causal=True)
        monkeypatch.undo()
        assert not jit_launches
        _assert_identical(second, first, "repeat")


def test_plans_keep_no_tensors():
    """A plan holds none of its calls' tensors: inputs and outputs are freed with the plan still cached."""
    with fast_launch_on_cpu():
        q = _randn((1, 33, 4, 16), torch.float16, "cpu", 0)
        k = _randn((1, 40, 2, 16), torch.float16, "cpu", 1)
        v = _randn((1, 40, 2, 16), torch.float16, "cpu", 2)
        out = flashtile.flash_attn_func(q, k, v, causal=True)
        torch.autograd.grad(out.sum(), (q, k, v))
        refs = [weakref.ref(t) for t in (q, k, v, out)]
        del q, k, v, out
        gc.collect()
        assert dispatch._PLANS and all(r() is None for r in refs)


def _key_variants(q, k, v):
    """(name, plan key arguments) for a base call and calls that each differ from it in one ingredient."""
    req = AttentionRequest(softmax_scale=0.25, window_right=0, diagonal_offset=7)
    seed = torch.zeros(1, dtype=torch.int64)
    cu = torch.tensor([0, 10, 33], dtype=torch.int32)
    misaligned = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)
    strided = q.transpose(1, 2).contiguous().transpose(1, 2)
    with_req = [
        ("scale", dict(softmax_scale=0.5)), ("offset", dict(diagonal_offset=0)), ("left", dict(window_left=3)),
        ("right", dict(window_right=-1)), ("softcap", dict(softcap=2.0)), ("deterministic", dict(deterministic=True)),
        ("alibi", dict(alibi_slopes=torch.ones(4))), ("alibi-batch", dict(alibi_slopes=torch.ones(1, 4))),
        ("bias", dict(attn_bias=torch.zeros(1, 1, 33, 40))), ("mask", dict(attn_bias=torch.ones(1, 1, 33, 40).bool())),
        ("sinks", dict(sinks=torch.zeros(4))), ("dropout", dict(dropout_p=0.1, seed=seed)),
        ("varlen", dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=23, max_seqlen_k=23)),
        ("varlen-max", dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=24, max_seqlen_k=23)),
    ]
    variants = [("base", (q, (q, k, v), req))]
    variants += [(name, (q, (q, k, v), AttentionRequest(**{**_fields(req), **change}))) for name, change in with_req]
    variants += [
        ("q shape", (q[:, :32], (q[:, :32], k, v), req)),
        ("k shape", (q, (q, k[:, :39], v[:, :39]), req)),
        ("q strides", (strided, (strided, k, v), req)),
        ("dtype", (q.bfloat16(), (q.bfloat16(), k.bfloat16(), v.bfloat16()), req)),
        ("alignment", (misaligned, (misaligned, k, v), req)),
        ("heads (GQA)", (q, (q, k[:, :, :1], v[:, :, :1]), req)),
        ("head dim v", (q, (q, k, v[..., :8]), req)),
    ]
    return variants


def _fields(req):
    return {name: getattr(req, name) for name in AttentionRequest.field_names()}


def test_plan_key_changes_with_each_ingredient():
    """Every ingredient a launch depends on is in the plan key: changing any one of them (a shape, a stride, the
    dtype, 16-byte alignment, a scalar of the request, which of its tensors are set, a setting) gives a key of its
    own, so no call reuses another's plan."""
    q = torch.randn(1, 33, 4, 16, dtype=torch.float16)
    k, v = torch.randn(1, 40, 2, 16, dtype=torch.float16), torch.randn(1, 40, 2, 16, dtype=torch.float16)
    keys = {name: dispatch.plan_key(*args) for name, args in _key_variants(q, k, v)}
    base_args = _key_variants(q, k, v)[0][1]
    for name, change in [("gluon_forward", False), ("gluon_backward", False), ("lazy_max", False),
                         ("defer_check", False), ("tma", True), ("tiles", [TileConfig(16, 16, 4, 1)]),
                         ("tiles", {"fwd": [TileConfig(32, 16, 4, 1)]})]:
        with override(**{name: change}):
            keys[f"setting {name}={change}"] = dispatch.plan_key(*base_args)
    q32 = q.float()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        for flag in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = flag
            keys[f"fp32 tf32={flag}"] = dispatch.plan_key(q32, (q32, k.float(), v.float()), base_args[2])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    # The backward's: its extra tensors (dout, out, lse, dlse, given gradient buffers) and bias_requires_grad.
    out, lse = torch.empty(1, 33, 4, 16, dtype=q.dtype), torch.empty(1, 4, 33)
    bwd = (out, q, k, v, out, lse, None)
    keys["bwd"] = dispatch.plan_key(q, bwd, base_args[2])
    keys["bwd dlse"] = dispatch.plan_key(q, bwd[:-1] + (lse,), base_args[2])
    keys["bwd dlse strides"] = dispatch.plan_key(q, bwd[:-1] + (lse.sum().expand(lse.shape),), base_args[2])
    keys["bwd bias grad"] = dispatch.plan_key(q, bwd, base_args[2], True)
    keys["bwd grad buffers"] = dispatch.plan_key(q, bwd + (q, k, v), base_args[2])
    names = list(keys)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert keys[a] != keys[b], f"{a} and {b} share a plan key"


def test_plan_key_stable_for_same_call():
    """The same call twice (fresh tensors of the same shapes) has one key: the cache is hit."""
    def key():
        q = torch.randn(1, 33, 4, 16, dtype=torch.float16)
        k, v = torch.randn(1, 40, 2, 16, dtype=torch.float16), torch.randn(1, 40, 2, 16, dtype=torch.float16)
        return dispatch.plan_key(q, (q, k, v), AttentionRequest(softmax_scale=0.25, window_right=0))
    assert key() == key()


def test_settings_change_takes_a_new_plan():
    """Changing a setting between calls (here the tiles) takes effect on the next call, as without plans."""
    with fast_launch_on_cpu():
        first = _flash("cpu", torch.float16, 1, 33, 40, 4, 2, 16, causal=True)
        n = len(dispatch._PLANS)
        with override(tiles=[TileConfig(16, 16, 4, 1)]):
            small = _flash("cpu", torch.float16, 1, 33, 40, 4, 2, 16, causal=True)
        assert len(dispatch._PLANS) == n + 2  # a forward and a backward plan of their own
        with override(tiles=[TileConfig(16, 16, 4, 1)], fast_launch=False):
            want = _flash("cpu", torch.float16, 1, 33, 40, 4, 2, 16, causal=True)
    _assert_identical(small, want, "tiles")
    torch.testing.assert_close(first[0], small[0], atol=2e-3, rtol=0)


# GPU: the same sequence at the Gluon kernels' shapes (Hopper: forward at d64 / d128 16-bit, backward at d128 and
# long d64) and the portable ones. dQ of the Gluon backward is summed in a varying order (not bit-reproducible even
# without plans), so it is compared within rounding there.
GPU_CALLS = [
    ("gluon-d64-causal", lambda dev: _flash(dev, torch.bfloat16, 2, 256, 256, 4, 4, 64, causal=True), False),
    ("gluon-d128-gqa", lambda dev: _flash(dev, torch.bfloat16, 1, 300, 500, 8, 2, 128, causal=True), True),
    ("gluon-d64-long", lambda dev: _flash(dev, torch.float16, 1, 2100, 2100, 2, 1, 64), True),
    ("gluon-d128-dropout", lambda dev: _flash(dev, torch.bfloat16, 1, 256, 256, 4, 2, 128, dropout_p=0.2), True),
    ("tiny-d64", lambda dev: _flash(dev, torch.bfloat16, 1, 128, 128, 4, 4, 64, causal=True), False),
    ("tiny-d128", lambda dev: _flash(dev, torch.bfloat16, 1, 128, 128, 4, 4, 128, causal=True), True),
    ("portable-d96-fp32", lambda dev: _flash(dev, torch.float32, 2, 200, 300, 4, 2, 96, causal=True), False),
    ("portable-dropout", lambda dev: _flash(dev, torch.float16, 2, 200, 300, 4, 2, 40, dropout_p=0.3), False),
    ("deterministic-d128", lambda dev: _flash(dev, torch.bfloat16, 1, 256, 256, 4, 2, 128, causal=True,
                                              deterministic=True), False),
    ("varlen", lambda dev: _varlen(dev, torch.bfloat16, causal=True), False),
    ("gluon-varlen-d128", lambda dev: _varlen(dev, torch.bfloat16, lengths=(100, 0, 300, 177), d=128, causal=True),
     True),
    ("sdpa-float-bias", lambda dev: _sdpa(dev, torch.float32, "float"), False),
    ("sdpa-bool-mask", lambda dev: _sdpa(dev, torch.float16, "bool"), False),
    ("strided-packed", lambda dev: _strided(dev, torch.float16), False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("name,call,gluon_dq", GPU_CALLS, ids=[c[0] for c in GPU_CALLS])
def test_gpu_cached_plans_match_uncached(name, call, gluon_dq):
    """On a GPU: the second call of a key (cached plan, compiled-kernel launchers) gives bit for bit what the call
    gives without plans and with every launch through Triton's JIT (SETTINGS.fast_launch off)."""
    assert CUDA
    call("cuda")
    cached = call("cuda")
    with override(fast_launch=False):
        want = call("cuda")
    for i, (a, b) in enumerate(zip(cached, want)):
        if gluon_dq and i == len(cached) - 3:  # dq
            torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)
        else:
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), (name, i)
    assert SETTINGS.fast_launch


def test_shared_requests_match_fresh_ones(monkeypatch):
    """flash_attn_func's repeated calls share the request an earlier call with the same options built
    (interface._REQUESTS): each call's request equals the one the full checks build for it, whatever came before
    (options of other types or values, other lengths and head dims), and a rejected option is rejected every time."""
    from flashtile import _ops, interface
    seen = []
    real = _ops.attention

    def capture(q, k, v, req):
        seen.append(req)
        return real(q, k, v, req)

    monkeypatch.setattr(_ops, "attention", capture)
    q = torch.randn(1, 9, 2, 16)
    k = v = torch.randn(1, 12, 2, 16)
    calls = [dict(causal=True), dict(causal=1), dict(causal=False), dict(window_size=(3, 2)),
             dict(window_size=[3, 2]), dict(window_size=(3, 20)), dict(softmax_scale=0.5), dict(softmax_scale=1),
             dict(softcap=2.0), dict(deterministic=True), dict(causal=True, softmax_scale=-0.5), dict(causal=True)]
    for kw in calls * 2 + [dict(causal=True, q=q[:, :5]), dict(causal=True, q=q[..., :8], k=k[..., :8])]:
        kw = dict(kw)
        qq, kk = kw.pop("q", q), kw.pop("k", k)
        out = flashtile.flash_attn_func(qq, kk, kk, **kw)
        monkeypatch.setattr(interface, "_REQUESTS", {})
        fresh = flashtile.flash_attn_func(qq, kk, kk, **kw)
        assert seen[-2] == seen[-1], kw
        assert torch.equal(out, fresh), kw
    for bad in (dict(causal=True, dropout_p=False), dict(window_size=(True, 2)), dict(softcap=None)):
        for _ in range(2):
            with pytest.raises((TypeError, ValueError)):
                flashtile.flash_attn_func(q, k, v, **bad)


def test_scratch_buffer_kept_per_stream(monkeypatch):
    """Triton's global scratch (configs._Scratch): one buffer per stream, reused by launches that fit it, replaced
    by a larger one when a launch asks for more; under CUDA-graph capture every launch gets a buffer of its own (a
    kept one could be replaced, and freed, after the capture while the graph still points at it)."""
    from flashtile.kernels import configs
    scratch = configs._Scratch(torch.device("cpu"))
    first = scratch(1024, 128, 7)
    assert first.numel() >= 1024 and scratch(512, 128, 7) is first
    other = scratch(512, 128, 8)
    assert other is not first and scratch(512, 128, 8) is other
    larger = scratch(4096, 128, 7)
    assert larger.numel() >= 4096 and larger is not first and scratch(1024, 128, 7) is larger
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    captured = scratch(1024, 128, 7)
    assert captured is not larger and scratch(1024, 128, 7) is not captured
    assert scratch.buffers[7] is larger
    configs._set_tma_allocator(torch.device("cpu"))
    configs._set_tma_allocator(torch.device("cpu"))
    assert len([d for d in configs._SCRATCH if d == torch.device("cpu")]) == 1


def _bound_launches():
    """The _launch.Bound objects of dispatch's plans (forward, backward and their helpers, decode), by plan type."""
    found = {}

    def visit(obj, owner, depth):
        if isinstance(obj, _launch.Bound):
            found.setdefault(owner, []).append(obj)
        elif depth < 3 and hasattr(obj, "__slots__"):
            for name in obj.__slots__:
                visit(getattr(obj, name, None), owner, depth + 1)

    from flashtile.kernels import decode
    for plan in list(dispatch._PLANS.values()) + list(decode._PLANS.values()):
        visit(plan, type(plan).__name__, 0)
    return found


@pytest.mark.skipif(CUDA, reason="CPU tensors run the kernels in the interpreter only on a machine without a GPU")
def test_direct_launch_declines_other_launchers():
    """_launch._Direct lays out only Triton 3.6's CudaLauncher; anything else (here the CPU stand-in of
    fast_launch_on_cpu, whose run is a plain method) keeps the launcher's own call, and the results match."""
    with fast_launch_on_cpu():
        want = _flash("cpu", torch.float32, 1, 40, 50, 2, 1, 32, causal=True)
        got = _flash("cpu", torch.float32, 1, 40, 50, 2, 1, 32, causal=True)
        bounds = [b for group in _bound_launches().values() for b in group]
        assert bounds and all(b.direct is False for b in bounds if b.compiled is not None)
    for a, b in zip(want, got):
        assert torch.equal(a, b)


def test_direct_launch_args_match_tritons_launcher(monkeypatch):
    """_launch._Direct hands the C launch function what Triton 3.6's CudaLauncher and its descriptor wrapper hand it
    (grid, stream, function, flags, scratch, metadata, then every parameter with each host TMA descriptor expanded
    into its CUtensorMap, shape and strides): both paths here run over a recording stand-in of the C function, the
    driver's descriptor fill stubbed. Needs Triton 3.6's launcher (the GPU machines'); other versions skip."""
    import triton
    driver = pytest.importorskip("triton.backends.nvidia.driver")
    launcher = getattr(driver, "CudaLauncher", None)
    if (launcher is None or getattr(driver, "_BASE_ARGS_FORMAT", None) != "iiiKKppOOOOOO"
            or launcher.__call__.__code__.co_argcount != 6 or not hasattr(driver, "wrap_handle_tensordesc")):
        pytest.skip(f"Triton {triton.__version__}'s launcher is laid out otherwise (_Direct declines it)")

    class Utils:
        @staticmethod
        def fill_tma_descriptor(*args):
            return ("tensormap",) + args

    class Active:
        utils = Utils()

    monkeypatch.setattr(type(triton.runtime.driver), "active", property(lambda self: Active()))
    seen = []
    sig = {"desc": "tensordesc<bf16[1, 64, 1, 64]>", "ptr": "*bf16", "n": "i32", "out_desc":
           "tensordesc<bf16[1, 64, 1, 64]>", "K": "constexpr"}
    meta = [dict(swizzle=3, elem_size=2, elem_type=10, block_size=[1, 64, 1, 64], fp4_padded=False),
            dict(swizzle=2, elem_size=2, elem_type=10, block_size=[1, 64, 1, 64], fp4_padded=False)]
    run = object.__new__(launcher)
    run.launch = driver.wrap_handle_tensordesc(lambda *args: seen.append(args), sig, meta)
    run.global_scratch_size = run.profile_scratch_size = 0
    run.global_scratch_align = run.profile_scratch_align = 1
    run.launch_cooperative_grid = run.launch_pdl = False
    run.num_ctas = 1

    class Compiled:
        function, packed_metadata = 1234, ("packed",)

    compiled = Compiled()
    compiled.run = run
    direct = _launch._Direct.of(compiled, (3, 2, 1), 4, (7,))
    assert direct is not None and [d[0] for d in direct.descs] == [0, 3]

    class Desc:
        def __init__(self, base, shape, strides, padding):
            self.base, self.shape, self.strides, self.padding = base, shape, strides, padding

    base = torch.zeros(4)
    args = (Desc(base, [1, 100, 2, 64], [12800, 128, 64, 1], "zero"), base, 5,
            Desc(base, [2, 30, 4, 64], [7680, 256, 64, 1], "nan"))
    run(3, 2, 1, 99, 1234, ("packed",), None, None, None, *args, 7)
    direct(99, args)
    # With the plan's template for the first descriptor, a call passes its base tensor alone.
    templated = _launch._Direct.of(compiled, (3, 2, 1), 4, (7,), {0: args[0]})
    templated(99, (base,) + args[1:])
    assert len(seen) == 3 and seen[0] == seen[1] == seen[2]
    assert seen[1][13][0] == "tensormap" and seen[1][-1] == 7
    assert _launch._Direct.of(compiled, (3, 2, 1), 4, (7,), {1: args[0]}) is None  # not a descriptor parameter
    assert _launch._Direct.of(compiled, (3, 2, 1), 3, (args[3], 7)) is None  # a descriptor among the fixed args


@pytest.mark.gpu
def test_gpu_direct_launch_matches_the_launcher():
    """On Triton 3.6 (the GPU machines'), a bound launch's repeated call goes to the compiled kernel's C launch
    function directly (_launch._Direct): the Gluon forward with its host TMA descriptors filled here, the backward,
    its preprocess and dQ pass, FP8's copy of V and decode's launches. Each result equals bit for bit the same calls
    through Triton's CudaLauncher (SETTINGS.direct_launch off; dQ within rounding: the backward adds it in a varying
    order)."""
    import triton

    def calls():
        out = list(_flash("cuda", torch.bfloat16, 2, 300, 500, 4, 2, 128, causal=True))
        q = _randn((1, 2048, 2, 128), torch.bfloat16, "cuda", 11, grad=False).to(torch.float8_e4m3fn)
        k = _randn((1, 2048, 2, 128), torch.bfloat16, "cuda", 12, grad=False).to(torch.float8_e4m3fn)
        v = _randn((1, 2048, 2, 128), torch.bfloat16, "cuda", 13, grad=False).to(torch.float8_e4m3fn)
        scale = torch.full((1, 2), 0.5, device="cuda")
        out.append(flashtile.flash_attn_func(q, k, v, q_descale=scale, k_descale=scale, v_descale=scale))
        cache_k = _randn((2, 600, 2, 64), torch.bfloat16, "cuda", 14, grad=False)
        cache_v = _randn((2, 600, 2, 64), torch.bfloat16, "cuda", 15, grad=False)
        qd = _randn((2, 1, 8, 64), torch.bfloat16, "cuda", 16, grad=False)
        seqlens = torch.tensor([599, 17], dtype=torch.int32, device="cuda")
        out.append(flashtile.flash_attn_with_kvcache(qd, cache_k, cache_v, cache_seqlens=seqlens))
        return out

    from flashtile.kernels import decode
    dispatch._PLANS.clear()  # (only this test's plans below)
    decode._PLANS.clear()
    calls()
    direct = calls()
    bounds = _bound_launches()
    # (direct is None for a launch not repeated on the fast path: e.g. the plan the backward's compile ahead made for
    # a dlse-less call, _ahead.py.)
    taken = {owner: [b.direct for b in group if b.direct is not None] for owner, group in bounds.items()}
    if triton.__version__.startswith("3.6"):
        assert {"GluonFwdPlan", "BwdPlan", "_AttnPlan"} <= set(taken), taken
        for owner, directs in taken.items():
            assert directs and all(isinstance(d, _launch._Direct) for d in directs), (owner, directs)
        forward = [d for d in taken["GluonFwdPlan"] if d.descs]
        assert forward and all(len(d.descs) == 4 for d in forward)  # q, k, v and out
    with override(direct_launch=False):
        through = calls()
    for i, (a, b) in enumerate(zip(direct, through)):
        if i == 2:  # dq
            torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)
        else:
            assert torch.equal(a.float().nan_to_num(7.0), b.float().nan_to_num(7.0)), i


@pytest.mark.skipif(CUDA, reason="CPU tensors run the kernels in the interpreter only on a machine without a GPU")
def test_gluon_varlen_plan_binds_its_tile_map():
    """A varlen call's Gluon plan (dispatched as on an H100, its launches stubbed) binds the tile map's launch: the
    map's shape, grid and scalars come from the plan key (packed rows, number of sequences), and what the bound
    launch computes, run in the interpreter, is the work list of the call's own offsets and key counts."""
    from flashtile.bench.features import _paged_cache
    from flashtile.bench.host import _as_on_hopper, _settings
    from flashtile.kernels import _common, hopper_fwd
    lens = [100, 0, 300, 257, 31]
    total, h, d, page = sum(lens), 2, 64, 16
    cu = cu_seqlens(lens, "cpu")
    used = torch.tensor(lens, dtype=torch.int32)
    q, k, v = (_randn((total, h, d), torch.bfloat16, "cpu", seed, grad=False) for seed in range(3))
    k_cache, v_cache, table = _paged_cache(k, v, lens, page)
    dispatch._PLANS.clear()
    with fast_launch_on_cpu(execute=False), _as_on_hopper(), _settings(_common, "INTERPRETING", False):
        for _ in range(2):
            flashtile.flash_attn_varlen_func(q, k_cache, v_cache, cu, cu, max(lens), max(lens), causal=True,
                                             block_table=table, seqused_k=used)
        plans = [p for p in dispatch._PLANS.values() if isinstance(p, hopper_fwd.GluonFwdPlan)]  # (dropped at exit)
    assert len(plans) == 1 and plans[0].varlen and plans[0].paged
    tiles, block_m = plans[0].tile_map, plans[0].block_m
    n_upper = -(-total // block_m) + len(lens)
    assert tiles.shape == (n_upper, 8)
    assert tiles.launch.static == (len(lens), n_upper) and tiles.launch.constexprs["USED"]
    assert tiles.launch.constexprs["REVERSE"]  # causal: each sequence's last tile first
    got = tiles.run(None, cu, torch.full_like(cu, -7), used).tolist()
    expect = [[b, m * block_m, int(cu[b]), n, 0, n, 0, 0] for b, n in enumerate(lens)
              for m in reversed(range(-(-n // block_m)))]
    assert got[:len(expect)] == expect
    assert all(row[0] == -1 for row in got[len(expect):])


@pytest.mark.skipif(torch.cuda.is_available(), reason="stand-in launches of CPU tensors")
def test_compile_cache_is_per_device(monkeypatch):
    """A compiled kernel is loaded on the GPU that was current at its first launch, and its function handle belongs
    to that GPU: the compile cache keeps an entry per device, so the same launch on another GPU compiles (loads) its
    own, as Triton's per-device caches do, instead of taking the first GPU's. Launches stubbed; the current device
    stands in."""
    from flashtile.kernels import _common
    from flashtile.testing import fast_launch_on_cpu
    current = [0]
    monkeypatch.setattr(_launch, "_device", lambda: current[0])
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    safe = torch.empty((1, 3), dtype=torch.int32)
    # (The stand-in's own _jit_launch is wrapped inside its block and unwrapped before the block restores the real
    # one: monkeypatch's teardown would put the stand-in back.)
    with fast_launch_on_cpu(execute=False), monkeypatch.context() as patch:
        jit, firsts = _launch._jit_launch, []

        def counted(*args, **kwargs):
            firsts.append(current[0])
            return jit(*args, **kwargs)

        patch.setattr(_launch, "_jit_launch", counted)
        def launch():
            _launch.launch(_common._safe_offsets_kernel, (1,), (cu, cu, safe, 3, 5, 0), dict(BLOCK=4, BOTH=False),
                           None)

        def found():  # a new bound launch of the same key finds a compiled kernel for the current device
            bound = _launch.Bound(_common._safe_offsets_kernel, (1,), (3, 5, 0), dict(BLOCK=4, BOTH=False), {})
            return bound.find(cu, cu, safe)

        assert not found()
        launch()
        launch()
        assert found()
        current[0] = 1
        assert not found()
        launch()
        assert found()
        launch()
        current[0] = 0
        launch()
        assert firsts == [0, 1]
        assert sorted(device for device, _ in _launch._COMPILED) == [0, 1]


@pytest.mark.skipif(CUDA, reason="CPU tensors run the kernels in the interpreter only on a machine without a GPU")
def test_gluon_forward_defers_its_check_for_bfloat16():
    """Which Gluon forward plans take DEFER (hopper_fwd.defer_pays: LAZY_MAX's check at each item's end, a redo
    pass for flagged items), dispatched as on an H100 with the launches stubbed: bfloat16 calls of at least
    DEFER_MIN_FLOPS, not float16, not smaller calls, not with SETTINGS.defer_check or lazy_max off. A DEFER plan's
    redo pass is the same kernel with REDO set, over the same grid; its first call compiles it aside."""
    from flashtile.bench.host import _as_on_hopper, _settings
    from flashtile.kernels import _common, hopper_fwd

    def plan_of(dtype, seqlen, head_dim=128, causal=True, **settings):
        q, k, v = (_randn((1, seqlen, 8, head_dim), dtype, "cpu", seed, grad=False) for seed in range(3))
        dispatch._PLANS.clear()
        with fast_launch_on_cpu(execute=False), _as_on_hopper(), _settings(_common, "INTERPRETING", False), \
                override(**settings):
            flashtile.flash_attn_func(q, k, v, causal=causal)
            plans = [p for p in dispatch._PLANS.values() if isinstance(p, hopper_fwd.GluonFwdPlan)]
            if plans and plans[0].redo_thread is not None:
                plans[0].redo_thread.join()
        assert len(plans) == 1
        return plans[0]

    plan = plan_of(torch.bfloat16, 4096)  # 2 * 4096 * 8 * 2048 * 256 = 2^35 FLOPs
    assert plan.defer and plan.launch.constexprs["DEFER"] and not plan.launch.constexprs["REDO"]
    assert plan.redo.constexprs == dict(plan.launch.constexprs, REDO=True) and plan.redo.grid == plan.launch.grid
    assert plan.redo.compiled is not None  # compiled aside (stand-in) on the first call
    for dtype, seqlen, settings in ((torch.float16, 4096, {}), (torch.bfloat16, 2048, {}),
                                    (torch.bfloat16, 4096, dict(defer_check=False)),
                                    (torch.bfloat16, 4096, dict(lazy_max=False))):
        plan = plan_of(dtype, seqlen, **settings)
        assert not plan.defer and plan.redo is None and not plan.launch.constexprs["DEFER"], (dtype, seqlen, settings)
    # Plain d64 (three warpgroups at 2k and more) takes two warpgroups where it defers (1.05-1.08x faster), three
    # where it does not.
    for dtype, settings, defer in ((torch.bfloat16, {}, True), (torch.float16, {}, False),
                                   (torch.bfloat16, dict(defer_check=False), False)):
        plan = plan_of(dtype, 8192, head_dim=64, causal=False, **settings)  # 2 * 8192 * 8 * 8192 * 128 = 2^37
        assert plan.defer == defer and plan.block_m == (128 if defer else 192), (dtype, settings)


@pytest.mark.skipif(CUDA, reason="CPU tensors run the kernels in the interpreter only on a machine without a GPU")
def test_defer_call_waits_for_the_redo_compile_only_when_flagged(monkeypatch):
    """A DEFER plan's first calls while its redo kernel still compiles aside: with nothing flagged (the count the
    first pass left is 0) the call returns without waiting for the compile and launches no redo pass; with an item
    flagged it waits for the compile and launches the pass. The compile starts only once the backward's
    compile-ahead helpers have ended (a stand-in helper here). Launches stubbed, the redo compile slowed."""
    import threading
    import time
    from flashtile import _ahead
    from flashtile._ahead import wait_for_compiles
    from flashtile.bench.host import _as_on_hopper, _settings
    from flashtile.kernels import _common, hopper_fwd
    q, k, v = (_randn((1, 4096, 8, 128), torch.bfloat16, "cpu", seed, grad=False) for seed in range(3))
    with fast_launch_on_cpu(execute=False), _as_on_hopper(), _settings(_common, "INTERPRETING", False), \
            monkeypatch.context() as patch:
        jit = _launch._jit_launch
        times = {}

        def slow_redo(kernel, grid, args, constexprs, options, key=None, stream=None):
            if constexprs.get("REDO"):
                times["redo"] = time.perf_counter()
                time.sleep(0.6)
            return jit(kernel, grid, args, constexprs, options, key, stream)

        def helper():
            time.sleep(0.2)
            times["helper"] = time.perf_counter()

        patch.setattr(_launch, "_jit_launch", slow_redo)
        for flagged in (0, 1):
            dispatch._PLANS.clear()
            _launch._COMPILED.clear()
            for state in hopper_fwd._REDO.values():
                state[0] = flagged  # what the first pass (not run here) would have left
            pending = threading.Thread(target=helper)
            pending.start()
            patch.setattr(_ahead, "_PENDING", [pending])
            start = time.perf_counter()
            flashtile.flash_attn_func(q, k, v, causal=True)
            took = time.perf_counter() - start
            plan, = [p for p in dispatch._PLANS.values() if isinstance(p, hopper_fwd.GluonFwdPlan)]
            assert plan.defer and plan.redo_thread is not None
            # (Bound.direct leaves None once the bound launch has been called with its kernel at hand.)
            if flagged:
                assert took >= 0.6 and plan.redo.compiled is not None and plan.redo.direct is not None
            else:
                assert took < 0.5 and plan.redo.compiled is None and plan.redo.direct is None
            wait_for_compiles()  # (what the benchmarks wait for before timing) joins the compile aside
            assert not plan.redo_thread.is_alive() and plan.redo.compiled is not None
            assert times["redo"] >= times["helper"], "the redo compile started beside a compile-ahead helper"
    for state in hopper_fwd._REDO.values():
        state.zero_()


def test_grown_redo_state_stays_allocated(monkeypatch):
    """DEFER's redo state per stream grows for a plan with more items than it holds; the state it replaces stays
    allocated (a CUDA graph captured over it still launches at its address), and the new one starts zeroed."""
    from flashtile.kernels import hopper_fwd
    monkeypatch.setattr(hopper_fwd, "_REDO", {})
    monkeypatch.setattr(hopper_fwd, "_REDO_RETIRED", [])
    small = hopper_fwd._redo_state("cpu", 7, 10)
    assert hopper_fwd._redo_state("cpu", 7, 100) is small  # (room enough: the same state)
    small_ref = weakref.ref(small)
    del small
    grown = hopper_fwd._redo_state("cpu", 7, 5000)
    gc.collect()
    assert small_ref() is not None and small_ref() is not grown
    assert grown.numel() >= 5002 and int(grown.count_nonzero()) == 0
    assert hopper_fwd._redo_state("cpu", 8, 10) is not grown  # (another stream, its own state)
