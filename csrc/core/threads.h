// A small fixed thread pool for the CPU paths: parallel_for splits [0, n) into contiguous ranges, one per
// worker, and blocks until all are done. The reference backend spreads matrix rows and experts with it.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace lily {

class ThreadPool {
 public:
  explicit ThreadPool(int threads = 0);
  ~ThreadPool();
  int size() const { return int(workers_.size()) + 1; }
  // fn(begin, end) over a partition of [0, n); ranges are at least `grain` long.
  void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn, int64_t grain = 1);

 private:
  void worker(int index);
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t n_ = 0, chunk_ = 0;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
};

}  // namespace lily
