"""Context-parallel attention on torch.distributed (NCCL on GPUs, gloo on CPUs): one sequence sharded over the
ranks of a process group, each rank getting what flashtile.flash_attn_func returns for its own queries.

- ring_flash_attn_func: contiguous shards; key/value blocks travel around a ring (ring attention).
- zigzag_ring_flash_attn_func: the sequence in 2W chunks, rank r holding chunks r and 2W-1-r (balanced causal
  work); zigzag_shard / zigzag_unshard convert to and from that layout.
- ring_flash_attn_varlen_func: a packed batch (cu_seqlens) split into equal row shards; sequences may cross them.
- ulysses_flash_attn_func: all-to-all from sequence shards to head groups and back (DeepSpeed-Ulysses).

docs/distributed.md has the layouts, the precision and the scaling model.
"""
from .ring import (ring_flash_attn_func, ring_flash_attn_varlen_func, zigzag_ring_flash_attn_func, zigzag_shard,
                   zigzag_unshard)
from .ulysses import ulysses_flash_attn_func

__all__ = ["ring_flash_attn_func", "zigzag_ring_flash_attn_func", "ring_flash_attn_varlen_func",
           "ulysses_flash_attn_func", "zigzag_shard", "zigzag_unshard"]
