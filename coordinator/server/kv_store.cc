#include "coordinator/server/kv_store.h"

#include <chrono>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "proto/grpc/auth.h"

namespace vp::server {

absl::Status ValidateKey(const std::string& key, const std::string& field) {
  if (key.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": must not be empty"));
  if (key.size() > KvStore::kMaxKeyBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": longer than ", KvStore::kMaxKeyBytes, " bytes"));
  }
  return absl::OkStatus();
}

absl::Status KvStore::Set(const std::string& key, std::string value) {
  if (auto st = ValidateKey(key, "key"); !st.ok()) return st;
  if (value.size() > kMaxValueBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("value: longer than ", kMaxValueBytes, " bytes"));
  }
  const std::string run = RunOf(key);
  // The limits are checked, and the write's share reserved, before it is persisted: a refused
  // write must not reach the durable store (a full run's writes would otherwise go on growing
  // the database). The reservation counts the key as new and its whole value, so concurrent
  // writes cannot together pass a limit that each passed alone.
  const size_t reserved_bytes = key.size() + value.size();
  std::function<absl::Status(const std::string&, const std::string&)> persist;
  bool reserved_key = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = kv_.find(key);
    reserved_key = it == kv_.end();
    if (reserved_key && kv_.size() + pending_keys_ >= kMaxKeys) {
      return absl::ResourceExhaustedError(absl::StrCat("store holds ", kMaxKeys, " keys"));
    }
    Usage& u = usage_[run];
    const size_t old_bytes = it == kv_.end() ? 0 : key.size() + it->second.size();
    const size_t keys = u.keys + u.pending_keys + (reserved_key ? 1 : 0);
    const size_t bytes = u.bytes + u.pending_bytes - old_bytes + reserved_bytes;
    if (keys > kMaxKeysPerRun || bytes > kMaxBytesPerRun) {
      if (u.keys == 0 && u.pending_keys == 0 && u.pending_bytes == 0) usage_.erase(run);
      return absl::ResourceExhaustedError(
          absl::StrCat("key: run \"", run, "\" would hold ", keys, " keys of ", bytes,
                       " bytes; the limit per run is ", kMaxKeysPerRun, " keys and ",
                       kMaxBytesPerRun, " bytes"));
    }
    u.pending_keys += reserved_key ? 1 : 0;
    u.pending_bytes += reserved_bytes;
    pending_keys_ += reserved_key ? 1 : 0;
    if (key.rfind("vocabpipe/", 0) == 0) persist = persist_;
  }
  absl::Status persisted = persist ? persist(key, value) : absl::OkStatus();
  {
    std::lock_guard<std::mutex> lock(mu_);
    Usage& u = usage_[run];
    u.pending_keys -= reserved_key ? 1 : 0;
    u.pending_bytes -= reserved_bytes;
    pending_keys_ -= reserved_key ? 1 : 0;
    if (persisted.ok()) {
      // What the key really adds now (another write may have set or replaced it meanwhile).
      auto it = kv_.find(key);
      if (it == kv_.end()) {
        u.keys += 1;
        u.bytes += reserved_bytes;
        kv_.emplace(key, std::move(value));
      } else {
        u.bytes = u.bytes - it->second.size() + value.size();
        it->second = std::move(value);
      }
    }
    if (u.keys == 0 && u.pending_keys == 0 && u.pending_bytes == 0) usage_.erase(run);
  }
  if (!persisted.ok()) return persisted;
  Wake(key);
  return absl::OkStatus();
}

void KvStore::Wake(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto [it, end] = waiting_.equal_range(key); it != end; ++it) {
    ++wakeups_;
    it->second->notify_one();
  }
}

bool KvStore::WaitForKey(std::unique_lock<std::mutex>& lock, const std::string& key,
                         absl::Time deadline) {
  std::condition_variable cv;
  const auto entry = waiting_.emplace(key, &cv);
  const bool woken =
      cv.wait_until(lock, absl::ToChronoTime(deadline)) == std::cv_status::no_timeout;
  waiting_.erase(entry);
  return woken;
}

size_t KvStore::waiting() const {
  std::lock_guard<std::mutex> lock(mu_);
  return waiting_.size();
}

uint64_t KvStore::wakeups() const {
  std::lock_guard<std::mutex> lock(mu_);
  return wakeups_;
}

