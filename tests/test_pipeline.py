"""Decode with two command buffers in flight and token selection on the device (issue 6, item 2), on the
emulated Metal backend: the CPU commits step n + 1 before it waits for step n's token, and the GPU selects
every token — greedy or sampled with any of the sampling parameters — into the next step's input slot.

Pinned here: pipelined and one-step-at-a-time runs give bit-identical tokens and logits; a stop id or an early
close() undoes the step run ahead, leaving the session exactly as if it had never run (same tokens, position,
and next logits); the counters show the GPU never drained between steps (one drained wait per generation, the
last token's, against one per step without pipelining) and no CPU wait inside a step; sampled tokens are the
host Sampler's on the same logits rows (sampling.h semantics, seeded Philox).
"""
import threading
import time

import numpy as np
import pytest

import tinymodels as tm

lily = pytest.importorskip("lily")
_core = pytest.importorskip("lily._core")
pytestmark = pytest.mark.usefixtures("gpu_backend")

GEOM, KIND = tm.PEAKED, "mlx_q4_bf16"
_ENGINES: dict = {}


def engine_for(geom, pipeline=True):
    if (geom, pipeline) not in _ENGINES:
        _ENGINES[geom, pipeline] = lily.Engine.from_pretrained(tm.get_model(geom, KIND), backend=tm.GPU_BACKEND,
                                                               count_bytes=False, metal_options={"pipeline": pipeline})
    return _ENGINES[geom, pipeline]


def engine(pipeline=True):
    return engine_for(GEOM, pipeline)


@pytest.fixture(scope="module")
def prompt():
    return np.asarray(tm.default_prompt_ids()[:24], np.int32)


def params(**kw):
    p = _core.SamplingParams()
    p.temperature = 0.0
    for k, v in kw.items():
        setattr(p, k, v)
    return p


def run(e, prompt, max_tokens, stop_ids=(), p=None, stop_after=None):
    """(tokens, core session, generation): a generation on a fresh session, closed after `stop_after` tokens."""
    s = e._core.new_session()
    g = e._core.generation(s, prompt, max_tokens, list(stop_ids), p or params())
    out = []
    while not g.done:
        out.append(g.next().token)
        if stop_after is not None and len(out) == stop_after:
            g.close()
            break
    return out, s, g


def next_logits(e, s, token):
    return e._core.logits(s, np.asarray([token], np.int32))[0]


def decode_counts(e, key, since):
    return e.counters()["decode"]["total"][key] - since.get("decode", {}).get("total", {}).get(key, 0)


def test_pipelined_equals_one_step_at_a_time(prompt):
    on, off = engine(True), engine(False)
    a, sa, ga = run(on, prompt, 10)
    b, sb, gb = run(off, prompt, 10)
    assert ga.pipelined and not gb.pipelined
    assert len(a) == 10 and a == b
    assert sa.tokens == sb.tokens == list(prompt) + a[:-1]  # the last token is never fed
    assert sa.position == sb.position
    np.testing.assert_array_equal(next_logits(on, sa, a[-1]), next_logits(off, sb, b[-1]))


def test_counters_show_the_gpu_never_drains(prompt):
    steps = 8
    for pipeline, drained in ((True, 1), (False, steps - 1)):
        e = engine(pipeline)
        before = e.counters()
        out, _, _ = run(e, prompt, steps)
        assert len(out) == steps
        # steps - 1 decode steps (the last token is not fed), one token read each plus the prompt's
        assert decode_counts(e, "command_buffers", before) == steps - 1
        assert decode_counts(e, "cpu_waits_in_step", before) == 0
        # pipelined: only the last token's wait finds nothing queued behind it; otherwise every decode wait does
        assert decode_counts(e, "cpu_waits_drained", before) == drained, pipeline
        pre = e.counters()["prefill"]["total"]["cpu_waits_drained"] - before["prefill"]["total"]["cpu_waits_drained"]
        assert pre == (0 if pipeline else 1)


@pytest.mark.parametrize("how", ["stop_id", "close"])
def test_the_step_run_ahead_is_undone(prompt, how):
    """A stop id at token 4, or close() after it: the pipelined run committed the step feeding token 4 and must
    undo it — session tokens, position and the logits of the next token equal those of the unpipelined run."""
    check_run_ahead_undone(engine(True), engine(False), prompt, how)


def check_run_ahead_undone(on, off, prompt, how):
    """The pipelined engine `on` against the one-step-at-a-time `off` (also tests/test_cuda.py's)."""
    ref, _, _ = run(off, prompt, 12)
    stop = ref[4]
    assert stop not in ref[:4], "pick a prompt whose greedy run does not repeat the token"
    kw = dict(stop_ids=[stop]) if how == "stop_id" else dict(stop_after=5)
    a, sa, ga = run(on, prompt, 12, **kw)
    b, sb, gb = run(off, prompt, 12, **kw)
    assert a == b == ref[:5]
    assert ga.finish_reason == gb.finish_reason == ("stop" if how == "stop_id" else "cancelled")
    assert sa.tokens == sb.tokens == list(prompt) + ref[:4]
    assert sa.position == sb.position == len(prompt) + 4
    assert sa.decoded == sb.decoded == 4
    follow = 7 if ref[4] != 7 else 8
    np.testing.assert_array_equal(next_logits(on, sa, follow), next_logits(off, sb, follow))
    # and a later generation on the rolled-back session continues it exactly
    more = np.asarray([follow], np.int32)
    ca = on._core.generation(sa, more, 4, [], params())
    cb = off._core.generation(sb, more, 4, [], params())
    assert [ca.next().token for _ in range(4)] == [cb.next().token for _ in range(4)]


