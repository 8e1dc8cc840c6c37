// ThreadWorld: an in-process fake of a communicator group, for tests that need a group of several
// ranks without MPI. Rank r is a thread; every collective of the Communicator interface meets the
// group at a barrier, reads the other ranks' buffers in place and writes only its own, with the
// semantics and byte counts of MpiCommunicator (the sums in rank order; all_reduce_bf16 rounds
// each value to bf16 and each partial sum too). Non-blocking all-reduces complete at the call.
#pragma once

#include <barrier>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "framework/kernels/cuda/bf16.h"
#include "parallel/communicator.h"

namespace keel::testing {

class ThreadWorld {
 public:
  explicit ThreadWorld(int size) : size_(size), barrier_(size), posted_(size) {
    for (int r = 0; r < size; ++r) comms_.push_back(std::make_unique<Comm>(*this, r));
  }
  int size() const { return size_; }
  Communicator& comm(int rank) { return *comms_[rank]; }

  // Runs body(rank's communicator) on one thread per rank; returns each rank's exception (null:
  // none). A rank that throws must do so where the others do not wait for it.
  std::vector<std::exception_ptr> run(const std::function<void(Communicator&)>& body) {
    std::vector<std::exception_ptr> errors(size_);
    std::vector<std::thread> threads;
    for (int r = 0; r < size_; ++r) {
      threads.emplace_back([&, r] {
        try {
          body(*comms_[r]);
        } catch (...) {
          errors[r] = std::current_exception();
        }
      });
    }
    for (std::thread& t : threads) t.join();
    return errors;
  }

 private:
  class Comm final : public Communicator {
   public:
    Comm(ThreadWorld& w, int rank) : w_(w), rank_(rank) {}
    int rank() const override { return rank_; }
    int size() const override { return w_.size_; }

    void all_reduce(float* data, int64_t n, ReduceOp op) override { reduce(data, n, op); }
    void all_reduce(double* data, int64_t n, ReduceOp op) override { reduce(data, n, op); }
    void all_reduce_bf16(float* data, int64_t n) override {
      if (size() == 1 || n == 0) return;
      count(n * 2);
      std::vector<float> out(static_cast<size_t>(n));
      exchange(data, [&](int r, const void* p) {
        const auto* x = static_cast<const float*>(p);
        for (int64_t i = 0; i < n; ++i) {
          const float v = from_bf16(to_bf16(x[i]));
          out[i] = r == 0 ? v : from_bf16(to_bf16(out[i] + v));
        }
      });
      std::copy(out.begin(), out.end(), data);
    }
    void all_reduce_bf16(Bf16* data, int64_t n) override {
      if (size() == 1 || n == 0) return;
      count(n * 2);
      std::vector<float> out(static_cast<size_t>(n));
      exchange(data, [&](int r, const void* p) {
        const auto* x = static_cast<const Bf16*>(p);
        for (int64_t i = 0; i < n; ++i) {
          out[i] = r == 0 ? from_bf16(x[i]) : from_bf16(to_bf16(out[i] + from_bf16(x[i])));
        }
      });
      for (int64_t i = 0; i < n; ++i) data[i] = to_bf16(out[i]);
    }
    void all_gather(const float* send, float* recv, int64_t n) override {
      all_gather_bytes(send, recv, n * static_cast<int64_t>(sizeof(float)));
    }
    void reduce_scatter(const float* send, float* recv, int64_t n) override {
      if (size() > 1) count(n * size() * static_cast<int64_t>(sizeof(float)));
      std::vector<float> out(static_cast<size_t>(n), 0.0f);
      exchange(send, [&](int r, const void* p) {
        const float* x = static_cast<const float*>(p) + rank_ * n;
        for (int64_t i = 0; i < n; ++i) out[i] = r == 0 ? x[i] : out[i] + x[i];
      });
      std::copy(out.begin(), out.end(), recv);
    }
    void broadcast(float* data, int64_t n, int root) override {
      broadcast_bytes(data, n * static_cast<int64_t>(sizeof(float)), root);
    }
    void all_gather_bytes(const void* send, void* recv, int64_t bytes) override {
      if (size() > 1) count(bytes * size());
      std::vector<unsigned char> out(static_cast<size_t>(bytes) * size());
      exchange(send, [&](int r, const void* p) {
        if (bytes > 0) std::memcpy(out.data() + r * bytes, p, static_cast<size_t>(bytes));
      });
      if (!out.empty()) std::memcpy(recv, out.data(), out.size());
    }
    void broadcast_bytes(void* data, int64_t bytes, int root) override {
      if (size() == 1 || bytes == 0) return;
      count(bytes);
      std::vector<unsigned char> out(static_cast<size_t>(bytes));
      exchange(data, [&](int r, const void* p) {
        if (r == root) std::memcpy(out.data(), p, out.size());
      });
      std::memcpy(data, out.data(), out.size());
    }
    void barrier() override { w_.barrier_.arrive_and_wait(); }
    std::unique_ptr<CommRequest> iall_reduce(float* data, int64_t n) override {
      all_reduce(data, n, ReduceOp::kSum);
      return std::make_unique<DoneRequest>();
    }

   private:
    // Posts `mine`, lets `read(r, rank r's buffer)` see every rank's in rank order, and returns
    // once every rank has read: the caller then writes its own buffer.
    template <typename Read>
    void exchange(const void* mine, Read read) {
      w_.posted_[rank_] = mine;
      w_.barrier_.arrive_and_wait();
      for (int r = 0; r < size(); ++r) read(r, w_.posted_[r]);
      w_.barrier_.arrive_and_wait();
    }
    template <typename T>
    void reduce(T* data, int64_t n, ReduceOp op) {
      if (size() == 1 || n == 0) return;
      count(n * static_cast<int64_t>(sizeof(T)));
      std::vector<T> out(static_cast<size_t>(n));
      exchange(data, [&](int r, const void* p) {
        const T* x = static_cast<const T*>(p);
        for (int64_t i = 0; i < n; ++i) {
          out[i] = r == 0 ? x[i] : op == ReduceOp::kSum ? out[i] + x[i] : std::max(out[i], x[i]);
        }
      });
      std::copy(out.begin(), out.end(), data);
    }

    ThreadWorld& w_;
    int rank_;
  };

  int size_;
  std::barrier<> barrier_;
  std::vector<const void*> posted_;
  std::vector<std::unique_ptr<Comm>> comms_;
};

}  // namespace keel::testing
