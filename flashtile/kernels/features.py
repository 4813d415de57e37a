"""What the kernels need to know about the optional attention features, resolved once on the host.

Each feature is a constexpr of the shared kernels (docs/derivation.md#8): a launch without it compiles none of
its code. `Features` turns the public options into what a launch passes: flags, scalars, and tensors (a
placeholder where a feature is off, since a kernel argument cannot be None and still be indexed).
"""
import dataclasses
import functools
import weakref
from typing import Optional

import torch

from . import _common, configs
from ._common import Alibi, Band, Bias, Blocks, CuSeqlens, Flags, Paged
from ..reference.dropout import dropout_threshold  # the bits _common._dropout_keep compares


# What attn_mask holds: the BIAS constexpr of every kernel, portable and Gluon (_common.BIAS_*).
BIAS_NONE, BIAS_FLOAT, BIAS_BOOL = _common.BIAS_NONE.value, _common.BIAS_FLOAT.value, _common.BIAS_BOOL.value


@dataclasses.dataclass(frozen=True)
class KernelArgs:
    """The portable kernels' feature arguments (_common's groups), placeholders where a feature is off."""
    flags: Flags  # the feature constexprs; BLOCK_SKIP and DBIAS are the launch's to set
    alibi: Alibi
    bias: Bias  # strides (b, h, i, j), 0 along broadcast dimensions; a bool mask viewed as uint8
    cu_seqlens: CuSeqlens
    no_blocks: Blocks  # stands in for Features.block_lists without a bool mask
    sinks: torch.Tensor
    seed: torch.Tensor
    dropout_threshold: int
    paged: Optional[Paged]
    descale: torch.Tensor  # FP8: fp32 (B, Hk, 3) factors of q, k, v

    def with_offsets(self, cu_seqlens_q, cu_seqlens_k):
        """These arguments with another call's varlen offsets (its other fields equal: a plan's calls whose
        requests hold no other tensor), without the dataclass's __init__."""
        new = object.__new__(KernelArgs)
        new.__dict__.update(self.__dict__, cu_seqlens=self.cu_seqlens._replace(q=cu_seqlens_q, k=cu_seqlens_k))
        return new


