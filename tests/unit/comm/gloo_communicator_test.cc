// The Gloo communicator over real TCP on loopback, ranks as threads.
#include "worker/comm/gloo/gloo_communicator.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <limits>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/support/gloo_threads.h"

namespace vp::comm {
namespace {

using testing::RunOnGlooRanks;

class GlooRanksTest : public ::testing::TestWithParam<int> {};

// Rank r contributes r*1000 + i at index i, plus -inf at index 0 on odd ranks (the value an
// all-padding vocabulary shard contributes to the max).
float Value(int rank, size_t i) {
  if (i == 0 && rank % 2 == 1) return -std::numeric_limits<float>::infinity();
  return static_cast<float>(rank * 1000 + static_cast<int>(i % 997));
}

TEST_P(GlooRanksTest, AllReduceSumAndMax) {
  const int p = GetParam();
  // Larger than one Gloo segment (1 MiB) so the ring runs more than one segment per rank.
  const size_t count = 300000;
  RunOnGlooRanks(p, [&](GlooCommunicator& comm) {
    std::vector<float> sum(count), max(count);
    for (size_t i = 0; i < count; ++i) sum[i] = max[i] = Value(comm.rank(), i);
    sum[0] = 1.0f;  // keep -inf out of the sum
    ASSERT_TRUE(comm.AllReduce(sum.data(), count, ReduceOp::kSum).ok());
    ASSERT_TRUE(comm.AllReduce(max.data(), count, ReduceOp::kMax).ok());
    EXPECT_EQ(sum[0], static_cast<float>(p));
    EXPECT_EQ(max[0], Value(p % 2 == 0 ? p - 2 : p - 1, 0));
    for (size_t i = 1; i < count; i += 1237) {
      float want_sum = 0, want_max = -std::numeric_limits<float>::infinity();
      for (int r = 0; r < p; ++r) {
        want_sum += Value(r, i);
        want_max = std::max(want_max, Value(r, i));
      }
      ASSERT_EQ(sum[i], want_sum) << "index " << i;
      ASSERT_EQ(max[i], want_max) << "index " << i;
    }
  });
}

TEST_P(GlooRanksTest, BroadcastFromEveryRoot) {
  const int p = GetParam();
  RunOnGlooRanks(p, [&](GlooCommunicator& comm) {
    for (int root = 0; root < p; ++root) {
      std::vector<float> data(777, -1.0f);
      if (comm.rank() == root) {
        for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<float>(root * 100 + i);
      }
      ASSERT_TRUE(comm.Broadcast(data.data(), data.size(), root).ok());
      for (size_t i = 0; i < data.size(); ++i) {
        ASSERT_EQ(data[i], static_cast<float>(root * 100 + i)) << "root " << root;
      }
    }
  });
}

TEST_P(GlooRanksTest, SendRecvRing) {
  const int p = GetParam();
  RunOnGlooRanks(p, [&](GlooCommunicator& comm) {
    const int r = comm.rank(), next = (r + 1) % p, prev = (r + p - 1) % p;
    // Three rounds with distinct tags; each rank forwards to next and hears from prev.
    for (uint64_t tag = 5; tag < 8; ++tag) {
      std::vector<float> out(1000, static_cast<float>(r * 10 + tag)), in(1000, -1.0f);
      ASSERT_TRUE(
          comm.SendRecv(out.data(), out.size(), next, tag, in.data(), in.size(), prev, tag).ok());
      EXPECT_EQ(in.front(), static_cast<float>(prev * 10 + tag));
      EXPECT_EQ(in.back(), static_cast<float>(prev * 10 + tag));
    }
    // The plain blocking calls, ordered so that no cycle of blocked senders forms: rank 0
    // sends first, every other rank receives first.
    std::vector<float> out(64, static_cast<float>(r)), in(64, -1.0f);
    if (r == 0) {
      ASSERT_TRUE(comm.Send(out.data(), out.size(), next, 42).ok());
      ASSERT_TRUE(comm.Recv(in.data(), in.size(), prev, 42).ok());
    } else {
      ASSERT_TRUE(comm.Recv(in.data(), in.size(), prev, 42).ok());
      ASSERT_TRUE(comm.Send(out.data(), out.size(), next, 42).ok());
    }
    EXPECT_EQ(in[63], static_cast<float>(prev));
    ASSERT_TRUE(comm.Barrier().ok());
  });
}

// ZeRO-1's pair: the reduce-scatter leaves each rank the exact sum of its own range (small
// integers: every order of addition is exact), the all-gather puts every range back everywhere.
// Odd counts so the ranges differ in length; the second spans several of the reduce-scatter's
// pieces (2^20 floats), with a short last one.
TEST_P(GlooRanksTest, ReduceScatterThenAllGatherRestoreTheAllReduce) {
  const int p = GetParam();
  for (const size_t count : {size_t{100003}, (size_t{5} << 20) + 12345}) {
    RunOnGlooRanks(p, [&](GlooCommunicator& comm) {
      std::vector<float> data(count);
      for (size_t i = 0; i < count; ++i)
        data[i] = static_cast<float>((comm.rank() + 1) * (i % 101));
      ASSERT_TRUE(comm.ReduceScatterSum(data.data(), count).ok());
      const ShardRange mine = RangeOf(count, p, comm.rank());
      const float ranks_sum = static_cast<float>(p * (p + 1) / 2);
      for (size_t i = mine.begin; i < mine.end(); ++i) {
        ASSERT_EQ(data[i], ranks_sum * static_cast<float>(i % 101)) << "index " << i;
      }
      // Only the own range is defined now: poison the rest, the gather must overwrite it.
      for (size_t i = 0; i < count; ++i) {
        if (i < mine.begin || i >= mine.end()) data[i] = -1.0f;
      }
      ASSERT_TRUE(comm.AllGather(data.data(), count).ok());
      for (size_t i = 0; i < count; ++i) {
        ASSERT_EQ(data[i], ranks_sum * static_cast<float>(i % 101)) << "index " << i;
      }
    });
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, GlooRanksTest, ::testing::Values(2, 3, 4),
                         [](const auto& info) { return absl::StrCat("p", info.param); });

TEST(RangeOf, BalancedRangesTileTheBuffer) {
  for (size_t total : {0ul, 1ul, 7ul, 8ul, 100003ul}) {
    for (int parts : {1, 2, 3, 4, 7}) {
      size_t next = 0, smallest = total, largest = 0;
      for (int i = 0; i < parts; ++i) {
        const ShardRange r = RangeOf(total, parts, i);
        EXPECT_EQ(r.begin, next) << total << "/" << parts << " part " << i;
        next = r.end();
        smallest = std::min(smallest, r.count);
        largest = std::max(largest, r.count);
      }
      EXPECT_EQ(next, total) << total << "/" << parts;
      EXPECT_LE(largest - smallest, 1u) << total << "/" << parts;
    }
  }
  EXPECT_EQ(RangeOf(10, 2, 2).count, 0u);  // outside the group: empty
}

TEST(GlooCommunicator, TwoPrefixesConcurrentlyFromTwoThreads) {
  const int p = 3;
  auto store = MakeHashStore();
  // Each rank owns a "p2p" and a "vocab" communicator on the same store; a compute thread uses
  // one while a communication thread uses the other, as the runtime does.
  std::vector<std::unique_ptr<GlooCommunicator>> p2p(p), vocab(p);
  {
    std::vector<std::thread> threads;
    for (int r = 0; r < p; ++r) {
      threads.emplace_back([&, r] {
        for (auto* which : {&p2p, &vocab}) {
          GlooOptions o;
          o.rank = r;
          o.size = p;
          o.store = store;
          o.prefix = which == &p2p ? "job/p2p" : "job/vocab";
          auto c = ConnectGloo(o);
          ASSERT_TRUE(c.ok()) << c.status();
          (*which)[r] = std::move(*c);
        }
      });
    }
    for (auto& t : threads) t.join();
  }
  for (int r = 0; r < p; ++r) ASSERT_TRUE(p2p[r] && vocab[r]);
  std::vector<std::thread> threads;
  for (int r = 0; r < p; ++r) {
    threads.emplace_back([&, r] {
      GlooCommunicator& c = *p2p[r];
      for (int it = 0; it < 40; ++it) {
        std::vector<float> out(500, static_cast<float>(r + it)), in(500);
        ASSERT_TRUE(
            c.SendRecv(out.data(), 500, (r + 1) % p, it, in.data(), 500, (r + p - 1) % p, it).ok());
        ASSERT_EQ(in[499], static_cast<float>((r + p - 1) % p + it));
      }
    });
    threads.emplace_back([&, r] {
      GlooCommunicator& c = *vocab[r];
      for (int it = 0; it < 40; ++it) {
        std::vector<float> v(2000, static_cast<float>(r * it));
        ASSERT_TRUE(c.AllReduce(v.data(), v.size(), ReduceOp::kSum).ok());
        ASSERT_EQ(v[1999], static_cast<float>(it * (0 + 1 + 2)));
      }
    });
  }
  for (auto& t : threads) t.join();
}

TEST(GlooCommunicator, FileStoreRendezvous) {
  const std::string dir = absl::StrCat(::testing::TempDir(), "/gloo_store_", getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  auto store = MakeFileStore(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  RunOnGlooRanks(
      2,
      [](GlooCommunicator& comm) {
        float x = static_cast<float>(comm.rank() + 1);
        ASSERT_TRUE(comm.AllReduce(&x, 1, ReduceOp::kSum).ok());
        EXPECT_EQ(x, 3.0f);
      },
      absl::Seconds(10), *store);
  std::filesystem::remove_all(dir);
  EXPECT_EQ(MakeFileStore(dir + "/missing").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(GlooCommunicator, RecvWithoutSenderTimesOut) {
  const absl::Duration timeout = absl::Seconds(1);
  RunOnGlooRanks(
      2,
      [&](GlooCommunicator& comm) {
        if (comm.rank() != 0) return;  // rank 1 never sends
        std::vector<float> in(8);
        const auto start = std::chrono::steady_clock::now();
        absl::Status s = comm.Recv(in.data(), in.size(), 1, 3);
        const double secs =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        EXPECT_TRUE(absl::IsDeadlineExceeded(s) || absl::IsUnavailable(s)) << s;
        EXPECT_NE(s.message().find("recv"), absl::string_view::npos) << s;
        EXPECT_NE(s.message().find("peer 1"), absl::string_view::npos) << s;
        EXPECT_GE(secs, 0.9);
        EXPECT_LT(secs, 5.0);
        // The context is poisoned: later calls fail fast instead of using a broken mesh.
        float x = 1;
        EXPECT_EQ(comm.AllReduce(&x, 1, ReduceOp::kSum).code(),
                  absl::StatusCode::kFailedPrecondition);
      },
      timeout);
}

TEST(GlooCommunicator, RejectsBadArguments) {
  GlooOptions o;
  o.size = 2;
  o.rank = 2;
  o.store = MakeHashStore();
  EXPECT_EQ(ConnectGloo(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.rank = 0;
  o.store = nullptr;
  EXPECT_EQ(ConnectGloo(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.store = MakeHashStore();
  o.timeout = absl::ZeroDuration();
  EXPECT_EQ(ConnectGloo(o).status().code(), absl::StatusCode::kInvalidArgument);

  RunOnGlooRanks(2, [](GlooCommunicator& comm) {
    float x[4] = {};
    EXPECT_EQ(comm.Send(x, 4, 2, 0).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(comm.Send(x, 4, comm.rank(), 0).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(comm.Recv(x, 4, 1 - comm.rank(), uint64_t{1} << 56).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(comm.Broadcast(x, 4, -1).code(), absl::StatusCode::kInvalidArgument);
    // Argument errors do not poison the communicator.
    EXPECT_TRUE(comm.Barrier().ok());
  });
}

TEST(GlooCommunicator, SingleRankIsIdentity) {
  GlooOptions o;
  o.store = MakeHashStore();
  o.prefix = "solo";
  auto comm = ConnectGloo(o);
  ASSERT_TRUE(comm.ok()) << comm.status();
  float x[2] = {3, -std::numeric_limits<float>::infinity()};
  ASSERT_TRUE((*comm)->AllReduce(x, 2, ReduceOp::kMax).ok());
  ASSERT_TRUE((*comm)->Broadcast(x, 2, 0).ok());
  ASSERT_TRUE((*comm)->Barrier().ok());
  EXPECT_EQ(x[0], 3.0f);
  EXPECT_TRUE(std::isinf(x[1]));
}

}  // namespace
}  // namespace vp::comm
