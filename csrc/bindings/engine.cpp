// Bindings of the C++ engine (core/engine.h): config and weight specs filled by src/lily/checkpoint.py,
// Engine and Session driven by src/lily/engine.py.
#include "../core/engine.h"

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/optional.h>

#include <algorithm>
#include <stdexcept>

#include "../backends/metal/metal_backend.h"
#include "../backends/reference/reference.h"
#ifdef LILY_HAVE_CUDA
#include "../backends/cuda/cuda_backend.h"
#endif
#include "kernels.h"

namespace nb = nanobind;
using namespace lily;

using TokenArray = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using FloatArray = nb::ndarray<nb::numpy, float, nb::ndim<2>>;
using LogitsRow = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

static FloatArray to_numpy(std::vector<float>&& v, size_t rows, size_t cols) {
  auto* heap = new std::vector<float>(std::move(v));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<float>*>(p); });
  return FloatArray(heap->data(), {rows, cols}, owner);
}

// `library`: the emulated kernel library (lily/_metal_emu.so) for "metal-emu"; engine.py passes its path.
// `count_bytes` (metal-emu): the emulator's per-page byte counting (the counters' bytes_read/written; off runs
// several times faster and leaves those zero).
// `metal_options`: MetalOptions (metal_backend.h) by field name; an unknown name is an error.
static metal::MetalOptions metal_options_of(const nb::dict& d) {
  metal::MetalOptions o;
  for (auto [k, v] : d) {
    const std::string key = nb::cast<std::string>(k);
    if (key == "gqa_pack") o.gqa_pack = nb::cast<bool>(v);
    else if (key == "pipeline") o.pipeline = nb::cast<bool>(v);
    else if (key == "attn_path") o.attn_path = nb::cast<int>(v);
    else if (key == "gpu_routing") o.gpu_routing = nb::cast<bool>(v);
    else if (key == "moe_tile_rows") o.moe_tile_rows = nb::cast<int>(v);
    else
      throw std::invalid_argument("[engine] unknown metal option '" + key +
                                  "' (gqa_pack, attn_path, gpu_routing, moe_tile_rows, pipeline; the decode fusions "
                                  "are Engine(fusions=...))");
  }
  return o;
}

// `fusions`: Fusions (schedule/backend.h) by field name, each a bool; an unknown name is an error.
static Fusions fusions_of(const nb::dict& d) {
  Fusions f;
  const std::pair<const char*, bool Fusions::*> fields[] = {
      {"norm_project", &Fusions::norm_project}, {"route", &Fusions::route},
      {"attn_prepare", &Fusions::attn_prepare}, {"gdn_step", &Fusions::gdn_step},
      {"expert_swiglu", &Fusions::expert_swiglu}, {"expert_combine", &Fusions::expert_combine},
      {"dequant", &Fusions::dequant}};
  for (auto [k, v] : d) {
    const std::string key = nb::cast<std::string>(k);
    auto it = std::find_if(std::begin(fields), std::end(fields), [&](const auto& fd) { return key == fd.first; });
    if (it == std::end(fields)) {
      std::string names;
      for (const auto& fd : fields) names += std::string(names.empty() ? "" : ", ") + fd.first;
      throw std::invalid_argument("[engine] unknown fusion '" + key + "' (" + names + ")");
    }
    f.*(it->second) = nb::cast<bool>(v);
  }
  return f;
}

// Why backend "cuda" cannot run here, or "" when it can.
static std::string cuda_unavailable() {
#ifdef LILY_HAVE_CUDA
  return cuda::unavailable_reason();
#else
  return "no CUDA device support in this build (lily._core was built without nvcc)";
#endif
}

static std::unique_ptr<Backend> make_backend(const std::string& name, const Model& model, int max_rows, int threads,
                                             const std::string& library, bool count_bytes,
                                             const metal::MetalOptions& options) {
  if (name == "reference") return make_reference_backend(model, max_rows, threads);
  if (name == "metal-emu") {
    metal::EmuOptions o;
    o.workers = threads;
    o.count_bytes = count_bytes;
    return metal::make_metal_backend(model, metal::make_emu_device(library, o), max_rows, options);
  }
#ifdef __APPLE__
  if (name == "metal") return metal::make_metal_backend(model, metal::make_metal_device(), max_rows, options);
#else
  if (name == "metal")
    throw std::invalid_argument("[engine] backend 'metal' needs macOS on Apple silicon; use 'metal-emu' to run the "
                                "same kernels in the emulator");
#endif
  if (name == "cuda") {
    if (const std::string why = cuda_unavailable(); !why.empty()) throw std::invalid_argument("[engine] backend 'cuda': " + why);
#ifdef LILY_HAVE_CUDA
    return cuda::make_cuda_backend(model, max_rows, options.pipeline);
#endif
  }
  throw std::invalid_argument("[engine] unknown backend '" + name + "' (available: reference, metal-emu, metal, cuda)");
}