absl::StatusOr<std::string> KvStore::Get(const std::string& key, absl::Time deadline) {
  if (auto st = ValidateKey(key, "key"); !st.ok()) return st;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (auto it = kv_.find(key); it != kv_.end()) return it->second;
    if (!WaitForKey(lock, key, deadline) && !kv_.count(key)) {
      return absl::NotFoundError(absl::StrCat("key ", key, ": not set before the timeout"));
    }
  }
}

absl::Status KvStore::Wait(const std::vector<std::string>& keys, absl::Time deadline) {
  for (size_t i = 0; i < keys.size(); ++i) {
    if (auto st = ValidateKey(keys[i], absl::StrCat("keys[", i, "]")); !st.ok()) return st;
  }
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    const std::string* missing = nullptr;
    for (const std::string& k : keys) {
      if (!kv_.count(k)) {
        missing = &k;
        break;
      }
    }
    if (missing == nullptr) return absl::OkStatus();
    // Woken by the first missing key only: the others are checked when it has come.
    if (!WaitForKey(lock, *missing, deadline)) {
      for (const std::string& k : keys) {
        if (!kv_.count(k)) {
          return absl::NotFoundError(absl::StrCat("key ", k, ": not set before the timeout"));
        }
      }
      return absl::OkStatus();
    }
  }
}

std::string KvStore::RunOf(const std::string& key) {
  constexpr std::string_view kRanks = "vocabpipe/";
  size_t from = 0;
  if (key.rfind(kRanks, 0) == 0) from = kRanks.size();
  const size_t slash = key.find('/', from);
  return slash == std::string::npos ? std::string(key.substr(0, from)) : key.substr(0, slash + 1);
}

void KvStore::Forget(const std::string& key, const std::string& value) {
  auto u = usage_.find(RunOf(key));
  if (u == usage_.end()) return;
  u->second.keys -= 1;
  u->second.bytes -= key.size() + value.size();
  if (u->second.keys == 0 && u->second.pending_keys == 0 && u->second.pending_bytes == 0) {
    usage_.erase(u);
  }
}

void KvStore::DropPrefix(const std::string& prefix) {
  std::lock_guard<std::mutex> lock(mu_);
  secrets_.erase(prefix);
  for (auto it = kv_.lower_bound(prefix); it != kv_.end() && it->first.rfind(prefix, 0) == 0;) {
    Forget(it->first, it->second);
    it = kv_.erase(it);
  }
}

void KvStore::SetRunSecret(const std::string& run, std::string secret) {
  std::lock_guard<std::mutex> lock(mu_);
  secrets_[run] = std::move(secret);
}

absl::Status KvStore::CheckRunSecret(const std::string& key, const std::string& secret,
                                     const std::string& field, bool runs_only) const {
  if (key.rfind("vocabpipe/", 0) != 0) {
    if (!runs_only) return absl::OkStatus();
    return absl::PermissionDeniedError(
        absl::StrCat(field,
                     ": outside every run's namespace (vocabpipe/ATTEMPT/...); this "
                     "store holds the rendezvous keys of running jobs' ranks only"));
  }
  const std::string run = RunOf(key);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = secrets_.find(run);
  if (it == secrets_.end()) {
    return absl::PermissionDeniedError(absl::StrCat(
        field, ": run \"", run, "\" is not an active run; its keys are for its ranks only"));
  }
  if (secret.empty()) {
    return absl::PermissionDeniedError(
        absl::StrCat(field, ": run \"", run, "\" needs its rendezvous secret (metadata ",
                     auth::kRunSecretMetadata, ", given to its ranks with the task)"));
  }
  if (!auth::SecretEquals(secret, it->second)) {
    return absl::PermissionDeniedError(absl::StrCat(field, ": wrong rendezvous secret for run \"",
                                                    run, "\"; its keys are for its ranks only"));
  }
  return absl::OkStatus();
}

size_t KvStore::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return kv_.size();
}

void KvStore::SetPersist(
    std::function<absl::Status(const std::string& key, const std::string& value)> persist) {
  std::lock_guard<std::mutex> lock(mu_);
  persist_ = std::move(persist);
}

void KvStore::Restore(const std::string& key, std::string value) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = kv_.find(key); it != kv_.end()) Forget(key, it->second);
    Usage& u = usage_[RunOf(key)];
    u.keys += 1;
    u.bytes += key.size() + value.size();
    kv_[key] = std::move(value);
  }
  Wake(key);
}

}  // namespace vp::server
