#include "worker/launch/job_rank.h"

#include <unistd.h>

#include <cstdlib>
#include <fstream>
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
  const std::string tensor_prefix = absl::StrCat(base, "/tensor/stage", stage, "/replica", replica);
  const std::string data_prefix = absl::StrCat(base, "/data/stage", stage, tensor_suffix);
  if (!IsCuda(spec)) {
    if (t > 1) {
      auto tensor = Gloo(options, tp, t, store, tensor_prefix);
      if (!tensor.ok()) return tensor.status();
      out->comms.push_back(std::move(*tensor));
      out->tensor = out->comms.back().get();
    }
    if (topology->data() > 1) {
      auto data = Gloo(options, replica, topology->data(), store, data_prefix);
      if (!data.ok()) return data.status();
      out->comms.push_back(std::move(*data));
      out->data = out->comms.back().get();
    }
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
  const int d = topology->data(), world = topology->world();
  // The pipeline's communicator of a one-stage job: one rank never transfers, the self
  // communicator (identity collectives on device pointers), so a one-GPU job does not depend
  // on NCCL's bootstrap and topology detection.
  auto self = [&out]() {
    out->comms.push_back(comm::MakeSelfCommunicator());
    return out->comms.back().get();
  };
  if (world == 1) {
    out->transport = "self";
    cuda.untagged_p2p = false;
    comm::Communicator* one = self();
    auto rank = runtime::CreateCudaPipelineRank(plan, stage, trainer, cuda, one, one);
    if (!rank.ok()) return rank.status();
    out->rank = std::move(*rank);
    return out;
  }
  // Which physical GPU each rank of the job has, host-wide: NCCL needs every member of a
  // communicator on a GPU of its own.
  char bus[64] = {0};
  if (cudaDeviceGetPCIBusId(bus, sizeof(bus), *device) != cudaSuccess) {
    return absl::InternalError(absl::StrCat("cuda:", *device, ": cannot read its PCI bus id"));
  }
  // The machine by its kernel's boot id, which containers on one node share (their host names
  // differ), so two containers given one GPU are seen to share it; the host name where the boot
  // id cannot be read.
  std::string machine;
  if (std::ifstream boot("/proc/sys/kernel/random/boot_id"); boot) std::getline(boot, machine);
  if (machine.empty()) {
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    machine = host;
  }
  const std::string id = absl::StrCat(machine, "/", bus);
  std::set<std::string> ids;
  try {
    store->set(absl::StrCat(base, "/gpu/", options.rank), std::vector<char>(id.begin(), id.end()));
    std::vector<std::string> keys;
    for (int r = 0; r < world; ++r) keys.push_back(absl::StrCat(base, "/gpu/", r));
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
  if (static_cast<int>(ids.size()) == world) {
    out->transport = "nccl";
    cuda.untagged_p2p = true;
    // One communicator per pipeline, driven by one communication thread in the plan's order
    // (as Gloo on the CPU), unless VOCABPIPE_NCCL_SPLIT_COMM=1: then transfers and vocabulary
    // barriers get a communicator each, driven from two threads, and the data-parallel
    // reduction overlaps the backward on a third. NCCL calls it unsafe to drive communicators
    // of one device from several threads at once, and the split has not yet run on two GPUs,
    // so it stays opt-in until a multi-GPU run validates it; without it the replicas' gradients
    // are summed at OPT, after the pipeline's transfers.
    const char* split_env = std::getenv("VOCABPIPE_NCCL_SPLIT_COMM");
    const bool split = split_env != nullptr && std::string(split_env) == "1";
    cuda.overlap_data_sync = split;
    // One bootstrap for the whole job (the world), then each group split from it
    // (ncclCommSplit, every rank in the same order): the pipeline's communicator(s), then the
    // data group's.
    auto world_comm = comm::ConnectNccl({.rank = options.rank,
                                         .size = world,
                                         .device = *device,
                                         .store = store,
                                         .prefix = absl::StrCat(base, "/world"),
                                         .high_priority_stream = !split,
                                         .timeout = options.timeout});
    if (!world_comm.ok()) {
      return absl::Status(world_comm.status().code(),
                          absl::StrCat("connect (NCCL): ", world_comm.status().message()));
    }
    comm::NcclCommunicator* w = world_comm->get();
    out->comms.push_back(std::move(*world_comm));
    auto add = [&out](absl::StatusOr<std::unique_ptr<comm::NcclCommunicator>> c)
        -> absl::StatusOr<comm::Communicator*> {
      if (!c.ok()) {
        return absl::Status(c.status().code(),
                            absl::StrCat("connect (NCCL): ", c.status().message()));
      }
      out->comms.push_back(std::move(*c));
      return out->comms.back().get();
    };
    if (p == 1) {
      p2p = coll = self();
    } else if (d == 1 && t == 1 && !split) {
      p2p = coll = w;  // the world is the pipeline: world rank = stage
    } else {
      for (bool vocab : split ? std::vector<bool>{false, true} : std::vector<bool>{true}) {
        auto c = add(w->Split(topology->PipelineGroupId(options.rank), stage, stage, p, vocab,
                              absl::StrCat(prefix, vocab ? "/vocab" : "/pp")));
        if (!c.ok()) return c.status();
        (vocab ? coll : p2p) = *c;
      }
      if (p2p == nullptr) p2p = coll;
    }
    if (d > 1) {
      auto c = add(
          w->Split(topology->DataGroupId(options.rank), replica, replica, d, false, data_prefix));
      if (!c.ok()) return c.status();
      out->data = *c;
    }
    if (t > 1) {
      // Driven by the compute thread inside the passes while the pipeline's communicator runs
      // on the communication thread — the concurrency Megatron-LM also relies on, which NCCL
      // documents as unsafe in general; the first multi-GPU run must confirm it (docs/cuda.md).
      auto c =
          add(w->Split(topology->TensorGroupId(options.rank), tp, tp, t, false, tensor_prefix));
      if (!c.ok()) return c.status();
      out->tensor = *c;
    }
    // NCCL connects a communicator's peers on its first use, which would be step 0, with the
    // communicators driven from different threads. Connect them here instead, on this thread,
    // every rank in the same order (pipeline, data, tensor); the pipeline's transfer
    // communicator also with its neighbours.
    std::vector<std::pair<comm::NcclCommunicator*, bool>> warm;
    auto nccl_of = [](comm::Communicator* c) { return dynamic_cast<comm::NcclCommunicator*>(c); };
    if (comm::NcclCommunicator* c = nccl_of(p2p)) warm.push_back({c, true});
    if (comm::NcclCommunicator* c = nccl_of(coll); c != nullptr && coll != p2p) {
      warm.push_back({c, false});
    }
    if (comm::NcclCommunicator* c = nccl_of(out->data)) warm.push_back({c, false});
    if (comm::NcclCommunicator* c = nccl_of(out->tensor)) warm.push_back({c, false});
    for (auto [c, neighbours] : warm) {
      if (absl::Status s = c->WarmUp(neighbours); !s.ok()) {
        return absl::Status(s.code(), absl::StrCat("connect (NCCL): warm-up: ", s.message()));
      }
    }
  } else {
    // Several ranks on one GPU: Gloo with device buffers staged through host memory, one
    // communicator per group as on the CPU.
    out->transport = "gloo-staged";
    cuda.untagged_p2p = false;
    auto staged = [&](int rank, int size,
                      const std::string& group_prefix) -> absl::StatusOr<comm::Communicator*> {
      auto gloo = Gloo(options, rank, size, store, group_prefix);
      if (!gloo.ok()) return gloo.status();
      out->comms.push_back(std::move(*gloo));
      out->comms.push_back(std::make_unique<comm::StagedCommunicator>(out->comms.back().get()));
      return out->comms.back().get();
    };
    if (p == 1) {
      p2p = coll = self();
    } else {
      auto c = staged(stage, p, prefix);
      if (!c.ok()) return c.status();
      p2p = coll = *c;
    }
    if (d > 1) {
      auto c = staged(replica, d, data_prefix);
      if (!c.ok()) return c.status();
      out->data = *c;
    }
    if (t > 1) {
      auto c = staged(tp, t, tensor_prefix);
      if (!c.ok()) return c.status();
      out->tensor = *c;
    }
  }
  auto rank = runtime::CreateCudaPipelineRank(plan, stage, trainer, cuda, p2p, coll, out->data,
                                              out->tensor);
  if (!rank.ok()) return rank.status();
  out->rank = std::move(*rank);
  return out;
#else
  (void)trainer;
  return RankCudaDevice(spec, options.rank, options.cuda_device).status();
#endif
}

}  // namespace vp::launch
