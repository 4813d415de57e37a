"""The one registry of attention providers and benchmark shapes.

Every provider takes the same canonical inputs, q: [B, Sq, H, D], k/v: [B, Sk, Hk, D], and returns a `Prepared`:
its own copies of the inputs in its layout (made here, outside any timed region), a forward callable, and how to
bring its output back to [B, Sq, H, D] for the correctness check. The bench builds the backward from the forward
(`out.backward(dout, retain_graph=True)` on a graph built once), so every provider is timed the same way.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import os
import sys
from dataclasses import dataclass, field
from typing import Callable, ContextManager

import torch

# The standard suite: batch * seqlen tokens at a fixed model width (FlashAttention-2/3 papers' setup).
TOTAL_TOKENS = 16 * 1024
HIDDEN = 2048
STANDARD_SEQLENS = (1024, 4096, 16384)
STANDARD_HEADDIMS = (64, 128, 256)
QUICK_SEQLENS = (16384,)
QUICK_HEADDIMS = (64, 128)
MODES = ("fwd", "bwd")


@dataclass(frozen=True)
class Shape:
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    heads_k: int
    headdim: int
    causal: bool
    # v's (and the output's) head dim when it differs from q's and k's (MLA's 192/128, say); None: headdim.
    headdim_v: int | None = field(default=None, kw_only=True)

    @property
    def dv(self) -> int:
        return self.headdim if self.headdim_v is None else self.headdim_v

    @property
    def label(self) -> str:
        seq = _short(self.seqlen_q)
        if self.seqlen_k != self.seqlen_q:
            seq += f"x{_short(self.seqlen_k)}"
        heads = f"H{self.heads}" if self.heads == self.heads_k else f"H{self.heads}/{self.heads_k}"
        dims = f"{self.headdim}" if self.dv == self.headdim else f"{self.headdim}/{self.dv}"
        return f"B{self.batch} {heads} S{seq} D{dims}{' causal' if self.causal else ''}"


def _short(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def standard_shapes(seqlens=STANDARD_SEQLENS, headdims=STANDARD_HEADDIMS, causals=(False, True),
                    total_tokens: int = TOTAL_TOKENS, hidden: int = HIDDEN,
                    headdim_v: int | None = None, heads: int | None = None) -> list[Shape]:
    """batch = total_tokens / seqlen (at least 1), heads = hidden / headdim (or `heads` at every head dim, hidden
    then unused); ordered seqlen, headdim, causal. headdim_v: v's head dim in every shape (None: each shape's
    headdim)."""
    if heads is not None and heads < 1:
        raise ValueError(f"--heads must be at least 1, got {heads}")
    shapes = []
    for seqlen in seqlens:
        for headdim in headdims:
            if heads is None and hidden % headdim:
                raise ValueError(f"headdim {headdim} does not divide the hidden size {hidden}; "
                                 f"pick a headdim among the divisors of {hidden} (64, 128, 256, ...), a hidden "
                                 f"size it divides (--hidden 1536 for headdim 96), or a number of heads (--heads 16).")
            n_heads = heads if heads is not None else hidden // headdim
            for causal in causals:
                shapes.append(Shape(max(1, total_tokens // seqlen), seqlen, seqlen, n_heads, n_heads, headdim, causal,
                                    headdim_v=None if headdim_v == headdim else headdim_v))
    return shapes


# ----------------------------------------------------------------------------------------------------------------
# Providers


class Unsupported(Exception):
    """A provider cannot run this shape by design (reported as skipped with the reason, not as an error)."""


@dataclass
class Prepared:
    fwd: Callable[[], torch.Tensor]               # runs the attention, returns the output in the provider's layout
    inputs: tuple[torch.Tensor, ...]             # the provider's leaves (require grad): grads reset between runs
    to_bshd: Callable[[torch.Tensor], torch.Tensor] = lambda o: o
    context: Callable[[], ContextManager] = contextlib.nullcontext   # entered around the check and the timing
    settle: Callable[[], None] = lambda: None    # after the first call: waits for work it left in the background


@dataclass
class Provider:
    name: str
    description: str
    _available: Callable[[], str | None]          # None when usable, else why not
    _prepare: Callable[..., Prepared]
    version: Callable[[], str | None] = field(default=lambda: None)

    def available(self) -> str | None:
        """None if the provider can run here, otherwise the reason it cannot."""
        try:
            return self._available()
        except Exception as exc:  # an import that fails in an unexpected way is a reason, reported as such
            return f"{type(exc).__name__}: {exc}"

    def prepare(self, q, k, v, causal: bool, softmax_scale: float) -> Prepared:
        return self._prepare(q, k, v, causal, softmax_scale)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(True)


def _bhsd_leaf(t: torch.Tensor) -> torch.Tensor:
    # [B, S, H, D] -> contiguous [B, H, S, D]; a copy, made once outside the timed region.
    return t.detach().transpose(1, 2).contiguous().requires_grad_(True)


def _bhsd_to_bshd(o: torch.Tensor) -> torch.Tensor:
    return o.transpose(1, 2)


def _needs_cuda() -> str | None:
    return None if torch.cuda.is_available() else "no CUDA device"


def dist_version(*names: str) -> str | None:
    """The installed version of the first of these distributions that is installed, or None."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


