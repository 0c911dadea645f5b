#include "coordinator/server/placement.h"

#include <algorithm>
#include <map>
#include <numeric>

#include "absl/strings/numbers.h"

namespace vp::server {

int DeviceIndex(const std::string& device) {
  const size_t colon = device.find(':');
  int index = -1;
  if (colon == std::string::npos || !absl::SimpleAtoi(device.substr(colon + 1), &index)) return -1;
  return index;
}

std::vector<int> PlaceRanks(const std::vector<PlacementCandidate>& candidates,
                            const planner::Topology& topology) {
  const int world = topology.world(), p = topology.pipeline(), d = topology.data();
  if (static_cast<int>(candidates.size()) < world) return {};
  // Rule 1: by hint (none last), then registration.
  std::vector<int> order(candidates.size());
  std::iota(order.begin(), order.end(), 0);
  auto hint = [&](int i) {
    return candidates[i].rank_hint >= 0 ? candidates[i].rank_hint : INT64_MAX;
  };
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    if (hint(a) != hint(b)) return hint(a) < hint(b);
    return candidates[a].registered < candidates[b].registered;
  });
  order.resize(world);
  std::vector<int> out(world);
  // Rule 2: every chosen worker has a hint.
  if (std::all_of(order.begin(), order.end(),
                  [&](int i) { return candidates[i].rank_hint >= 0; })) {
    for (int r = 0; r < world; ++r) out[r] = order[r];
    return out;
  }
  // Rule 3: hosts, biggest first; devices in order within a host.
  std::map<std::string, std::vector<int>> by_host;  // host → positions in `order`
  std::vector<std::string> hosts;
  for (int pos = 0; pos < world; ++pos) {
    const std::string& h = candidates[order[pos]].hostname;
    if (by_host.find(h) == by_host.end()) hosts.push_back(h);
    by_host[h].push_back(pos);
  }
  std::stable_sort(hosts.begin(), hosts.end(), [&](const std::string& a, const std::string& b) {
    return by_host[a].size() > by_host[b].size();
  });
  for (auto& [h, positions] : by_host) {
    std::stable_sort(positions.begin(), positions.end(), [&](int a, int b) {
      const int da = candidates[order[a]].device, db = candidates[order[b]].device;
      return da != db ? da < db : a < b;
    });
  }
  std::vector<std::vector<int>> pipelines;  // candidate indices, stage order
  std::vector<int> rest;
  for (const std::string& h : hosts) {
    const std::vector<int>& positions = by_host[h];
    const size_t whole = positions.size() / p * p;
    for (size_t i = 0; i < positions.size(); ++i) {
      if (i < whole) {
        if (i % p == 0) pipelines.emplace_back();
        pipelines.back().push_back(order[positions[i]]);
      } else {
        rest.push_back(order[positions[i]]);
      }
    }
  }
  for (size_t i = 0; i < rest.size(); ++i) {
    if (i % p == 0) pipelines.emplace_back();
    pipelines.back().push_back(rest[i]);
  }
  for (int replica = 0; replica < d; ++replica)
    for (int stage = 0; stage < p; ++stage)
      out[topology.RankOf({.stage = stage, .replica = replica})] = pipelines[replica][stage];
  return out;
}

}  // namespace vp::server
