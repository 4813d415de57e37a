"""Tests of the public API: argument checks, options not built yet, return conventions, SDPA semantics against
torch, torch.compile and opcheck of the custom ops, autograd through the LSE, strided inputs, the CPU fallback.

CPU tensors run the Triton kernels in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), except in
the fallback test, which runs a subprocess without the interpreter. Numbers are judged by the design's rule
("Judging correctness"): against the float64 oracle, a result passes when its max error is at most K x the error
of plain PyTorch computing the same thing in the input dtype, plus a rounding atol. Kernel outputs are NaN-filled
before the kernels run (poison_kernel_outputs), so an element no program writes fails.
"""

import copy
import inspect
import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import flashtile
from flashtile._settings import SETTINGS
import flashtile.kernels._common
import flashtile.kernels.configs
from flashtile.reference import naive_attention
from flashtile.testing import FP32_ACCUM_FLOOR as FP32_ATOL
from flashtile.testing import K, assert_close

REPO_ROOT = Path(__file__).resolve().parents[1]
F32, F64 = torch.float32, torch.float64
NEG_INF = float("-inf")


# --------------------------------------------------------------------------------------------------------------
# Fixtures and helpers
# --------------------------------------------------------------------------------------------------------------

@pytest.fixture
def seed(request):
    """A seed derived from the test id: every test draws its own inputs, reproducibly."""
    return zlib.crc32(request.node.nodeid.encode())


@pytest.fixture
def gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.fixture(autouse=True)
def poisoned_allocations(poison):
    """Every test here runs with NaN-filled kernel buffers (conftest.poison); the list of allocated shapes."""
    return poison


def test_cpu_tensors_run_the_kernels(poisoned_allocations, gen):
    """In-process CPU tests must exercise the Triton kernels (interpreted), not the reference fallback."""
    if torch.cuda.is_available():
        pytest.skip("a check of the CPU suite: on a CUDA machine conftest.py leaves the interpreter off")
    assert flashtile.kernels.configs.INTERPRETING, "TRITON_INTERPRET=1 was not set before triton was imported"
    q = _randn((1, 5, 2, 16), gen, requires_grad=True)
    flashtile.flash_attn_func(q, q, q).sum().backward()
    # The launchers allocated the forward's lse [B, H, S], and out, dq, dk, dv [B, S, H, D].
    assert (1, 2, 5) in poisoned_allocations
    assert poisoned_allocations.count((1, 5, 2, 16)) >= 4


def _randn(shape, gen, dtype=F32, requires_grad=False):
    t = torch.randn(shape, generator=gen, dtype=F32).to(dtype)
    return t.requires_grad_(requires_grad)


def assert_within_rule(name, got, oracle, baseline, dtype=F32):
    """got: the result under test; oracle: float64; baseline: plain PyTorch in the input dtype (flashtile.testing's
    rule, the one every kernel test uses)."""
    assert got.shape == oracle.shape, f"{name}: shape {tuple(got.shape)} != oracle's {tuple(oracle.shape)}"
    assert_close(name, got.detach(), oracle.detach().double(), baseline.detach(), dtype)


def _grads(loss, inputs):
    # An input the loss does not depend on (v, for a loss on the LSE alone) gets a zero gradient, not an error.
    return torch.autograd.grad(loss, inputs, allow_unused=True, materialize_grads=True)


# --------------------------------------------------------------------------------------------------------------
# 1. Validation at the public boundary
# --------------------------------------------------------------------------------------------------------------

class _Api:
    """One public entry point and its layout: flash_attn_func takes (B, S, H, D), SDPA (B, H, S, D)."""

    def __init__(self, fn, layout, names, scale_kw):
        self.fn, self.layout, self.names, self.scale_kw = fn, layout, names, scale_kw

    def shape(self, b, s, h, d):
        return (b, s, h, d) if self.layout == "bshd" else (b, h, s, d)

    def make(self, gen, b=1, sq=5, sk=7, hq=2, hk=2, d=16, dtype=F32):
        q = _randn(self.shape(b, sq, hq, d), gen, dtype)
        k = _randn(self.shape(b, sk, hk, d), gen, dtype)
        v = _randn(self.shape(b, sk, hk, d), gen, dtype)
        return q, k, v

    def gqa_kwargs(self):
        return {} if self.layout == "bshd" else {"enable_gqa": True}

    def fmt(self, template):
        """Fill {q}, {k}, {v}, {scale} with this API's argument names."""
        return template.format(q=self.names[0], k=self.names[1], v=self.names[2], scale=self.scale_kw)


FLASH = _Api(flashtile.flash_attn_func, "bshd", ("q", "k", "v"), "softmax_scale")
SDPA = _Api(flashtile.scaled_dot_product_attention, "bhsd", ("query", "key", "value"), "scale")
APIS = [pytest.param(FLASH, id="flash_attn_func"), pytest.param(SDPA, id="sdpa")]


def _replace(qkv, i, t):
    qkv = list(qkv)
    qkv[i] = t
    return qkv


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("dtypes", [
    pytest.param((F32, torch.float16, F32), id="k-fp16"),
    pytest.param((torch.bfloat16, torch.bfloat16, torch.float16), id="v-fp16"),
    pytest.param((torch.float16, F32, F32), id="q-fp16"),
])
def test_dtype_mismatch(api, dtypes, gen):
    q, k, v = (t.to(dt) for t, dt in zip(api.make(gen), dtypes))
    with pytest.raises(TypeError, match=api.fmt(r"{q}, {k}, {v} must share one dtype, got ") +
                       r"torch\.\w+, torch\.\w+, torch\.\w+"):
        api.fn(q, k, v)


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("dtype, which", [
    pytest.param(F64, (0, 1, 2), id="all-float64"),
    pytest.param(torch.int32, (0, 1, 2), id="all-int32"),
    pytest.param(F64, (1,), id="k-float64"),
    pytest.param(torch.int64, (2,), id="v-int64"),
    pytest.param(torch.complex64, (0, 1, 2), id="all-complex64"),
])
def test_unsupported_dtype(api, dtype, which, gen):
    qkv = list(api.make(gen))
    for i in which:
        qkv[i] = qkv[i].to(dtype)
    bad = api.names[which[0]]
    with pytest.raises(TypeError, match=rf"{bad} has dtype {re.escape(str(dtype))}; flashtile supports float16, "
                                        rf"bfloat16 and float32"):
        api.fn(*qkv)


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("which, match", [
    pytest.param((1,), r"{q}, {k}, {v} must be on one device, got cpu, meta, cpu", id="k-meta"),
    pytest.param((2,), r"{q}, {k}, {v} must be on one device, got cpu, cpu, meta", id="v-meta"),
    pytest.param((0, 1, 2), r"flashtile runs on CUDA GPUs \(and on the CPU for testing\), got device meta",
                 id="all-meta"),
])
def test_device_mismatch(api, which, match, gen):
    qkv = list(api.make(gen))
    for i in which:
        qkv[i] = qkv[i].to(torch.device("meta"))
    with pytest.raises(ValueError, match=api.fmt(match)):
        api.fn(*qkv)


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("which, rank", [
    pytest.param(0, 3, id="q-3d"),
    pytest.param(1, 5, id="k-5d"),
    pytest.param(2, 3, id="v-3d"),
    pytest.param(0, 5, id="q-5d"),
])
def test_wrong_rank(api, which, rank, gen):
    qkv = api.make(gen)
    t = qkv[which]
    t = t[0] if rank == 3 else t.unsqueeze(0)
    with pytest.raises(ValueError, match=rf"{api.names[which]} must be 4-D .* \({rank}-D\)"):
        api.fn(*_replace(qkv, which, t))


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("d", [pytest.param(d, id=f"D{d}") for d in (4, 12, 20, 520)])
def test_unsupported_head_dim(api, d, gen):
    with pytest.raises(ValueError, match=rf"head dim {d} is not supported: it must be a multiple of 8 and at most "
                                         rf"512"):
        api.fn(*api.make(gen, d=d))


