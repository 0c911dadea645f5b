// Test helper for CUDA tests that run ranks as threads: one rank's device context.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "worker/engine/kernels/cuda/caching_allocator.h"
#include "worker/engine/kernels/cuda/device.h"
#include "worker/engine/kernels/cuda/gemm.h"
#include "worker/engine/kernels/cuda/kernels.h"
#include "worker/engine/kernels/cuda/runtime.h"
#include "worker/engine/memory.h"

namespace vp::engine::cuda::test_support {

// One rank's device in a test: its own stream, GEMM runner and allocator (tracked by `tracker`),
// as a rank's engine has, and copies between host fp32 values and device E (float or bf16,
// rounded on the device). Construct on the thread that uses it; `error` is set when setup failed.
struct TestDevice {
  MemoryTracker tracker;
  std::unique_ptr<CachingAllocator> alloc;
  CudaStream stream;
  std::unique_ptr<GemmRunner> gemm;
  DeviceContext ctx;
  std::string error;

  TestDevice() {
    alloc = std::make_unique<CachingAllocator>(MakeCudaMemoryBackend(), &tracker,
                                               CachingAllocator::Reuse::kAfterSync);
    auto s = CudaStream::Create();
    auto g = GemmRunner::Create();
    if (!s.ok() || !g.ok()) {
      error = "device setup failed";
      return;
    }
    stream = std::move(*s);
    gemm = std::move(*g);
    ctx = DeviceContext{stream.get(), gemm.get(), alloc.get()};
  }

  template <typename E>
  DeviceArray<E> Up(const std::vector<float>& host) {
    auto f = DeviceArray<float>::Create(ctx, MemoryCategory::kActivations, host.size(), false);
    if (!f.ok()) return {};
    cudaMemcpyAsync(f->data(), host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice,
                    ctx.stream);
    if constexpr (std::is_same_v<E, float>) {
      cudaStreamSynchronize(ctx.stream);
      return std::move(*f);
    } else {
      auto d = DeviceArray<E>::Create(ctx, MemoryCategory::kActivations, host.size(), false);
      if (!d.ok()) return {};
      FloatToBf16(d->data(), f->data(), static_cast<long>(host.size()), ctx.stream);
      cudaStreamSynchronize(ctx.stream);
      return std::move(*d);
    }
  }

  template <typename E>
  std::vector<float> Down(const E* p, size_t n) {
    std::vector<float> host(n);
    DeviceArray<float> tmp;
    const float* src = nullptr;
    if constexpr (std::is_same_v<E, float>) {
      src = p;
    } else {
      auto f = DeviceArray<float>::Create(ctx, MemoryCategory::kActivations, n, false);
      if (!f.ok()) return host;
      tmp = std::move(*f);
      Bf16ToFloat(tmp.data(), p, static_cast<long>(n), ctx.stream);
      src = tmp.data();
    }
    cudaMemcpyAsync(host.data(), src, n * sizeof(float), cudaMemcpyDeviceToHost, ctx.stream);
    cudaStreamSynchronize(ctx.stream);
    return host;
  }
};

}  // namespace vp::engine::cuda::test_support
