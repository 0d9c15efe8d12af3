"""metal/kernels.def, the one table of kernel host names: well-formed rows, each inside its family's block,
named <family prefix>_..., every row dispatched by some encoder (KernelId::<name> in csrc/backends/metal),
and the same set of names as the emulated library (tests/test_metal_device.py checks creation)."""
import re
from pathlib import Path

import pytest

from lily._core import kernels

ROOT = Path(__file__).resolve().parents[1]
DEF = ROOT / "metal" / "kernels.def"
NAME = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)*$")
# Host-name prefixes each family's rows may use (STYLE.md: <family>_<variant>_<dtype>[_<param><value>]).
PREFIXES = {
    "common": ("embed_", "rmsnorm_", "argmax_", "sample_", "copy_"),
    "dense": ("qgemv_", "qgemm_"),
    "moe": ("moe_",),
    "gdn": ("gdn_",),
    "attn": ("attn_",),
    "proj": ("proj_",),
}


def def_rows():
    """[(family of the enclosing block, family argument, name)] in file order."""
    rows, block = [], None
    for line in DEF.read_text().splitlines():
        m = re.match(r"\s*// ---- family: (\w+)", line)
        if m:
            block = m.group(1)
            continue
        if re.match(r"\s*// ---- end", line):
            block = None
            continue
        m = re.match(r"\s*LILY_KERNEL\(\s*(\w+)\s*,\s*(\w+)\s*,\s*(simd|tensor)\s*\)", line)
        if m:
            rows.append((block, m.group(1), m.group(2)))
    return rows


def test_table_matches_def_file():
    table = kernels.kernel_table()
    assert [(f, n) for _, f, n in def_rows()] == [tuple(r) for r in table]


def test_rows_well_formed_and_in_their_block():
    names = set()
    for block, family, name in def_rows():
        assert block is not None, f"{name}: row outside any family block"
        # The block of the dense family is named "qgemv / qgemm" at the top and "dense" at its end.
        assert family == block or (family == "dense" and block == "qgemv"), f"{name}: family {family} in block {block}"
        assert NAME.match(name), f"{name}: not lower_snake_case"
        assert name.startswith(PREFIXES[family]), f"{name}: family {family} expects a prefix in {PREFIXES[family]}"
        assert name not in names, f"{name}: duplicate row"
        names.add(name)


def test_every_row_is_dispatched():
    src = "\n".join(p.read_text() for p in sorted((ROOT / "csrc" / "backends" / "metal").glob("*.cpp")))
    unused = [n for _, _, n in def_rows() if f"KernelId::{n}" not in src]
    assert not unused, f"kernels.def rows no encoder selects (KernelId::<name>): {unused}"


def test_same_names_as_emulated_library():
    if not kernels.available():
        pytest.skip("emulated kernel library not built (needs clang and boost.context)")
    lib = set(kernels.emu_kernel_names())
    table = {n for _, n in kernels.kernel_table()}
    assert not table - lib, f"rows without a [[host_name]] instantiation: {sorted(table - lib)}"
    assert not lib - table, f"instantiations without a kernels.def row: {sorted(lib - table)}"