@pytest.mark.parametrize("api", APIS)
def test_head_dims_differ(api, gen):
    q, k, v = api.make(gen)
    k = _randn(api.shape(1, 7, 2, 32), gen)
    with pytest.raises(ValueError, match=api.fmt(r"head dims differ: {q} 16, {k} 32; queries and keys need one")):
        api.fn(q, k, v)


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("hq, hk", [pytest.param(3, 2, id="Hq3-Hk2"), pytest.param(2, 4, id="Hq2-Hk4"),
                                    pytest.param(6, 4, id="Hq6-Hk4")])
def test_heads_not_multiple(api, hq, hk, gen):
    with pytest.raises(ValueError, match=api.fmt(rf"{{q}} has {hq} heads but {{k}}/{{v}} have {hk}; the number of "
                                                 rf"query heads must be a multiple")):
        api.fn(*api.make(gen, hq=hq, hk=hk), **api.gqa_kwargs())


def test_sdpa_needs_enable_gqa(gen):
    q, k, v = SDPA.make(gen, hq=4, hk=2)
    with pytest.raises(ValueError, match=r"query has 4 heads but key/value have 2; pass enable_gqa=True"):
        flashtile.scaled_dot_product_attention(q, k, v)
    with pytest.raises(ValueError, match=r"enable_gqa=True"):
        flashtile.scaled_dot_product_attention(q, k, v, enable_gqa=False)


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("which, how", [
    pytest.param(0, "every-other", id="q-stride2"),
    pytest.param(1, "every-other", id="k-stride2"),
    pytest.param(2, "transposed", id="v-transposed"),
])
def test_last_dim_not_contiguous(api, which, how, gen):
    qkv = api.make(gen)
    t = qkv[which]
    if how == "every-other":
        t = _randn(t.shape + (2,), gen)[..., 0]
    else:
        t = _randn(t.shape[:-2] + (t.shape[-1], t.shape[-2]), gen).transpose(-1, -2)
    assert t.stride(-1) != 1
    with pytest.raises(ValueError, match=rf"{api.names[which]}'s last dimension \(headdim\) must be contiguous, got "
                                         rf"stride {t.stride(-1)}"):
        api.fn(*_replace(qkv, which, t))


@pytest.mark.parametrize("api", APIS)
def test_checks_after_a_valid_call(api, gen):
    """check_qkv remembers the signatures of inputs that passed (flashtile._validate._VALID), not their values: after
    valid calls of a shape, inputs of that shape with another dtype, a strided last dim, a mismatched device or a
    tensor subclass still get their errors, and only the passing signature is remembered."""
    from flashtile import _validate
    qkv = api.make(gen)
    api.fn(*qkv)
    api.fn(*qkv)
    passed = len(_validate._VALID)
    with pytest.raises(TypeError, match=r"has dtype torch\.float64"):
        api.fn(*_replace(qkv, 1, qkv[1].double()))
    strided = _randn(qkv[2].shape + (2,), gen)[..., 0]
    with pytest.raises(ValueError, match=r"last dimension \(headdim\) must be contiguous"):
        api.fn(*_replace(qkv, 2, strided))
    with pytest.raises(ValueError, match=api.fmt("{q}, {k}, {v} must be on one device")):
        api.fn(*_replace(qkv, 0, qkv[0].to("meta")))
    assert len(_validate._VALID) == passed
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        api.fn(*_replace(qkv, 0, qkv[0].numpy()))
    # A subclass of Tensor (nn.Parameter) takes the full checks every time and is not remembered.
    api.fn(torch.nn.Parameter(qkv[0], requires_grad=False), *qkv[1:])
    assert len(_validate._VALID) == passed


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("sizes, bad", [
    pytest.param(dict(b=0), 0, id="B0"),
    pytest.param(dict(sq=0), 0, id="Sq0"),
    pytest.param(dict(sk=0), 1, id="Sk0"),
    pytest.param(dict(hq=0, hk=0), 0, id="H0"),
])
def test_empty(api, sizes, bad, gen):
    with pytest.raises(ValueError, match=rf"{api.names[bad]} is empty \(shape .*\); every dimension"):
        api.fn(*api.make(gen, **sizes))


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("which, sizes, match", [
    pytest.param(1, (1, 9, 2), r"{k} has seqlen 9 but {v} has 7; keys and values must have the same sequence",
                 id="k-seqlen"),
    pytest.param(2, (1, 9, 2), r"{k} has seqlen 7 but {v} has 9", id="v-seqlen"),
    pytest.param(2, (1, 7, 1), r"{k} has 2 heads but {v} has 1; keys and values must have the same number of heads",
                 id="v-heads"),
    pytest.param(1, (2, 7, 2), r"batch sizes differ: {q} 1, {k} 2, {v} 1", id="k-batch"),
    pytest.param(2, (3, 7, 2), r"batch sizes differ: {q} 1, {k} 1, {v} 3", id="v-batch"),
])
def test_kv_mismatch(api, which, sizes, match, gen):
    b, s, h = sizes
    qkv = api.make(gen)
    with pytest.raises(ValueError, match=api.fmt(match)):
        api.fn(*_replace(qkv, which, _randn(api.shape(b, s, h, 16), gen)))


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("which, value, type_name", [
    pytest.param(0, [[1.0]], "list", id="q-list"),
    pytest.param(1, None, "NoneType", id="k-None"),
    pytest.param(2, 1.5, "float", id="v-float"),
])
def test_non_tensor(api, which, value, type_name, gen):
    with pytest.raises(TypeError, match=rf"{api.names[which]} must be a torch.Tensor, got {type_name}"):
        api.fn(*_replace(api.make(gen), which, value))


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("value, exc, match", [
    pytest.param("0.5", TypeError, r"^{scale} must be a float or None .*, got str", id="str"),
    pytest.param(True, TypeError, r"^{scale} must be a float or None .*, got bool", id="bool"),
    pytest.param(torch.tensor(0.5), TypeError, r"^{scale} must be a float or None .*, got Tensor", id="tensor"),
    pytest.param(math.inf, ValueError, r"^{scale} must be finite, got inf", id="inf"),
    pytest.param(-math.inf, ValueError, r"^{scale} must be finite, got -inf", id="-inf"),
    pytest.param(math.nan, ValueError, r"^{scale} must be finite, got nan", id="nan"),
])
def test_bad_scale(api, value, exc, match, gen):
    with pytest.raises(exc, match=api.fmt(match)):
        api.fn(*api.make(gen), **{api.scale_kw: value})


