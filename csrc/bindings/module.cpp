// lily._core: the nanobind module. One init_<area> per file, as in MLX's python/src.
#include <nanobind/nanobind.h>

namespace nb = nanobind;

void init_engine(nb::module_& m);
// Per-family kernel entry points for tests (csrc/bindings/kernels_<family>.cpp): each runs one encoder on
// an EmuDevice and returns numpy arrays.
void init_kernels(nb::module_& k);
void init_kernels_common(nb::module_& k);
void init_kernels_sample(nb::module_& k);
void init_kernels_dense(nb::module_& k);
void init_kernels_moe(nb::module_& k);
void init_kernels_gdn(nb::module_& k);
void init_kernels_attn(nb::module_& k);

NB_MODULE(_core, m) {
  m.doc() = "Lily's C++ core: weights, schedule, backends, generation loop";
  init_engine(m);
  nb::module_ k = m.def_submodule("kernels", "One entry point per Metal encoder, run on the emulated device (tests)");
  init_kernels(k);
  init_kernels_common(k);
  init_kernels_sample(k);
  init_kernels_dense(k);
  init_kernels_moe(k);
  init_kernels_gdn(k);
  init_kernels_attn(k);
}
