"""flashtile as torch's flash SDPA backend (flashtile.integrations.sdpa).

torch only dispatches its flash backend on CUDA, so the CPU tests install the same kernels under the CPU dispatch
key and call torch's aten ops directly (their autograd formulas included): what torch gets back (shapes, dtypes,
strides, the rng state) and the values, judged against the float64 reference. The GPU tests run
torch.nn.functional.scaled_dot_product_attention itself, and torch's context_parallel on two GPUs
(examples/sdpa_context_parallel.py).
"""
import os
import shutil
import subprocess
import sys

import pytest
import torch

import flashtile
import flashtile.integrations.sdpa as ft_sdpa
from flashtile import reference
from flashtile.testing import judge

aten = torch.ops.aten
needs_hook = pytest.mark.skipif(ft_sdpa.available() is not None, reason=str(ft_sdpa.available()))


@pytest.fixture
def on_cpu(monkeypatch):
    """flashtile installed as the flash kernels of CPU tensors for one test."""
    monkeypatch.setattr(ft_sdpa, "_DISPATCH_KEY", "CPU")
    ft_sdpa.activate()
    yield
    ft_sdpa.deactivate()


def bhsd(batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, seqlen_q, heads, head_dim), (batch, seqlen_k, kv_heads, head_dim),
              (batch, seqlen_k, kv_heads, head_dim)]
    # SDPA's usual layout: (batch, heads, seqlen, d) views of (batch, seqlen, heads, d) projections.
    return [torch.randn(s, generator=gen).transpose(1, 2).requires_grad_() for s in shapes]


def oracle(q, k, v, causal, scale, dout):
    """float64 out, lse, dq, dk, dv for (batch, heads, seqlen, d) inputs (bottom-right causal)."""
    q64, k64, v64 = (t.detach().double().transpose(1, 2).requires_grad_() for t in (q, k, v))
    out, lse = reference.naive_attention(q64, k64, v64, softmax_scale=scale, causal=causal)
    out.backward(dout.double().transpose(1, 2))
    return [out.transpose(1, 2), lse] + [t.grad.transpose(1, 2) for t in (q64, k64, v64)]


def plain(q, k, v, causal, scale, dout):
    """The same in float32 with plain PyTorch (torch's math SDPA), the judge's yardstick."""
    q32, k32, v32 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    offset = k.shape[2] - q.shape[2]
    mask = None
    if causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(offset)
    rep = q.shape[1] // k.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(q32, k32.repeat_interleave(rep, 1),
                                                           v32.repeat_interleave(rep, 1), attn_mask=mask, scale=scale)
    out.backward(dout)
    lse = torch.logsumexp((q32 @ k32.repeat_interleave(rep, 1).transpose(-1, -2) * scale).masked_fill(
        ~mask if mask is not None else torch.zeros((), dtype=torch.bool), float("-inf")), dim=-1)
    return [out, lse] + [t.grad for t in (q32, k32, v32)]


# ----------------------------------------------------------------------------------------------------------------
# Registration


@needs_hook
def test_activate_deactivate_and_context_manager(monkeypatch):
    monkeypatch.setattr(ft_sdpa, "_DISPATCH_KEY", "CPU")
    attention = torch.nn.attention
    assert attention.current_flash_attention_impl() is None
    ft_sdpa.activate()
    ft_sdpa.activate()  # twice is harmless
    assert attention.current_flash_attention_impl() == "flashtile" and ft_sdpa.is_active()
    assert "flashtile" in attention.list_flash_attention_impls()
    ft_sdpa.deactivate()
    assert attention.current_flash_attention_impl() is None and not ft_sdpa.is_active()
    q, k, v = bhsd(1, 2, 2, 5, 5, 16, seed=0)
    with pytest.raises(NotImplementedError):  # no CPU kernel once uninstalled
        aten._scaled_dot_product_flash_attention(q, k, v)
    with ft_sdpa.enabled():
        aten._scaled_dot_product_flash_attention(q, k, v)
        assert ft_sdpa.call_counts() == {"forward": 1, "backward": 0}
    assert attention.current_flash_attention_impl() is None
    ft_sdpa.deactivate()  # when not active: a no-op


