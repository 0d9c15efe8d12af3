// The library policy shared by MetalDevice and EmuDevice (libraries.h).
#include "libraries.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>

namespace lily::metal {

namespace {

// A compiler's message can run to pages; a warning keeps its first line.
std::string first_line(const std::string& s) {
  const size_t nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl) + " ...";
}

}  // namespace

void KernelLibraries::init_libraries(bool tensor_wanted) {
  tensor_ = tensor_wanted;
  if (const char* env = std::getenv("LILY_METAL_FAIL_LIBRARY")) fail_library_ = env;
}

void KernelLibraries::warn(const std::string& message) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  if (std::find(warned_.begin(), warned_.end(), message) != warned_.end()) return;
  warned_.push_back(message);
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
}

std::string KernelLibraries::forced_failure(const std::string& library, bool msl4) const {
  if (fail_library_ == library || (msl4 && fail_library_ == library + "@4.0"))
    return "compile of " + library + " forced to fail by $LILY_METAL_FAIL_LIBRARY=" + fail_library_;
  return "";
}

std::string KernelLibraries::compile_one(const std::string& library, bool msl4) {
  if (std::string forced = forced_failure(library, msl4); !forced.empty()) return forced;
  return compile_library(library, msl4);
}

void KernelLibraries::compile_all() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  if (compiled_) return;
  std::vector<std::string> retried;  // libraries that compiled only at MSL 3.1
  for (const std::string& lib : library_names()) {
    LibraryStatus st;
    st.library = lib;
    st.msl_version = tensor_ ? "4.0" : "3.1";
    st.error = compile_one(lib, tensor_);
    if (!st.error.empty() && tensor_) {
      retried.push_back(lib + " at MSL 4.0: " + first_line(st.error));
      st.msl_version = "3.1";
      st.error = compile_one(lib, false);
    }
    status_.push_back(st);
  }
  if (tensor_) {
    std::string reason;
    for (size_t i = 0; i < size_t(KernelId::count) && reason.empty(); ++i) {
      const KernelId k = KernelId(i);
      if (!kernel_needs_tensor_ops(k)) continue;
      if (library_of(k).empty()) reason = std::string(kernel_name(k)) + " is in no library compiled at MSL 4.0";
      else if (std::string e = build_pipeline(k); !e.empty()) reason = std::string(kernel_name(k)) + ": " + first_line(e);
    }
    if (!reason.empty()) {
      tensor_ = false;
      std::string why = reason;
      for (const std::string& r : retried) why += "; " + r;
      warn("[metal] warning: Metal 4 tensor ops turned off (" + why + "); prefill runs the MSL 3.1 simdgroup kernels");
      retried.clear();
    }
  }
  for (const std::string& r : retried) warn("[metal] warning: " + r + "; compiled at MSL 3.1 instead");
  for (LibraryStatus& st : status_) {
    for (size_t i = 0; i < size_t(KernelId::count); ++i) {
      if (library_of(KernelId(i)) != st.library || (kernel_needs_tensor_ops(KernelId(i)) && !tensor_)) continue;
      ++st.kernels;
      const std::string family = kernel_family(KernelId(i));
      if (std::find(st.families.begin(), st.families.end(), family) == st.families.end()) st.families.push_back(family);
    }
  }
  compiled_ = true;
}

void KernelLibraries::require(KernelId k) {
  compile_all();
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const std::string where = std::string("[metal] kernel ") + kernel_name(k) + " (family " + kernel_family(k) + ")";
  if (library_of(k).empty()) {
    std::string failed;
    for (const LibraryStatus& st : status_)
      if (!st.error.empty()) failed += "; library " + st.library + " failed: " + st.error;
    throw std::runtime_error(where + " is in no compiled library" +
                             (failed.empty() ? std::string(" (no library failed: it is missing from the sources)") : failed));
  }
  if (std::string e = build_pipeline(k); !e.empty()) throw std::runtime_error(where + ": cannot build its pipeline: " + e);
}

std::vector<LibraryStatus> KernelLibraries::build_all() {
  compile_all();
  std::lock_guard<std::recursive_mutex> lock(mu_);
  std::vector<LibraryStatus> out = status_;
  for (LibraryStatus& st : out) {
    st.pipelines = 0;
    for (size_t i = 0; i < size_t(KernelId::count); ++i) {
      const KernelId k = KernelId(i);
      if (library_of(k) != st.library || (kernel_needs_tensor_ops(k) && !tensor_)) continue;
      if (std::string e = build_pipeline(k); e.empty()) ++st.pipelines;
      else if (st.error.empty()) st.error = std::string(kernel_name(k)) + ": " + e;
    }
  }
  return out;
}

}  // namespace lily::metal
