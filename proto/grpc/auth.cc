#include "proto/grpc/auth.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <openssl/bio.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/objects.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "proto/safefs/run_owner.h"

namespace vp::auth {
namespace {

std::string Hex(const unsigned char* p, size_t n) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * n);
  for (size_t i = 0; i < n; ++i) {
    out.push_back(kDigits[p[i] >> 4]);
    out.push_back(kDigits[p[i] & 15]);
  }
  return out;
}

absl::StatusOr<std::string> ReadPem(const std::string& path, const std::string& flag) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read \"", path, "\""));
  std::ostringstream s;
  s << f.rdbuf();
  std::string text = s.str();
  // Never echo the file: only whether it looks like PEM.
  if (text.find("-----BEGIN ") == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": \"", path, "\" is not a PEM file (no -----BEGIN line)"));
  }
  return text;
}

// A token's user is the owner its runs record in their folders' OWNER files: one alphabet.
bool ValidUserName(const std::string& user) { return safefs::ValidOwnerName(user); }

}  // namespace

bool IsLoopbackHost(const std::string& host) {
  if (host == "localhost") return true;
  in_addr v4{};
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  if (inet_pton(AF_INET6, host.c_str(), &v6) == 1) {
    if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
    return IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127;
  }
  return false;
}

bool IsLoopbackAddress(const std::string& address) {
  // gRPC's unix-domain form; "unix-abstract:" names have no file, so no permissions guard them.
  if (address.rfind("unix:", 0) == 0) return address.size() > 5;
  const size_t colon = address.rfind(':');
  std::string host = colon == std::string::npos ? address : address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return IsLoopbackHost(host);
}

bool SetTlsFlag(const std::string& flag, const std::string& value, TlsFiles& files) {
  std::string* file = flag == "--tls-ca"     ? &files.ca
                      : flag == "--tls-cert" ? &files.cert
                      : flag == "--tls-key"  ? &files.key
                                             : nullptr;
  if (file == nullptr) return false;
  *file = value;
  return true;
}

std::vector<std::string> TlsFlags(const TlsFiles& files) {
  return {"--tls-ca", files.ca, "--tls-cert", files.cert, "--tls-key", files.key};
}

absl::Status CheckInsecure(const TlsFiles& files, const std::string& address,
                           const std::string& what) {
  if (files.any()) {
    return absl::InvalidArgumentError("--insecure: excludes --tls-cert, --tls-key and --tls-ca");
  }
  if (!IsLoopbackAddress(address)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--insecure: only on loopback, but ", what, " is \"", address,
                     "\" (use a numeric 127.x.y.z or ::1, localhost, or unix:PATH; or TLS: "
                     "--tls-cert/--tls-key/--tls-ca)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ClientCredentials(
    const TlsFiles& files, const std::string& bearer_token) {
  if (files.ca.empty()) return absl::InvalidArgumentError("--tls-ca: required for TLS");
  if (files.cert.empty() != files.key.empty()) {
    return absl::InvalidArgumentError("--tls-cert, --tls-key: give both or neither");
  }
  grpc::SslCredentialsOptions ssl;
  auto ca = ReadPem(files.ca, "--tls-ca");
  if (!ca.ok()) return ca.status();
  ssl.pem_root_certs = *ca;
  if (!files.cert.empty()) {
    auto cert = ReadPem(files.cert, "--tls-cert");
    if (!cert.ok()) return cert.status();
    auto key = ReadPem(files.key, "--tls-key");
    if (!key.ok()) return key.status();
    ssl.pem_cert_chain = *cert;
    ssl.pem_private_key = *key;
  }
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::SslCredentials(ssl);
  if (!bearer_token.empty()) {
    creds = grpc::CompositeChannelCredentials(creds, grpc::AccessTokenCredentials(bearer_token));
  }
  return creds;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerCredentials(const TlsFiles& files) {
  for (const auto& [flag, value] :
       {std::pair<const char*, const std::string*>{"--tls-cert", &files.cert},
        {"--tls-key", &files.key},
        {"--tls-ca", &files.ca}}) {
    if (value->empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, ": required with TLS (--tls-cert, --tls-key and --tls-ca together)"));
    }
  }
  auto cert = ReadPem(files.cert, "--tls-cert");
  if (!cert.ok()) return cert.status();
  auto key = ReadPem(files.key, "--tls-key");
  if (!key.ok()) return key.status();
  auto ca = ReadPem(files.ca, "--tls-ca");
  if (!ca.ok()) return ca.status();
  grpc::SslServerCredentialsOptions ssl(GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY);
  ssl.pem_root_certs = *ca;
  ssl.pem_key_cert_pairs.push_back({*key, *cert});
  return grpc::SslServerCredentials(ssl);
}

