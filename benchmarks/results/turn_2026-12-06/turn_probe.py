"""Where a one-token turn's fixed costs go (scratch): state copies, one-token steps on a new state (graphs
captured + updated) against steps on a state whose graphs exist, and the Session-level turn."""
import statistics, time, sys
import numpy as np
import lily

e = lily.Engine.from_pretrained(sys.argv[1], backend="cuda")
core = e._core
rng = np.random.default_rng(7)
for c in (128, 4096):
    ids = rng.integers(0, e.config.vocab_size, c).tolist()
    ctx = e.new_session(); e.prefill(ids, ctx)
    e.generate(ids + [11], session=ctx.fork(), max_tokens=8, temperature=0, stop=None)  # warm
    rows = {k: [] for k in ("clone", "clone+sync", "feed1_new", "feed2_new", "feed3", "feed4", "feed5", "turn", "turn_again", "gen8")}
    def t(k, f):
        t0 = time.perf_counter(); r = f(); rows[k].append((time.perf_counter() - t0) * 1e3); return r
    tok = lambda x: np.array([x], np.int32)
    for i in range(5):
        s = t("clone", lambda: core.clone_session(ctx._core))
        s2 = core.clone_session(ctx._core); t("clone+sync", lambda: core.feed(s2, tok(5), logits=True))
        t("feed1_new", lambda: core.feed(s, tok(11), logits=True))
        t("feed2_new", lambda: core.feed(s, tok(12), logits=True))
        t("feed3", lambda: core.feed(s, tok(13), logits=True))
        t("feed4", lambda: core.feed(s, tok(14), logits=True))
        t("feed5", lambda: core.feed(s, tok(15), logits=True))
        f = ctx.fork()
        t("turn", lambda: e.generate(ids + [11], session=f, max_tokens=1, temperature=0, stop=None))
        t("turn_again", lambda: e.generate(ids + [11, 12], session=f, max_tokens=1, temperature=0, stop=None))
        f2 = ctx.fork()
        t("gen8", lambda: e.generate(ids + [11], session=f2, max_tokens=8, temperature=0, stop=None))
        del s, s2, f, f2
    print(f"context {c}: " + "  ".join(f"{k} {statistics.median(v):.2f}" for k, v in rows.items()), flush=True)
