#include "worker/daemon/address.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "proto/grpc/auth.h"

namespace vp::daemon {
namespace {

// A socket fd closed on scope exit.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

std::string Numeric(const sockaddr* sa, socklen_t len) {
  char host[NI_MAXHOST] = {0};
  if (getnameinfo(sa, len, host, sizeof(host), nullptr, 0, NI_NUMERICHOST) != 0) return "";
  return host;
}

// Binds a TCP socket to ip:0: the IP is this host's.
absl::Status CanBind(const std::string& what, const std::string& ip) {
  sockaddr_storage ss{};
  socklen_t len = 0;
  auto* v4 = reinterpret_cast<sockaddr_in*>(&ss);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&ss);
  if (inet_pton(AF_INET, ip.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    len = sizeof(sockaddr_in);
  } else if (inet_pton(AF_INET6, ip.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    len = sizeof(sockaddr_in6);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": \"", ip, "\" is not a numeric IP address (or auto)"));
  }
  Fd fd(socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) return absl::InternalError(absl::StrCat(what, ": socket: ", strerror(errno)));
  if (bind(fd.get(), reinterpret_cast<sockaddr*>(&ss), len) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": ", ip, " is not an address of this host (bind: ", strerror(errno), ")"));
  }
  return absl::OkStatus();
}

}  // namespace

bool IsLoopback(const std::string& address) { return auth::IsLoopbackHost(address); }

absl::StatusOr<std::string> RouteSourceAddress(const std::string& host_port) {
  const size_t colon = host_port.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == host_port.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--coordinator: \"", host_port, "\" is not HOST:PORT"));
  }
  std::string host = host_port.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  const std::string port = host_port.substr(colon + 1);
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    return absl::UnavailableError(absl::StrCat("--address auto: cannot resolve the coordinator ",
                                               host, ": ", gai_strerror(rc)));
  }
  std::string why = "no address";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    Fd fd(socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
    if (fd.get() < 0) continue;
    // connect() on a UDP socket sends nothing: it only picks the route and source address.
    if (connect(fd.get(), a->ai_addr, a->ai_addrlen) != 0) {
      why = strerror(errno);
      continue;
    }
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    if (getsockname(fd.get(), reinterpret_cast<sockaddr*>(&local), &len) != 0) continue;
    std::string ip = Numeric(reinterpret_cast<sockaddr*>(&local), len);
    if (!ip.empty()) {
      freeaddrinfo(found);
      return ip;
    }
  }
  freeaddrinfo(found);
  return absl::UnavailableError(
      absl::StrCat("--address auto: no route to the coordinator ", host_port, " (", why, ")"));
}

absl::StatusOr<std::string> ChooseAddress(const std::string& flag, const std::string& pod_ip,
                                          const std::string& coordinator) {
  if (!flag.empty() && flag != "auto") {
    if (auto st = CanBind("--address", flag); !st.ok()) return st;
    return flag;
  }
  if (flag.empty() && !pod_ip.empty()) {
    if (auto st = CanBind("$POD_IP", pod_ip); !st.ok()) return st;
    return pod_ip;
  }
  // A coordinator on a unix socket is on this host, and so is every rank it can reach.
  if (coordinator.rfind("unix:", 0) == 0) return std::string("127.0.0.1");
  auto ip = RouteSourceAddress(coordinator);
  if (!ip.ok()) return ip.status();
  if (auto st = CanBind("--address auto", *ip); !st.ok()) return st;
  return ip;
}

std::string InterfaceOf(const std::string& ip) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return "";
  std::string name;
  for (ifaddrs* i = list; i != nullptr && name.empty(); i = i->ifa_next) {
    if (i->ifa_addr == nullptr) continue;
    const int family = i->ifa_addr->sa_family;
    if (family != AF_INET && family != AF_INET6) continue;
    const socklen_t len = family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    if (Numeric(i->ifa_addr, len) == ip) name = i->ifa_name;
  }
  freeifaddrs(list);
  return name;
}

}  // namespace vp::daemon
