#include "coordinator/server/placement.h"

#include <algorithm>
#include <map>
#include <numeric>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace vp::server {

int DeviceIndex(const std::string& device) {
  const size_t colon = device.find(':');
  int index = -1;
  if (colon == std::string::npos || !absl::SimpleAtoi(device.substr(colon + 1), &index)) return -1;
  return index;
}

namespace {

// Rule 3 on units (single workers, or whole tensor groups): `units` in rule 1's order, each with
// its host; returns d pipelines of p units, stage order, pipeline j = replica j.
std::vector<std::vector<int>> Pipelines(const std::vector<int>& units,
                                        const std::vector<std::string>& host_of,
                                        const std::vector<int>& device_of, int p) {
  std::map<std::string, std::vector<int>> by_host;  // host → positions in `units`
  std::vector<std::string> hosts;
  for (size_t pos = 0; pos < units.size(); ++pos) {
    const std::string& h = host_of[pos];
    if (by_host.find(h) == by_host.end()) hosts.push_back(h);
    by_host[h].push_back(static_cast<int>(pos));
  }
  std::stable_sort(hosts.begin(), hosts.end(), [&](const std::string& a, const std::string& b) {
    return by_host[a].size() > by_host[b].size();
  });
  for (auto& [h, positions] : by_host) {
    std::stable_sort(positions.begin(), positions.end(), [&](int a, int b) {
      return device_of[a] != device_of[b] ? device_of[a] < device_of[b] : a < b;
    });
  }
  std::vector<std::vector<int>> pipelines;  // units, stage order
  std::vector<int> rest;
  for (const std::string& h : hosts) {
    const std::vector<int>& positions = by_host[h];
    const size_t whole = positions.size() / p * p;
    for (size_t i = 0; i < positions.size(); ++i) {
      if (i < whole) {
        if (i % p == 0) pipelines.emplace_back();
        pipelines.back().push_back(units[positions[i]]);
      } else {
        rest.push_back(units[positions[i]]);
      }
    }
  }
  for (size_t i = 0; i < rest.size(); ++i) {
    if (i % p == 0) pipelines.emplace_back();
    pipelines.back().push_back(rest[i]);
  }
  return pipelines;
}

// t > 1: whole tensor groups, host by host.
std::vector<int> PlaceTensorGroups(const std::vector<PlacementCandidate>& candidates,
                                   const std::vector<int>& order, const planner::Topology& topology,
                                   std::string* unmet) {
  const int t = topology.tensor(), p = topology.pipeline(), d = topology.data();
  const int needed = p * d;
  // Each host's free workers in device order (then rule 1's order), cut into groups of t.
  std::map<std::string, std::vector<int>> by_host;
  std::vector<std::string> hosts;
  for (int i : order) {
    const std::string& h = candidates[i].hostname;
    if (by_host.find(h) == by_host.end()) hosts.push_back(h);
    by_host[h].push_back(i);
  }
  std::vector<std::vector<int>> groups;
  std::vector<std::string> group_host;
  std::vector<int> group_device;
  std::vector<std::string> counts;
  for (const std::string& h : hosts) {
    std::vector<int>& workers = by_host[h];
    std::stable_sort(workers.begin(), workers.end(),
                     [&](int a, int b) { return candidates[a].device < candidates[b].device; });
    const size_t whole = workers.size() / t;
    counts.push_back(absl::StrCat(h, " has ", workers.size(), " free (", whole, " groups)"));
    for (size_t g = 0; g < whole; ++g) {
      groups.emplace_back(workers.begin() + g * t, workers.begin() + (g + 1) * t);
      group_host.push_back(h);
      group_device.push_back(candidates[workers[g * t]].device);
    }
  }
  if (static_cast<int>(groups.size()) < needed) {
    if (unmet != nullptr) {
      *unmet = absl::StrCat("placement: needs ", needed, " tensor groups of ", t,
                            " workers on one host each (parallel.tensor ", t, "), finds ",
                            groups.size(), ": ", absl::StrJoin(counts, "; "));
    }
    return {};
  }
  groups.resize(needed);
  group_host.resize(needed);
  group_device.resize(needed);
  std::vector<int> units(needed);
  std::iota(units.begin(), units.end(), 0);
  const std::vector<std::vector<int>> pipelines = Pipelines(units, group_host, group_device, p);
  std::vector<int> out(topology.world());
  for (int replica = 0; replica < d; ++replica) {
    for (int stage = 0; stage < p; ++stage) {
      const std::vector<int>& group = groups[pipelines[replica][stage]];
      for (int tp = 0; tp < t; ++tp) {
        out[topology.RankOf({.stage = stage, .replica = replica, .tensor = tp})] = group[tp];
      }
    }
  }
  return out;
}

}  // namespace

std::vector<int> PlaceRanks(const std::vector<PlacementCandidate>& candidates,
                            const planner::Topology& topology, std::string* unmet) {
  const int world = topology.world(), p = topology.pipeline(), d = topology.data();
  if (static_cast<int>(candidates.size()) < world) {
    if (unmet != nullptr) {
      *unmet = absl::StrCat("placement: needs ", world, " free workers, finds ", candidates.size());
    }
    return {};
  }
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
  if (topology.tensor() > 1) return PlaceTensorGroups(candidates, order, topology, unmet);
  order.resize(world);
  std::vector<int> out(world);
  // Rule 2: every chosen worker has a hint.
  if (std::all_of(order.begin(), order.end(),
                  [&](int i) { return candidates[i].rank_hint >= 0; })) {
    for (int r = 0; r < world; ++r) out[r] = order[r];
    return out;
  }
  // Rule 3: hosts, biggest first; devices in order within a host.
  std::vector<std::string> host_of;
  std::vector<int> device_of;
  for (int i : order) {
    host_of.push_back(candidates[i].hostname);
    device_of.push_back(candidates[i].device);
  }
  const std::vector<std::vector<int>> pipelines = Pipelines(order, host_of, device_of, p);
  for (int replica = 0; replica < d; ++replica)
    for (int stage = 0; stage < p; ++stage)
      out[topology.RankOf({.stage = stage, .replica = replica})] = pipelines[replica][stage];
  return out;
}

}  // namespace vp::server
