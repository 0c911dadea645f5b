#include "worker/comm/gloo/gloo_communicator.h"

#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/logging.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/hash_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <chrono>
#include <exception>
#include <filesystem>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace vp::comm {
namespace {

// Point-to-point slots live under this top byte; Gloo's collectives use prefixes 0x01..0x08.
constexpr uint64_t kP2PSlotPrefix = uint64_t{0x80} << 56;
constexpr uint64_t kMaxTag = (uint64_t{1} << 56) - 1;

using ReduceFn = void (*)(void*, const void*, const void*, size_t);

std::chrono::milliseconds ToMillis(absl::Duration d) {
  return std::chrono::milliseconds(absl::ToInt64Milliseconds(d));
}

// The message of any exception Gloo throws (EnforceNotMet keeps its text in msg()).
std::string ExceptionText(const std::exception& e) {
  if (const auto* enforce = dynamic_cast<const gloo::EnforceNotMet*>(&e)) return enforce->msg();
  return e.what();
}

// Gloo reports timeouts as IoException/EnforceNotMet whose text says so; map those to
// DeadlineExceeded and every other transport failure to Unavailable (the peer is gone).
absl::Status StatusFromGloo(const std::string& context, const std::string& text) {
  const std::string lower = absl::AsciiStrToLower(text);
  if (absl::StrContains(lower, "timed out") || absl::StrContains(lower, "timeout")) {
    return absl::DeadlineExceededError(absl::StrCat(context, ": ", text));
  }
  return absl::UnavailableError(absl::StrCat(context, ": ", text));
}

}  // namespace

absl::StatusOr<std::shared_ptr<gloo::rendezvous::Store>> MakeFileStore(const std::string& dir) {
  std::error_code ec;
  if (dir.empty() || !std::filesystem::is_directory(dir, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat("file store directory \"", dir, "\" must be an existing directory"));
  }
  try {
    return std::shared_ptr<gloo::rendezvous::Store>(
        std::make_shared<gloo::rendezvous::FileStore>(dir));
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("file store in \"", dir, "\": ", ExceptionText(e)));
  }
}

std::shared_ptr<gloo::rendezvous::Store> MakeHashStore() {
  return std::make_shared<gloo::rendezvous::HashStore>();
}

GlooCommunicator::GlooCommunicator(ConnectKey, int rank, int size, std::string prefix,
                                   absl::Duration timeout,
                                   std::shared_ptr<gloo::transport::Device> device,
                                   std::shared_ptr<gloo::Context> context)
    : rank_(rank),
      size_(size),
      prefix_(std::move(prefix)),
      timeout_(timeout),
      device_(std::move(device)),
      context_(std::move(context)) {}

GlooCommunicator::~GlooCommunicator() {
  // The context (pairs) must go before the device whose loop thread serves them.
  context_.reset();
  device_.reset();
}

absl::Status GlooCommunicator::CheckUsable() const {
  if (error_.ok()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("gloo communicator \"", prefix_, "\" rank ", rank_,
                   " is unusable after an earlier error: ", error_.message()));
}

absl::Status GlooCommunicator::Fail(const std::string& what_op, const std::exception& e) {
  absl::Status status = StatusFromGloo(
      absl::StrCat("gloo ", what_op, " on rank ", rank_, " of ", size_, " (communicator \"",
                   prefix_, "\", timeout ", absl::FormatDuration(timeout_), ")"),
      ExceptionText(e));
  if (error_.ok()) error_ = status;
  return status;
}

absl::Status GlooCommunicator::CheckPeer(const char* op, const char* arg, int peer,
                                         bool allow_self) const {
  if (peer < 0 || peer >= size_) {
    return absl::InvalidArgumentError(
        absl::StrCat("gloo ", op, ": ", arg, " ", peer, " outside [0, ", size_, ")"));
  }
  if (!allow_self && peer == rank_) {
    return absl::InvalidArgumentError(
        absl::StrCat("gloo ", op, ": ", arg, " ", peer, " is this rank itself"));
  }
  return absl::OkStatus();
}

absl::Status GlooCommunicator::AllReduce(float* data, size_t count, ReduceOp op) {
  if (absl::Status s = CheckUsable(); !s.ok()) return s;
  if (count == 0 || size_ == 1) return absl::OkStatus();
  if (data == nullptr) return absl::InvalidArgumentError("gloo all-reduce: data is null");
  const char* op_name = op == ReduceOp::kSum ? "sum" : "max";
  try {
    gloo::AllreduceOptions opts(context_);
    opts.setOutput(data, count);
    opts.setReduceFunction(op == ReduceOp::kSum ? static_cast<ReduceFn>(&gloo::sum<float>)
                                                : static_cast<ReduceFn>(&gloo::max<float>));
    opts.setTimeout(ToMillis(timeout_));
    gloo::allreduce(opts);
  } catch (const std::exception& e) {
    return Fail(absl::StrCat("all-reduce ", op_name, " of ", count, " floats"), e);
  }
  return absl::OkStatus();
}

