// lily._core.kernels: the shared harness (kernels.h) and the infrastructure's own test entry points:
// the emulated library's contents, the kernel table, and the Encoder's barrier derivation on a fake device.
// The families' entry points live in kernels_<family>.cpp.
#include "kernels.h"

#include "../backends/metal/metal_sources.h"

#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdlib>
#include <stdexcept>
#include <tuple>

namespace nb = nanobind;

namespace lily::metal {

std::string emu_library_path() {
  if (const char* env = std::getenv("LILY_METAL_EMU"); env && *env) return env;
  const std::string init = nb::cast<std::string>(nb::module_::import_("lily").attr("__file__"));
  return init.substr(0, init.find_last_of('/') + 1) + "_metal_emu.so";
}

nb::dict counters_dict(const Counters& c, const std::function<const char*(gpu::KernelIndex)>& label) {
  nb::dict d, rd, wr;
  d["dispatches"] = c.dispatches;
  d["stages"] = c.stages;
  d["cpu_waits"] = c.cpu_waits;
  d["cpu_waits_in_step"] = c.cpu_waits_in_step;
  d["cpu_waits_drained"] = c.cpu_waits_drained;
  d["command_buffers"] = c.command_buffers;
  for (size_t r = 0; r < size_t(Role::count); ++r) {
    rd[role_name(Role(r))] = c.bytes_read[r];
    wr[role_name(Role(r))] = c.bytes_written[r];
  }
  d["bytes_read"] = rd;
  d["bytes_written"] = wr;
  nb::dict kernels;  // dispatches by kernel, the ones dispatched at least once
  for (size_t k = 0; k < gpu::kMaxKernels; ++k)
    if (c.kernel_dispatches[k])
      kernels[label ? label(gpu::KernelIndex(k)) : kernel_name(KernelId(k))] = c.kernel_dispatches[k];
  d["kernels"] = kernels;
  return d;
}

GemmPath gemm_path(const std::string& name) {
  if (name == "auto") return GemmPath::automatic;
  if (name == "simdgroup") return GemmPath::simdgroup;
  if (name == "tensor") return GemmPath::tensor;
  throw std::invalid_argument("[kernels] path: 'auto', 'simdgroup' or 'tensor', got '" + name + "'");
}

namespace {
std::string& device_setting() {
  static std::string device = "metal-emu";
  return device;
}
}  // namespace

const std::string& kernel_device() { return device_setting(); }

std::unique_ptr<Device> make_kernel_device(const EmuOptions& options) {
  if (kernel_device() == "metal-emu") return make_emu_device(emu_library_path(), options);
#ifdef __APPLE__
  return make_metal_device();
#else
  throw std::invalid_argument("[kernels] device 'metal' needs macOS on Apple silicon");
#endif
}

KernelRun::KernelRun(int order, uint64_t seed, int workers, bool count_bytes, int tensor_ops, uint32_t max_threads) {
  EmuOptions o;
  o.max_threads = max_threads;
  o.tensor_ops = tensor_ops;
  o.order = order;
  o.seed = seed;
  o.workers = workers;
  o.count_bytes = count_bytes;
  device_ = make_kernel_device(o);
}

Buffer* KernelRun::alloc(uint64_t bytes, Role role, const std::string& label, int fill) {
  buffers_.push_back(device_->alloc(bytes, role, label));
  Buffer* b = buffers_.back().get();
  if (bytes) std::memset(b->contents(), fill, bytes);
  return b;
}

void KernelRun::encode(const std::function<void(Encoder&)>& body) {
  auto cb = device_->command_buffer();
  body(cb->encoder());
  cb->commit();
  cb->wait();
}

namespace {

// A Device-less Encoder that only logs what the base class decides: the barrier derivation under test.
class TraceEncoder final : public Encoder {
 public:
  std::vector<std::string> events;
  uint32_t static_bytes = 0;  // every kernel's static threadgroup memory, as a pipeline would report it
  uint32_t static_threadgroup_bytes(gpu::KernelIndex) const override { return static_bytes; }

