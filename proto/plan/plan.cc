#include "proto/plan/plan.h"

#include <array>
#include <charconv>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace vp::planner {
namespace {

constexpr std::array<absl::string_view, kNumActionKinds> kNames = {
    "F",  "B",   "W",         "BW",       "IF",        "IB",        "S",
    "T",  "OPT", "SEND_ACT",  "RECV_ACT", "SEND_GRAD", "RECV_GRAD", "BCAST_X",
    "C1", "C2",  "IF_REDUCE", "IB_BCAST", "GRAD_SYNC"};

absl::Status Bad(absl::string_view what, absl::string_view detail) {
  return absl::InvalidArgumentError(absl::StrCat("plan text: ", what, ": ", detail));
}

}  // namespace

absl::string_view ActionKindName(ActionKind kind) { return kNames[static_cast<int>(kind)]; }

bool IsCompute(ActionKind kind) {
  return static_cast<int>(kind) <= static_cast<int>(ActionKind::kOpt);
}
bool IsP2P(ActionKind kind) {
  return kind == ActionKind::kSendAct || kind == ActionKind::kRecvAct ||
         kind == ActionKind::kSendGrad || kind == ActionKind::kRecvGrad;
}
bool IsCollective(ActionKind kind) {
  return static_cast<int>(kind) >= static_cast<int>(ActionKind::kBcastX) &&
         kind != ActionKind::kGradSync;
}
bool IsDataSync(ActionKind kind) { return kind == ActionKind::kGradSync; }

std::string ToString(const Action& a) {
  if (a.kind == ActionKind::kOpt) return "OPT";
  if (a.kind == ActionKind::kGradSync) return absl::StrCat("GRAD_SYNC(c", a.chunk, ")");
  std::string s = absl::StrCat(ActionKindName(a.kind), "(", a.mb);
  if (a.chunk != 0) absl::StrAppend(&s, ",c", a.chunk);
  if (a.seq != 0) absl::StrAppend(&s, ",s", a.seq);
  if (a.kind == ActionKind::kSendAct || a.kind == ActionKind::kSendGrad) {
    absl::StrAppend(&s, ",>", a.peer);
  } else if (a.kind == ActionKind::kRecvAct || a.kind == ActionKind::kRecvGrad) {
    absl::StrAppend(&s, ",<", a.peer);
  }
  s += ")";
  return s;
}

absl::StatusOr<Action> ParseAction(absl::string_view token) {
  Action a;
  absl::string_view name = token;
  absl::string_view args;
  if (auto open = token.find('('); open != absl::string_view::npos) {
    if (token.back() != ')') return Bad(token, "missing ')'");
    name = token.substr(0, open);
    args = token.substr(open + 1, token.size() - open - 2);
  }
  int kind = -1;
  for (int i = 0; i < kNumActionKinds; ++i) {
    if (kNames[i] == name) kind = i;
  }
  if (kind < 0) return Bad(token, "unknown action kind");
  a.kind = static_cast<ActionKind>(kind);
  if (a.kind == ActionKind::kOpt) {
    if (!args.empty()) return Bad(token, "OPT takes no arguments");
    a.mb = -1;
    return a;
  }
  if (a.kind == ActionKind::kGradSync) {
    int v = 0;
    if (args.size() < 2 || args[0] != 'c' || !absl::SimpleAtoi(args.substr(1), &v) || v < 0 ||
        v > 32767) {
      return Bad(token, "GRAD_SYNC takes one local chunk, cC (C in [0, 32767])");
    }
    a.chunk = static_cast<int16_t>(v);
    return a;
  }
  if (args.empty()) return Bad(token, "missing microbatch");
  std::vector<absl::string_view> parts = absl::StrSplit(args, ',');
  if (!absl::SimpleAtoi(parts[0], &a.mb) || a.mb < 0) return Bad(token, "bad microbatch");
  for (size_t i = 1; i < parts.size(); ++i) {
    absl::string_view p = parts[i];
    if (p.empty()) return Bad(token, "empty field");
    int v = 0;
    if (!absl::SimpleAtoi(p.substr(1), &v) || v < 0) return Bad(token, "bad number");
    // The fields are int16: a larger value would wrap (found by fuzz/plan_text).
    if (v > 32767) return Bad(token, "number out of range (at most 32767)");
    switch (p[0]) {
      case 'c':
        a.chunk = static_cast<int16_t>(v);
        break;
      case 's':
        a.seq = static_cast<int16_t>(v);
        break;
      case '>':
        if (a.kind != ActionKind::kSendAct && a.kind != ActionKind::kSendGrad)
          return Bad(token, "'>' only on sends");
        a.peer = static_cast<int16_t>(v);
        break;
      case '<':
        if (a.kind != ActionKind::kRecvAct && a.kind != ActionKind::kRecvGrad)
          return Bad(token, "'<' only on receives");
        a.peer = static_cast<int16_t>(v);
        break;
      default:
        return Bad(token, "unknown field");
    }
  }
  if (IsP2P(a.kind) && a.peer < 0) return Bad(token, "send/receive needs a peer");
  return a;
}

