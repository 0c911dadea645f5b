// The CUDA device runtime: device discovery, streams, and the dense bf16 peak used for MFU.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace vp::engine::cuda {

// Number of usable CUDA devices; 0 when there is no device or no driver (never an error, so
// tests can skip with "no CUDA device").
int DeviceCount();

// cudaDeviceProp::name of `device`, e.g. "NVIDIA H100 80GB HBM3".
absl::StatusOr<std::string> DeviceName(int device);

// cudaDeviceProp::totalGlobalMem of `device` in bytes (what a worker reports as its memory).
absl::StatusOr<int64_t> DeviceMemoryBytes(int device);

// A CUDA stream owned for its lifetime (non-blocking with respect to the legacy default
// stream). Move-only; a default-constructed CudaStream holds no stream.
class CudaStream {
 public:
  // priority: kHighPriority for the vocabulary collectives' side stream, kNormalPriority else.
  enum class Priority { kNormal, kHigh };
  static absl::StatusOr<CudaStream> Create(Priority priority = Priority::kNormal);

  CudaStream() = default;
  ~CudaStream();
  CudaStream(CudaStream&& other) noexcept;
  CudaStream& operator=(CudaStream&& other) noexcept;
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  cudaStream_t get() const { return stream_; }
  absl::Status Synchronize() const;

 private:
  explicit CudaStream(cudaStream_t s) : stream_(s) {}
  cudaStream_t stream_ = nullptr;
};

// Dense (no sparsity) bf16 tensor-core peak in TFLOP/s for a device name as CUDA reports it:
// A100 312, H100 SXM 989, H100 PCIe 756, H100 NVL 835, H200 989, L40S 362, L4 121, A10 125,
// RTX 4090 165 (dense, fp32 accumulation ≈ half of the fp16-accumulate figure).
// nullopt for an unknown device: the caller reports no MFU rather than a made-up number
// (or takes the peak from a flag).
std::optional<double> PeakBf16Tflops(std::string_view device_name);

// Model FLOPs utilisation in [0, ∞): flops / seconds / (peak_tflops · 1e12). nullopt when the
// peak is unknown or not positive, or seconds is not positive.
std::optional<double> Mfu(double flops, double seconds, std::optional<double> peak_tflops);

}  // namespace vp::engine::cuda
