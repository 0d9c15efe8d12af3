// mslemu runtime: runs a grid of MSL threadgroups on CPU worker threads.
//
// A worker runs one threadgroup at a time; the threadgroup's threads are boost.context fibers that give up
// the CPU only at threadgroup_barrier and simd_* collectives. Between sync points a thread runs alone, so a
// run is deterministic for a given schedule, and forward / reverse / random schedules expose kernels that
// depend on an order the GPU does not promise. Threadgroup memory is a per-worker arena, poisoned (0xFF) for
// every threadgroup. Fiber stacks, arenas and worker threads persist across dispatches.
//
// Faults (out-of-bounds access at a guard page, fiber stack overflow) and byte counting (pages made
// inaccessible for the dispatch) go through one SIGSEGV handler; see mslemu.h for what callers get.
#include "mslemu.h"
#include "mslemu/exec.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/context/detail/fcontext.hpp>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#define MSLEMU_API extern "C" __attribute__((visibility("default")))

#if defined(__linux__) && defined(__x86_64__)
#define MSLEMU_FAULT_HANDLING 1  // decoding the fault (write bit, redirecting the fiber) is ISA specific
#else
#define MSLEMU_FAULT_HANDLING 0
#endif

namespace mslemu {

__thread Thread* t_self = nullptr;

namespace {
namespace fctx = boost::context::detail;

size_t page_size() {
  static const size_t size = (size_t)sysconf(_SC_PAGESIZE);
  return size;
}
uintptr_t page_floor(uintptr_t a) { return a & ~(uintptr_t)(page_size() - 1); }
uintptr_t page_ceil(uintptr_t a) { return page_floor(a + page_size() - 1); }
uint32_t align_up(uint32_t v, uint32_t a) { return (v + a - 1) / a * a; }

std::string format(const char* fmt, va_list ap) {
  char buf[2048];
  vsnprintf(buf, sizeof buf, fmt, ap);
  return buf;
}
std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::string s = format(fmt, ap);
  va_end(ap);
  return s;
}

void* map_or_die(size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    perror("mslemu: mmap");
    abort();
  }
  return p;
}

// ---------------------------------------------------------------------------------------------------------
// Kernel registry
// ---------------------------------------------------------------------------------------------------------
struct Registry {
  std::vector<const KernelInfo*> kernels;
  std::once_flag sorted;
  std::string error;
  void finish() {
    std::call_once(sorted, [this] {
      std::sort(kernels.begin(), kernels.end(),
                [](const KernelInfo* a, const KernelInfo* b) { return strcmp(a->name, b->name) < 0; });
      for (size_t i = 1; i < kernels.size(); ++i)
        if (strcmp(kernels[i - 1]->name, kernels[i]->name) == 0 && error.empty())
          error = format("two kernels have the host name '%s' (%s:%d and %s:%d)", kernels[i]->name, kernels[i - 1]->file,
                         kernels[i - 1]->line, kernels[i]->file, kernels[i]->line);
    });
  }
};
Registry& registry() {
  static Registry r;
  return r;
}

// ---------------------------------------------------------------------------------------------------------
// Regions the fault handler must recognise without locks: fiber stack pools and threadgroup arenas.
// Append-only; entries are published with a release store of the count.
// ---------------------------------------------------------------------------------------------------------
struct KnownRegion {
  uintptr_t lo, hi;
  uint32_t stride;  // stack pools: bytes per stack including its guard page; 0 for arenas
};
constexpr int kMaxKnownRegions = 4096;
KnownRegion g_known[kMaxKnownRegions];
std::atomic<int> g_nknown{0};
std::mutex g_known_mutex;
void publish_region(KnownRegion r) {
  std::lock_guard<std::mutex> lock(g_known_mutex);
  const int n = g_nknown.load(std::memory_order_relaxed);
  if (n == kMaxKnownRegions) return;  // fault messages only get less specific
  g_known[n] = r;
  g_nknown.store(n + 1, std::memory_order_release);
}

// Fiber stacks, each with an inaccessible guard page below it (stacks grow down). Reused by every
// threadgroup and dispatch on the owning worker; grown in chunks when a larger threadgroup arrives.
class StackPool {
 public:
  explicit StackPool(size_t stack_bytes) : stack_bytes_(stack_bytes) {}
  size_t stack_bytes() const { return stack_bytes_; }
  // Tops are staggered by a few cache lines: at a uniform page-multiple stride every fiber's hot frames
  // would map to the same L1 sets and evict each other on each switch.
  char* top(size_t i) const { return tops_[i] - (i % 16) * 256; }
  void reserve(size_t n) {
    if (tops_.size() >= n) return;
    const size_t stride = stack_bytes_ + page_size(), count = n - tops_.size();
    char* base = (char*)map_or_die(stride * count);
    for (size_t i = 0; i < count; ++i) {
      mprotect(base + i * stride, page_size(), PROT_NONE);
      tops_.push_back(base + (i + 1) * stride);
    }
    publish_region({(uintptr_t)base, (uintptr_t)(base + stride * count), (uint32_t)stride});
  }

 private:
  size_t stack_bytes_;
  std::vector<char*> tops_;
};

// ---------------------------------------------------------------------------------------------------------
// Workers
// ---------------------------------------------------------------------------------------------------------
struct DispatchState;

