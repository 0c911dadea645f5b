// vocabpipe certs init DIR [--hosts H1,H2,...] [--days N]
//     A certificate authority and the certificates of a test or small cluster, with OpenSSL
//     (EC P-256 keys, SHA-256 signatures), into DIR:
//       ca.pem ca-key.pem           the cluster CA (keep ca-key.pem offline)
//       server.pem server-key.pem   the coordinator: SANs localhost, 127.0.0.1, ::1 + --hosts
//       worker.pem worker-key.pem   the workers (and their ranks): a client certificate whose
//                                   subject has OU=worker, the mark the coordinator checks
//     Keys are written 0600, certificates 0644; an existing file is never overwritten.
// vocabpipe certs worker NAME DIR [--days N]
//     A worker certificate of its own for worker NAME, signed by DIR's CA (ca.pem, ca-key.pem):
//     DIR/NAME.pem and DIR/NAME-key.pem, subject CN=NAME, OU=worker. The coordinator binds a
//     registered worker to the name its certificate carries, and a revocation list (--revoked)
//     names it by the serial number or fingerprint printed here.
// vocabpipe certs token USER --tokens FILE [--role user|admin] [--days N | --expires TIME]
//     A random 256-bit bearer token (RAND_bytes) for USER: its SHA-256 hash (and its expiry,
//     when given: N days from now, or an RFC 3339 TIME) is appended to the tokens file (the
//     coordinator's --tokens), the token is printed once.
// docs/operations.md, "Security".
#include <arpa/inet.h>
#include <fcntl.h>
#include <openssl/bio.h>
#include <openssl/bn.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "client/commands.h"
#include "proto/grpc/auth.h"

namespace vp::cli {
namespace fs = std::filesystem;
namespace {

constexpr char kUsage[] =
    "usage: vocabpipe certs init DIR [--hosts H1,H2,...] [--days N]\n"
    "       vocabpipe certs worker NAME DIR [--days N]\n"
    "       vocabpipe certs token USER --tokens FILE [--role user|admin]\n"
    "                             [--days N | --expires 2027-01-31T00:00:00Z]\n";

struct FreeKey {
  void operator()(EVP_PKEY* p) const { EVP_PKEY_free(p); }
};
struct FreeCert {
  void operator()(X509* p) const { X509_free(p); }
};
struct FreeBio {
  void operator()(BIO* p) const { BIO_free(p); }
};
struct FreeBn {
  void operator()(BIGNUM* p) const { BN_free(p); }
};
using Key = std::unique_ptr<EVP_PKEY, FreeKey>;
using Cert = std::unique_ptr<X509, FreeCert>;

absl::Status OpenSslError(const std::string& what) {
  return absl::InternalError(absl::StrCat("OpenSSL: ", what, " failed"));
}

absl::StatusOr<Key> NewKey() {
  Key key(EVP_EC_gen("P-256"));
  if (key == nullptr) return OpenSslError("EC P-256 key generation");
  return key;
}

absl::Status AddExtension(X509* cert, X509* issuer, int nid, const std::string& value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value.c_str());
  if (ext == nullptr) return OpenSslError(absl::StrCat("extension ", OBJ_nid2sn(nid), "=", value));
  const int ok = X509_add_ext(cert, ext, -1);
  X509_EXTENSION_free(ext);
  return ok == 1 ? absl::OkStatus() : OpenSslError("X509_add_ext");
}

struct CertSpec {
  std::string common_name;
  std::string unit{};  // OU, may be empty
  bool ca = false;
  std::string extended_usage{};  // serverAuth | clientAuth (leaf certificates)
  std::string alt_names{};       // subjectAltName value, may be empty
  int days = 365;
};

// A certificate for `key`, signed by issuer_key (issuer null: self-signed).
absl::StatusOr<Cert> MakeCert(const CertSpec& spec, EVP_PKEY* key, X509* issuer,
                              EVP_PKEY* issuer_key) {
  Cert cert(X509_new());
  if (cert == nullptr) return OpenSslError("X509_new");
  X509_set_version(cert.get(), 2);  // v3
  std::unique_ptr<BIGNUM, FreeBn> serial(BN_new());
  if (serial == nullptr || BN_rand(serial.get(), 127, BN_RAND_TOP_ANY, BN_RAND_BOTTOM_ANY) != 1 ||
      BN_to_ASN1_INTEGER(serial.get(), X509_get_serialNumber(cert.get())) == nullptr) {
    return OpenSslError("serial number");
  }
  X509_gmtime_adj(X509_getm_notBefore(cert.get()), -300);
  X509_gmtime_adj(X509_getm_notAfter(cert.get()), static_cast<long>(spec.days) * 86400);
  X509_set_pubkey(cert.get(), key);
  X509_NAME* name = X509_get_subject_name(cert.get());
  auto add = [&](const char* field, const std::string& value) {
    return X509_NAME_add_entry_by_txt(name, field, MBSTRING_ASC,
                                      reinterpret_cast<const unsigned char*>(value.c_str()), -1, -1,
                                      0) == 1;
  };
  if (!add("O", "vocabpipe") || (!spec.unit.empty() && !add("OU", spec.unit)) ||
      !add("CN", spec.common_name)) {
    return OpenSslError("subject name");
  }
  X509* signer = issuer != nullptr ? issuer : cert.get();
  X509_set_issuer_name(cert.get(), X509_get_subject_name(signer));
  std::vector<std::pair<int, std::string>> extensions;
  if (spec.ca) {
    extensions = {{NID_basic_constraints, "critical,CA:TRUE,pathlen:0"},
                  {NID_key_usage, "critical,keyCertSign,cRLSign"},
                  {NID_subject_key_identifier, "hash"}};
  } else {
    extensions = {{NID_basic_constraints, "critical,CA:FALSE"},
                  {NID_key_usage, "critical,digitalSignature,keyAgreement"},
                  {NID_ext_key_usage, spec.extended_usage},
                  {NID_subject_key_identifier, "hash"},
                  {NID_authority_key_identifier, "keyid:always"}};
    if (!spec.alt_names.empty()) extensions.push_back({NID_subject_alt_name, spec.alt_names});
  }
  for (const auto& [nid, value] : extensions) {
    if (auto st = AddExtension(cert.get(), signer, nid, value); !st.ok()) return st;
  }
  if (X509_sign(cert.get(), issuer_key != nullptr ? issuer_key : key, EVP_sha256()) == 0) {
    return OpenSslError("X509_sign");
  }
  return cert;
}

absl::StatusOr<std::string> ToPem(X509* cert, EVP_PKEY* key) {
  std::unique_ptr<BIO, FreeBio> bio(BIO_new(BIO_s_mem()));
  if (bio == nullptr) return OpenSslError("BIO_new");
  const int ok = cert != nullptr ? PEM_write_bio_X509(bio.get(), cert)
                                 : PEM_write_bio_PrivateKey(bio.get(), key, nullptr, nullptr, 0,
                                                            nullptr, nullptr);
  if (ok != 1) return OpenSslError("PEM encoding");
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, static_cast<size_t>(n));
}

