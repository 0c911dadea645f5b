// PlaceRanks: which free worker runs which rank (coordinator/server/placement.h).
#include "coordinator/server/placement.h"

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

namespace vp::server {
namespace {

planner::Topology Grid(int p, int d) { return *planner::Topology::Create(p, d); }

// Workers registered in this order: host name and device per worker, no hints.
std::vector<PlacementCandidate> Workers(const std::vector<std::pair<std::string, int>>& list) {
  std::vector<PlacementCandidate> out;
  for (size_t i = 0; i < list.size(); ++i) {
    out.push_back({.hostname = list[i].first,
                   .device = list[i].second,
                   .registered = static_cast<int64_t>(i + 1)});
  }
  return out;
}

// The hosts of replica r's pipeline, stage by stage.
std::vector<std::string> PipelineHosts(const std::vector<PlacementCandidate>& c,
                                       const std::vector<int>& placed, const planner::Topology& t,
                                       int replica) {
  std::vector<std::string> hosts;
  for (int s = 0; s < t.pipeline(); ++s)
    hosts.push_back(c[placed[t.RankOf({.stage = s, .replica = replica})]].hostname);
  return hosts;
}

TEST(PlaceRanks, APipelineStaysOnOneHostInDeviceOrder) {
  // Two hosts of four GPUs, registered interleaved and out of device order.
  const auto c =
      Workers({{"a", 2}, {"b", 0}, {"a", 0}, {"b", 3}, {"a", 3}, {"b", 1}, {"a", 1}, {"b", 2}});
  const planner::Topology t = Grid(4, 2);
  const std::vector<int> placed = PlaceRanks(c, t);
  ASSERT_EQ(placed.size(), 8u);
  EXPECT_EQ(std::set<int>(placed.begin(), placed.end()).size(), 8u);  // each worker once
  for (int replica = 0; replica < 2; ++replica) {
    const auto hosts = PipelineHosts(c, placed, t, replica);
    EXPECT_EQ(std::set<std::string>(hosts.begin(), hosts.end()).size(), 1u) << replica;
    for (int s = 0; s < 4; ++s) {
      EXPECT_EQ(c[placed[t.RankOf({.stage = s, .replica = replica})]].device, s)
          << "replica " << replica << " stage " << s;
    }
  }
  // Replica 0 on the host that comes first in registration order (a tie in size).
  EXPECT_EQ(PipelineHosts(c, placed, t, 0)[0], "a");
}

TEST(PlaceRanks, WholePipelinesFirstThenTheRestAcrossHosts) {
  // p = 3, d = 3 over hosts of 5, 3 and 1 workers: two whole pipelines (one on each of the
  // bigger hosts) and one made of the leftovers.
  std::vector<std::pair<std::string, int>> list;
  for (int i = 0; i < 5; ++i) list.push_back({"big", i});
  for (int i = 0; i < 3; ++i) list.push_back({"mid", i});
  list.push_back({"small", 0});
  const auto c = Workers(list);
  const planner::Topology t = Grid(3, 3);
  const std::vector<int> placed = PlaceRanks(c, t);
  ASSERT_EQ(placed.size(), 9u);
  int whole = 0;
  for (int replica = 0; replica < 3; ++replica) {
    const auto hosts = PipelineHosts(c, placed, t, replica);
    whole += std::set<std::string>(hosts.begin(), hosts.end()).size() == 1;
  }
  EXPECT_EQ(whole, 2);
  EXPECT_EQ(PipelineHosts(c, placed, t, 0), (std::vector<std::string>{"big", "big", "big"}));
  EXPECT_EQ(PipelineHosts(c, placed, t, 1), (std::vector<std::string>{"mid", "mid", "mid"}));
  EXPECT_EQ(PipelineHosts(c, placed, t, 2), (std::vector<std::string>{"big", "big", "small"}));
}

TEST(PlaceRanks, HintsOnEveryChosenWorkerDecideTheRanks) {
  auto c = Workers({{"a", 0}, {"b", 0}, {"a", 1}, {"b", 1}});
  for (int i = 0; i < 4; ++i) c[i].rank_hint = 3 - i;  // the platform numbered them backwards
  const std::vector<int> placed = PlaceRanks(c, Grid(2, 2));
  EXPECT_EQ(placed, (std::vector<int>{3, 2, 1, 0}));
}

TEST(PlaceRanks, TheChosenSetIsTheFirstByHintThenRegistration) {
  // Five free workers for four ranks: the one registered last and without a hint waits, even
  // though its host would keep a pipeline together.
  auto c = Workers({{"a", 0}, {"b", 0}, {"a", 1}, {"b", 1}, {"a", 2}});
  c[1].rank_hint = 0;
  const std::vector<int> placed = PlaceRanks(c, Grid(2, 2));
  ASSERT_EQ(placed.size(), 4u);
  EXPECT_EQ(std::set<int>(placed.begin(), placed.end()), (std::set<int>{0, 1, 2, 3}));
}

TEST(PlaceRanks, OneHostOfCpuWorkersKeepsRegistrationOrderPerPipeline) {
  const auto c = Workers({{"h", -1}, {"h", -1}, {"h", -1}, {"h", -1}});
  const planner::Topology t = Grid(2, 2);
  const std::vector<int> placed = PlaceRanks(c, t);
  // Pipeline 0 = the first two registered, pipeline 1 = the next two; rank = replica + d·stage.
  EXPECT_EQ(placed, (std::vector<int>{0, 2, 1, 3}));
  EXPECT_TRUE(PlaceRanks(Workers({{"h", -1}}), t).empty());  // too few
}

// Tensor groups: t consecutive devices of one host, a pipeline of them on one host where it
// fits, never a group across hosts.
TEST(PlaceRanks, TensorGroupsAreConsecutiveDevicesOfOneHost) {
  // a: 5 GPUs (2 whole groups of 2, one left over), b: 3 (1 group), registered interleaved.
  const auto c =
      Workers({{"a", 4}, {"b", 0}, {"a", 0}, {"b", 2}, {"a", 1}, {"a", 3}, {"b", 1}, {"a", 2}});
  const planner::Topology t = *planner::Topology::Create(/*p=*/1, /*d=*/3, /*t=*/2);
  std::string unmet;
  const std::vector<int> placed = PlaceRanks(c, t, &unmet);
  ASSERT_EQ(placed.size(), 6u) << unmet;
  std::set<int> used;
  for (int replica = 0; replica < 3; ++replica) {
    const int r0 = t.RankOf({.stage = 0, .replica = replica, .tensor = 0});
    const int r1 = t.RankOf({.stage = 0, .replica = replica, .tensor = 1});
    EXPECT_EQ(r1, r0 + 1);  // the tensor axis is innermost: neighbours
    EXPECT_EQ(c[placed[r0]].hostname, c[placed[r1]].hostname) << "replica " << replica;
    EXPECT_EQ(c[placed[r1]].device, c[placed[r0]].device + 1) << "replica " << replica;
    used.insert(placed[r0]);
    used.insert(placed[r1]);
  }
  EXPECT_EQ(used.size(), 6u);
  // a's groups are devices 0-1 and 2-3 (device 4 stays free), b's 0-1.
  std::multiset<std::string> hosts;
  for (int i : used) hosts.insert(c[i].hostname);
  EXPECT_EQ(hosts.count("a"), 4u);
  EXPECT_EQ(hosts.count("b"), 2u);
}

TEST(PlaceRanks, APipelineOfTensorGroupsStaysOnOneHost) {
  // p = 2, t = 2: 4 workers a stage pair; host a has 4, host b has 4.
  const auto c =
      Workers({{"b", 0}, {"a", 0}, {"b", 1}, {"a", 1}, {"b", 2}, {"a", 2}, {"b", 3}, {"a", 3}});
  const planner::Topology t = *planner::Topology::Create(/*p=*/2, /*d=*/2, /*t=*/2);
  const std::vector<int> placed = PlaceRanks(c, t);
  ASSERT_EQ(placed.size(), 8u);
  for (int replica = 0; replica < 2; ++replica) {
    std::set<std::string> hosts;
    for (int s = 0; s < 2; ++s)
      for (int tp = 0; tp < 2; ++tp)
        hosts.insert(c[placed[t.RankOf({.stage = s, .replica = replica, .tensor = tp})]].hostname);
    EXPECT_EQ(hosts.size(), 1u) << "replica " << replica;
  }
}

TEST(PlaceRanks, TooFewWholeTensorGroupsWaitNamingHostsAndNeed) {
  // 4 free GPUs, but 1 + 1 + 2 over three hosts: one whole group of 2, the job needs 2.
  const auto c = Workers({{"a", 0}, {"b", 0}, {"c", 0}, {"c", 1}});
  const planner::Topology t = *planner::Topology::Create(/*p=*/2, /*d=*/1, /*t=*/2);
  std::string unmet;
  EXPECT_TRUE(PlaceRanks(c, t, &unmet).empty());
  EXPECT_EQ(unmet,
            "placement: needs 2 tensor groups of 2 workers on one host each (parallel.tensor 2), "
            "finds 1: a has 1 free (0 groups); b has 1 free (0 groups); c has 2 free (1 groups)");
}

TEST(DeviceIndex, ReadsTheCudaOrdinal) {
  EXPECT_EQ(DeviceIndex("cuda:3"), 3);
  EXPECT_EQ(DeviceIndex("cpu"), -1);
  EXPECT_EQ(DeviceIndex("cuda"), -1);
  EXPECT_EQ(DeviceIndex("cuda:x"), -1);
}

}  // namespace
}  // namespace vp::server