# --------------------------------------------------------------------------------------------------------------
# 2. Feature options are validated here too (their kernels are tests/test_features.py's)
# --------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("api, kwargs, exc, match", [
    pytest.param(FLASH, dict(dropout_p=1.5), ValueError, r"dropout_p must be in \[0, 1\), got 1\.5", id="flash-dropout"),
    pytest.param(FLASH, dict(window_size=(4, -3)), ValueError, r"window_size entries must be >= -1", id="flash-window"),
    pytest.param(FLASH, dict(softcap=float("nan")), ValueError, r"softcap must be finite and >= 0", id="flash-softcap"),
    pytest.param(FLASH, dict(alibi_slopes=torch.ones(3)), ValueError, r"alibi_slopes must have shape \(2,\)",
                 id="flash-alibi"),
    pytest.param(SDPA, dict(attn_mask=torch.ones(5, 6, dtype=torch.bool)), ValueError, r"does not broadcast",
                 id="sdpa-mask-shape"),
    pytest.param(SDPA, dict(dropout_p=-0.1), ValueError, r"dropout_p must be in \[0, 1\)", id="sdpa-dropout"),
])
def test_bad_feature_options(api, kwargs, exc, match, gen):
    with pytest.raises(exc, match=match):
        api.fn(*api.make(gen), **kwargs)


# --------------------------------------------------------------------------------------------------------------
# 3. Return conventions
# --------------------------------------------------------------------------------------------------------------

DTYPES = [pytest.param(F32, id="fp32"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.bfloat16, id="bf16")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [pytest.param(False, id="full"), pytest.param(True, id="causal")])
def test_flash_attn_func_returns(dtype, causal, gen):
    b, sq, sk, hq, hk, d = 2, 17, 33, 4, 2, 16
    q = _randn((b, sq, hq, d), gen, dtype)
    k = _randn((b, sk, hk, d), gen, dtype)
    v = _randn((b, sk, hk, d), gen, dtype)
    out = flashtile.flash_attn_func(q, k, v, causal=causal)
    assert isinstance(out, torch.Tensor)
    assert out.shape == (b, sq, hq, d) and out.dtype == dtype

    res = flashtile.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert isinstance(res, tuple) and len(res) == 3
    out2, lse, s_dmask = res
    assert s_dmask is None
    assert lse.shape == (b, hq, sq) and lse.dtype == F32
    assert out2.shape == (b, sq, hq, d) and out2.dtype == dtype
    assert torch.equal(out2, out)

    out_ref, lse_ref = naive_attention(q.double(), k.double(), v.double(), causal=causal)
    out_pt, lse_pt = naive_attention(q, k, v, causal=causal)
    assert_within_rule("out", out, out_ref, out_pt, dtype)
    assert_within_rule("lse", lse, lse_ref, lse_pt, dtype)