// Creates `path` with `mode`; never replaces an existing file.
absl::Status WriteNew(const fs::path& path, const std::string& text, mode_t mode) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
  if (fd < 0) return absl::InternalError(absl::StrCat(path.string(), ": cannot create"));
  const bool ok = write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  fchmod(fd, mode);  // whatever the umask
  close(fd);
  return ok ? absl::OkStatus() : absl::InternalError(absl::StrCat(path.string(), ": write failed"));
}

// "DNS:localhost,IP:127.0.0.1,IP:::1" plus the hosts; InvalidArgument naming --hosts.
absl::StatusOr<std::string> AltNames(const std::vector<std::string>& hosts) {
  std::vector<std::string> names = {"DNS:localhost", "IP:127.0.0.1", "IP:::1"};
  for (const std::string& h : hosts) {
    unsigned char buf[16];
    if (inet_pton(AF_INET, h.c_str(), buf) == 1 || inet_pton(AF_INET6, h.c_str(), buf) == 1) {
      names.push_back("IP:" + h);
      continue;
    }
    const bool ok = !h.empty() && h.size() <= 253 &&
                    h.find_first_not_of(
                        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                        "0123456789.-*") == std::string::npos;
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat("--hosts: \"", h,
                       "\" is neither an IP address nor a DNS name (letters, digits, '.', '-')"));
    }
    names.push_back("DNS:" + h);
  }
  return absl::StrJoin(names, ",");
}