bool IsWorkerCertificate(std::string_view pem) {
  std::unique_ptr<BIO, decltype(&BIO_free)> bio(
      BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())), &BIO_free);
  if (bio == nullptr) return false;
  std::unique_ptr<X509, decltype(&X509_free)> cert(
      PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr), &X509_free);
  if (cert == nullptr) return false;
  X509_NAME* name = X509_get_subject_name(cert.get());
  for (int i = X509_NAME_get_index_by_NID(name, NID_organizationalUnitName, -1); i >= 0;
       i = X509_NAME_get_index_by_NID(name, NID_organizationalUnitName, i)) {
    const ASN1_STRING* value = X509_NAME_ENTRY_get_data(X509_NAME_get_entry(name, i));
    const std::string_view unit(reinterpret_cast<const char*>(ASN1_STRING_get0_data(value)),
                                static_cast<size_t>(ASN1_STRING_length(value)));
    if (unit == kWorkerUnit) return true;
  }
  return false;
}

std::optional<WorkerCertificate> ParseWorkerCertificate(std::string_view pem) {
  if (!IsWorkerCertificate(pem)) return std::nullopt;
  std::unique_ptr<BIO, decltype(&BIO_free)> bio(
      BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())), &BIO_free);
  if (bio == nullptr) return std::nullopt;
  std::unique_ptr<X509, decltype(&X509_free)> cert(
      PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr), &X509_free);
  if (cert == nullptr) return std::nullopt;
  WorkerCertificate out;
  X509_NAME* name = X509_get_subject_name(cert.get());
  const int cn = X509_NAME_get_index_by_NID(name, NID_commonName, -1);
  if (cn >= 0) {
    const ASN1_STRING* value = X509_NAME_ENTRY_get_data(X509_NAME_get_entry(name, cn));
    out.name.assign(reinterpret_cast<const char*>(ASN1_STRING_get0_data(value)),
                    static_cast<size_t>(ASN1_STRING_length(value)));
  }
  const ASN1_INTEGER* serial = X509_get0_serialNumber(cert.get());
  out.serial = Hex(ASN1_STRING_get0_data(serial), static_cast<size_t>(ASN1_STRING_length(serial)));
  // Leading zero bytes (DER keeps one when the top bit is set) are not part of the number.
  while (out.serial.size() > 2 && out.serial.rfind("00", 0) == 0) out.serial.erase(0, 2);
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  if (X509_digest(cert.get(), EVP_sha256(), md, &n) != 1) return std::nullopt;
  out.fingerprint = Hex(md, n);
  return out;
}

absl::StatusOr<RevocationList> RevocationList::Load(const std::string& path) {
  std::ifstream f(path);
  if (!f) return absl::InvalidArgumentError(absl::StrCat("--revoked: cannot read \"", path, "\""));
  RevocationList list;
  std::string line;
  int n = 0;
  while (std::getline(f, line)) {
    ++n;
    std::string entry;
    for (char c : line.substr(0, line.find('#'))) {
      if (c == ':' || absl::ascii_isspace(static_cast<unsigned char>(c))) continue;
      entry.push_back(absl::ascii_tolower(static_cast<unsigned char>(c)));
    }
    if (entry.empty()) continue;
    while (entry.size() > 2 && entry.rfind("00", 0) == 0) entry.erase(0, 2);
    if (entry.size() > 128 || entry.find_first_not_of("0123456789abcdef") != std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("--revoked: ", path, " line ", n,
                       ": need a certificate serial number or SHA-256 fingerprint in hex"));
    }
    list.entries_.push_back(std::move(entry));
  }
  return list;
}

