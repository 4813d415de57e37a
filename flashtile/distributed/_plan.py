"""Which block calls one ring step makes: the pieces of (local queries) x (the keys received at that step).

Positions are global: the ring, zig-zag and varlen layouts only decide which global rows a rank holds. A piece is
a rectangle of local query rows against rows of the step's key block, with the diagonal offset that puts the
global mask (bottom-right aligned, flash-attn's convention) on it: query at global position i sees the key at
global position j iff i + D - left <= j <= i + D + right, D = Sk - Sq of the whole sequence (0 for
self-attention), right = 0 when causal, -1 bounds unbounded. For a piece whose first query row is at global
position gq and first key row at gk, that is local row a sees local key c iff a + (gq - gk + D) - left <= c <=
a + (gq - gk + D) + right: the piece's diagonal offset is gq - gk + D, and ALiBi's |i + D - j| is the same
distance. Pieces with no visible pair are skipped (causal rings skip every block in the future); pieces with
every pair visible run without a mask.
"""
import dataclasses
from typing import Optional

import torch

from ._local import Varlen

SKIP, FULL, MASKED = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Mask:
    """The global mask: left / right band widths, None unbounded (causal is right = 0)."""
    left: Optional[int]
    right: Optional[int]

    @classmethod
    def of(cls, causal, window):
        left, right = window
        return cls(None if left < 0 else left, 0 if causal else (None if right < 0 else right))

    @property
    def banded(self):
        return self.left is not None or self.right is not None

    @property
    def causal_only(self):
        return self.left is None and self.right == 0

    def classify(self, n_q, n_k, offset):
        """SKIP, FULL or MASKED for n_q query rows against n_k key rows under this diagonal offset."""
        if n_q <= 0 or n_k <= 0:
            return SKIP
        first = 0 if self.right is None else max(0, -offset - self.right)
        last = n_q - 1 if self.left is None else min(n_q - 1, n_k - 1 - offset + self.left)
        if first > last:
            return SKIP
        full_left = self.left is None or n_q - 1 + offset - self.left <= 0
        full_right = self.right is None or n_k - 1 <= offset + self.right
        return FULL if full_left and full_right else MASKED


@dataclasses.dataclass(frozen=True)
class Piece:
    """Local query rows [q0, q1) against rows [k0, k1) of the step's key block. masked False: every pair is
    visible (run without causal or window). varlen: a packed call (the varlen ring's own-shard step); seq_ids:
    the global sequence index of each of its sequences, for per-sequence ALiBi slopes; for a single-sequence
    piece of the varlen ring, seq_ids holds that one sequence."""
    q0: int
    q1: int
    k0: int
    k1: int
    offset: int
    masked: bool
    varlen: Optional[Varlen] = None
    seq_ids: Optional[tuple] = None


# (local start, global start, length) of each contiguous run of rows a rank holds.
def ring_chunks(rank, world, local_len):
    return [(0, rank * local_len, local_len)]


def zigzag_chunks(rank, world, local_len):
    """Rank r holds chunks r and 2W - 1 - r of the sequence cut into 2W chunks (causal work is then equal)."""
    c = local_len // 2
    return [(0, rank * c, c), (c, (2 * world - 1 - rank) * c, c)]


def chunk_pieces(q_chunks, k_chunks, seq_offset, mask: Mask, alibi: bool):
    """The pieces of one step: every (query chunk, key chunk) pair that sees something, then merged where one call
    computes the same thing (see _coalesce). seq_offset: D = Sk - Sq of the whole sequence."""
    if not alibi and mask.causal_only and seq_offset == 0 and q_chunks == k_chunks:
        # The rank's own keys under a causal mask: its chunks are in global order, so the local causal mask over
        # the concatenation is the global one (zig-zag: chunk r's queries see none of chunk 2W-1-r's keys and all
        # of chunk r's below the diagonal). One call instead of three.
        n = sum(c[2] for c in q_chunks)
        return [Piece(0, n, 0, n, 0, True)]
    pieces = []
    for q_local, q_global, n_q in q_chunks:
        for k_local, k_global, n_k in k_chunks:
            offset = q_global - k_global + seq_offset
            kind = mask.classify(n_q, n_k, offset)
            if kind != SKIP:
                pieces.append(Piece(q_local, q_local + n_q, k_local, k_local + n_k, offset, kind == MASKED))
    return pieces if alibi else _coalesce(pieces)


def _coalesce(pieces):
    """Merge unmasked pieces that share their key rows and have adjacent query rows, or share their query rows and
    have adjacent key rows: without a mask or ALiBi the offset does not matter, and one larger call is faster."""
    changed = True
    while changed:
        changed = False
        for i, a in enumerate(pieces):
            for j, b in enumerate(pieces):
                if i == j or a.masked or b.masked:
                    continue
                if (a.k0, a.k1) == (b.k0, b.k1) and a.q1 == b.q0:
                    merged = Piece(a.q0, b.q1, a.k0, a.k1, a.offset, False)
                elif (a.q0, a.q1) == (b.q0, b.q1) and a.k1 == b.k0:
                    merged = Piece(a.q0, a.q1, a.k0, b.k1, a.offset, False)
                else:
                    continue
                pieces = [p for n, p in enumerate(pieces) if n not in (i, j)] + [merged]
                changed = True
                break
            if changed:
                break
    return sorted(pieces, key=lambda p: (p.q0, p.k0))


@dataclasses.dataclass(frozen=True)
class VarlenLayout:
    """A packed batch of T tokens cut into W equal shards; bounds: the host copy of cu_seqlens."""
    bounds: tuple
    world: int

    @property
    def shard_len(self):
        return self.bounds[-1] // self.world

    def pieces(self, q_shard, k_shard, mask: Mask, device):
        """The pieces of q_shard's queries against k_shard's keys. Sequences never mix, so two different shards
        share at most one sequence (the one spanning the boundaries between them): one plain call with that
        sequence's offsets. A shard against itself is one packed call over its sequences, each clipped to the
        shard: a clipped sequence has the same query and key rows, so the kernels' per-sequence bottom-right
        alignment is its global alignment."""
        n = self.shard_len
        q_lo, k_lo = q_shard * n, k_shard * n
        if q_shard == k_shard:
            return self._own_shard(q_lo, q_lo + n, device)
        for b in range(len(self.bounds) - 1):
            s0, s1 = self.bounds[b], self.bounds[b + 1]
            gq0, gq1 = max(s0, q_lo), min(s1, q_lo + n)
            gk0, gk1 = max(s0, k_lo), min(s1, k_lo + n)
            if gq0 < gq1 and gk0 < gk1:
                offset = gq0 - gk0  # positions within the sequence: queries and keys are the same tokens
                kind = mask.classify(gq1 - gq0, gk1 - gk0, offset)
                if kind == SKIP:
                    return []
                return [Piece(gq0 - q_lo, gq1 - q_lo, gk0 - k_lo, gk1 - k_lo, offset, kind == MASKED, None, (b,))]
        return []

    def _own_shard(self, lo, hi, device):
        cu, ids, longest = [0], [], 0
        for b in range(len(self.bounds) - 1):
            s0, s1 = max(self.bounds[b], lo), min(self.bounds[b + 1], hi)
            if s0 < s1:
                cu.append(cu[-1] + s1 - s0)
                ids.append(b)
                longest = max(longest, s1 - s0)
        varlen = Varlen(torch.tensor(cu, dtype=torch.int32, device=device), longest)
        return [Piece(0, hi - lo, 0, hi - lo, 0, True, varlen, tuple(ids))]