struct Worker {
  StackPool stacks;
  std::vector<Thread> threads;
  std::vector<SimdGroup> simdgroups;
  std::vector<uint32_t> order;
  Group group{};
  unsigned char* arena;  // kMaxThreadgroupMemory bytes, then a guard page
  uint32_t arena_used = 0;
  struct Static {
    TgDecl* decl;
    unsigned char* ptr;
  };
  std::vector<Static> statics;
  fctx::fcontext_t scheduler = nullptr;
  uint64_t rng = 0;
  bool failed = false;
  std::string error;
  uintptr_t fault_addr = 0;  // written by the signal handler, read by the fault trampoline
  bool fault_write = false;
  stack_t altstack{};

  explicit Worker(size_t stack_bytes) : stacks(stack_bytes) {
    threads.resize(kMaxThreadsPerThreadgroup);
    simdgroups.resize(kMaxThreadsPerThreadgroup / kSimdWidth);
    arena = (unsigned char*)map_or_die(kMaxThreadgroupMemory + page_size());
    mprotect(arena + kMaxThreadgroupMemory, page_size(), PROT_NONE);
    publish_region({(uintptr_t)arena, (uintptr_t)arena + kMaxThreadgroupMemory + page_size(), 0});
    // The signal handler needs a stack of its own to report a fiber stack overflow.
    altstack.ss_size = 64 * 1024;
    altstack.ss_sp = map_or_die(altstack.ss_size);
    altstack.ss_flags = 0;
  }
};
__thread Worker* t_worker = nullptr;

// Worker 0 is the thread that calls mslemu_dispatch; workers 1.. are persistent OS threads.
class Pool {
 public:
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }
  void run(int n, const std::function<void(Worker&)>& job) {
    const size_t stack_bytes = stack_kib() * 1024;
    while ((int)workers_.size() < n) workers_.push_back(std::make_unique<Worker>(stack_bytes));
    while ((int)threads_.size() < n - 1) {
      const int id = (int)threads_.size() + 1;
      threads_.emplace_back([this, id] { loop(id); });
    }
    if (n == 1) return run_on_caller(*workers_[0], job);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = &job;
      wanted_ = n;
      pending_ = n - 1;
      ++generation_;
    }
    wake_.notify_all();
    run_on_caller(*workers_[0], job);
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return pending_ == 0; });
    job_ = nullptr;
  }

 private:
  static size_t stack_kib() {
    const char* env = getenv("MSLEMU_STACK_KB");
    const long v = env ? atol(env) : 0;
    return v >= 16 ? (size_t)v : 64;
  }
  static void run_on_caller(Worker& w, const std::function<void(Worker&)>& job) {
    stack_t previous;
    sigaltstack(&w.altstack, &previous);
    t_worker = &w;
    job(w);
    t_worker = nullptr;
    sigaltstack(&previous, nullptr);
  }
  void loop(int id) {
    Worker& w = *workers_[id];
    sigaltstack(&w.altstack, nullptr);
    t_worker = &w;
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(Worker&)>* job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        if (id >= wanted_) continue;
        job = job_;
      }
      (*job)(w);
      std::lock_guard<std::mutex> lock(mutex_);
      if (--pending_ == 0) done_.notify_all();
    }
  }

  std::vector<std::unique_ptr<Worker>> workers_;
  std::vector<std::thread> threads_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const std::function<void(Worker&)>* job_ = nullptr;
  uint64_t generation_ = 0;
  int wanted_ = 0, pending_ = 0;
  bool stop_ = false;
};

