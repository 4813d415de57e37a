"""Gluon imports shared by the Hopper kernels, under names that hold from Triton 3.6 (the GPU machines') on.

Triton renamed 3.6's ``tma.async_copy_global_to_shared`` / ``async_copy_shared_to_global`` to ``async_load`` /
``async_store`` and later wrapped the bulk TMA reduction (``cp.reduce.async.bulk.tensor``) as
``async_atomic_add``; 3.6 has the reduction only as a builder call, wrapped here. ``AVAILABLE`` is False where
Triton has no Gluon; the kernels are then never defined, and dispatch never picks them.
"""
import triton.language as tl

try:
    from triton._C.libtriton import ir as _ir
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language._core import builtin as _builtin
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                    warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    AVAILABLE = False

# Registers per thread requested for warp_specialize's worker partitions (setmaxnreg): a consumer warpgroup holds
# fp32 accumulators of 128 to 192 registers (O and S in the forward, dK and dV in the backward); a warp that only
# issues TMA copies needs the minimum, 24. 232 is what remains under the 64K-register file with the default
# partition at its own share (the compiled kernels start at 168 per thread and spill nothing at 232 in the
# forward; see benchmarks/NOTES.md for the backward's spills at d128).
# (constexprs: kernels read module-level values only as such)
CONSUMER_REGS = tl.constexpr(232)
PRODUCER_REGS = tl.constexpr(24)

if AVAILABLE:
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

    @_builtin
    def _tma_reduce_add_36(tensor_desc, coord, src, _semantic=None):
        """Add a shared-memory tile into global memory with one bulk TMA reduction (Triton 3.6)."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)

    tma_reduce_add = getattr(tma, "async_atomic_add", None) or _tma_reduce_add_36

    @gluon.jit
    def tanh_approx(x):
        """tanh.approx.f32: one special-function op (relative error ~2^-11, below the 16-bit inputs' own rounding),
        as the portable kernels' _common._tanh_approx. (Hopper has no packed fp16 tanh: tanh.approx.f16x2 compiles
        to two MUFU.TANH.F16.)"""
        return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True,
                                         pack=1)

    @gluon.jit
    def to_float32(x):
        """A 16-bit tile in fp32. bf16 by two integer ops per pair (shift the low half up, mask the high half):
        ptxas turns the plain conversion into a byte permute and a shift per element."""
        if x.dtype == gl.bfloat16:
            return gl.inline_asm_elementwise("{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xffff0000; }", "=r,=r,r", [x],
                                             dtype=gl.float32, is_pure=True, pack=2)
        else:
            return x.to(gl.float32)

__all__ = ["AVAILABLE", "CONSUMER_REGS", "PRODUCER_REGS", "TensorDescriptor", "fence_async_shared", "gl", "gluon",
           "mbarrier", "tanh_approx", "tma", "tma_load", "tma_reduce_add", "tma_store", "to_float32", "warpgroup_mma",
           "warpgroup_mma_wait"]
