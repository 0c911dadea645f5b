#include "worker/engine/kernels/cuda/runtime.h"

#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "worker/engine/kernels/cuda/check.h"
#include "worker/engine/kernels/cuda/cublaslt_library.h"

namespace vp::engine::cuda {

absl::Status CudaStatus(cudaError_t error, const char* expr, const char* file, int line) {
  const std::string text =
      absl::StrCat(expr, " failed at ", file, ":", line, ": ", cudaGetErrorName(error), " (",
                   cudaGetErrorString(error), ")");
  switch (error) {
    case cudaSuccess:
      return absl::OkStatus();
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(text);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
      return absl::FailedPreconditionError(text);
    case cudaErrorInvalidValue:
    case cudaErrorInvalidConfiguration:
    case cudaErrorInvalidDevicePointer:
      return absl::InvalidArgumentError(text);
    default:
      return absl::InternalError(text);
  }
}

absl::Status CublasStatus(cublasStatus_t status, const char* expr, const char* file, int line) {
  // A status comes from a cuBLASLt call, so the library is open and names it; the number
  // otherwise.
  absl::StatusOr<const CublasLt*> lt = LoadCublasLt();
  const std::string name = lt.ok() ? absl::StrCat((*lt)->cublasLtGetStatusName(status), " (",
                                                  (*lt)->cublasLtGetStatusString(status), ")")
                                   : absl::StrCat("cuBLAS status ", static_cast<int>(status));
  const std::string text = absl::StrCat(expr, " failed at ", file, ":", line, ": ", name);
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return absl::OkStatus();
    case CUBLAS_STATUS_ALLOC_FAILED:
      return absl::ResourceExhaustedError(text);
    case CUBLAS_STATUS_INVALID_VALUE:
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return absl::InvalidArgumentError(text);
    case CUBLAS_STATUS_NOT_INITIALIZED:
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return absl::FailedPreconditionError(text);
    default:
      return absl::InternalError(text);
  }
}

int DeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the error so later calls do not see it
    return 0;
  }
  return count;
}

absl::StatusOr<std::string> DeviceName(int device) {
  cudaDeviceProp prop{};
  VP_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device));
  return std::string(prop.name);
}

absl::StatusOr<int64_t> DeviceMemoryBytes(int device) {
  cudaDeviceProp prop{};
  VP_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device));
  return static_cast<int64_t>(prop.totalGlobalMem);
}

absl::StatusOr<CudaStream> CudaStream::Create(Priority priority) {
  int least = 0, greatest = 0;  // numerically lower = higher priority
  VP_CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaStream_t s = nullptr;
  VP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithPriority(
      &s, cudaStreamNonBlocking, priority == Priority::kHigh ? greatest : least));
  return CudaStream(s);
}

CudaStream::~CudaStream() {
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

CudaStream::CudaStream(CudaStream&& other) noexcept
    : stream_(std::exchange(other.stream_, nullptr)) {}

CudaStream& CudaStream::operator=(CudaStream&& other) noexcept {
  if (this != &other) {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    stream_ = std::exchange(other.stream_, nullptr);
  }
  return *this;
}

absl::Status CudaStream::Synchronize() const {
  VP_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

std::optional<double> PeakBf16Tflops(std::string_view device_name) {
  const std::string name = absl::AsciiStrToLower(std::string(device_name));
  // Order matters: more specific names first (an "H100 PCIe" also contains "h100").
  struct Entry {
    const char* needle;
    double tflops;
  };
  static constexpr Entry kTable[] = {
      {"h200", 989.0}, {"gh200", 989.0}, {"h100 pcie", 756.0}, {"h100 nvl", 835.0}, {"h100", 989.0},
      {"h800", 989.0}, {"a100", 312.0},  {"a800", 312.0},      {"l40s", 362.0},     {"l40", 181.0},
      {"l4", 121.0},   {"a10", 125.0},   {"rtx 4090", 165.0},
  };
  for (const Entry& e : kTable) {
    if (absl::StrContains(name, e.needle)) return e.tflops;
  }
  return std::nullopt;
}

std::optional<double> Mfu(double flops, double seconds, std::optional<double> peak_tflops) {
  if (!peak_tflops.has_value() || !(*peak_tflops > 0.0) || !(seconds > 0.0) || flops < 0.0) {
    return std::nullopt;
  }
  return flops / seconds / (*peak_tflops * 1e12);
}

}  // namespace vp::engine::cuda
