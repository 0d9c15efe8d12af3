// The reference backend: the whole model in plain fp32 C++, multithreaded. It is the numerical oracle
// the Metal path is tested against, and the portable CPU path. Implements schedule/backend.h.
#pragma once
#include <memory>

#include "../../schedule/backend.h"

namespace lily {

std::unique_ptr<Backend> make_reference_backend(const Model& model, int max_rows, int threads = 0);

}  // namespace lily
