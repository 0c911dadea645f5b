#include "worker/launch/preemption.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gloo/rendezvous/file_store.h"
#include "gloo/rendezvous/store.h"

namespace vp::launch {

PreemptionAgreement::PreemptionAgreement(gloo::rendezvous::Store& store, std::string prefix,
                                         int rank, int world, const std::atomic<bool>* signalled,
                                         absl::Duration poll)
    : store_(store),
      prefix_(std::move(prefix)),
      rank_(rank),
      world_(world),
      signalled_(signalled),
      poll_(poll) {}

namespace {

// FileStore::check is protected, and FileStore::wait measures its timeout in whole seconds (a
// 1 ms wait for an absent key takes a second): a derived class reaches check directly.
struct FileStoreCheck : gloo::rendezvous::FileStore {
  static bool Present(gloo::rendezvous::FileStore& store, const std::vector<std::string>& keys) {
    return (store.*(&FileStoreCheck::check))(keys);
  }
};

}  // namespace

// Gloo's Store has no "exists": the FileStore's check, else a wait with a 1 ms bound (one
// call to the coordinator's StoreService for a GrpcStore; a timeout throws).
bool PreemptionAgreement::Present(const std::vector<std::string>& keys) {
  if (auto* file = dynamic_cast<gloo::rendezvous::FileStore*>(&store_)) {
    return FileStoreCheck::Present(*file, keys);
  }
  try {
    store_.wait(keys, std::chrono::milliseconds(1));
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

absl::StatusOr<bool> PreemptionAgreement::StopAfter(int64_t done) {
  try {
    if (!acked_) {
      bool requested = false;
      if (signalled_ != nullptr && signalled_->load()) {
        store_.set(prefix_ + "request", {'1'});
        requested = true;
      } else if (absl::Now() >= next_poll_) {
        next_poll_ = absl::Now() + poll_;
        requested = Present({prefix_ + "request"});
      }
      if (!requested) return false;
      const std::string d = absl::StrCat(done);
      store_.set(absl::StrCat(prefix_, "ack/", rank_), std::vector<char>(d.begin(), d.end()));
      acked_ = true;
    }
    if (stop_ < 0) {
      std::vector<std::string> keys;
      for (int r = 0; r < world_; ++r) keys.push_back(absl::StrCat(prefix_, "ack/", r));
      if (!Present(keys)) return false;
      int64_t latest = 0;
      for (const std::string& k : keys) {
        const std::vector<char> v = store_.get(k);
        int64_t d = 0;
        if (!absl::SimpleAtoi(std::string(v.begin(), v.end()), &d)) {
          return absl::DataLossError(absl::StrCat("preemption: store key ", k, " is not a step"));
        }
        latest = std::max(latest, d);
      }
      stop_ = latest + 1;
    }
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("preemption: rendezvous store: ", e.what()));
  }
  if (done > stop_) {
    return absl::InternalError(absl::StrCat("preemption: the ranks agreed to stop after step ",
                                            stop_, " but this rank has done ", done));
  }
  return done == stop_;
}

}  // namespace vp::launch
