"""Dropout's keep-mask in pure PyTorch: the same Philox-4x32-10 bits the kernels draw (docs/derivation.md#8).

Element (b, h, i, j) is kept iff the top 31 bits of one output of Philox-4x32-10 under the 64-bit key `seed` are
>= round(p * 2^31). One Philox call covers the four elements {i, i + 8} x {j, j + 8} (i and j with bit 3 clear):
its counter is (g(j), g(i), b * H + h, 0) with g(x) = (x >> 4) * 8 + (x & 7), the position with bit 3 squeezed
out, and output 2 * (bit 3 of i) + (bit 3 of j) goes to each. Those four elements are what one GPU thread holds of a
tile in the Hopper tensor cores' accumulator layout both ways round (rows i and i + 8, columns j and j + 8 of the
forward's S; keys j and j + 8, queries i and i + 8 of the backward's S^T), so a Gluon kernel draws each call once
and no thread needs another's bits. This is an independent implementation (integer arithmetic in int64 tensors) of
what flashtile/kernels/_common._dropout_keep computes with Triton's Philox and the Gluon kernels with their own
(kernels/_gluon.dropout_bits), so a test that feeds it to the reference checks the kernels' random numbers too. It is
also the CPU fallback's mask and what `return_attn_probs=True` encodes in S_dmask.
"""
import torch

_MASK32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUNDS = 10
_BITS = 31


def _mulhi32(a, b):
    """High 32 bits of a * b for uint32 values held in int64 (the product can pass 2^63, so split b)."""
    b_hi, b_lo = b >> 16, b & 0xFFFF
    return (a * b_hi + ((a * b_lo) >> 16)) >> 16


def philox_4x32(seed, c0, c1, c2, c3):
    """Philox-4x32-10 with key (seed & 0xffffffff, seed >> 32) on uint32 counters held in int64 tensors; returns
    the four outputs (int64 tensors with values in [0, 2^32))."""
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for _ in range(_ROUNDS):
        old_c0, old_c2 = c0, c2
        c0 = _mulhi32(torch.full_like(old_c2, _ROUND_B), old_c2) ^ c1 ^ k0
        c2 = _mulhi32(torch.full_like(old_c0, _ROUND_A), old_c0) ^ c3 ^ k1
        c1 = (_ROUND_B * old_c2) & _MASK32
        c3 = (_ROUND_A * old_c0) & _MASK32
        k0, k1 = (k0 + _KEY_A) & _MASK32, (k1 + _KEY_B) & _MASK32
    return c0, c1, c2, c3


def _group(x):
    """A position's Philox counter word: x with its bit 3 squeezed out (x and x + 8 share it when bit 3 is clear)."""
    return ((x >> 4) << 3) | (x & 7)


def dropout_threshold(p):
    """The integer threshold on 31 random bits that keeps an element with probability 1 - p."""
    return min(round(p * 2 ** _BITS), 2 ** _BITS - 1)


def dropout_mask(seed, batch, heads, seqlen_q, seqlen_k, p, *, device="cpu", batch_offset=0):
    """Keep-mask [batch, heads, seqlen_q, seqlen_k] (True = kept) of dropout with probability p under `seed` (an
    int). batch_offset numbers the batch entries from there (a varlen sequence b uses counter b * heads + h)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}.")
    seed = int(seed)
    i = torch.arange(seqlen_q, device=device, dtype=torch.int64).view(1, 1, -1, 1)
    j = torch.arange(seqlen_k, device=device, dtype=torch.int64).view(1, 1, 1, -1)
    bh = ((torch.arange(batch, device=device, dtype=torch.int64).view(-1, 1) + batch_offset) * heads
          + torch.arange(heads, device=device, dtype=torch.int64).view(1, -1)).view(batch, heads, 1, 1)
    shape = (batch, heads, seqlen_q, seqlen_k)
    c0, c1, c2 = _group(j).expand(shape), _group(i).expand(shape), (bh & _MASK32).expand(shape)
    outputs = philox_4x32(seed, c0, c1, c2, torch.zeros(shape, dtype=torch.int64, device=device))
    which = (2 * ((i >> 3) & 1) + ((j >> 3) & 1)).expand(shape)
    bits = torch.stack(outputs, dim=-1).gather(-1, which.unsqueeze(-1)).squeeze(-1)
    return (bits >> 1) >= dropout_threshold(p)
