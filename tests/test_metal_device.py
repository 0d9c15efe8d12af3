"""The Metal backend's device layer: the Encoder's derived barriers (on a fake device), the emulated device
(library loads, every kernels.def row present, counters, dependent dispatches under every schedule), and
the embedded sources device_metal.mm compiles.

Encoder rule (csrc/backends/metal/device.cpp): a dispatch ends the current stage (barrier first) when it
reads a range the stage wrote, or writes a range the stage read or wrote; reads never conflict."""
import re
from pathlib import Path

import numpy as np
import pytest

from lily._core import kernels

ROOT = Path(__file__).resolve().parents[1]
B = 1 << 16  # fake buffer size


def trace(*dispatches, sizes=(B, B, B)):
    events, n, barriers = kernels.encoder_trace(list(sizes), [list(d) for d in dispatches])
    assert n == sum(1 for d in dispatches if d) and barriers == events.count("barrier")
    return events


D, BAR = "dispatch", "barrier"


@pytest.mark.parametrize("first,second,fenced", [
    ("w", "r", True),    # read after write
    ("r", "w", True),    # write after read
    ("w", "w", True),    # write after write
    ("r", "r", False),   # read after read
    ("rw", "r", True),
    ("r", "rw", True),
])
def test_hazards_on_one_range(first, second, fenced):
    ev = trace([(0, 0, 0, first)], [(0, 0, 0, second)])
    assert ev == ([D, BAR, D] if fenced else [D, D])


def test_disjoint_ranges_and_buffers_need_no_barrier():
    assert trace([(0, 0, 100, "w")], [(0, 100, 100, "r")], [(1, 0, 0, "w")], [(0, 4096, 0, "w")]) == [D] * 4
    # adjacent and overlapping by one byte
    assert trace([(0, 0, 100, "w")], [(0, 99, 1, "r")]) == [D, BAR, D]
    # bytes = 0 extends to the end of the buffer
    assert trace([(0, 1000, 0, "w")], [(0, B - 1, 1, "r")]) == [D, BAR, D]


def test_stage_resets_after_barrier():
    # w0; r0 (fence); r0 again: same stage as the first reader, no second fence; w1 then r1: fence.
    assert trace([(0, 0, 0, "w")], [(0, 0, 0, "r")], [(0, 0, 0, "r"), (2, 0, 0, "w")], [(1, 0, 0, "w")],
                 [(1, 0, 0, "r")]) == [D, BAR, D, D, D, BAR, D]
    # a write inside one stage, read two stages later: no fence needed (the intervening barrier ordered it)
    assert trace([(0, 0, 0, "w")], [(1, 0, 0, "w")], [(1, 0, 0, "r")], [(0, 0, 0, "r")]) == [D, D, BAR, D, D]


def test_explicit_barriers():
    assert trace([], [(0, 0, 0, "r")], [], [], [(0, 0, 0, "r")]) == [D, BAR, D]  # empty stages dropped


def test_threadgroup_memory_over_32k_is_refused_with_the_kernel_named():
    name = kernels.kernel_table()[0][1]  # the trace encoder dispatches KernelId 0
    assert trace([(0, 0, 0, "r")]) == [D]
    assert kernels.encoder_trace([B], [[(0, 0, 0, "r")]], threadgroup_bytes=24576, static_threadgroup_bytes=8192)[1] == 1
    with pytest.raises(ValueError, match=rf"{name}: 8192 bytes of static threadgroup memory \+ 24592 set by the host "
                                         r"exceed the 32768-byte limit"):
        kernels.encoder_trace([B], [[(0, 0, 0, "r")]], threadgroup_bytes=24577, static_threadgroup_bytes=8192)
    with pytest.raises(ValueError, match=r"0 bytes of static threadgroup memory \+ 32784 set by the host"):
        kernels.encoder_trace([B], [[(0, 0, 0, "r")]], threadgroup_bytes=32769)


def test_binding_past_the_end_raises():
    with pytest.raises(IndexError, match="exceeds buffer"):
        trace([(0, 10, 100, "r")], sizes=(64,))


