"""Single-pass numba kernels of the codecs, each byte for byte the payload of their torch path."""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

# Every literal is typed: numba widens an fp32 value combined with a Python float to fp64,
# and the torch path computes in fp32.
_F32_ABS = np.uint32(0x7FFFFFFF)
_F32_INF = np.uint32(0x7F800000)
_INT8_MARGIN = np.float32(1 + 2.0**-10)
_FP16_MIN_NORMAL = np.float32(2.0**-14)
_FP16_SCALE_MAX = np.float32(65000.0)
_LEVELS = np.float32(127)
_SIGN_ROW = 64
_INT8_BLOCK = 512  # quantization.INT8_BLOCK (not imported: this module loads numba only)
_INT8_GROUP = 16
_SIGN_GROUP = 4096
_ABOVE_GROUP = 2048
_PACK_MAGIC = np.uint64(0x8040201008040201)
_FP16_MAX_BITS = np.uint32(0x477FE000)  # 65504
_BF16_MAX_BITS = np.uint32(0x7F7F0000)  # about 3.39e38
_kernel = numba.njit(nogil=True, cache=True, error_model="numpy", boundscheck=False)
# Helpers are inlined into their kernel (a call per block cost up to 1.5x: LLVM did not inline them).
_helper = numba.njit(nogil=True, cache=True, error_model="numpy", boundscheck=False, inline="always")
# Sums may be reassociated (vectorised); their error bound does not depend on the order.
_sum_kernel = numba.njit(
    nogil=True, cache=True, error_model="numpy", boundscheck=False, fastmath={"reassoc", "nsz"}
)


@intrinsic
def _f32_to_f16_bits(typingctx, x):  # type: ignore[no-untyped-def]
    """fp32 -> IEEE fp16 bits, round to nearest even (LLVM's fptrunc: vcvtps2ph, as torch)."""
    sig = types.uint16(types.float32)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return sig, codegen