absl::Status InitCerts(const fs::path& dir, const std::vector<std::string>& hosts, int days) {
  auto alt = AltNames(hosts);
  if (!alt.ok()) return alt.status();
  const std::vector<std::string> files = {"ca.pem",         "ca-key.pem", "server.pem",
                                          "server-key.pem", "worker.pem", "worker-key.pem"};
  for (const std::string& f : files) {  // nothing is written when anything exists
    if (fs::exists(dir / f)) {
      return absl::AlreadyExistsError(absl::StrCat(
          (dir / f).string(), ": exists; certs init never overwrites (use a new DIR)"));
    }
  }
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat(dir.string(), ": ", ec.message()));
  auto ca_key = NewKey();
  if (!ca_key.ok()) return ca_key.status();
  auto ca = MakeCert({.common_name = "vocabpipe CA", .ca = true, .days = days}, ca_key->get(),
                     nullptr, nullptr);
  if (!ca.ok()) return ca.status();
  struct Leaf {
    std::string name;
    CertSpec spec;
  };
  const std::vector<Leaf> leaves = {
      {"server",
       {.common_name = "vocabpipe-coordinator",
        .extended_usage = "serverAuth",
        .alt_names = *alt,
        .days = days}},
      {"worker",
       {.common_name = "vocabpipe-worker",
        .unit = auth::kWorkerUnit,
        .extended_usage = "clientAuth",
        .days = days}},
  };
  std::vector<std::pair<std::string, std::pair<std::string, mode_t>>> out;
  auto pem = [&](const std::string& file, X509* cert, EVP_PKEY* key) -> absl::Status {
    auto text = ToPem(cert, key);
    if (!text.ok()) return text.status();
    out.push_back({file, {*text, static_cast<mode_t>(cert != nullptr ? 0644 : 0600)}});
    return absl::OkStatus();
  };
  if (auto st = pem("ca.pem", ca->get(), nullptr); !st.ok()) return st;
  if (auto st = pem("ca-key.pem", nullptr, ca_key->get()); !st.ok()) return st;
  for (const Leaf& leaf : leaves) {
    auto key = NewKey();
    if (!key.ok()) return key.status();
    auto cert = MakeCert(leaf.spec, key->get(), ca->get(), ca_key->get());
    if (!cert.ok()) return cert.status();
    if (auto st = pem(leaf.name + ".pem", cert->get(), nullptr); !st.ok()) return st;
    if (auto st = pem(leaf.name + "-key.pem", nullptr, key->get()); !st.ok()) return st;
  }
  for (const auto& [file, content] : out) {
    if (auto st = WriteNew(dir / file, content.first, content.second); !st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadFile(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::InvalidArgumentError(absl::StrCat(path.string(), ": cannot read"));
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

// A worker certificate for `name`, signed by the CA of `dir`; returns its identity.
absl::StatusOr<auth::WorkerCertificate> WorkerCert(const fs::path& dir, const std::string& name,
                                                   int days) {
  const bool ok_name =
      !name.empty() && name.size() <= 64 &&
      name.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.") ==
          std::string::npos &&
      name[0] != '.';
  if (!ok_name) {
    return absl::InvalidArgumentError(
        "NAME: 1..64 letters, digits, '-', '_', '.' (not starting with '.')");
  }
  for (const std::string& f : {name + ".pem", name + "-key.pem"}) {
    if (fs::exists(dir / f)) {
      return absl::AlreadyExistsError(
          absl::StrCat((dir / f).string(), ": exists; certs never overwrites"));
    }
  }
  auto ca_pem = ReadFile(dir / "ca.pem");
  if (!ca_pem.ok()) return ca_pem.status();
  auto ca_key_pem = ReadFile(dir / "ca-key.pem");
  if (!ca_key_pem.ok()) return ca_key_pem.status();
  std::unique_ptr<BIO, FreeBio> cb(
      BIO_new_mem_buf(ca_pem->data(), static_cast<int>(ca_pem->size())));
  Cert ca(cb ? PEM_read_bio_X509(cb.get(), nullptr, nullptr, nullptr) : nullptr);
  std::unique_ptr<BIO, FreeBio> kb(
      BIO_new_mem_buf(ca_key_pem->data(), static_cast<int>(ca_key_pem->size())));
  Key ca_key(kb ? PEM_read_bio_PrivateKey(kb.get(), nullptr, nullptr, nullptr) : nullptr);
  if (ca == nullptr || ca_key == nullptr || X509_check_private_key(ca.get(), ca_key.get()) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(dir.string(), ": ca.pem and ca-key.pem are not a CA certificate and its key"));
  }
  auto key = NewKey();
  if (!key.ok()) return key.status();
  auto cert = MakeCert({.common_name = name,
                        .unit = auth::kWorkerUnit,
                        .extended_usage = "clientAuth",
                        .days = days},
                       key->get(), ca.get(), ca_key.get());
  if (!cert.ok()) return cert.status();
  auto cert_pem = ToPem(cert->get(), nullptr);
  if (!cert_pem.ok()) return cert_pem.status();
  auto key_pem = ToPem(nullptr, key->get());
  if (!key_pem.ok()) return key_pem.status();
  auto id = auth::ParseWorkerCertificate(*cert_pem);
  if (!id) return OpenSslError("reading back the worker certificate");
  if (auto st = WriteNew(dir / (name + "-key.pem"), *key_pem, 0600); !st.ok()) return st;
  if (auto st = WriteNew(dir / (name + ".pem"), *cert_pem, 0644); !st.ok()) return st;
  return *id;
}

int Fail(std::ostream& err, const std::string& why, int code = 2) {
  err << "vocabpipe certs: " << why << "\n" << (code == 2 ? kUsage : "");
  return code;
}

}  // namespace

int RunCertsCommand(const Args& args, std::ostream& out, std::ostream& err) {
  if (WantsHelp(args)) {
    out << kUsage;
    return 0;
  }
  if (args.empty()) return Fail(err, "give a subcommand: init, worker or token");
  std::vector<std::string> positional;
  std::string hosts, tokens, role = "user";
  int days = 365;
  bool days_given = false;
  absl::Time expires = absl::InfiniteFuture();
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.size() > 1 && a[0] == '-') {
      if (i + 1 >= args.size()) return Fail(err, a + " needs a value");
      const std::string& v = args[++i];
      if (a == "--hosts" && args[0] == "init") {
        hosts = v;
      } else if (a == "--days") {  // init, worker: validity; token: expiry
        if (!absl::SimpleAtoi(v, &days) || days < 1 || days > 3650) {
          return Fail(err, "--days: need an integer in [1, 3650]");
        }
        days_given = true;
      } else if (a == "--expires" && args[0] == "token") {
        std::string why;
        if (!absl::ParseTime(absl::RFC3339_full, v, &expires, &why)) {
          return Fail(err, "--expires: need an RFC 3339 time such as 2027-01-31T00:00:00Z");
        }
      } else if (a == "--tokens" && args[0] == "token") {
        tokens = v;
      } else if (a == "--role" && args[0] == "token") {
        role = v;
      } else {
        return Fail(err, "unknown flag " + a);
      }
    } else {
      positional.push_back(a);
    }
  }
  if (args[0] == "init") {
    if (positional.size() != 1) return Fail(err, "init: give exactly one DIR");
    std::vector<std::string> host_list;
    if (!hosts.empty()) host_list = absl::StrSplit(hosts, ',', absl::SkipEmpty());
    const absl::Status st = InitCerts(positional[0], host_list, days);
    if (!st.ok()) {
      return Fail(err, std::string(st.message()),
                  absl::IsInvalidArgument(st) || absl::IsAlreadyExists(st) ? 2 : 1);
    }
    out << "wrote " << positional[0]
        << "/{ca,server,worker}.pem and their -key.pem files (keys 0600)\n"
        << "coordinator: --tls-cert server.pem --tls-key server-key.pem --tls-ca ca.pem "
           "--tokens FILE\n"
        << "workers:     --tls-cert worker.pem --tls-key worker-key.pem --tls-ca ca.pem\n"
        << "CLI:         --tls-ca ca.pem (or VOCABPIPE_TLS_CA) and VOCABPIPE_TOKEN\n";
    return 0;
  }
  if (args[0] == "worker") {
    if (positional.size() != 2) return Fail(err, "worker: give NAME and DIR");
    auto id = WorkerCert(positional[1], positional[0], days);
    if (!id.ok()) {
      return Fail(
          err, std::string(id.status().message()),
          absl::IsInvalidArgument(id.status()) || absl::IsAlreadyExists(id.status()) ? 2 : 1);
    }
    out << "wrote " << positional[1] << "/" << positional[0] << ".pem and " << positional[0]
        << "-key.pem (key 0600): worker " << id->name << "\n"
        << "serial " << id->serial << "\n"
        << "sha256 " << id->fingerprint << "\n";
    return 0;
  }
  if (args[0] == "token") {
    if (positional.size() != 1) return Fail(err, "token: give exactly one USER");
    if (tokens.empty()) return Fail(err, "--tokens FILE: required (the coordinator's --tokens)");
    if (days_given && expires != absl::InfiniteFuture()) {
      return Fail(err, "--days, --expires: give one of them");
    }
    if (days_given) expires = absl::Now() + absl::Hours(24) * days;
    auto token = auth::AddToken(tokens, positional[0], role, expires);
    if (!token.ok()) {
      return Fail(err, std::string(token.status().message()),
                  absl::IsInvalidArgument(token.status()) ? 2 : 1);
    }
    out << *token << "\n";
    return 0;
  }
  return Fail(err, "unknown subcommand " + args[0] + " (init, worker or token)");
}

}  // namespace vp::cli