bool RevocationList::Revoked(const WorkerCertificate& cert) const {
  for (const std::string& e : entries_) {
    if (e == cert.serial || e == cert.fingerprint) return true;
  }
  return false;
}

std::string FormatExpiry(absl::Time t) {
  return absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", t, absl::UTCTimeZone());
}

std::string Sha256Hex(std::string_view data) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  EVP_Digest(data.data(), data.size(), md, &n, EVP_sha256(), nullptr);
  return Hex(md, n);
}

absl::StatusOr<std::string> RandomHex(int bytes) {
  std::vector<unsigned char> buf(bytes);
  if (RAND_bytes(buf.data(), bytes) != 1) {
    return absl::InternalError("RAND_bytes: OpenSSL's random generator failed");
  }
  return Hex(buf.data(), buf.size());
}

bool SecretEquals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

absl::StatusOr<TokenTable> TokenTable::Load(const std::string& path) {
  std::ifstream f(path);
  if (!f) return absl::InvalidArgumentError(absl::StrCat("--tokens: cannot read \"", path, "\""));
  TokenTable table;
  std::string line;
  int n = 0;
  while (std::getline(f, line)) {
    ++n;
    line = std::string(absl::StripAsciiWhitespace(line.substr(0, line.find('#'))));
    if (line.empty()) continue;
    std::vector<std::string> parts = absl::StrSplit(line, ' ', absl::SkipWhitespace());
    const std::string where = absl::StrCat("--tokens: ", path, " line ", n);
    if (parts.size() != 3 && parts.size() != 4) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": need \"USER ROLE SHA256HEX [EXPIRES]\""));
    }
    if (!ValidUserName(parts[0])) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": user: letters, digits, -_.@ only"));
    }
    if (parts[1] != "user" && parts[1] != "admin") {
      return absl::InvalidArgumentError(absl::StrCat(where, ": role: user or admin"));
    }
    if (parts[2].size() != 64 ||
        parts[2].find_first_not_of("0123456789abcdef") != std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": hash: 64 lower-case hex digits (SHA-256)"));
    }
    User user{parts[0], parts[1] == "admin"};
    if (parts.size() == 4) {
      std::string error;
      if (!absl::ParseTime(absl::RFC3339_full, parts[3], &user.expires, &error)) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": expires: an RFC 3339 time such as 2027-01-31T00:00:00Z"));
      }
    }
    table.entries_.push_back({std::move(user), parts[2]});
  }
  // An empty table locks every user out, the admins included; it is far more often a file
  // truncated by mistake, or caught half written, than a wish.
  if (table.entries_.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tokens: ", path,
        " holds no token; an empty table would lock every user out (an admin adds one with "
        "`vocabpipe certs token USER --tokens ",
        path, "`)"));
  }
  return table;
}

std::optional<User> TokenTable::Find(std::string_view token) const {
  const std::string hash = Sha256Hex(token);
  std::optional<User> found;
  for (const Entry& e : entries_) {  // every entry, so the time does not tell which matched
    if (SecretEquals(hash, e.hash) && !found) found = e.user;
  }
  return found;
}

absl::StatusOr<std::string> AddToken(const std::string& path, const std::string& user,
                                     const std::string& role, absl::Time expires) {
  if (!ValidUserName(user)) {
    return absl::InvalidArgumentError("USER: 1..64 letters, digits, '-', '_', '.', '@'");
  }
  if (role != "user" && role != "admin") return absl::InvalidArgumentError("--role: user or admin");
  if (expires <= absl::Now()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--expires: ", FormatExpiry(expires), " is not in the future"));
  }
  auto token = RandomHex(32);
  if (!token.ok()) return token.status();
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  if (fd < 0)
    return absl::InvalidArgumentError(absl::StrCat("--tokens: cannot write \"", path, "\""));
  std::string line = absl::StrCat(user, " ", role, " ", Sha256Hex(*token));
  if (expires != absl::InfiniteFuture()) absl::StrAppend(&line, " ", FormatExpiry(expires));
  line += "\n";
  const bool ok = write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size());
  close(fd);
  if (!ok) return absl::InternalError(absl::StrCat("--tokens: writing \"", path, "\" failed"));
  return *token;
}

}  // namespace vp::auth
