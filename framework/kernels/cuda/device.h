// Host-callable entry points of the CUDA backend (compiled only when KEEL_HAVE_CUDA).
#pragma once

#include <cstdint>

namespace keel::kernels::cuda {

int device_count();  // 0 when there is no usable GPU or driver
const char* last_error();
// Runs the device GELU forward and backward on host data (tests the shared per-element math).
bool gelu_roundtrip(const float* host_in, const float* host_dout, float* host_out, float* host_dinp,
                    int64_t n);

}  // namespace keel::kernels::cuda
