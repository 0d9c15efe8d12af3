"""NumPy reference of the gdn family (metal/gdn.metal): the Gated DeltaNet mixer of docs/model.md, the same math
as csrc/backends/reference/reference.cpp gdn(), with the bf16 roundings of the Metal path (the conv outputs q̂, k̂
and v are stored bf16 between kernels; the output is bf16). Everything else is fp32.

Shapes: T rows; n_k key heads, n_v value heads, d_k / d_v head dims; C = 2·n_k·d_k + n_v·d_v conv channels
(q ‖ k ‖ v); k_c = 4 conv taps.
  qkv [T, C], z [T, n_v·d_v], b, a [T, n_v]     activations (bf16 values held in f32)
  conv_w [C, k_c], A_log, dt_bias [n_v], norm_w [d_v]
  conv_state [k_c − 1, C] (oldest row first), rec_state [n_v, d_k, d_v]
"""
import numpy as np

from .bf16 import bf16_bits, bf16_float, bf16_round  # noqa: F401 (re-exported)

F32 = np.float32


def silu(x):
    x = x.astype(F32)
    return (x / (F32(1) + np.exp(-x))).astype(F32)


def sigmoid(x):
    return (F32(1) / (F32(1) + np.exp(-x.astype(F32)))).astype(F32)


def softplus(x):
    x = x.astype(F32)
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20)))).astype(F32)


def gates(b, a, A_log, dt_bias):
    """b, a [T, n_v] -> β, α [T, n_v]."""
    beta = sigmoid(b)
    alpha = np.exp(-np.exp(A_log.astype(F32)) * softplus(a + dt_bias.astype(F32))).astype(F32)
    return beta, alpha


def conv_silu(qkv, conv_w, conv_state):
    """Causal depthwise conv over [conv_state ‖ qkv] + SiLU -> (c [T, C], new conv_state [k_c − 1, C])."""
    T = qkv.shape[0]
    K = conv_w.shape[1]
    u = np.concatenate([conv_state.astype(F32), qkv.astype(F32)], axis=0)
    acc = np.zeros(qkv.shape, F32)
    for j in range(K):
        acc = (acc + conv_w[:, j].astype(F32) * u[j:j + T]).astype(F32)
    return silu(acc), u[T:].copy()


def gdn(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_state, rec_state, nk, nv, dk, dv, eps):
    """One pass over T rows (chunking does not change the result). Returns (out f32 [T, n_v·d_v] before the
    final bf16 store, new conv_state, new rec_state)."""
    T = qkv.shape[0]
    Kd = nk * dk
    c, conv_state = conv_silu(qkv, conv_w, conv_state)
    qs = c[:, :Kd].reshape(T, nk, dk)
    ks = c[:, Kd:2 * Kd].reshape(T, nk, dk)
    vs = bf16_round(c[:, 2 * Kd:]).reshape(T, nv, dv)

    def l2(x, scale):
        inv = (F32(1) / np.sqrt((x * x).sum(-1, keepdims=True, dtype=F32) + F32(1e-6))).astype(F32)
        return bf16_round(x * (inv * F32(scale)))

    qs = l2(qs, 1.0 / np.sqrt(F32(dk)))
    ks = l2(ks, 1.0)
    beta, alpha = gates(b, a, A_log, dt_bias)
    S = rec_state.astype(F32).copy()
    o = np.zeros((T, nv, dv), F32)
    ratio = nv // nk
    for h in range(nv):
        kh = h // ratio
        Sh = S[h]
        for t in range(T):
            Sh *= alpha[t, h]
            m = ks[t, kh] @ Sh
            delta = beta[t, h] * (vs[t, h] - m)
            Sh += np.outer(ks[t, kh], delta)
            o[t, h] = qs[t, kh] @ Sh
    ms = (o * o).mean(-1, keepdims=True, dtype=F32)
    y = o * (F32(1) / np.sqrt(ms + F32(eps))) * norm_w.astype(F32) * silu(z.reshape(T, nv, dv))
    return y.reshape(T, nv * dv).astype(F32), conv_state, S


# ---- the kernel cases: tests/test_gdn.py and `lily doctor` run them on the device lily._core.kernels chose

EPS = 1e-6


def _kernels():
    from .._core import kernels
    return kernels


def make_inputs(T, nk, nv, dk, dv, seed):
    """Random, never-zero inputs and states (bf16 activations as bf16-representable f32)."""
    rng = np.random.default_rng(seed)
    C, V = 2 * nk * dk + nv * dv, nv * dv
    f = np.float32
    p = dict(
        qkv=bf16_round(rng.standard_normal((T, C)).astype(f)),
        z=bf16_round(rng.standard_normal((T, V)).astype(f)),
        b=bf16_round(rng.standard_normal((T, nv)).astype(f)),
        a=bf16_round(rng.standard_normal((T, nv)).astype(f) * 2),
        conv_w=(rng.standard_normal((C, 4)) * 0.5).astype(f),
        A_log=rng.uniform(-2, 1, nv).astype(f),
        dt_bias=rng.uniform(-1, 1, nv).astype(f),
        norm_w=rng.uniform(0.5, 1.5, dv).astype(f),
        conv_state=rng.standard_normal((3, C)).astype(f),
        rec_state=(rng.standard_normal((nv, dk, dv)) * 0.3).astype(f),
    )
    # one row driving the softplus past torch's threshold and one far below it
    p["a"][0, 0] = 30.0
    if T > 1:
        p["a"][1, -1] = -30.0
    return p


def run(p, nk, nv, dk, dv, calls, order=0, seed=0, twin=False):
    bits = {k: bf16_bits(p[k]) for k in ("qkv", "z", "b", "a")}
    r = _kernels().gdn_run(bits["qkv"], bits["z"], bits["b"], bits["a"], p["conv_w"], p["A_log"], p["dt_bias"],
                        p["norm_w"], p["conv_state"], p["rec_state"], nk, nv, dk, dv, EPS, calls, order, seed, twin)
    r["out_f"] = bf16_float(r["out"])
    return r


def reference(p, nk, nv, dk, dv):
    return gdn(p["qkv"], p["z"], p["b"], p["a"], p["conv_w"], p["A_log"], p["dt_bias"], p["norm_w"],
                   p["conv_state"], p["rec_state"], nk, nv, dk, dv, EPS)


def check_against_reference(r, p, nk, nv, dk, dv):
    """The state is fp32 all the way (only summation order differs from numpy); the output is one bf16 store
    of the same fp32 value, so within one bf16 ulp (2^-7 relative) per element. A wrong gate, head mapping,
    conv tap or missed row moves results by O(1e-1) relative."""
    out, conv_state, rec_state = reference(p, nk, nv, dk, dv)
    np.testing.assert_array_equal(r["conv_state"], conv_state)  # pure data movement: exact
    np.testing.assert_allclose(r["rec_state"], rec_state, rtol=0, atol=1e-5 * float(np.abs(rec_state).max()))
    assert np.isfinite(r["out_f"]).all()
    np.testing.assert_allclose(r["out_f"], out, rtol=2.0 ** -7, atol=1e-6)
    return float(np.abs(r["out_f"] - out).max() / np.abs(out).max())  # relative to the output's scale
