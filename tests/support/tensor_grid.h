// Test support: the t·p ranks of one pipeline with tensor groups, as threads over real Gloo.
#pragma once

#include <atomic>
#include <functional>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/support/gloo_threads.h"
#include "worker/comm/communicator.h"
#include "worker/engine/kernels/cpu/blas.h"

namespace vp::runtime::fixtures {

// Runs `fn(rank, stage, tp, pipeline comm, tensor comm)` on the t·p ranks of one pipeline as
// threads (rank = stage·t + tp, one BLAS thread each), each with its pipeline group (the ranks
// of its tensor index) and its tensor group (null at t = 1) connected.
inline void RunGrid(
    int p, int t,
    const std::function<void(int, int, int, comm::Communicator*, comm::Communicator*)>& fn) {
  static std::atomic<int> run{0};
  const std::string prefix = absl::StrCat("tp-grid", run.fetch_add(1));
  auto store = comm::MakeHashStore();
  comm::testing::RunOnGlooRanks(
      p * t,
      [&](comm::GlooCommunicator& w) {
        const int rank = w.rank(), tp = rank % t, stage = rank / t;
        engine::cpu::SetBlasThreads(1);
        auto connect = [&](const std::string& name, int r, int size) {
          return comm::testing::ConnectGroup(store, absl::StrCat(prefix, "/", name), r, size);
        };
        auto pipe = connect(absl::StrCat("pipe-t", tp), stage, p);
        auto tensor = connect(absl::StrCat("tensor-s", stage), tp, t);
        ASSERT_TRUE(pipe.ok() && tensor.ok());
        fn(rank, stage, tp, pipe->get(), t > 1 ? tensor->get() : nullptr);
      },
      absl::Seconds(60), store);
}

}  // namespace vp::runtime::fixtures
