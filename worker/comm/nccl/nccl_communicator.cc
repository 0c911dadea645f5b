#include "worker/comm/nccl/nccl_communicator.h"

#include <gloo/rendezvous/store.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <exception>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "worker/comm/nccl/nccl_library.h"
#include "worker/comm/nccl/stream_query.h"

namespace vp::comm {
namespace {

static_assert(sizeof(ncclUniqueId) == kNcclIdBytes, "NCCL_UNIQUE_ID_BYTES changed");
constexpr uint64_t kMaxTag = (uint64_t{1} << 56) - 1;  // the Gloo backend's tag range

absl::Status NcclError(const Nccl& nccl, ncclResult_t r, const std::string& what) {
  const std::string text = absl::StrCat(what, ": ", nccl.ncclGetErrorString(r));
  switch (r) {
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return absl::InvalidArgumentError(text);
    case ncclRemoteError:
    case ncclSystemError:
      return absl::UnavailableError(text);  // a peer or the network is gone
    case ncclInProgress:
      // Only seen here when Settle gave up at the deadline: the header's contract is that a
      // call past the timeout returns DeadlineExceeded (as Wait does), not Internal.
      return absl::DeadlineExceededError(text);
    default:
      return absl::InternalError(text);
  }
}

absl::Status CudaError(cudaError_t e, const std::string& what) {
  return absl::InternalError(
      absl::StrCat(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")"));
}

// Non-blocking communicators may return ncclInProgress from any call: poll until it resolves.
ncclResult_t Settle(const Nccl& nccl, ncclComm_t comm, ncclResult_t r, absl::Time deadline) {
  while (r == ncclInProgress) {
    if (absl::Now() > deadline) return ncclInProgress;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
    ncclResult_t state = ncclSuccess;
    ncclResult_t q = nccl.ncclCommGetAsyncError(comm, &state);
    r = q != ncclSuccess ? q : state;
  }
  return r;
}

// A communicator's stream (normal or high priority) and its one-float Barrier scratch.
absl::Status CreateStreamAndScratch(bool high_priority, cudaStream_t* stream, float** scratch) {
  int least = 0, greatest = 0;
  cudaDeviceGetStreamPriorityRange(&least, &greatest);
  if (cudaError_t e = cudaStreamCreateWithPriority(stream, cudaStreamNonBlocking,
                                                   high_priority ? greatest : least);
      e != cudaSuccess) {
    return CudaError(e, "nccl connect: stream");
  }
  if (cudaError_t e = cudaMalloc(scratch, sizeof(float)); e != cudaSuccess) {
    cudaStreamDestroy(*stream);
    *stream = nullptr;
    return CudaError(e, "nccl connect: scratch");
  }
  cudaMemsetAsync(*scratch, 0, sizeof(float), *stream);  // ordered before its first use
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<NcclIdBytes> ExchangeNcclId(
    gloo::rendezvous::Store& store, const std::string& key, int rank, absl::Duration timeout,
    const std::function<absl::StatusOr<NcclIdBytes>()>& make_id) {
  try {
    if (rank == 0) {
      absl::StatusOr<NcclIdBytes> id = make_id();
      if (!id.ok()) return id.status();
      store.set(key, std::vector<char>(id->begin(), id->end()));
      return *id;
    }
    store.wait({key}, std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout)));
    const std::vector<char> bytes = store.get(key);
    if (bytes.size() != kNcclIdBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "nccl id under \"", key, "\" has ", bytes.size(), " bytes, expected ", kNcclIdBytes));
    }
    NcclIdBytes id;
    std::memcpy(id.data(), bytes.data(), kNcclIdBytes);
    return id;
  } catch (const std::exception& e) {
    const std::string text = e.what();
    const std::string lower = absl::AsciiStrToLower(text);
    const std::string what = absl::StrCat("nccl id exchange under \"", key, "\" on rank ", rank,
                                          " (timeout ", absl::FormatDuration(timeout), "): ");
    if (absl::StrContains(lower, "timeout") || absl::StrContains(lower, "timed out")) {
      return absl::DeadlineExceededError(what + text);
    }
    return absl::UnavailableError(what + text);
  }
}

NcclCommunicator::NcclCommunicator(ConnectKey, const NcclOptions& o, const Nccl* nccl,
                                   ncclComm* comm, cudaStream_t stream, float* scratch)
    : nccl_(nccl),
      rank_(o.rank),
      size_(o.size),
      device_(o.device),
      prefix_(o.prefix),
      timeout_(o.timeout),
      comm_(comm),
      stream_(stream),
      scratch_(scratch) {}

