#include "worker/sharedlib/shared_library.h"

#include <dlfcn.h>

#include <fstream>
#include <utility>

#include "absl/strings/str_cat.h"

namespace vp::sharedlib {

absl::StatusOr<SharedLibrary> SharedLibrary::Open(std::string_view what,
                                                  const std::vector<std::string>& names,
                                                  bool deep_bind) {
  std::string tried;
  bool searched = false;  // a soname was tried, which the loader looks for on its paths
  for (const std::string& name : names) {
    if (name.empty()) continue;
    searched = searched || name.find('/') == std::string::npos;
    // RTLD_LOCAL: the library's symbols serve only the lookups made through this handle.
    void* handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL | (deep_bind ? RTLD_DEEPBIND : 0));
    if (handle != nullptr) return SharedLibrary(std::string(what), name, handle);
    const char* why = dlerror();
    absl::StrAppend(&tried, tried.empty() ? "" : "; ", name, ": ", why ? why : "unknown error");
  }
  return absl::NotFoundError(absl::StrCat(std::string(what), " could not be loaded (",
                                          tried.empty() ? "no names to try" : tried, ")",
                                          searched ? "; put its folder on LD_LIBRARY_PATH" : ""));
}

absl::StatusOr<void*> SharedLibrary::Address(const char* symbol) const {
  dlerror();  // clear a stale error: a symbol's address may legitimately be null
  void* address = dlsym(handle_, symbol);
  if (address == nullptr) {
    return absl::NotFoundError(absl::StrCat(what_, " (", name_, ") does not export ", symbol,
                                            ": an older version than this build needs"));
  }
  return address;
}

bool IsMapped(std::string_view file_prefix) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    // The path is the last field; its file name follows the last '/'.
    const size_t slash = line.rfind('/');
    if (slash == std::string::npos) continue;
    if (std::string_view(line).substr(slash + 1).starts_with(file_prefix)) return true;
  }
  return false;
}

}  // namespace vp::sharedlib