SAMPLED = [
    dict(temperature=0.9, seed=11),
    dict(temperature=1.3, top_k=12, top_p=0.9, min_p=0.02, seed=2**40 + 5),
    dict(temperature=1.1, top_p=0.7, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3, seed=7),
    dict(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5),  # greedy over penalised logits
]


@pytest.mark.parametrize("kw", SAMPLED, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_sampled_tokens_are_the_host_samplers_on_the_same_logits(prompt, kw):
    """The device's sample_token picks, step after step (its penalty tables updated on the device), the token the
    host Sampler picks from the same logits rows — replayed here through the same ops (the prompt's last row,
    then one decode step per token) — and pipelining does not change them."""
    e = engine_for(tm.BASE)
    n = 10
    got, _, g = run(e, prompt, n, p=params(**kw))
    assert g.pipelined and len(got) == n
    last = e.counters()["decode"]["last"]
    assert last["kernels"].get("sample_token") == 1 and "argmax_f32" not in last["kernels"], last["kernels"]
    off, _, _ = run(engine_for(tm.BASE, pipeline=False), prompt, n, p=params(**kw))
    assert off == got
    s = e._core.new_session()
    rows = [e._core.feed(s, prompt)[0]]
    rows += [e._core.logits(s, np.asarray([t], np.int32))[0] for t in got[:-1]]
    host = _core.Sampler(params(**kw), e.config.vocab_size, list(prompt))
    want = []
    for row in rows:
        c = host.sample(np.ascontiguousarray(row, np.float32))
        host.accept(c.token)
        want.append(c.token)
    assert got == want
    if kw["temperature"] > 0:
        assert len(set(got)) > 2  # the draws are not all one token: the comparison sees the sampler at work


def test_logprobs_come_from_each_steps_own_logits_row(prompt):
    """With a step always queued behind the one being read, each token's logprobs must come from its own step's
    logits row (one row per token slot), not from the step after it."""
    e = engine_for(tm.BASE)
    s = e._core.new_session()
    g = e._core.generation(s, prompt, 6, [], params(temperature=1.0, seed=3, logprobs=True, top_logprobs=3))
    choices = [g.next() for _ in range(6)]
    assert g.pipelined
    r = e._core.new_session()
    rows = [e._core.feed(r, prompt)[0]]
    rows += [e._core.logits(r, np.asarray([c.token], np.int32))[0] for c in choices[:-1]]
    for c, row in zip(choices, rows):
        lse = np.logaddexp.reduce(row.astype(np.float64))
        assert c.logprob == pytest.approx(row[c.token] - lse, abs=1e-5)
        top = np.argsort(-row, kind="stable")[:3]
        assert [t for t, _ in c.top] == top.tolist()


def test_a_cancel_flag_stops_the_prompt_between_chunks():
    """CancelFlag.set() from another thread (a server whose client went away) stops a long prompt before its next
    prefill chunk: Cancelled is raised, and the session holds exactly the chunks that ran."""
    e = lily.Engine.from_pretrained(tm.get_model(tm.BASE, KIND), backend=tm.GPU_BACKEND, count_bytes=False,
                                    prefill_chunk=4)
    ids = np.random.default_rng(9).integers(0, e.config.vocab_size, 400).astype(np.int32)
    flag = lily.CancelFlag()
    s = e._core.new_session()
    g = e._core.generation(s, ids, 4, [], params(), cancel=flag)

    def cancel_once_started():
        while s.position == 0:
            time.sleep(0.001)
        flag.set()

    t = threading.Thread(target=cancel_once_started)
    t.start()
    with pytest.raises(lily.Cancelled, match="cancelled after"):
        g.next()
    t.join()
    assert g.done and g.finish_reason == "cancelled"
    assert 0 < s.prefilled < len(ids) and s.prefilled % 4 == 0
    assert s.position == s.prefilled and s.tokens == ids[:s.prefilled].tolist()
    # a flag set before anything runs: nothing is fed; the Python stream raises it too
    flag2 = lily.CancelFlag()
    flag2.set()
    with pytest.raises(lily.Cancelled):
        list(e.stream(ids[:40].tolist(), max_tokens=2, cancel=flag2))
    sess = e.new_session()
    with pytest.raises(lily.Cancelled):
        list(e.stream(ids[:40].tolist(), max_tokens=2, cancel=flag2, session=sess))
    assert sess.position == 0
