"""Checkpoint loading: both layouts, sharded index, and a clear error (naming file and tensor or field) for
every way a checkpoint can be broken."""
import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

import lily
from lily.checkpoint import CheckpointError, load_config, read_checkpoint, resolve
import tinymodels as tm


def _copy(kind, tmp_path, geom=tm.BASE) -> Path:
    dst = tmp_path / kind
    shutil.copytree(tm.get_model(geom, kind), dst)
    return dst


def _shard_of(d: Path, tensor: str) -> Path:
    return d / json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][tensor]


def _rewrite_header(path: Path, edit) -> None:
    """Rewrites a safetensors header in place (the data section is kept byte for byte)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * ((8 - len(new) % 8) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def _drop_from_index(d: Path, tensor: str) -> None:
    idx = d / "model.safetensors.index.json"
    j = json.loads(idx.read_text())
    del j["weight_map"][tensor]
    idx.write_text(json.dumps(j))


def test_both_layouts_load_with_vision_and_mtp_skipped():
    hf = read_checkpoint(tm.get_model(tm.BASE, "hf_bf16"))
    mlx = read_checkpoint(tm.get_model(tm.BASE, "mlx_q4_bf16"))
    assert (hf.layout, mlx.layout) == ("hf", "mlx")
    assert len(hf.files) >= 2  # sharded, index read
    assert not any(str(f).endswith("mtp.safetensors") for f in hf.files)  # an mtp-only shard is never mapped
    names_hf = {s.name for s in hf.specs}
    assert names_hf == {s.name for s in mlx.specs}
    assert not any("visual" in n or "mtp" in n for n in names_hf)
    norms = {s.name: s.add_one for s in hf.specs}
    assert norms["norm"] and norms["layers.0.input_layernorm"] and not norms["layers.0.linear_attn.norm"]
    assert not any(s.add_one for s in mlx.specs)  # MLX files already hold 1 + w


def test_hf_fused_experts_are_views_not_copies():
    ck = read_checkpoint(tm.get_model(tm.BASE, "hf_bf16"))
    spec = {s.name: s for s in ck.specs}
    g, u = spec["layers.0.mlp.experts.gate_proj"], spec["layers.0.mlp.experts.up_proj"]
    assert g.w.offset == u.w.offset and g.w.file == u.w.file  # the same fused tensor
    assert (g.row_offset, u.row_offset) == (0, tm.BASE.moe_inter) and g.stored_rows == 2 * tm.BASE.moe_inter


def test_config_variants(tmp_path):
    d = _copy("hf_bf16", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    base = load_config(d)
    # text-only config (qwen3_5_moe_text) and the interval form of the layer pattern
    text = dict(cfg["text_config"], model_type="qwen3_5_moe_text")
    text.pop("layer_types")
    text["full_attention_interval"] = 4
    (d / "config.json").write_text(json.dumps(text))
    alt = load_config(d)
    assert alt.layer_types == base.layer_types and alt.rotary_dim == base.rotary_dim == tm.BASE.head_dim // 4
    assert base.eos_token_id[:2] == list(tm.EOS_IDS)


@pytest.mark.parametrize("case", ["model_type", "missing_field", "bad_json", "no_config", "layer_types"])
def test_bad_config(tmp_path, case):
    d = _copy("mlx_q4_bf16", tmp_path)
    path = d / "config.json"
    cfg = json.loads(path.read_text())
    if case == "model_type":
        cfg["model_type"] = "llama"
        match = "model_type 'llama'"
    elif case == "missing_field":
        del cfg["text_config"]["hidden_size"]
        match = "hidden_size is missing"
    elif case == "layer_types":
        cfg["text_config"]["layer_types"] = ["linear_attention"]
        match = "layer_types"
    if case == "bad_json":
        path.write_text("{not json")
        match = "not valid JSON"
    elif case == "no_config":
        path.unlink()
        match = "config.json: missing"
    else:
        path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=match) as e:
        lily.Engine.from_pretrained(d)
    assert "config.json" in str(e.value)


def test_missing_tensor(tmp_path):
    d = _copy("mlx_q4_bf16", tmp_path)
    name = "language_model.model.layers.2.linear_attn.in_proj_z.scales"
    _rewrite_header(_shard_of(d, name), lambda h: h.pop(name))
    _drop_from_index(d, name)
    # without its scales the U32 weight cannot be a dense matrix
    with pytest.raises(CheckpointError, match=r"layers\.2\.linear_attn\.in_proj_z"):
        read_checkpoint(d)
    d2 = _copy("hf_bf16", tmp_path / "b")
    name = "model.language_model.layers.1.mlp.shared_expert.down_proj.weight"
    _rewrite_header(_shard_of(d2, name), lambda h: h.pop(name))
    _drop_from_index(d2, name)
    with pytest.raises(CheckpointError, match=r"missing tensor layers\.1\.mlp\.shared_expert\.down_proj"):
        read_checkpoint(d2)


def test_index_disagrees_with_files(tmp_path):
    d = _copy("hf_bf16", tmp_path)
    name = "model.language_model.norm.weight"
    shard = _shard_of(d, name)
    _rewrite_header(shard, lambda h: h.pop(name))  # still listed in the index
    with pytest.raises(CheckpointError, match=f"{name} listed in the index is not in the file"):
        read_checkpoint(d)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    idx["weight_map"][name] = "model-99999-of-99999.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match="model-99999-of-99999.safetensors: listed in .* but missing"):
        read_checkpoint(d)


def test_wrong_shape_and_dtype(tmp_path):
    d = _copy("hf_bf16", tmp_path)
    name = "model.language_model.layers.0.input_layernorm.weight"
    shard = _shard_of(d, name)

    def shrink(h):
        b, e = h[name]["data_offsets"]
        h[name]["shape"] = [tm.BASE.hidden // 2]
        h[name]["data_offsets"] = [b, b + tm.BASE.hidden]

    _rewrite_header(shard, shrink)
    with pytest.raises(CheckpointError, match=rf"{shard.name}: tensor {name}: shape \[64\], expected \[128\]"):
        read_checkpoint(d)

    d2 = _copy("hf_bf16", tmp_path / "b")
    shard2 = _shard_of(d2, name)
    _rewrite_header(shard2, lambda h: h[name].update(dtype="I16"))
    with pytest.raises(CheckpointError, match=rf"tensor {name}: dtype I16"):
        read_checkpoint(d2)


def test_truncated_file(tmp_path):
    d = _copy("mlx_q4_bf16", tmp_path)
    shard = _shard_of(d, "language_model.lm_head.weight")
    raw = shard.read_bytes()
    shard.write_bytes(raw[: len(raw) - 1000])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: tensor .* ends at byte \d+ but the file has \d+ bytes \(truncated\)"):
        read_checkpoint(d)
    shard.write_bytes(raw[:5])
    with pytest.raises(CheckpointError, match="truncated safetensors file"):
        read_checkpoint(d)


def test_header_that_lies(tmp_path):
    d = _copy("mlx_q4_bf16", tmp_path)
    name = "language_model.model.norm.weight"
    shard = _shard_of(d, name)

    def lie(h):
        h[name]["shape"] = [h[name]["shape"][0] * 2]  # claims twice the data its offsets hold

    _rewrite_header(shard, lie)
    with pytest.raises(CheckpointError, match=rf"tensor {name}: header says BF16\[\d+\].* span "):
        read_checkpoint(d)

    d2 = _copy("mlx_q4_bf16", tmp_path / "b")
    shard2 = _shard_of(d2, name)

    def overlap(h):
        others = [k for k in h if k != "__metadata__" and k != name]
        b, _ = h[others[0]]["data_offsets"]
        size = h[name]["data_offsets"][1] - h[name]["data_offsets"][0]
        h[name]["data_offsets"] = [b, b + size]

    _rewrite_header(shard2, overlap)
    with pytest.raises(CheckpointError, match="overlap"):
        read_checkpoint(d2)

    raw = shard2.read_bytes()
    shard2.write_bytes(struct.pack("<Q", 10**12) + raw[8:])
    with pytest.raises(CheckpointError, match="header length"):
        read_checkpoint(d2)


def test_quantisation_config_mismatch(tmp_path):
    d = _copy("mlx_q4_bf16", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization"]["language_model.model.layers.0.mlp.shared_expert.up_proj"] = {"group_size": 64, "bits": 8}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"layers\.0\.mlp\.shared_expert\.up_proj.*4-bit .* config.json quantization says 8-bit"):
        read_checkpoint(d)


def test_resolve_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no such directory"):
        resolve(str(tmp_path / "nope"))
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        resolve(f)


def test_resolve_hub_repo_offline_from_cache(tmp_path, monkeypatch):
    """A hub repo id resolves through huggingface_hub's cache; offline use works once the files are cached."""
    from huggingface_hub import constants

    src = tm.get_model(tm.BASE, "mlx_q4_bf16")
    cache = tmp_path / "hub"
    repo = cache / "models--lily-test--tiny"
    snap = repo / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    for f in src.iterdir():
        shutil.copy(f, snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    path = resolve("lily-test/tiny", local_files_only=True)
    assert path == snap
    e = lily.Engine.from_pretrained("lily-test/tiny", local_files_only=True)
    ref = lily.Engine.from_pretrained(src)
    ids = np.arange(1, 9)
    np.testing.assert_array_equal(e.logits(ids), ref.logits(ids))
    with pytest.raises(CheckpointError, match="could not fetch"):
        resolve("lily-test/absent", local_files_only=True)
