// The rendezvous key-value store StoreService serves: set, get and wait with a timeout. Keys
// are namespaced by the job's attempt. The ranks' keys ("vocabpipe/...") can be made durable
// (SetPersist: the coordinator writes them to its job store before they are visible), so a
// restarted coordinator that re-adopts a running launch serves its keys again (Restore).
// Thread-safe.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace vp::server {

class KvStore {
 public:
  // Limits on what one request may store (a Gloo address is ~100 bytes, an NCCL id 128).
  static constexpr size_t kMaxKeyBytes = 1024;
  static constexpr size_t kMaxValueBytes = 1 << 20;
  static constexpr size_t kMaxKeys = 1 << 20;
  // Per run (RunOf): a Gloo or NCCL rendezvous of p ranks sets a few keys per rank.
  static constexpr size_t kMaxKeysPerRun = 4096;
  static constexpr size_t kMaxBytesPerRun = 16 << 20;  // keys + values

  absl::Status Set(const std::string& key, std::string value);
  // Waits until `key` exists or the deadline passes (NotFound then).
  absl::StatusOr<std::string> Get(const std::string& key, absl::Time deadline);
  // Waits until every key exists (NotFound naming a missing one at the deadline).
  absl::Status Wait(const std::vector<std::string>& keys, absl::Time deadline);
  // Drops every key starting with prefix (a finished launch's rendezvous), and the run secret
  // registered for exactly that prefix.
  void DropPrefix(const std::string& prefix);
  // The rendezvous secret of a run ("vocabpipe/ATTEMPT/", RunOf): from now on its keys are
  // readable and writable only with it.
  void SetRunSecret(const std::string& run, std::string secret);
  // PermissionDenied unless `key` is outside the ranks' namespace ("vocabpipe/...") or its run
  // has a secret equal to `secret` (compared in constant time). `field` names the key.
  // runs_only: keys outside the ranks' namespace are refused too (a secure coordinator: the
  // store serves running jobs' ranks only).
  absl::Status CheckRunSecret(const std::string& key, const std::string& secret,
                              const std::string& field, bool runs_only = false) const;
  size_t size() const;
  // Called with every ranks' key (its run in the "vocabpipe/" namespace) before Set stores it,
  // outside the store's lock, and only once the key and byte limits have admitted the write
  // (a refused write is never persisted); an error fails the Set and stores nothing.
  void SetPersist(
      std::function<absl::Status(const std::string& key, const std::string& value)> persist);
  // A key read back from durable storage (not persisted again; limits still counted).
  void Restore(const std::string& key, std::string value);

  // The run a key belongs to: "vocabpipe/ATTEMPT/" for the ranks' rendezvous keys of one
  // launch, else everything up to and including the key's first '/' ("" without one). Each
  // run may hold at most kMaxKeysPerRun keys and kMaxBytesPerRun bytes (ResourceExhausted).
  static std::string RunOf(const std::string& key);

  // Waiters woken so far: a write wakes only the calls waiting for its key (never every
  // waiter of the store, which at N ranks connecting would be N wake-ups a write).
  uint64_t wakeups() const;
  // Get and Wait calls waiting now.
  size_t waiting() const;

 private:
  // Wakes the Get and Wait calls waiting for `key`.
  void Wake(const std::string& key);
  // Sleeps (releasing `lock`) until `key` is written or the deadline passes; false at the
  // deadline. Requires mu_ held through `lock`.
  bool WaitForKey(std::unique_lock<std::mutex>& lock, const std::string& key, absl::Time deadline);

  struct Usage {
    size_t keys = 0, bytes = 0;
    // Reserved by writes being persisted (Set): counted against the limits until they land.
    size_t pending_keys = 0, pending_bytes = 0;
  };
  void Forget(const std::string& key, const std::string& value);  // requires mu_

  mutable std::mutex mu_;
  // The calls waiting for each key, each on a condition variable of its own.
  std::multimap<std::string, std::condition_variable*> waiting_;
  uint64_t wakeups_ = 0;
  std::map<std::string, std::string> kv_;
  std::map<std::string, Usage> usage_;          // per run
  size_t pending_keys_ = 0;                     // new keys reserved by writes being persisted
  std::map<std::string, std::string> secrets_;  // per run
  std::function<absl::Status(const std::string&, const std::string&)> persist_;
};

// Checks a key: non-empty, at most kMaxKeyBytes. InvalidArgument naming `field`.
absl::Status ValidateKey(const std::string& key, const std::string& field);

}  // namespace vp::server
