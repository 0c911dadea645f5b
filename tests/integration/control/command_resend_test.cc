// Issue 16, item 4: the coordinator's commands to a worker are resent until acknowledged. A
// heartbeat answer that is lost (the worker never saw it) is answered again by the next
// heartbeat; once a heartbeat acknowledges a command's seq it is not sent again. Drives the
// Coordinator directly (the daemon side is exercised by every control-plane test).
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "coordinator/server/coordinator.h"

namespace vp::server {
namespace {
namespace v1 = vocabpipe::v1;

TEST(CommandResend, ACommandIsResentUntilAHeartbeatAcknowledgesIt) {
  CoordinatorOptions options;
  options.db_path = ":memory:";
  options.profile = false;
  auto c = Coordinator::Open(options);
  ASSERT_TRUE(c.ok()) << c.status();
  v1::RegisterWorkerRequest reg;
  reg.set_device("cpu");
  reg.set_memory_bytes(int64_t{16} << 30);
  reg.set_address("127.0.0.1");
  reg.set_threads(1);
  reg.set_peak_flops(1e10);
  auto worker = (*c)->RegisterWorker(reg);
  ASSERT_TRUE(worker.ok()) << worker.status();

  v1::SubmitJobRequest submit;
  submit.set_spec_text(
      "model: {layers: 2, hidden: 32, heads: 2, vocab_size: 64, seq_len: 16}\n"
      "parallel: {pipeline: 1, microbatch_size: 2, microbatches: 2}\n"
      "train: {steps: 1}\ndata: {path: data.bin}\ncheckpoint: {dir: run}\n");
  submit.set_base_dir("/tmp");
  auto spec = SpecFromRequest(submit);
  ASSERT_TRUE(spec.ok()) << spec.status();
  auto id = (*c)->Submit(*spec);
  ASSERT_TRUE(id.ok()) << id.status();

  v1::HeartbeatRequest beat;
  beat.set_worker_id(worker->worker_id());
  // Planning runs on its own thread: the RunTask comes within a few beats.
  v1::HeartbeatResponse first;
  for (int i = 0; i < 100 && first.commands_size() == 0; ++i) {
    auto r = (*c)->Heartbeat(beat);
    ASSERT_TRUE(r.ok()) << r.status();
    first = *r;
    if (first.commands_size() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_EQ(first.commands_size(), 1);
  ASSERT_TRUE(first.commands(0).has_run());
  EXPECT_EQ(first.commands(0).seq(), 1);
  EXPECT_EQ(first.commands(0).run().job_id(), *id);

  // That answer was lost: the worker's next heartbeat still acknowledges nothing.
  auto again = (*c)->Heartbeat(beat);
  ASSERT_TRUE(again.ok());
  ASSERT_EQ(again->commands_size(), 1);
  EXPECT_EQ(again->commands(0).seq(), 1);
  EXPECT_EQ(again->commands(0).run().attempt(), first.commands(0).run().attempt());

  // Acknowledged: not sent again.
  beat.set_acked_seq(1);
  auto acked = (*c)->Heartbeat(beat);
  ASSERT_TRUE(acked.ok());
  EXPECT_EQ(acked->commands_size(), 0);

  // The next command is numbered on.
  ASSERT_TRUE((*c)->Cancel(*id, "test").ok());
  auto cancel = (*c)->Heartbeat(beat);
  ASSERT_TRUE(cancel.ok());
  ASSERT_EQ(cancel->commands_size(), 1);
  EXPECT_TRUE(cancel->commands(0).has_cancel());
  EXPECT_EQ(cancel->commands(0).seq(), 2);
  beat.set_acked_seq(2);
  auto done = (*c)->Heartbeat(beat);
  ASSERT_TRUE(done.ok());
  EXPECT_EQ(done->commands_size(), 0);
}

}  // namespace
}  // namespace vp::server
