"""The request object and the dispatch layer: schemas derived from the request's fields, each backend's allow-list
and its reasons, `explain`, the varlen `deterministic` pass-through, and double backward's clear error."""
import pytest
import torch

import flashtile
from flashtile import _ops, dispatch
from flashtile._settings import SETTINGS, override
from flashtile.dispatch import Target
from flashtile.request import AttentionRequest, KVCacheRequest, unbounded_window

H100 = Target("cuda", 90, False)


def _qkv(b=2, sq=256, sk=256, h=4, hk=2, d=64, dtype=torch.bfloat16, requires_grad=False):
    gen = torch.Generator().manual_seed(sq * 7 + d)
    q = torch.randn((b, sq, h, d), generator=gen).to(dtype).requires_grad_(requires_grad)
    k = torch.randn((b, sk, hk, d), generator=gen).to(dtype).requires_grad_(requires_grad)
    v = torch.randn((b, sk, hk, d), generator=gen).to(dtype).requires_grad_(requires_grad)
    return q, k, v


def test_schema_follows_the_fields():
    """Every field appears in the op schemas in declaration order, with its default; positions and gradient slots
    come from the same list."""
    names = AttentionRequest.field_names()
    schema = str(torch.ops.flashtile.attn_fwd.default._schema)
    for name in names:
        assert f" {name}" in schema
    args = [a.name for a in torch.ops.flashtile.attn_fwd.default._schema.arguments]
    assert args == ["q", "k", "v"] + list(names)
    bwd = [a.name for a in torch.ops.flashtile.attn_bwd.default._schema.arguments]
    assert bwd[-len(names):] == list(names)
    assert _ops._GRAD_SLOTS["attn_bias"] == 3 + names.index("attn_bias")
    kv_args = [a.name for a in torch.ops.flashtile.kvcache_attn.default._schema.arguments]
    assert kv_args == ["q", "k_cache", "v_cache"] + list(KVCacheRequest.field_names())


def test_flatten_round_trip():
    slopes = torch.rand(4)
    req = AttentionRequest(softmax_scale=0.5, diagonal_offset=3, window_right=0, alibi_slopes=slopes, dropout_p=0.1)
    again = AttentionRequest.unflatten(req.flatten())
    assert again == req and again.alibi_slopes is slopes
    assert req.causal and not req.mask_left and req.mask_right and not req.varlen
    assert "causal" in req.describe() and "alibi" in req.describe() and "dropout_p=0.1" in req.describe()


@pytest.mark.parametrize("left, right, sq, sk, expect", [
    pytest.param(2 ** 63 - 1, 2 ** 31, 10, 20, (-1, -1), id="huge"),
    pytest.param(19, 9, 10, 20, (-1, -1), id="exactly-wide-enough"),
    pytest.param(18, 8, 10, 20, (18, 8), id="one-short"),
    pytest.param(5, 0, 1, 7, (5, -1), id="one-query-row-right-0"),
    pytest.param(-1, 0, 4, 4, (-1, 0), id="causal"),
])
def test_unbounded_window(left, right, sq, sk, expect):
    assert unbounded_window(left, right, sq, sk) == expect


def test_huge_window_matches_full_attention():
    """window_size entries up to 2**63 - 1 mean unbounded (no int32 overflow anywhere)."""
    q, k, v = _qkv(1, 33, 47, 2, 1, 16, torch.float32)
    full = flashtile.flash_attn_func(q, k, v, causal=True)
    for window in ((2 ** 63 - 1, 2 ** 63 - 1), (2 ** 31 + 5, 0), (2 ** 31 - 1, -1)):
        torch.testing.assert_close(flashtile.flash_attn_func(q, k, v, causal=True, window_size=window), full)


