"""Safe softmax and online softmax (docs/derivation.md, ch. 2 and 3)."""

import math

import torch

from ._common import NEG_INF, finite_or_zero


def safe_softmax(x, dim=-1):
    """softmax(x) along dim computed as exp(x - max) / sum exp(x - max), in x.dtype.

    Subtracting the max keeps every exponent <= 0, so nothing overflows and the largest term is exactly 1.
    A slice that is all -inf (a row that sees no key) gives zeros, not NaN.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point torch.Tensor, got {getattr(x, 'dtype', type(x).__name__)}.")
    if x.shape[dim] == 0:
        return x.clone()
    m = finite_or_zero(x.amax(dim=dim, keepdim=True))
    e = torch.exp(x - m)
    l = e.sum(dim=dim, keepdim=True)
    return e / torch.where(l > 0, l, torch.ones_like(l))


def _check_stream(x):
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point torch.Tensor, got {getattr(x, 'dtype', type(x).__name__)}.")
    if x.dim() != 1:
        raise ValueError(f"x has shape {tuple(x.shape)}; online softmax reads a 1-D stream (flatten it or loop "
                         f"over rows).")


def online_softmax_states(x, limit=None):
    """Run the online softmax recurrence over the 1-D stream x and return its state after every element.

    Returns a list of len(x) pairs (m_i, l_i) of Python floats, where after element i

        m_i = max(x_0 .. x_i)        l_i = sum_{j <= i} exp(x_j - m_i)

    kept true by m_i = max(m_{i-1}, x_i), l_i = l_{i-1} * exp(m_{i-1} - m_i) + exp(x_i - m_i), starting from
    m = -inf, l = 0. While every element so far is -inf the state stays (-inf, 0).

    limit (a float >= 1, or None): the invariant l_i = sum_{j <= i} exp(x_j - m_i) holds for any reference m_i, not
    only the maximum. With a limit the reference stays where it is, and l takes exp(x_i - m_{i-1}) with no rescale,
    while that term is at most limit; an element past it takes the step above (m_i = the maximum so far). Every
    term then stays at most limit, and m_i is at most the maximum. The Gluon forward takes its key blocks this
    way (kernels/hopper_fwd.py, LAZY_MAX; docs/derivation.md ch. 3).
    """
    _check_stream(x)
    if limit is not None and not (isinstance(limit, (int, float)) and limit >= 1.0):
        raise ValueError(f"limit={limit!r}: pass None or a number >= 1 (the largest term kept without a rescale).")
    keep_below = None if limit is None else math.log(limit)
    m_i, l_i = NEG_INF, 0.0
    states = []
    for x_i in x.tolist():
        if keep_below is not None and m_i != NEG_INF and x_i - m_i <= keep_below:
            l_i += math.exp(x_i - m_i)  # the reference stays: no maximum, no rescale
            states.append((m_i, l_i))
            continue
        m_new = max(m_i, x_i)
        if m_new != NEG_INF:  # exp(-inf - (-inf)) is NaN; with no finite element yet there is nothing to add
            l_i = l_i * math.exp(m_i - m_new) + math.exp(x_i - m_new)
        m_i = m_new
        states.append((m_i, l_i))
    return states


def online_softmax(x, limit=None):
    """softmax of the 1-D stream x in two passes: one for the final (m, l), one writing exp(x_j - m) / l.

    Returns a tensor shaped and typed like x; an all -inf stream gives zeros. limit: see online_softmax_states
    (the result is the same softmax for any reference).
    """
    _check_stream(x)
    if x.numel() == 0:
        return x.clone()
    m, l = online_softmax_states(x, limit)[-1]
    if l == 0.0:
        return torch.zeros_like(x)
    return torch.exp(x.double() - m).div(l).to(x.dtype)