class Features:
    """The kernels' view of one AttentionRequest (flashtile/request.py): what a launch derives from it (the BIAS and
    SOFTCAP constexprs, the feature arguments with placeholders, a bool mask's block lists). The request's own
    fields are read from `req`."""
    __slots__ = ("req", "_maps")

    def __init__(self, req):
        self.req = req
        self._maps = {}  # block lists of this call, by tiles (block_lists)

    @property
    def band(self):
        return Band(self.req.window_left, self.req.window_right)

    @property
    def bias_kind(self):
        if self.req.attn_bias is None:
            return BIAS_NONE
        return BIAS_BOOL if self.req.attn_bias.dtype == torch.bool else BIAS_FLOAT

    def softcap_mode(self, dtype):
        """SOFTCAP constexpr: 0 off; 2 the hardware tanh approximation for 16-bit inputs on a GPU; 1 the exact
        tanh (fp32, and the interpreter, which runs no inline assembly)."""
        if self.req.softcap <= 0:
            return 0
        return 1 if dtype == torch.float32 or configs.INTERPRETING else 2

    def variant(self):
        """The constexpr flags, for the launch cache's key."""
        req = self.req
        return (req.mask_left, req.mask_right, req.softcap > 0, req.alibi_slopes is not None, self.bias_kind,
                req.sinks is not None, req.dropout_p > 0, req.varlen, req.paged, req.descale is not None)

    def _bias_tma_ok(self, use_tma, seqlen_q, seqlen_k):
        """Whether attn_mask tiles can be TMA loads: a Hopper launch, full (not broadcast) query and key dims with
        a unit key stride, and 16-byte aligned base and strides."""
        bias = self.req.attn_bias
        if not use_tma or bias is None or self.req.varlen or tuple(bias.shape[2:]) != (seqlen_q, seqlen_k):
            return False
        size = bias.element_size()
        strides = [st for st, n in zip(bias.stride()[:3], bias.shape[:3]) if n > 1]
        # The rows' stride is a descriptor stride, and TMA takes no 0 there (a mask expanded along queries); batch
        # and head strides only offset the base (the Gluon kernels' descriptor narrows expanded ones to size 1).
        return (bias.stride(3) == 1 and bias.stride(2) != 0 and bias.data_ptr() % configs.TMA_ALIGN_BYTES == 0
                and all(st * size % configs.TMA_ALIGN_BYTES == 0 for st in strides))

    def gluon_bias_ok(self, dtype, seqlen_q, seqlen_k):
        """Whether the Hopper Gluon kernels can read attn_mask: a bool mask or a float bias of the inputs' dtype
        whose tiles TMA can load (_bias_tma_ok: full along queries and keys, 16-byte aligned)."""
        bias = self.req.attn_bias
        return (bias is not None and bias.dtype in (torch.bool, dtype)
                and self._bias_tma_ok(True, seqlen_q, seqlen_k))

    def alibi_args(self, placeholder):
        """(slopes, batch stride): the (H,) or (B, H) slopes and 0 or their batch stride; the placeholder (never
        read) and 0 without ALiBi."""
        alibi = self.req.alibi_slopes
        if alibi is None:
            return placeholder, 0
        return alibi, alibi.stride(0) if alibi.dim() == 2 else 0

    def paged_args(self, k, v, seqlen_k):
        """_common.Paged of a paged request (k, v its caches; seqlen_k the launch's max_seqlen_k), else None (a
        constexpr: the other launches' kernels take no parameter for it, so their code is unchanged). Without
        seqused_k the key counts are cu_seqlens_k's lengths (computed on the device)."""
        req = self.req
        if not req.paged:
            return None
        used = req.seqused_k
        if used is None:
            used = req.cu_seqlens_k[1:] - req.cu_seqlens_k[:-1]
        limit = min(req.block_table.shape[1] * k.shape[1], seqlen_k)
        return Paged(req.block_table, req.block_table.stride(0), k.shape[0], limit, used, k.stride(0), v.stride(0))

    def kernel_args(self, q, use_tma=False, seqlen_q=0, seqlen_k=0, total_k=0, kv=None):
        """KernelArgs of a launch on q's device and dtype; use_tma: the launch reads its tiles by TMA (an attn_mask
        then does too where _bias_tma_ok); seqlen_q / seqlen_k: the launch's lengths; total_k: a varlen batch's
        number of key rows (q's come from q); kv: (k, v), which a paged request's launch needs."""
        placeholder, seed_placeholder, cu_placeholder = _placeholders(q.device)
        bias, bias_strides = placeholder, (0, 0, 0, 0)
        mask = self.req.attn_bias
        if mask is not None:
            bias = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
            bias_strides = tuple(st if n > 1 else 0 for st, n in zip(bias.stride(), bias.shape))
        flags = Flags(MASK_LEFT=self.req.mask_left, MASK_RIGHT=self.req.mask_right, SOFTCAP=self.softcap_mode(q.dtype),
                      HAS_ALIBI=self.req.alibi_slopes is not None, BIAS=self.bias_kind,
                      BIAS_TMA=self._bias_tma_ok(use_tma, seqlen_q, seqlen_k), HAS_SINKS=self.req.sinks is not None,
                      DROPOUT=self.req.dropout_p > 0, VARLEN=self.req.varlen, PAGED=self.req.paged,
                      PAGE_SIZE=kv[0].shape[1] if self.req.paged else 0, FP8=self.req.descale is not None)
        if self.req.varlen:
            cu = CuSeqlens(self.req.cu_seqlens_q, self.req.cu_seqlens_k, q.shape[0], total_k)
        else:
            cu = CuSeqlens(cu_placeholder, cu_placeholder)
        return KernelArgs(
            flags=flags, alibi=Alibi(*self.alibi_args(placeholder)), bias=Bias(bias, bias_strides), cu_seqlens=cu,
            no_blocks=Blocks(cu_placeholder, cu_placeholder, (0, 0), 0),
            sinks=self.req.sinks if self.req.sinks is not None else placeholder,
            seed=self.req.seed if self.req.dropout_p > 0 else seed_placeholder,
            dropout_threshold=dropout_threshold(self.req.dropout_p),
            paged=self.paged_args(*(kv or (None, None)), seqlen_k),
            descale=self.req.descale if self.req.descale is not None else placeholder)

    def block_lists(self, block_m, block_n, transpose, seqlen_q, seqlen_k, mark_full=False):
        """For a bool attn_mask, which tiles to visit: per (batch|1, head|1, resident block), the number of
        streamed blocks that hold any attended element and their indices, ascending (FlexAttention's block-sparse
        iteration: the kernel loops over the list, so fully masked tiles cost nothing and the loop stays a plain
        pipelined loop). transpose: resident key blocks, streamed query blocks (the dK/dV kernel). mark_full: the
        tiles the mask leaves entirely visible are listed as -1 - index (a kernel may skip reading the mask
        there). Lists are kept across calls for the same mask until it is written in place (_mask_lists).

        Returns None without a bool mask, else _common.Blocks (counts int32 [B|1, H|1, R], indices int32
        [B|1, H|1, R, C], (stride_b, stride_h) of the counts (0 along broadcast dims), C)."""
        if self.bias_kind != BIAS_BOOL:
            return None
        key = (block_m, block_n, transpose, mark_full)
        if key not in self._maps:
            mask = self.req.attn_bias
            shared = _mask_lists(mask)
            shared_key = key + (seqlen_q, seqlen_k, mask.storage_offset(), tuple(mask.shape), mask.stride())
            if shared is not None and shared_key in shared:
                self._maps[key] = shared[shared_key]
                return self._maps[key]
            b, h = mask.shape[:2]
            tiles, full = _tile_flags(mask, block_m, block_n, seqlen_q, seqlen_k, mark_full)
            if transpose:
                tiles = tiles.transpose(2, 3)
                full = full.transpose(2, 3) if mark_full else None
            counts = tiles.sum(dim=-1, dtype=torch.int32).contiguous()
            # A stable descending sort of the 0/1 flags puts the visited blocks first, in ascending order.
            indices = torch.sort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).indices
            if mark_full:
                indices = torch.where(torch.gather(full, -1, indices), -1 - indices, indices)
            indices = indices.to(torch.int32).contiguous()
            rows = counts.shape[-1]
            strides = (h * rows if b > 1 else 0, rows if h > 1 else 0)
            self._maps[key] = Blocks(counts, indices, strides, indices.shape[-1])
            if shared is not None:
                shared[shared_key] = self._maps[key]
        return self._maps[key]


