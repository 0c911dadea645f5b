#include "worker/launch/job_rank.h"

#include <unistd.h>

#include <cstdlib>
#include <set>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gloo/rendezvous/store.h"
#include "proto/plan/topology.h"
#include "proto/spec/job_spec.h"
#include "worker/comm/gloo/gloo_communicator.h"

#ifdef VP_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "worker/comm/nccl/nccl_communicator.h"
#include "worker/comm/nccl/staged_communicator.h"
#include "worker/engine/kernels/cuda/runtime.h"
#include "worker/runtime/cuda/cuda_pipeline_rank.h"
#endif

namespace vp::launch {
namespace {

bool IsCuda(const vocabpipe::v1::JobSpec& spec) { return spec.device().rfind("cuda", 0) == 0; }

// This process's member `rank` of a group of `size` under `prefix`.
absl::StatusOr<std::unique_ptr<comm::Communicator>> Gloo(
    const WorkerOptions& options, int rank, int size,
    std::shared_ptr<gloo::rendezvous::Store> store, const std::string& prefix) {
  auto gloo = comm::ConnectGloo({.rank = rank,
                                 .size = size,
                                 .store = std::move(store),
                                 .prefix = prefix,
                                 .hostname = options.hostname,
                                 .timeout = options.timeout});
  if (!gloo.ok()) {
    return absl::Status(gloo.status().code(), absl::StrCat("connect: ", gloo.status().message()));
  }
  return std::unique_ptr<comm::Communicator>(std::move(*gloo));
}

}  // namespace

absl::StatusOr<int> PickCudaDevice(const std::string& spec_device, int rank, int requested_device,
                                   int device_count) {
  if (device_count <= 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("device: ", spec_device, ": no CUDA device on this host"));
  }
  int device = requested_device;
  if (device < 0 && spec_device.rfind("cuda:", 0) == 0) {
    if (!absl::SimpleAtoi(spec_device.substr(5), &device)) device = -1;
  }
  if (device < 0) device = rank % device_count;
  if (device >= device_count) {
    return absl::InvalidArgumentError(absl::StrCat("device: cuda:", device, " does not exist (",
                                                   device_count, " CUDA devices on this host)"));
  }
  return device;
}

int CudaDeviceCount() {
#ifdef VP_HAVE_CUDA
  return engine::cuda::DeviceCount();
#else
  return 0;
#endif
}

absl::StatusOr<int> RankCudaDevice(const vocabpipe::v1::JobSpec& spec, int rank,
                                   int requested_device) {
#ifdef VP_HAVE_CUDA
  return PickCudaDevice(spec.device(), rank, requested_device, engine::cuda::DeviceCount());
#else
  (void)rank;
  (void)requested_device;
  return absl::UnimplementedError(absl::StrCat(
      "device: ", spec.device(), ": not available in this build (built without CUDA)"));
#endif
}

double CudaPeakFlops(int device) {
#ifdef VP_HAVE_CUDA
  auto name = engine::cuda::DeviceName(device);
  if (!name.ok()) return 0;
  const std::optional<double> tflops = engine::cuda::PeakBf16Tflops(*name);
  return tflops.has_value() ? *tflops * 1e12 : 0;
#else
  (void)device;
  return 0;
#endif
}

int64_t CudaMemoryBytes(int device) {
#ifdef VP_HAVE_CUDA
  auto bytes = engine::cuda::DeviceMemoryBytes(device);
  return bytes.ok() ? *bytes : 0;
#else
  (void)device;
  return 0;
#endif
}

absl::StatusOr<std::unique_ptr<runtime::PipelineRank>> CreateLocalRank(
    const vocabpipe::v1::JobSpec& spec, const planner::Plan& plan,
    const runtime::TrainerOptions& trainer, comm::Communicator* self, int cuda_device) {
  if (!IsCuda(spec)) return runtime::PipelineRank::Create(plan, 0, trainer, self);
  auto device = RankCudaDevice(spec, 0, cuda_device);
  if (!device.ok()) return device.status();
#ifdef VP_HAVE_CUDA
  runtime::CudaRankOptions cuda;
  cuda.device = *device;
  cuda.precision = spec.precision() == "fp32" ? runtime::DevicePrecision::kFp32
                                              : runtime::DevicePrecision::kBf16;
  cuda.untagged_p2p = false;  // one rank: no transfers
  return runtime::CreateCudaPipelineRank(plan, 0, trainer, cuda, self, self);
#else
  (void)trainer;
  return absl::InternalError("unreachable: RankCudaDevice fails without CUDA");
#endif
}

