#include "tests/integration/metrics/http.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace vp::metrics::testing {
namespace {

// Closes the socket on every return path.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) close(fd);
  }
};

sockaddr_in Loopback(int port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return addr;
}

}  // namespace

absl::StatusOr<HttpResponse> HttpGet(int port, const std::string& path) {
  Fd s{socket(AF_INET, SOCK_STREAM, 0)};
  if (s.fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  timeval tv{.tv_sec = 5, .tv_usec = 0};
  setsockopt(s.fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(s.fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  sockaddr_in addr = Loopback(port);
  if (connect(s.fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return absl::UnavailableError(
        absl::StrCat("connect 127.0.0.1:", port, ": ", std::strerror(errno)));
  }
  // HTTP/1.0: the server closes the connection after the body and sends no chunked encoding.
  const std::string request =
      absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1:", port, "\r\n\r\n");
  for (size_t sent = 0; sent < request.size();) {
    const ssize_t n = send(s.fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return absl::UnavailableError(absl::StrCat("send: ", std::strerror(errno)));
    sent += static_cast<size_t>(n);
  }
  std::string raw;
  char buf[8192];
  while (true) {
    const ssize_t n = recv(s.fd, buf, sizeof(buf), 0);
    if (n == 0) break;
    if (n < 0) return absl::UnavailableError(absl::StrCat("recv: ", std::strerror(errno)));
    raw.append(buf, static_cast<size_t>(n));
  }
  const size_t header_end = raw.find("\r\n\r\n");
  if (header_end == std::string::npos || raw.compare(0, 5, "HTTP/") != 0) {
    return absl::DataLossError(absl::StrCat("malformed HTTP response: ", raw.substr(0, 200)));
  }
  HttpResponse r;
  r.status = std::atoi(raw.c_str() + raw.find(' ') + 1);
  r.body = raw.substr(header_end + 4);
  return r;
}

int FreePort() {
  Fd s{socket(AF_INET, SOCK_STREAM, 0)};
  sockaddr_in addr = Loopback(0);
  if (s.fd < 0 || bind(s.fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) return 0;
  socklen_t len = sizeof(addr);
  if (getsockname(s.fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return 0;
  return ntohs(addr.sin_port);
}

std::vector<Sample> ParseExposition(const std::string& text) {
  std::vector<Sample> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    Sample s;
    size_t pos = line.find_first_of("{ ");
    s.name = line.substr(0, pos);
    if (pos != std::string::npos && line[pos] == '{') {
      ++pos;
      // name="value" pairs; values escape only \\, \" and \n.
      while (pos < line.size() && line[pos] != '}') {
        const size_t eq = line.find('=', pos);
        const std::string key = line.substr(pos, eq - pos);
        std::string value;
        size_t i = eq + 2;  // past ="
        for (; i < line.size() && line[i] != '"'; ++i) {
          if (line[i] == '\\' && i + 1 < line.size()) {
            ++i;
            value += line[i] == 'n' ? '\n' : line[i];
          } else {
            value += line[i];
          }
        }
        s.labels[key] = value;
        pos = i + 1;
        if (pos < line.size() && line[pos] == ',') ++pos;
      }
      ++pos;  // past }
    }
    s.value = std::strtod(line.c_str() + pos, nullptr);
    out.push_back(std::move(s));
  }
  return out;
}

std::optional<double> Find(const std::vector<Sample>& samples, const std::string& name,
                           const std::map<std::string, std::string>& labels) {
  for (const Sample& s : samples) {
    if (s.name == name && s.labels == labels) return s.value;
  }
  return std::nullopt;
}

}  // namespace vp::metrics::testing
