#include "threads.h"

#include <algorithm>
#include <exception>

namespace lily {

ThreadPool::ThreadPool(int threads) {
  if (threads <= 0) threads = int(std::max(1u, std::thread::hardware_concurrency()));
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { worker(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::worker(int index) {
  uint64_t seen = 0;
  for (;;) {
    std::unique_lock<std::mutex> lk(mu_);
    wake_.wait(lk, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    const auto* job = job_;
    const int64_t b = std::min(n_, index * chunk_), e = std::min(n_, b + chunk_);
    lk.unlock();
    if (b < e) (*job)(b, e);
    lk.lock();
    if (--pending_ == 0) done_.notify_one();
  }
}

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn, int64_t grain) {
  if (n <= 0) return;
  const int64_t parts = std::min<int64_t>(size(), std::max<int64_t>(1, n / std::max<int64_t>(1, grain)));
  if (parts <= 1 || workers_.empty()) {
    fn(0, n);
    return;
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    job_ = &fn;
    n_ = n;
    chunk_ = (n + size() - 1) / size();
    pending_ = int(workers_.size());
    ++generation_;
  }
  wake_.notify_all();
  fn(0, std::min(n, chunk_));  // the caller takes range 0
  std::unique_lock<std::mutex> lk(mu_);
  done_.wait(lk, [&] { return pending_ == 0; });
}

}  // namespace lily
