// Vocabulary passes: S, T, IF, IB placed by the transformer timeline; OPT last.
//
// Letters used across the planner: p pipeline ranks (r one rank), m microbatches (i or mb one
// microbatch), k sequence chunks (q one chunk), v model chunks per rank, G layer groups
// (g one group; G = p·v), d vocabulary barrier intervals between the last group's F and B,
// u = mb·k + q a (microbatch, sequence chunk) unit.
#include <algorithm>
#include <array>
#include <cstdint>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/planner/generator.h"

namespace vp::planner::internal {

// Tie-break between vocabulary passes due at the same point: input forward first, then the
// output layer's S/T, then the input backward.
namespace {
enum class PassFamily : uint8_t { kInputForward, kOutput, kInputBackward };
}  // namespace

std::vector<std::vector<Action>> AddVocabularyPasses(const Ctx& c, const Timeline& base) {
  const Layout& l = c.l;
  const int p = l.p, m = l.m, k = l.k, units = m * k;
  const int G = l.groups;
  std::vector<const Timed*> fl(units), bl(units), ff(m), bf(m);
  for (int r = 0; r < p; ++r)
    for (const Timed& t : base[r]) {
      const int g = l.group_of[r][t.a.chunk];
      const int u = t.a.mb * k + t.a.seq;
      if (g == G - 1 && t.a.kind == ActionKind::kF) fl[u] = &t;
      if (g == G - 1 && (t.a.kind == ActionKind::kB || t.a.kind == ActionKind::kBW)) bl[u] = &t;
      if (g == 0 && t.a.kind == ActionKind::kF && t.a.seq == 0) ff[t.a.mb] = &t;
      if (g == 0 && (t.a.kind == ActionKind::kB || t.a.kind == ActionKind::kBW) && t.a.seq == 0)
        bf[t.a.mb] = &t;
    }
  struct Extra {
    double target;
    PassFamily family;
    int64_t key;
    Action a;
  };
  std::vector<Extra> extras;  // the same for every rank (sharded) or for one rank
  const bool interlaced = c.in.vocab == VocabMethod::kInterlaced;
  const int mp = c.in.max_pending_t;
  // The aligned interlaced block has S and T in its order already.
  for (int u = 0; u < units && !AlignedInterlaced(c); ++u) {
    const int mb = u / k, q = u % k;
    const double s_t = fl[u]->end;
    extras.push_back({s_t, PassFamily::kOutput, 2LL * u + 1, MakeAction(ActionKind::kS, mb, 0, q)});
    double t_t;
    int64_t t_key;
    if (!l.sharded || interlaced) {
      t_t = s_t;
      t_key = 2LL * u + 2;
    } else {
      t_t = u + mp < units ? fl[u + mp]->end : kInf;
      t_key = 2LL * (u + mp);
      if (l.barrier == 2) t_t = std::min(t_t, bl[u]->start);
    }
    extras.push_back({t_t, PassFamily::kOutput, t_key, MakeAction(ActionKind::kT, mb, 0, q)});
  }
  std::vector<Extra> input;
  for (int mb = 0; mb < m; ++mb) {
    input.push_back({ff[std::max(mb - 1, 0)]->start, PassFamily::kInputForward, mb,
                     MakeAction(ActionKind::kIF, mb)});
    input.push_back({bf[mb]->end, PassFamily::kInputBackward, mb, MakeAction(ActionKind::kIB, mb)});
  }
  std::vector<std::vector<Action>> out(p);
  for (int r = 0; r < p; ++r) {
    std::vector<std::pair<size_t, const Extra*>> mine;
    auto add = [&](const std::vector<Extra>& xs) {
      for (const Extra& e : xs) {
        auto it = std::lower_bound(base[r].begin(), base[r].end(), e.target,
                                   [](const Timed& t, double v) { return t.start < v; });
        mine.push_back({static_cast<size_t>(it - base[r].begin()), &e});
      }
    };
    if (l.sharded || r == l.x_owner()) add(extras);
    if (l.sharded || r == l.owner_rank[0]) add(input);
    std::stable_sort(mine.begin(), mine.end(), [](const auto& a, const auto& b) {
      if (a.first != b.first) return a.first < b.first;
      if (a.second->target != b.second->target) return a.second->target < b.second->target;
      if (a.second->family != b.second->family) return a.second->family < b.second->family;
      return a.second->key < b.second->key;
    });
    size_t e = 0;
    for (size_t i = 0; i <= base[r].size(); ++i) {
      while (e < mine.size() && mine[e].first == i) out[r].push_back(mine[e++].second->a);
      if (i < base[r].size()) out[r].push_back(base[r][i].a);
    }
    out[r].push_back(MakeAction(ActionKind::kOpt, -1));
  }
  return out;
}

}  // namespace vp::planner::internal
