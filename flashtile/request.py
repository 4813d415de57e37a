"""The request objects: one attention call (or one KV-cache call), validated once at the public boundary.

A public function (flashtile.interface, flashtile.kvcache) checks its arguments and builds an `AttentionRequest`
(or a `KVCacheRequest`): a frozen dataclass of everything the call asks for besides the input tensors q, k, v,
normalised to one encoding per option (causal is the band's right edge at the diagonal, window_right = 0; a window
wider than the sequences is no window). From there on the request is what travels:

    interface.flash_attn_func(...)  ->  AttentionRequest  ->  _ops (custom op: schema = the request's fields)
        ->  dispatch (which backend runs it, and why)  ->  a kernel launcher (reads the request's fields)

The custom ops' schemas, their fake implementations, the autograd context and the gradient slots are all derived
from the field lists below (`schema`, `flatten`, `unflatten`, `position`), so adding an option is adding a field
(docs/architecture.md, "How to add a feature").
"""
import dataclasses
import typing
from typing import Optional

import torch

# Schema types of the fields, by annotation; a field may name its own with metadata={"schema": ...}.
_SCHEMA_TYPES = {float: "float", bool: "bool", int: "int", Optional[torch.Tensor]: "Tensor?", torch.Tensor: "Tensor"}


class _Fields:
    """Mixin: the op-schema view of a frozen request dataclass."""

    _field_names = ()  # set by _finalize once the dataclass exists (torch.compile cannot trace dataclasses.fields)
    _tensor_fields = ()

    @classmethod
    def field_names(cls):
        return cls._field_names

    @classmethod
    def schema(cls):
        """The fields as torch.library schema arguments: "float softmax_scale, SymInt diagonal_offset, ..."."""
        hints = typing.get_type_hints(cls)
        parts = []
        for f in dataclasses.fields(cls):
            kind = f.metadata.get("schema") or _SCHEMA_TYPES[hints[f.name]]
            default = "" if f.default is dataclasses.MISSING else f"={f.default!r}"
            parts.append(f"{kind} {f.name}{default}")
        return ", ".join(parts)

    @classmethod
    def position(cls, name):
        """Index of a field among the flattened fields (op argument index = number of leading tensors + this)."""
        return cls.field_names().index(name)

    def flatten(self):
        """The field values in declaration order: the op's trailing arguments."""
        return tuple(getattr(self, name) for name in self.field_names())

    @classmethod
    def unflatten(cls, values, named=None):
        """The request from an op's trailing arguments (positional values, then any passed by name)."""
        kwargs = dict(zip(cls.field_names(), values))
        if named:
            kwargs.update(named)
        return cls(**kwargs)

    def tensors(self):
        """(name, tensor) of the tensor fields that are set, as a tuple. A request with none remembers it (requests
        are frozen, and the public functions hand one request to every call with the same options)."""
        if "_no_tensors" in self.__dict__:
            return ()
        found = tuple((name, getattr(self, name)) for name in self._tensor_fields
                      if isinstance(getattr(self, name), torch.Tensor))
        if not found:
            object.__setattr__(self, "_no_tensors", True)  # (a cache beside the fields: not one of them)
        return found


# Attributes kept beside a request's fields (not fields: frozen dataclasses take them by object.__setattr__):
# tensors()'s answer for a request without tensors, and flashtile.dispatch's part of the plan key.
_CACHES = ("_no_tensors", "_plan_key")


def _finalize(cls):
    cls._field_names = tuple(f.name for f in dataclasses.fields(cls))
    hints = typing.get_type_hints(cls)
    # The fields that may hold a tensor (tensors() looks at these only).
    cls._tensor_fields = tuple(name for name in cls._field_names
                               if hints[name] in (torch.Tensor, Optional[torch.Tensor]))
    return cls