absl::StatusOr<std::unique_ptr<JobRank>> ConnectJobRank(
    const vocabpipe::v1::JobSpec& spec, const planner::Plan& plan,
    const runtime::TrainerOptions& trainer, const WorkerOptions& options,
    std::shared_ptr<gloo::rendezvous::Store> store) {
  const int p = plan.pipeline;
  const int t = std::max(1, spec.parallel().tensor());
  auto topology = planner::Topology::Create(p, spec.parallel().data(), t, spec::kMaxRanks);
  if (!topology.ok()) return topology.status();
  if (options.rank < 0 || options.rank >= topology->world()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rank: ", options.rank, " is not in [0, ", topology->world(), ")"));
  }
  auto out = std::make_unique<JobRank>();
  out->coord = topology->CoordOf(options.rank);
  const int stage = out->coord.stage, replica = out->coord.replica, tp = out->coord.tensor;
  if (trainer.tensor.size != t || trainer.tensor.rank != tp) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", options.rank, " is ", topology->Describe(options.rank),
                     ", but the trainer options say tensor rank ", trainer.tensor.rank, " of ",
                     trainer.tensor.size));
  }
  if (trainer.data.replicas != topology->data() || trainer.data.replica != replica) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", options.rank, " is ", topology->Describe(options.rank),
                     ", but the trainer options say replica ", trainer.data.replica, " of ",
                     trainer.data.replicas));
  }
  // One pipeline per replica, each under its own key prefix (the one-replica name unchanged);
  // the replicas of one stage form its data group.
  const std::string base = absl::StrCat("vocabpipe/", options.attempt);
  // Under tensor parallelism each tensor index has its own pipeline and data groups, and each
  // stage of each replica a tensor group.
  const std::string tensor_suffix = t > 1 ? absl::StrCat("/tensor", tp) : "";
  const std::string prefix =
      (topology->data() == 1 ? absl::StrCat(base, "/pipeline")
                             : absl::StrCat(base, "/pipeline/replica", replica)) +
      tensor_suffix;
  if (t > 1) {
    if (IsCuda(spec)) {
      return absl::UnimplementedError(
          "parallel.tensor: > 1 runs on device cpu only in this version (the CUDA engine's "
          "tensor-parallel layers are not built yet)");
    }
    auto tensor = Gloo(options, tp, t, store,
                       absl::StrCat(base, "/tensor/stage", stage, "/replica", replica));
    if (!tensor.ok()) return tensor.status();
    out->comms.push_back(std::move(*tensor));
    out->tensor = out->comms.back().get();
  }
  if (topology->data() > 1) {
    if (IsCuda(spec)) {
      // NCCL groups (ncclCommSplit) and the device ZeRO-1 state have not run on GPUs yet.
      return absl::UnimplementedError(
          "parallel.data: > 1 runs on device cpu only in this version (the CUDA data-parallel "
          "groups have not run on GPUs yet)");
    }
    auto data = Gloo(options, replica, topology->data(), store,
                     absl::StrCat(base, "/data/stage", stage, tensor_suffix));
    if (!data.ok()) return data.status();
    out->comms.push_back(std::move(*data));
    out->data = out->comms.back().get();
  }
  if (!IsCuda(spec)) {
    auto gloo = Gloo(options, stage, p, store, prefix);
    if (!gloo.ok()) return gloo.status();
    out->comms.push_back(std::move(*gloo));
    out->transport = "gloo";
    auto rank = runtime::PipelineRank::Create(plan, stage, trainer, out->comms.back().get(),
                                              out->data, out->tensor);
    if (!rank.ok()) return rank.status();
    out->rank = std::move(*rank);
    return out;
  }
