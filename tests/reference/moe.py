"""NumPy reference of the MoE family (metal/moe.metal): routing, the expert grouping the prefill path builds on
the GPU (histogram, offsets, block map), and the MoE block of docs/model.md, with the Metal kernels'
rounding points made explicit (same math as csrc/backends/reference/reference.cpp moe_route / moe).

Shapes: T tokens, H hidden, E experts, k top-k, I expert width, Is shared expert width, n = T*k assignments.
  xn bf16 bits [T, H]; x f32 [T, H]; ids int32 [T, k]; weights f32 [T, k];
  experts: Wg, Wu f32 [E, I, H], Wd f32 [E, H, I]; shared: Sg, Su f32 [Is, H], Sd [H, Is], sgate [1, H].
Rounding points of the kernels: h = SiLU(gate) * up is stored bf16 (both paths); the prefill GEMMs stage
dequantised weights as bf16 in threadgroup memory (round_weights=True), the decode GEMVs use them in fp32.
"""
import numpy as np

from reference.dense import bf16_float, bf16_round


def silu(v):
    return v / (1.0 + np.exp(-v))


def sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def route(logits, k):
    """softmax in fp32 over E, top-k (ties -> lower index), renormalised. logits f32 [T, E] -> ids, weights."""
    T, E = logits.shape
    ids = np.zeros((T, k), np.int32)
    w = np.zeros((T, k), np.float32)
    for t in range(T):
        l = logits[t].astype(np.float32)
        p = np.exp(l - l.max()).astype(np.float32)
        p = (p / p.sum(dtype=np.float32)).astype(np.float32)
        order = sorted(range(E), key=lambda e: (-p[e], e))[:k]
        ids[t] = order
        w[t] = p[order] / p[order].sum(dtype=np.float32)
    return ids, w


def router_logits(xn_bits, W):
    """f32 [T, E] = xn . W^T (fp32-exact inputs, fp64 accumulation)."""
    return (bf16_float(xn_bits).astype(np.float64) @ W.astype(np.float64).T).astype(np.float32)


def group(ids, E, bm):
    """What the GPU's histogram / scan build: counts [E], offsets [E + 1] and the block map rows
    (expert, first slot, rows) in expert order, ceil(count / bm) tiles per expert."""
    counts = np.bincount(np.asarray(ids).reshape(-1), minlength=E).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    blocks = []
    for e in range(E):
        for b in range(0, int(counts[e]), bm):
            blocks.append((e, int(offsets[e]) + b, min(bm, int(counts[e]) - b)))
    return counts, offsets, blocks


def moe(xn_bits, x, ids, weights, mats, round_weights, round_gate_up=False):
    """x + MoE(xn): mats = dict of f32 matrices (Wg, Wu, Wd [E, ...], Sg, Su, Sd, sgate). Returns f32 [T, H].
    round_gate_up: the gate and up outputs are stored bf16 before SwiGLU (decode's unfused ablation)."""
    rw = bf16_round if round_weights else (lambda a: a)
    rgu = (lambda a: bf16_round(a.astype(np.float32)).astype(np.float64)) if round_gate_up else (lambda a: a)
    xs = bf16_float(xn_bits).astype(np.float64)
    T, _ = xs.shape
    out = x.astype(np.float64).copy()

    def expert(g, u, d, v):
        h = bf16_round((silu(rgu(rw(g).astype(np.float64) @ v)) * rgu(rw(u).astype(np.float64) @ v)).astype(np.float32))
        return rw(d).astype(np.float64) @ h.astype(np.float64)

    for t in range(T):
        acc = np.zeros(xs.shape[1])
        for j in range(ids.shape[1]):
            e = ids[t, j]
            acc += float(weights[t, j]) * expert(mats["Wg"][e], mats["Wu"][e], mats["Wd"][e], xs[t])
        sg = sigmoid(float(mats["sgate"][0].astype(np.float64) @ xs[t]))
        out[t] += acc + sg * expert(mats["Sg"], mats["Su"], mats["Sd"], xs[t])
    return out.astype(np.float32)