@_finalize
@dataclasses.dataclass(frozen=True)
class AttentionRequest(_Fields):
    """One call of flash_attn_func and friends or scaled_dot_product_attention, besides q, k, v.

    softmax_scale: > 0 (the public functions turn a negative or zero scale into a positive one on q).
    diagonal_offset: query i's diagonal is key i + diagonal_offset: Sk - Sq for flash-attn's bottom-right alignment,
        0 for torch's top-left one; unused for varlen batches (each sequence aligns to its own corner).
    window_left / window_right: query i sees key j iff i + offset - left <= j <= i + offset + right; -1 is
        unbounded. Causal is window_right = 0.
    softcap: > 0 turns scores s into softcap * tanh(s / softcap). alibi_slopes: fp32 (H,) or (B, H).
    attn_bias: SDPA's attn_mask, 4-D (size-1 dims broadcast): a float bias or a bool mask (True = attend).
    sinks: fp32 (H,) learnable sink logits. dropout_p, seed: dropout probability and the call's Philox key (int64
        (1,) tensor, drawn from torch's generator; None without dropout).
    cu_seqlens_q / _k, max_seqlen_q / _k: a variable-length batch (int32 (B + 1,) offsets; None otherwise).
    block_table: a paged varlen batch's pages (int32 (B, max_pages); k, v are then (num_pages, page_size, Hk, D)
        caches): key j of sequence b is row j % page_size of page block_table[b, j // page_size]. seqused_k: int32
        (B,) key counts of a paged batch (None: cu_seqlens_k's lengths). Forward only.
    deterministic: the backward must give bit-identical gradients run to run.
    descale: float8_e4m3fn q, k, v (forward only): fp32 (B, Hk, 3) factors, q's, k's and v's, per batch entry (or
        sequence) and kv head: the values are the stored ones times their factor; out is bfloat16.
    """
    softmax_scale: float
    diagonal_offset: int = dataclasses.field(default=0, metadata={"schema": "SymInt"})
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    alibi_slopes: Optional[torch.Tensor] = None
    attn_bias: Optional[torch.Tensor] = None
    sinks: Optional[torch.Tensor] = None
    dropout_p: float = 0.0
    seed: Optional[torch.Tensor] = None
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_k: Optional[torch.Tensor] = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    block_table: Optional[torch.Tensor] = None
    seqused_k: Optional[torch.Tensor] = None
    deterministic: bool = False
    descale: Optional[torch.Tensor] = None

    # Inputs of the forward op that can take a gradient besides q, k, v (the op's backward returns them in this
    # order after the q/k/v gradients).
    GRAD_FIELDS = ("attn_bias", "sinks")

    def with_fields(self, **changes):
        """This request with `changes` (values the caller has checked), without dataclasses.replace's __init__:
        for a request built and checked before (flashtile.interface's FP8 calls swap in each call's descale
        factors). The caches kept beside the fields (tensors(), the plan key's part) are not carried over."""
        new = object.__new__(type(self))
        fields = self.__dict__.copy()
        for cache in _CACHES:
            fields.pop(cache, None)
        fields.update(changes)
        new.__dict__.update(fields)
        return new

    @property
    def causal(self):
        return self.window_right == 0 and self.window_left < 0

    @property
    def mask_left(self):
        return self.window_left >= 0

    @property
    def mask_right(self):
        return self.window_right >= 0

    @property
    def banded(self):
        return self.mask_left or self.mask_right

    @property
    def varlen(self):
        return self.cu_seqlens_q is not None

    @property
    def paged(self):
        return self.block_table is not None

    def describe(self):
        """The options that are on, for messages and `explain`: "causal, softcap=30.0, varlen (batch 3)"."""
        parts = []
        if self.causal:
            parts.append("causal")
        elif self.banded:
            parts.append(f"window=({self.window_left}, {self.window_right})")
        if self.softcap > 0:
            parts.append(f"softcap={self.softcap:g}")
        if self.alibi_slopes is not None:
            parts.append("alibi")
        if self.attn_bias is not None:
            kind = "bool mask" if self.attn_bias.dtype == torch.bool else f"float bias ({self.attn_bias.dtype})"
            parts.append(f"attn_mask: {kind} {tuple(self.attn_bias.shape)}")
        if self.sinks is not None:
            parts.append("sinks")
        if self.dropout_p > 0:
            parts.append(f"dropout_p={self.dropout_p:g}")
        if self.varlen:
            parts.append(f"varlen (batch {self.cu_seqlens_q.numel() - 1})")
        if self.paged:
            parts.append(f"paged ({self.block_table.shape[1]} pages per sequence)")
        if self.deterministic:
            parts.append("deterministic")
        if self.descale is not None:
            parts.append("fp8 (descaled)")
        return ", ".join(parts) or "plain"


@_finalize
@dataclasses.dataclass(frozen=True)
class KVCacheRequest(_Fields):
    """One call of flash_attn_with_kvcache besides q, the cache and the new k, v (flashtile.kvcache validates it).

    cache_seqlens: int32/int64 (B,) lengths before the append, or None when every sequence has cache_seqlen.
    seqlen_new: the number of appended tokens (0 without k, v). Window, softcap, ALiBi, causal as in
    AttentionRequest (causal kept as its own flag here: the decode kernel's rotary position rule depends on it).
    num_splits: split-KV chunks (0 chooses). k_descale / v_descale: fp32 (B, Hk) for an fp8 cache.
    """
    cache_seqlens: Optional[torch.Tensor] = None
    cache_seqlen: int = 0
    seqlen_new: int = 0
    cache_batch_idx: Optional[torch.Tensor] = None
    cache_leftpad: Optional[torch.Tensor] = None
    block_table: Optional[torch.Tensor] = None
    rotary_cos: Optional[torch.Tensor] = None
    rotary_sin: Optional[torch.Tensor] = None
    rotary_interleaved: bool = True
    alibi_slopes: Optional[torch.Tensor] = None
    softmax_scale: float = 1.0
    causal: bool = False
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    num_splits: int = 0
    k_descale: Optional[torch.Tensor] = None
    v_descale: Optional[torch.Tensor] = None


def unbounded_window(window_left, window_right, seqlen_q, seqlen_k):
    """A window that no row of a (seqlen_q, seqlen_k) problem reaches past is no window: (-1, -1) sides for it.

    With bottom-right alignment query i's diagonal is key i + Sk - Sq, so the left bound i + Sk - Sq - left is <= 0
    for every row iff left >= Sk - 1, and the right bound i + Sk - Sq + right is >= Sk - 1 iff right >= Sq - 1.
    Any integer up to 2**63 - 1 is accepted; the kernels then never see one past int32."""
    if window_left >= max(seqlen_k - 1, 0):
        window_left = -1
    if window_right >= max(seqlen_q - 1, 0):
        window_right = -1
    return window_left, window_right
