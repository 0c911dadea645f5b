#pragma once

#include <string_view>

namespace vp::cli {

// The vocabpipe release this binary belongs to.
std::string_view Version();

}  // namespace vp::cli
