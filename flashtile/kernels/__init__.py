"""Triton kernels, one family per file: forward.py, backward.py; shared pieces in _common.py, tiles in configs.py."""
from .backward import attention_backward
from .forward import attention_forward

__all__ = ["attention_forward", "attention_backward"]