absl::Status GlooCommunicator::Broadcast(float* data, size_t count, int root) {
  if (absl::Status s = CheckUsable(); !s.ok()) return s;
  if (absl::Status s = CheckPeer("broadcast", "root", root, /*allow_self=*/true); !s.ok()) {
    return s;
  }
  if (count == 0 || size_ == 1) return absl::OkStatus();
  if (data == nullptr) return absl::InvalidArgumentError("gloo broadcast: data is null");
  try {
    gloo::BroadcastOptions opts(context_);
    opts.setOutput(data, count);  // the root's output doubles as its input
    opts.setRoot(root);
    opts.setTimeout(ToMillis(timeout_));
    gloo::broadcast(opts);
  } catch (const std::exception& e) {
    return Fail(absl::StrCat("broadcast of ", count, " floats from root ", root), e);
  }
  return absl::OkStatus();
}

// Ring reduce-scatter over the point-to-point slots: n − 1 steps, in step t rank r sends its
// partial sum of range (r − t − 1) to r + 1 and adds the partial sum of range (r − t − 2) from
// r − 1 into its own, so after the last step range r holds every rank's contribution. Each
// rank sends (n − 1)/n of the buffer, the bandwidth optimum. The tag is one user transfers never
// reach (P2PTag and the tests stay far below 2^56 − 2), and the ring's transfers are sequential,
// so Gloo's in-order matching per (peer, slot) keeps them apart.
// The incoming range arrives in pieces of kReduceChunkFloats into one reused buffer: receiving a
// whole range into freshly mapped memory cost ~15× the transfer (20M floats, d = 2: 0.39 s
// against 0.026 s; bench/runtime/collectives_bench), and a bounded piece keeps the scratch
// small whatever the model.
absl::Status GlooCommunicator::ReduceScatterSum(float* data, size_t count) {
  if (absl::Status s = CheckUsable(); !s.ok()) return s;
  if (count == 0 || size_ == 1) return absl::OkStatus();
  if (data == nullptr) return absl::InvalidArgumentError("gloo reduce-scatter: data is null");
  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  scratch_.resize(std::min(kReduceChunkFloats, RangeOf(count, size_, 0).count));
  for (int t = 0; t < size_ - 1; ++t) {
    const ShardRange out = RangeOf(count, size_, ((rank_ - t - 1) % size_ + size_) % size_);
    const ShardRange in = RangeOf(count, size_, ((rank_ - t - 2) % size_ + size_) % size_);
    // Piece i of the range sent and piece i of the range received (the peer cuts the same
    // range the same way); the shorter range's last piece may be empty.
    for (size_t at = 0; at < std::max(out.count, in.count); at += kReduceChunkFloats) {
      const size_t send = out.count > at ? std::min(kReduceChunkFloats, out.count - at) : 0;
      const size_t recv = in.count > at ? std::min(kReduceChunkFloats, in.count - at) : 0;
      if (absl::Status s = SendRecv(data + out.begin + at, send, next, kMaxTag, scratch_.data(),
                                    recv, prev, kMaxTag);
          !s.ok()) {
        return s;
      }
      float* dst = data + in.begin + at;
      for (size_t i = 0; i < recv; ++i) dst[i] += scratch_[i];
    }
  }
  return absl::OkStatus();
}

