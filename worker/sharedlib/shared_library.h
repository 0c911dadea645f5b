// A shared library opened at run time (dlopen) rather than at process start (DT_NEEDED).
//
// Why: the CUDA vendor libraries are costly to merely load. cuBLASLt makes a process about
// 150 MiB resident the moment the dynamic linker maps and relocates it, before any GPU work; a
// CUDA-enabled build that linked it would charge every CPU rank, CLI call and daemon that
// much. The CUDA backend therefore opens cuBLASLt and NCCL on first use (cublaslt_library.h,
// nccl_library.h), and a CPU job never maps them.
//
//   auto lib = SharedLibrary::Open("cuBLASLt", {"libcublasLt.so.13"});
//   auto create = lib->Function<decltype(cublasLtCreate)>("cublasLtCreate");
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace vp::sharedlib {

class SharedLibrary {
 public:
  // Tries each name in turn (a soname, which the loader searches for on LD_LIBRARY_PATH, the
  // cache and the default folders; or a path). NotFound lists every name with its loader error.
  // The library is never closed: vendor libraries register exit handlers and keep threads, so
  // it stays loaded to the end of the process (a SharedLibrary is a cheap copyable handle).
  // deep_bind: the library resolves its own symbols before the process's (RTLD_DEEPBIND), for
  // a plugin that carries its own copy of a library the process also has (the SentencePiece
  // plugin's protobuf).
  static absl::StatusOr<SharedLibrary> Open(std::string_view what,
                                            const std::vector<std::string>& names,
                                            bool deep_bind = false);

  // The address of `symbol` typed as F* (F a function type); NotFound naming the library and
  // the symbol when it does not export it (an older version than the one built against).
  template <typename F>
  absl::StatusOr<F*> Function(const char* symbol) const {
    absl::StatusOr<void*> address = Address(symbol);
    if (!address.ok()) return address.status();
    return reinterpret_cast<F*>(*address);
  }

  // *out = the address of `symbol` (Function<F>), or NotFound as Function says.
  template <typename F>
  absl::Status Bind(const char* symbol, F** out) const {
    absl::StatusOr<F*> f = Function<F>(symbol);
    if (!f.ok()) return f.status();
    *out = *f;
    return absl::OkStatus();
  }

  const std::string& name() const { return name_; }  // the name that opened it

 private:
  SharedLibrary(std::string what, std::string name, void* handle)
      : what_(std::move(what)), name_(std::move(name)), handle_(handle) {}
  absl::StatusOr<void*> Address(const char* symbol) const;

  std::string what_;
  std::string name_;
  void* handle_ = nullptr;
};

// A table of a vendor library's functions, kept under their own names, from an X-macro list:
//   #define VP_ZLIB_FUNCTIONS(X) X(zlibVersion) X(crc32)
//   struct Zlib { VP_ZLIB_FUNCTIONS(VP_SHAREDLIB_FUNCTION) };   // Zlib::crc32 has crc32's type
// and, in the loader, `VP_ZLIB_FUNCTIONS(VP_SHAREDLIB_BIND)` with `lib` (a SharedLibrary) and
// `table` (the struct) in scope: each function bound, the first missing one returned.
#define VP_SHAREDLIB_FUNCTION(name) decltype(&::name) name = nullptr;
#define VP_SHAREDLIB_BIND(name) \
  if (absl::Status st = lib.Bind(#name, &table.name); !st.ok()) return st;

// Whether this process has a file whose name starts with `file_prefix` mapped (/proc/self/maps):
// how tests prove that a CPU path never loads a vendor library.
bool IsMapped(std::string_view file_prefix);

}  // namespace vp::sharedlib
