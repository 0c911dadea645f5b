// Which IP a worker daemon advertises to the coordinator, and so which IP its ranks' Gloo
// transport binds to and peers connect to.
//
//   --address auto (the default): the source address of this host's route to the coordinator
//       (a UDP socket connect()ed to it, no packet sent); on a pod or node that reaches the
//       coordinator over its network interface this is the IP its peers can reach. A
//       coordinator on a unix socket ("unix:PATH") is on this host: 127.0.0.1.
//   $POD_IP (when set and --address was not given): the pod IP Kubernetes hands a container.
//   --address IP: that IP.
// The IP must be an address of this host (a socket can bind to it) and numeric: Gloo binds to it.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace vp::daemon {

// flag: the --address value ("auto" or an IP; empty = not given); pod_ip: $POD_IP (may be
// empty); coordinator: HOST:PORT. Errors name the flag or variable and the rule.
absl::StatusOr<std::string> ChooseAddress(const std::string& flag, const std::string& pod_ip,
                                          const std::string& coordinator);

// The address of the host's route to HOST:PORT (UDP connect + getsockname).
absl::StatusOr<std::string> RouteSourceAddress(const std::string& host_port);

// The network interface that holds ip (for NCCL_SOCKET_IFNAME); empty when none does.
std::string InterfaceOf(const std::string& ip);

// A numeric 127.0.0.0/8 or ::1, or "localhost" (auth::IsLoopbackHost: never by a name's prefix).
bool IsLoopback(const std::string& address);

}  // namespace vp::daemon
