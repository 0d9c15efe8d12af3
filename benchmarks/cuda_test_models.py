"""The tiny models the CUDA tests read, copied into one folder to carry to a device machine.

There, mlx and the tokenizer package are absent, so neither the mlx kinds nor the tokenizer can be built; a
missing one fails the tests at setup. They are built here (or taken from the cache, tests/tinymodels.py), and
copied to FOLDER (about 40 MB):

    python3 benchmarks/cuda_test_models.py models
    # device call: carry ["models"], LILY_TEST_MODELS=$PWD/models (benchmarks/cuda_device.sh STEPS=test)
"""

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import tinymodels as tm  # noqa: E402

# tests/test_cuda.py (its CASES are test_metal_model.py's), test_one_row_chunks.py, the fork test
NEEDED = [(tm.PEAKED, "mlx_q4_bf16"), (tm.BASE, "mlx_q4_bf16"), (tm.INTERVAL2, "mlx_q4_bf16"),
          (tm.INTERVAL2, "hf_twin_mlx_q4_bf16"), (tm.GVA4_HD128, "hf_bf16")]


def main(folder: Path) -> None:
    for src in [tm.get_tokenizer_dir()] + [tm.get_model(g, kind) for g, kind in NEEDED]:
        dst = folder / src.relative_to(tm.cache_root())
        if not dst.exists():
            shutil.copytree(src, dst)
        print(dst)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(Path(sys.argv[1]))
