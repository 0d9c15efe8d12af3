"""mslemu, the MSL-on-CPU emulator (csrc/mslemu): shim semantics, schedules, diagnostics, byte counting.

The kernels live in tests/mslemu_cases/. They are built once per session through the CMake function the
project uses (lily_add_metal_emu_library), cached in the temp dir by a hash of the emulator's and the cases'
sources, and driven through the C ABI (csrc/mslemu/mslemu.h) with ctypes. Inputs are random, never zeros.
"""
import ctypes
import hashlib
import mmap
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMU_DIR = os.path.join(ROOT, "csrc", "mslemu")
CASES = os.path.join(ROOT, "tests", "mslemu_cases")
LIBRARY_SOURCES = ["kernels.metal", "bad_kernels.metal", "tensor_kernels.metal"]
PAGE = mmap.PAGESIZE
FORWARD, REVERSE, RANDOM = 0, 1, 2
ORDERS = [FORWARD, REVERSE, RANDOM]

# Mirrors tests/mslemu_cases/case_args.h.
FLOAT_OPS, UINT_OPS, BINS = 18, 11, 16
FC_HAS_BIAS, FC_MULTIPLIER = 3, 7

pytestmark = pytest.mark.skipif(
    not (shutil.which("cmake") and (shutil.which("clang++-19") or shutil.which("clang++"))),
    reason="mslemu needs cmake and clang++")


# ---------------------------------------------------------------------------------------------------------
# C ABI
# ---------------------------------------------------------------------------------------------------------
class Buffer(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("size", ctypes.c_uint64)]


class FunctionConstant(ctypes.Structure):
    _fields_ = [("index", ctypes.c_uint32), ("reserved", ctypes.c_uint32), ("value", ctypes.c_uint64)]


class DispatchDesc(ctypes.Structure):
    _fields_ = [("threadgroups", ctypes.c_uint32 * 3), ("threads", ctypes.c_uint32 * 3), ("grid", ctypes.c_uint32 * 3),
                ("buffers", ctypes.POINTER(Buffer)), ("nbuffers", ctypes.c_int),
                ("threadgroup_lengths", ctypes.POINTER(ctypes.c_uint32)), ("nthreadgroup", ctypes.c_int),
                ("constants", ctypes.POINTER(FunctionConstant)), ("nconstants", ctypes.c_int),
                ("order", ctypes.c_int), ("seed", ctypes.c_uint64), ("workers", ctypes.c_int),
                ("count_bytes", ctypes.c_int), ("bytes_read", ctypes.POINTER(ctypes.c_uint64)),
                ("bytes_written", ctypes.POINTER(ctypes.c_uint64))]


class KernelError(RuntimeError):
    pass


def dim3(v):
    v = tuple(v) if isinstance(v, (tuple, list)) else (v,)
    return (v + (1, 1, 1))[:3]


class Emu:
    def __init__(self, path):
        lib = self.lib = ctypes.CDLL(path)
        lib.mslemu_find_kernel.restype = ctypes.c_void_p
        lib.mslemu_find_kernel.argtypes = [ctypes.c_char_p]
        lib.mslemu_kernel_name.restype = ctypes.c_char_p
        lib.mslemu_library_error.restype = ctypes.c_char_p
        lib.mslemu_dispatch.argtypes = [ctypes.c_void_p, ctypes.POINTER(DispatchDesc), ctypes.c_char_p, ctypes.c_uint64]
        lib.mslemu_alloc.restype = ctypes.c_void_p
        lib.mslemu_alloc.argtypes = [ctypes.c_uint64]
        lib.mslemu_free.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
        assert lib.mslemu_abi_version() == 1
        assert lib.mslemu_library_error() is None

    def names(self):
        return [self.lib.mslemu_kernel_name(i).decode() for i in range(self.lib.mslemu_kernel_count())]

    def dispatch(self, name, threadgroups, threads, buffers, *, grid=None, tg_lengths=(), constants=None,
                 order=FORWARD, seed=1, workers=2, count_bytes=False):
        """Buffers are numpy arrays (or None for an unbound slot), read and written in place."""
        kernel = self.lib.mslemu_find_kernel(name.encode())
        if not kernel:
            raise KeyError(name)
        bufs = (Buffer * max(1, len(buffers)))(
            *[Buffer(b.ctypes.data, b.nbytes) if b is not None else Buffer(None, 0) for b in buffers])
        desc = DispatchDesc()
        desc.threadgroups[:] = dim3(threadgroups)
        desc.threads[:] = dim3(threads)
        desc.grid[:] = dim3(grid) if grid is not None else (0, 0, 0)
        desc.buffers, desc.nbuffers = bufs, len(buffers)
        lengths = (ctypes.c_uint32 * max(1, len(tg_lengths)))(*tg_lengths)
        desc.threadgroup_lengths, desc.nthreadgroup = lengths, len(tg_lengths)
        fcs = [FunctionConstant(i, 0, v) for i, v in (constants or {}).items()]
        fc_array = (FunctionConstant * max(1, len(fcs)))(*fcs)
        desc.constants, desc.nconstants = fc_array, len(fcs)
        desc.order, desc.seed, desc.workers = order, seed, workers
        read = (ctypes.c_uint64 * max(1, len(buffers)))()
        written = (ctypes.c_uint64 * max(1, len(buffers)))()
        desc.count_bytes, desc.bytes_read, desc.bytes_written = int(count_bytes), read, written
        err = ctypes.create_string_buffer(4096)
        if self.lib.mslemu_dispatch(kernel, ctypes.byref(desc), err, len(err)):
            raise KernelError(err.value.decode())
        return list(read)[:len(buffers)], list(written)[:len(buffers)]

    def guarded(self, array):
        """A copy of `array` in mslemu_alloc memory: its end touches an inaccessible page."""
        nbytes = array.nbytes
        ptr = self.lib.mslemu_alloc(nbytes)
        raw = (ctypes.c_char * nbytes).from_address(ptr)
        out = np.frombuffer(raw, dtype=array.dtype).reshape(array.shape)
        out[...] = array
        return out, lambda: self.lib.mslemu_free(ptr, nbytes)


