"""LLVM intrinsics that keep integer arithmetic at its own width inside Numba kernels.

Numba widens uint8 and uint32 arithmetic to 64 bits. AVX2 has no 64-bit vector multiply and a 64-bit lane holds
a quarter of the elements a 32-bit one does and an eighth of an 8-bit one, so the loops that matter (hashing,
code checks, fixed-point adds) use these to stay at 32 or 8 bits, where LLVM vectorises them 8 or 32 lanes wide.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_I8 = ir.IntType(8)


def _binary(width: types.Integer, op: str, doc: str):
    """An intrinsic applying one LLVM instruction (builder method `op`) to two integers of `width`."""

    @intrinsic
    def fn(typingctx, a, b):
        def codegen(context, builder, signature, args):
            return getattr(builder, op)(args[0], args[1])

        return width(width, width), codegen

    fn.__doc__ = doc
    return fn


mul32 = _binary(types.uint32, "mul", "uint32 * uint32 mod 2**32 (AVX2 has no 64-bit vector multiply).")
shl32 = _binary(types.uint32, "shl", "uint32 << uint32, for shifts below 32.")
or8 = _binary(types.uint8, "or_", "uint8 | uint8 (an accumulator of per-byte flags).")


@intrinsic
def clz32(typingctx, a):
    """Count of leading zero bits of a uint32 (32 for 0), one instruction (lzcnt) that vectorises."""
    sig = types.uint32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.ctlz(args[0], context.get_constant(types.boolean, False))

    return sig, codegen


@intrinsic
def byte_outside(typingctx, c, lo, span):
    """1 if byte c is nonzero and (c & 0x7F) - lo, wrapped to 8 bits, exceeds span; else 0. All 8-bit."""
    sig = types.uint8(types.uint8, types.uint8, types.uint8)

    def codegen(context, builder, signature, args):
        c, lo, span = args
        outside = builder.icmp_unsigned(">", builder.sub(builder.and_(c, ir.Constant(_I8, 0x7F)), lo), span)
        nonzero = builder.icmp_unsigned("!=", c, ir.Constant(_I8, 0))
        return builder.zext(builder.and_(outside, nonzero), _I8)

    return sig, codegen


_I32 = ir.IntType(32)


def _be32_pointer(context, builder, array_type, array, offset):
    """i32* to the 4 bytes at array[offset] (a uint8 array), for an unaligned access."""
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [offset]), _I32.as_pointer())


def _bswap(builder, value):
    return builder.call(builder.module.declare_intrinsic("llvm.bswap", [_I32]), [value])


@intrinsic
def load_be32(typingctx, array, offset):
    """The big-endian int32 at array[offset:offset + 4] of a uint8 array: one unaligned load and a byte swap, which
    vectorise (the byte-by-byte assembly does not). No bounds check."""
    sig = types.int32(array, types.intp)

    def codegen(context, builder, signature, args):
        ptr = _be32_pointer(context, builder, signature.args[0], args[0], args[1])
        return _bswap(builder, builder.load(ptr, align=1))

    return sig, codegen


@intrinsic
def store_be32(typingctx, array, offset, value):
    """array[offset:offset + 4] = the low 32 bits of an integer value, big-endian (see load_be32)."""
    sig = types.void(array, types.intp, value)

    def codegen(context, builder, signature, args):
        word = context.cast(builder, args[2], signature.args[2], types.int32)
        builder.store(_bswap(builder, word), _be32_pointer(context, builder, signature.args[0], args[0], args[1]),
                      align=1)
        return context.get_dummy_value()

    return sig, codegen


class Lanes:
    """LLVM IR on vectors of WIDTH uint32 lanes, for a loop whose codegen LLVM's own vectoriser gets wrong (see
    protocol.cnat's stochastic encode): each step states the scalar kernel's step on all lanes at once."""

    WIDTH = 8  # one AVX2 register of 32-bit lanes

    def __init__(self, builder: ir.IRBuilder):
        self.builder = builder
        self.vector = ir.VectorType(_I32, self.WIDTH)

    def const(self, value: int) -> ir.Constant:
        return ir.Constant(self.vector, [value & 0xFFFFFFFF] * self.WIDTH)

    def splat(self, value: ir.Value) -> ir.Value:
        """Every lane = the uint32 value."""
        b = self.builder
        one = b.insert_element(ir.Constant(self.vector, ir.Undefined), value, ir.Constant(_I32, 0))
        return b.shuffle_vector(one, ir.Constant(self.vector, ir.Undefined), ir.Constant(self.vector, [0] * self.WIDTH))

    def umin(self, a: ir.Value, c: ir.Value) -> ir.Value:
        return self.builder.select(self.builder.icmp_unsigned("<", a, c), a, c)

    def umax(self, a: ir.Value, c: ir.Value) -> ir.Value:
        return self.builder.select(self.builder.icmp_unsigned(">", a, c), a, c)

    def load(self, data: ir.Value, index: ir.Value) -> ir.Value:
        """The WIDTH uint32 from data[index] (data: a uint32 array's data pointer)."""
        return self.builder.load(self.builder.bitcast(self.builder.gep(data, [index]), self.vector.as_pointer()),
                                 align=4)

    def prefetch(self, data: ir.Value, index: ir.Value) -> None:
        """A hint to fetch the line of data[index] into the caches for reading; it never faults, so index may lie
        past the array's end."""
        b = self.builder
        address = b.bitcast(b.gep(data, [index]), _I8.as_pointer())
        hint = b.module.declare_intrinsic("llvm.prefetch", [address.type],
                                          ir.FunctionType(ir.VoidType(), [address.type, _I32, _I32, _I32]))
        b.call(hint, [address, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])  # read, keep, data

    def store_bytes(self, value: ir.Value, data: ir.Value, index: ir.Value) -> None:
        """data[index:index + WIDTH] = each lane's low byte (data: a uint8 array's data pointer)."""
        narrow = ir.VectorType(_I8, self.WIDTH)
        self.builder.store(self.builder.trunc(value, narrow),
                           self.builder.bitcast(self.builder.gep(data, [index]), narrow.as_pointer()), align=1)

    def reduce(self, value: ir.Value, pick) -> ir.Value:
        """The lanes folded with pick (self.umin or self.umax) into one uint32."""
        lanes = [self.builder.extract_element(value, ir.Constant(_I32, j)) for j in range(self.WIDTH)]
        out = lanes[0]
        for lane in lanes[1:]:
            out = pick(out, lane)
        return out
