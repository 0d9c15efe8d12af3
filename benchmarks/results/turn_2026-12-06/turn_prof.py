import cProfile, pstats, sys, time
import numpy as np
import lily
e = lily.Engine.from_pretrained(sys.argv[1], backend="cuda")
rng = np.random.default_rng(7)
ids = rng.integers(0, e.config.vocab_size, 4096).tolist()
ctx = e.new_session(); e.prefill(ids, ctx)
for _ in range(3):
    e.generate(ids + [11], session=ctx.fork(), max_tokens=1, temperature=0, stop=None)
forks = [ctx.fork() for _ in range(20)]
pr = cProfile.Profile()
t0 = time.perf_counter()
pr.enable()
for f in forks:
    e.generate(ids + [11], session=f, max_tokens=1, temperature=0, stop=None)
pr.disable()
print(f"{(time.perf_counter() - t0) / 20 * 1e3:.2f} ms a turn (profiled)")
pstats.Stats(pr).sort_stats("tottime").print_stats(18)
