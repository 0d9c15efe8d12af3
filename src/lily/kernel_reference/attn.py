"""NumPy reference of the gated-attention family (docs/model.md, gated attention; the same math as
csrc/backends/reference/reference.cpp attn_prepare / attention), with the bf16 rounding points of the
Metal kernels made explicit so that tests can compare the kernels' bf16 outputs tightly.

Shapes: T rows, n_q query heads, n_kv KV heads, d head dim, r rotary dims, cap cache rows per KV head.
  q_gate [T, n_q, 2d] (query | gate per head), k, v [T, n_kv, d], k_cache, v_cache [n_kv, cap, d].
"""
import numpy as np

from .bf16 import bf16_bits, bf16_float, bf16_round  # noqa: F401 (re-exported)


def rms_norm(x, w, eps):
    """x [..., d] f32, w [d] (already 1 + w) -> f32."""
    x = x.astype(np.float32)
    inv = np.float32(1.0) / np.sqrt(np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32) + np.float32(eps))
    return (x * inv * w.astype(np.float32)).astype(np.float32)


def rope(x, positions, r, theta):
    """Half-split partial RoPE on the first r dims of x [T, heads, d]; positions [T]."""
    half = r // 2
    j = np.arange(half, dtype=np.float32)
    inv = np.float32(1.0) / np.power(np.float32(theta), (2 * j) / np.float32(r)).astype(np.float32)
    ang = (np.asarray(positions, dtype=np.float32)[:, None] * inv[None, :]).astype(np.float32)  # [T, half]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    y = x.astype(np.float32).copy()
    a, b = x[..., :half], x[..., half:r]
    y[..., :half] = a * c - b * s
    y[..., half:r] = b * c + a * s
    return y


def prepare(q_gate, k, v, q_norm, k_norm, pos, r, theta, eps):
    """-> (q [T, n_q, d], k_rows [T, n_kv, d], v_rows [T, n_kv, d]) as the kernel stores them (bf16-rounded)."""
    T, n_q, d2 = q_gate.shape
    d = d2 // 2
    positions = pos + np.arange(T)
    q = rope(rms_norm(q_gate[..., :d], q_norm, eps), positions, r, theta)
    kk = rope(rms_norm(k, k_norm, eps), positions, r, theta)
    return bf16_round(q), bf16_round(kk), bf16_round(v)


def attention(q, gate, k_cache, v_cache, pos):
    """Causal softmax(q·Kᵀ/√d)·V ⊙ σ(gate) in fp64 (the fp32 kernels must land within rounding of this).

    q, gate [T, n_q, d]; caches [n_kv, cap, d]; row t sees cache rows [0, pos + t]. -> [T, n_q·d] float32.
    """
    T, n_q, d = q.shape
    n_kv = k_cache.shape[0]
    group = n_q // n_kv
    out = np.zeros((T, n_q, d), dtype=np.float64)
    for t in range(T):
        n = pos + t + 1
        for h in range(n_q):
            K = k_cache[h // group, :n].astype(np.float64)
            V = v_cache[h // group, :n].astype(np.float64)
            s = K @ q[t, h].astype(np.float64) / np.sqrt(d)
            p = np.exp(s - s.max())
            o = (p / p.sum()) @ V
            out[t, h] = o / (1.0 + np.exp(-gate[t, h].astype(np.float64)))
    return out.reshape(T, n_q * d).astype(np.float32)


# ---- the kernel cases: tests/test_attn.py and `lily doctor` run them on the device lily._core.kernels chose

ORDERS = {"forward": 0, "reverse": 1, "random": 2}
THETA, EPS = 1e4, 1e-6
# bf16 outputs: one rounding of the output (2^-9 relative) plus fp32 accumulation; a wrong key, a missing
# rescale or a mask off by one row moves outputs by far more than this.
OUT_RTOL, OUT_ATOL = 8e-3, 2e-3


def _kernels():
    from .._core import kernels
    return kernels


def make_case(n_q, n_kv, d, r, T, pos, cap, seed):
    rng = np.random.default_rng(seed)
    bf = lambda a: bf16_bits(a.astype(np.float32))  # noqa: E731
    return dict(
        q_gate=bf(rng.standard_normal((T, n_q, 2 * d)) * 2.0),
        k=bf(rng.standard_normal((T, n_kv, d)) * 2.0),
        v=bf(rng.standard_normal((T, n_kv, d))),
        q_norm=(1.0 + 0.3 * rng.standard_normal(d)).astype(np.float32),
        k_norm=(1.0 + 0.3 * rng.standard_normal(d)).astype(np.float32),
        # pre-filled history at [0, pos); rows past pos + T hold garbage the kernels must never read into results
        k_cache=bf(rng.standard_normal((n_kv, cap, d)) * 2.0),
        v_cache=bf(rng.standard_normal((n_kv, cap, d))),
    )


def run(mode, case, n_q, n_kv, d, r, pos, order="forward", path="auto", split_block=0, seed=1):
    return _kernels().attn_run(mode, case["q_gate"], case["k"], case["v"], case["q_norm"], case["k_norm"],
                            case["k_cache"], case["v_cache"], n_q, n_kv, d, r, THETA, EPS, pos, path=path,
                            split_block=split_block, order=ORDERS[order], seed=seed)


def check_prepare(res, case, n_kv, d, r, T, pos):
    f = bf16_float
    q, k_rows, v_rows = prepare(f(case["q_gate"]), f(case["k"]), f(case["v"]), case["q_norm"], case["k_norm"],
                                  pos, r, THETA, EPS)
    # normed + roped values rounded once to bf16: equal up to one bf16 ulp where fp32 rounding straddles a tie
    np.testing.assert_allclose(f(res["q"]), q, rtol=2 ** -7, atol=1e-6)
    np.testing.assert_allclose(f(res["k_cache"][:, pos:pos + T]), k_rows.transpose(1, 0, 2), rtol=2 ** -7, atol=1e-6)
    assert np.array_equal(res["v_cache"][:, pos:pos + T], case["v"].transpose(1, 0, 2))
    for name in ("k_cache", "v_cache"):  # every other row untouched
        assert np.array_equal(res[name][:, :pos], case[name][:, :pos])
        assert np.array_equal(res[name][:, pos + T:], case[name][:, pos + T:])


def reference_out(res, case, d, pos):
    f = bf16_float
    return attention(f(res["q"]), f(case["q_gate"])[..., d:], f(res["k_cache"]), f(res["v_cache"]), pos)
