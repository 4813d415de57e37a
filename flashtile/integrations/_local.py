"""The one place the integrations reach past the public API.

torch's SDPA provider (integrations/sdpa.py) must run the backward with an output and LSE it is handed (torch's
context_parallel merges partial results and passes the merged LSE back) and keep the dropout seed between the
forward and the backward, which the public functions do not expose. Every such call is here, so that a change to
flashtile's internal call convention (flashtile._ops) touches this file alone.

Tensors: q (batch, seqlen_q, heads, d) or (total_q, heads, d) with `varlen`; k, v likewise with kv_heads. varlen:
(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) or None. Causal masks align bottom-right. No autograd: the
callers are kernels registered below torch's autograd.
"""
import torch

from .. import _ops
from .. import interface as _interface
from ..request import AttentionRequest, unbounded_window


def draw_seed(q, dropout_p):
    """The Philox key of one call (int64 (1,) on q's device), None without dropout."""
    return _interface._draw_seed(q, dropout_p)


def _request(q, k, scale, causal, window, dropout_p, seed, varlen):
    """The AttentionRequest of one call: causal is the band's right edge at the diagonal (request.py)."""
    left, right = window
    if causal:
        right = 0
    if varlen is not None:
        cu_q, cu_k, max_q, max_k = varlen
        left, right = unbounded_window(left, right, max_q, max_k)
        extra = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)
    else:
        left, right = unbounded_window(left, right, q.shape[1], k.shape[1])
        extra = dict(diagonal_offset=k.shape[1] - q.shape[1])
    return AttentionRequest(softmax_scale=scale, window_left=left, window_right=right, dropout_p=dropout_p,
                            seed=seed, deterministic=torch.are_deterministic_algorithms_enabled(), **extra)


def attention_forward(q, k, v, scale, causal, *, window=(-1, -1), dropout_p=0.0, seed=None, varlen=None):
    """-> (out like q with v's head dim, lse float32 (batch, heads, seqlen_q) or (heads, total_q)). scale > 0."""
    with torch.no_grad():
        return _ops.forward(q, k, v, _request(q, k, scale, causal, window, dropout_p, seed, varlen))


def attention_backward(dout, q, k, v, out, lse, scale, causal, *, window=(-1, -1), dropout_p=0.0, seed=None,
                       varlen=None):
    """Gradients (dq, dk, dv) of attention_forward's call for the given out and lse, which need not be the ones the
    forward returned: the backward recomputes P = exp(scale * q k^T - lse) and delta = rowsum(dout * out) from them
    (docs/derivation.md, chapter 6), which is how a merged LSE yields each partial's share of the gradients."""
    req = _request(q, k, scale, causal, window, dropout_p, seed, varlen)
    with torch.no_grad():
        dq, dk, dv = _ops.backward(dout, q, k, v, out, lse, None, req)
    return dq, dk, dv