def test_embedded_sources_match_metal_dir():
    emb = dict(kernels.embedded_sources())
    disk = {p.name: p.read_text() for p in (ROOT / "metal").iterdir() if p.suffix in (".metal", ".h", ".def")}
    assert emb == disk
    for name in emb:
        if name.endswith(".metal"):
            unit = kernels.metal_translation_unit(name)
            assert not re.search(r'^\s*#\s*include\s*"', unit, re.M), f"{name}: quoted include left"
            assert "#pragma once" not in unit
            if '#include "lily_args.h"' in emb[name]:
                assert "LILY_QGROUP" in unit


# ---------------------------------------------------------------- the emulated device

def test_emu_library_loads(kernel_device):
    if kernel_device != "metal-emu":
        pytest.skip("the emulated library's contents (this run uses the real Metal device)")
    names = kernels.emu_kernel_names()
    assert names == sorted(names)
    table = {n for _, n in kernels.kernel_table()}
    assert table <= set(names), f"missing from the library: {sorted(table - set(names))}"
    assert set(names) <= table, f"in the library without a kernels.def row: {sorted(set(names) - table)}"
    assert kernels.check_emu_device() == "metal-emu"


def test_missing_library_names_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("LILY_METAL_EMU", str(tmp_path / "absent.so"))
    assert not kernels.available()
    with pytest.raises(RuntimeError, match="boost"):
        kernels.check_emu_device()


def bf16_bits(a):
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)


def bf16_float(b):
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