# Block lists of bool masks kept across calls (Features.block_lists): a training loop passes the same mask every
# step, and building the lists reads all of it (256 MiB for one 16k x 16k mask, twice per step: the forward's and
# the backward's lists). Entries belong to the mask's root tensor (the user's tensor, of which the call sees a
# view) and hold only while its version counter, which every in-place write to it or to any of its views advances,
# is unchanged; the entry goes when the root is freed (a weak reference: the cache keeps no mask alive). At most
# MASK_LISTS_ROOTS masks are kept, the oldest dropped first.
MASK_LISTS_ROOTS = 8
_mask_lists_cache = {}  # id(root) -> (weak reference to root, version, {key: lists})


def _mask_lists(mask):
    """The cross-call dict of block lists for this bool mask at its current version (emptied when the mask was
    written since), or None where none is kept: inference tensors have no version counter to tell."""
    if mask.is_inference():
        return None
    root = mask._base if mask._base is not None else mask
    version = mask._version  # (a view shares its root's counter)
    entry = _mask_lists_cache.get(id(root))
    if entry is None or entry[0]() is not root or entry[1] != version:
        if entry is None or entry[0]() is not root:
            while len(_mask_lists_cache) >= MASK_LISTS_ROOTS:
                _mask_lists_cache.pop(next(iter(_mask_lists_cache)))
        entry = (weakref.ref(root, functools.partial(_forget_mask, id(root))), version, {})
        _mask_lists_cache[id(root)] = entry
    return entry[2]


def _forget_mask(key, ref):
    """Weak-reference callback: the mask is gone, and so is its entry (unless the id already names a newer one)."""
    entry = _mask_lists_cache.get(key)
    if entry is not None and entry[0] is ref:
        del _mask_lists_cache[key]


@functools.lru_cache(maxsize=None)
def _placeholders(device):
    """Stand-ins for absent tensor arguments (fp32, int64 and int32): a kernel takes their pointers but never reads
    or writes them while the feature's flag is off. Made once per device (a call would otherwise pay for three
    allocations and two fills)."""
    return (torch.zeros((1,), dtype=torch.float32, device=device), torch.zeros((1,), dtype=torch.int64, device=device),
            torch.zeros((1,), dtype=torch.int32, device=device))


# Eight mask bytes (each 0 or 1) per int64 word: a word is 0 iff its bytes all are, and ALL_ONES iff they all are 1.
ALL_ONES = 0x0101010101010101


def _tile_flags(mask, block_m, block_n, seqlen_q, seqlen_k, want_full):
    """(any, all): whether each [block_m, block_n] tile of a bool [B|1, H|1, Sq, Sk] mask holds an attended
    element, and (want_full, else None) whether it holds only attended ones; bool [B|1, H|1, nm, nn]. Tiles that
    reach past Sq or Sk are never all visible. The mask is read once, as int64 words, when the tiles divide it;
    otherwise through a zero-padded copy."""
    b, h = mask.shape[:2]
    nm, nn = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
    words = None
    if seqlen_q % block_m == 0 and seqlen_k % block_n == 0 and block_n % 8 == 0:
        try:
            words = mask.view(torch.int64)
        except RuntimeError:  # strides or offset that 8-byte words cannot view
            pass
    if words is None:
        padded = mask.new_zeros((b, h, nm * block_m, -(-nn * block_n // 8) * 8))
        padded[:, :, :seqlen_q, :seqlen_k] = mask
        words = padded.view(torch.int64)[..., :nn * block_n // 8] if block_n % 8 == 0 else None
        if words is None:
            tiles = padded[..., :nn * block_n].unflatten(3, (nn, block_n)).unflatten(2, (nm, block_m))
            return tiles.any(dim=5).any(dim=3), (tiles.all(dim=5).all(dim=3) if want_full else None)
    tiles = words.unflatten(3, (nn, block_n // 8)).unflatten(2, (nm, block_m))  # [b, h, nm, bm, nn, bn / 8]
    if not want_full:
        return tiles.amax(dim=(3, 5)) != 0, None
    # Both flags from one pass over the mask: min and max over each row's words, then over the tile's rows.
    lo, hi = torch.aminmax(tiles, dim=5)
    return hi.amax(dim=3) != 0, lo.amin(dim=3) == ALL_ONES
