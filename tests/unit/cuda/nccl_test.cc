// NCCL communicator on real devices: one rank per device as threads of this process (NCCL does
// not allow two ranks of one communicator on the same GPU, so with one device only the
// single-rank case runs). Skips with "no CUDA device" without a GPU.
#include <gloo/rendezvous/hash_store.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "proto/plan/topology.h"
#include "worker/comm/nccl/nccl_communicator.h"
#include "worker/engine/kernels/cuda/runtime.h"

namespace vp::comm {
namespace {

using engine::cuda::DeviceCount;

TEST(NcclCommunicator, CollectivesAndPointToPointAcrossDevices) {
  const int p = DeviceCount();
  if (p == 0) GTEST_SKIP() << "no CUDA device";
  auto store = std::make_shared<gloo::rendezvous::HashStore>();
  std::vector<std::string> errors(p);
  std::vector<std::vector<float>> sum(p), mx(p), bc(p), recv(p);
  std::vector<std::thread> threads;
  for (int r = 0; r < p; ++r) {
    threads.emplace_back([&, r] {
      NcclOptions o{.rank = r,
                    .size = p,
                    .device = r,
                    .store = store,
                    .prefix = "test/attempt0/vocab",
                    .high_priority_stream = true,
                    .timeout = absl::Seconds(60)};
      auto comm = ConnectNccl(o);
      if (!comm.ok()) {
        errors[r] = comm.status().ToString();
        return;
      }
      const size_t n = 1000;
      float* buf = nullptr;
      cudaMalloc(reinterpret_cast<void**>(&buf), n * sizeof(float));
      std::vector<float> host(n);
      auto run = [&](auto&& op, std::vector<float>& out) {
        for (size_t i = 0; i < n; ++i) host[i] = float(r + 1) * (i % 7);
        cudaMemcpy(buf, host.data(), n * sizeof(float), cudaMemcpyHostToDevice);
        if (absl::Status s = op(); !s.ok()) errors[r] += s.ToString();
        out.resize(n);
        cudaMemcpy(out.data(), buf, n * sizeof(float), cudaMemcpyDeviceToHost);
      };
      run([&] { return (*comm)->AllReduce(buf, n, ReduceOp::kSum); }, sum[r]);
      run([&] { return (*comm)->AllReduce(buf, n, ReduceOp::kMax); }, mx[r]);
      run([&] { return (*comm)->Broadcast(buf, n, p - 1); }, bc[r]);
      if (p > 1) {  // ring: send to r+1, receive from r−1, grouped so it cannot deadlock
        float* in = nullptr;
        cudaMalloc(reinterpret_cast<void**>(&in), n * sizeof(float));
        run([&] { return (*comm)->SendRecv(buf, n, (r + 1) % p, in, n, (r + p - 1) % p); },
            recv[r]);
        cudaMemcpy(recv[r].data(), in, n * sizeof(float), cudaMemcpyDeviceToHost);
        cudaFree(in);
      }
      if (absl::Status s = (*comm)->Barrier(); !s.ok()) errors[r] += s.ToString();
      cudaFree(buf);
    });
  }
  for (auto& t : threads) t.join();
  const float total = p * (p + 1) / 2.0f;
  for (int r = 0; r < p; ++r) {
    ASSERT_EQ(errors[r], "") << "rank " << r;
    for (size_t i = 0; i < 1000; ++i) {
      ASSERT_EQ(sum[r][i], total * (i % 7));
      ASSERT_EQ(mx[r][i], float(p) * (i % 7));
      ASSERT_EQ(bc[r][i], float(p) * (i % 7));
      if (p > 1) {
        ASSERT_EQ(recv[r][i], float((r + p - 1) % p + 1) * (i % 7));
      }
    }
  }
}

// The job's groups split from one world communicator (ncclCommSplit, as the launcher does):
// with 4+ devices 2 replicas × 2 stages, with 2-3 a pipeline over all, with 1 a world of one
// (the split itself still runs). Each group's sum of (world rank + 1) must be its members'.
TEST(NcclCommunicator, SplitFormsTheTopologysGroups) {
  const int devices = DeviceCount();
  if (devices == 0) GTEST_SKIP() << "no CUDA device";
  const int world = std::min(devices, 4), d = world >= 4 ? 2 : 1, p = world / d;
  auto topology = planner::Topology::Create(p, d);
  ASSERT_TRUE(topology.ok()) << topology.status();
  auto store = std::make_shared<gloo::rendezvous::HashStore>();
  std::vector<std::string> errors(world);
  std::vector<float> pipe_sum(world), data_sum(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      auto w = ConnectNccl({.rank = r,
                            .size = world,
                            .device = r,
                            .store = store,
                            .prefix = "test/attempt0/world",
                            .timeout = absl::Seconds(60)});
      if (!w.ok()) {
        errors[r] = w.status().ToString();
        return;
      }
      const planner::RankCoord c = topology->CoordOf(r);
      auto pipe = (*w)->Split(topology->PipelineGroupId(r), c.stage, c.stage, p, true, "pipe");
      auto data = (*w)->Split(topology->DataGroupId(r), c.replica, c.replica, d, false, "data");
      if (!pipe.ok() || !data.ok()) {
        errors[r] = absl::StrCat(pipe.status().ToString(), " / ", data.status().ToString());
        return;
      }
      // Connected as the launcher connects them (the pipeline with its neighbours).
      for (auto [comm, neighbours] :
           {std::pair{pipe->get(), true}, std::pair{data->get(), false}}) {
        if (absl::Status s = comm->WarmUp(neighbours); !s.ok()) errors[r] += s.ToString();
      }
      // A split whose expectation NCCL cannot meet is refused (the world stays usable).
      auto wrong = (*w)->Split(0, 0, 0, world + 1, false, "too-big");
      if (wrong.status().code() != absl::StatusCode::kInvalidArgument) {
        errors[r] = absl::StrCat("oversized split: ", wrong.status().ToString());
      }
      float* buf = nullptr;
      cudaMalloc(reinterpret_cast<void**>(&buf), sizeof(float));
      for (auto [comm, out] :
           {std::pair{pipe->get(), &pipe_sum}, std::pair{data->get(), &data_sum}}) {
        const float mine = float(r + 1);
        cudaMemcpy(buf, &mine, sizeof(float), cudaMemcpyHostToDevice);
        if (absl::Status s = comm->AllReduce(buf, 1, ReduceOp::kSum); !s.ok()) {
          errors[r] += s.ToString();
        }
        cudaMemcpy(&(*out)[r], buf, sizeof(float), cudaMemcpyDeviceToHost);
      }
      if (absl::Status s = (*w)->Barrier(); !s.ok()) errors[r] += s.ToString();
      cudaFree(buf);
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) {
    ASSERT_EQ(errors[r], "") << "rank " << r;
    float want_pipe = 0, want_data = 0;
    for (int m : topology->PipelineGroup(r)) want_pipe += float(m + 1);
    for (int m : topology->DataGroup(r)) want_data += float(m + 1);
    EXPECT_EQ(pipe_sum[r], want_pipe) << "rank " << r;
    EXPECT_EQ(data_sum[r], want_data) << "rank " << r;
  }
}

TEST(NcclCommunicator, RejectsBadArguments) {
  if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  auto store = std::make_shared<gloo::rendezvous::HashStore>();
  auto comm = ConnectNccl({.rank = 0, .size = 1, .device = 0, .store = store, .prefix = "one"});
  ASSERT_TRUE(comm.ok()) << comm.status();
  EXPECT_TRUE(absl::IsInvalidArgument((*comm)->Send(nullptr, 4, 0, 1)));    // self
  EXPECT_TRUE(absl::IsInvalidArgument((*comm)->Broadcast(nullptr, 4, 3)));  // root
  EXPECT_TRUE((*comm)->Barrier().ok());
  EXPECT_TRUE(absl::IsInvalidArgument(
      ConnectNccl({.rank = 2, .size = 2, .store = store, .prefix = "x"}).status()));
}

}  // namespace
}  // namespace vp::comm