@pytest.mark.parametrize("order", [0, 1, 2])
def test_dependent_dispatches_and_counters(order, kernel_device):
    rng = np.random.default_rng(7 + order)
    V, H, T = 50, 1024, 3  # x: 3 * 1024 * 4 = 12 KiB = 3 pages exactly
    q = rng.integers(0, 256, (V, H), dtype=np.uint8)  # 8-bit codes: element j is byte j of the row
    scales = bf16_bits(0.01 * rng.standard_normal((V, H // 64)) + 0.02)
    biases = bf16_bits(0.5 * rng.standard_normal((V, H // 64)))
    tokens = np.array([5, 0, 49], dtype=np.int32)
    w = (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)
    r = kernels.device_probe(q, scales, biases, tokens, w, 1e-6, order=order, seed=123)
    E = (np.repeat(bf16_float(scales), 64, axis=1) * q + np.repeat(bf16_float(biases), 64, axis=1)).astype(np.float32)
    x = E[tokens]
    np.testing.assert_allclose(r["x"], x, rtol=1e-6, atol=1e-6)
    ref = x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(bf16_float(r["out"]), ref, rtol=1e-2, atol=1e-2)
    c = r["counters"]
    assert (c["dispatches"], c["stages"], c["command_buffers"], c["cpu_waits"]) == (2, 2, 1, 1)
    page = 4096
    # x is written by embed and read by rmsnorm: 3 pages each way; xn written: T*H*2 = 6 KiB -> 2 pages.
    assert c["bytes_written"]["activations"] == 12 * 1024 + 6 * 1024
    assert c["bytes_read"]["activations"] == 12 * 1024
    # weights: 3 code rows (1 KiB each), their scales and biases (32 B each), the norm vector (4 KiB); a
    # touched page counts whole (inside the bound range).
    assert 3 * 1024 + H * 4 <= c["bytes_read"]["weights"] <= 9 * page + H * 4
    assert c["bytes_read"]["io"] == tokens.nbytes
    assert c["bytes_written"]["weights"] == 0


# ---------------------------------------------------------------- the Metal backend on the emulated device

def test_metal_emu_backend_matches_reference(gpu_backend):
    from lily.engine import Engine
    ref = Engine.from_pretrained("synthetic:tiny", "reference")
    emu = Engine.from_pretrained("synthetic:tiny", gpu_backend, prefill_chunk=8)
    assert emu._core.backend == gpu_backend
    ids = [1, 5, 9, 200, 3, 7, 11, 13, 17, 19, 23]  # two prefill chunks (8 + 3)
    a, b = ref.logits(ids), emu.logits(ids)
    # bf16 activations between kernels: a few percent of the logit range, same greedy tokens.
    assert np.abs(a - b).max() <= 0.05 * np.abs(a).max()
    assert (a.argmax(1) == b.argmax(1)).mean() >= 0.9
    c = emu.counters()["prefill"]
    assert c["total"]["command_buffers"] == 2 and c["last"]["command_buffers"] == 1
    assert c["last"]["cpu_waits"] == 1  # read_logits is the only wait
    assert c["last"]["bytes_read"]["weights"] > 0 and c["last"]["bytes_written"]["weights"] == 0
    assert 1 < c["last"]["stages"] <= c["last"]["dispatches"]
    # decode steps continue a session (and its KV cache) one token per command buffer
    s_ref, s_emu = ref.new_session(), emu.new_session()
    ref.prefill(ids[:5], s_ref), emu.prefill(ids[:5], s_emu)
    for t in ids[5:8]:
        la, lb = ref.prefill([t], s_ref), emu.prefill([t], s_emu)
        assert np.abs(la - lb).max() <= 0.05 * np.abs(la).max()
    d = emu.counters()["decode"]
    assert d["last"]["command_buffers"] == 1 and d["last"]["cpu_waits"] == 1
    assert d["total"]["command_buffers"] == 3
    assert d["last"]["bytes_read"]["kv"] > 0 and d["last"]["bytes_written"]["state"] > 0


# The library names of $LILY_METAL_FAIL_LIBRARY: kernels.def families on the emulator, metal/ files on a Mac.
COMMON_LIBRARY = {"metal-emu": "common", "metal": "common.metal"}
DENSE_LIBRARY = {"metal-emu": "dense", "metal": "qgemm.metal"}


def test_failed_tensor_library_falls_back_to_simdgroup(monkeypatch, capfd, gpu_backend):
    """A Metal 4 tensor-op library that fails (forced: $LILY_METAL_FAIL_LIBRARY=dense@4.0 fails the dense
    library at MSL 4.0 only) costs one warning and the tensor kernels, not the backend: prefill runs the
    simdgroup GEMMs and still matches the reference. Without the forced failure the same run uses tensor ops."""
    from lily.engine import Engine
    monkeypatch.setenv("LILY_METAL_EMU_TENSOR_OPS", "1")
    if gpu_backend == "metal" and not kernels.device_report()["tensor_ops"]:
        pytest.skip("this Mac's GPU has no Metal 4 tensor ops to fall back from")
    ref = Engine.from_pretrained("synthetic:tiny", "reference")
    ids = [1, 5, 9, 200, 3, 7, 11, 13, 17, 19, 23]
    a = ref.logits(ids)

    def prefill_kernels(engine):
        b = engine.logits(ids)
        assert np.abs(a - b).max() <= 0.05 * np.abs(a).max()
        assert (a.argmax(1) == b.argmax(1)).mean() >= 0.9
        return set(engine.counters()["prefill"]["total"]["kernels"])

    capfd.readouterr()
    with_tensor = prefill_kernels(Engine.from_pretrained("synthetic:tiny", gpu_backend, prefill_chunk=8))
    assert any("tensor" in k for k in with_tensor), with_tensor
    assert "warning" not in capfd.readouterr().err

    monkeypatch.setenv("LILY_METAL_FAIL_LIBRARY", DENSE_LIBRARY[gpu_backend] + "@4.0")
    fallen_back = prefill_kernels(Engine.from_pretrained("synthetic:tiny", gpu_backend, prefill_chunk=8))
    assert not any("tensor" in k for k in fallen_back), fallen_back
    assert any(k.startswith("qgemm_") for k in fallen_back), fallen_back
    warnings = [line for line in capfd.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "tensor ops turned off" in warnings[0] and DENSE_LIBRARY[gpu_backend] in warnings[0], \
        warnings


def test_failed_library_names_its_family(monkeypatch, kernel_device):
    """A library that fails at every version leaves the others usable and refuses its own kernels, naming the
    kernel, its family and the failure."""
    common = COMMON_LIBRARY[kernel_device]
    monkeypatch.setenv("LILY_METAL_FAIL_LIBRARY", common)
    report = kernels.device_report()
    status = {lib["library"]: lib for lib in report["libraries"]}
    assert "forced to fail" in status[common]["error"] and status[common]["pipelines"] == 0
    assert all(not lib["error"] and lib["pipelines"] == lib["kernels"] > 0
               for name, lib in status.items() if name != common), status
    rng = np.random.default_rng(3)
    with pytest.raises(RuntimeError, match=r"embed_q8_f32 \(family common\).*forced to fail"):
        kernels.device_probe(rng.integers(0, 256, (4, 64), dtype=np.uint8), np.ones((4, 1), np.uint16),
                             np.zeros((4, 1), np.uint16), np.array([1], np.int32), np.ones(64, np.float32), 1e-6)