def test_flash_attn_func_deterministic(gen):
    b, sq, sk, hq, hk, d = 1, 33, 65, 4, 1, 32
    q = _randn((b, sq, hq, d), gen, requires_grad=True)
    k = _randn((b, sk, hk, d), gen, requires_grad=True)
    v = _randn((b, sk, hk, d), gen, requires_grad=True)
    dout = _randn((b, sq, hq, d), gen)
    runs = []
    for deterministic in (True, True, False):
        out = flashtile.flash_attn_func(q, k, v, causal=True, deterministic=deterministic)
        runs.append((out.detach(),) + _grads((out * dout).sum(), (q, k, v)))
    # The portable backward (the only one off Hopper) has no atomics: every run agrees bit for bit, whatever
    # `deterministic` says.
    for other in runs[1:]:
        for a, b_ in zip(runs[0], other):
            assert torch.equal(a, b_)
    out_ref = naive_attention(q.double(), k.double(), v.double(), causal=True)[0]
    assert_within_rule("out", runs[0][0], out_ref, naive_attention(q, k, v, causal=True)[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_sdpa_returns(dtype, gen):
    b, h, sq, sk, d = 2, 3, 5, 7, 16
    q, k, v = SDPA.make(gen, b=b, sq=sq, sk=sk, hq=h, hk=h, d=d, dtype=dtype)
    out = flashtile.scaled_dot_product_attention(q, k, v)
    assert isinstance(out, torch.Tensor)
    assert out.shape == (b, h, sq, d) and out.dtype == dtype
    out_ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert_within_rule("out", out, out_ref, F.scaled_dot_product_attention(q, k, v), dtype)


_REQUIRED = inspect.Parameter.empty


@pytest.mark.parametrize("fn, expected", [
    # flash-attn 2.x flash_attn_interface.flash_attn_func
    pytest.param(flashtile.flash_attn_func,
                 [("q", _REQUIRED), ("k", _REQUIRED), ("v", _REQUIRED), ("dropout_p", 0.0), ("softmax_scale", None),
                  ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
                  ("deterministic", False), ("return_attn_probs", False), ("sinks", None),
                  # keyword-only: FA3's FP8 factors
                  ("q_descale", None), ("k_descale", None), ("v_descale", None)], id="flash_attn_func"),
    # torch.nn.functional.scaled_dot_product_attention (torch >= 2.5)
    pytest.param(flashtile.scaled_dot_product_attention,
                 [("query", _REQUIRED), ("key", _REQUIRED), ("value", _REQUIRED), ("attn_mask", None),
                  ("dropout_p", 0.0), ("is_causal", False), ("scale", None), ("enable_gqa", False)], id="sdpa"),
])
def test_signature_matches_upstream(fn, expected):
    """Same names, order and defaults as the function it stands in for, so keyword and positional calls port."""
    params = inspect.signature(fn).parameters.values()
    assert [(p.name, p.default) for p in params] == expected
    # flash-attn's parameters are positional-or-keyword; flashtile's extras (sinks) are keyword-only after them.
    kinds = [p.kind for p in params]
    upstream = [k for k in kinds if k == inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert kinds == upstream + [inspect.Parameter.KEYWORD_ONLY] * (len(kinds) - len(upstream))


# --------------------------------------------------------------------------------------------------------------
# 4. SDPA semantics against torch; flash-attn's bottom-right causal against an explicit mask
# --------------------------------------------------------------------------------------------------------------

def _torch_has_enable_gqa():
    try:
        inspect.signature(F.scaled_dot_product_attention).bind(None, None, None, enable_gqa=True)
        return True
    except TypeError:
        return False
    except ValueError:  # a builtin without a signature: ask it directly
        t = torch.zeros(1, 2, 1, 8)
        try:
            F.scaled_dot_product_attention(t, t[:, :1], t[:, :1], enable_gqa=True)
        except TypeError:
            return False
        return True


SDPA_CASES = [
    # (B, Hq, Hk, Sq, Sk, D, is_causal, scale)
    pytest.param((2, 2, 2, 17, 33, 16, False, None), id="full-B2-Sq17-Sk33-H2-Hk2-D16"),
    pytest.param((1, 2, 2, 65, 65, 32, False, None), id="full-B1-Sq65-Sk65-H2-Hk2-D32"),
    pytest.param((2, 2, 2, 33, 33, 16, True, None), id="causal-B2-Sq33-Sk33-H2-Hk2-D16"),
    pytest.param((1, 2, 2, 17, 65, 16, True, None), id="causal-topleft-B1-Sq17-Sk65-H2-Hk2-D16"),
    pytest.param((1, 2, 2, 65, 17, 16, True, None), id="causal-topleft-B1-Sq65-Sk17-H2-Hk2-D16"),
    pytest.param((2, 2, 2, 17, 33, 64, False, 0.3), id="scale0.3-B2-Sq17-Sk33-H2-Hk2-D64"),
    pytest.param((1, 3, 3, 33, 17, 24, True, 1.7), id="causal-scale1.7-B1-Sq33-Sk17-H3-Hk3-D24"),
    pytest.param((2, 4, 2, 17, 33, 16, False, None), id="gqa-B2-Sq17-Sk33-H4-Hk2-D16"),
    pytest.param((1, 4, 2, 33, 17, 16, True, None), id="gqa-causal-B1-Sq33-Sk17-H4-Hk2-D16"),
]


@pytest.mark.parametrize("case", SDPA_CASES)
def test_sdpa_matches_torch(case, gen):
    b, hq, hk, sq, sk, d, is_causal, scale = case
    kwargs = dict(is_causal=is_causal, scale=scale)
    if hq != hk:
        if not _torch_has_enable_gqa():
            pytest.skip("this torch's scaled_dot_product_attention has no enable_gqa (added in torch 2.5)")
        kwargs["enable_gqa"] = True
    q = _randn((b, hq, sq, d), gen, requires_grad=True)
    k = _randn((b, hk, sk, d), gen, requires_grad=True)
    v = _randn((b, hk, sk, d), gen, requires_grad=True)
    dout = _randn((b, hq, sq, d), gen)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))

    out = flashtile.scaled_dot_product_attention(q, k, v, **kwargs)
    out_ref = F.scaled_dot_product_attention(q64, k64, v64, **kwargs)
    out_pt = F.scaled_dot_product_attention(q, k, v, **kwargs)
    # With Sq != Sk, is_causal aligns top-left in torch; a bottom-right mask would be off by |Sk - Sq| keys.
    assert_within_rule("out", out, out_ref, out_pt)

    grads = _grads((out * dout).sum(), (q, k, v))
    grads_ref = _grads((out_ref * dout.double()).sum(), (q64, k64, v64))
    grads_pt = _grads((out_pt * dout).sum(), (q, k, v))
    for name, g, g_ref, g_pt in zip(("dq", "dk", "dv"), grads, grads_ref, grads_pt):
        assert_within_rule(name, g, g_ref, g_pt)


def _explicit_masked_attention(q, k, v, mask, scale):
    """Dense attention with an explicit bool mask [Sq, Sk], written independently of flashtile.reference.

    q [B, Sq, H, D], k, v [B, Sk, Hk, D]. A row with no visible key gets out 0 and lse -inf, and no gradient."""
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    s = scale * torch.einsum("bqhd,bkhd->bhqk", q, k)
    seen = mask.any(dim=-1)
    s_seen = s[:, :, seen].masked_fill(~mask[seen], NEG_INF)
    p = s.new_zeros(s.shape)
    p[:, :, seen] = torch.softmax(s_seen, dim=-1)
    lse = s.new_full(s.shape[:-1], NEG_INF)
    lse[:, :, seen] = torch.logsumexp(s_seen, dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


@pytest.mark.parametrize("sq, sk", [pytest.param(2, 5, id="B2-Sq2-Sk5-H2-Hk1-D16"),
                                    pytest.param(5, 2, id="B2-Sq5-Sk2-H2-Hk1-D16"),
                                    pytest.param(17, 65, id="B2-Sq17-Sk65-H2-Hk1-D16"),
                                    pytest.param(65, 17, id="B2-Sq65-Sk17-H2-Hk1-D16")])
def test_flash_attn_causal_bottom_right(sq, sk, gen):
    b, hq, hk, d = 2, 2, 1, 16
    scale = 1.0 / math.sqrt(d)
    # Bottom-right alignment as flash-attn's docstring draws it: query i sees key j iff j <= i + Sk - Sq.
    mask = torch.tensor([[j <= i + sk - sq for j in range(sk)] for i in range(sq)])
    if (sq, sk) == (2, 5):
        assert mask.int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    if (sq, sk) == (5, 2):
        assert mask.int().tolist() == [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]]
    q = _randn((b, sq, hq, d), gen, requires_grad=True)
    k = _randn((b, sk, hk, d), gen, requires_grad=True)
    v = _randn((b, sk, hk, d), gen, requires_grad=True)
    dout = _randn((b, sq, hq, d), gen)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))

    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    out_ref, lse_ref = _explicit_masked_attention(q64, k64, v64, mask, scale)
    out_pt, lse_pt = _explicit_masked_attention(q, k, v, mask, scale)
    assert_within_rule("out", out, out_ref, out_pt)
    assert_within_rule("lse", lse, lse_ref, lse_pt)

    empty = ~mask.any(dim=-1)  # rows that see no key
    assert torch.equal(out[:, empty], torch.zeros_like(out[:, empty]))
    assert torch.equal(lse[:, :, empty], torch.full_like(lse[:, :, empty], NEG_INF))

    grads = _grads((out * dout).sum(), (q, k, v))
    grads_ref = _grads((out_ref * dout.double()).sum(), (q64, k64, v64))
    grads_pt = _grads((out_pt * dout).sum(), (q, k, v))
    for name, g, g_ref, g_pt in zip(("dq", "dk", "dv"), grads, grads_ref, grads_pt):
        assert torch.isfinite(g).all(), f"{name} has non-finite entries"
        assert_within_rule(name, g, g_ref, g_pt)
    dq = grads[0]
    assert torch.equal(dq[:, empty], torch.zeros_like(dq[:, empty]))


