"""What the kernels need to know about the optional attention features, resolved once on the host.

Each feature is a constexpr of the shared kernels (docs/derivation.md#8): a launch without it compiles none of
its code. `Features` turns the public options into what a launch passes: flags, scalars, and tensors (a
placeholder where a feature is off, since a kernel argument cannot be None and still be indexed).
"""
import dataclasses
from typing import Optional

import torch

# Dropout keeps element (b, h, i, j) iff 31 random bits >= round(p * 2^31) (_common._dropout_keep).
_DROPOUT_BITS = 31

BIAS_NONE, BIAS_FLOAT, BIAS_BOOL = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class KernelArgs:
    alibi: torch.Tensor
    stride_alibi_b: int
    has_alibi: bool
    bias: torch.Tensor
    bias_strides: tuple  # (b, h, i, j); 0 along broadcast dimensions
    bias_kind: int
    sinks: torch.Tensor
    has_sinks: bool
    seed: torch.Tensor
    dropout_threshold: int
    cu_q: torch.Tensor
    cu_k: torch.Tensor


@dataclasses.dataclass(eq=False)
class Features:
    """The options of one attention call, as the kernels see them.

    window_left / window_right: query i sees key j iff j >= i + offset - left and j <= i + offset + right; -1
    means unbounded. Causal is window_right = 0 (the caller folds it in).
    alibi_slopes: fp32 (H,) or (B, H). attn_bias: a float bias or a bool mask (True = attend) of 4 dims, each
    either full or 1 (broadcast). sinks: fp32 (H,). seed: int64 (1,) tensor, drawn by the caller from torch's
    generator. cu_seqlens_q / _k: int32 (B + 1,) for variable-length batches.
    """
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
    _maps: dict = dataclasses.field(default_factory=dict)

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
    def bias_kind(self):
        if self.attn_bias is None:
            return BIAS_NONE
        return BIAS_BOOL if self.attn_bias.dtype == torch.bool else BIAS_FLOAT

    def variant(self):
        """The constexpr flags, for the launch cache's key."""
        return (self.mask_left, self.mask_right, self.softcap > 0, self.alibi_slopes is not None, self.bias_kind,
                self.sinks is not None, self.dropout_p > 0, self.varlen)

    def kernel_args(self, q):
        placeholder = q.new_empty((1,), dtype=torch.float32)
        alibi, stride_alibi_b = placeholder, 0
        if self.alibi_slopes is not None:
            alibi = self.alibi_slopes
            stride_alibi_b = alibi.stride(0) if alibi.dim() == 2 else 0
        bias, bias_strides = placeholder, (0, 0, 0, 0)
        if self.attn_bias is not None:
            bias = self.attn_bias.view(torch.uint8) if self.attn_bias.dtype == torch.bool else self.attn_bias
            bias_strides = tuple(st if n > 1 else 0 for st, n in zip(bias.stride(), bias.shape))
        seed = self.seed if self.dropout_p > 0 else q.new_zeros((1,), dtype=torch.int64)
        threshold = min(round(self.dropout_p * 2 ** _DROPOUT_BITS), 2 ** _DROPOUT_BITS - 1)
        cu_placeholder = q.new_zeros((1,), dtype=torch.int32)
        return KernelArgs(
            alibi=alibi, stride_alibi_b=stride_alibi_b, has_alibi=self.alibi_slopes is not None,
            bias=bias, bias_strides=bias_strides, bias_kind=self.bias_kind,
            sinks=self.sinks if self.sinks is not None else placeholder, has_sinks=self.sinks is not None,
            seed=seed, dropout_threshold=threshold,
            cu_q=self.cu_seqlens_q if self.varlen else cu_placeholder,
            cu_k=self.cu_seqlens_k if self.varlen else cu_placeholder,
        )

    def block_map(self, block_m, block_n, transpose, seqlen_q=None, seqlen_k=None):
        """For an attn_bias: int8 map [B|1, H|1, query block, key block] (transpose: [.., key block, query
        block]) of tiles holding any attended element (True, or a float > -inf); the kernels skip the others.
        Returns (map or None, (stride_b, stride_h, stride_row)), strides 0 along broadcast dims."""
        if self.attn_bias is None:
            return None, (0, 0, 0)
        key = (block_m, block_n, transpose)
        if key not in self._maps:
            bias = self.attn_bias
            b, h, sq, sk = bias.shape
            sq, sk = (seqlen_q or sq), (seqlen_k or sk)
            visible = bias if bias.dtype == torch.bool else bias > float("-inf")
            visible = visible.expand(b, h, sq, sk)
            nm, nn = -(-sq // block_m), -(-sk // block_n)
            padded = visible.new_zeros((b, h, nm * block_m, nn * block_n))
            padded[:, :, :sq, :sk] = visible
            tiles = padded.view(b, h, nm, block_m, nn, block_n).any(dim=5).any(dim=3).to(torch.int8)
            if transpose:
                tiles = tiles.transpose(2, 3)
            tiles = tiles.contiguous()
            strides = (tiles.stride(0) if b > 1 else 0, tiles.stride(1) if h > 1 else 0, tiles.stride(2))
            self._maps[key] = (tiles, strides)
        return self._maps[key]