void init_engine(nb::module_& m) {
  m.def("cuda_unavailable", &cuda_unavailable, "Why backend 'cuda' cannot run here, or '' when it can");
  nb::enum_<DType>(m, "DType").value("f32", DType::f32).value("bf16", DType::bf16).value("f16", DType::f16).value("u32", DType::u32);

  nb::class_<ModelConfig>(m, "ModelConfig")
      .def(nb::init<>())
      .def_rw("vocab", &ModelConfig::vocab)
      .def_rw("hidden", &ModelConfig::hidden)
      .def_rw("layers", &ModelConfig::layers)
      .def_rw("n_q", &ModelConfig::n_q)
      .def_rw("n_kv", &ModelConfig::n_kv)
      .def_rw("head_dim", &ModelConfig::head_dim)
      .def_rw("rotary_dim", &ModelConfig::rotary_dim)
      .def_rw("rope_theta", &ModelConfig::rope_theta)
      .def_rw("lin_nk", &ModelConfig::lin_nk)
      .def_rw("lin_nv", &ModelConfig::lin_nv)
      .def_rw("lin_dk", &ModelConfig::lin_dk)
      .def_rw("lin_dv", &ModelConfig::lin_dv)
      .def_rw("conv_kernel", &ModelConfig::conv_kernel)
      .def_rw("experts", &ModelConfig::experts)
      .def_rw("top_k", &ModelConfig::top_k)
      .def_rw("moe_inter", &ModelConfig::moe_inter)
      .def_rw("shared_inter", &ModelConfig::shared_inter)
      .def_rw("rms_eps", &ModelConfig::rms_eps)
      .def_rw("max_position", &ModelConfig::max_position)
      .def_rw("full_attention", &ModelConfig::full_attention)
      .def("validate", &ModelConfig::validate);

  nb::class_<TensorRef>(m, "TensorRef")
      .def(nb::init<>())
      .def_rw("file", &TensorRef::file)
      .def_rw("offset", &TensorRef::offset)
      .def_rw("nbytes", &TensorRef::nbytes)
      .def_rw("dtype", &TensorRef::dtype)
      .def_rw("shape", &TensorRef::shape);

  nb::class_<WeightSpec>(m, "WeightSpec")
      .def(nb::init<>())
      .def_rw("name", &WeightSpec::name)
      .def_rw("w", &WeightSpec::w)
      .def_rw("scales", &WeightSpec::scales)
      .def_rw("biases", &WeightSpec::biases)
      .def_rw("bits", &WeightSpec::bits)
      .def_rw("group", &WeightSpec::group)
      .def_rw("experts", &WeightSpec::experts)
      .def_rw("rows", &WeightSpec::rows)
      .def_rw("cols", &WeightSpec::cols)
      .def_rw("stored_rows", &WeightSpec::stored_rows)
      .def_rw("row_offset", &WeightSpec::row_offset)
      .def_rw("add_one", &WeightSpec::add_one);

  nb::class_<Model>(m, "Model")
      .def(nb::init<ModelConfig, const std::vector<std::string>&, const std::vector<WeightSpec>&>(),
           nb::arg("config"), nb::arg("files"), nb::arg("specs"))
      .def_prop_ro("config", [](const Model& mo) { return mo.config(); });

  nb::class_<SamplingParams>(m, "SamplingParams")
      .def(nb::init<>())
      .def_rw("temperature", &SamplingParams::temperature)
      .def_rw("top_k", &SamplingParams::top_k)
      .def_rw("top_p", &SamplingParams::top_p)
      .def_rw("min_p", &SamplingParams::min_p)
      .def_rw("repetition_penalty", &SamplingParams::repetition_penalty)
      .def_rw("presence_penalty", &SamplingParams::presence_penalty)
      .def_rw("frequency_penalty", &SamplingParams::frequency_penalty)
      .def_rw("seed", &SamplingParams::seed)
      .def_rw("logprobs", &SamplingParams::logprobs)
      .def_rw("top_logprobs", &SamplingParams::top_logprobs)
      .def("validate", &SamplingParams::validate);

  nb::class_<TokenChoice>(m, "TokenChoice")
      .def_ro("token", &TokenChoice::token)
      .def_ro("logprob", &TokenChoice::logprob)
      .def_ro("top", &TokenChoice::top);

  // The sampler on its own, over logits given by the caller (tests check its distributions).
  nb::class_<Sampler>(m, "Sampler")
      .def(
          "__init__",
          [](Sampler* self, const SamplingParams& p, int vocab, const std::vector<int32_t>& context) {
            new (self) Sampler(p, vocab, context.data(), int64_t(context.size()));
          },
          nb::arg("params"), nb::arg("vocab"), nb::arg("context") = std::vector<int32_t>{})
      .def("sample", [](Sampler& sm, LogitsRow l) { return sm.sample(l.data()); })
      .def(
          "sample_many",
          [](Sampler& sm, LogitsRow l, int64_t n) {
            std::vector<int32_t> out(static_cast<size_t>(n));
            {
              nb::gil_scoped_release nogil;
              for (auto& t : out) t = sm.sample(l.data()).token;
            }
            return out;
          },
          "n draws from one logits row (without accepting them: penalties stay as they are)")
      .def("accept", &Sampler::accept)
      .def("probabilities", [](const Sampler& sm, LogitsRow l) {
        auto p = sm.probabilities(l.data());
        const size_t n = p.size();
        return to_numpy(std::move(p), 1, n);
      })
      .def_prop_ro("draws", &Sampler::draws);

  nb::class_<CancelFlag>(m, "CancelFlag",
                         "Set it from any thread to stop a prompt between two prefill chunks (Engine.stream(cancel=...)); "
                         "the call then raises lily.Cancelled.")
      .def(nb::init<>())
      .def("set", &CancelFlag::set)
      .def("is_set", &CancelFlag::is_set);
  nb::exception<Cancelled>(m, "Cancelled", PyExc_RuntimeError);

  nb::class_<Generation>(m, "Generation")
      .def("next", &Generation::next, nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("done", &Generation::done)
      .def_prop_ro("finish_reason", [](const Generation& g) { return std::string(g.finish_reason()); })
      .def_prop_ro("generated", &Generation::generated)
      .def_prop_ro("max_tokens", &Generation::max_tokens)
      .def("close", &Generation::close)
      .def_prop_ro("pipelined", &Generation::pipelined);

  nb::class_<Session>(m, "Session")
      .def_prop_ro("position", [](const Session& s) { return s.state->pos; })
      .def_prop_ro("tokens", [](const Session& s) { return s.tokens; })
      .def_ro("prefilled", &Session::prefilled)
      .def_ro("decoded", &Session::decoded);

  nb::class_<Engine>(m, "Engine")
      .def("__init__",
           [](Engine* self, std::shared_ptr<Model> model, const std::string& backend, int max_rows, int threads,
              int64_t max_context, const std::string& library, bool count_bytes, const nb::dict& metal_options,
              const nb::dict& fusions) {
             auto b = make_backend(backend, *model, max_rows, threads, library, count_bytes,
                                   metal_options_of(metal_options));
             new (self) Engine(std::move(model), std::move(b), max_context, fusions_of(fusions));
           },
           nb::arg("model"), nb::arg("backend") = "reference", nb::arg("max_rows") = 512, nb::arg("threads") = 0,
           nb::arg("max_context") = 262144, nb::arg("library") = "", nb::arg("count_bytes") = true,
           nb::arg("metal_options") = nb::dict(), nb::arg("fusions") = nb::dict())
      .def(
          "counters",
          [](Engine& e) {
            // {"prefill": {"last": ..., "total": ...}, "decode": {...}}: what the device spent on the last
            // prefill chunk / decode step, and on all of them (GPU backends only; {} otherwise).
            nb::dict d;
            auto* mb = dynamic_cast<gpu::GpuBackend*>(&e.backend());
            if (!mb) return d;
            for (auto [name, phase] : {std::pair{"prefill", Phase::prefill}, std::pair{"decode", Phase::decode}}) {
              nb::dict p;
              const auto label = [mb](gpu::KernelIndex k) { return mb->kernel_label(k); };
              p["last"] = metal::counters_dict(mb->counters(phase, false), label);
              p["total"] = metal::counters_dict(mb->counters(phase, true), label);
              d[name] = p;
            }
            return d;
          },
          "Device counters per phase (dispatches, stages, cpu_waits, command_buffers, bytes by role).")
      .def(
          "memory",
          [](Engine& e, bool reset_peak) {
            // {"live": {role: bytes}, "peak": {role: bytes}, "live_total", "peak_total", "cached"}: device memory the
            // backend allocated (mapped weight files not included); GPU backends only ({} otherwise).
            nb::dict d;
            auto* mb = dynamic_cast<gpu::GpuBackend*>(&e.backend());
            if (!mb) return d;
            const gpu::Memory m = mb->memory();
            nb::dict live, peak;
            for (int r = 0; r < int(gpu::Role::count); ++r) {
              live[gpu::role_name(gpu::Role(r))] = m.live[r];
              peak[gpu::role_name(gpu::Role(r))] = m.peak[r];
            }
            d["live"] = live, d["peak"] = peak, d["live_total"] = m.live_total, d["peak_total"] = m.peak_total;
            d["cached"] = m.cached;
            if (reset_peak) mb->reset_peak_memory();
            return d;
          },
          nb::arg("reset_peak") = false)
      .def_prop_ro("backend", [](Engine& e) { return e.backend().name(); })
      .def_prop_ro("max_rows", [](Engine& e) { return e.backend().max_rows(); })
      .def_prop_ro("max_context", &Engine::max_context)
      .def("new_session", &Engine::new_session)
      .def("clone_session", &Engine::clone_session)
      .def("state_bytes", &Engine::state_bytes)
      .def(
          "export_session",
          [](Engine& e, const Session& s) {
            std::vector<StateTensor> ts;
            {
              nb::gil_scoped_release nogil;
              ts = e.export_session(s);
            }
            nb::list out;
            for (auto& t : ts)
              out.append(nb::make_tuple(t.name, t.dtype, t.shape,
                                        nb::bytes(reinterpret_cast<const char*>(t.data.data()), t.data.size())));
            return out;
          },
          "[(name, dtype, shape, bytes)] of the session's state (Backend::export_state)")
      .def(
          "import_session",
          [](Engine& e, nb::list tensors, const std::vector<int32_t>& tokens) {
            std::vector<StateTensor> ts;
            for (nb::handle h : tensors) {
              nb::tuple t = nb::cast<nb::tuple>(h);
              StateTensor st;
              st.name = nb::cast<std::string>(t[0]);
              st.dtype = nb::cast<std::string>(t[1]);
              st.shape = nb::cast<std::vector<int64_t>>(t[2]);
              nb::bytes b = nb::cast<nb::bytes>(t[3]);
              st.data.assign(static_cast<const uint8_t*>(b.data()), static_cast<const uint8_t*>(b.data()) + b.size());
              ts.push_back(std::move(st));
            }
            nb::gil_scoped_release nogil;
            return e.import_session(ts, tokens);
          },
          nb::arg("tensors"), nb::arg("tokens"))
      .def(
          "generation",
          [](Engine& e, Session& s, TokenArray prompt, int64_t max_tokens, const std::vector<int32_t>& stop_ids,
             const SamplingParams& params, int chunk, std::optional<LogitsRow> first_logits,
             std::shared_ptr<CancelFlag> cancel) {
            GenerateOptions o;
            o.max_tokens = max_tokens, o.stop_ids = stop_ids, o.sampling = params, o.chunk = chunk;
            o.cancel = std::move(cancel);
            if (first_logits && int64_t(first_logits->shape(0)) != e.model().config().vocab)
              throw std::invalid_argument("[engine] first_logits must have vocab entries");
            return new Generation(e, s, prompt.data(), int64_t(prompt.shape(0)), o,
                                  first_logits ? first_logits->data() : nullptr);
          },
          nb::arg("session"), nb::arg("prompt"), nb::arg("max_tokens"), nb::arg("stop_ids"), nb::arg("params"),
          nb::arg("chunk") = 0, nb::arg("first_logits") = nb::none(), nb::arg("cancel").none() = nb::none(),
          nb::rv_policy::take_ownership,
          nb::keep_alive<0, 1>(), nb::keep_alive<0, 2>())
      .def(
          "logits",
          [](Engine& e, Session& s, TokenArray tokens, int chunk) {
            const int64_t n = int64_t(tokens.shape(0));
            std::vector<float> out;
            {
              nb::gil_scoped_release nogil;
              out = e.logits(s, tokens.data(), n, chunk);
            }
            return to_numpy(std::move(out), size_t(n), size_t(e.model().config().vocab));
          },
          nb::arg("session"), nb::arg("tokens"), nb::arg("chunk") = 0)
      .def(
          "feed",
          [](Engine& e, Session& s, TokenArray tokens, int chunk, std::shared_ptr<CancelFlag> cancel,
             bool logits) -> nb::object {
            std::vector<float> out;
            {
              nb::gil_scoped_release nogil;
              out = e.feed(s, tokens.data(), int64_t(tokens.shape(0)), chunk, cancel.get(), logits);
            }
            if (!logits) return nb::none();
            return nb::cast(to_numpy(std::move(out), 1, size_t(e.model().config().vocab)));
          },
          nb::arg("session"), nb::arg("tokens"), nb::arg("chunk") = 0, nb::arg("cancel").none() = nb::none(),
          nb::arg("logits") = true,
          "Feeds tokens; the last one's logits [1, V], or None without `logits` (then nothing waits for the device).");
}