@intrinsic
def _f16_bits_to_f32(typingctx, x):  # type: ignore[no-untyped-def]
    """IEEE fp16 bits -> fp32 (exact)."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


@intrinsic
def _f32_from_bits(typingctx, x):  # type: ignore[no-untyped-def]
    """The fp32 whose bits are `x`."""
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@_kernel
def int8_encode(x, q, scales):  # type: ignore[no-untyped-def]
    """`Int8Codec._encode_chunked`'s q and fp16 scales (as int16 bits; blocks of 512). Returns
    1 if a block has a nonzero absmax, 0 if none does, -1 when the torch path must decide
    (NaN/Inf, a scale outside fp16's normal range)."""
    n = x.size
    xbits = x.view(np.uint32)
    scale_bits = scales.view(np.uint16)
    nonzero = 0
    safe = np.empty(_INT8_GROUP, dtype=np.float32)
    tops = np.empty(_INT8_GROUP, dtype=np.uint32)
    span = _INT8_GROUP * _INT8_BLOCK
    groups = n // span
    if groups:
        for k in range(_INT8_GROUP):
            tops[k] = _abs_peak(xbits[k * _INT8_BLOCK : (k + 1) * _INT8_BLOCK])
    # Group by group: the scales from the maxima, then the values, in L1/L2, while the same
    # loop reads the next group's maxima from DRAM (one pass over memory, overlapped with
    # the arithmetic: maxima then values group by group cost 1.3x, block by block 1.5x).
    for g in range(groups):
        base = g * span
        for k in range(_INT8_GROUP):
            status = _int8_scale(tops[k], scale_bits, g * _INT8_GROUP + k, safe, k)
            if status < 0:
                return -1
            nonzero |= status
        ahead = base + span if g + 1 < groups else base  # the last group re-reads itself
        for k in range(_INT8_GROUP):
            at = base + k * _INT8_BLOCK
            nxt = ahead + k * _INT8_BLOCK
            tops[k] = _int8_round(
                x[at : at + _INT8_BLOCK], safe[k], q[at : at + _INT8_BLOCK], xbits[nxt : nxt + _INT8_BLOCK]
            )
    for b in range(groups * _INT8_GROUP, scale_bits.size):
        lo = b * _INT8_BLOCK
        hi = min(n, lo + _INT8_BLOCK)
        status = _int8_scale(_abs_peak(xbits[lo:hi]), scale_bits, b, safe, 0)
        if status < 0:
            return -1
        nonzero |= status
        _int8_round(x[lo:hi], safe[0], q[lo:hi], xbits[lo:hi])
    return nonzero


@_helper
def _abs_peak(xbits):  # type: ignore[no-untyped-def]
    """max |x| as fp32 bits: nonnegative floats order as their bits; NaN/Inf come out on top."""
    top = np.uint32(0)
    for j in range(xbits.size):
        top = max(top, np.uint32(xbits[j] & _F32_ABS))
    return top


@_helper
def _int8_scale(top, scale_bits, b, safe, k):  # type: ignore[no-untyped-def]
    """Block b's fp16 scale (absmax rounded up, `quantization._scales`) and the divisor."""
    if top >= _F32_INF:
        return -1
    amax = _f32_from_bits(top)
    if top and (amax < _FP16_MIN_NORMAL or amax > _FP16_SCALE_MAX):
        return -1
    s = _f32_to_f16_bits(amax * _INT8_MARGIN)
    scale_bits[b] = s
    safe[k] = max(_f16_bits_to_f32(s), _FP16_MIN_NORMAL)
    return 1 if top else 0


@_helper
def _int8_round(x, safe, q, ahead):  # type: ignore[no-untyped-def]
    """q = round(x / safe * 127) (rint: half to even, as torch.round); returns `ahead`'s peak."""
    top = np.uint32(0)
    for j in range(x.size):
        q[j] = np.int32(np.rint(x[j] / safe * _LEVELS))
        top = max(top, np.uint32(ahead[j] & _F32_ABS))
    return top


@_kernel
def int8_decode(q, scale, out):  # type: ignore[no-untyped-def]
    """`Int8Codec._decode`'s values, q / 127 * scale in fp32; False on a -128 (torch raises)."""
    n = q.size
    low = np.int32(0)
    whole = n // _INT8_BLOCK
    for b in range(whole):
        at = b * _INT8_BLOCK
        low = min(low, _int8_scaled(q[at : at + _INT8_BLOCK], scale[b], out[at : at + _INT8_BLOCK]))
    if whole < scale.size:
        at = whole * _INT8_BLOCK
        low = min(low, _int8_scaled(q[at:], scale[whole], out[at:]))
    return low > -128


@_helper
def _int8_scaled(q, s, out):  # type: ignore[no-untyped-def]
    low = np.int32(0)
    for j in range(q.size):
        v = np.int32(q[j])
        low = min(low, v)
        out[j] = np.float32(v) / _LEVELS * s
    return low


@_sum_kernel
def sign_encode(x, packed):  # type: ignore[no-untyped-def]
    """`SignCodec`'s bits (x >= 0, most significant first, zero-padded) into `packed`, and
    (sum |x|, sum x**2): fp32 sums of rows of 64 added up in fp64, as the torch path (its
    summation order within a row is torch's own, so the last bits of the sums may differ)."""
    n = x.size
    total = 0.0
    squares = 0.0
    bools = np.empty(_SIGN_GROUP, dtype=np.uint8)
    words = bools.view(np.uint64)
    groups = n // _SIGN_GROUP
    # Sums and bits of a group while it is in L1; fused row by row, LLVM vectorised neither.
    for g in range(groups):
        part = x[g * _SIGN_GROUP : (g + 1) * _SIGN_GROUP]
        for r in range(_SIGN_GROUP // _SIGN_ROW):
            row = part[r * _SIGN_ROW : (r + 1) * _SIGN_ROW]
            a = np.float32(0)
            a2 = np.float32(0)
            for j in range(_SIGN_ROW):
                v = abs(row[j])
                a += v
                a2 += v * v
            total += a
            squares += a2
        for j in range(_SIGN_GROUP):
            bools[j] = part[j] >= 0
        out = packed[g * (_SIGN_GROUP // 8) : (g + 1) * (_SIGN_GROUP // 8)]
        for i in range(_SIGN_GROUP // 8):
            # bytes b0..b7 of 0/1 times this, >> 56, put b0 in bit 7 ... b7 in bit 0
            out[i] = (words[i] * _PACK_MAGIC) >> np.uint64(56)
    rest = x[groups * _SIGN_GROUP :]
    rows = rest.size // _SIGN_ROW
    for r in range(rows):
        row = rest[r * _SIGN_ROW : (r + 1) * _SIGN_ROW]
        a = np.float32(0)
        a2 = np.float32(0)
        for j in range(_SIGN_ROW):
            v = abs(row[j])
            a += v
            a2 += v * v
        total += a
        squares += a2
    for j in range(rows * _SIGN_ROW, rest.size):
        v = abs(rest[j])
        total += v
        squares += v * v  # an fp32 square, as the torch path's
    tail = packed[groups * (_SIGN_GROUP // 8) :]
    for i in range(tail.size):
        byte = np.uint32(0)
        for j in range(min(8, rest.size - 8 * i)):
            byte |= np.uint32(rest[8 * i + j] >= 0) << np.uint32(7 - j)
        tail[i] = byte
    return total, squares


@_kernel
def sign_decode(packed, scale, out):  # type: ignore[no-untyped-def]
    """+scale where a bit is set, -scale where not (`SignCodec._decode`'s values, -0.0 for a
    zero scale as there): the bits of scale with the sign bit from the packed bit."""
    n = out.size
    sbits = np.uint32(np.array([scale], dtype=np.float32).view(np.uint32)[0])
    one = np.uint32(1)
    outbits = out.view(np.uint32)
    whole = n // 8
    for i in range(whole):
        b = np.uint32(packed[i])
        for j in range(8):
            outbits[8 * i + j] = sbits | ((~(b >> np.uint32(7 - j)) & one) << np.uint32(31))
    for j in range(n - whole * 8):
        b = np.uint32(packed[whole])
        outbits[8 * whole + j] = sbits | ((~(b >> np.uint32(7 - j)) & one) << np.uint32(31))
    return True


@_kernel
def fp16_encode(x, wire):  # type: ignore[no-untyped-def]
    """x to fp16 (`wire` int16 bits) when every |x| <= fp16's max (False otherwise: NaN/Inf or
    clamping, the torch path's business)."""
    xbits = x.view(np.uint32)
    out = wire.view(np.uint16)
    peak = np.uint32(0)
    for j in range(x.size):
        peak = max(peak, np.uint32(xbits[j] & _F32_ABS))
        out[j] = _f32_to_f16_bits(x[j])
    return peak <= _FP16_MAX_BITS


@_kernel
def bf16_encode(x, wire):  # type: ignore[no-untyped-def]
    """x to bf16 (`wire` int16 bits), round to nearest even as torch, when every |x| <= bf16's max."""
    xbits = x.view(np.uint32)
    out = wire.view(np.uint16)
    peak = np.uint32(0)
    one = np.uint32(1)
    for j in range(xbits.size):
        u = xbits[j]
        peak = max(peak, np.uint32(u & _F32_ABS))
        out[j] = np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & one)) >> np.uint32(16))
    return peak <= _BF16_MAX_BITS


@_kernel
def fp16_decode(wire, out):  # type: ignore[no-untyped-def]
    """fp16 (`wire` int16 bits) to fp32; False when one is NaN/Inf."""
    bits = wire.view(np.uint16)
    peak = np.uint16(0)
    for j in range(bits.size):
        h = bits[j]
        peak = max(peak, np.uint16(h & np.uint16(0x7FFF)))
        out[j] = _f16_bits_to_f32(h)
    return peak < np.uint16(0x7C00)


@_kernel
def bf16_decode(wire, out):  # type: ignore[no-untyped-def]
    """bf16 (`wire` int16 bits) to fp32; False when one is NaN/Inf."""
    bits = wire.view(np.uint16)
    outbits = out.view(np.uint32)
    peak = np.uint16(0)
    for j in range(bits.size):
        h = bits[j]
        peak = max(peak, np.uint16(h & np.uint16(0x7FFF)))
        outbits[j] = np.uint32(h) << np.uint32(16)
    return peak < np.uint16(0x7F80)


@_kernel
def above(x, threshold_bits, pos, values):  # type: ignore[no-untyped-def]
    """Positions (increasing) and values of the x with |x| >= threshold, written while they
    fit `pos`; returns how many there are, or -1 when x holds NaN/Inf."""
    xbits = x.view(np.uint32)
    bound = np.uint32(threshold_bits)  # a Python int: compared with a uint32, numba would go through fp64
    flags = np.empty(_ABOVE_GROUP, dtype=np.uint8)
    words = flags.view(np.uint64)
    n = x.size
    count = 0
    peak = np.uint32(0)
    # A vectorised pass flags a group, then only the words of 8 flags holding a hit are
    # looked at (a tenth of them at 1 %): a branch per value cost twice as much.
    for g in range(n // _ABOVE_GROUP):
        base = g * _ABOVE_GROUP
        part = xbits[base : base + _ABOVE_GROUP]
        for j in range(_ABOVE_GROUP):
            u = np.uint32(part[j] & _F32_ABS)
            peak = max(peak, u)
            flags[j] = u >= bound
        for w in range(_ABOVE_GROUP // 8):
            if words[w]:
                for j in range(8 * w, 8 * w + 8):
                    if flags[j]:
                        if count < pos.size:
                            pos[count] = base + j
                            values[count] = x[base + j]
                        count += 1
    for j in range(n // _ABOVE_GROUP * _ABOVE_GROUP, n):
        u = np.uint32(xbits[j] & _F32_ABS)
        peak = max(peak, u)
        if u >= bound:
            if count < pos.size:
                pos[count] = j
                values[count] = x[j]
            count += 1
    return -1 if peak >= _F32_INF else count


@_kernel
def scatter(idx, values, out):  # type: ignore[no-untyped-def]
    """out = 0 except out[idx] = values; False (out untouched) unless idx increases strictly within range."""
    prev = -1
    for i in range(idx.size):
        at = np.intp(idx[i])
        if at <= prev:
            return False
        prev = at
    if prev >= out.size:
        return False
    out[:] = 0
    for i in range(idx.size):
        out[idx[i]] = values[i]
    return True