# --------------------------------------------------------------------------------------------------------------
# 5. torch.compile(fullgraph=True)
# --------------------------------------------------------------------------------------------------------------

class _FlashBlock(torch.nn.Module):
    """linear -> (B, S, 3, H, D) -> flash_attn_func (causal, strided views of the packed qkv) -> linear."""

    def __init__(self, heads=2, head_dim=16):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.width = width = heads * head_dim
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).unbind(2)
        o = flashtile.flash_attn_func(q, k, v, causal=True)
        return self.proj(o.reshape(b, s, self.heads * self.head_dim))


class _SdpaBlock(torch.nn.Module):
    """linear -> (B, H, S, D) with 4 query heads over 2 kv heads -> flashtile SDPA (causal, GQA) -> linear."""

    def __init__(self, heads=4, kv_heads=2, head_dim=16):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.width = heads * head_dim
        self.q = torch.nn.Linear(heads * head_dim, heads * head_dim)
        self.kv = torch.nn.Linear(heads * head_dim, 2 * kv_heads * head_dim)
        self.proj = torch.nn.Linear(heads * head_dim, heads * head_dim)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        o = flashtile.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.proj(o.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


@pytest.fixture
def dynamo_counters():
    """A clean torch.compile state and empty counters before the test; the caches dropped again after it."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield torch._dynamo.utils.counters
    torch._dynamo.reset()


def _have_cxx_compiler():
    return any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "clang++", "c++"))


@pytest.mark.parametrize("block", [pytest.param(_FlashBlock, id="flash_attn_func"),
                                   pytest.param(_SdpaBlock, id="sdpa")])
@pytest.mark.parametrize("backend", [
    pytest.param("aot_eager", id="aot_eager"),
    # Inductor on the CPU compiles C++ for the linear layers (~20 s here); the custom op stays opaque.
    pytest.param("inductor", id="inductor-cpu",
                 marks=pytest.mark.skipif(not _have_cxx_compiler(), reason="inductor on the CPU needs a C++ compiler")),
])
def test_torch_compile_fullgraph(block, backend, seed, dynamo_counters):
    torch.manual_seed(seed)
    model = block()
    eager = copy.deepcopy(model)
    x = torch.randn(2, 33, model.width, requires_grad=True)
    x_eager = x.detach().clone().requires_grad_()

    compiled = torch.compile(model, fullgraph=True, backend=backend)
    y = compiled(x)
    y.square().sum().backward()
    assert not dynamo_counters["graph_break"], dict(dynamo_counters["graph_break"])
    assert dynamo_counters["stats"]["unique_graphs"] == 1

    y_eager = eager(x_eager)
    y_eager.square().sum().backward()
    tol = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(y, y_eager, **tol)
    torch.testing.assert_close(x.grad, x_eager.grad, **tol)
    for (name, p), p_eager in zip(model.named_parameters(), eager.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, p_eager.grad, **tol, msg=lambda m, name=name: f"{name}.grad: {m}")


def test_torch_compile_dynamic_seqlen(gen, dynamo_counters):
    """dynamic=True: one graph serves every sequence length (the causal offset Sk - Sq is a symbolic int)."""
    fn = torch.compile(lambda q, k, v: flashtile.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)[:2],
                       fullgraph=True, backend="aot_eager", dynamic=True)
    for sq, sk in ((17, 33), (33, 17), (9, 9)):
        q = _randn((1, sq, 2, 16), gen, requires_grad=True)
        k = _randn((1, sk, 1, 16), gen, requires_grad=True)
        v = _randn((1, sk, 1, 16), gen, requires_grad=True)
        out, lse = fn(q, k, v)
        grads = _grads(out.square().sum(), (q, k, v))
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        out_ref, lse_ref = naive_attention(q64, k64, v64, causal=True)
        out_pt, lse_pt = naive_attention(q, k, v, causal=True)
        assert_within_rule(f"out Sq{sq}-Sk{sk}", out, out_ref, out_pt)
        assert_within_rule(f"lse Sq{sq}-Sk{sk}", lse, lse_ref, lse_pt)
        grads_ref = _grads(out_ref.square().sum(), (q64, k64, v64))
        grads_pt = _grads(out_pt.square().sum(), (q, k, v))
        for name, g, g_ref, g_pt in zip(("dq", "dk", "dv"), grads, grads_ref, grads_pt):
            assert_within_rule(f"{name} Sq{sq}-Sk{sk}", g, g_ref, g_pt)
    assert not dynamo_counters["graph_break"], dict(dynamo_counters["graph_break"])
    assert dynamo_counters["stats"]["unique_graphs"] == 1


# --------------------------------------------------------------------------------------------------------------
# 6. torch.library.opcheck on the custom ops
# --------------------------------------------------------------------------------------------------------------

OPCHECK_SHAPES = [pytest.param((1, 17, 33, 2, 1, 16), id="B1-Sq17-Sk33-H2-Hk1-D16"),
                  pytest.param((1, 33, 17, 2, 1, 16), id="B1-Sq33-Sk17-H2-Hk1-D16")]
CAUSAL = [pytest.param(False, id="full"), pytest.param(True, id="causal")]


def _opcheck_inputs(shape, gen, requires_grad):
    b, sq, sk, hq, hk, d = shape
    q = _randn((b, sq, hq, d), gen, requires_grad=requires_grad)
    k = _randn((b, sk, hk, d), gen, requires_grad=requires_grad)
    v = _randn((b, sk, hk, d), gen, requires_grad=requires_grad)
    return q, k, v, 1.0 / math.sqrt(d), sk - sq


def _assert_opcheck_passes(op, args):
    result = torch.library.opcheck(op, args)
    assert result and all(status == "SUCCESS" for status in result.values()), result


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("shape", OPCHECK_SHAPES)
def test_opcheck_attn_fwd(shape, causal, gen):
    q, k, v, scale, offset = _opcheck_inputs(shape, gen, requires_grad=True)
    # The op's trailing arguments are AttentionRequest's fields: softmax_scale, diagonal_offset, window_left,
    # window_right (causal: the right edge at the diagonal), ...
    _assert_opcheck_passes(torch.ops.flashtile.attn_fwd.default, (q, k, v, scale, offset, -1, 0 if causal else -1))


@pytest.mark.parametrize("with_dlse", [pytest.param(False, id="dlse-None"), pytest.param(True, id="dlse-tensor")])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("shape", OPCHECK_SHAPES)
def test_opcheck_attn_bwd(shape, causal, with_dlse, gen):
    q, k, v, scale, offset = _opcheck_inputs(shape, gen, requires_grad=False)
    right = 0 if causal else -1
    out, lse = torch.ops.flashtile.attn_fwd(q, k, v, scale, offset, -1, right)
    dout = _randn(out.shape, gen)
    dlse = _randn(lse.shape, gen) if with_dlse else None
    _assert_opcheck_passes(torch.ops.flashtile.attn_bwd.default,
                           (dout, q, k, v, out, lse, dlse, False, scale, offset, -1, right))


class _OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the ops that reach the dispatcher."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_eager_calls_skip_the_dispatcher(gen, monkeypatch):
    """Eager calls run the op's implementation through _AttnFunction, bit-identical to the op (forward, the
    gradients of q, k, v, a float bias and the sinks); dispatch modes, FakeTensors and EAGER_DIRECT = False see the
    op itself."""
    from flashtile import _ops
    q = _randn((1, 17, 2, 16), gen, requires_grad=True)
    k, v = (_randn((1, 23, 1, 16), gen, requires_grad=True) for _ in range(2))
    bias = _randn((1, 2, 17, 23), gen, requires_grad=True)
    sinks = _randn((2,), gen, requires_grad=True)
    assert _ops.eager(q, k, v) and _ops.eager(q, None, None)
    with _OpLog() as log:
        assert not _ops.eager(q, k, v)
        flashtile.flash_attn_func(q.detach(), k.detach(), v.detach())
    assert torch.ops.flashtile.attn_fwd.default in log.ops
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        assert not _ops.eager(mode.from_tensor(q), k, v)

    def run():
        out = flashtile.flash_attn_func(q, k, v, causal=True, sinks=sinks)
        out_b = flashtile.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                       attn_mask=bias, enable_gqa=True)
        loss = out.square().sum() + out_b.square().sum()
        return (out, out_b) + torch.autograd.grad(loss, (q, k, v, bias, sinks))

    calls = []
    monkeypatch.setattr(_ops._AttnFunction, "apply", lambda *a, _apply=_ops._AttnFunction.apply: (
        calls.append(1), _apply(*a))[1])
    direct = run()
    assert calls, "the eager call did not take _AttnFunction"
    monkeypatch.setattr(SETTINGS, "eager_direct", False)
    calls.clear()
    through_op = run()
    assert not calls
    for name, a, b in zip(("out", "out_bias", "dq", "dk", "dv", "dbias", "dsinks"), direct, through_op):
        assert torch.equal(a, b), name


def test_launch_key_is_at_least_as_fine_as_tritons():
    """kernels._launch keys: integers by width, value 1 and divisibility by 16 (Triton's specialization);
    tensors by dtype and 16-byte alignment; floats by type only."""
    from flashtile.kernels._launch import _arg_key
    assert _arg_key(32) == _arg_key(48) != _arg_key(40) == _arg_key(24)
    assert _arg_key(1) != _arg_key(3) and _arg_key(2 ** 31 + 16) != _arg_key(32) == _arg_key(-32)
    assert _arg_key(True) != _arg_key(1) and _arg_key(True) != _arg_key(False)
    assert _arg_key(0.5) == _arg_key(2.0)
    t = torch.zeros(64, dtype=torch.float16)
    assert _arg_key(t) == _arg_key(t[8:]) != _arg_key(t[1:]) and _arg_key(t) != _arg_key(t.float())
    # Argument groups (tuples, NamedTuples): field by field, nested.
    assert _arg_key((32, (t, 0.5))) == _arg_key((48, (t[8:], 2.0))) != _arg_key((32, (t[1:], 0.5)))
    assert _arg_key((32, 1)) != _arg_key((32, 3)) and _arg_key((40,)) != _arg_key((48,))


# --------------------------------------------------------------------------------------------------------------
# 7. Autograd through the returned LSE
# --------------------------------------------------------------------------------------------------------------

def _loss_weighted(out, lse, w_out, w_lse):
    # A row that sees no key has lse -inf; where() keeps the loss finite and gives that row's lse no gradient.
    return (out * w_out).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * w_lse).sum()


def _loss_lse_sum(out, lse, w_out, w_lse):
    # Only the LSE: the output's gradient is None, and the LSE's is expanded (stride 0).
    return lse.sum()


def _loss_sums(out, lse, w_out, w_lse):
    return out.sum() + lse.sum()


def _loss_lse_broadcast(out, lse, w_out, w_lse):
    # The LSE's gradient is w_lse[0, 0] expanded over batch and heads: strides (0, 0, 1).
    return (out * w_out).sum() + (lse.sum(dim=(0, 1)) * w_lse[0, 0]).sum()


LSE_CASES = [
    # (B, Sq, Sk, Hq, Hk, D, causal, loss)
    pytest.param((2, 17, 33, 4, 2, 16, False, _loss_weighted), id="weighted-full-B2-Sq17-Sk33-H4-Hk2-D16"),
    pytest.param((1, 33, 65, 2, 1, 32, True, _loss_weighted), id="weighted-causal-B1-Sq33-Sk65-H2-Hk1-D32"),
    pytest.param((2, 65, 17, 2, 2, 16, True, _loss_weighted), id="weighted-causal-B2-Sq65-Sk17-H2-Hk2-D16"),
    pytest.param((1, 17, 33, 4, 1, 16, False, _loss_lse_sum), id="lse-only-full-B1-Sq17-Sk33-H4-Hk1-D16"),
    # Rows 0-15 see no key: lse.sum() still sends them a gradient of 1, which must not turn into NaN.
    pytest.param((1, 33, 17, 2, 2, 16, True, _loss_lse_sum), id="lse-only-causal-B1-Sq33-Sk17-H2-Hk2-D16"),
    pytest.param((2, 17, 33, 4, 2, 16, False, _loss_lse_broadcast), id="lse-broadcast-full-B2-Sq17-Sk33-H4-Hk2-D16"),
    pytest.param((2, 33, 33, 2, 1, 64, True, _loss_sums), id="sums-causal-B2-Sq33-Sk33-H2-Hk1-D64"),
]


@pytest.mark.parametrize("case", LSE_CASES)
def test_autograd_through_lse(case, gen):
    b, sq, sk, hq, hk, d, causal, loss_fn = case
    q = _randn((b, sq, hq, d), gen, requires_grad=True)
    k = _randn((b, sk, hk, d), gen, requires_grad=True)
    v = _randn((b, sk, hk, d), gen, requires_grad=True)
    w_out, w_lse = _randn((b, sq, hq, d), gen), _randn((b, hq, sq), gen)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))

    out, lse, _ = flashtile.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    out_ref, lse_ref = naive_attention(q64, k64, v64, causal=causal)
    out_pt, lse_pt = naive_attention(q, k, v, causal=causal)
    grads = _grads(loss_fn(out, lse, w_out, w_lse), (q, k, v))
    grads_ref = _grads(loss_fn(out_ref, lse_ref, w_out.double(), w_lse.double()), (q64, k64, v64))
    grads_pt = _grads(loss_fn(out_pt, lse_pt, w_out, w_lse), (q, k, v))
    for name, g, g_ref, g_pt in zip(("dq", "dk", "dv"), grads, grads_ref, grads_pt):
        assert torch.isfinite(g).all(), f"{name} has non-finite entries"
        assert_within_rule(name, g, g_ref, g_pt)


# --------------------------------------------------------------------------------------------------------------
# 8. Non-contiguous inputs
# --------------------------------------------------------------------------------------------------------------

def _strided_inputs(kind, b, sq, sk, hq, hk, d, gen):
    """(leaves, q, k, v): q/k/v are strided views (last dim contiguous) of the leaf tensors that get gradients."""
    if kind == "packed-qkv":  # (B, S, 3, H, D)[:, :, i]
        qkv = _randn((b, sq, 3, hq, d), gen, requires_grad=True)
        return (qkv,), qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    if kind == "packed-kv":  # q alone, (B, Sk, 2, Hk, D)[:, :, i]
        q = _randn((b, sq, hq, d), gen, requires_grad=True)
        kv = _randn((b, sk, 2, hk, d), gen, requires_grad=True)
        return (q, kv), q, kv[:, :, 0], kv[:, :, 1]
    if kind == "transposed":  # (B, H, S, D).transpose(1, 2)
        leaves = tuple(_randn(s, gen, requires_grad=True) for s in ((b, hq, sq, d), (b, hk, sk, d), (b, hk, sk, d)))
        return (leaves, *(t.transpose(1, 2) for t in leaves))
    if kind == "headdim-slice":  # q (B, S, H, 2D)[..., :D], k (B, 2S, H, D)[:, ::2], v (B, S, 2H, D)[:, :, 1::2]
        q = _randn((b, sq, hq, 2 * d), gen, requires_grad=True)
        k = _randn((b, 2 * sk, hk, d), gen, requires_grad=True)
        v = _randn((b, sk, 2 * hk, d), gen, requires_grad=True)
        return (q, k, v), q[..., :d], k[:, ::2], v[:, :, 1::2]
    raise AssertionError(kind)


STRIDED_CASES = [
    # (kind, B, Sq, Sk, Hq, Hk, D, causal)
    pytest.param(("packed-qkv", 2, 33, 33, 2, 2, 16, True), id="packed-qkv-causal-B2-Sq33-Sk33-H2-Hk2-D16"),
    pytest.param(("packed-kv", 1, 17, 65, 4, 2, 32, False), id="packed-kv-full-B1-Sq17-Sk65-H4-Hk2-D32"),
    pytest.param(("transposed", 2, 65, 17, 2, 1, 16, True), id="transposed-causal-B2-Sq65-Sk17-H2-Hk1-D16"),
    pytest.param(("headdim-slice", 1, 17, 33, 2, 2, 24, False), id="headdim-slice-full-B1-Sq17-Sk33-H2-Hk2-D24"),
]
DOUTS = [pytest.param("sum", id="dout-expanded"), pytest.param("broadcast", id="dout-broadcast-rows"),
         pytest.param("strided", id="dout-strided")]


@pytest.mark.parametrize("dout_kind", DOUTS)
@pytest.mark.parametrize("case", STRIDED_CASES)
def test_non_contiguous_inputs(case, dout_kind, gen):
    kind, b, sq, sk, hq, hk, d, causal = case
    leaves, q, k, v = _strided_inputs(kind, b, sq, sk, hq, hk, d, gen)
    assert all(t.stride(-1) == 1 for t in (q, k, v)) and not all(t.is_contiguous() for t in (q, k, v))
    dout = _randn((b, hq, sq, d), gen).transpose(1, 2)  # a strided gradient, last dim contiguous
    w = _randn((d,), gen)

    def loss(out):
        if dout_kind == "sum":  # the gradient reaching the op is ones expand()ed: all strides 0
            return out.sum()
        if dout_kind == "broadcast":  # w expanded over batch, seqlen and heads: strides (0, 0, 0, 1)
            return (out.sum(dim=(0, 1, 2)) * w.to(out.dtype)).sum()
        return (out * dout.to(out.dtype)).sum()

    for t in (q, k, v):
        t.retain_grad()
    out = flashtile.flash_attn_func(q, k, v, causal=causal)
    if dout_kind == "strided":
        out.backward(dout)
    else:
        loss(out).backward()
    grads = (q.grad, k.grad, v.grad)

    # Contiguous copies through the same kernels: the same numbers bit for bit (only the addresses differ).
    qc, kc, vc = (t.detach().contiguous().requires_grad_() for t in (q, k, v))
    out_c = flashtile.flash_attn_func(qc, kc, vc, causal=causal)
    grads_c = _grads(loss(out_c), (qc, kc, vc))
    assert torch.equal(out, out_c)
    for name, g, g_c in zip(("dq", "dk", "dv"), grads, grads_c):
        assert torch.equal(g, g_c), name

    # The gradients that reached the leaves are the view gradients scattered back.
    for leaf in leaves:
        assert leaf.grad is not None and torch.isfinite(leaf.grad).all()
    if kind == "packed-qkv":
        torch.testing.assert_close(leaves[0].grad, torch.stack(grads_c, dim=2), rtol=0, atol=0)
    elif kind == "packed-kv":
        torch.testing.assert_close(leaves[0].grad, grads_c[0], rtol=0, atol=0)
        torch.testing.assert_close(leaves[1].grad, torch.stack(grads_c[1:], dim=2), rtol=0, atol=0)

    # And both are right.
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out_ref = naive_attention(q64, k64, v64, causal=causal)[0]
    out_pt = naive_attention(qc, kc, vc, causal=causal)[0]
    assert_within_rule("out", out, out_ref, out_pt)
    grads_ref = _grads(loss(out_ref), (q64, k64, v64))
    grads_pt = _grads(loss(out_pt), (qc, kc, vc))
    for name, g, g_ref, g_pt in zip(("dq", "dk", "dv"), grads, grads_ref, grads_pt):
        assert_within_rule(name, g, g_ref, g_pt)


# --------------------------------------------------------------------------------------------------------------
# CPU fallback without the interpreter (a subprocess: the choice is made when triton is imported)
# --------------------------------------------------------------------------------------------------------------

_FALLBACK_SCRIPT = textwrap.dedent("""
    import json, warnings
    import torch
    import flashtile
    from flashtile.kernels import configs
    from flashtile.reference import naive_attention

    gen = torch.Generator().manual_seed({seed})
    q = torch.randn(2, 17, 4, 16, generator=gen).requires_grad_()
    k = torch.randn(2, 33, 2, 16, generator=gen).requires_grad_()
    v = torch.randn(2, 33, 2, 16, generator=gen).requires_grad_()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))

    def err(a, b):
        return (a.detach().double() - b.detach().double()).abs().max().item()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = {{}}
        for causal in (False, True):
            out = flashtile.flash_attn_func(q, k, v, causal=causal)
            grads = torch.autograd.grad(out.square().sum(), (q, k, v))
            out_ref = naive_attention(q64, k64, v64, causal=causal)[0]
            grads_ref = torch.autograd.grad(out_ref.square().sum(), (q64, k64, v64))
            out_pt = naive_attention(q, k, v, causal=causal)[0]
            grads_pt = torch.autograd.grad(out_pt.square().sum(), (q, k, v))
            for name, a, r, p in zip(("out", "dq", "dk", "dv"), (out,) + grads, (out_ref,) + grads_ref,
                                     (out_pt,) + grads_pt):
                results[f"{{name}}-causal{{causal}}"] = (err(a, r), err(p, r), bool(torch.isfinite(a).all()))
    print(json.dumps(dict(
        interpreting=configs.INTERPRETING,
        warnings=[(w.category.__name__, str(w.message)) for w in caught
                  if "flashtile" in str(w.message)],
        results=results,
    )))
