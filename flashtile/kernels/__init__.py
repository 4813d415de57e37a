"""Triton kernels, one family per file: forward.py, backward.py, decode.py (KV cache), the Hopper Gluon kernels in
hopper_fwd.py / hopper_bwd.py; shared pieces (argument groups, the block-range and mask component) in _common.py,
the one launcher and compile cache in _launch.py, tiles in configs.py."""
from .._source import kernel_sources

with kernel_sources():  # (the kernel functions' source lines without the tokenizer: flashtile/_source.py)
    from .backward import attention_backward
    from .forward import attention_forward

__all__ = ["attention_forward", "attention_backward"]
