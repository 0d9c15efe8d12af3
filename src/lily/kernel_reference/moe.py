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

from .dense import bf16_float, bf16_round


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


# ---- the kernel cases: tests/test_moe.py and `lily doctor` run them on the device lily._core.kernels chose

from .dense import bf16_bits, random_matrix  # noqa: E402  (the kernel cases)


BITS = {"q4": 4, "q8": 8, "bf16": 0}


def _kernels():
    from .._core import kernels
    return kernels


def stacked(rng, E, rows, cols, bits, scale):
    """E matrices [rows, cols] stacked as one tensor [E * rows, ...]: (codes u8, scales, biases, W f32 [E, rows, cols])."""
    ws, ss, bs, Ws = [], [], [], []
    for _ in range(E):
        w, s, b, W = random_matrix(rng, rows, cols, bits)
        ws.append(w), ss.append(s), bs.append(b), Ws.append(W * np.float32(scale))
        if bits:  # scale the affine parameters the same way (exact in bf16: scale is a power of two)
            ss[-1] = bf16_bits(bf16_float(s) * np.float32(scale))
            bs[-1] = bf16_bits(bf16_float(b) * np.float32(scale))
        else:
            ws[-1] = bf16_bits(W * np.float32(scale)).view(np.uint8).reshape(rows, -1)
    cat = lambda a: np.ascontiguousarray(np.concatenate(a)) if a[0].size else a[0]
    return cat(ws), cat(ss), cat(bs), np.stack(Ws)


def make_layer(seed, H, E, I, Is, fmt="q4", router_fmt="q8", fused=False):
    """Random MoE weights: (mats for kernels.moe, f32 matrices for the reference)."""
    rng = np.random.default_rng(seed)
    bits, rbits = BITS[fmt], BITS[router_fmt]
    # 1/4 and 1/8 keep activations O(1) through SwiGLU at these widths.
    if fused:
        gu = stacked(rng, E, 2 * I, H, bits, 0.25)
        gate = (bits, E, I, H, 2 * I, 0, gu[0], gu[1], gu[2])
        up = (bits, E, I, H, 2 * I, I, gu[0], gu[1], gu[2])
        Wg, Wu = gu[3][:, :I], gu[3][:, I:]
    else:
        g, u = stacked(rng, E, I, H, bits, 0.25), stacked(rng, E, I, H, bits, 0.25)
        gate, up = (bits, E, I, H, I, 0, *g[:3]), (bits, E, I, H, I, 0, *u[:3])
        Wg, Wu = g[3], u[3]
    d = stacked(rng, E, H, I, bits, 0.125)
    r = stacked(rng, 1, E, H, rbits, 0.25)
    sg, su, sd = (stacked(rng, 1, Is, H, bits, 0.25), stacked(rng, 1, Is, H, bits, 0.25),
                  stacked(rng, 1, H, Is, bits, 0.125))
    sgate = stacked(rng, 1, 1, H, rbits, 0.125)
    mats = [(rbits, 0, E, H, E, 0, *r[:3]), gate, up, (bits, E, H, I, H, 0, *d[:3]),
            (bits, 0, Is, H, Is, 0, *sg[:3]), (bits, 0, Is, H, Is, 0, *su[:3]), (bits, 0, H, Is, H, 0, *sd[:3]),
            (rbits, 0, 1, H, 1, 0, *sgate[:3])]
    f32 = dict(R=r[3][0], Wg=Wg, Wu=Wu, Wd=d[3], Sg=sg[3][0], Su=su[3][0], Sd=sd[3][0], sgate=sgate[3][0])
    return mats, f32


def inputs(seed, T, H):
    rng = np.random.default_rng(seed + 1000)
    xn = bf16_bits(rng.standard_normal((T, H)).astype(np.float32))
    x = rng.standard_normal((T, H)).astype(np.float32)
    return xn, x


def random_routes(rng, T, E, k):
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    w = rng.random((T, k)).astype(np.float32) + np.float32(0.05)
    return ids, (w / w.sum(1, keepdims=True)).astype(np.float32)


def call(mode, mats, E, k, H, I, Is, xn, x, ids=None, w=None, tile=0, order=0, seed=0, skew=0, tensor_ops=False,
         path="auto", **fuse):
    T = xn.shape[0]
    ids = np.zeros((T, k), np.int32) if ids is None else np.ascontiguousarray(ids, np.int32)
    w = np.zeros((T, k), np.float32) if w is None else np.ascontiguousarray(w, np.float32)
    return _kernels().moe(mode, mats, E, k, H, I, Is, xn, x, ids, w, tile_rows=tile, order=order, seed=seed,
                       weight_skew=skew, tensor_ops=tensor_ops, path=path, **fuse)


def check_close(got, want, rel=3e-3):
    """Errors relative to the output's scale: fp32 accumulation in another order, and the bf16 rounding of
    h that can land one ulp apart. A wrong expert, weight or missing term is an O(1) error."""
    assert np.all(np.isfinite(got)), "unwritten or non-finite outputs"
    err = np.abs(got.astype(np.float64) - want)
    scale = np.abs(want).max()
    assert err.max() <= rel * scale, f"max err {err.max()} (scale {scale}) at {np.unravel_index(err.argmax(), err.shape)}"
    return float(err.max() / scale)