def test_gluon_allow_list_reasons():
    q, k, v = _qkv()
    req = AttentionRequest(softmax_scale=0.125, window_right=0)
    gluon = dispatch.GluonHopper()
    assert gluon.decline_forward(q, k, v, req, H100) is None
    assert "Hopper" in gluon.decline_forward(q, k, v, req, Target("cuda", 80, False))
    assert "CUDA" in gluon.decline_forward(q, k, v, req, Target("cpu", 0, True))
    assert "float16 or bfloat16" in gluon.decline_forward(*(t.float() for t in (q, k, v)), req, H100)
    q256, k256, v256 = _qkv(d=256)
    assert gluon.decline_forward(q256, k256, v256, req, H100) is None
    drop = AttentionRequest(softmax_scale=0.125, dropout_p=0.1)
    assert "dropout at head dim 256" in gluon.decline_forward(q256, k256, v256, drop, H100)
    # The backward at 192 and 256 (d192 on d256's tiles), without ALiBi, an attn_mask or dropout.
    for d in (192, 256):
        qd, kd, vd = _qkv(d=d)
        dout = torch.empty_like(qd)
        assert gluon.decline_backward(dout, qd, kd, vd, req, H100) is None
        assert "dropout at head dim" in gluon.decline_backward(dout, qd, kd, vd, drop, H100)
        alibi = AttentionRequest(softmax_scale=0.125, alibi_slopes=torch.ones(4))
        assert "ALiBi at head dim" in gluon.decline_backward(dout, qd, kd, vd, alibi, H100)
        mask = AttentionRequest(softmax_scale=0.125, attn_bias=torch.ones((2, 4, 256, 256), dtype=torch.bool))
        assert "attn_mask at head dim" in gluon.decline_backward(dout, qd, kd, vd, mask, H100)
    from flashtile.kernels import hopper_bwd
    assert set(dispatch.GLUON_KERNEL_DIMS) == set(hopper_bwd.TILE_DIM)
    # Every multiple of 8 from GLUON_MIN_HEAD_DIM to 256 takes both kernels; others take the portable ones.
    for d in (40, 72, 80, 112, 160, 200, 248):
        qd, kd, vd = _qkv(d=d)
        assert gluon.decline_forward(qd, kd, vd, req, H100) is None
        assert gluon.decline_backward(torch.empty_like(qd), qd, kd, vd, req, H100) is None
    for d in (32, 264):
        qd, kd, vd = _qkv(d=d)
        assert "multiple of 8 from 40 to 256" in gluon.decline_forward(qd, kd, vd, req, H100)
        assert "multiple of 8 from 40 to 256" in gluon.decline_backward(torch.empty_like(qd), qd, kd, vd, req, H100)
        assert ("portable kernels" in gluon.decline_forward(qd, kd, vd, req, H100)) is (d < 40)
    # Above 128 the backward takes what d192's and d256's paths take.
    q160, k160, v160 = _qkv(d=160)
    assert "dropout at head dim 160" in gluon.decline_backward(torch.empty_like(q160), q160, k160, v160, drop, H100)
    from flashtile.kernels import hopper_fwd
    assert set(dispatch.GLUON_KERNEL_DIMS) == set(hopper_fwd.TILE_DIM)
    qm, km, _ = _qkv(d=192)
    vm = _qkv(d=128)[2]  # MLA: q and k at 192, v at 128 take the forward and the backward
    assert gluon.decline_forward(qm, km, vm, req, H100) is None
    dout_m = torch.empty(qm.shape[:-1] + (128,), dtype=qm.dtype)
    assert gluon.decline_backward(dout_m, qm, km, vm, req, H100) is None
    v64 = _qkv(d=64)[2]
    assert "192 for q and k with 128 for v" in gluon.decline_backward(dout_m, qm, km, v64, req, H100)
    assert "192 for q and k with 128 for v" in gluon.decline_forward(qm, km, _qkv(d=64)[2], req, H100)
    q96, k96, v96 = _qkv(d=96)  # both take d96 (on d128's tiles)
    assert gluon.decline_forward(q96, k96, v96, req, H100) is None
    assert gluon.decline_backward(torch.empty_like(q96), q96, k96, v96, req, H100) is None
    with override(gluon_forward=False):
        assert "FLASHTILE_GLUON=0" in gluon.decline_forward(q, k, v, req, H100)
    dout = torch.empty_like(q)
    det = AttentionRequest(softmax_scale=0.125, deterministic=True)
    assert "deterministic" in gluon.decline_backward(dout, q, k, v, det, H100)
    short = _qkv(sk=300)
    assert gluon.decline_backward(torch.empty_like(short[0]), *short, req, H100) is None  # the persistent grid
    packed = [t.reshape(-1, *t.shape[2:]) for t in short]
    cu = torch.tensor([0, 300, 600], dtype=torch.int32)
    packed_req = AttentionRequest(softmax_scale=0.125, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=300,
                                  max_seqlen_k=300)
    # short d64 varlen: the persistent grid as well
    assert gluon.decline_backward(torch.empty_like(packed[0]), *packed, packed_req, H100) is None
    # a longest sequence past the persistent grid's bound: one program per key block, below GLUON_BWD_MIN_SEQLEN_K
    # keys per sequence on average at d64 the portable backward
    long_k = hopper_bwd.PERSISTENT_MAX_SEQLEN_K + 1
    cu_k = torch.tensor([0, long_k, long_k + 10] + [long_k + 10 + 20 * i for i in range(1, 8)], dtype=torch.int32)
    cu_q = torch.arange(0, 10 * 30, 30, dtype=torch.int32)
    kl, vl = (torch.empty(int(cu_k[-1]), 2, 64, dtype=torch.bfloat16) for _ in range(2))
    ql = torch.empty(int(cu_q[-1]), 4, 64, dtype=torch.bfloat16)
    long_req = AttentionRequest(softmax_scale=0.125, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=30,
                                max_seqlen_k=long_k)
    assert "keys per sequence" in gluon.decline_backward(torch.empty_like(ql), ql, kl, vl, long_req, H100)
    qs, ks, vs = _qkv(sk=4096, d=128)
    assert gluon.decline_backward(torch.empty_like(qs), qs, ks, vs, req, H100) is None
    bias = torch.zeros((2, 4, 256, 4096), dtype=torch.bfloat16)
    with_bias = AttentionRequest(softmax_scale=0.125, attn_bias=bias, dropout_p=0.1)
    assert "dropout" in gluon.decline_backward(torch.empty_like(qs), qs, ks, vs, with_bias, H100)


