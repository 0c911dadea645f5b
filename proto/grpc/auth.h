// Transport security and identities of the control plane (docs/operations.md, "Security"):
// gRPC SSL credentials from the --tls-cert/--tls-key/--tls-ca flags, the loopback rule of
// --insecure, bearer tokens (a tokens file of SHA-256 hashes -> user and role) and the
// per-run rendezvous secret. The crypto is OpenSSL's (SHA-256, RAND_bytes, CRYPTO_memcmp).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace grpc {
class ChannelCredentials;
class ServerCredentials;
}  // namespace grpc

namespace vp::auth {

// Worker certificates carry this organizational unit in their subject (vocabpipe certs init):
// only their holders may use WorkerService's worker calls and StoreService.
inline constexpr char kWorkerUnit[] = "worker";
// Call metadata of the rendezvous secret of a run (RunTask.store_secret), sent by a rank's
// GrpcStore with every store call.
inline constexpr char kRunSecretMetadata[] = "x-vocabpipe-run-secret";
// The rank process reads its run's secret from this variable (never from its command line,
// which every user of the host can read).
inline constexpr char kRunSecretEnv[] = "VOCABPIPE_STORE_SECRET";

// PEM files of one end of a channel. A server needs cert + key + ca (ca verifies client
// certificates); a worker needs all three; the CLI needs ca only.
struct TlsFiles {
  std::string cert, key, ca;
  bool any() const { return !cert.empty() || !key.empty() || !ca.empty(); }
};
// The command-line flags of TlsFiles: SetTlsFlag stores `value` as the file of `flag` when it is
// --tls-ca, --tls-cert or --tls-key (false for any other flag, nothing stored); TlsFlags gives
// the three flags and their files for a child process's command line.
bool SetTlsFlag(const std::string& flag, const std::string& value, TlsFiles& files);
std::vector<std::string> TlsFlags(const TlsFiles& files);

// A host that is this machine by its form alone: the name "localhost", or a numeric IPv4
// address in 127.0.0.0/8 or the IPv6 address ::1 (also as ::ffff:127.x.y.z), parsed with
// inet_pton. A name is never judged by its spelling ("127.evil.example" is not loopback: it
// resolves wherever its DNS or /etc/hosts says).
bool IsLoopbackHost(const std::string& host);
// "HOST:PORT" (or "[V6]:PORT") whose host is IsLoopbackHost, or a gRPC "unix:PATH" address (a
// socket file on this machine, guarded by the permissions of its folder).
bool IsLoopbackAddress(const std::string& address);
// The rule of --insecure: no TLS flags with it, and only on a loopback address.
// `what` names the address's flag ("--listen", "--coordinator").
absl::Status CheckInsecure(const TlsFiles& files, const std::string& address,
                           const std::string& what);

// Client credentials: TLS verifying the server against files.ca, presenting files.cert/key
// when given (workers), with `bearer_token` as "authorization: Bearer ..." metadata when not
// empty (the CLI). InvalidArgument naming the flag when a file is missing or unreadable.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ClientCredentials(
    const TlsFiles& files, const std::string& bearer_token = "");
// Server credentials: files.cert/key, client certificates requested and verified against
// files.ca (a client without one may still connect: the CLI, which carries a token).
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(const TlsFiles& files);

// Whether a (verified) PEM certificate's subject has an organizational unit equal to
// kWorkerUnit, read with OpenSSL's X509 API (not by parsing the subject's text form, where an
// escaped ',' in another field could pass for one).
bool IsWorkerCertificate(std::string_view pem);

// A worker certificate's identity: its subject's common name (the worker's name, `vocabpipe
// certs worker NAME`), its serial number and the SHA-256 of its DER encoding, both lower-case
// hex without separators (what a revocation list names).
struct WorkerCertificate {
  std::string name, serial, fingerprint;
};
// nullopt when the PEM does not parse or is not a worker certificate (IsWorkerCertificate).
std::optional<WorkerCertificate> ParseWorkerCertificate(std::string_view pem);

// The coordinator's --revoked file: one revoked worker certificate per line, by serial number
// or SHA-256 fingerprint (hex; ':' separators and upper case are accepted); '#' starts a
// comment. InvalidArgument naming the line for anything else.
class RevocationList {
 public:
  static absl::StatusOr<RevocationList> Load(const std::string& path);
  bool Revoked(const WorkerCertificate& cert) const;
  size_t size() const { return entries_.size(); }

 private:
  std::vector<std::string> entries_;
};

// Hex SHA-256 of `data` (OpenSSL EVP).
std::string Sha256Hex(std::string_view data);
// `bytes` random bytes from OpenSSL's CSPRNG, hex encoded.
absl::StatusOr<std::string> RandomHex(int bytes);
// Constant-time equality (CRYPTO_memcmp) of two strings of the same length; false otherwise.
bool SecretEquals(std::string_view a, std::string_view b);

struct User {
  std::string name;
  bool admin = false;
  absl::Time expires = absl::InfiniteFuture();  // the token's, when it has an expiry
};

// The tokens file: one line per token, "USER ROLE SHA256HEX [EXPIRES]" (role user|admin;
// EXPIRES an RFC 3339 time such as 2027-01-31T00:00:00Z, after which the token is refused);
// '#' starts a comment. Only hashes are stored: the file does not let its reader call the
// coordinator. A file without a single token is refused (InvalidArgument): it would lock
// everyone out.
class TokenTable {
 public:
  static absl::StatusOr<TokenTable> Load(const std::string& path);
  // The token's user: its hash compared with every entry in constant time.
  std::optional<User> Find(std::string_view token) const;
  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    User user;
    std::string hash;
  };
  std::vector<Entry> entries_;
};

// Makes a random token for `user` with `role`, appends its hash (and `expires` unless infinite)
// to the tokens file (created 0600) and returns the token. InvalidArgument naming the argument
// for a bad user or role, or an expiry that is not in the future.
absl::StatusOr<std::string> AddToken(const std::string& path, const std::string& user,
                                     const std::string& role,
                                     absl::Time expires = absl::InfiniteFuture());

// The RFC 3339 form of a time in UTC, to the second ("2027-01-31T00:00:00Z").
std::string FormatExpiry(absl::Time t);

}  // namespace vp::auth
