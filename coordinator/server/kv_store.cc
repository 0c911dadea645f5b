#include "coordinator/server/kv_store.h"

#include <chrono>

#include "absl/strings/str_cat.h"

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
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (kv_.size() >= kMaxKeys && !kv_.count(key)) {
      return absl::ResourceExhaustedError(absl::StrCat("store holds ", kMaxKeys, " keys"));
    }
    kv_[key] = std::move(value);
  }
  cv_.notify_all();
  return absl::OkStatus();
}

absl::StatusOr<std::string> KvStore::Get(const std::string& key, absl::Time deadline) {
  if (auto st = ValidateKey(key, "key"); !st.ok()) return st;
  std::unique_lock<std::mutex> lock(mu_);
  const auto until = absl::ToChronoTime(deadline);
  for (;;) {
    if (auto it = kv_.find(key); it != kv_.end()) return it->second;
    if (cv_.wait_until(lock, until) == std::cv_status::timeout && !kv_.count(key)) {
      return absl::NotFoundError(absl::StrCat("key ", key, ": not set before the timeout"));
    }
  }
}

absl::Status KvStore::Wait(const std::vector<std::string>& keys, absl::Time deadline) {
  for (size_t i = 0; i < keys.size(); ++i) {
    if (auto st = ValidateKey(keys[i], absl::StrCat("keys[", i, "]")); !st.ok()) return st;
  }
  std::unique_lock<std::mutex> lock(mu_);
  const auto until = absl::ToChronoTime(deadline);
  for (;;) {
    const std::string* missing = nullptr;
    for (const std::string& k : keys) {
      if (!kv_.count(k)) {
        missing = &k;
        break;
      }
    }
    if (missing == nullptr) return absl::OkStatus();
    if (cv_.wait_until(lock, until) == std::cv_status::timeout) {
      for (const std::string& k : keys) {
        if (!kv_.count(k)) {
          return absl::NotFoundError(absl::StrCat("key ", k, ": not set before the timeout"));
        }
      }
      return absl::OkStatus();
    }
  }
}

void KvStore::DropPrefix(const std::string& prefix) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = kv_.lower_bound(prefix); it != kv_.end() && it->first.rfind(prefix, 0) == 0;) {
    it = kv_.erase(it);
  }
}

size_t KvStore::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return kv_.size();
}

}  // namespace vp::server