def test_gluon_fp8_allow_list():
    """float8_e4m3fn inputs take the Hopper forward at head dim 128, fixed-length or varlen, without a paged cache,
    softcap, ALiBi or an attn_mask (the portable kernel takes the rest, with its reason named), and never the Hopper
    backward."""
    q, k, v = (t.to(torch.float8_e4m3fn) for t in _qkv(d=128))
    gluon = dispatch.GluonHopper()
    descale = torch.ones(2, 2, 3)
    req = AttentionRequest(softmax_scale=0.125, window_right=0, descale=descale)
    assert gluon.decline_forward(q, k, v, req, H100) is None
    assert dispatch.choose_forward(q, k, v, req, H100).name == "gluon-hopper"
    windowed = AttentionRequest(softmax_scale=0.125, window_left=100, window_right=3, descale=descale,
                                sinks=torch.zeros(4))
    assert gluon.decline_forward(q, k, v, windowed, H100) is None
    for name, fields in (("softcap", dict(softcap=5.0)), ("ALiBi", dict(alibi_slopes=torch.rand(4))),
                         ("attn_mask", dict(attn_bias=torch.zeros(2, 4, 256, 256, dtype=torch.bool)))):
        other = AttentionRequest(softmax_scale=0.125, descale=descale, **fields)
        assert name in gluon.decline_forward(q, k, v, other, H100), name
        assert dispatch.choose_forward(q, k, v, other, H100).name == "triton"
    q64, k64, v64 = (t.to(torch.float8_e4m3fn) for t in _qkv(d=64))
    cu = torch.tensor([0, 100, 256], dtype=torch.int32)
    packed = AttentionRequest(softmax_scale=0.125, descale=descale, cu_seqlens_q=cu, cu_seqlens_k=cu,
                              max_seqlen_q=156, max_seqlen_k=156)
    assert gluon.decline_forward(q[0], k[0], v[0], packed, H100) is None  # run on an H100: tests/test_fp8.py
    assert "head dim 64" in gluon.decline_forward(q64, k64, v64, req, H100)
    assert "float16 or bfloat16" in gluon.decline_backward(torch.empty_like(q), q, k, v, req, H100)


