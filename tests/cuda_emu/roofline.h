// The CUDA emulator's roofline measurement (README.md here, "The roofline estimate"; issue 30
// section 1): for every device task (kernel launch, cuBLASLt matmul, async copy or fill, cub sort)
// the bytes of device memory it reads and writes and the flops it does, so that the GPU benchmark's
// --estimate mode (tests/gpu/train_bench.cc) can price a training step on an H200's roofline.
//
// Bytes are measured, not modelled, so no kernel needs a formula: while a measured task runs,
// every device allocation (cudaMalloc's mappings) is PROT_NONE, and a SIGSEGV handler counts each
// page's first touch: a read fault opens the page for reading (one page read), a write fault opens
// it for reading and writing (one page written; a page read and then written counts both, as a
// read-modify-write moves it both ways). Each page counts once per task, however often the task
// touches it: the ideal cache of the roofline model, where a kernel moves each byte of HBM once.
// Granularity is the host page (4 KiB): a contiguous operand is over-counted by under two pages
// (its partial first and last page), a strided one by the rest of each page it touches.
//
// Flops are not measured: cuBLASLt's are 2 m n k, and a Label names a group of launches with the
// flops of the operation they stand for (the emulated cuDNN attention, tests/cuda_emu/sdpa.cc).
// keel's own kernels count no flops (element-wise and reductions: a few per element, nothing
// against their bytes at 4.8 TB/s).
//
// Off unless set_enabled(true); the measured tasks then run one at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace keel_emu::roofline {

// The H200 SXM's figures (NVIDIA H200 Tensor Core GPU datasheet): HBM3e 4.8 TB/s; BF16/FP16
// tensor cores 1,979 TFLOP/s with 2:4 sparsity, so 989 dense; TF32 tensor cores 989 with sparsity,
// 494.5 dense; FP32 (CUDA cores) 67 TFLOP/s.
constexpr double kHbmBytesPerS = 4.8e12;
constexpr double kBf16TensorFlops = 989e12;
constexpr double kTf32TensorFlops = 494.5e12;
constexpr double kFp32Flops = 67e12;
// The least a launch costs: without CUDA graphs a stream of tiny kernels runs at the launch rate,
// about 2-3 us per cudaLaunchKernel on current drivers (host side); 2.5 us here.
constexpr double kLaunchFloorS = 2.5e-6;

// Which peak a record's flops run at.
enum class Peak { kCudaCores, kTensorBf16, kTensorTf32 };
double peak_flops(Peak p);

// One device task, or one Label's launches together.
struct Record {
  std::string name;
  uint64_t launches = 0;
  uint64_t bytes_read = 0, bytes_written = 0;  // pages first read / first written, in bytes
  double flops = 0;                            // that scale with the tokens (matmuls)
  // Flops that scale with B * T^2 (attention at sequence length T), apart, so a run at a shorter
  // sequence can be scaled to the real one.
  double attention_flops = 0;
  Peak peak = Peak::kCudaCores;
};

// The roofline time of a record: max(bytes / HBM bandwidth, flops / peak, launches x floor).
double seconds(const Record& r);

// Measurement on (the benchmark's estimate mode) or off (the default).
void set_enabled(bool on);
bool enabled();
// The records of tasks submitted since the last take(), in submission order; clears them.
std::vector<Record> take();

// A scope whose launches (submitted on this thread while it lives) go into one record named
// `name` with these flops, instead of one record per launch: the emulated cuDNN's attention is
// keel's kernels standing in for cuDNN's, and is priced as cuDNN's operation.
class Label {
 public:
  Label(const char* name, double flops, double attention_flops, Peak peak);
  ~Label();
  Label(const Label&) = delete;
  Label& operator=(const Label&) = delete;

 private:
  std::shared_ptr<Record> record_;
  std::shared_ptr<Record> outer_;
};

// At a task's submission (runtime.cc, cublaslt.cc): its record when measuring (the open Label's,
// else a new one named `name`), counted as one launch; null when not measuring.
std::shared_ptr<Record> start(const char* name, double flops = 0, Peak peak = Peak::kCudaCores);
// Runs task, with device memory protected and its first touches counted into `rec` when rec is
// not null (Note above); one measured task at a time.
void run_measured(Record* rec, const std::function<void()>& task);

// cudaMalloc's and cudaFree's mappings (runtime.cc): [begin, begin + bytes), page-aligned end.
void add_region(void* begin, size_t bytes);
void remove_region(void* begin);

// The benchmark's last line: "estimated H200 step: X ms, MFU Y% of 989 TFLOP/s".
std::string summary_line(double step_ms, double model_flops_per_step);

}  // namespace keel_emu::roofline
