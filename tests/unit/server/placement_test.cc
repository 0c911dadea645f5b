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

TEST(DeviceIndex, ReadsTheCudaOrdinal) {
  EXPECT_EQ(DeviceIndex("cuda:3"), 3);
  EXPECT_EQ(DeviceIndex("cpu"), -1);
  EXPECT_EQ(DeviceIndex("cuda"), -1);
  EXPECT_EQ(DeviceIndex("cuda:x"), -1);
}

}  // namespace
}  // namespace vp::server