def test_portable_and_reference():
    q, k, v = _qkv(1, 8, 8, 2, 2, 16, torch.float32)
    req = AttentionRequest(softmax_scale=0.25)
    assert dispatch.PortableTriton().decline_forward(q, k, v, req, Target("cpu", 0, True)) is None
    assert "TRITON_INTERPRET" in dispatch.PortableTriton().decline_forward(q, k, v, req, Target("cpu", 0, False))
    assert dispatch.choose_forward(q, k, v, req, Target("cpu", 0, False)).name == "reference"
    assert dispatch.choose_forward(q, k, v, req, H100).name == "triton"  # fp32 takes the portable kernels


def test_backward_dq_addend_rounds_once():
    """dispatch.backward's dq_addend (flashtile.distributed's last step) on the backends that store dQ as they
    compute it (the reference here; the portable kernels under TRITON_INTERPRET=1): dq is the addend plus the float32
    gradient of the same call, rounded once into the buffer's dtype; dk, dv are untouched by it; a bad addend
    raises naming its shape."""
    q, k, v = _qkv(1, 37, 29, 4, 2, 16, torch.float32)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    req = AttentionRequest(softmax_scale=0.25, window_right=0, diagonal_offset=-8)
    backend = dispatch.choose_backward(dout, q, k, v, req)
    out, lse = dispatch.choose_forward(q, k, v, req).forward(q, k, v, req)
    grads32 = [torch.empty(t.shape) for t in (q, k, v)]
    dispatch.backward(dout, q, k, v, out, lse, None, req, False, buffers=grads32)
    addend = torch.randn(q.shape, generator=torch.Generator().manual_seed(6)) * 10
    dq = torch.full(q.shape, float("nan"), dtype=torch.bfloat16)
    dk, dv = torch.empty(k.shape), torch.empty(v.shape)
    result = dispatch.backward(dout, q, k, v, out, lse, None, req, False, buffers=(dq, dk, dv), dq_addend=addend)
    assert result[0][0] is dq
    assert torch.equal(dq, torch.add(addend, grads32[0], out=torch.empty(q.shape, dtype=torch.bfloat16)))
    assert not torch.equal(dq, grads32[0].to(torch.bfloat16))
    assert backend.name in ("reference", "triton")  # both bit-identical run to run
    assert torch.equal(dk, grads32[1]) and torch.equal(dv, grads32[2])
    with pytest.raises(ValueError, match="dq_addend must be a float32 tensor shaped like q"):
        dispatch.backward(dout, q, k, v, out, lse, None, req, False, buffers=(dq, dk, dv), dq_addend=addend[:, 1:])


def test_explain():
    q, k, v = _qkv(2, 4096, 4096, 16, 4, 128)
    text = str(flashtile.explain(q, k, v, causal=True, deterministic=True, target=H100))
    assert "forward: gluon-hopper" in text and "backward: triton" in text and "not gluon-hopper: deterministic" in text
    exp = flashtile.explain(q.float(), k.float(), v.float(), target=Target("cuda", 80, False))
    assert exp.forward_backend == "triton" and "sm_90" in str(exp)
    with pytest.raises(ValueError, match="window_size"):
        flashtile.explain(q, k, v, window_size=(-3, 0))


def test_explain_cli(capsys):
    from flashtile.__main__ import main
    assert main(["explain", "--batch", "1", "--seqlen", "1024", "--heads", "4", "--head-dim", "128", "--dtype",
                 "bf16", "--causal", "--arch", "90"]) == 0
    out = capsys.readouterr().out
    assert "forward: gluon-hopper" in out