int Plan::groups() const {
  int g = 0;
  for (const RankPlan& r : ranks) g += static_cast<int>(r.chunks.size());
  return g;
}

std::string PlanToText(const Plan& plan) {
  std::string s = "# vocabpipe plan v1\n";
  absl::StrAppend(&s, "schedule ", plan.schedule, "\nvocab ", plan.vocab, "\npipeline ",
                  plan.pipeline, "\nmicrobatches ", plan.microbatches, "\nseq_chunks ",
                  plan.seq_chunks, "\nlayers ", plan.layers, "\nseq_bounds");
  for (int b : plan.seq_bounds) absl::StrAppend(&s, " ", b);
  absl::StrAppend(&s, "\nx_owner ", plan.x_owner, "\nvocab_sharded ", plan.vocab_sharded ? 1 : 0,
                  "\nbarrier ", plan.barrier, "\n");
  for (size_t r = 0; r < plan.ranks.size(); ++r) {
    for (size_t c = 0; c < plan.ranks[r].chunks.size(); ++c) {
      const ModelChunk& mc = plan.ranks[r].chunks[c];
      absl::StrAppend(&s, "chunk ", r, " ", c, " group ", mc.group, " layers ", mc.first_layer, " ",
                      mc.num_layers, "\n");
    }
  }
  for (size_t r = 0; r < plan.ranks.size(); ++r) {
    absl::StrAppend(&s, "rank ", r, ":");
    for (const Action& a : plan.ranks[r].actions) absl::StrAppend(&s, " ", ToString(a));
    s += "\n";
  }
  return s;
}

