"""Checks at the public boundary. Each error names the bad value and says how to fix it."""
import math

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Head dims: multiples of 8 (16-byte rows in half precision, what TMA and vector loads need) up to 256 (the
# largest tile that fits the per-program shared memory and registers of the kernels).
HEAD_DIM_MULTIPLE = 8
MAX_HEAD_DIM = 256


def _check_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")


def check_qkv(q, k, v, layout="bshd"):
    """Validate attention inputs. layout "bshd": (batch, seqlen, heads, headdim), flash-attn's;
    "bhsd": (batch, heads, seqlen, headdim), torch SDPA's. Returns nothing; raises TypeError/ValueError."""
    names = ("q", "k", "v") if layout == "bshd" else ("query", "key", "value")
    dims = "(batch, seqlen, heads, headdim)" if layout == "bshd" else "(batch, heads, seqlen, headdim)"
    for name, t in zip(names, (q, k, v)):
        _check_tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D {dims}, got shape {tuple(t.shape)} ({t.dim()}-D); "
                             f"add the missing batch or head dimension with unsqueeze, or reshape.")
    for name, t in zip(names, (q, k, v)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; flashtile supports float16, bfloat16 and float32: "
                            f"convert it with .to(torch.bfloat16) (or float16/float32).")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{names[0]}, {names[1]}, {names[2]} must share one dtype, got {q.dtype}, {k.dtype}, "
                        f"{v.dtype}; convert them to one dtype with .to(...).")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{names[0]}, {names[1]}, {names[2]} must be on one device, got {q.device}, {k.device}, "
                         f"{v.device}; move them with .to(device).")
    if q.device.type not in ("cuda", "cpu"):
        raise ValueError(f"flashtile runs on CUDA GPUs (and on the CPU for testing), got device {q.device}.")

    def bshd(t):  # (batch, seqlen, heads, headdim) view of the shape
        return tuple(t.shape) if layout == "bshd" else (t.shape[0], t.shape[2], t.shape[1], t.shape[3])

    (b, sq, hq, d), (bk, sk, hk, dk), (bv, sv, hv, dv) = bshd(q), bshd(k), bshd(v)
    for name, t in zip(names, (q, k, v)):
        if t.numel() == 0:
            raise ValueError(f"{name} is empty (shape {tuple(t.shape)}); every dimension of {dims} must be at "
                             f"least 1.")
    if not (b == bk == bv):
        raise ValueError(f"batch sizes differ: {names[0]} {b}, {names[1]} {bk}, {names[2]} {bv}; "
                         f"they must be equal.")
    if sk != sv:
        raise ValueError(f"{names[1]} has seqlen {sk} but {names[2]} has {sv}; keys and values must have the "
                         f"same sequence length.")
    if hk != hv:
        raise ValueError(f"{names[1]} has {hk} heads but {names[2]} has {hv}; keys and values must have the "
                         f"same number of heads.")
    if d != dk or d != dv:
        raise ValueError(f"head dims differ: {names[0]} {d}, {names[1]} {dk}, {names[2]} {dv}; this version needs "
                         f"one head dim for q, k and v.")
    if d % HEAD_DIM_MULTIPLE or d > MAX_HEAD_DIM:
        raise ValueError(f"head dim {d} is not supported: it must be a multiple of {HEAD_DIM_MULTIPLE} and at most "
                         f"{MAX_HEAD_DIM}; pad the head dim with zeros to the next multiple of {HEAD_DIM_MULTIPLE}.")
    if hq % hk:
        raise ValueError(f"{names[0]} has {hq} heads but {names[1]}/{names[2]} have {hk}; the number of query heads "
                         f"must be a multiple of the number of key/value heads (grouped-query attention).")
    for name, t in zip(names, (q, k, v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}'s last dimension (headdim) must be contiguous, got stride {t.stride(-1)}; "
                             f"call {name}.contiguous() first.")


def resolve_scale(softmax_scale, head_dim, name="softmax_scale"):
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"{name} must be a float or None (meaning 1/sqrt(headdim)), got "
                        f"{type(softmax_scale).__name__}.")
    if not math.isfinite(softmax_scale):
        raise ValueError(f"{name} must be finite, got {softmax_scale}.")
    return float(softmax_scale)


def not_built(feature, issue_hint):
    """Options whose feature is not built yet raise instead of being ignored."""
    return NotImplementedError(f"{feature} is not implemented in flashtile yet ({issue_hint}); call without it.")
