"""lily.convert: affine (de)quantisation bit-exact with mlx, HF -> MLX conversion identical
to ``mlx_lm.convert -q --q-group-size 64 --q-bits 4``.

mlx / mlx-lm / transformers are test-only references (skipped when absent).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lily import convert as cv
import tinymodels as tm

mx = pytest.importorskip("mlx.core")
mx.set_default_device(mx.cpu)

MX_DT = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def _edge_case_matrix(rng, rows=96, cols=512):
    w = (rng.standard_normal((rows, cols)) * rng.uniform(1e-3, 3.0, (rows, 1))).astype(np.float32)
    w[0, :64] = -np.abs(w[0, :64])          # max negative (all negative)
    w[1, :64] = 0.3                         # all equal, positive
    w[2, :64] = 0.0                         # all zero
    w[3, :64] = np.abs(w[3, :64])           # all positive
    w[4, :64] = -2.5                        # all equal, negative
    w[5, :64] = 1e-9                        # range below eps
    w[6, :64] = -1e-9
    w[7, :64] = np.round(w[7, :64] * 4) / 4  # coarse grid: ties in (w - b) / s
    w[8, :64] = np.linspace(0, 15, 64)      # exact ties at x.5
    w[8, 1], w[8, 2] = 6.5, 5.5
    w[9, :64] = np.where(np.arange(64) % 2, 1e4, -1e-4)  # huge dynamic range
    w[10, 64:128] = -np.abs(w[10, 64:128])
    w[10, 64] = 0.0                         # max exactly 0
    return w


def _mx_bits(a, dtype):
    a = mx.array(a) if not isinstance(a, mx.array) else a
    if dtype == "bfloat16":
        return np.array(a.view(mx.uint16))
    return np.array(a)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("seed", [0, 1])
def test_quantize_bit_exact(bits, dtype, seed):
    rng = np.random.default_rng(seed)
    w = _edge_case_matrix(rng)
    ref_q, ref_s, ref_b = mx.quantize(mx.array(w).astype(MX_DT[dtype]), group_size=64, bits=bits)
    inp = {"float32": w, "bfloat16": cv.f32_to_bf16(w), "float16": w.astype(np.float16)}[dtype]
    q, s, b = cv.quantize_affine(inp, bits=bits, group_size=64)
    assert q.dtype == np.uint32 and q.shape == (w.shape[0], w.shape[1] * bits // 32)
    assert s.shape == b.shape == (w.shape[0], w.shape[1] // 64)
    np.testing.assert_array_equal(q, np.array(ref_q))
    np.testing.assert_array_equal(s.view(np.uint8), _mx_bits(ref_s, dtype).view(np.uint8))
    np.testing.assert_array_equal(b.view(np.uint8), _mx_bits(ref_b, dtype).view(np.uint8))
    # float32 input + dtype="bfloat16" means "cast to bf16 first" (mx.array(w).astype(bf16))
    if dtype == "bfloat16":
        q2, s2, b2 = cv.quantize_affine(w, bits=bits, group_size=64, dtype="bfloat16")
        np.testing.assert_array_equal(q2, q)
        np.testing.assert_array_equal(s2, s)
        np.testing.assert_array_equal(b2, b)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_dequantize_bit_exact(bits, dtype):
    rng = np.random.default_rng(7)
    w = _edge_case_matrix(rng)
    rq, rs, rb = mx.quantize(mx.array(w).astype(MX_DT[dtype]), group_size=64, bits=bits)
    ref = np.array(mx.dequantize(rq, rs, rb, group_size=64, bits=bits).astype(mx.float32))
    got = cv.dequantize_affine(np.array(rq), _mx_bits(rs, dtype), _mx_bits(rb, dtype), bits=bits, group_size=64)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))


def test_quantize_3d_and_chunking():
    """Switch-expert shaped input [E, out, in], quantised in small row chunks."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((5, 48, 192)).astype(np.float32)
    ref_q, ref_s, ref_b = mx.quantize(mx.array(w).astype(mx.bfloat16), group_size=64, bits=4)
    q, s, b = cv.quantize_affine(cv.f32_to_bf16(w), 4, 64, chunk_elems=1000)
    assert q.shape == (5, 48, 24) and s.shape == (5, 48, 3)
    np.testing.assert_array_equal(q, np.array(ref_q))
    np.testing.assert_array_equal(s, _mx_bits(ref_s, "bfloat16"))
    np.testing.assert_array_equal(b, _mx_bits(ref_b, "bfloat16"))


def test_bf16_helpers_match_mlx():
    rng = np.random.default_rng(5)
    x = np.concatenate([
        rng.standard_normal(10000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 10000),
        # exact ties between two bf16 values (round to even), both parities
        ((np.arange(1, 2001, dtype=np.uint32) << 16) | 0x8000).view(np.float32),
        np.array([0.0, -0.0, np.inf, -np.inf, 3.4e38, -3.4e38, 1e-45, 1.17e-38], np.float32)])
    ref = np.array(mx.array(x).astype(mx.bfloat16).view(mx.uint16))
    np.testing.assert_array_equal(cv.f32_to_bf16(x), ref)
    back = np.array(mx.array(ref).view(mx.bfloat16).astype(mx.float32))
    np.testing.assert_array_equal(cv.bf16_to_f32(ref).view(np.uint32), back.view(np.uint32))
    assert np.isnan(cv.bf16_to_f32(cv.f32_to_bf16(np.array([np.nan], np.float32)))).all()


# ----------------------------------------------------------------------------- safetensors I/O

