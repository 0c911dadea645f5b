// The rendezvous store's waits (coordinator/server/kv_store.h): a write wakes only the calls
// waiting for its key, so N ranks connecting cost N wake-ups, not N² (issue 36).
#include "coordinator/server/kv_store.h"

#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace vp::server {
namespace {

void WaitUntilWaiting(const KvStore& kv, size_t n) {
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (kv.waiting() < n && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_EQ(kv.waiting(), n);
}

TEST(KvStore, AWriteWakesOnlyTheCallsWaitingForItsKey) {
  constexpr int kRanks = 64;
  KvStore kv;
  std::vector<std::string> got(kRanks);
  std::vector<std::thread> ranks;
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  for (int r = 0; r < kRanks; ++r) {
    ranks.emplace_back([&, r] {
      auto v = kv.Get(absl::StrCat("vocabpipe/a.1/g/", r), deadline);
      got[r] = v.ok() ? *v : std::string(v.status().message());
    });
  }
  WaitUntilWaiting(kv, kRanks);
  ASSERT_TRUE(kv.Set("vocabpipe/a.1/g/7", "seven").ok());
  EXPECT_EQ(kv.wakeups(), 1u);  // not 64
  for (int r = 0; r < kRanks; ++r) {
    if (r == 7) continue;
    ASSERT_TRUE(kv.Set(absl::StrCat("vocabpipe/a.1/g/", r), absl::StrCat(r)).ok());
  }
  for (std::thread& t : ranks) t.join();
  EXPECT_EQ(kv.wakeups(), static_cast<uint64_t>(kRanks));
  EXPECT_EQ(kv.waiting(), 0u);
  EXPECT_EQ(got[7], "seven");
  EXPECT_EQ(got[63], "63");
}

TEST(KvStore, WaitReturnsOnceEveryKeyIsThereAndTimesOutNamingAMissingOne) {
  KvStore kv;
  absl::Status waited;
  std::thread waiter([&] {
    waited = kv.Wait({"vocabpipe/a.1/x", "vocabpipe/a.1/y"}, absl::Now() + absl::Seconds(60));
  });
  WaitUntilWaiting(kv, 1);
  ASSERT_TRUE(kv.Set("vocabpipe/a.1/y", "1").ok());  // not the key it waits for first
  EXPECT_EQ(kv.wakeups(), 0u);
  ASSERT_TRUE(kv.Set("vocabpipe/a.1/x", "1").ok());
  waiter.join();
  EXPECT_TRUE(waited.ok()) << waited;
  const absl::Status late =
      kv.Wait({"vocabpipe/a.1/x", "vocabpipe/a.1/z"}, absl::Now() + absl::Milliseconds(20));
  EXPECT_EQ(late.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(late.message().find("vocabpipe/a.1/z"), std::string::npos) << late;
  EXPECT_EQ(kv.Get("vocabpipe/a.1/q", absl::Now() + absl::Milliseconds(20)).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(kv.waiting(), 0u);
}

TEST(KvStore, ARestoredKeyWakesItsWaiter) {
  KvStore kv;
  std::string got;
  std::thread waiter([&] {
    auto v = kv.Get("vocabpipe/a.1/preempt/request", absl::Now() + absl::Seconds(60));
    got = v.ok() ? *v : "";
  });
  WaitUntilWaiting(kv, 1);
  kv.Restore("vocabpipe/a.1/preempt/request", "1");
  waiter.join();
  EXPECT_EQ(got, "1");
}

}  // namespace
}  // namespace vp::server