NcclCommunicator::~NcclCommunicator() {
  cudaSetDevice(device_);
  if (comm_ != nullptr) {
    // A poisoned communicator was aborted already; a healthy one finalises cleanly.
    if (error_.ok()) {
      // A finalise that did not settle (a peer gone, kernels still waiting on it) would make
      // ncclCommDestroy wait for it without end; abort instead.
      ncclResult_t r = nccl_->ncclCommFinalize(comm_);
      r = Settle(*nccl_, comm_, r, absl::Now() + timeout_);
      if (r == ncclSuccess) {
        nccl_->ncclCommDestroy(comm_);
      } else {
        nccl_->ncclCommAbort(comm_);
      }
    }
  }
  if (scratch_ != nullptr) cudaFree(scratch_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::Status NcclCommunicator::CheckUsable() const {
  if (error_.ok()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("nccl communicator \"", prefix_, "\" rank ", rank_,
                   " is unusable after an earlier error: ", error_.message()));
}

absl::Status NcclCommunicator::CheckPeer(const char* op, const char* arg, int peer,
                                         bool allow_self) const {
  if (peer < 0 || peer >= size_) {
    return absl::InvalidArgumentError(
        absl::StrCat("nccl ", op, ": ", arg, " ", peer, " outside [0, ", size_, ")"));
  }
  if (!allow_self && peer == rank_) {
    return absl::InvalidArgumentError(
        absl::StrCat("nccl ", op, ": ", arg, " ", peer, " is this rank itself"));
  }
  return absl::OkStatus();
}

absl::Status NcclCommunicator::Fail(absl::Status status) {
  if (error_.ok()) {
    error_ = status;
    // An errored or hung NCCL communicator cannot be reused; abort frees its resources and
    // unblocks kernels still waiting on peers.
    nccl_->ncclCommAbort(comm_);
    comm_ = nullptr;
  }
  return status;
}

absl::Status NcclCommunicator::Wait(const std::string& what) {
  const absl::Time deadline = absl::Now() + timeout_;
  const std::string ctx =
      absl::StrCat("nccl ", what, " on rank ", rank_, " of ", size_, " (communicator \"", prefix_,
                   "\", timeout ", absl::FormatDuration(timeout_), ")");
  while (true) {
    const cudaError_t q = QueryStream(stream_);  // NotReady is not left as the last error
    if (q == cudaSuccess) return absl::OkStatus();
    if (q != cudaErrorNotReady) return Fail(CudaError(q, ctx));
    ncclResult_t state = ncclSuccess;
    nccl_->ncclCommGetAsyncError(comm_, &state);
    if (state != ncclSuccess && state != ncclInProgress) return Fail(NcclError(*nccl_, state, ctx));
    if (absl::Now() > deadline) return Fail(absl::DeadlineExceededError(ctx));
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

absl::Status NcclCommunicator::AllReduce(float* data, size_t count, ReduceOp op) {
  if (absl::Status s = CheckUsable(); !s.ok()) return s;
  if (count == 0 || size_ == 1) return absl::OkStatus();
  if (data == nullptr) return absl::InvalidArgumentError("nccl all-reduce: data is null");
  const std::string what =
      absl::StrCat("all-reduce ", op == ReduceOp::kSum ? "sum" : "max", " of ", count, " floats");
  cudaSetDevice(device_);
  ncclResult_t r = nccl_->ncclAllReduce(data, data, count, ncclFloat,
                                        op == ReduceOp::kSum ? ncclSum : ncclMax, comm_, stream_);
  r = Settle(*nccl_, comm_, r, absl::Now() + timeout_);
  if (r != ncclSuccess) return Fail(NcclError(*nccl_, r, "nccl " + what));
  return Wait(what);
}

absl::Status NcclCommunicator::Broadcast(float* data, size_t count, int root) {
  if (absl::Status s = CheckUsable(); !s.ok()) return s;
  if (absl::Status s = CheckPeer("broadcast", "root", root, true); !s.ok()) return s;
  if (count == 0 || size_ == 1) return absl::OkStatus();
  if (data == nullptr) return absl::InvalidArgumentError("nccl broadcast: data is null");
  const std::string what = absl::StrCat("broadcast of ", count, " floats from root ", root);
  cudaSetDevice(device_);
  ncclResult_t r = nccl_->ncclBroadcast(data, data, count, ncclFloat, root, comm_, stream_);
  r = Settle(*nccl_, comm_, r, absl::Now() + timeout_);
  if (r != ncclSuccess) return Fail(NcclError(*nccl_, r, "nccl " + what));
  return Wait(what);
}

// The ranges are balanced, not equal (RangeOf), which ncclReduceScatter and ncclAllGather do
// not take: one grouped ncclReduce (resp. ncclBroadcast) per range, rooted at its owner, moves
// the same bytes in one launch.
absl::Status NcclCommunicator::ReduceScatterSum(float* data, size_t count) {
  return RangedCollective(data, count, /*reduce=*/true);
}

absl::Status NcclCommunicator::AllGather(float* data, size_t count) {
  return RangedCollective(data, count, /*reduce=*/false);
}

absl::Status NcclCommunicator::RangedCollective(float* data, size_t count, bool reduce) {
  if (absl::Status s = CheckUsable(); !s.ok()) return s;
  if (count == 0 || size_ == 1) return absl::OkStatus();
  const char* op = reduce ? "reduce-scatter" : "all-gather";
  if (data == nullptr)
    return absl::InvalidArgumentError(absl::StrCat("nccl ", op, ": data is null"));
  const std::string what = absl::StrCat(op, " of ", count, " floats");
  cudaSetDevice(device_);
  const absl::Time deadline = absl::Now() + timeout_;
  ncclResult_t r = Settle(*nccl_, comm_, nccl_->ncclGroupStart(), deadline);
  for (int owner = 0; owner < size_ && r == ncclSuccess; ++owner) {
    const ShardRange range = RangeOf(count, size_, owner);
    if (range.count == 0) continue;
    float* part = data + range.begin;
    r = Settle(
        *nccl_, comm_,
        reduce
            ? nccl_->ncclReduce(part, part, range.count, ncclFloat, ncclSum, owner, comm_, stream_)
            : nccl_->ncclBroadcast(part, part, range.count, ncclFloat, owner, comm_, stream_),
        deadline);
  }
  const ncclResult_t end = Settle(*nccl_, comm_, nccl_->ncclGroupEnd(), deadline);
  if (r == ncclSuccess) r = end;
  if (r != ncclSuccess) return Fail(NcclError(*nccl_, r, "nccl " + what));
  return Wait(what);
}

absl::Status NcclCommunicator::Send(const float* data, size_t count, int peer, uint64_t tag) {
  if (absl::Status s = CheckUsable(); !s.ok()) return s;
  if (absl::Status s = CheckPeer("send", "peer", peer, false); !s.ok()) return s;
  if (tag > kMaxTag) return absl::InvalidArgumentError("nccl send: tag must be < 2^56");
  if (count == 0) return absl::OkStatus();
  if (data == nullptr) return absl::InvalidArgumentError("nccl send: data is null");
  return SendRecv(data, count, peer, nullptr, 0, 0);
}

absl::Status NcclCommunicator::Recv(float* data, size_t count, int peer, uint64_t tag) {
  if (absl::Status s = CheckUsable(); !s.ok()) return s;
  if (absl::Status s = CheckPeer("recv", "peer", peer, false); !s.ok()) return s;
  if (tag > kMaxTag) return absl::InvalidArgumentError("nccl recv: tag must be < 2^56");
  if (count == 0) return absl::OkStatus();
  if (data == nullptr) return absl::InvalidArgumentError("nccl recv: data is null");
  return SendRecv(nullptr, 0, 0, data, count, peer);
}

absl::Status NcclCommunicator::SendRecv(const float* send_data, size_t send_count, int send_peer,
                                        float* recv_data, size_t recv_count, int recv_peer) {
  if (absl::Status s = CheckUsable(); !s.ok()) return s;
  if (send_count > 0) {
    if (absl::Status s = CheckPeer("send", "peer", send_peer, false); !s.ok()) return s;
  }
  if (recv_count > 0) {
    if (absl::Status s = CheckPeer("recv", "peer", recv_peer, false); !s.ok()) return s;
  }
  if ((send_count > 0 && send_data == nullptr) || (recv_count > 0 && recv_data == nullptr)) {
    return absl::InvalidArgumentError("nccl send/recv: data is null with a non-zero count");
  }
  if (send_count == 0 && recv_count == 0) return absl::OkStatus();
  const std::string what = absl::StrCat("send ", send_count, " floats to ", send_peer, " / recv ",
                                        recv_count, " floats from ", recv_peer);
  cudaSetDevice(device_);
  const absl::Time deadline = absl::Now() + timeout_;
  ncclResult_t r = Settle(*nccl_, comm_, nccl_->ncclGroupStart(), deadline);
  if (r == ncclSuccess && send_count > 0) {
    r = Settle(*nccl_, comm_,
               nccl_->ncclSend(send_data, send_count, ncclFloat, send_peer, comm_, stream_),
               deadline);
  }
  if (r == ncclSuccess && recv_count > 0) {
    r = Settle(*nccl_, comm_,
               nccl_->ncclRecv(recv_data, recv_count, ncclFloat, recv_peer, comm_, stream_),
               deadline);
  }
  const ncclResult_t end = Settle(*nccl_, comm_, nccl_->ncclGroupEnd(), deadline);
  if (r == ncclSuccess) r = end;
  if (r != ncclSuccess) return Fail(NcclError(*nccl_, r, "nccl " + what));
  return Wait(what);
}

absl::Status NcclCommunicator::Barrier() {
  if (absl::Status s = CheckUsable(); !s.ok()) return s;
  if (size_ == 1) return absl::OkStatus();
  return AllReduce(scratch_, 1, ReduceOp::kSum);
}

absl::Status NcclCommunicator::WarmUp(bool neighbours) {
  if (absl::Status s = CheckUsable(); !s.ok()) return s;
  if (size_ == 1) return absl::OkStatus();
  cudaSetDevice(device_);
  const size_t count = static_cast<size_t>(size_) + 1;  // one a member, one to receive into
  float* raw = nullptr;
  if (cudaError_t e = cudaMalloc(&raw, count * sizeof(float)); e != cudaSuccess) {
    return CudaError(e, absl::StrCat("nccl warm-up of \"", prefix_, "\": buffer"));
  }
  std::unique_ptr<float, decltype(&cudaFree)> buffer(raw, &cudaFree);
  if (cudaError_t e = cudaMemsetAsync(raw, 0, count * sizeof(float), stream_); e != cudaSuccess) {
    return CudaError(e, absl::StrCat("nccl warm-up of \"", prefix_, "\": buffer"));
  }
  if (absl::Status s = AllReduce(raw, size_, ReduceOp::kSum); !s.ok()) return s;
  if (absl::Status s = ReduceScatterSum(raw, size_); !s.ok()) return s;
  if (absl::Status s = AllGather(raw, size_); !s.ok()) return s;
  if (!neighbours) return absl::OkStatus();
  const bool has_next = rank_ + 1 < size_, has_previous = rank_ > 0;
  // Downstream, then upstream: every member posts its pair of each direction in one group.
  if (absl::Status s =
          SendRecv(raw, has_next ? 1 : 0, rank_ + 1, raw + size_, has_previous ? 1 : 0, rank_ - 1);
      !s.ok()) {
    return s;
  }
  return SendRecv(raw, has_previous ? 1 : 0, rank_ - 1, raw + size_, has_next ? 1 : 0, rank_ + 1);
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Split(int color, int key,
                                                                          int expect_rank,
                                                                          int expect_size,
                                                                          bool high_priority_stream,
                                                                          const std::string& name) {
  if (absl::Status s = CheckUsable(); !s.ok()) return s;
  if (color < 0) {
    return absl::InvalidArgumentError(absl::StrCat("nccl split: color ", color, " must be >= 0"));
  }
  if (expect_size < 1 || expect_rank < 0 || expect_rank >= expect_size || expect_size > size_) {
    return absl::InvalidArgumentError(absl::StrCat("nccl split \"", name, "\": rank ", expect_rank,
                                                   " of ", expect_size, " in a communicator of ",
                                                   size_));
  }
  if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) {
    return CudaError(e, "nccl split: device");
  }
  cudaStream_t stream = nullptr;
  float* scratch = nullptr;
  if (absl::Status st = CreateStreamAndScratch(high_priority_stream, &stream, &scratch); !st.ok()) {
    return st;
  }
  auto release = [&] {
    cudaFree(scratch);
    cudaStreamDestroy(stream);
  };
  const std::string what =
      absl::StrCat("nccl split of \"", prefix_, "\" into \"", name, "\" (color ", color, ", key ",
                   key, ") on rank ", rank_, " (timeout ", absl::FormatDuration(timeout_), ")");
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // a member that never calls surfaces as a timeout, not a hang
  ncclComm_t child = nullptr;
  const absl::Time deadline = absl::Now() + timeout_;
  // The split is collective over the parent: its progress is the parent's until the child
  // exists, then the child's own.
  ncclResult_t r =
      Settle(*nccl_, comm_, nccl_->ncclCommSplit(comm_, color, key, &child, &config), deadline);
  if (r == ncclSuccess && child != nullptr) r = Settle(*nccl_, child, ncclInProgress, deadline);
  if (r == ncclSuccess && child == nullptr) r = ncclInternalError;
  if (r != ncclSuccess) {
    // Abort the parent first: that joins NCCL's split job, which fills in `child` (a local
    // whose address the job holds) even when it failed; only then is `child` final.
    const absl::Status failed =
        Fail(r == ncclInProgress ? absl::DeadlineExceededError(what) : NcclError(*nccl_, r, what));
    if (child != nullptr) nccl_->ncclCommAbort(child);
    release();
    return failed;
  }
  int count = 0, user_rank = -1;
  if (nccl_->ncclCommCount(child, &count) != ncclSuccess ||
      nccl_->ncclCommUserRank(child, &user_rank) != ncclSuccess || count != expect_size ||
      user_rank != expect_rank) {
    nccl_->ncclCommAbort(child);
    release();
    return absl::InvalidArgumentError(absl::StrCat(what, ": NCCL formed rank ", user_rank, " of ",
                                                   count, ", expected rank ", expect_rank, " of ",
                                                   expect_size));
  }
  NcclOptions o;
  o.rank = expect_rank;
  o.size = expect_size;
  o.device = device_;
  o.prefix = name;
  o.high_priority_stream = high_priority_stream;
  o.timeout = timeout_;
  return std::make_unique<NcclCommunicator>(ConnectKey(), o, nccl_, child, stream, scratch);
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> ConnectNccl(const NcclOptions& o) {
  if (o.size < 1 || o.rank < 0 || o.rank >= o.size) {
    return absl::InvalidArgumentError(
        absl::StrCat("nccl connect: rank ", o.rank, " must be in [0, size ", o.size, ")"));
  }
  if (o.store == nullptr) return absl::InvalidArgumentError("nccl connect: store is required");
  if (o.prefix.empty()) return absl::InvalidArgumentError("nccl connect: prefix is required");
  if (o.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("nccl connect: timeout must be positive");
  }
  if (cudaError_t e = cudaSetDevice(o.device); e != cudaSuccess) {
    return absl::FailedPreconditionError(
        absl::StrCat("nccl connect: device ", o.device, ": ", cudaGetErrorString(e)));
  }
  // NCCL is opened here, by the first communicator a process connects (nccl_library.h).
  absl::StatusOr<const Nccl*> loaded = LoadNccl();
  if (!loaded.ok()) return loaded.status();
  const Nccl& nccl = **loaded;
  absl::StatusOr<NcclIdBytes> id =
      ExchangeNcclId(*o.store, o.prefix + "/nccl_unique_id", o.rank, o.timeout,
                     [&nccl]() -> absl::StatusOr<NcclIdBytes> {
                       ncclUniqueId uid;
                       if (ncclResult_t r = nccl.ncclGetUniqueId(&uid); r != ncclSuccess) {
                         return NcclError(nccl, r, "ncclGetUniqueId");
                       }
                       NcclIdBytes bytes;
                       std::memcpy(bytes.data(), uid.internal, kNcclIdBytes);
                       return bytes;
                     });
  if (!id.ok()) return id.status();

  cudaStream_t stream = nullptr;
  float* scratch = nullptr;
  if (absl::Status st = CreateStreamAndScratch(o.high_priority_stream, &stream, &scratch);
      !st.ok()) {
    return st;
  }

  ncclUniqueId uid;
  std::memcpy(uid.internal, id->data(), kNcclIdBytes);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // so a missing peer surfaces as a timeout, not a hang
  ncclComm_t comm = nullptr;
  ncclResult_t r = nccl.ncclCommInitRankConfig(&comm, o.size, uid, o.rank, &config);
  const absl::Time deadline = absl::Now() + o.timeout;
  if (comm != nullptr) r = Settle(nccl, comm, r, deadline);
  if (r != ncclSuccess) {
    if (comm != nullptr) nccl.ncclCommAbort(comm);
    cudaFree(scratch);
    cudaStreamDestroy(stream);
    const std::string what =
        absl::StrCat("nccl connect \"", o.prefix, "\" rank ", o.rank, " of ", o.size, " (timeout ",
                     absl::FormatDuration(o.timeout), ")");
    if (r == ncclInProgress) return absl::DeadlineExceededError(what);
    return NcclError(nccl, r, what);
  }
  return std::make_unique<NcclCommunicator>(NcclCommunicator::ConnectKey(), o, &nccl, comm, stream,
                                            scratch);
}

}  // namespace vp::comm
