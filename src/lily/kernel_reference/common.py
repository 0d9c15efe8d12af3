"""NumPy reference of the common family (metal/common.metal): embedding rows, RMSNorm to bf16, greedy argmax;
the same math as csrc/backends/reference/reference.cpp embed / rms_normalise.

Shapes: T rows, V vocabulary, H hidden; E [V, H] stored as in lily/kernel_reference/dense.py; x f32 [T, H].
"""
import numpy as np

from .dense import bf16_bits, bf16_float  # noqa: F401  (re-exported for the tests)


def embed(E, tokens):
    """E f32 [V, H] as dequantised (w = scale * q + bias in fp32), tokens int32 [T] -> x f32 [T, H]."""
    return E[np.asarray(tokens)].astype(np.float32)


def rmsnorm(x, w, eps):
    """x f32 [T, n], w f32 [n] -> f32 [T, n] (before the kernel's bf16 store)."""
    x = x.astype(np.float32)
    inv = np.float32(1.0) / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + eps).astype(np.float32)
    return (x * inv * w.astype(np.float32)).astype(np.float32)


def argmax(logits):
    """First index of the maximum (numpy's tie rule)."""
    return int(np.argmax(logits))