def test_sharded_writer_roundtrip(tmp_path):
    from safetensors import safe_open
    rng = np.random.default_rng(0)
    tensors = {f"t{i}": rng.standard_normal((17 + i, 33)).astype(np.float32) for i in range(6)}
    tensors["u"] = rng.integers(0, 2 ** 32, (7, 5), dtype=np.uint32)
    tensors["b"] = cv.f32_to_bf16(rng.standard_normal((9, 4)).astype(np.float32))
    st_dtype = {"b": "BF16", "u": "U32"}
    plan = [(k, v.shape, st_dtype.get(k, "F32")) for k, v in tensors.items()]
    w = cv.ShardedWriter(tmp_path, plan, max_shard_bytes=6000)
    for k, v in reversed(list(tensors.items())):  # any order, row slices
        w.write(k, v[3:], 3)
        w.write(k, v[:3], 0)
    w.close()
    idx = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(idx["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert idx["metadata"]["total_size"] == sum(v.nbytes for v in tensors.values())
    for k, v in tensors.items():
        f = tmp_path / idx["weight_map"][k]
        if k != "b":
            with safe_open(str(f), "np") as h:
                np.testing.assert_array_equal(h.get_tensor(k), v)
        np.testing.assert_array_equal(cv.SafetensorsFile(f).get(k), v)
        got = mx.load(str(f))[k]
        if k == "b":
            got = got.view(mx.uint16)
        np.testing.assert_array_equal(np.array(got), v)
    w2 = cv.ShardedWriter(tmp_path / "x", plan)
    w2.write("u", tensors["u"])
    with pytest.raises(RuntimeError):
        w2.close()


def test_write_file_is_read_back_by_the_safetensors_package(tmp_path):
    from safetensors import safe_open

    from lily import safetensors_io
    rng = np.random.default_rng(1)
    f = rng.standard_normal((3, 5)).astype(np.float32)
    b = cv.f32_to_bf16(rng.standard_normal(7).astype(np.float32))
    path = tmp_path / "s.safetensors"
    safetensors_io.write_file(path, [("live.f", "F32", [3, 5], f.tobytes()), ("live.b", "BF16", [7], b.tobytes())],
                              {"note": "x"})
    assert not (tmp_path / "s.safetensors.tmp").exists()
    with safe_open(str(path), "np") as h:
        assert h.metadata() == {"note": "x"} and set(h.keys()) == {"live.f", "live.b"}
        np.testing.assert_array_equal(h.get_tensor("live.f"), f)
        assert h.get_slice("live.b").get_dtype() == "BF16"
    np.testing.assert_array_equal(np.array(mx.load(str(path))["live.b"].view(mx.uint16)), b)
    sf = cv.SafetensorsFile(path)
    np.testing.assert_array_equal(sf.get("live.b"), b)
    assert sf.metadata == {"note": "x"}
    (tmp_path / "cut.safetensors").write_bytes(path.read_bytes()[:-3])
    with pytest.raises(ValueError, match=r"cut.safetensors: tensor live\.\w ends at byte \d+ but the file has"):
        cv.SafetensorsFile(tmp_path / "cut.safetensors")


# ----------------------------------------------------------------------------- converter vs mlx_lm.convert

def _all_tensors(d: Path) -> dict:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        sf = cv.SafetensorsFile(f)
        for k in sf.keys():
            out[k] = (sf.info(k)[0], np.array(sf.get(k)))
    return out


@pytest.mark.parametrize("geom_name,kind,dtype", [
    ("BASE", "mlx_q4_bf16", None),          # the mlx-community recipe (bf16 scales)
    ("BASE", "mlx_q4_f32", "float32"),      # --dtype float32: f32 scales, bf16(1+w) norms
    ("GVA1_HD32", "mlx_q4_bf16", None),     # unsnapped norms: bf16(1 + w) rounding exercised
])
def test_convert_matches_mlx_lm(tmp_path, geom_name, kind, dtype):
    geom = getattr(tm, geom_name)
    hf = tm.get_model(geom, "hf_bf16")
    ref = tm.get_model(geom, kind)
    out = cv.convert_hf_to_mlx_q4(hf, tmp_path / "out", dtype=dtype, chunk_rows=100)
    mine, theirs = _all_tensors(out), _all_tensors(ref)
    assert sorted(mine) == sorted(theirs)
    assert not any(k.startswith(("vision", "model.visual")) or "mtp." in k for k in mine)
    for k in theirs:
        assert mine[k][0] == theirs[k][0], (k, mine[k][0], theirs[k][0])
        assert mine[k][1].shape == theirs[k][1].shape, k
        assert mine[k][1].tobytes() == theirs[k][1].tobytes(), f"{k} differs"
    assert json.loads((out / "config.json").read_text()) == json.loads((ref / "config.json").read_text())
    assert (json.loads((out / "model.safetensors.index.json").read_text())
            == json.loads((ref / "model.safetensors.index.json").read_text()))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).exists()
    assert (out / "generation_config.json").read_bytes() == (hf / "generation_config.json").read_bytes()


def test_convert_sharded_output_loads_in_mlx_lm(tmp_path):
    """Small shard limit -> several shards + index; mlx_lm loads the result, and the
    quantised model gives the same logits as mlx_lm.convert's output."""
    hf = tm.get_model(tm.BASE, "hf_bf16")
    ref = tm.get_model(tm.BASE, "mlx_q4_bf16")
    out = cv.convert_hf_to_mlx_q4(hf, tmp_path / "out", max_shard_bytes=300_000)
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(idx["weight_map"].values())) >= 4
    ids = tm.default_prompt_ids()[:24]
    a, _ = tm.mlx_logits(out, ids)
    b, _ = tm.mlx_logits(ref, ids)
    np.testing.assert_array_equal(a, b)


def test_convert_refuses_existing(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError):
        cv.convert_hf_to_mlx_q4(tmp_path, tmp_path / "out")