 protected:
  void do_dispatch(gpu::KernelIndex, Grid, Grid, const void*, size_t, const std::vector<Binding>&, uint32_t) override {
    events.push_back("dispatch");
  }
  void do_barrier() override { events.push_back("barrier"); }
};

class HostBuffer final : public Buffer {
 public:
  void* contents() override { return nullptr; }
};

Access parse_access(const std::string& s) {
  if (s == "r") return Access::read;
  if (s == "w") return Access::write;
  if (s == "rw") return Access::read_write;
  throw std::invalid_argument("[kernels] access must be 'r', 'w' or 'rw', got '" + s + "'");
}

using TraceBinding = std::tuple<int, uint64_t, uint64_t, std::string>;  // buffer index, offset, bytes, access

}  // namespace
}  // namespace lily::metal

using namespace lily::metal;

void init_kernels(nb::module_& k) {
  k.def("available",
        []() {
          try {
            emu_library_kernels(emu_library_path());
            return true;
          } catch (const std::exception&) {
            return false;
          }
        },
        "True when the emulated kernel library (lily/_metal_emu.so) loads.");
  k.def("emu_library_path", &emu_library_path, "Path of the emulated kernel library ($LILY_METAL_EMU overrides).");
  k.def("emu_kernel_names", []() { return emu_library_kernels(emu_library_path()); },
        "Host names of every kernel in the emulated library, sorted.");
  k.def("kernel_table",
        []() {
          std::vector<std::pair<std::string, std::string>> rows;
          for (size_t i = 0; i < size_t(KernelId::count); ++i)
            rows.emplace_back(kernel_family(KernelId(i)), kernel_name(KernelId(i)));
          return rows;
        },
        "(family, host name) of every row of metal/kernels.def, in KernelId order.");
  k.def("check_emu_device",
        [](int order, uint64_t seed) {
          KernelRun run(order, seed);  // throws, naming the missing kernels, if the library lacks a row
          return run.device().name();
        },
        nb::arg("order") = 0, nb::arg("seed") = 0, "Creates an EmuDevice (checks every kernels.def row exists).");
  k.def("set_device",
        [](const std::string& device) {
          if (device != "metal-emu" && device != "metal")
            throw std::invalid_argument("[kernels] device: 'metal-emu' or 'metal', got '" + device + "'");
          device_setting() = device;
        },
        nb::arg("device"), "Chooses the device every kernel entry point runs on: 'metal-emu' (default) or 'metal'.");
  k.def("device", &kernel_device, "The device kernel entry points run on (set_device).");
  k.def("device_report",
        [](int tensor_ops) {
          // A fresh device, as a backend makes one: its facts, then every library compiled and pipeline built.
          EmuOptions o;
          o.tensor_ops = tensor_ops;
          auto dev = make_kernel_device(o);
          std::vector<nb::dict> libraries;
          for (const LibraryStatus& st : dev->build_libraries()) {
            nb::dict l;
            l["library"] = st.library;
            l["msl_version"] = st.msl_version;
            l["families"] = st.families;
            l["kernels"] = st.kernels;
            l["pipelines"] = st.pipelines;
            l["error"] = st.error;
            libraries.push_back(l);
          }
          const DeviceFacts f = dev->facts();
          nb::dict d;
          d["name"] = f.name, d["gpu"] = f.gpu, d["gpu_family"] = f.gpu_family, d["msl_version"] = f.msl_version;
          d["os"] = f.os, d["bf16"] = f.bf16, d["tensor_ops"] = f.tensor_ops;
          d["working_set"] = f.working_set, d["max_buffer"] = f.max_buffer, d["wired_limit"] = f.wired_limit;
          d["libraries"] = libraries;
          return d;
        },
        nb::arg("tensor_ops") = -1,
        "Facts of a new device of kernels.device() and the status of each kernel library: {name, gpu, gpu_family, "
        "msl_version, os, bf16, tensor_ops, working_set, max_buffer, wired_limit, libraries: [{library, "
        "msl_version, families, kernels, pipelines, error}]}. tensor_ops: EmuOptions::tensor_ops (metal-emu).");
  k.def("embedded_sources",
        []() {
          std::vector<std::pair<std::string, std::string>> files;
          for (int i = 0; i < kMetalSourceCount; ++i) files.emplace_back(kMetalSources[i].name, kMetalSources[i].text);
          return files;
        },
        "(name, text) of every metal/ file embedded into the extension (what device_metal.mm compiles).");
  k.def("metal_translation_unit", &metal_translation_unit, nb::arg("file"),
        "The embedded .metal file with its quoted includes inlined: the source newLibraryWithSource receives.");
  k.def("device_probe",
        [](HostArray<uint8_t> q, HostArray<uint16_t> scales, HostArray<uint16_t> biases, HostArray<int32_t> tokens,
           HostArray<float> w, float eps, int order, uint64_t seed) {
          // embed (8-bit E -> x f32) then rmsnorm (x -> bf16) in one command buffer: a read-after-write the
          // Encoder must fence, run under `order`; returns both outputs and the device's counters.
          if (q.ndim() != 2) throw std::invalid_argument("[device_probe] q must be [V, H] uint8 codes");
          const int V = int(q.shape(0)), H = int(q.shape(1)), T = int(tokens.shape(0));
          KernelRun run(order, seed);
          DeviceMatrix M;
          M.format = LILY_W_Q8;
          M.w = run.wrap(q, Role::weights, "E");
          M.scales = run.wrap(scales, Role::weights, "E.scales");
          M.biases = run.wrap(biases, Role::weights, "E.biases");
          M.rows = V, M.cols = H;
          M.w_row_bytes = uint64_t(H);
          M.s_row_bytes = uint64_t(H / LILY_QGROUP) * 2;
          M.matrix_bytes = uint64_t(V) * (M.w_row_bytes + 2 * M.s_row_bytes);
          Buffer* tok = run.upload(tokens, Role::io, "tokens");
          Buffer* x = run.alloc(uint64_t(T) * H * 4, Role::activations, "x");
          Buffer* wv = run.upload(w, Role::weights, "norm");
          Buffer* out = run.alloc(uint64_t(T) * H * 2, Role::activations, "xn");
          run.encode([&](Encoder& enc) {
            encode_embed(enc, M, {tok}, {x}, T);
            encode_rmsnorm(enc, {x}, DeviceVec{wv, 0, H}, {out}, T, H, eps);
          });
          nb::dict d;
          d["x"] = run.download<float>(x, {size_t(T), size_t(H)});
          d["out"] = run.download<uint16_t>(out, {size_t(T), size_t(H)});
          d["counters"] = run.counters();
          return d;
        },
        nb::arg("q"), nb::arg("scales"), nb::arg("biases"), nb::arg("tokens"), nb::arg("w"), nb::arg("eps"),
        nb::arg("order") = 0, nb::arg("seed") = 0);
  k.def("encoder_trace",
        [](const std::vector<uint64_t>& buffer_sizes, const std::vector<std::vector<TraceBinding>>& dispatches,
           uint32_t threadgroup_bytes, uint32_t static_threadgroup_bytes) {
          std::vector<HostBuffer> buffers(buffer_sizes.size());
          for (size_t i = 0; i < buffers.size(); ++i) {
            buffers[i].size = buffer_sizes[i];
            buffers[i].label = "b" + std::to_string(i);
          }
          TraceEncoder enc;
          enc.static_bytes = static_threadgroup_bytes;
          int slot_args = 0;
          for (const auto& d : dispatches) {
            if (d.empty()) {  // an empty list stands for an explicit barrier
              enc.barrier();
              continue;
            }
            std::vector<Binding> bs;
            int slot = 1;
            for (const auto& [index, offset, bytes, access] : d)
              bs.push_back({slot++, &buffers.at(size_t(index)), offset, parse_access(access), bytes});
            // Encoder::dispatch takes an initializer_list; forward up to four bindings.
            auto disp = [&](std::initializer_list<Binding> l) {
              enc.dispatch(KernelId(0), {}, {}, slot_args, l, threadgroup_bytes);
            };
            switch (bs.size()) {
              case 1: disp({bs[0]}); break;
              case 2: disp({bs[0], bs[1]}); break;
              case 3: disp({bs[0], bs[1], bs[2]}); break;
              case 4: disp({bs[0], bs[1], bs[2], bs[3]}); break;
              default: throw std::invalid_argument("[kernels] encoder_trace takes 1..4 bindings per dispatch");
            }
          }
          return std::make_tuple(enc.events, enc.dispatches(), enc.barriers());
        },
        nb::arg("buffer_sizes"), nb::arg("dispatches"), nb::arg("threadgroup_bytes") = 0,
        nb::arg("static_threadgroup_bytes") = 0,
        "Runs the Encoder's barrier derivation on fake buffers. dispatches: a list of binding lists "
        "[(buffer index, offset, bytes (0 = to the end), 'r'|'w'|'rw')], an empty list = explicit barrier. "
        "threadgroup_bytes / static_threadgroup_bytes: each dispatch's host-set and static threadgroup memory. "
        "Returns (events ['dispatch'|'barrier'], dispatches, barriers).");
}
