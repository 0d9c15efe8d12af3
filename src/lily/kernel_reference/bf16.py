"""bfloat16 in NumPy (which has no bf16 type): bit patterns as uint16, round to nearest even — the rounding
the Metal kernels apply when they store bf16. Shared by every family's reference."""
import numpy as np


def bf16_bits(a):
    """float32 -> bfloat16 bit pattern (uint16), round to nearest even (NaN not expected)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)


def bf16_float(bits):
    """bfloat16 bit pattern (uint16) -> float32."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def bf16_round(a):
    """float32 rounded to the nearest bf16, as float32."""
    return bf16_float(bf16_bits(a))