""")


@pytest.mark.parametrize("interpret", [pytest.param(None, id="TRITON_INTERPRET-unset"),
                                       pytest.param("0", id="TRITON_INTERPRET-0")])
def test_cpu_fallback_without_interpreter(interpret, seed):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    if interpret is not None:
        env["TRITON_INTERPRET"] = interpret
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    proc = subprocess.run([sys.executable, "-c", _FALLBACK_SCRIPT.format(seed=seed)], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["interpreting"] is False
    # Two forwards and two backwards, one warning.
    assert len(report["warnings"]) == 1, report["warnings"]
    category, message = report["warnings"][0]
    assert category == "UserWarning"
    assert "pure-PyTorch reference" in message and "TRITON_INTERPRET=1" in message
    for name, (err, base, finite) in report["results"].items():
        assert finite, f"{name} has non-finite entries"
        assert err <= K * base + FP32_ATOL, f"{name}: max error {err:.3e} > {K} x PyTorch's {base:.3e} + atol"


def test_inference_calls_skip_autograd_function(monkeypatch):
    """An eager call with nothing to differentiate (no input requires grad, or grad mode off) runs the forward
    without _ops._AttnFunction (_needs_grad); a call that does gets it, its gradient intact. Outputs are the same
    either way."""
    from flashtile import _ops
    applied = []
    real = _ops._AttnFunction.apply
    monkeypatch.setattr(_ops._AttnFunction, "apply", lambda *a: applied.append(1) or real(*a))
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 37, 2, 32, generator=gen) for _ in range(3))
    plain = flashtile.flash_attn_func(q, k, v, causal=True)
    assert applied == [] and plain.grad_fn is None and not plain.requires_grad
    qg = q.clone().requires_grad_()
    with torch.no_grad():
        off = flashtile.flash_attn_func(qg, k, v, causal=True)
    assert applied == [] and off.grad_fn is None
    on = flashtile.flash_attn_func(qg, k, v, causal=True)
    assert applied == [1] and on.grad_fn is not None
    assert torch.equal(plain, off) and torch.equal(plain, on.detach())
    (dq,) = torch.autograd.grad(on.sum(), qg)
    assert dq.shape == q.shape and torch.isfinite(dq).all()
    # Forward-mode AD: a dual input reaches _AttnFunction (which refuses it: the safety catalog's
    # transform/forward_ad_dual); once its level is left it has no tangent, and the call is an inference one again.
    import torch.autograd.forward_ad as fwAD
    with fwAD.dual_level():
        dual = fwAD.make_dual(q, torch.ones_like(q))
        with pytest.raises(RuntimeError, match="(?i)forward-mode"):
            flashtile.flash_attn_func(dual, k, v, causal=True)
    assert applied == [1, 1]
    assert torch.equal(flashtile.flash_attn_func(dual, k, v, causal=True), plain) and applied == [1, 1]
