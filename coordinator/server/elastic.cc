#include "coordinator/server/elastic.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace vp::server {

ReplicaChoice ChooseReplicas(int requested_data, int requested_microbatches, int ranks_per_replica,
                             int free_workers, bool may_shrink, const std::string& device) {
  const int per = std::max(1, ranks_per_replica);
  const int full = requested_data * per;
  if (free_workers >= full) return {.data = requested_data};
  if (!may_shrink) return {};
  const std::string kind = device.empty() ? "cpu" : device;
  const int fit = std::min(requested_data - 1, free_workers / per);
  if (fit < 1) {
    return {.wait = absl::StrCat("elastic: waiting for ", per, " free ", kind,
                                 " workers for one replica (", free_workers, " free)")};
  }
  const int global = requested_data * requested_microbatches;
  if (global % fit != 0) {
    return {.wait = absl::StrCat("elastic: cannot keep the global batch at ", fit,
                                 fit == 1 ? " replica" : " replicas", " (", requested_data, " × ",
                                 requested_microbatches, " = ", global,
                                 " microbatches do not split over ", fit, "); waiting for ", full,
                                 " free ", kind, " workers (", free_workers, " free)")};
  }
  return {.data = fit};
}

std::string ReplicaShape(int data, int microbatches) {
  return absl::StrCat(data, data == 1 ? " replica" : " replicas", " (m ", microbatches, ")");
}

}  // namespace vp::server