// Ring all-gather: in step t rank r passes range (r − t) on to r + 1 and receives range
// (r − t − 1) from r − 1 straight into place.
absl::Status GlooCommunicator::AllGather(float* data, size_t count) {
  if (absl::Status s = CheckUsable(); !s.ok()) return s;
  if (count == 0 || size_ == 1) return absl::OkStatus();
  if (data == nullptr) return absl::InvalidArgumentError("gloo all-gather: data is null");
  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  for (int t = 0; t < size_ - 1; ++t) {
    const ShardRange out = RangeOf(count, size_, ((rank_ - t) % size_ + size_) % size_);
    const ShardRange in = RangeOf(count, size_, ((rank_ - t - 1) % size_ + size_) % size_);
    if (absl::Status s = SendRecv(data + out.begin, out.count, next, kMaxTag - 1, data + in.begin,
                                  in.count, prev, kMaxTag - 1);
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

absl::Status GlooCommunicator::Send(const float* data, size_t count, int peer, uint64_t tag) {
  return SendRecv(data, count, peer, tag, nullptr, 0, peer, 0);
}

absl::Status GlooCommunicator::Recv(float* data, size_t count, int peer, uint64_t tag) {
  return SendRecv(nullptr, 0, peer, 0, data, count, peer, tag);
}

absl::Status GlooCommunicator::SendRecv(const float* send_data, size_t send_count, int send_peer,
                                        uint64_t send_tag, float* recv_data, size_t recv_count,
                                        int recv_peer, uint64_t recv_tag) {
  if (absl::Status s = CheckUsable(); !s.ok()) return s;
  if (send_count > 0) {
    if (absl::Status s = CheckPeer("send", "peer", send_peer, false); !s.ok()) return s;
    if (send_data == nullptr) return absl::InvalidArgumentError("gloo send: data is null");
    if (send_tag > kMaxTag) {
      return absl::InvalidArgumentError(absl::StrCat("gloo send: tag ", send_tag, " >= 2^56"));
    }
  }
  if (recv_count > 0) {
    if (absl::Status s = CheckPeer("recv", "peer", recv_peer, false); !s.ok()) return s;
    if (recv_data == nullptr) return absl::InvalidArgumentError("gloo recv: data is null");
    if (recv_tag > kMaxTag) {
      return absl::InvalidArgumentError(absl::StrCat("gloo recv: tag ", recv_tag, " >= 2^56"));
    }
  }
  const auto timeout = ToMillis(timeout_);
  std::string op = "send/recv";
  try {
    std::unique_ptr<gloo::transport::UnboundBuffer> recv_buf;
    std::unique_ptr<gloo::transport::UnboundBuffer> send_buf;
    // Receive first, so that a peer blocked in its own send can always make progress.
    if (recv_count > 0) {
      recv_buf = context_->createUnboundBuffer(recv_data, recv_count * sizeof(float));
      recv_buf->recv(recv_peer, kP2PSlotPrefix | recv_tag);
    }
    if (send_count > 0) {
      // Gloo only reads a send buffer; its API is non-const because buffers serve both ways.
      send_buf =
          context_->createUnboundBuffer(const_cast<float*>(send_data), send_count * sizeof(float));
      send_buf->send(send_peer, kP2PSlotPrefix | send_tag);
    }
    if (send_buf) {
      op = absl::StrCat("send of ", send_count, " floats to peer ", send_peer, " tag ", send_tag);
      if (!send_buf->waitSend(timeout)) {
        return Fail(op, std::runtime_error("send aborted"));
      }
    }
    if (recv_buf) {
      op = absl::StrCat("recv of ", recv_count, " floats from peer ", recv_peer, " tag ", recv_tag);
      if (!recv_buf->waitRecv(timeout)) {
        return Fail(op, std::runtime_error("recv aborted"));
      }
    }
  } catch (const std::exception& e) {
    return Fail(op, e);
  }
  return absl::OkStatus();
}

absl::Status GlooCommunicator::Barrier() {
  if (absl::Status s = CheckUsable(); !s.ok()) return s;
  if (size_ == 1) return absl::OkStatus();
  try {
    gloo::BarrierOptions opts(context_);
    opts.setTimeout(ToMillis(timeout_));
    gloo::barrier(opts);
  } catch (const std::exception& e) {
    return Fail("barrier", e);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<GlooCommunicator>> ConnectGloo(const GlooOptions& options) {
  if (options.size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("gloo options: size ", options.size, " < 1"));
  }
  if (options.rank < 0 || options.rank >= options.size) {
    return absl::InvalidArgumentError(
        absl::StrCat("gloo options: rank ", options.rank, " outside [0, size ", options.size, ")"));
  }
  if (options.store == nullptr) {
    return absl::InvalidArgumentError("gloo options: store is null");
  }
  if (options.hostname.empty()) {
    return absl::InvalidArgumentError(
        "gloo options: hostname is empty (give the IP to bind, e.g. 127.0.0.1)");
  }
  if (options.timeout <= absl::ZeroDuration() || options.timeout > absl::Hours(24)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gloo options: timeout ", absl::FormatDuration(options.timeout), " must be in (0, 24h]"));
  }
  const std::string where =
      absl::StrCat("gloo connect of rank ", options.rank, " of ", options.size, " (communicator \"",
                   options.prefix, "\", bind ", options.hostname, ")");
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = options.hostname;
    std::shared_ptr<gloo::transport::Device> device = gloo::transport::tcp::CreateDevice(attr);
    auto context = std::make_shared<gloo::rendezvous::Context>(options.rank, options.size);
    context->setTimeout(ToMillis(options.timeout));
    if (options.prefix.empty()) {
      context->connectFullMesh(*options.store, device);
    } else {
      gloo::rendezvous::PrefixStore store(options.prefix, *options.store);
      context->connectFullMesh(store, device);
    }
    return std::make_unique<GlooCommunicator>(GlooCommunicator::ConnectKey(), options.rank,
                                              options.size, options.prefix, options.timeout,
                                              std::move(device), std::move(context));
  } catch (const std::exception& e) {
    return StatusFromGloo(where, ExceptionText(e));
  }
}

}  // namespace vp::comm