# flashtile ------------------------------------------------------------------------------------------------------

def _flashtile_available() -> str | None:
    try:
        import flashtile
    except ImportError as exc:
        return f"flashtile not importable: {exc}"
    if not hasattr(flashtile, "flash_attn_func"):
        return "flashtile has no flash_attn_func yet"
    return _needs_cuda()


def _flashtile_prepare(q, k, v, causal, scale) -> Prepared:
    import flashtile

    q, k, v = _leaf(q), _leaf(k), _leaf(v)
    return Prepared(lambda: flashtile.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal), (q, k, v),
                    settle=flashtile.wait_for_compiles)


@contextlib.contextmanager
def _gluon_forward_off():
    """The Hopper Gluon forward switched off for the duration (SETTINGS.gluon_forward)."""
    from flashtile import _settings

    with _settings.override(gluon_forward=False):
        yield


def _flashtile_portable_prepare(q, k, v, causal, scale) -> Prepared:
    """flashtile with the Hopper Gluon kernels switched off: the portable Triton kernels only. The forward's switch
    is flipped around the call; deterministic=True keeps the backward (run later by autograd) off the Gluon
    kernel, whose dQ reduction is not deterministic."""
    import flashtile

    q, k, v = _leaf(q), _leaf(k), _leaf(v)

    def fwd():
        with _gluon_forward_off():
            return flashtile.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, deterministic=True)
    return Prepared(fwd, (q, k, v), settle=flashtile.wait_for_compiles)


# torch SDPA (cuDNN and FlashAttention-2 backends) ---------------------------------------------------------------

def _sdpa_available(backend_name: str) -> Callable[[], str | None]:
    def available() -> str | None:
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
        except ImportError as exc:
            return f"torch.nn.attention.sdpa_kernel needs torch >= 2.3: {exc}"
        if not hasattr(SDPBackend, backend_name):
            return f"this torch has no SDPBackend.{backend_name}"
        return _needs_cuda()
    return available


def _sdpa_prepare(backend_name: str) -> Callable[..., Prepared]:
    def prepare(q, k, v, causal, scale) -> Prepared:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        sq, sk = q.shape[1], k.shape[1]
        if causal and sq != sk:
            raise Unsupported("SDPA's is_causal aligns the mask top-left when seqlen_q != seqlen_k "
                              "(flashtile aligns bottom-right)")
        if backend_name == "FLASH_ATTENTION" and v.shape[-1] != q.shape[-1]:
            raise Unsupported("SDPA's flash backend needs one head dim for q, k and v")
        gqa = q.shape[2] != k.shape[2]
        q, k, v = _bhsd_leaf(q), _bhsd_leaf(k), _bhsd_leaf(v)
        kwargs = {"enable_gqa": True} if gqa else {}

        def fwd():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                                                    **kwargs)
        # sdpa_kernel sets global flags; entering it once around the whole measurement keeps its Python cost out
        # of the timing. The backward kernel is fixed when the forward runs, so it follows the same backend.
        return Prepared(fwd, (q, k, v), _bhsd_to_bshd, lambda: sdpa_kernel(getattr(SDPBackend, backend_name)))
    return prepare


# FlexAttention ---------------------------------------------------------------------------------------------------

_FLEX = {}


def _flex_available() -> str | None:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError as exc:
        return f"torch.nn.attention.flex_attention needs torch >= 2.5: {exc}"
    return _needs_cuda()


def _flex_compiled():
    """flex_attention compiled once, with dynamo's recompile limits raised: past the default limit (8) dynamo
    silently runs the unfused eager implementation (~15 TFLOP/s), which would be benchmarked instead."""
    if "fn" not in _FLEX:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        config = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                     "accumulated_cache_size_limit"):
            if hasattr(config, name):
                setattr(config, name, max(getattr(config, name), 1 << 16))
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def _flex_block_mask(seqlen_q: int, seqlen_k: int, device):
    """Bottom-right causal block mask, built once per (Sq, Sk, device)."""
    key = ("mask", seqlen_q, seqlen_k, str(device))
    if key not in _FLEX:
        from torch.nn.attention.flex_attention import create_block_mask

        offset = seqlen_k - seqlen_q

        def causal_mask(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + offset

        _FLEX[key] = create_block_mask(causal_mask, B=None, H=None, Q_LEN=seqlen_q, KV_LEN=seqlen_k, device=device)
    return _FLEX[key]


def _flex_prepare(q, k, v, causal, scale) -> Prepared:
    flex = _flex_compiled()
    block_mask = _flex_block_mask(q.shape[1], k.shape[1], q.device) if causal else None
    gqa = q.shape[2] != k.shape[2]
    q, k, v = _bhsd_leaf(q), _bhsd_leaf(k), _bhsd_leaf(v)
    return Prepared(lambda: flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa), (q, k, v),
                    _bhsd_to_bshd)