def test_varlen_passes_deterministic(monkeypatch):
    """flash_attn_varlen_func and its packed forms hand `deterministic` to the request (it used to be dropped)."""
    seen = []
    real = dispatch.backward

    def spy(dout, q, k, v, out, lse, dlse, req, bias_requires_grad):
        seen.append(req.deterministic)
        return real(dout, q, k, v, out, lse, dlse, req, bias_requires_grad)

    monkeypatch.setattr(dispatch, "backward", spy)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    qkv = torch.randn((12, 3, 2, 16), requires_grad=True)
    flashtile.flash_attn_varlen_qkvpacked_func(qkv, cu, 7, deterministic=True).sum().backward()
    q, kv = torch.randn((12, 2, 16), requires_grad=True), torch.randn((12, 2, 2, 16), requires_grad=True)
    flashtile.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 7, 7, deterministic=True).sum().backward()
    k, v = torch.randn((12, 2, 16), requires_grad=True), torch.randn((12, 2, 16), requires_grad=True)
    flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, deterministic=True).sum().backward()
    flashtile.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7).sum().backward()
    assert seen == [True, True, True, False]


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "op"])
def test_double_backward_raises(eager, monkeypatch):
    """A gradient penalty through the attention raises instead of silently dropping the second-order term."""
    monkeypatch.setattr(SETTINGS, "eager_direct", eager)
    q, k, v = _qkv(1, 9, 9, 2, 2, 16, torch.float32, requires_grad=True)
    out = flashtile.flash_attn_func(q, k, v, causal=True)
    (dq,) = torch.autograd.grad(out.square().sum(), (q,), create_graph=True)
    with pytest.raises(RuntimeError, match="not differentiable"):
        (out.sum() + dq.square().sum()).backward()
    # A plain backward is unaffected.
    q.grad = None
    flashtile.flash_attn_func(q, k, v).sum().backward()
    assert q.grad is not None


@pytest.mark.gpu
def test_varlen_deterministic_dq_is_bit_identical():
    """deterministic=True reaches the varlen backward: dq is bit-identical over repeated calls on Hopper (where the
    default Gluon backward adds dQ in a varying order)."""
    torch.manual_seed(0)
    lens = [1000, 3000, 2048, 17, 4000]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    total, h, hk, d = sum(lens), 16, 4, 128
    q = torch.randn((total, h, d), device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn((total, hk, d), device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn((total, hk, d), device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn((total, h, d), device="cuda", dtype=torch.bfloat16)
    first = None
    for _ in range(8):
        out = flashtile.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                                               deterministic=True)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        if first is None:
            first = grads
        for a, b in zip(grads, first):
            assert torch.equal(a, b)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d, dv", [(64, 64), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128)])
def test_gluon_forward_tiles_fit(d, dv, causal, monkeypatch):
    """The Gluon forward's plan at each head-dim pair (built on CPU tensors as on an H100, not launched): 64-key
    blocks on 256-column tiles, 128 elsewhere and for MLA's 192/128, as dispatch's paged check reads them
    (key_block_rows); buffers that fit SMEM_BYTES counted at their real widths (Q and K chunks of 64 columns at
    192, V and the output at their tile's); and d192, which keeps two accumulators for its output, stores it from
    registers."""
    from flashtile.kernels import hopper_fwd
    if not hopper_fwd.AVAILABLE:
        pytest.skip("this Triton has no Gluon")
    monkeypatch.setattr(hopper_fwd, "_num_sms", lambda device_index: 132)
    q, k, _ = _qkv(d=d)
    v = _qkv(d=dv)[2]
    for softcap in (0.0, 30.0):
        req = AttentionRequest(softmax_scale=d ** -0.5, window_right=0 if causal else -1, softcap=softcap)
        c = hopper_fwd._fwd_plan(q, k, v, req, q.dtype).launch.constexprs
        expect_n = 64 if dv in (192, 256) else 128
        assert c["BLOCK_N"] == expect_n == hopper_fwd.key_block_rows(d, dv)
        qk_w, v_w = (192 if d == 192 else c["HEAD_DIM"]), c["HEAD_DIM_V"]
        wg_rows = c["BLOCK_M"]  # NUM_WG consumer warpgroups of WG_M rows
        smem = 2 * (c["STAGES"] * c["BLOCK_N"] * (qk_w + v_w) + wg_rows * (c["QBUF"] * qk_w + c["STAGE_O"] * v_w))
        assert smem <= hopper_fwd.SMEM_BYTES, (c, smem)
        if (d, dv) == (192, 192):
            assert not c["STAGE_O"] and c["PAD_D"]