absl::StatusOr<Plan> PlanFromText(absl::string_view text) {
  Plan plan;
  plan.ranks.clear();
  plan.seq_bounds.clear();
  bool have_pipeline = false;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    std::vector<absl::string_view> w = absl::StrSplit(line, ' ', absl::SkipEmpty());
    auto where = [&](absl::string_view d) { return Bad(absl::StrCat("line ", line_no), d); };
    auto num = [&](size_t i, int* out) { return i < w.size() && absl::SimpleAtoi(w[i], out); };
    absl::string_view key = w[0];
    int v = 0;
    if (key == "schedule" && w.size() == 2) {
      plan.schedule = std::string(w[1]);
    } else if (key == "vocab" && w.size() == 2) {
      plan.vocab = std::string(w[1]);
    } else if (key == "pipeline" && num(1, &plan.pipeline)) {
      if (plan.pipeline < 1 || plan.pipeline > 4096) return where("pipeline out of range");
      plan.ranks.resize(plan.pipeline);
      have_pipeline = true;
    } else if (key == "microbatches" && num(1, &plan.microbatches)) {
    } else if (key == "seq_chunks" && num(1, &plan.seq_chunks)) {
    } else if (key == "layers" && num(1, &plan.layers)) {
    } else if (key == "x_owner" && num(1, &plan.x_owner)) {
    } else if (key == "vocab_sharded" && num(1, &v)) {
      plan.vocab_sharded = v != 0;
    } else if (key == "barrier" && num(1, &plan.barrier)) {
    } else if (key == "seq_bounds") {
      for (size_t i = 1; i < w.size(); ++i) {
        if (!num(i, &v)) return where("bad seq_bounds");
        plan.seq_bounds.push_back(v);
      }
    } else if (key == "chunk" && w.size() == 8) {
      int r, c;
      ModelChunk mc;
      if (!have_pipeline || !num(1, &r) || !num(2, &c) || !num(4, &mc.group) ||
          !num(6, &mc.first_layer) || !num(7, &mc.num_layers) || r < 0 || r >= plan.pipeline ||
          c != static_cast<int>(plan.ranks[r].chunks.size()))
        return where("bad chunk line (chunks must follow 'pipeline' and come in order)");
      plan.ranks[r].chunks.push_back(mc);
    } else if (key.substr(0, 4) == "rank" && w.size() >= 2 && w[1].back() == ':') {
      int r;
      if (!have_pipeline || !absl::SimpleAtoi(w[1].substr(0, w[1].size() - 1), &r) || r < 0 ||
          r >= plan.pipeline)
        return where("bad rank line");
      for (size_t i = 2; i < w.size(); ++i) {
        absl::StatusOr<Action> a = ParseAction(w[i]);
        if (!a.ok()) return where(a.status().message());
        plan.ranks[r].actions.push_back(*a);
      }
    } else {
      return where(absl::StrCat("unknown or malformed line '", line, "'"));
    }
  }
  if (!have_pipeline) return Bad("header", "missing 'pipeline'");
  // Without these the plan would print as text that does not parse back (fuzz/plan_text).
  if (plan.schedule.empty()) return Bad("header", "missing 'schedule'");
  if (plan.vocab.empty()) return Bad("header", "missing 'vocab'");
  return plan;
}

Plan RankSlice(const Plan& plan, int rank) {
  Plan slice = plan;
  for (int r = 0; r < static_cast<int>(slice.ranks.size()); ++r) {
    if (r != rank) slice.ranks[r].actions.clear();
  }
  return slice;
}

absl::StatusOr<Plan> MergeRankSlices(const std::vector<Plan>& slices) {
  if (slices.empty()) return absl::InvalidArgumentError("no plan slices");
  Plan whole = slices[0];
  const int p = whole.pipeline;
  if (static_cast<int>(slices.size()) != p || static_cast<int>(whole.ranks.size()) != p) {
    return absl::InvalidArgumentError(
        absl::StrCat(slices.size(), " plan slices for a plan of ", p, " ranks"));
  }
  const auto layout = [](Plan plan) {
    for (RankPlan& r : plan.ranks) r.actions.clear();
    return plan;
  };
  const Plan shape = layout(whole);
  for (int r = 0; r < p; ++r) {
    if (layout(slices[r]) != shape) {
      return absl::InvalidArgumentError(
          absl::StrCat("the slice of rank ", r, " has another layout than rank 0's"));
    }
    if (HasOtherRanksActions(slices[r], r)) {
      return absl::InvalidArgumentError(
          absl::StrCat("the slice of rank ", r, " holds another rank's actions"));
    }
    whole.ranks[r].actions = slices[r].ranks[r].actions;
  }
  return whole;
}

bool HasOtherRanksActions(const Plan& plan, int rank) {
  for (int r = 0; r < static_cast<int>(plan.ranks.size()); ++r) {
    if (r != rank && !plan.ranks[r].actions.empty()) return true;
  }
  return false;
}

}  // namespace vp::planner