@needs_hook
def test_first_registry_version(monkeypatch):
    """torch's first registry (no restore_flash_attention_impl; activate returns early for the active name and keeps
    every handle): activate / deactivate / activate still install and remove the kernels, and the registry's
    current name follows."""
    registry = torch.nn.attention._registry
    monkeypatch.setattr(ft_sdpa, "_DISPATCH_KEY", "CPU")
    monkeypatch.setattr(registry, "_FLASH_ATTENTION_ACTIVE", None)
    monkeypatch.setattr(registry, "_FLASH_ATTENTION_HANDLES", {}, raising=False)

    def old_activate(impl):
        if registry._FLASH_ATTENTION_ACTIVE == impl:
            return
        handle = registry._FLASH_ATTENTION_IMPLS[impl]()
        if handle is not None:
            registry._FLASH_ATTENTION_HANDLES[impl] = handle
        registry._FLASH_ATTENTION_ACTIVE = impl

    monkeypatch.setattr(torch.nn.attention, "activate_flash_attention_impl", old_activate)
    monkeypatch.setattr(torch.nn.attention, "current_flash_attention_impl", lambda: registry._FLASH_ATTENTION_ACTIVE)
    monkeypatch.delattr(torch.nn.attention, "restore_flash_attention_impl")
    q, k, v = bhsd(1, 2, 2, 5, 5, 16, seed=0)
    for _ in range(2):
        ft_sdpa.activate()
        assert torch.nn.attention.current_flash_attention_impl() == "flashtile"
        aten._scaled_dot_product_flash_attention(q, k, v)
        ft_sdpa.deactivate()
        assert torch.nn.attention.current_flash_attention_impl() is None
        with pytest.raises(NotImplementedError):
            aten._scaled_dot_product_flash_attention(q, k, v)


def test_clear_error_without_the_hook(monkeypatch):
    monkeypatch.delattr(torch.nn.attention, "register_flash_attention_impl", raising=False)
    assert "register_flash_attention_impl" in ft_sdpa.available()
    with pytest.raises(RuntimeError, match="torch 2.11 and later"):
        ft_sdpa.activate()


# ----------------------------------------------------------------------------------------------------------------
# What torch gets back, through the aten ops and their autograd


CASES = [pytest.param(2, 4, 2, 37, 37, 16, True, id="B2-H4-Hk2-S37-D16-causal"),
         pytest.param(1, 3, 3, 19, 41, 32, False, id="B1-H3-Sq19-Sk41-D32"),
         pytest.param(2, 2, 1, 33, 9, 24, True, id="B2-H2-Hk1-Sq33-Sk9-D24-causal")]


@needs_hook
@pytest.mark.parametrize("batch,heads,kv_heads,seqlen_q,seqlen_k,head_dim,causal", CASES)
def test_scaled_dot_product_flash_attention_op(on_cpu, batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim,
                                               causal):
    q, k, v = bhsd(batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, seed=seqlen_q)
    scale = 0.7 * head_dim ** -0.5
    out, lse, cum_q, cum_k, max_q, max_k, rng_state, offset, debug = aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale)
    # What aten's meta function (and so torch.compile) promises.
    assert out.shape == q.shape and out.stride() == q.stride() and out.dtype == q.dtype
    assert lse.shape == (batch, heads, seqlen_q) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert cum_q is None and cum_k is None and (max_q, max_k) == (seqlen_q, seqlen_k)
    assert rng_state.shape == (2,) and rng_state.dtype == torch.uint64
    assert offset.shape == () and offset.dtype == torch.uint64 and debug.numel() == 0
    dout = torch.randn_like(out)
    out.backward(dout)
    got = [out, lse, q.grad, k.grad, v.grad]
    want, yardstick = oracle(q, k, v, causal, scale, dout), plain(q, k, v, causal, scale, dout)
    for name, g, w, y in zip(("out", "lse", "dq", "dk", "dv"), got, want, yardstick):
        err, bound = judge(g, w, y, torch.float32)
        assert err <= bound, f"{name}: max error {err:.3e} > bound {bound:.3e}"
    assert ft_sdpa.call_counts() == {"forward": 1, "backward": 1}


