"""Shared pytest fixtures: tiny reference models (see tests/tinymodels.py) and a seeded rng.

Fixtures (all model fixtures are session-scoped; builds are lazy and cached on disk under
``$LILY_TEST_MODELS`` or ``~/.cache/lily-test-models``):

* ``model_dir(geom, kind) -> Path``      -- :func:`tinymodels.get_model`
* ``geom``                               -- parametrised over ``DEFAULT_GEOMETRIES`` (ids = tag)
* ``base_geom`` / ``peaked_geom``        -- :data:`tinymodels.BASE` / :data:`tinymodels.PEAKED`
* ``tokenizer_dir``                      -- directory with the tiny tokenizer files
* ``prompt_ids``                         -- the 64-token ChatML prompt (list of ints)
* ``ref_logits(geom, kind, prompt_ids, decode_ids=None, dtype=None)`` -- memoised reference
  logits: ``hf_*`` kinds via :func:`tinymodels.hf_logits`, ``mlx_*`` via
  :func:`tinymodels.mlx_logits`; returns ``(prefill [T, V], decode [S, V])`` float32 (treat as
  read-only, they are shared)
* ``gpu_backend``                        -- the GPU backend the backend-generic tests run on: ``metal-emu``
  (the MSL emulator, everywhere), or ``$LILY_TEST_BACKEND`` (``metal`` on a Mac, ``cuda`` on an NVIDIA
  GPU); skips with the reason when that backend is not built or has no device
* ``kernel_device``                      -- the device of the kernel-level tests (``lily._core.kernels``),
  chosen the same way (``metal-emu`` or ``metal``); skips like ``gpu_backend``
* ``rng``                                -- ``np.random.Generator`` with a fresh seed per test;
  the seed is printed and attached to the failure report; set ``LILY_TEST_SEED`` to replay.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tinymodels  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running test")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    seed = getattr(item, "_lily_rng_seed", None)
    if seed is not None and rep.failed:
        rep.sections.append(("rng seed", f"rerun with LILY_TEST_SEED={seed}"))


def pytest_terminal_summary(terminalreporter):
    if tinymodels.BUILD_TIMES:
        terminalreporter.write_sep("-", "tiny model builds (seconds)")
        for (name, kind), t in sorted(tinymodels.BUILD_TIMES.items()):
            terminalreporter.write_line(f"{t:7.2f}  {kind:22s} {name}")


@pytest.fixture
def rng(request):
    env = os.environ.get("LILY_TEST_SEED")
    seed = int(env) if env else secrets.randbits(32)
    request.node._lily_rng_seed = seed
    print(f"rng seed: LILY_TEST_SEED={seed}")
    return np.random.default_rng(seed)


GPU_BACKEND = tinymodels.GPU_BACKEND


@pytest.fixture(scope="session")
def gpu_backend():
    """The one place a test learns which GPU backend it runs: every test that would hard-code "metal-emu"
    takes this instead, so the README's test command on a Mac (LILY_TEST_BACKEND=metal) or on an NVIDIA
    machine (LILY_TEST_BACKEND=cuda) runs the same assertions on real hardware."""
    import lily

    reason = lily.backend_unavailable(GPU_BACKEND)
    if reason:
        pytest.skip(f"backend {GPU_BACKEND!r}: {reason}")
    return GPU_BACKEND


@pytest.fixture(scope="session")
def byte_counting_backend(gpu_backend):
    """gpu_backend for the tests that assert bytes moved: only the emulator counts them (pages its kernels
    touch); a real GPU reports dispatches, stages and CPU waits but no bytes, so there these tests skip."""
    if gpu_backend != "metal-emu":
        pytest.skip(f"bytes moved are counted by the emulator only (metal-emu), not by {gpu_backend!r}")
    return gpu_backend


@pytest.fixture(scope="session")
def kernel_device(gpu_backend):
    """The device the kernel-level tests (lily._core.kernels) run on, chosen like gpu_backend: the emulator, or
    the real Metal device under LILY_TEST_BACKEND=metal; skips for a backend without Metal kernels."""
    from lily._core import kernels

    if gpu_backend not in ("metal-emu", "metal"):
        pytest.skip(f"the Metal kernel tests need backend metal or metal-emu, not {gpu_backend!r}")
    kernels.set_device(gpu_backend)
    return gpu_backend


@pytest.fixture(scope="session")
def model_dir():
    return tinymodels.get_model


@pytest.fixture(scope="session", params=tinymodels.DEFAULT_GEOMETRIES, ids=lambda g: g.tag)
def geom(request):
    return request.param


@pytest.fixture(scope="session")
def base_geom():
    return tinymodels.BASE


@pytest.fixture(scope="session")
def peaked_geom():
    return tinymodels.PEAKED


@pytest.fixture(scope="session")
def tokenizer_dir():
    return tinymodels.get_tokenizer_dir()


@pytest.fixture(scope="session")
def prompt_ids():
    return tinymodels.default_prompt_ids()


@pytest.fixture(scope="session")
def ref_logits():
    memo: dict = {}

    def get(geom, kind, prompt_ids, decode_ids=None, dtype=None):
        key = (geom, kind, tuple(int(t) for t in prompt_ids),
               tuple(int(t) for t in (() if decode_ids is None else decode_ids)), str(dtype))
        if key not in memo:
            path = tinymodels.get_model(geom, kind)
            if kind.startswith("mlx_"):
                assert dtype is None, "mlx references always run in float32"
                memo[key] = tinymodels.mlx_logits(path, prompt_ids, decode_ids)
            else:
                memo[key] = tinymodels.hf_logits(path, prompt_ids, decode_ids, dtype=dtype)
        return memo[key]

    return get
