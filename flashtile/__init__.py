"""flashtile: FlashAttention as a pure-Python library (Triton kernels, no C++ build)."""
from . import reference
from ._ahead import wait_for_compiles
from ._values import check_values
from .interface import (explain, flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                        flash_attn_varlen_func, flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func,
                        scaled_dot_product_attention)
from .kvcache import flash_attn_with_kvcache

__version__ = "0.1.0"
__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache",
           "scaled_dot_product_attention", "explain", "check_values", "wait_for_compiles", "reference", "__version__"]