@needs_hook
def test_contiguous_query_gets_its_strides(on_cpu):
    q, k, v = (t.detach().contiguous() for t in bhsd(1, 2, 2, 7, 7, 16, seed=1))
    out = aten._scaled_dot_product_flash_attention(q, k, v)[0]
    assert out.stride() == q.stride()
    grads = aten._scaled_dot_product_flash_attention_backward(torch.randn_like(out), q, k, v, out,
                                                             torch.zeros(1, 2, 7), None, None, 7, 7, 0.0, False,
                                                             torch.zeros(2, dtype=torch.uint64),
                                                             torch.zeros((), dtype=torch.uint64))
    assert [g.stride() for g in grads] == [t.stride() for t in (q, k, v)]


@needs_hook
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_with_merged_lse(on_cpu, causal):
    """context_parallel's use of the ops: the keys in two blocks, each (query rows, key block) pair's forward
    through the op, the partials merged through their LSEs (docs/derivation.md, chapter 7), then each pair's
    backward with the merged output and LSE, gradients summed. All must equal attention over all keys."""
    q, k, v = (t.detach() for t in bhsd(2, 4, 2, 24, 24, 16, seed=7))
    scale = 16 ** -0.5
    top, bottom, first, second = slice(0, 12), slice(12, 24), slice(0, 12), slice(12, 24)
    if causal:  # the diagonal blocks causal, the block below them full, the one above skipped (a ring's plan)
        blocks = [(top, first, True), (bottom, first, False), (bottom, second, True)]
    else:
        blocks = [(slice(None), first, False), (slice(None), second, False)]
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:3], float("-inf"))
    for rows, keys, block_causal in blocks:
        o, l = aten._scaled_dot_product_flash_attention(q[:, :, rows], k[:, :, keys], v[:, :, keys], 0.0,
                                                        block_causal, scale=scale)[:2]
        merged = torch.logaddexp(lse[..., rows], l)
        out[:, :, rows] = (out[:, :, rows] * (lse[..., rows] - merged).exp()[..., None]
                           + o * (l - merged).exp()[..., None])
        lse[..., rows] = merged
    dout = torch.randn_like(out)
    rng = (torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64))
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rows, keys, block_causal in blocks:
        gq, gk, gv = aten._scaled_dot_product_flash_attention_backward(
            dout[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys], out[:, :, rows], lse[..., rows], None,
            None, 12, 12, 0.0, block_causal, *rng, scale=scale)
        dq[:, :, rows] += gq
        dk[:, :, keys] += gk
        dv[:, :, keys] += gv
    want = oracle(q, k, v, causal, scale, dout)
    yardstick = plain(q, k, v, causal, scale, dout)
    for name, got, w, y in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), want, yardstick):
        err, bound = judge(got, w, y, torch.float32)
        assert err <= bound, f"{name}: max error {err:.3e} > bound {bound:.3e}"


@needs_hook
def test_dropout_seed_travels_in_the_rng_state(on_cpu):
    q, k, v = bhsd(2, 2, 2, 17, 17, 16, seed=3)
    torch.manual_seed(11)
    out = aten._scaled_dot_product_flash_attention(q, k, v, 0.3, True, scale=0.25)[0]
    dout = torch.randn_like(out)
    out.backward(dout)
    # flashtile's own API draws the same seed from torch's generator: the same dropout mask, forward and backward.
    q2, k2, v2 = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    torch.manual_seed(11)
    ref = flashtile.flash_attn_func(q2, k2, v2, dropout_p=0.3, softmax_scale=0.25, causal=True)
    ref.backward(dout.transpose(1, 2))
    torch.testing.assert_close(out, ref.transpose(1, 2), atol=0, rtol=0)
    for got, want in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        torch.testing.assert_close(got, want.transpose(1, 2), atol=1e-6, rtol=1e-6)


