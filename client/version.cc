#include "client/version.h"

namespace vp::cli {

std::string_view Version() { return "0.1.0"; }

}  // namespace vp::cli
