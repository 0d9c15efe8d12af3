"""`lily doctor` on the test backend (metal-emu here, the GPU under LILY_TEST_BACKEND=metal): the device facts,
one row per kernel family with its pipelines and the max error of its cases against NumPy, synthetic:tiny end
to end against the reference backend; a broken library is reported as a failed row, naming it, not a crash."""
import re

from lily import cli


def run_doctor(backend, capsys):
    rc = cli.main(["doctor", "--backend", backend, "--seed", "5"])
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


def table(out):
    """{family: (built, total, max error or None, result)} of the doctor's table."""
    rows = {}
    for line in out.splitlines():
        m = re.match(r"(\S+)\s+(?:(\d+)/(\d+)|-)\s+(\S+)\s+(pass|FAIL)\s", line)
        if m:
            rows[m[1]] = (m[2] and int(m[2]), m[3] and int(m[3]), None if m[4] == "-" else float(m[4]), m[5])
    return rows


def test_doctor_passes_and_prints_its_table(gpu_backend, capsys):
    rc, out = run_doctor(gpu_backend, capsys)
    assert rc == 0 and "all checks passed" in out, out
    for fact in ("device", "GPU family", "MSL version", "tensor ops", "working set", "wired limit"):
        assert re.search(rf"^\s*{fact}  \S", out, re.M), (fact, out)
    rows = table(out)
    assert {"common", "dense", "proj", "moe", "gdn", "attn", "synthetic:tiny"} <= set(rows), out
    for family, (built, total, err, result) in rows.items():
        assert result == "pass", (family, out)
        if family != "synthetic:tiny":
            assert built == total > 0, (family, out)
        # every row compared outputs: rounding leaves a small error, far below the O(1) of a real bug
        assert err is not None and err < 0.05, (family, out)


def test_doctor_reports_a_failed_library(gpu_backend, capsys, monkeypatch):
    library = {"metal-emu": "gdn", "metal": "gdn.metal"}.get(gpu_backend, "gdn")
    monkeypatch.setenv("LILY_METAL_FAIL_LIBRARY", library)
    rc, out = run_doctor(gpu_backend, capsys)
    rows = table(out)
    assert rc == 1 and "FAILED" in out, out
    assert rows["gdn"][3] == "FAIL" and rows["gdn"][0] == 0, out
    assert f"{library}: compile of {library} forced to fail" in out, out
    assert all(rows[f][3] == "pass" for f in ("common", "dense", "moe", "attn")), out
    assert rows["synthetic:tiny"][3] == "FAIL", out  # the model needs every family
