"""Pure-PyTorch attention references: the derivation ladder of docs/derivation.md, runnable and tested.

naive_attention (with every mask and score modification, and naive_attention_varlen for packed batches) /
attention_backward are the float64 test oracle and the CPU fallback; the softmax, tiled and
merge functions run each later step of the derivation block by block, the way the kernels do.
"""

from ._common import causal_mask
from .merge import merge_partials
from .naive import attention_backward, naive_attention, naive_attention_varlen
from .softmax import online_softmax, online_softmax_states, safe_softmax
from .tiled import tiled_attention_backward, tiled_attention_fa1, tiled_attention_fa2

__all__ = [
    "attention_backward",
    "causal_mask",
    "merge_partials",
    "naive_attention",
    "naive_attention_varlen",
    "online_softmax",
    "online_softmax_states",
    "safe_softmax",
    "tiled_attention_backward",
    "tiled_attention_fa1",
    "tiled_attention_fa2",
]
