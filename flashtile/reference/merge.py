"""Combining partial attention results over disjoint key sets (docs/derivation.md, ch. 7).

Flash decoding splits the keys of one query across programs; ring attention splits them across devices. Each
part returns its own normalised output and LSE, and the exact result is a weighted sum of the parts.

# outs[i]: [B, S, H, D]   lses[i]: [B, H, S]
"""

from collections.abc import Sequence

import torch

from ._common import NEG_INF, accum_dtype, finite_or_zero


def _check_partials(outs, lses):
    if not isinstance(outs, Sequence) or not isinstance(lses, Sequence):
        raise TypeError("outs and lses must be sequences (lists or tuples) of tensors, one pair per key chunk.")
    if len(outs) == 0 or len(outs) != len(lses):
        raise ValueError(f"got {len(outs)} partial outputs and {len(lses)} LSEs; pass one LSE per output, at least "
                         f"one of each.")
    for i, (o, lse) in enumerate(zip(outs, lses)):
        if not isinstance(o, torch.Tensor) or not isinstance(lse, torch.Tensor):
            raise TypeError(f"partial {i}: outs and lses must hold torch.Tensors.")
        if o.dim() != 4:
            raise ValueError(f"outs[{i}] has shape {tuple(o.shape)}; expected (batch, seqlen, heads, headdim).")
        if o.shape != outs[0].shape or o.dtype != outs[0].dtype:
            raise ValueError(f"outs[{i}] is {tuple(o.shape)} {o.dtype} but outs[0] is {tuple(outs[0].shape)} "
                             f"{outs[0].dtype}; every partial must have the same shape and dtype.")
        b, s, h, _ = o.shape
        if tuple(lse.shape) != (b, h, s):
            raise ValueError(f"lses[{i}] has shape {tuple(lse.shape)}; expected (batch, heads, seqlen) = "
                             f"{(b, h, s)} to match outs[{i}].")


def merge_partials(outs, lses):
    """Merge partial attention outputs computed over disjoint key sets.

        lse = log sum_i exp(lse_i)        out = sum_i exp(lse_i - lse) * out_i

    Args:
        outs: sequence of [B, S, H, D] partial outputs, each normalised over its own keys.
        lses: sequence of matching [B, H, S] natural-log LSEs.
    Returns:
        out [B, S, H, D] in the dtype of outs, lse [B, H, S] in float32 (float64 for float64 outs).

    A partial with lse -inf (it saw no key) gets weight 0 and its out is never read, so it may hold anything.
    A row where every partial is -inf gets out 0 and lse -inf.
    """
    _check_partials(outs, lses)
    acc_dtype = accum_dtype(outs[0].dtype)
    lse_i = torch.stack([x.to(acc_dtype) for x in lses])                    # [N, B, H, S]
    m = finite_or_zero(lse_i.amax(dim=0))                                    # [B, H, S]
    w = torch.exp(lse_i - m)                                                 # exp(lse_i - m), 0 for empty parts
    l = w.sum(dim=0)
    seen = l > 0
    l_div = torch.where(seen, l, torch.ones_like(l))
    lse = torch.where(seen, m + torch.log(l_div), NEG_INF)

    out = torch.zeros(outs[0].shape, dtype=acc_dtype, device=outs[0].device)
    for w_i, o_i in zip(w / l_div, outs):                                    # w_i = exp(lse_i - lse)
        w_i = w_i.transpose(1, 2).unsqueeze(-1)                              # [B, S, H, 1]
        out += torch.where(w_i > 0, w_i * o_i.to(acc_dtype), 0.0)            # 0 * garbage could be NaN
    return out.to(outs[0].dtype), lse
