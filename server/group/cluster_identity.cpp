// Multi-node identity and addressing (server/group/include/group/worker_registry.h): the cluster
// token (generated, read, compared in constant time), the model fingerprint both sides compare
// before a worker joins, and HOST:PORT parsing and the local address towards a host.
#include <arpa/inet.h>
#include <netdb.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "models/config.h"
#include "models/rope.h"
#include "group/worker_registry.h"

namespace burst::server {

namespace fs = std::filesystem;

namespace {

std::string float_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

std::string weights_identity(const models::ModelSpec& spec) {
  if (spec.dir.empty()) return "random(" + std::to_string(spec.random_seed) + ")";
  // Paths differ from host to host; the files' count and total size do not.
  int64_t files = 0, bytes = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(spec.dir, ec)) {
    if (e.path().extension() != ".safetensors") continue;
    ++files;
    bytes += static_cast<int64_t>(e.file_size(ec));
  }
  return "safetensors(" + std::to_string(files) + " files, " + std::to_string(bytes) + " bytes)";
}

}  // namespace

Result<std::string> random_token() {
  unsigned char bytes[32];
  size_t got = 0;
  while (got < sizeof bytes) {
    const ssize_t n = getrandom(bytes + got, sizeof bytes - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Status::error(std::string("getrandom failed: ") + std::strerror(errno));
    got += static_cast<size_t>(n);
  }
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char b : bytes) {
    out += kHex[b >> 4];
    out += kHex[b & 15];
  }
  return out;
}


Result<std::string> read_token_file(const std::string& path) {
  auto text = models::read_regular_file(path, 4096);
  if (!text.ok()) return Status::error("cluster token file: " + text.message());
  std::string t = text.value();
  const auto first = t.find_first_not_of(" \t\r\n");
  if (first == std::string::npos) return Status::error("cluster token file " + path + " is empty");
  t = t.substr(first, t.find_last_not_of(" \t\r\n") - first + 1);
  return t;
}

Result<std::string> cluster_token_from_env() {
  const char* t = std::getenv(kClusterTokenEnv);
  if (t != nullptr && *t != '\0') return std::string(t);
  const char* f = std::getenv(kClusterTokenFileEnv);
  if (f != nullptr && *f != '\0') return read_token_file(f);
  return std::string();
}

std::string model_fingerprint(const models::LlamaConfig& c, const models::ModelSpec& spec) {
  std::string rope = "none";
  if (c.rope_scaling.kind == models::RopeScaling::Kind::kLinear) {
    rope = "linear:" + float_text(c.rope_scaling.factor);
  } else if (c.rope_scaling.kind == models::RopeScaling::Kind::kDynamic) {
    rope = "dynamic:" + float_text(c.rope_scaling.factor);
  } else if (c.rope_scaling.kind == models::RopeScaling::Kind::kYarn) {
    const models::RopeScaling& y = c.rope_scaling;
    rope = "yarn:" + float_text(y.factor) + ":" +
           std::to_string(y.original_max_position_embeddings) + ":" + float_text(y.beta_fast) +
           ":" + float_text(y.beta_slow) + ":" + (y.truncate ? "1" : "0") + ":" +
           float_text(models::rope_logit_scale(c));
  }
  return "hidden=" + std::to_string(c.hidden_size) +
         " intermediate=" + std::to_string(c.intermediate_size) +
         " layers=" + std::to_string(c.num_layers) + " heads=" + std::to_string(c.num_heads) +
         " kv_heads=" + std::to_string(c.num_kv_heads) +
         " head_dim=" + std::to_string(c.head_dim) + " vocab=" + std::to_string(c.vocab_size) +
         " max_positions=" + std::to_string(c.max_position_embeddings) +
         " rms_eps=" + float_text(c.rms_norm_eps) + " rope_theta=" + float_text(c.rope_theta) +
         " rope_scaling=" + rope + " tied=" + (c.tie_word_embeddings ? "1" : "0") +
         " dtype=" + engine::dtype_name(c.torch_dtype) + " bos=" + std::to_string(c.bos_token_id) +
         " eos=" + std::to_string(c.eos_token_id) + " weights=" + weights_identity(spec);
}

// ---- addresses ------------------------------------------------------------------------------

Result<std::pair<std::string, int>> split_host_port(const std::string& text) {
  std::string host, port;
  if (!text.empty() && text[0] == '[') {
    const size_t close = text.find(']');
    if (close == std::string::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      return Status::error("'" + text + "' is not [IPV6]:PORT");
    }
    host = text.substr(1, close - 1);
    port = text.substr(close + 2);
  } else {
    const size_t colon = text.rfind(':');
    if (colon == std::string::npos) return Status::error("'" + text + "' is not HOST:PORT");
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
  }
  if (host.empty()) return Status::error("'" + text + "' has no host");
  if (port.empty() || port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos ||
      std::stoi(port) > 65535) {
    return Status::error("'" + text + "' has no valid port (0..65535)");
  }
  return std::make_pair(host, std::stoi(port));
}

Result<std::string> local_address_towards(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  const int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (rc != 0) return Status::error("cannot resolve " + host + ": " + gai_strerror(rc));
  std::string out, why = "no address";
  for (addrinfo* a = found; a && out.empty(); a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype, 0);
    if (fd < 0) continue;
    // connect() on a UDP socket only picks the route (and so the source address).
    sockaddr_storage local{};
    socklen_t len = sizeof local;
    if (connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      char buf[INET6_ADDRSTRLEN] = {};
      const void* addr = local.ss_family == AF_INET6
                             ? static_cast<const void*>(
                                   &reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr)
                             : static_cast<const void*>(
                                   &reinterpret_cast<sockaddr_in*>(&local)->sin_addr);
      if (inet_ntop(local.ss_family, addr, buf, sizeof buf)) out = buf;
    } else {
      why = std::strerror(errno);
    }
    close(fd);
  }
  freeaddrinfo(found);
  if (out.empty()) return Status::error("no route to " + host + ": " + why);
  return out;
}

}  // namespace burst::server