#ifdef VP_HAVE_CUDA
  auto device = RankCudaDevice(spec, options.rank, options.cuda_device);
  if (!device.ok()) return device.status();
  out->cuda_device = *device;
  runtime::CudaRankOptions cuda;
  cuda.device = *device;
  cuda.precision = spec.precision() == "fp32" ? runtime::DevicePrecision::kFp32
                                              : runtime::DevicePrecision::kBf16;
  if (p == 1) {
    // One rank never communicates: the self communicator (identity collectives on device
    // pointers), so a one-GPU job does not depend on NCCL's bootstrap and topology detection.
    out->transport = "self";
    cuda.untagged_p2p = false;
    out->comms.push_back(comm::MakeSelfCommunicator());
    auto rank = runtime::CreateCudaPipelineRank(plan, options.rank, trainer, cuda,
                                                out->comms[0].get(), out->comms[0].get());
    if (!rank.ok()) return rank.status();
    out->rank = std::move(*rank);
    return out;
  }
  // Which physical GPU this is, host-wide: the transport depends on whether two ranks share one.
  char bus[64] = {0};
  if (cudaDeviceGetPCIBusId(bus, sizeof(bus), *device) != cudaSuccess) {
    return absl::InternalError(absl::StrCat("cuda:", *device, ": cannot read its PCI bus id"));
  }
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  const std::string id = absl::StrCat(host, "/", bus);
  std::set<std::string> ids;
  try {
    store->set(absl::StrCat(prefix, "/gpu/", options.rank),
               std::vector<char>(id.begin(), id.end()));
    std::vector<std::string> keys;
    for (int r = 0; r < p; ++r) keys.push_back(absl::StrCat(prefix, "/gpu/", r));
    store->wait(keys, absl::ToChronoMilliseconds(options.timeout));
    for (const std::string& k : keys) {
      const std::vector<char> v = store->get(k);
      ids.insert(std::string(v.begin(), v.end()));
    }
  } catch (const std::exception& e) {
    return absl::DeadlineExceededError(
        absl::StrCat("connect: waiting for every rank's GPU id: ", e.what()));
  }
  comm::Communicator* p2p = nullptr;
  comm::Communicator* coll = nullptr;
  if (static_cast<int>(ids.size()) == p) {
    out->transport = "nccl";
    cuda.untagged_p2p = true;
    // One communicator, driven by one communication thread in the plan's order (as Gloo on the
    // CPU), unless VOCABPIPE_NCCL_SPLIT_COMM=1: then transfers and vocabulary barriers get a
    // communicator each, driven from two threads. NCCL calls it unsafe to drive two
    // communicators of one device from two threads at once, and the split has not yet run on
    // two GPUs, so it stays opt-in until a multi-GPU run validates it.
    const char* split_env = std::getenv("VOCABPIPE_NCCL_SPLIT_COMM");
    const bool split = split_env != nullptr && std::string(split_env) == "1";
    for (bool vocab : split ? std::vector<bool>{false, true} : std::vector<bool>{true}) {
      auto nccl = comm::ConnectNccl({.rank = options.rank,
                                     .size = p,
                                     .device = *device,
                                     .store = store,
                                     .prefix = absl::StrCat(prefix, vocab ? "/vocab" : "/pp"),
                                     .high_priority_stream = vocab,
                                     .timeout = options.timeout});
      if (!nccl.ok()) {
        return absl::Status(nccl.status().code(),
                            absl::StrCat("connect (NCCL): ", nccl.status().message()));
      }
      out->comms.push_back(std::move(*nccl));
    }
    p2p = out->comms.front().get();
    coll = out->comms.back().get();
  } else {
    out->transport = "gloo-staged";
    cuda.untagged_p2p = false;
    auto gloo = Gloo(options, options.rank, p, store, prefix);
    if (!gloo.ok()) return gloo.status();
    out->comms.push_back(std::move(*gloo));
    out->comms.push_back(std::make_unique<comm::StagedCommunicator>(out->comms[0].get()));
    p2p = coll = out->comms[1].get();
  }
  auto rank = runtime::CreateCudaPipelineRank(plan, options.rank, trainer, cuda, p2p, coll);
  if (!rank.ok()) return rank.status();
  out->rank = std::move(*rank);
  return out;
#else
  (void)trainer;
  return RankCudaDevice(spec, options.rank, options.cuda_device).status();
#endif
}

}  // namespace vp::launch
