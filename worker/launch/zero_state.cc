#include "worker/launch/zero_state.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace vp::launch {
namespace {

// Tags of the gather's two transfers per replica on the data group's communicator (its only
// other traffic, the optimizer step's collectives, never overlaps a save).
constexpr uint64_t kMomentTag = 1, kVarianceTag = 2;

}  // namespace

absl::StatusOr<std::unique_ptr<engine::AdamW>> WholeOptimizerLike(const engine::AdamW& shard) {
  auto whole = engine::AdamW::Create(nullptr, shard.buffer_count(), shard.config(), {});
  if (!whole.ok()) return whole.status();
  auto out = std::make_unique<engine::AdamW>(std::move(*whole));
  out->set_step(shard.step());
  return out;
}

absl::StatusOr<std::unique_ptr<engine::AdamW>> GatherOptimizerState(engine::AdamW& shard,
                                                                    comm::Communicator& data) {
  const size_t n = shard.buffer_count();
  const int d = data.size();
  const comm::ShardRange mine = comm::RangeOf(n, d, data.rank());
  if (mine.begin != shard.shard_begin() || mine.count != shard.count()) {
    return absl::InternalError(absl::StrCat(
        "zero: replica ", data.rank(), " of ", d, " holds AdamW state [", shard.shard_begin(), ", ",
        shard.shard_begin() + shard.count(), "), expected [", mine.begin, ", ", mine.end(), ")"));
  }
  if (data.rank() != 0) {
    if (auto st = data.Send(shard.m().data(), shard.count(), 0, kMomentTag); !st.ok()) return st;
    if (auto st = data.Send(shard.v().data(), shard.count(), 0, kVarianceTag); !st.ok()) return st;
    return nullptr;
  }
  auto whole = WholeOptimizerLike(shard);
  if (!whole.ok()) return whole.status();
  engine::AdamW& w = **whole;
  std::copy_n(shard.m().data(), shard.count(), w.m().data() + mine.begin);
  std::copy_n(shard.v().data(), shard.count(), w.v().data() + mine.begin);
  for (int r = 1; r < d; ++r) {
    const comm::ShardRange range = comm::RangeOf(n, d, r);
    if (auto st = data.Recv(w.m().data() + range.begin, range.count, r, kMomentTag); !st.ok()) {
      return st;
    }
    if (auto st = data.Recv(w.v().data() + range.begin, range.count, r, kVarianceTag); !st.ok()) {
      return st;
    }
  }
  return std::move(*whole);
}

absl::Status TakeOptimizerRange(engine::AdamW& whole, engine::AdamW& shard) {
  if (whole.count() != shard.buffer_count() || whole.sharded()) {
    return absl::InternalError("zero: the whole AdamW state does not match the shard's buffer");
  }
  std::copy_n(whole.m().data() + shard.shard_begin(), shard.count(), shard.m().data());
  std::copy_n(whole.v().data() + shard.shard_begin(), shard.count(), shard.v().data());
  shard.set_step(whole.step());
  return absl::OkStatus();
}

}  // namespace vp::launch