# FlashAttention-2 (flash-attn 2.x) -------------------------------------------------------------------------------

def _fa2_available() -> str | None:
    try:
        import flash_attn
    except ImportError as exc:
        return f"flash_attn not importable: {exc}"
    version = getattr(flash_attn, "__version__", None)
    if not hasattr(flash_attn, "flash_attn_func") or not str(version).startswith("2."):
        return (f"flash_attn (version {version}) is not flash-attn 2.x: with only flash-attn-4 installed, "
                "flash_attn is FA4's namespace package")
    return _needs_cuda()


def _fa2_prepare(q, k, v, causal, scale) -> Prepared:
    from flash_attn import flash_attn_func

    if v.shape[-1] != q.shape[-1]:
        raise Unsupported("flash-attn 2 needs one head dim for q, k and v")
    q, k, v = _leaf(q), _leaf(k), _leaf(v)
    return Prepared(lambda: flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=scale, causal=causal), (q, k, v))


# FlashAttention-4 (flash-attn-4, CuTe DSL) -----------------------------------------------------------------------

def _fa4_import():
    """`flash_attn.cute.flash_attn_func`. The cutlass DSL puts its packages on sys.path from a .pth file, which
    `pip install --target DIR` does not run; add that directory here when nvidia_cutlass_dsl is importable."""
    try:
        from flash_attn.cute import flash_attn_func
        return flash_attn_func
    except ImportError as first:
        try:
            import nvidia_cutlass_dsl
        except ImportError:
            raise first from None
        added = False
        for root in nvidia_cutlass_dsl.__path__:
            dsl = os.path.join(root, "dsl_packages")
            if os.path.isdir(dsl) and dsl not in sys.path:
                sys.path.insert(0, dsl)
                added = True
        if not added:
            raise
        importlib.invalidate_caches()
        from flash_attn.cute import flash_attn_func
        return flash_attn_func


def _fa4_available() -> str | None:
    try:
        _fa4_import()
    except ImportError as exc:
        return f"flash_attn.cute (flash-attn-4) not importable: {exc}"
    return _needs_cuda()


def _fa4_prepare(q, k, v, causal, scale) -> Prepared:
    fa4 = _fa4_import()
    q, k, v = _leaf(q), _leaf(k), _leaf(v)

    def fwd():
        # FA4's 4th positional argument is qv, so pass by keyword; it returns (out, lse).
        res = fa4(q, k, v, softmax_scale=scale, causal=causal)
        return res[0] if isinstance(res, tuple) else res
    return Prepared(fwd, (q, k, v))


PROVIDERS: dict[str, Provider] = {p.name: p for p in [
    Provider("flashtile", "flashtile.flash_attn_func (Gluon on Hopper, else Triton), [B, S, H, D]",
             _flashtile_available, _flashtile_prepare,
             lambda: dist_version("flashtile") or getattr(importlib.import_module("flashtile"), "__version__", None)),
    Provider("flashtile-triton", "flashtile with its Gluon kernels off (the portable Triton path)",
             _flashtile_available, _flashtile_portable_prepare, lambda: None),
    Provider("sdpa-cudnn", "torch SDPA, SDPBackend.CUDNN_ATTENTION, [B, H, S, D]", _sdpa_available("CUDNN_ATTENTION"),
             _sdpa_prepare("CUDNN_ATTENTION"),
             lambda: str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else None),
    Provider("sdpa-flash", "torch SDPA, SDPBackend.FLASH_ATTENTION (FA2 inside torch), [B, H, S, D]",
             _sdpa_available("FLASH_ATTENTION"), _sdpa_prepare("FLASH_ATTENTION"), lambda: torch.__version__),
    Provider("flex", "torch FlexAttention, compiled once (dynamic=False), causal as a block mask, [B, H, S, D]",
             _flex_available, _flex_prepare, lambda: torch.__version__),
    Provider("fa2", "flash_attn.flash_attn_func (flash-attn 2.x), [B, S, H, D]", _fa2_available, _fa2_prepare,
             lambda: dist_version("flash-attn", "flash_attn")),
    Provider("fa4", "flash_attn.cute.flash_attn_func (flash-attn-4, CuTe DSL), [B, S, H, D]", _fa4_available,
             _fa4_prepare, lambda: dist_version("flash-attn-4")),
]}
