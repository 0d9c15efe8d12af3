"""A state's clone when the CUDA block cache holds blocks of its sizes (warm: the clone before was dropped) and
when it holds none (cold: every earlier clone is still alive, as an agent's turn snapshots are), then forks and
one-token turns on a cold cache. Host milliseconds, medians (scratch: PYTHONPATH=src python3 cold_probe.py DIR)."""
import statistics, sys, time
import numpy as np
import lily

e = lily.Engine.from_pretrained(sys.argv[1], backend="cuda")
core = e._core
ids = np.random.default_rng(7).integers(0, e.config.vocab_size, 4096).tolist()
ctx = e.new_session()
e.prefill(ids, ctx)
e.generate(ids + [11], session=ctx.fork(), max_tokens=2, temperature=0, stop=None)  # graphs captured


def ms(f):
    t0 = time.perf_counter()
    r = f()
    return (time.perf_counter() - t0) * 1e3, r


warm, cold, fork, turn, alive = [], [], [], [], []
for _ in range(7):
    warm.append(ms(lambda: core.clone_session(ctx._core))[0])
for _ in range(20):
    t, s = ms(lambda: core.clone_session(ctx._core))
    cold.append(t), alive.append(s)
for _ in range(20):
    t, f = ms(ctx.fork)
    fork.append(t), alive.append(f)
    turn.append(ms(lambda: e.generate(ids + [11], session=f, max_tokens=1, temperature=0, stop=None))[0])
m = e.memory()
med = lambda xs: f"{statistics.median(xs):.2f}"
print(f"clone warm {med(warm)}  clone cold {med(cold)} (first {cold[0]:.2f})  fork cold {med(fork)}  "
      f"turn cold {med(turn)}  live {m['live_total'] / 2**30:.2f} GiB  cached {m['cached'] / 2**30:.2f} GiB")
