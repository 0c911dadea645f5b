// Test helper: runs p ranks as threads of this process, each with its own Gloo communicator
// over real TCP on loopback, rendezvousing through one in-process HashStore.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "worker/comm/gloo/gloo_communicator.h"

namespace vp::comm::testing {

// Calls fn(comm) on p threads (comm.rank() = thread index). All communicators are connected
// before any fn starts and destroyed only after every fn has returned, so a rank that finishes
// early never resets a connection a slower rank still uses. A unique prefix per call keeps
// repeated runs in one process apart.
inline void RunOnGlooRanks(int p, const std::function<void(GlooCommunicator&)>& fn,
                           absl::Duration timeout = absl::Seconds(10),
                           std::shared_ptr<gloo::rendezvous::Store> store = nullptr) {
  static std::atomic<int> next_run{0};
  const std::string prefix = absl::StrCat("run", next_run.fetch_add(1));
  if (store == nullptr) store = MakeHashStore();
  std::vector<std::unique_ptr<GlooCommunicator>> comms(p);
  {
    std::vector<std::thread> threads;
    for (int r = 0; r < p; ++r) {
      threads.emplace_back([&, r] {
        GlooOptions options;
        options.rank = r;
        options.size = p;
        options.store = store;
        options.prefix = prefix;
        options.timeout = timeout;
        auto comm = ConnectGloo(options);
        ASSERT_TRUE(comm.ok()) << comm.status();
        comms[r] = std::move(*comm);
      });
    }
    for (auto& t : threads) t.join();
  }
  for (const auto& c : comms) ASSERT_NE(c, nullptr);
  std::vector<std::thread> threads;
  for (int r = 0; r < p; ++r) threads.emplace_back([&, r] { fn(*comms[r]); });
  for (auto& t : threads) t.join();
}

// A communicator of `size` members of a subgroup (a pipeline, tensor or data group of threads that
// already run, e.g. inside RunOnGlooRanks), connected through `store` under `prefix`.
inline absl::StatusOr<std::unique_ptr<GlooCommunicator>> ConnectGroup(
    std::shared_ptr<gloo::rendezvous::Store> store, const std::string& prefix, int rank, int size,
    absl::Duration timeout = absl::Seconds(60)) {
  GlooOptions options;
  options.rank = rank;
  options.size = size;
  options.store = std::move(store);
  options.prefix = prefix;
  options.timeout = timeout;
  return ConnectGloo(options);
}

}  // namespace vp::comm::testing
