// Test support: the ranks of a job — d replicas of a p-stage pipeline with t tensor ranks per
// stage — as threads over real Gloo, each with its groups connected.
#pragma once

#include <atomic>
#include <functional>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "proto/plan/topology.h"
#include "tests/support/gloo_threads.h"
#include "worker/comm/communicator.h"
#include "worker/engine/kernels/cpu/blas.h"

namespace vp::runtime::fixtures {

// Runs `fn(rank, coord, pipeline comm, data comm, tensor comm)` on the d·p·t ranks of a job as
// threads numbered as planner::Topology numbers a job's ranks (rank = tensor + t·(replica +
// d·stage)), one BLAS thread each: its pipeline group (its replica's and tensor index's
// stages), its data group (its stage's and tensor index's replicas; null at d = 1) and its
// tensor group (null at t = 1), connected before `fn` runs.
inline void RunJobGrid(int d, int p, int t,
                       const std::function<void(int, const planner::RankCoord&, comm::Communicator*,
                                                comm::Communicator*, comm::Communicator*)>& fn) {
  auto topology = planner::Topology::Create(p, d, t);
  ASSERT_TRUE(topology.ok()) << topology.status();
  static std::atomic<int> run{0};
  const std::string prefix = absl::StrCat("job-grid", run.fetch_add(1));
  auto store = comm::MakeHashStore();
  comm::testing::RunOnGlooRanks(
      topology->world(),
      [&](comm::GlooCommunicator& w) {
        const int rank = w.rank();
        const planner::RankCoord c = topology->CoordOf(rank);
        engine::cpu::SetBlasThreads(1);
        auto connect = [&](const std::string& name, int id, int r, int size) {
          return comm::testing::ConnectGroup(store, absl::StrCat(prefix, "/", name, id), r, size);
        };
        auto pipe = connect("pipe", topology->PipelineGroupId(rank), c.stage, p);
        auto data = connect("data", topology->DataGroupId(rank), c.replica, d);
        auto tensor = connect("tensor", topology->TensorGroupId(rank), c.tensor, t);
        ASSERT_TRUE(pipe.ok() && data.ok() && tensor.ok()) << "rank " << rank;
        fn(rank, c, pipe->get(), d > 1 ? data->get() : nullptr, t > 1 ? tensor->get() : nullptr);
      },
      absl::Seconds(60), store);
}

// One pipeline (d = 1): `fn(rank, stage, tp, pipeline comm, tensor comm)`, rank = stage·t + tp.
inline void RunGrid(
    int p, int t,
    const std::function<void(int, int, int, comm::Communicator*, comm::Communicator*)>& fn) {
  RunJobGrid(
      1, p, t,
      [&](int rank, const planner::RankCoord& c, comm::Communicator* pipe, comm::Communicator*,
          comm::Communicator* tensor) { fn(rank, c.stage, c.tensor, pipe, tensor); });
}

}  // namespace vp::runtime::fixtures