@needs_hook
def test_flash_attention_forward_varlen(on_cpu):
    gen = torch.Generator().manual_seed(5)
    cu = torch.tensor([0, 7, 7, 20], dtype=torch.int32)
    q = torch.randn(20, 4, 16, generator=gen).requires_grad_()
    k, v = (torch.randn(20, 2, 16, generator=gen).requires_grad_() for _ in range(2))
    out, lse, rng_state, offset, debug = aten._flash_attention_forward(q, k, v, cu, cu, 13, 13, 0.0, True, False,
                                                                       window_size_left=4, window_size_right=0)
    assert lse.shape == (4, 20) and rng_state.dtype == torch.uint64 and debug.numel() == 0
    dout = torch.randn_like(out)
    out.backward(dout)
    q2, k2, v2 = (t.detach().requires_grad_() for t in (q, k, v))
    ref, ref_lse, _ = flashtile.flash_attn_varlen_func(q2, k2, v2, cu, cu, 13, 13, causal=True, window_size=(4, 0),
                                                       return_attn_probs=True)
    ref.backward(dout)
    for got, want in ((out, ref), (lse, ref_lse), (q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@needs_hook
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal,heads,kv_heads,seqlen", [(True, 8, 8, 1000), (False, 8, 2, 513)])
def test_gpu_sdpa_runs_flashtile(dtype, causal, heads, kv_heads, seqlen):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, heads, seqlen, 128, device="cuda", dtype=dtype, generator=gen).requires_grad_()
    k, v = (torch.randn(2, kv_heads, seqlen, 128, device="cuda", dtype=dtype, generator=gen).requires_grad_()
            for _ in range(2))
    dout = torch.randn_like(q)
    gqa = heads != kv_heads

    def run():
        for t in (q, k, v):
            t.grad = None
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        out.backward(dout)
        return [out.detach(), q.grad, k.grad, v.grad]

    theirs = run()  # torch's own flash kernel
    with ft_sdpa.enabled():
        ours = run()
        assert ft_sdpa.call_counts() == {"forward": 1, "backward": 1}
    want = oracle(q.float(), k.float(), v.float(), causal, 128 ** -0.5, dout.float())
    for name, got, peer, ref in zip(("out", "dq", "dk", "dv"), ours, theirs, [want[0]] + want[2:]):
        err, bound = judge(got, ref, peer, dtype)
        assert err <= bound, f"{name}: max error {err:.3e} > bound {bound:.3e} (torch's flash)"


@pytest.mark.gpu
@needs_hook
def test_gpu_transformers_model_on_sdpa_runs_flashtile():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).cuda().to(torch.bfloat16)
    ids = torch.randint(0, 128, (2, 256), device="cuda")
    with torch.no_grad():
        theirs = model(input_ids=ids).logits
    with ft_sdpa.enabled(force=True):
        with torch.no_grad():
            ours = model(input_ids=ids).logits
        assert ft_sdpa.call_counts()["forward"] == 2  # one call per layer
    assert (ours.float() - theirs.float()).abs().max().item() < 0.1


@pytest.mark.gpu
@needs_hook
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_gpu_context_parallel_two_gpus():
    script = os.path.join(os.path.dirname(__file__), "..", "examples", "sdpa_context_parallel.py")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    torchrun = [shutil.which("torchrun")] if shutil.which("torchrun") else [sys.executable, "-m",
                                                                              "torch.distributed.run"]
    result = subprocess.run(torchrun + ["--standalone", "--nproc_per_node=2", script], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "context_parallel matches one GPU" in result.stdout
