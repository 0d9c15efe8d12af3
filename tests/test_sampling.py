"""The C++ sampler (csrc/core/sampling.cpp) against numpy computations from the same logits: the processed
distribution exactly, draws statistically (total variation and chi-square over many draws), penalties exactly,
seeded determinism, logprobs."""
import numpy as np
import pytest

from lily import _core

V = 64
DRAWS = 200_000


def params(**kw):
    p = _core.SamplingParams()
    for k, v in kw.items():
        setattr(p, k, v)
    return p


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def expected(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The documented order: temperature -> top_k -> top_p -> min_p, in float64."""
    l = logits.astype(np.float64) / temperature
    keep = np.ones(len(l), bool)
    if top_k:
        keep &= l >= np.sort(l)[::-1][top_k - 1]
    p = np.where(keep, softmax(np.where(keep, l, -np.inf)), 0.0)
    if top_p < 1:
        order = sorted(np.flatnonzero(keep), key=lambda i: (-p[i], i))
        before = np.cumsum([0.0] + [p[i] for i in order])[:-1]
        kept = [i for i, b in zip(order, before) if b < top_p]
        keep = np.zeros(len(l), bool)
        keep[kept] = True
        p = np.where(keep, p, 0.0) / p[keep].sum()
    if min_p > 0:
        keep &= p >= min_p * p.max()
        p = np.where(keep, p, 0.0) / p[keep].sum()
    return p


CASES = [dict(temperature=1.0), dict(temperature=0.5), dict(temperature=1.7), dict(top_k=5),
         dict(top_p=0.8), dict(min_p=0.1), dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_distribution_matches_numpy(case, rng):
    logits = (rng.standard_normal(V) * 2).astype(np.float32)
    want = expected(logits, **case)
    s = _core.Sampler(params(seed=int(rng.integers(1 << 62)), **case), V)
    got = s.probabilities(logits)[0]
    np.testing.assert_allclose(got, want, atol=1e-6)
    draws = np.asarray(s.sample_many(logits, DRAWS))
    freq = np.bincount(draws, minlength=V) / DRAWS
    assert np.all(freq[want == 0] == 0), "a filtered token was drawn"
    tv = 0.5 * np.abs(freq - want).sum()
    assert tv < 0.01, tv
    # chi-square over tokens with expected count >= 5
    m = want * DRAWS >= 5
    chi2 = (((freq[m] - want[m]) * DRAWS) ** 2 / (want[m] * DRAWS)).sum()
    dof = max(m.sum() - 1, 1)
    assert chi2 < dof + 6 * np.sqrt(2 * dof), (chi2, dof)  # ~6 sigma of the chi-square's spread


def test_greedy_is_first_maximum():
    logits = np.array([0, 3, 1, 3, 2], np.float32)
    s = _core.Sampler(params(temperature=0.0), 5)
    assert s.sample(logits).token == 1 and s.draws == 0  # greedy draws nothing


def test_penalties_exact(rng):
    logits = (rng.standard_normal(V) * 2).astype(np.float32)
    prompt = [3, 7, 7, 11]
    gen = [7, 20, 20, 20, 5]
    p = params(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25)
    s = _core.Sampler(p, V, prompt)
    for t in gen:
        s.accept(t)
    l = logits.astype(np.float64).copy()
    for t in set(prompt) | set(gen):  # HF: prompt + generated, each distinct token once
        l[t] = l[t] / 1.3 if l[t] > 0 else l[t] * 1.3
    for t in set(gen):  # OpenAI: generated only
        l[t] -= 0.25 * gen.count(t) + 0.5
    np.testing.assert_allclose(s.probabilities(logits)[0], softmax(l), atol=1e-6)
    # greedy sees the penalised logits too
    g = _core.Sampler(params(temperature=0.0, repetition_penalty=100.0), V, [int(np.argmax(logits))])
    assert g.sample(logits).token == int(np.argsort(logits)[-2]) or logits.max() <= 0


def test_seed_determinism(rng):
    logits = (rng.standard_normal(V)).astype(np.float32)
    a = _core.Sampler(params(seed=42, top_p=0.9), V).sample_many(logits, 500)
    b = _core.Sampler(params(seed=42, top_p=0.9), V).sample_many(logits, 500)
    c = _core.Sampler(params(seed=43, top_p=0.9), V).sample_many(logits, 500)
    assert a == b and a != c


def test_logprobs_are_the_raw_log_softmax(rng):
    logits = (rng.standard_normal(V) * 3).astype(np.float32)
    s = _core.Sampler(params(temperature=0.5, top_k=3, logprobs=True, top_logprobs=4, seed=1), V)
    c = s.sample(logits)
    lsm = np.log(softmax(logits.astype(np.float64)))
    assert abs(c.logprob - lsm[c.token]) < 1e-5
    order = np.argsort(-lsm, kind="stable")[:4]
    assert [t for t, _ in c.top] == order.tolist()
    np.testing.assert_allclose([lp for _, lp in c.top], lsm[order], atol=1e-5)


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(min_p=2.0),
                                 dict(top_k=-1), dict(repetition_penalty=0.0)])
def test_invalid_parameters_are_rejected(bad):
    with pytest.raises(ValueError, match="sampling"):
        _core.Sampler(params(**bad), V)
