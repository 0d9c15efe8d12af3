// lily._core: the nanobind module. One init_<area> per file, as in MLX's python/src.
#include <nanobind/nanobind.h>

namespace nb = nanobind;

void init_engine(nb::module_& m);

NB_MODULE(_core, m) {
  m.doc() = "Lily's C++ core: weights, schedule, backends, generation loop";
  init_engine(m);
}
