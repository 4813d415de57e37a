"""flashtile: FlashAttention as a pure-Python library (Triton kernels, forward and backward)."""
from . import reference
from .interface import flash_attn_func, scaled_dot_product_attention

__version__ = "0.1.0"

__all__ = ["flash_attn_func", "scaled_dot_product_attention", "reference", "__version__"]
