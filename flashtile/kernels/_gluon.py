"""Gluon imports shared by the Hopper kernels, under names that hold from Triton 3.6 (the GPU machines') on.

Triton renamed 3.6's ``tma.async_copy_global_to_shared`` / ``async_copy_shared_to_global`` to ``async_load`` /
``async_store`` and later wrapped the bulk TMA reduction (``cp.reduce.async.bulk.tensor``) as
``async_atomic_add``; 3.6 has the reduction only as a builder call, wrapped here. ``AVAILABLE`` is False where
Triton has no Gluon; the kernels are then never defined, and dispatch never picks them.

``aggregate`` groups what travels together inside a kernel (a launch's constexprs, an mbarrier ring, a work item),
as Triton's own Gluon examples do: later Triton versions export it as ``gluon.aggregate``, 3.6 has the same class
decorator as ``triton.language.core._aggregate``. An aggregate adds no instruction: its tensor fields are the same
SSA values, and its constexpr fields stay compile-time constants, through ``warp_specialize`` too (where the order
of the fields is the order the worker partitions receive their values in: hopper_fwd.FwdProgram).
"""
import triton.language as tl
from triton.language import core as _tl_core

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
# forward; docs/design-record.md, "Gluon backward", for the backward's spills at d128).
# (constexprs: kernels read module-level values only as such)
CONSUMER_REGS = tl.constexpr(232)
PRODUCER_REGS = tl.constexpr(24)