# ---------------------------------------------------------------------------------------------------------
# Build (once per content hash)
# ---------------------------------------------------------------------------------------------------------
def content_hash():
    h = hashlib.sha256()
    for base in (EMU_DIR, CASES):
        for dirpath, dirnames, filenames in sorted(os.walk(base)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for f in sorted(filenames):
                p = os.path.join(dirpath, f)
                h.update(os.path.relpath(p, ROOT).encode())
                with open(p, "rb") as fh:
                    h.update(fh.read())
    return h.hexdigest()[:16]


def build_library():
    build = os.path.join(tempfile.gettempdir(), f"lily-mslemu-tests-{content_hash()}")
    lib = os.path.join(build, "cases.so")
    if os.path.exists(lib):
        return lib
    project = os.path.join(build, "project")
    os.makedirs(project, exist_ok=True)
    sources = " ".join(os.path.join(CASES, s) for s in LIBRARY_SOURCES)
    with open(os.path.join(project, "CMakeLists.txt"), "w") as f:
        f.write(f"cmake_minimum_required(VERSION 3.20)\nproject(mslemu_cases LANGUAGES NONE)\n"
                f"add_subdirectory({EMU_DIR} mslemu)\n"
                f"if(NOT LILY_HAVE_MSLEMU)\n  message(FATAL_ERROR \"mslemu disabled\")\nendif()\n"
                f"lily_add_metal_emu_library(TARGET cases OUTPUT_NAME {lib} SOURCES {sources} "
                f"INCLUDE_DIRS {CASES} METAL_VERSION 400)\n")
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    out = os.path.join(build, "out")
    for cmd in (["cmake", *gen, "-S", project, "-B", out], ["cmake", "--build", out, "-j", "2"]):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            pytest.fail(f"{' '.join(cmd)} failed:\n{r.stdout}\n{r.stderr}")
    return lib


@pytest.fixture(scope="module")
def emu():
    return Emu(build_library())


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def lower_check(name, version=310):
    return subprocess.run([sys.executable, os.path.join(EMU_DIR, "lower.py"), "check", os.path.join(CASES, name),
                           "-I", CASES, "--metal-version", str(version)], capture_output=True, text=True)


def page_aligned(nbytes, dtype):
    """A numpy array owning whole pages (exact byte counts)."""
    raw = np.empty(nbytes + PAGE, dtype=np.uint8)
    start = (-raw.ctypes.data) % PAGE
    return raw[start:start + nbytes].view(dtype)


# ---------------------------------------------------------------------------------------------------------
# Library
# ---------------------------------------------------------------------------------------------------------
def test_library_lists_every_kernel(emu):
    names = emu.names()
    assert names == sorted(names)
    for n in ("simd_ops", "gemm_f32", "gemm_f16", "fc_kernel", "oob_read", "scale_add"):
        assert n in names
    assert emu.lib.mslemu_find_kernel(b"no_such_kernel") is None


# ---------------------------------------------------------------------------------------------------------
# simdgroup collectives
# ---------------------------------------------------------------------------------------------------------
def simd_reference(x, u):
    """Expected simd_ops outputs for full 32-lane simdgroups."""
    g, lane = x.reshape(-1, 32).astype(np.float64), np.arange(32)
    ug = u.reshape(-1, 32)
    f = np.zeros((g.shape[0], 32, FLOAT_OPS))
    rows = lambda v: np.repeat(np.asarray(v)[:, None], 32, axis=1)
    p = 1.0 + g * 0.01
    f[..., 0] = rows(g.sum(1))
    f[..., 1] = rows(p.prod(1))
    f[..., 2] = rows(g.max(1))
    f[..., 3] = rows(g.min(1))
    f[..., 4] = np.cumsum(g, 1) - g
    f[..., 5] = np.cumsum(g, 1)
    f[..., 6] = g[:, (lane * 7 + 3) % 32]
    f[..., 7] = g[:, lane ^ 5]
    f[..., 8] = np.where(lane >= 3, g[:, (lane - 3) % 32], g)
    f[..., 9] = np.where(lane + 3 < 32, g[:, (lane + 3) % 32], g)
    f[..., 10] = g[:, (lane - 7) % 32]
    f[..., 11] = g[:, (lane + 7) % 32]
    f[..., 12] = rows(g[:, 9])
    f[..., 13] = rows(g[:, 0])
    f[..., 14] = np.repeat(g.reshape(-1, 8, 4).sum(2), 4, axis=1)
    f[..., 15] = g[:, lane ^ 1]
    f[..., 16] = rows(2 * g.sum(1))
    f[..., 17] = np.cumprod(p, 1) / p
    o = np.zeros((g.shape[0], 32, UINT_OPS), dtype=np.uint64)
    ballot = ((g > 0) * (1 << lane)).sum(1)
    o[..., 0] = rows(ballot)
    o[..., 1] = 1
    o[..., 2] = rows((g > 0).all(1))
    o[..., 3] = rows((g > 1.5).any(1))
    o[..., 4] = rows(np.bitwise_and.reduce(ug, 1))
    o[..., 5] = rows(np.bitwise_or.reduce(ug, 1))
    o[..., 6] = rows(np.bitwise_xor.reduce(ug, 1))
    o[..., 7] = rows(ug.max(1))
    o[..., 8] = rows(ug.min(1))
    o[..., 9] = lane == 0
    o[..., 10] = np.cumsum(ug & 0xFF, 1)
    return f.reshape(-1, FLOAT_OPS), o.reshape(-1, UINT_OPS).astype(np.uint32)


@pytest.mark.parametrize("order", ORDERS)
def test_every_simd_collective(emu, rng, order):
    n = 4 * 96  # 4 threadgroups of 3 simdgroups
    x = rng.standard_normal(n).astype(np.float32)
    u = rng.integers(0, 2**32, n, dtype=np.uint32)
    fout = np.full((n, FLOAT_OPS), np.nan, np.float32)
    uout = np.zeros((n, UINT_OPS), np.uint32)
    emu.dispatch("simd_ops", 4, 96, [fout, uout, x, u], order=order, seed=7)
    fref, uref = simd_reference(x, u)
    np.testing.assert_allclose(fout, fref, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(uout, uref)


def test_collectives_skip_returned_lanes(emu, rng):
    for active in (1, 13, 32):
        x = rng.standard_normal(64).astype(np.float32)
        out = np.full((64, 3), -7.0, np.float32)
        emu.dispatch("simd_partial", 1, 64, [out, x, np.array([active], np.uint32)])
        g = x.reshape(2, 32)[:, :active].astype(np.float64)
        res = out.reshape(2, 32, 3)
        np.testing.assert_allclose(res[:, :active, 0], np.repeat(g.sum(1)[:, None], active, 1), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(res[:, :active, 1], np.cumsum(g, 1) - g, rtol=1e-5, atol=1e-5)
        assert (res[:, :active, 2] == float((1 << active) - 1)).all()
        assert (res[:, active:] == -7.0).all()


def test_partial_simdgroup(emu, rng):
    # 40 threads: simdgroup 1 has 8 lanes; its sums cover just those lanes.
    x = rng.standard_normal(40).astype(np.float32)
    out = np.full((40, 3), -7.0, np.float32)
    emu.dispatch("simd_partial", 1, 40, [out, x, np.array([32], np.uint32)])
    np.testing.assert_allclose(out[32:, 0], x[32:].sum(), rtol=1e-5)
    assert (out[32:, 2] == 255.0).all()


# ---------------------------------------------------------------------------------------------------------
# Threadgroup memory, barriers, atomics, schedules
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("order", ORDERS)
def test_barriers_and_threadgroup_memory(emu, rng, order):
    x = rng.standard_normal(8 * 256).astype(np.float32)
    out = np.zeros_like(x)
    emu.dispatch("tg_reverse", 8, 256, [out, x], order=order, seed=3)
    b = x.reshape(8, 256)[:, ::-1]
    np.testing.assert_array_equal(out, (b + np.roll(b, -1, axis=1)).ravel())


def test_dynamic_threadgroup_memory(emu, rng):
    x = rng.standard_normal(6 * 160).astype(np.float32)
    out = np.zeros_like(x)
    # 160 threads = 5 simdgroups, the last one full; scratch holds their partial sums.
    emu.dispatch("tg_dynamic_sum", 6, 160, [out, x], tg_lengths=[32], order=RANDOM)
    np.testing.assert_allclose(out.reshape(6, 160), np.repeat(x.reshape(6, 160).sum(1, keepdims=True), 160, 1), rtol=1e-5)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_atomics(emu, rng, workers):
    values = rng.integers(1, 10**6, 64 * 128, dtype=np.uint32)
    hist = np.zeros(BINS, np.uint32)
    total = np.zeros(1, np.float32)
    maxv = np.zeros(1, np.uint32)
    emu.dispatch("histogram", 64, 128, [hist, total, maxv, values], workers=workers, order=RANDOM)
    np.testing.assert_array_equal(hist, np.bincount(values % BINS, minlength=BINS))
    assert total[0] == float((values % 7).sum())  # small integers: exact in float in any order
    assert maxv[0] == values.max()


def test_schedules_expose_a_missing_barrier(emu, rng):
    x = rng.standard_normal(256).astype(np.float32)
    results = {}
    for order in ORDERS:
        out = np.zeros_like(x)
        emu.dispatch("race_missing_barrier", 1, 256, [out, x], order=order, seed=11)
        results[order] = out
    assert not np.array_equal(results[FORWARD], results[REVERSE], equal_nan=True)
    # Unwritten threadgroup memory reads as the 0xFF poison (NaN), never as plausible data.
    assert np.isnan(results[FORWARD]).any() and np.isnan(results[REVERSE]).any()
    out = np.zeros_like(x)
    emu.dispatch("tg_reverse", 1, 256, [out, x], order=REVERSE)  # the same exchange with barriers
    assert not np.isnan(out).any()


# ---------------------------------------------------------------------------------------------------------
# simdgroup_matrix
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,kernel,tol", [(np.float32, "gemm_f32", 1e-5), (np.float16, "gemm_f16", 1e-3)])
@pytest.mark.parametrize("shape", [(8, 8, 8), (19, 13, 27), (33, 40, 5)])
def test_simdgroup_matrix_gemm(emu, rng, dtype, kernel, tol, shape):
    M, N, K = shape
    A = rng.standard_normal((M, K)).astype(dtype)
    B = rng.standard_normal((K, N)).astype(dtype)
    C = np.full((M, N), np.nan, np.float32)
    args = np.array([M, N, K], np.int32)
    emu.dispatch(kernel, ((N + 7) // 8, (M + 7) // 8), 32, [C, A, B, args])
    ref = A.astype(np.float64) @ B.astype(np.float64)
    np.testing.assert_allclose(C, ref, rtol=tol, atol=tol * np.sqrt(K))


def test_simdgroup_matrix_lane_layout(emu, rng):
    m = rng.standard_normal((8, 16)).astype(np.float32)
    out = np.zeros(64, np.float32)
    emu.dispatch("sgm_layout", 1, 32, [out, m])
    lane = np.arange(32)
    q = lane // 4
    row = (q & 4) + (lane // 2) % 4  # MLX steel/gemm/mma.h get_coord
    col = (q & 2) * 2 + (lane % 2) * 2
    expected = np.stack([m[row, 8 + col], m[row, 8 + col + 1]], 1).ravel()
    np.testing.assert_array_equal(out, expected)


# ---------------------------------------------------------------------------------------------------------
# Metal 4 tensor ops: matmul2d (mslemu/tensor.h)
# ---------------------------------------------------------------------------------------------------------
def bf16_round(x):
    return (bf16_bits(x).astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("shape", [(16, 32, 8), (37, 45, 29), (5, 70, 64), (1, 1, 1)])
@pytest.mark.parametrize("order", ORDERS)
def test_matmul2d_device_tensors(emu, rng, dtype, shape, order):
    M, N, K = shape
    A = rng.standard_normal((M, K)).astype(np.float32)
    B = rng.standard_normal((N, K)).astype(np.float32)
    if dtype == "bf16":
        A, B = bf16_round(A), bf16_round(B)
        a, b = bf16_bits(A), bf16_bits(B)
    else:
        a, b = A.astype(np.float16), B.astype(np.float16)
        A, B = a.astype(np.float32), b.astype(np.float32)
    C = np.full((M, N), np.nan, np.float32)
    emu.dispatch(f"mm2d_device_nt_{dtype}", ((N + 31) // 32, (M + 15) // 16), 128,
                 [C, a, b, np.array([M, N, K, 0], np.int32)], order=order)
    # Products of bf16 / half inputs are exact in fp32; the sum is fp32 (fma in k order).
    ref = A.astype(np.float64) @ B.T.astype(np.float64)
    np.testing.assert_allclose(C, ref, rtol=1e-5, atol=1e-5 * np.sqrt(K))


@pytest.mark.parametrize("shape", [(32, 16, 8), (50, 21, 19), (7, 40, 3)])
def test_matmul2d_cooperative_accumulate(emu, rng, shape):
    M, N, K = shape
    A = bf16_round(rng.standard_normal((K, M)).astype(np.float32))  # stored [K, M]: transpose_left
    B = bf16_round(rng.standard_normal((K, N)).astype(np.float32))
    bias = rng.standard_normal((M, N)).astype(np.float32)
    D = np.full((M, N), 0xFFFF, np.uint16)
    emu.dispatch("mm2d_coop_acc", ((N + 15) // 16, (M + 31) // 32), 32,
                 [D, bf16_bits(A), bf16_bits(B), bias, np.array([M, N, K, 0], np.int32)])
    ref = bias + A.T.astype(np.float64) @ B.astype(np.float64)
    got = (D.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_allclose(got, ref, rtol=2.0**-8, atol=1e-6)


def test_matmul2d_cooperative_layout_is_a_partition(emu):
    # 24 x 20 over execution_simdgroups<2> (64 threads): every tile element belongs to exactly one (thread,
    # element), invalid tail elements included; the layout is opaque (scrambled here), so kernels must ask.
    out = np.full((64, 1 + 3 * 16), -1, np.int32)
    emu.dispatch("mm2d_layout", 1, 64, [out])
    cap = out[:, 0]
    assert (cap == (24 * 20 + 63) // 64).all()
    seen = np.zeros((24, 20), int)
    for t in range(64):
        for i in range(cap[t]):
            valid, n, m = out[t, 1 + 3 * i:4 + 3 * i]
            if valid:
                seen[m, n] += 1
    assert (seen == 1).all()
    assert not np.array_equal(out[0, 2:4], [0, 0]) or not np.array_equal(out[1, 2:4], [1, 0])  # not row-major


def test_matmul2d_scope_must_match_threadgroup(emu):
    with pytest.raises(KernelError, match=r"execution_simdgroups<4> \(128 threads\) but the threadgroup has 64"):
        emu.dispatch("mm2d_wrong_scope", 1, 64, [np.zeros(64, np.float32), np.zeros(64, np.float16)])


def test_tensor_headers_need_msl4():
    r = subprocess.run([sys.executable, os.path.join(EMU_DIR, "lower.py"), "check",
                        os.path.join(CASES, "tensor_kernels.metal"), "-I", CASES, "--metal-version", "310"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "needs MSL 4.0" in r.stderr


# ---------------------------------------------------------------------------------------------------------
# Numerics, vectors, positions, function constants
# ---------------------------------------------------------------------------------------------------------
def bf16_bits(x):
    """float32 -> bfloat16 bits, round to nearest even (NaN stays NaN)."""
    b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), (b >> 16).astype(np.uint16) | 0x40, r)


def test_bfloat_and_half_rounding(emu, rng):
    x = (rng.standard_normal(4096) * 10.0 ** rng.integers(-8, 8, 4096)).astype(np.float32)
    ties = x.view(np.uint32).copy()
    ties[:1024] = (ties[:1024] & 0xFFFF0000) | 0x8000  # exactly halfway: the even neighbour wins
    x = ties.view(np.float32)
    bf, hf, bsum = (np.zeros(4096, np.uint16) for _ in range(3))
    emu.dispatch("convert", 16, 256, [bf, hf, bsum, x])
    np.testing.assert_array_equal(bf, bf16_bits(x))
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(hf, x.astype(np.float16).view(np.uint16))
    b = (bf.astype(np.uint32) << 16).view(np.float32)
    # bfloat arithmetic rounds after every operation, as on the GPU.
    sq = (bf16_bits(b * b).astype(np.uint32) << 16).view(np.float32)
    ok = np.isfinite(b * b + b)
    np.testing.assert_array_equal(bsum[ok], bf16_bits(sq + b)[ok])


def test_vectors_literals_math(emu, rng):
    n = 64
    p = rng.standard_normal((n, 3)).astype(np.float32)  # packed_float3: 12-byte stride
    x = rng.standard_normal(n).astype(np.float32)
    out = np.zeros((n, 8), np.float32)
    emu.dispatch("vectors", 1, n, [out, p, x])
    w = np.stack([np.full(n, 2.0, np.float32), x, p[:, 1], p[:, 0]], 1)
    np.testing.assert_allclose(out[:, 0], w[:, 0] + w[:, 1] * 10 + w[:, 2] * 100, rtol=1e-6)
    np.testing.assert_array_equal(out[:, 1], w[:, 3].astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(out[:, 2], x * np.float32(0.1))  # the literal is a float, not a double
    np.testing.assert_array_equal(out[:, 3], (x.astype(np.float16) * np.float16(1.5)).astype(np.float32))
    np.testing.assert_allclose(out[:, 4], p @ np.array([1, 2, 3], np.float32), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out[:, 5], -x)
    np.testing.assert_array_equal(out[:, 6], np.where(x > 0, 2.0, 1.0))
    np.testing.assert_allclose(out[:, 7], np.clip(2 * x + 1, -1, 1) + np.tanh(x) + np.exp(-np.abs(x)), rtol=1e-5)


def test_position_attributes(emu):
    tgs, threads = (2, 3, 2), (8, 2, 3)
    grid = tuple(a * b for a, b in zip(tgs, threads))
    out = np.zeros((np.prod(grid), 20), np.uint32)
    emu.dispatch("positions", tgs, threads, [out], order=RANDOM)
    z, y, x = np.meshgrid(*[np.arange(g) for g in grid[::-1]], indexing="ij")
    x, y, z = x.ravel(), y.ravel(), z.ravel()
    tx, ty, tz = x % 8, y % 2, z % 3
    tidx = (tz * 2 + ty) * 8 + tx
    expected = np.stack([x, y, z, tx, ty, tz, x // 8, y // 2, z // 3, tidx, tidx % 32, tidx // 32,
                         np.full_like(x, 8), np.full_like(x, 2), *[np.full_like(x, t) for t in tgs],
                         np.full_like(x, 2), np.full_like(x, 32), np.full_like(x, grid[0])], 1)
    np.testing.assert_array_equal(out, expected)


def test_dispatch_threads_grid(emu, rng):
    n = 1000  # 4 threadgroups of 256, the last one 232 threads
    y = rng.standard_normal(1024).astype(np.float32)
    x = rng.standard_normal(1024).astype(np.float32)
    y0 = y.copy()
    emu.dispatch("scale_add", 0, 256, [y, x, np.array([0.75], np.float32)], grid=n)
    np.testing.assert_allclose(y[:n], y0[:n] + np.float32(0.75) * x[:n], rtol=1e-6)
    np.testing.assert_array_equal(y[n:], y0[n:])


def test_function_constants(emu, rng):
    y0 = rng.standard_normal(64).astype(np.float32)
    bias = rng.standard_normal(64).astype(np.float32)
    for has_bias, mult in ((1, 3), (0, -2)):
        y = y0.copy()
        emu.dispatch("fc_kernel", 1, 64, [y, bias], constants={FC_HAS_BIAS: has_bias, FC_MULTIPLIER: mult & 0xFFFFFFFF})
        np.testing.assert_allclose(y, y0 * mult + (bias if has_bias else -1.0), rtol=1e-6)
    with pytest.raises(KernelError, match=r"function constant 'multiplier' \(index 7\) is read but the dispatch does not set it"):
        emu.dispatch("fc_kernel", 1, 64, [y0.copy(), bias], constants={FC_HAS_BIAS: 1})


# ---------------------------------------------------------------------------------------------------------
# Byte counting
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("workers", [1, 2])
def test_byte_counting_is_exact_for_page_aligned_buffers(emu, rng, workers):
    floats_per_page = PAGE // 4
    src = page_aligned(16 * PAGE, np.float32)
    src[:] = rng.standard_normal(src.size)
    out = page_aligned(4 * PAGE, np.float32)
    out[:] = rng.standard_normal(out.size)
    args = page_aligned(PAGE, np.uint32)[:2]
    args[:] = [3 * floats_per_page, 4 * floats_per_page]  # pages 3..6 of src
    read, written = emu.dispatch("copy_slice", 16, 256, [out, src, args], count_bytes=True, workers=workers)
    assert read == [0, 4 * PAGE, 8]
    assert written == [4 * PAGE, 0, 0]
    np.testing.assert_array_equal(out, src[3 * floats_per_page:7 * floats_per_page])
    src[0] = 1.0  # protections are restored: the buffers are writable again


def test_byte_counting_clips_to_the_buffer(emu, rng):
    # An unaligned slice inside page-aligned memory: touched pages are clipped to [ptr, ptr + size).
    base = page_aligned(8 * PAGE, np.float32)
    base[:] = rng.standard_normal(base.size)
    src = base[100:100 + 3000]
    out = page_aligned(PAGE * 4, np.float32)[:3000]
    args = np.array([0, 3000], np.uint32)
    read, written = emu.dispatch("copy_slice", 12, 256, [out, src, args], count_bytes=True)
    assert read[1] == src.nbytes and written[0] == out.nbytes and read[0] == 0
    np.testing.assert_array_equal(out, src)


# ---------------------------------------------------------------------------------------------------------
# Diagnostics
# ---------------------------------------------------------------------------------------------------------
def test_out_of_bounds_read_at_guard_page(emu, rng):
    x, free = emu.guarded(rng.standard_normal(256).astype(np.float32))
    try:
        out = np.zeros(256, np.float32)
        with pytest.raises(KernelError) as e:
            emu.dispatch("oob_read", 2, 128, [out, x])
        msg = str(e.value)
        assert "kernel 'oob_read'" in msg
        assert "out-of-bounds read past the end of buffer(1): byte 1024 of a 1024-byte buffer" in msg
        assert "threadgroup (1,0,0), thread (127,0,0)" in msg and "lane 31" in msg
        emu.dispatch("oob_read", 2, 128, [out, x[:-1].copy()], grid=255)  # in bounds: fine
    finally:
        free()


def test_divergent_collective(emu):
    with pytest.raises(KernelError, match=r"divergent simdgroup collective in simdgroup 0: lane 0 is in simd_sum "
                                          r"\(.*bad_kernels.metal:24:.*\) while lane 16 is in simd_sum \(.*:26:"):
        emu.dispatch("divergent_simd", 1, 32, [np.zeros(32, np.float32)])


def test_simd_collective_versus_barrier(emu):
    with pytest.raises(KernelError, match=r"divergent control flow in simdgroup 0: lanes 0-15 wait in simd_sum "
                                          r"\(.*\) while lanes 16-31 wait at threadgroup_barrier"):
        emu.dispatch("simd_vs_barrier", 1, 32, [np.zeros(32, np.float32)])


@pytest.mark.parametrize("order", [FORWARD, REVERSE])
def test_barrier_after_early_return(emu, order):
    with pytest.raises(KernelError, match=r"(reached after \d+ of 64 threads returned|thread returned while \d+ "
                                          r"threads wait at threadgroup_barrier)"):
        emu.dispatch("barrier_after_return", 1, 64, [np.zeros(64, np.float32), np.array([40], np.uint32)], order=order)
    emu.dispatch("barrier_after_return", 1, 64, [np.zeros(64, np.float32), np.array([64], np.uint32)])


def test_barrier_in_divergent_branch(emu):
    with pytest.raises(KernelError, match="threads wait at different threadgroup_barrier calls"):
        emu.dispatch("barrier_in_branch", 1, 64, [np.zeros(64, np.float32)])


def test_threadgroup_memory_limit(emu):
    out = np.zeros(1024, np.float32)
    with pytest.raises(KernelError, match=r"kernel 'tg_static_too_big': threadgroup memory exceeds the 32768-byte "
                                          r"limit: 'more' needs 16384 bytes after 20480"):
        emu.dispatch("tg_static_too_big", 1, 1024, [out])
    with pytest.raises(KernelError, match=r"kernel 'tg_dynamic': threadgroup memory of 32784 bytes .* exceeds the "
                                          r"32768-byte limit"):
        emu.dispatch("tg_dynamic", 1, 64, [out], tg_lengths=[32784])
    with pytest.raises(KernelError, match="not a multiple of 16"):
        emu.dispatch("tg_dynamic", 1, 64, [out], tg_lengths=[260])
    with pytest.raises(KernelError, match=r"threadgroup\(0\) has no length set"):
        emu.dispatch("tg_dynamic", 1, 64, [out])
    emu.dispatch("tg_dynamic", 1, 64, [out], tg_lengths=[32768])


def test_threads_per_threadgroup_limit(emu):
    out = np.zeros(2048, np.float32)
    with pytest.raises(KernelError, match=r"kernel 'tg_reverse': 1025 threads per threadgroup \(1025,1,1\) exceed "
                                          r"the limit of 1024"):
        emu.dispatch("tg_reverse", 1, 1025, [out, out.copy()])
    with pytest.raises(KernelError, match=r"exceed the kernel's \[\[max_total_threads_per_threadgroup\(64\)\]\]"):
        emu.dispatch("small_groups", 1, 128, [out])
    emu.dispatch("small_groups", 2, 64, [out])


def test_unbound_buffer_and_short_reference(emu):
    with pytest.raises(KernelError, match=r"buffer\(1\) is not bound"):
        emu.dispatch("tg_reverse", 1, 32, [np.zeros(32, np.float32), None])
    with pytest.raises(KernelError, match=r"buffer\(3\) holds 8 bytes but the kernel's reference parameter needs 12"):
        emu.dispatch("gemm_f32", 1, 32, [np.zeros(64, np.float32)] * 3 + [np.zeros(2, np.int32)])


def test_fiber_stack_overflow(emu):
    with pytest.raises(KernelError, match="fiber stack overflow"):
        emu.dispatch("stack_hog", 1, 32, [np.zeros(32, np.float32)])


@pytest.mark.parametrize("case,message", [
    ("check_as_device_to_thread.metal", "no matching function for call to 'sum4'"),
    ("check_as_tg_to_device.metal", "cannot initialize a variable of type 'device float *' with an lvalue of type "
                                    "'threadgroup float[32]'"),
    ("check_as_write_constant.metal", "cannot assign to variable 'p' with const-qualified type"),
])
def test_compile_check_rejects_address_space_mixups(case, message):
    r = lower_check(case)
    assert r.returncode != 0
    assert message in r.stderr
    assert f"{case}:" in r.stderr  # diagnostics point into the .metal file


# Each rule of lower.py's RULES: a case Apple's compiler rejects (the rule and its MSL section in the message)
# and, below, a case it accepts. (case, MSL version, rule, message)
RULE_CASES = [
    ("check_double.metal", 310, "double", "'double' is not supported in MSL"),
    ("check_tg_initializer.metal", 310, "tg-initializer", "a threadgroup variable cannot have an initializer"),
    ("check_byvalue_param.metal", 310, "by-value-param", "parameter 'uint n' is passed by value without an attribute"),
    ("check_address_space.metal", 310, "address-space",
     "parameter 'float * a' is a pointer or reference without an address space"),
    ("check_tg_limit.metal", 310, "tg-memory", "threadgroup memory declared in this function exceeds the 32768-byte limit"),
    ("check_max_threads.metal", 310, "max-threads", "max_total_threads_per_threadgroup(2048) exceeds the limit of 1024"),
    ("check_float_atomic_tg.metal", 310, "float-atomic", "a threadgroup atomic_float"),
    ("check_float_atomic_cast.metal", 310, "float-atomic", "a threadgroup or thread atomic_float"),
    ("check_grid_width.metal", 310, "grid-width", "kernel 'k' mixes component counts: uint3 "
                                                  "[[threadgroup_position_in_grid]], uint [[threads_per_threadgroup]]"),
    ("check_grid_pair_type.metal", 310, "grid-width", "[[thread_position_in_grid]] and [[threads_per_grid]] need one type"),
    ("check_recursion.metal", 310, "recursion", "recursive call even -> odd -> even"),
    ("check_function_pointer.metal", 310, "function-pointer", "a function pointer or reference is not supported"),
    ("check_function_name_as_value.metal", 310, "function-pointer", "'square' names a function without calling it"),
    ("check_virtual.metal", 310, "function-pointer", "virtual functions are not supported in MSL"),
    ("check_bfloat.metal", 300, "version", "'bfloat' needs MSL 3.1; this file is compiled as MSL 3.0"),
    ("check_tensor_below_4.metal", 310, "version", "'tensor' needs MSL 4.0; this file is compiled as MSL 3.1"),
    ("check_attribute_spelling.metal", 310, "attribute", "unknown attribute [[thread_positon_in_grid]]"),
    ("check_attribute_buffer.metal", 310, "attribute", "unknown attribute [[bufer]]"),
]


@pytest.mark.parametrize("case,version,rule,message", RULE_CASES, ids=[c[0] for c in RULE_CASES])
def test_compile_check_rejects(case, version, rule, message):
    r = lower_check(case, version)
    assert r.returncode != 0
    assert message in r.stderr
    assert f"MSL rule '{rule}'" in r.stderr and "§" in r.stderr  # the rule and its specification section
    assert f"{case}:" in r.stderr  # diagnostics point into the .metal file (a shim static_assert: its call site)


@pytest.mark.parametrize("case,version", [
    ("check_ok_generic.metal", 310),
    ("check_ok_atomics.metal", 310),   # float-atomic: device atomic_float, threadgroup atomic_uint
    ("check_ok_grid.metal", 310),      # grid-width: uint3 throughout, scalar index attributes
    ("check_ok_calls.metal", 310),     # recursion / function-pointer: an acyclic call graph, a functor type
    ("check_ok_tg_limit.metal", 310),  # tg-memory / max-threads: exactly at the limits
    ("check_bfloat.metal", 310),       # version: bfloat at MSL 3.1
    ("kernels.metal", 400),            # the emulator's own kernels (every attribute spelling they use)
])
def test_compile_check_accepts_valid_msl(case, version):
    r = lower_check(case, version)
    assert r.returncode == 0, r.stderr


# Every metal/*.metal passing the checker at MSL 3.1 and 4.0: tests/test_kernel_table.py
# (test_compiled_names_per_msl_version).


# ---------------------------------------------------------------------------------------------------------
# Speed (reported with -s; the bounds only catch pathological regressions)
# ---------------------------------------------------------------------------------------------------------
def test_matvec_speed(emu, rng):
    import time
    rows = cols = 4096
    W = rng.standard_normal((rows, cols)).astype(np.float32)
    x = rng.standard_normal(cols).astype(np.float32)
    y = np.zeros(rows, np.float32)
    args = np.array([rows, 0, cols], np.int32)
    t = time.perf_counter()
    emu.dispatch("matvec", rows // 8, 256, [y, W, x, args])
    seconds = time.perf_counter() - t
    np.testing.assert_allclose(y, W.astype(np.float64) @ x, rtol=1e-4, atol=1e-3)
    print(f"\nmatvec 4096x4096 f32, 512 threadgroups of 256, 2 workers: {seconds * 1e3:.1f} ms "
          f"({seconds / 512 * 1e6:.0f} us per threadgroup)")
    assert seconds < 5.0

    out = np.zeros(1024, np.float32)
    iters = 200
    t = time.perf_counter()
    emu.dispatch("barrier_bench", 1, 1024, [out, np.array([iters], np.uint32)], workers=1)
    per_barrier = (time.perf_counter() - t) / (2 * iters * 1024)
    print(f"threadgroup_barrier: {per_barrier * 1e9:.0f} ns per thread per barrier (1024 threads)")
    assert (out == iters).all()
