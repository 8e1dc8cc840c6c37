// Device collectives staged through host memory (staging_communicator.h).
#include "parallel/staging_communicator.h"

namespace keel {

namespace {

// Waits for the host collective, then copies the result back to the device.
class StagedRequest final : public CommRequest {
 public:
  StagedRequest(std::unique_ptr<CommRequest> inner, std::shared_ptr<DeviceBackend> backend,
                std::vector<float> host, float* device_data)
      : host_(std::move(host)),
        inner_(std::move(inner)),
        backend_(std::move(backend)),
        device_data_(device_data) {}
  void wait() override {
    if (done_) return;
    inner_->wait();
    finish();
  }
  bool test() override {
    if (done_) return true;
    if (!inner_->test()) return false;
    finish();
    return true;
  }

 private:
  void finish() {
    if (!host_.empty()) {
      backend_->copy_from_host(device_data_, host_.data(), host_.size() * sizeof(float));
    }
    done_ = true;
  }
  // host_ before inner_: a request dropped unwaited (an exception mid-backward) destroys inner_
  // first, whose destructor waits for MPI to finish writing into host_.
  std::vector<float> host_;
  std::unique_ptr<CommRequest> inner_;
  std::shared_ptr<DeviceBackend> backend_;
  float* device_data_;
  bool done_ = false;
};

}  // namespace

StagingCommunicator::StagingCommunicator(Communicator& host, Device device)
    : host_(host), backend_(device_backend(device, "a staged collective")), buffers_(2) {}

void StagingCommunicator::to_host(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) backend_->copy_to_host(dst, src, bytes);
}

void StagingCommunicator::to_device(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) backend_->copy_from_host(dst, src, bytes);
}

std::vector<float>& StagingCommunicator::buffer(size_t index, size_t n) {
  std::vector<float>& b = buffers_[index];
  if (b.size() < n) b.resize(n);
  return b;
}

void StagingCommunicator::all_reduce(float* data, int64_t n, ReduceOp op) {
  if (size() == 1 || n == 0) return;  // as the host communicators: nothing moves
  std::vector<float>& h = buffer(0, static_cast<size_t>(n));
  to_host(h.data(), data, n * sizeof(float));
  host_.all_reduce(h.data(), n, op);
  to_device(data, h.data(), n * sizeof(float));
  count(n * static_cast<int64_t>(sizeof(float)));
}

void StagingCommunicator::all_reduce(double* data, int64_t n, ReduceOp op) {
  if (size() == 1 || n == 0) return;
  if (doubles_.size() < static_cast<size_t>(n)) doubles_.resize(n);
  to_host(doubles_.data(), data, n * sizeof(double));
  host_.all_reduce(doubles_.data(), n, op);
  to_device(data, doubles_.data(), n * sizeof(double));
  count(n * static_cast<int64_t>(sizeof(double)));
}

void StagingCommunicator::all_reduce_bf16(float* data, int64_t n) {
  if (size() == 1 || n == 0) return;
  // fp32 crosses PCIe (this path is for correctness, not speed); bf16 crosses the network.
  std::vector<float>& h = buffer(0, static_cast<size_t>(n));
  to_host(h.data(), data, n * sizeof(float));
  host_.all_reduce_bf16(h.data(), n);
  to_device(data, h.data(), n * sizeof(float));
  count(n * 2);
}

void StagingCommunicator::all_reduce_bf16(Bf16* data, int64_t n) {
  if (size() == 1 || n == 0) return;
  if (bf16_.size() < static_cast<size_t>(n)) bf16_.resize(n);
  to_host(bf16_.data(), data, n * sizeof(Bf16));
  host_.all_reduce_bf16(bf16_.data(), n);
  to_device(data, bf16_.data(), n * sizeof(Bf16));
  count(n * static_cast<int64_t>(sizeof(Bf16)));
}

void StagingCommunicator::all_gather(const float* send, float* recv, int64_t n) {
  const size_t total = static_cast<size_t>(n) * size();
  std::vector<float>& s = buffer(0, static_cast<size_t>(n));
  std::vector<float>& r = buffer(1, total);
  to_host(s.data(), send, n * sizeof(float));
  host_.all_gather(s.data(), r.data(), n);
  to_device(recv, r.data(), total * sizeof(float));
  if (size() > 1) count(static_cast<int64_t>(total * sizeof(float)));
}

void StagingCommunicator::reduce_scatter(const float* send, float* recv, int64_t n) {
  const size_t total = static_cast<size_t>(n) * size();
  std::vector<float>& s = buffer(0, total);
  std::vector<float>& r = buffer(1, static_cast<size_t>(n));
  to_host(s.data(), send, total * sizeof(float));
  host_.reduce_scatter(s.data(), r.data(), n);
  to_device(recv, r.data(), n * sizeof(float));
  if (size() > 1) count(static_cast<int64_t>(total * sizeof(float)));
}

void StagingCommunicator::broadcast(float* data, int64_t n, int root) {
  if (size() == 1 || n == 0) return;
  std::vector<float>& h = buffer(0, static_cast<size_t>(n));
  to_host(h.data(), data, n * sizeof(float));
  host_.broadcast(h.data(), n, root);
  to_device(data, h.data(), n * sizeof(float));
  count(n * static_cast<int64_t>(sizeof(float)));
}

void StagingCommunicator::all_gather_bytes(const void* send, void* recv, int64_t bytes) {
  const size_t total = static_cast<size_t>(bytes) * size();
  if (bytes_send_.size() < static_cast<size_t>(bytes)) bytes_send_.resize(bytes);
  if (bytes_recv_.size() < total) bytes_recv_.resize(total);
  to_host(bytes_send_.data(), send, static_cast<size_t>(bytes));
  host_.all_gather_bytes(bytes_send_.data(), bytes_recv_.data(), bytes);
  to_device(recv, bytes_recv_.data(), total);
  if (size() > 1) count(static_cast<int64_t>(total));
}

void StagingCommunicator::broadcast_bytes(void* data, int64_t bytes, int root) {
  if (size() == 1 || bytes == 0) return;
  if (bytes_send_.size() < static_cast<size_t>(bytes)) bytes_send_.resize(bytes);
  to_host(bytes_send_.data(), data, static_cast<size_t>(bytes));
  host_.broadcast_bytes(bytes_send_.data(), bytes, root);
  to_device(data, bytes_send_.data(), static_cast<size_t>(bytes));
  count(bytes);
}

std::unique_ptr<CommRequest> StagingCommunicator::iall_reduce(float* data, int64_t n) {
  if (size() == 1 || n == 0) return std::make_unique<DoneRequest>();
  std::vector<float> h(static_cast<size_t>(n));
  to_host(h.data(), data, n * sizeof(float));
  auto inner = host_.iall_reduce(h.data(), n);  // h's buffer moves into the request, unmoved
  count(n * static_cast<int64_t>(sizeof(float)));
  return std::make_unique<StagedRequest>(std::move(inner), backend_, std::move(h), data);
}

}  // namespace keel