if AVAILABLE:
    # Any Gluon value: a field that holds a tensor in some launches and a constexpr in others (an integer argument
    # equal to 1, which Triton specializes into a constant, or a feature's placeholder 0) is annotated with it.
    Value = _tl_core.base_value

    def aggregate(cls):
        """Triton's aggregate with, where the class defines no __init__, a positional one: the fields in order
        of annotation, a constexpr field's value wrapped as gl.constexpr. A class with computed fields defines
        its own __init__ as a gluon.constexpr_function, as Triton's examples do."""
        if "__init__" not in cls.__dict__:
            fields = dict(cls.__annotations__)

            def __init__(self, *values):
                if len(values) != len(fields):
                    raise TypeError(f"{cls.__name__} takes {len(fields)} fields ({', '.join(fields)}), "
                                    f"got {len(values)}")
                for (name, kind), value in zip(fields.items(), values):
                    if kind is gl.constexpr and not isinstance(value, gl.constexpr):
                        value = gl.constexpr(value)
                    setattr(self, name, value)

            # (Not a JIT function, as Triton's own generated __init__: the cache key covers the methods and the call
            # sites that pass the fields, not the field list.)
            __init__.__triton_builtin__ = True
            cls.__init__ = __init__
        return (getattr(gluon, "aggregate", None) or _tl_core._aggregate)(cls)

    @aggregate
    class Ring:
        """The mbarriers of a ring of STAGES shared-memory slots that a producer warp fills by TMA and consumers
        release: the i-th use (a running count) takes slot i % STAGES on pass i // STAGES. Slot s is guarded by
        full[s] (the loads' bytes arrive on it) and empty[s] (every consumer arrives once it is done with the
        slot). A fresh barrier has completed no phase, so the producer's first wait on an "empty" barrier (parity
        1) does not block; after that, each wait needs every consumer's release of the previous use. (The
        buffers a slot holds are the kernel's business.)"""
        full: gl.shared_memory_descriptor
        empty: gl.shared_memory_descriptor
        STAGES: gl.constexpr

        @gluon.jit
        def wait_empty(self, i):
            """Producer: wait until use i's slot is free; returns the slot."""
            slot = i % self.STAGES
            mbarrier.wait(self.empty.index(slot), ((i // self.STAGES) & 1) ^ 1)
            return slot

        @gluon.jit
        def wait_full(self, i):
            """Consumer: wait until use i's loads have landed; returns the slot."""
            slot = i % self.STAGES
            mbarrier.wait(self.full.index(slot), (i // self.STAGES) & 1)
            return slot

        @gluon.jit
        def release(self, i):
            """Consumer: done with use i's slot."""
            mbarrier.arrive(self.empty.index(i % self.STAGES), count=1)

    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

    @_builtin
    def _tma_reduce_add_36(tensor_desc, coord, src, _semantic=None):
        """Add a shared-memory tile into global memory with one bulk TMA reduction (Triton 3.6)."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)

    tma_reduce_add = getattr(tma, "async_atomic_add", None) or _tma_reduce_add_36
    # A barrier of the calling warps (a partition's, in warp_specialize): 3.6's gl.thread_barrier, gl.barrier later.
    thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

    @gluon.constexpr_function
    def row_pieces_layout(cols):
        """The layout in which a 4-warp partition stores a 16-bit [rows, cols] tile (cols >= 8) from registers: a
        lane holds 8 consecutive columns of a row, a row's 16-byte pieces sit on adjacent lanes, so each warp store
        writes whole pieces of consecutive columns. (In wgmma's accumulator layout a lane holds two adjacent columns
        of a row, and each 4-byte store of a warp writes to eight rows.) hopper_fwd._store_o_chunk and
        hopper_bwd._rows_for_store convert to it through shared memory."""
        lanes = min(32, cols // 8)
        return gl.BlockedLayout([1, 8], [32 // lanes, lanes], [4, 1], [1, 0])

    @gluon.jit
    def mma_over_96(a, rows, acc, use_acc):
        """Issue acc + a rows^T over the first 96 columns of two 128-column shared tiles (d96 on d128's tiles: the
        columns past 96 are TMA's zero fill), as two asynchronous products of 64 and 32 columns; returns the second
        one's token. use_acc: add to acc, else acc is not read. (hopper_fwd's Q K^T, NARROW_QK; hopper_bwd's S^T and
        dP^T.)"""
        acc = warpgroup_mma(a.slice(0, 64, dim=1), rows.slice(0, 64, dim=1).permute((1, 0)), acc, use_acc=use_acc,
                            is_async=True)
        return warpgroup_mma(a.slice(64, 32, dim=1), rows.slice(64, 32, dim=1).permute((1, 0)), acc, is_async=True)

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

    @gluon.jit
    def _philox(k0, k1, c0, c1, c2, c3):
        """Philox-4x32-10 (Random123's constants, as triton.language.random.philox and reference.dropout) on uint32
        counter tensors under the key (k0, k1). Each round's two products are widening multiplies, one
        IMAD.WIDE.U32 each for both halves (umulhi and a separate low product compile to two)."""
        for _ in gl.static_range(10):
            wa = c0.to(gl.uint64) * 0xD2511F53
            wb = c2.to(gl.uint64) * 0xCD9E8D57
            c0 = (wb >> 32).to(gl.uint32) ^ c1 ^ k0
            c2 = (wa >> 32).to(gl.uint32) ^ c3 ^ k1
            c1 = wb.to(gl.uint32)
            c3 = wa.to(gl.uint32)
            k0 = k0 + 0x9E3779B9
            k1 = k1 + 0xBB67AE85
        return c0, c1, c2, c3

    @gluon.jit
    def _corner(x, R: gl.constexpr, C: gl.constexpr):
        """The [R // 16, 8, C // 16, 8] entries of an [R, C] tile whose row and column have bit 3 clear (a Philox
        group's first element), reshaped in registers: no data moves between threads."""
        x6 = gl.permute(gl.reshape(x, [R // 16, 2, 8, C // 16, 2, 8]), (0, 2, 3, 5, 1, 4))
        return gl.split(gl.split(x6)[0])[0]

    @gluon.jit
    def dropout_tile_keep(rows, col0, seed, bh, threshold, N: gl.constexpr, KEYS_AS_ROWS: gl.constexpr):
        """Dropout's keep-mask (dropout_bits compared with the threshold) for the [R, N] tile of the layout rows
        come from (instr_shape [16, N, 16], 4 warps) with columns col0 + 0..N-1, drawn in four column chunks, so
        that fewer Philox states are live at once (a d128 forward drawing its 64 keys per thread in one go spilled
        83 registers offline, in four 26). The chunks go back in place by reshapes within each thread (no data
        moves)."""
        W: gl.constexpr = N // 4
        layout: gl.constexpr = rows.type.layout.parent
        c_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, W, 16])
        r = gl.convert_layout(rows, gl.SliceLayout(1, c_layout))
        cols = col0 + gl.arange(0, W, layout=gl.SliceLayout(0, c_layout))
        # Column 2 W a + W b + n is entry n of chunk 2 a + b: (.., n, b, a), then back to [R, N].
        bits = gl.join(gl.join(dropout_bits(r, cols, seed, bh, KEYS_AS_ROWS),
                               dropout_bits(r, cols + W, seed, bh, KEYS_AS_ROWS)),
                       gl.join(dropout_bits(r, cols + 2 * W, seed, bh, KEYS_AS_ROWS),
                               dropout_bits(r, cols + 3 * W, seed, bh, KEYS_AS_ROWS)))
        bits = gl.reshape(gl.permute(bits, (0, 3, 2, 1)), [rows.shape[0], N])
        return gl.convert_layout(bits, layout) >= dropout_limit(threshold)

    @gluon.jit
    def dropout_limit(threshold):
        """(bits >> 1) >= threshold as one unsigned comparison: bits >= dropout_limit(threshold)."""
        return threshold.to(gl.uint32, bitcast=True) * 2

    @gluon.jit
    def dropout_bits(rows, cols, seed, bh, KEYS_AS_ROWS: gl.constexpr):
        """Dropout's random bits for a tile in a Hopper accumulator layout with row positions `rows` and column
        positions `cols` (its SliceLayouts; each starts at a multiple of 16): queries as rows, or keys
        with KEYS_AS_ROWS (the backward's S^T). The bits of reference.dropout.dropout_mask and the portable
        kernels' _common._dropout_keep: one Philox call under the 64-bit key `seed` (an int64 scalar) at counter
        (g(j), g(i), bh, 0), g(x) = (x >> 4) * 8 + (x & 7), serves {i, i + 8} x {j, j + 8}, output 2 * (bit 3 of i)
        + (bit 3 of j) to each; an element is kept iff its top 31 bits are >= the threshold. In this layout a
        thread holds all four elements of each of its groups, so the calls run on [R // 16, 8, C // 16, 8] tensors
        (a quarter of the tile) and their outputs go back in place by reshapes within the thread."""
        R: gl.constexpr = rows.shape[0]
        C: gl.constexpr = cols.shape[0]
        layout: gl.constexpr = rows.type.layout.parent
        zero = gl.zeros([R, C], gl.int32, layout=layout)
        r0 = _corner(gl.expand_dims(rows, 1) + zero, R, C)
        c0 = _corner(gl.expand_dims(cols, 0) + zero, R, C)
        if KEYS_AS_ROWS:
            i, j = c0, r0
        else:
            i, j = r0, c0
        ctr_j = (((j >> 4) << 3) | (j & 7)).to(gl.uint32, bitcast=True)
        ctr_i = (((i >> 4) << 3) | (i & 7)).to(gl.uint32, bitcast=True)
        seed = seed.to(gl.uint64, bitcast=True)
        k0 = (seed & 0xFFFFFFFF).to(gl.uint32)
        k1 = (seed >> 32).to(gl.uint32)
        o0, o1, o2, o3 = _philox(k0, k1, ctr_j, ctr_i, ctr_j * 0 + bh.to(gl.uint32, bitcast=True), ctr_j * 0)
        # x_rc: the output for the element whose row has bit 3 = r and column bit 3 = c.
        if KEYS_AS_ROWS:
            x00, x01, x10, x11 = o0, o2, o1, o3
        else:
            x00, x01, x10, x11 = o0, o1, o2, o3
        # join stacks along a new last dim: (.., column bit, row bit); then back to [R, C].
        bits = gl.join(gl.join(x00, x01), gl.join(x10, x11))
        bits = gl.reshape(gl.permute(bits, (0, 5, 1, 2, 4, 3)), [R, C])
        return gl.convert_layout(bits, layout)


__all__ = ["AVAILABLE", "CONSUMER_REGS", "PRODUCER_REGS", "Ring", "TensorDescriptor", "Value", "aggregate",
           "dropout_tile_keep", "fence_async_shared", "gl", "gluon", "mbarrier", "tanh_approx", "tma", "tma_load",
           "tma_reduce_add", "tma_store", "thread_barrier", "to_float32", "warpgroup_mma", "warpgroup_mma_wait"]
