// Test helpers: a plain-socket HTTP/1.0 GET on 127.0.0.1, a free-port finder and a parser of
// the Prometheus text exposition format.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace vp::metrics::testing {

struct HttpResponse {
  int status = 0;
  std::string body;
};

// GET http://127.0.0.1:<port><path>; every socket operation times out after 5 s.
absl::StatusOr<HttpResponse> HttpGet(int port, const std::string& path);

// A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, then closed).
int FreePort();

struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

// The samples of a text exposition (comment lines skipped).
std::vector<Sample> ParseExposition(const std::string& text);

// The value of the sample with exactly this name and label set.
std::optional<double> Find(const std::vector<Sample>& samples, const std::string& name,
                           const std::map<std::string, std::string>& labels);

}  // namespace vp::metrics::testing
