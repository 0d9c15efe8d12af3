"""metal/kernels.def, the one table of kernel host names: well-formed rows, each inside its family's block,
named <family prefix>_..., every row dispatched by some encoder (KernelId::<name> in csrc/backends/metal),
each row's function defined (as a template where the row has template arguments) in the .metal file that
instantiates it, no host name written anywhere else in metal/, and the same set of names as the emulated
library at MSL 4.0 (tensor rows absent at 3.1; tests/test_metal_device.py checks creation)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lily._core import kernels

ROOT = Path(__file__).resolve().parents[1]
DEF = ROOT / "metal" / "kernels.def"
NAME = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)*$")
# Host-name prefixes each family's rows may use (<family>_<variant>_<dtype>[_<param><value>], docs/design.md).
PREFIXES = {
    "common": ("embed_", "rmsnorm_", "argmax_", "sample_", "copy_"),
    "dense": ("qgemv_", "qgemm_"),
    "moe": ("moe_",),
    "gdn": ("gdn_",),
    "attn": ("attn_",),
    "proj": ("proj_",),
}


ROW = re.compile(r"\s*LILY_KERNEL(_FN)?\(\s*(\w+)\s*,\s*(\w+)\s*,\s*(simd|tensor)\s*(?:,\s*(\w+)\s*,([^)]*))?\)")


def def_rows(full=False):
    """[(family of the enclosing block, family argument, name)] in file order; full=True adds
    (requires, function, [template arguments]) (function = name and no arguments for LILY_KERNEL_FN rows)."""
    rows, block = [], None
    for line in DEF.read_text().splitlines():
        m = re.match(r"\s*// ---- family: (\w+)", line)
        if m:
            block = m.group(1)
            continue
        if re.match(r"\s*// ---- end", line):
            block = None
            continue
        if not line.startswith("LILY_KERNEL"):
            continue
        m = ROW.fullmatch(line)
        assert m, f"kernels.def: malformed row {line!r}"
        plain, family, name, requires, function, targs = m.groups()
        assert (plain is None) == (function is not None), f"{name}: LILY_KERNEL needs a function and template " \
                                                          f"arguments, LILY_KERNEL_FN neither"
        row = (block, family, name)
        if full:
            row += (requires, function or name, [a.strip() for a in targs.split(",")] if targs else [])
        rows.append(row)
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


def metal_sources():
    return {p.name: p.read_text() for p in sorted((ROOT / "metal").glob("*.metal"))}


def test_each_row_names_a_kernel_its_file_instantiates():
    sources = metal_sources()
    for _, _, name, requires, function, targs in def_rows(full=True):
        if targs:
            # A template kernel, and the file defining it says so to metal/instantiate.h.
            files = [f for f, text in sources.items() if re.search(rf"kernel(\]\])? void {function}\(", text)]
            assert len(files) == 1, f"{name}: kernel template {function} defined in {files}"
            text = sources[files[0]]
            assert re.search(rf"template <[^>]*>\s*\n(?:\[\[kernel\]\]|kernel) void {function}\(", text), \
                f"{name}: {function} in {files[0]} is not a template"
            assert f"#define LILY_DEFINES_{function} LILY_DEFINED" in text, \
                f"{files[0]} defines {function} but does not expand its rows (LILY_DEFINES_{function})"
        else:
            files = [f for f, text in sources.items() if re.search(rf"kernel(\]\])? void {name}\(", text)]
            assert len(files) == 1, f"{name}: a LILY_KERNEL_FN row needs one kernel named {name}, found in {files}"


def test_host_names_written_only_in_kernels_def():
    rows = def_rows(full=True)
    templates = {function for *_, function, targs in rows if targs}
    for f, text in metal_sources().items():
        code = re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)
        assert "host_name(" not in code, f"{f}: a literal [[host_name]]; instantiate through kernels.def"
        for _, _, name, _, _, targs in rows:
            if name in templates:
                continue  # also the name of a kernel template (moe_combine<false>)
            for m in re.finditer(rf"\b{name}\b", code):
                line = code[code.rfind("\n", 0, m.start()) + 1:]
                # A plain kernel's definition is the one other place its name may appear.
                assert not targs and re.match(rf"(\[\[kernel\]\]|kernel) void {name}\(", line), \
                    f"{f}: host name {name} written outside kernels.def"


def checked_names(path, version, include=None):
    """The host names `lower.py check` (Apple's rules included) finds in one .metal file."""
    cmd = [sys.executable, str(ROOT / "csrc" / "mslemu" / "lower.py"), "check", str(path), "--metal-version",
           str(version)] + (["-I", str(include)] if include else [])
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return set(re.search(r"kernels: (.*)\)$", r.stdout.strip()).group(1).split(", "))


@pytest.mark.parametrize("version", [310, 400])
def test_compiled_names_per_msl_version(version):
    names = set()
    for f in sorted((ROOT / "metal").glob("*.metal")):
        names |= checked_names(f, version, ROOT / "metal")
    want = {n for _, _, n, req, _, _ in def_rows(full=True) if version >= 400 or req == "simd"}
    assert names == want


@pytest.mark.parametrize("version", [310, 400])
def test_embedded_units_instantiate_the_same_kernels(version, tmp_path):
    # device_metal.mm compiles metal_translation_unit(file): the embedded sources with instantiate.h and
    # kernels.def inlined. Checked here without include paths, it must yield the kernels of the file on disk.
    for f in sorted((ROOT / "metal").glob("*.metal")):
        unit = tmp_path / f.name
        unit.write_text(kernels.metal_translation_unit(f.name))
        assert checked_names(unit, version) == checked_names(f, version, ROOT / "metal"), f.name