uint64_t splitmix(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
template <class T> void shuffle(std::vector<T>& v, size_t n, uint64_t& rng) {
  for (size_t i = n; i > 1; --i) std::swap(v[i - 1], v[splitmix(rng) % i]);
}

// ---------------------------------------------------------------------------------------------------------
// One dispatch
// ---------------------------------------------------------------------------------------------------------
struct DispatchState {
  Launch launch{};
  uint64_t ngroups = 0;
  int order = 0;
  uint64_t seed = 0;
  std::vector<uint64_t> permutation;  // threadgroup order for MSLEMU_ORDER_RANDOM
  std::atomic<uint64_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex mutex;
  std::string error;
};

// Read by the fault handler while a dispatch runs.
std::atomic<const Launch*> g_launch{nullptr};

// Function constants of the running dispatch. Dispatches are serialised, so plain globals suffice.
uint64_t g_constant_value[kMaxFunctionConstants];
bool g_constant_set[kMaxFunctionConstants];

std::string where(const Thread* t) {
  const Group& g = *t->group;
  return format(" [threadgroup (%u,%u,%u), thread (%u,%u,%u) = index %u, simdgroup %u, lane %u]", g.position[0],
                g.position[1], g.position[2], t->position_in_threadgroup[0], t->position_in_threadgroup[1],
                t->position_in_threadgroup[2], t->index_in_threadgroup, t->simdgroup, t->lane);
}
std::string site_text(const Site& s) { return format("%s:%u:%u", s.file, s.line, s.column); }

[[noreturn]] void fiber_main(fctx::transfer_t from) {
  Worker& w = *t_worker;
  w.scheduler = from.fctx;
  Thread* t = (Thread*)from.data;
  w.group.launch->kernel->invoke(t);
  Group& g = *t->group;
  t->wait = Wait::done;
  --g.active;
  --t->sg->active;
  if (g.arrived > 0)
    fail("thread returned while %d threads wait at threadgroup_barrier (%s); every thread of a threadgroup must "
         "reach each barrier",
         g.arrived, site_text(g.barrier_site).c_str());
  fctx::jump_fcontext(w.scheduler, nullptr);
  __builtin_unreachable();
}

void resume(Thread& t) {
  t_self = &t;
  fctx::transfer_t back = fctx::jump_fcontext(t.context, &t);
  t.context = back.fctx;
  t_self = nullptr;
}

bool runnable(const Thread& t) {
  switch (t.wait) {
    case Wait::running: return true;
    case Wait::done: return false;
    case Wait::simd: return t.sg->gen != t.wait_gen || t.sg->arrived == t.sg->active;
    case Wait::barrier: return t.group->gen != t.wait_gen || t.group->arrived == t.group->active;
  }
  return false;
}

std::string lane_list(uint32_t mask) {
  std::string s;
  for (int l = 0; l < kSimdWidth;) {
    if (!(mask >> l & 1)) {
      ++l;
      continue;
    }
    int e = l;
    while (e + 1 < kSimdWidth && (mask >> (e + 1) & 1)) ++e;
    s += (s.empty() ? "" : ",") + (e == l ? format("%d", l) : format("%d-%d", l, e));
    l = e + 1;
  }
  return s;
}

// No thread can run: say where they wait, naming a simdgroup split between a collective and a barrier.
std::string deadlock_message(Worker& w) {
  const Group& g = w.group;
  for (int s = 0; s < g.nsimd; ++s) {
    uint32_t at_simd = 0, at_barrier = 0;
    const Thread* first = nullptr;
    for (int l = 0; l < w.simdgroups[s].nlanes; ++l) {
      const Thread& t = w.threads[s * kSimdWidth + l];
      if (t.wait == Wait::simd) at_simd |= 1u << l, first = first ? first : &t;
      if (t.wait == Wait::barrier) at_barrier |= 1u << l;
    }
    if (at_simd && at_barrier) {
      const SimdGroup& sg = w.simdgroups[s];
      return format("divergent control flow in simdgroup %d: lanes %s wait in %s (%s) while lanes %s wait at "
                    "threadgroup_barrier (%s)",
                    s, lane_list(at_simd).c_str(), sg.op[first->lane], site_text(sg.site[first->lane]).c_str(),
                    lane_list(at_barrier).c_str(), site_text(g.barrier_site).c_str()) +
             where(first);
    }
  }
  int at_barrier = 0, at_simd = 0;
  const Thread* simd_thread = nullptr;
  for (int i = 0; i < g.nthreads; ++i) {
    const Thread& t = w.threads[i];
    if (t.wait == Wait::barrier) ++at_barrier;
    if (t.wait == Wait::simd) ++at_simd, simd_thread = simd_thread ? simd_thread : &t;
  }
  std::string m = format("deadlock: %d threads wait at threadgroup_barrier", at_barrier);
  if (at_barrier) m += " (" + site_text(g.barrier_site) + ")";
  m += format(", %d at simdgroup collectives", at_simd);
  if (simd_thread)
    m += format(" (e.g. %s at %s)", simd_thread->sg->op[simd_thread->lane],
                site_text(simd_thread->sg->site[simd_thread->lane]).c_str());
  return m + format(" [threadgroup (%u,%u,%u)]", g.position[0], g.position[1], g.position[2]);
}

// Runs threadgroup `linear` of the dispatch to completion; false with w.error set on failure.
bool run_group(Worker& w, const DispatchState& d, uint64_t linear) {
  const Launch& L = d.launch;
  Group& g = w.group;
  g.launch = &L;
  const uint64_t tx = L.threadgroups[0], txy = tx * L.threadgroups[1];
  g.position[0] = (uint32_t)(linear % tx);
  g.position[1] = (uint32_t)(linear / tx % L.threadgroups[1]);
  g.position[2] = (uint32_t)(linear / txy);
  for (int k = 0; k < 3; ++k)  // a dispatchThreads grid cuts the last threadgroup of each dimension short
    g.size[k] = std::min(L.threads[k], L.grid[k] - g.position[k] * L.threads[k]);
  const int n = (int)(g.size[0] * g.size[1] * g.size[2]);
  g.nthreads = g.active = n;
  g.arrived = 0;
  g.gen = 0;
  g.nsimd = (n + kSimdWidth - 1) / kSimdWidth;

  // Threadgroup memory: dynamic [[threadgroup(i)]] blocks first, static declarations after them on first use.
  uint32_t offset = 0;
  for (int i = 0; i < kMaxThreadgroupSlots; ++i) {
    g.dynamic_memory[i] = L.dynamic_lengths[i] ? w.arena + offset : nullptr;
    offset += L.dynamic_lengths[i];
  }
  memset(w.arena, 0xFF, offset);
  w.arena_used = offset;
  w.statics.clear();

  for (int s = 0; s < g.nsimd; ++s) {
    SimdGroup& sg = w.simdgroups[s];
    sg.nlanes = sg.active = std::min(kSimdWidth, n - s * kSimdWidth);
    sg.arrived = 0;
    sg.present = 0;
    sg.gen = 0;
  }
  w.stacks.reserve((size_t)n);
  for (int i = 0; i < n; ++i) {
    Thread& t = w.threads[i];
    t.index_in_threadgroup = (uint32_t)i;
    t.position_in_threadgroup[0] = (uint32_t)i % g.size[0];
    t.position_in_threadgroup[1] = (uint32_t)i / g.size[0] % g.size[1];
    t.position_in_threadgroup[2] = (uint32_t)i / (g.size[0] * g.size[1]);
    for (int k = 0; k < 3; ++k) t.position_in_grid[k] = g.position[k] * L.threads[k] + t.position_in_threadgroup[k];
    t.lane = (uint32_t)i % kSimdWidth;
    t.simdgroup = (uint32_t)i / kSimdWidth;
    t.group = &g;
    t.sg = &w.simdgroups[t.simdgroup];
    t.wait = Wait::running;
    t.wait_gen = 0;
    t.context = fctx::make_fcontext(w.stacks.top((size_t)i), w.stacks.stack_bytes() - 4096, fiber_main);
  }

  w.order.resize((size_t)n);
  for (int i = 0; i < n; ++i) w.order[i] = (uint32_t)(d.order == MSLEMU_ORDER_REVERSE ? n - 1 - i : i);
  w.rng = d.seed ^ (linear * 0xD1B54A32D192ED03ull);
  w.failed = false;
  int remaining = n;
  while (remaining > 0) {
    if (d.order == MSLEMU_ORDER_RANDOM) shuffle(w.order, (size_t)n, w.rng);
    bool progressed = false;
    for (int k = 0; k < n; ++k) {
      Thread& t = w.threads[w.order[k]];
      if (!runnable(t)) continue;
      resume(t);
      progressed = true;
      if (w.failed) return false;
      if (t.wait == Wait::done) --remaining;
    }
    if (!progressed) {
      w.error = deadlock_message(w);
      return false;
    }
  }
  return true;
}

// ---------------------------------------------------------------------------------------------------------
// Byte counting (see mslemu.h). Handler-visible state lives in its own mappings, never in a counted page.
// ---------------------------------------------------------------------------------------------------------
constexpr uint8_t kRead = 1, kWritten = 2;

template <class T> class Mapped {  // a zeroed array in private pages
 public:
  Mapped() = default;
  explicit Mapped(size_t n) : n_(n), bytes_(page_ceil(std::max<size_t>(n, 1) * sizeof(T))) {
    p_ = (T*)map_or_die(bytes_);
  }
  Mapped(Mapped&& o) noexcept : p_(o.p_), n_(o.n_), bytes_(o.bytes_) { o.p_ = nullptr; }
  Mapped& operator=(Mapped&& o) noexcept {
    std::swap(p_, o.p_), std::swap(n_, o.n_), std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~Mapped() {
    if (p_) munmap(p_, bytes_);
  }
  T& operator[](size_t i) const { return p_[i]; }
  size_t size() const { return n_; }

 private:
  T* p_ = nullptr;
  size_t n_ = 0, bytes_ = 0;
};

struct CountRegion {
  uintptr_t lo, hi;           // page-aligned
  std::atomic<uint8_t>* state;  // per page: kRead | kWritten
  uint8_t* prot;              // per page: protection before the dispatch
};
CountRegion* g_regions = nullptr;
std::atomic<int> g_nregions{0};

#if MSLEMU_FAULT_HANDLING
// In the signal handler: opens a counted page and records the access; false if addr is not counted or the
// access would fault without counting (then it is a kernel error).
bool count_fault(uintptr_t addr, bool write) {
  const int n = g_nregions.load(std::memory_order_acquire);
  int lo = 0, hi = n - 1;
  while (lo <= hi) {
    const int mid = (lo + hi) / 2;
    const CountRegion& r = g_regions[mid];
    if (addr < r.lo) hi = mid - 1;
    else if (addr >= r.hi) lo = mid + 1;
    else {
      const size_t page = (addr - r.lo) / page_size();
      const uint8_t prot = r.prot[page];
      if (!(prot & (write ? PROT_WRITE : PROT_READ))) return false;
      const uint8_t state = r.state[page].fetch_or(write ? kWritten : kRead) | (write ? kWritten : kRead);
      // Opened read-only until written, so the first write still faults and is recorded.
      mprotect((void*)(r.lo + page * page_size()), page_size(), (state & kWritten) ? prot : (prot & ~PROT_WRITE));
      return true;
    }
  }
  return false;
}
#endif

// Protections of [lo, hi) page by page, from /proc/self/maps; 0 for unmapped pages.
void read_protections(uintptr_t lo, uintptr_t hi, uint8_t* out) {
  memset(out, 0, (hi - lo) / page_size());
  int fd = open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  std::string text;
  char buf[65536];
  for (ssize_t r; (r = read(fd, buf, sizeof buf)) > 0;) text.append(buf, (size_t)r);
  close(fd);
  for (size_t pos = 0; pos < text.size();) {
    size_t eol = text.find('\n', pos);
    if (eol == std::string::npos) eol = text.size();
    unsigned long a, b;
    char perms[8] = {};
    if (sscanf(text.c_str() + pos, "%lx-%lx %7s", &a, &b, perms) == 3 && a < hi && b > lo) {
      const uint8_t prot = (uint8_t)((perms[0] == 'r' ? PROT_READ : 0) | (perms[1] == 'w' ? PROT_WRITE : 0) |
                                     (perms[2] == 'x' ? PROT_EXEC : 0));
      for (uintptr_t p = std::max<uintptr_t>(a, lo); p < std::min<uintptr_t>(b, hi); p += page_size())
        out[(p - lo) / page_size()] = prot;
    }
    pos = eol + 1;
  }
}

class ByteCounter {
 public:
  // Protects every bound buffer; "" or why counting cannot start.
  std::string start(const Launch& L, int nbuffers) {
#if !MSLEMU_FAULT_HANDLING
    return "byte counting is implemented for Linux x86-64 only";
#else
    std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
    for (int i = 0; i < nbuffers; ++i)
      if (L.buffers[i] && L.sizes[i])
        ranges.push_back({page_floor((uintptr_t)L.buffers[i]), page_ceil((uintptr_t)L.buffers[i] + L.sizes[i])});
    std::sort(ranges.begin(), ranges.end());
    std::vector<std::pair<uintptr_t, uintptr_t>> merged;
    for (auto& r : ranges) {
      if (!merged.empty() && r.first <= merged.back().second) merged.back().second = std::max(merged.back().second, r.second);
      else merged.push_back(r);
    }
    regions_ = Mapped<CountRegion>(merged.size());
    for (size_t i = 0; i < merged.size(); ++i) {
      const size_t pages = (merged[i].second - merged[i].first) / page_size();
      states_.emplace_back(pages);
      prots_.emplace_back(pages);
      CountRegion& r = regions_[i];
      r.lo = merged[i].first;
      r.hi = merged[i].second;
      r.state = &states_.back()[0];
      r.prot = &prots_.back()[0];
      read_protections(r.lo, r.hi, r.prot);
      for (size_t p = 0; p < pages; ++p)
        if (!(r.prot[p] & PROT_READ))
          return format("byte counting: buffer memory at %p is not readable mapped memory", (void*)(r.lo + p * page_size()));
    }
    g_regions = &regions_[0];
    g_nregions.store((int)merged.size(), std::memory_order_release);
    for (size_t i = 0; i < merged.size(); ++i) {
      if (mprotect((void*)regions_[i].lo, regions_[i].hi - regions_[i].lo, PROT_NONE) != 0) {
        restore(i);
        return format("byte counting: cannot protect buffer memory at %p", (void*)regions_[i].lo);
      }
    }
    active_ = true;
    return "";
#endif
  }
  // Restores protections and fills the per-slot counts.
  void finish(const Launch& L, int nbuffers, uint64_t* read, uint64_t* written) {
    if (!active_) return;
    restore(regions_.size());
    active_ = false;
    for (int i = 0; i < nbuffers; ++i) {
      read[i] = written[i] = 0;
      const uintptr_t lo = (uintptr_t)L.buffers[i], hi = lo + L.sizes[i];
      if (!lo || lo == hi) continue;
      const CountRegion* r = &regions_[0];
      while (!(lo >= r->lo && lo < r->hi)) ++r;
      for (uintptr_t page = page_floor(lo); page < hi; page += page_size()) {
        const uint8_t s = r->state[(page - r->lo) / page_size()].load(std::memory_order_relaxed);
        const uint64_t bytes = std::min<uintptr_t>(page + page_size(), hi) - std::max(page, lo);
        if (s & kRead) read[i] += bytes;
        if (s & kWritten) written[i] += bytes;
      }
    }
  }

 private:
  void restore(size_t nregions) {
    g_nregions.store(0, std::memory_order_release);
    for (size_t i = 0; i < nregions; ++i) {
      const CountRegion& r = regions_[i];
      const size_t pages = (r.hi - r.lo) / page_size();
      for (size_t p = 0; p < pages;) {  // one mprotect per run of equal protection
        size_t e = p;
        while (e < pages && r.prot[e] == r.prot[p]) ++e;
        mprotect((void*)(r.lo + p * page_size()), (e - p) * page_size(), r.prot[p]);
        p = e;
      }
    }
  }
  Mapped<CountRegion> regions_;
  std::vector<Mapped<std::atomic<uint8_t>>> states_;
  std::vector<Mapped<uint8_t>> prots_;
  bool active_ = false;
};

// ---------------------------------------------------------------------------------------------------------
// Fault handling
// ---------------------------------------------------------------------------------------------------------
#if MSLEMU_FAULT_HANDLING
struct sigaction g_previous[2];  // SIGSEGV, SIGBUS handlers installed before ours

std::string describe_fault(uintptr_t addr, bool write) {
  const char* access = write ? "write" : "read";
  const int nknown = g_nknown.load(std::memory_order_acquire);
  for (int i = 0; i < nknown; ++i) {
    const KnownRegion& k = g_known[i];
    if (addr < k.lo || addr >= k.hi) continue;
    if (k.stride && (addr - k.lo) % k.stride < page_size())
      return format("fiber stack overflow (stacks are %zu KiB; raise MSLEMU_STACK_KB)", (size_t)(k.stride - page_size()) / 1024);
    if (!k.stride)
      return format("threadgroup memory %s past the %u-byte limit", access, kMaxThreadgroupMemory);
  }
  const Launch* L = g_launch.load(std::memory_order_acquire);
  int best = -1;
  uintptr_t best_distance = 64 * 1024;  // farther from every buffer: just an invalid address
  for (int i = 0; L && i < kMaxBufferSlots; ++i) {
    const uintptr_t lo = (uintptr_t)L->buffers[i], hi = lo + L->sizes[i];
    if (!lo) continue;
    if (addr >= lo && addr < hi)
      return format("%s of buffer(%d) at byte %lu faulted (%s memory)", access, i, (unsigned long)(addr - lo),
                    write ? "read-only" : "inaccessible");
    const uintptr_t distance = addr >= hi ? addr - hi : lo - addr;
    if (distance < best_distance) best = i, best_distance = distance;
  }
  if (best >= 0) {
    const uintptr_t lo = (uintptr_t)L->buffers[best];
    const uint64_t size = L->sizes[best];
    if (addr >= lo + size)
      return format("out-of-bounds %s past the end of buffer(%d): byte %lu of a %lu-byte buffer", access, best,
                    (unsigned long)(addr - lo), (unsigned long)size);
    return format("out-of-bounds %s before the start of buffer(%d): %lu bytes before it", access, best,
                  (unsigned long)(lo - addr));
  }
  return format("invalid memory %s at %p", access, (void*)addr);
}

// Entered on the faulting fiber (the handler redirects it here), so formatting and fail() are safe.
[[noreturn]] void fault_trampoline() {
  Worker& w = *t_worker;
  fail("%s", describe_fault(w.fault_addr, w.fault_write).c_str());
}

void chain(int sig, siginfo_t* info, void* context) {
  const struct sigaction& prev = g_previous[sig == SIGBUS];
  if (prev.sa_flags & SA_SIGINFO) {
    if (prev.sa_sigaction) return prev.sa_sigaction(sig, info, context);
  } else if (prev.sa_handler != SIG_DFL && prev.sa_handler != SIG_IGN) {
    return prev.sa_handler(sig);
  }
  signal(sig, SIG_DFL);  // returning re-executes the access, which now gets the default action
}

void on_fault(int sig, siginfo_t* info, void* context) {
  // Counted pages first, touching only handler-private memory: even a fault inside this handler (on a TLS
  // block that happens to share a counted page) resolves here.
  ucontext_t* uc = (ucontext_t*)context;
  const uintptr_t addr = (uintptr_t)info->si_addr;
  const bool write = (uc->uc_mcontext.gregs[REG_ERR] & 2) != 0;
  if (sig == SIGSEGV && count_fault(addr, write)) return;
  Worker* w = t_worker;
  Thread* t = t_self;
  if (!w || !t) return chain(sig, info, context);
  // Abandon the fiber: continue it in fault_trampoline on the top of its own stack (it never resumes).
  w->fault_addr = addr;
  w->fault_write = write;
  uintptr_t sp = ((uintptr_t)w->stacks.top(t->index_in_threadgroup) - 256) & ~(uintptr_t)15;
  uc->uc_mcontext.gregs[REG_RSP] = (greg_t)(sp - 8);  // as if fault_trampoline had been called
  uc->uc_mcontext.gregs[REG_RIP] = (greg_t)(uintptr_t)&fault_trampoline;
}

// Ours stays first even if someone (Python's faulthandler) installed a handler since the last dispatch.
void install_fault_handler() {
  const int signals[2] = {SIGSEGV, SIGBUS};
  for (int i = 0; i < 2; ++i) {
    struct sigaction current;
    sigaction(signals[i], nullptr, &current);
    if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_fault) continue;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    g_previous[i] = current;
    sigaction(signals[i], &sa, nullptr);
  }
}
#else
void install_fault_handler() {}
#endif

std::mutex g_dispatch_mutex;
Pool& pool() {
  static Pool p;
  return p;
}

int default_workers() {
  const char* env = getenv("MSLEMU_WORKERS");
  const int v = env ? atoi(env) : 0;
  return v > 0 ? v : 2;
}

// Checks the dispatch against the kernel and Metal's limits and fills d.launch; "" or the problem.
std::string prepare(const KernelInfo& k, const mslemu_dispatch_desc& desc, DispatchState& d) {
  Launch& L = d.launch;
  L.kernel = &k;
  const uint64_t nthreads = (uint64_t)desc.threads[0] * desc.threads[1] * desc.threads[2];
  if (nthreads == 0) return "threads per threadgroup has a zero dimension";
  if (nthreads > kMaxThreadsPerThreadgroup)
    return format("%lu threads per threadgroup (%u,%u,%u) exceed the limit of %u", (unsigned long)nthreads,
                  desc.threads[0], desc.threads[1], desc.threads[2], kMaxThreadsPerThreadgroup);
  if (nthreads > k.max_threads)
    return format("%lu threads per threadgroup exceed the kernel's [[max_total_threads_per_threadgroup(%u)]]",
                  (unsigned long)nthreads, k.max_threads);
  const bool dispatch_threads = desc.grid[0] || desc.grid[1] || desc.grid[2];
  for (int i = 0; i < 3; ++i) {
    L.threads[i] = desc.threads[i];
    L.threadgroups[i] = dispatch_threads ? (desc.grid[i] + desc.threads[i] - 1) / desc.threads[i] : desc.threadgroups[i];
    L.grid[i] = dispatch_threads ? desc.grid[i] : desc.threadgroups[i] * desc.threads[i];
    if ((uint64_t)L.threadgroups[i] * desc.threads[i] > 0xFFFFFFFFull) return "grid larger than 2^32 threads in a dimension";
  }
  d.ngroups = (uint64_t)L.threadgroups[0] * L.threadgroups[1] * L.threadgroups[2];

  if (desc.nbuffers < 0 || desc.nbuffers > kMaxBufferSlots || (desc.nbuffers && !desc.buffers))
    return format("nbuffers = %d; Metal binds at most %d buffers", desc.nbuffers, kMaxBufferSlots);
  for (int i = 0; i < desc.nbuffers; ++i) {
    L.buffers[i] = desc.buffers[i].ptr;
    L.sizes[i] = desc.buffers[i].ptr ? desc.buffers[i].size : 0;
  }
  if (desc.nthreadgroup < 0 || desc.nthreadgroup > kMaxThreadgroupSlots || (desc.nthreadgroup && !desc.threadgroup_lengths))
    return format("nthreadgroup = %d; Metal binds at most %d threadgroup memory blocks", desc.nthreadgroup, kMaxThreadgroupSlots);
  uint64_t dynamic = 0;
  for (int i = 0; i < desc.nthreadgroup; ++i) {
    if (desc.threadgroup_lengths[i] % 16)
      return format("threadgroup(%d) length %u is not a multiple of 16 bytes, as Metal requires", i, desc.threadgroup_lengths[i]);
    L.dynamic_lengths[i] = desc.threadgroup_lengths[i];
    dynamic += desc.threadgroup_lengths[i];
  }
  if (dynamic > kMaxThreadgroupMemory)
    return format("threadgroup memory of %lu bytes ([[threadgroup(i)]] lengths) exceeds the %u-byte limit",
                  (unsigned long)dynamic, kMaxThreadgroupMemory);
  for (int i = 0; i < k.nuses; ++i) {
    const SlotUse& u = k.uses[i];
    if (u.kind == Bind::buffer) {
      if (u.index >= desc.nbuffers || !L.buffers[u.index]) return format("buffer(%d) is not bound", u.index);
      if (L.sizes[u.index] < u.size)
        return format("buffer(%d) holds %lu bytes but the kernel's reference parameter needs %u", u.index,
                      (unsigned long)L.sizes[u.index], u.size);
    } else if (u.kind == Bind::threadgroup_memory && (u.index >= desc.nthreadgroup || !L.dynamic_lengths[u.index])) {
      return format("threadgroup(%d) has no length set", u.index);
    }
  }

  if (desc.nconstants < 0 || (desc.nconstants && !desc.constants)) return "bad function constant array";
  memset(g_constant_set, 0, sizeof g_constant_set);
  for (int i = 0; i < desc.nconstants; ++i) {
    const uint32_t index = desc.constants[i].index;
    if (index >= kMaxFunctionConstants)
      return format("function constant index %u is beyond mslemu's limit of %u", index, kMaxFunctionConstants - 1);
    g_constant_set[index] = true;
    g_constant_value[index] = desc.constants[i].value;
  }

  if (desc.order < MSLEMU_ORDER_FORWARD || desc.order > MSLEMU_ORDER_RANDOM) return format("unknown order %d", desc.order);
  d.order = desc.order;
  d.seed = desc.seed;
  if (d.order == MSLEMU_ORDER_RANDOM) {
    d.permutation.resize(d.ngroups);
    for (uint64_t i = 0; i < d.ngroups; ++i) d.permutation[i] = i;
    uint64_t rng = d.seed;
    shuffle(d.permutation, d.ngroups, rng);
  }
  if (desc.count_bytes && (!desc.bytes_read || !desc.bytes_written)) return "count_bytes needs bytes_read and bytes_written";
  return "";
}

std::string run(DispatchState& d, int workers) {
  std::function<void(Worker&)> job = [&d](Worker& w) {
    while (!d.failed.load(std::memory_order_relaxed)) {
      const uint64_t i = d.next.fetch_add(1);
      if (i >= d.ngroups) return;
      const uint64_t linear = d.order == MSLEMU_ORDER_RANDOM  ? d.permutation[i]
                              : d.order == MSLEMU_ORDER_REVERSE ? d.ngroups - 1 - i
                                                                : i;
      if (!run_group(w, d, linear)) {
        std::lock_guard<std::mutex> lock(d.mutex);
        if (!d.failed.exchange(true)) d.error = w.error;
        return;
      }
    }
  };
  pool().run((int)std::max<uint64_t>(1, std::min<uint64_t>((uint64_t)workers, d.ngroups)), job);
  return d.error;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------
// Interface used by kernel code (exec.h)
// ---------------------------------------------------------------------------------------------------------
void register_kernel(const KernelInfo* k) { registry().kernels.push_back(k); }

void fail(const char* fmt, ...) {
  Worker& w = *t_worker;
  va_list ap;
  va_start(ap, fmt);
  w.error = format(fmt, ap) + where(t_self);
  va_end(ap);
  w.failed = true;
  fctx::jump_fcontext(w.scheduler, nullptr);  // the scheduler never resumes this fiber
  __builtin_unreachable();
}

void block(Thread*) {
  Worker& w = *t_worker;
  w.scheduler = fctx::jump_fcontext(w.scheduler, nullptr).fctx;
}

void barrier(const Site& site) {
  Thread* t = t_self;
  Group& g = *t->group;
  if (g.active != g.nthreads)
    fail("threadgroup_barrier (%s) reached after %d of %d threads returned; every thread of a threadgroup must "
         "reach each barrier",
         site_text(site).c_str(), g.nthreads - g.active, g.nthreads);
  if (g.arrived == 0) g.barrier_site = site;
  else if (!same_site(g.barrier_site, site))
    fail("threads wait at different threadgroup_barrier calls (%s and %s): a barrier in divergent control flow",
         site_text(g.barrier_site).c_str(), site_text(site).c_str());
  if (++g.arrived == g.active) {  // the last thread releases the others and carries on
    g.arrived = 0;
    ++g.gen;
    return;
  }
  t->wait = Wait::barrier;
  t->wait_gen = g.gen;
  block(t);
  t->wait = Wait::running;
}

void simd_collective(const char* op, const Site& site, uint32_t param, Combine combine) {
  Thread* t = t_self;
  SimdGroup& sg = *t->sg;
  const uint32_t lane = t->lane;
  sg.op[lane] = op;
  sg.site[lane] = site;
  sg.param[lane] = param;
  sg.present |= 1u << lane;
  if (++sg.arrived < sg.active) {
    const uint64_t gen = sg.gen;
    t->wait = Wait::simd;
    t->wait_gen = gen;
    block(t);
    t->wait = Wait::running;
    if (sg.gen != gen) return;  // completed by another lane
    // else the lanes still missing have returned: this lane completes the collective
  }
  const int first = __builtin_ctz(sg.present);
  for (int l = first + 1; l < kSimdWidth; ++l)
    if ((sg.present >> l & 1) && (sg.op[l] != sg.op[first] || !same_site(sg.site[l], sg.site[first])))
      fail("divergent simdgroup collective in simdgroup %u: lane %d is in %s (%s) while lane %d is in %s (%s); all "
           "lanes that have not returned must reach the same simd_* call",
           t->simdgroup, first, sg.op[first], site_text(sg.site[first]).c_str(), l, sg.op[l],
           site_text(sg.site[l]).c_str());
  combine(&sg);
  sg.present = 0;
  sg.arrived = 0;
  ++sg.gen;
}

void* threadgroup_static(TgDecl* decl) {
  Worker& w = *t_worker;
  for (const auto& s : w.statics)
    if (s.decl == decl) return s.ptr;
  const uint32_t offset = align_up(w.arena_used, std::max<uint32_t>(16, decl->align));
  if ((uint64_t)offset + decl->size > kMaxThreadgroupMemory)
    fail("threadgroup memory exceeds the %u-byte limit: '%s' needs %u bytes after %u bytes already allocated "
         "(static + [[threadgroup(i)]])",
         kMaxThreadgroupMemory, decl->name, decl->size, w.arena_used);
  unsigned char* p = w.arena + offset;
  memset(p, 0xFF, decl->size);
  w.arena_used = offset + decl->size;
  w.statics.push_back({decl, p});
  return p;
}

uint64_t function_constant_bits(uint32_t index, const char* name) {
  if (!g_constant_set[index]) fail("function constant '%s' (index %u) is read but the dispatch does not set it", name, index);
  return g_constant_value[index];
}
bool function_constant_defined(uint32_t index) { return g_constant_set[index]; }

}  // namespace mslemu

// ---------------------------------------------------------------------------------------------------------
// C ABI (mslemu.h)
// ---------------------------------------------------------------------------------------------------------
using namespace mslemu;

MSLEMU_API int mslemu_abi_version(void) { return MSLEMU_ABI_VERSION; }

MSLEMU_API const mslemu_kernel* mslemu_find_kernel(const char* host_name) {
  Registry& r = registry();
  r.finish();
  auto it = std::lower_bound(r.kernels.begin(), r.kernels.end(), host_name,
                             [](const KernelInfo* k, const char* name) { return strcmp(k->name, name) < 0; });
  return it != r.kernels.end() && strcmp((*it)->name, host_name) == 0 ? (const mslemu_kernel*)*it : nullptr;
}

MSLEMU_API int mslemu_kernel_count(void) { return (int)registry().kernels.size(); }

MSLEMU_API const char* mslemu_kernel_name(int i) {
  Registry& r = registry();
  r.finish();
  return i >= 0 && i < (int)r.kernels.size() ? r.kernels[i]->name : nullptr;
}

MSLEMU_API const char* mslemu_library_error(void) {
  Registry& r = registry();
  r.finish();
  return r.error.empty() ? nullptr : r.error.c_str();
}

MSLEMU_API int mslemu_dispatch(const mslemu_kernel* kernel, const mslemu_dispatch_desc* desc, char* error, uint64_t error_len) {
  const KernelInfo* k = (const KernelInfo*)kernel;
  std::string problem;
  if (!k || !desc) {
    problem = "[mslemu] mslemu_dispatch: no kernel or no descriptor";
  } else {
    std::lock_guard<std::mutex> lock(g_dispatch_mutex);
    DispatchState d;
    problem = prepare(*k, *desc, d);
    if (problem.empty() && d.ngroups > 0) {
      install_fault_handler();
      ByteCounter counter;
      if (desc->count_bytes) problem = counter.start(d.launch, desc->nbuffers);
      if (problem.empty()) {
        g_launch.store(&d.launch, std::memory_order_release);
        problem = run(d, desc->workers > 0 ? desc->workers : default_workers());
        g_launch.store(nullptr, std::memory_order_release);
      }
      counter.finish(d.launch, desc->nbuffers, desc->bytes_read, desc->bytes_written);
    } else if (problem.empty() && desc->count_bytes) {
      for (int i = 0; i < desc->nbuffers; ++i) desc->bytes_read[i] = desc->bytes_written[i] = 0;
    }
    if (!problem.empty()) problem = format("[mslemu] kernel '%s': ", k->name) + problem;
  }
  if (problem.empty()) return 0;
  if (error && error_len) snprintf(error, error_len, "%s", problem.c_str());
  return 1;
}

MSLEMU_API void* mslemu_alloc(uint64_t size) {
  const uint64_t padded = (std::max<uint64_t>(size, 1) + 15) & ~(uint64_t)15, body = page_ceil(padded);
  void* map = mmap(nullptr, body + page_size(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (map == MAP_FAILED) return nullptr;
  mprotect((char*)map + body, page_size(), PROT_NONE);
  return (char*)map + body - padded;
}

MSLEMU_API void mslemu_free(void* ptr, uint64_t size) {
  if (!ptr) return;
  const uint64_t padded = (std::max<uint64_t>(size, 1) + 15) & ~(uint64_t)15, body = page_ceil(padded);
  munmap((char*)ptr + padded - body, body + page_size());
}
