// SPDX-License-Identifier: Apache-2.0
#pragma once

// Redis servers for the Redis block store's tests: the shared one CI and scripts/test.sh start
// (its port in KVCACHE_REDIS_PORT), servers a test starts for itself (to fill, restrict or kill
// them), and a proxy that cuts a connection part-way through a reply, killing the server then.
// Under CI (CI=true) a test that finds no server fails; elsewhere it is skipped, saying why.

#include <arpa/inet.h>
#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace kvcache::testing {

/// Whether this run is CI's, where a test must never skip for want of a server.
inline bool in_ci() {
  const char* ci = std::getenv("CI");
  return ci != nullptr && std::string_view(ci) == "true";
}

/// A port of 127.0.0.1 nothing listens on now: the kernel's pick for a socket bound to port 0.
inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t size = sizeof a;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &size) != 0) {
    if (fd >= 0) ::close(fd);
    throw std::runtime_error("free_port: cannot bind a socket to 127.0.0.1");
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

/// Whether a Redis server answers PING on 127.0.0.1:port.
inline bool answers(int port) {
  const timeval tv{0, 200000};
  redisContext* c = redisConnectWithTimeout("127.0.0.1", port, tv);
  if (c == nullptr) return false;
  bool ok = false;
  if (c->err == 0) {
    auto* reply = static_cast<redisReply*>(redisCommand(c, "PING"));
    ok = reply != nullptr && reply->type == REDIS_REPLY_STATUS;
    if (reply != nullptr) freeReplyObject(reply);
  }
  redisFree(c);
  return ok;
}

/// A redis-server of the test's own on a free port of 127.0.0.1, no persistence, with `args`
/// (as "--maxmemory", "1mb"). The binary: $KVCACHE_REDIS_SERVER, else redis-server on the PATH.
/// Killed (SIGKILL) when destroyed.
class RedisServer {
 public:
  explicit RedisServer(const std::vector<std::string>& args = {}) {
    const char* env = std::getenv("KVCACHE_REDIS_SERVER");
    const std::string binary = env != nullptr && *env != '\0' ? env : "redis-server";
    for (int attempt = 0; attempt < 5; ++attempt) {
      port_ = free_port();
      std::vector<std::string> words = {
          binary,        "--port", std::to_string(port_), "--bind",  "127.0.0.1", "--save",   "", "--appendonly", "no",
          "--daemonize", "no",     "--loglevel",          "warning", "--logfile", "/dev/null"};
      words.insert(words.end(), args.begin(), args.end());
      std::vector<char*> argv;
      for (std::string& w : words) argv.push_back(w.data());
      argv.push_back(nullptr);
      pid_ = ::fork();
      if (pid_ == 0) {  // only system calls until exec; the server dies with the test
        ::prctl(PR_SET_PDEATHSIG, SIGKILL);
        const int null = ::open("/dev/null", O_WRONLY);
        ::dup2(null, STDOUT_FILENO);
        ::dup2(null, STDERR_FILENO);
        ::execvp(binary.c_str(), argv.data());
        ::_exit(127);
      }
      if (pid_ < 0) throw std::runtime_error("RedisServer: cannot fork");
      for (int wait = 0; wait < 100; ++wait) {
        if (answers(port_)) return;
        int status = 0;
        if (::waitpid(pid_, &status, WNOHANG) == pid_) {  // it exited: the port was taken meanwhile, or no binary
          pid_ = -1;
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      stop();
    }
    throw std::runtime_error("RedisServer: " + binary +
                             " did not answer on any of 5 ports (is redis-server installed?)");
  }
  RedisServer(const RedisServer&) = delete;
  RedisServer& operator=(const RedisServer&) = delete;
  ~RedisServer() { stop(); }

  [[nodiscard]] int port() const noexcept { return port_; }
  /// Kills the server at once (SIGKILL) and waits for it.
  void stop() noexcept {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
  }

 private:
  int port_ = 0;
  pid_t pid_ = -1;
};

/// A server for a test: the shared one if KVCACHE_REDIS_PORT names it (checked to answer), else
/// one of its own. nullopt if there is none to be had (`why` says why).
struct RedisForTest {
  int port = 0;
  std::unique_ptr<RedisServer> own;
};
inline std::optional<RedisForTest> redis_for_test(std::string& why) {
  if (const char* env = std::getenv("KVCACHE_REDIS_PORT"); env != nullptr && *env != '\0') {
    const int port = std::atoi(env);
    if (answers(port)) return RedisForTest{port, nullptr};
    why = "KVCACHE_REDIS_PORT=" + std::string(env) + " but no Redis server answers there";
    return std::nullopt;
  }
  try {
    auto own = std::make_unique<RedisServer>();
    const int port = own->port();
    return RedisForTest{port, std::move(own)};
  } catch (const std::exception& e) {
    why = std::string("KVCACHE_REDIS_PORT is not set and no server could be started: ") + e.what();
    return std::nullopt;
  }
}

/// A server of the test's own, or null with `why` set.
inline std::unique_ptr<RedisServer> own_redis(std::string& why, const std::vector<std::string>& args = {}) {
  try {
    return std::make_unique<RedisServer>(args);
  } catch (const std::exception& e) {
    why = e.what();
    return nullptr;
  }
}

/// A TCP proxy on a free port of 127.0.0.1 for one connection to `port`: it forwards both ways
/// until `cut_after` bytes have come back from the server, then calls `at_cut` (which kills the
/// server) and closes the connection there, so that the client gets a reply cut part-way.
class CuttingProxy {
 public:
  template <class AtCut>
  CuttingProxy(int port, std::size_t cut_after, AtCut at_cut) : upstream_port_(port), cut_after_(cut_after) {
    listener_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t size = sizeof a;
    if (listener_ < 0 || ::bind(listener_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
        ::listen(listener_, 1) != 0 || ::getsockname(listener_, reinterpret_cast<sockaddr*>(&a), &size) != 0) {
      throw std::runtime_error("CuttingProxy: cannot listen on 127.0.0.1");
    }
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this, at_cut] { run(at_cut); });
  }
  CuttingProxy(const CuttingProxy&) = delete;
  CuttingProxy& operator=(const CuttingProxy&) = delete;
  ~CuttingProxy() {
    stop_ = true;
    thread_.join();
    ::close(listener_);
  }
  [[nodiscard]] int port() const noexcept { return port_; }
  /// Bytes that came back from the server and went on to the client.
  [[nodiscard]] std::size_t forwarded() const noexcept { return forwarded_; }

 private:
  template <class AtCut>
  void run(const AtCut& at_cut) {
    int client = -1, server = -1;
    for (pollfd p{listener_, POLLIN, 0}; !stop_ && client < 0;) {
      if (::poll(&p, 1, 50) > 0) client = ::accept(listener_, nullptr, nullptr);
    }
    if (client < 0) return;
    server = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<std::uint16_t>(upstream_port_));
    if (::connect(server, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) stop_ = true;
    std::vector<char> buffer(1 << 16);
    while (!stop_) {
      pollfd fds[2] = {{client, POLLIN, 0}, {server, POLLIN, 0}};
      if (::poll(fds, 2, 50) <= 0) continue;
      if ((fds[0].revents & (POLLIN | POLLHUP)) != 0) {
        const ssize_t n = ::read(client, buffer.data(), buffer.size());
        if (n <= 0 || ::write(server, buffer.data(), static_cast<std::size_t>(n)) != n) break;
      }
      if ((fds[1].revents & (POLLIN | POLLHUP)) != 0) {
        const std::size_t room = cut_after_ - forwarded_;
        const ssize_t n = ::read(server, buffer.data(), std::min(buffer.size(), room));
        if (n <= 0) break;
        if (::write(client, buffer.data(), static_cast<std::size_t>(n)) != n) break;
        forwarded_ += static_cast<std::size_t>(n);
        if (forwarded_ == cut_after_) {
          at_cut();
          break;
        }
      }
    }
    ::close(client);
    ::close(server);
  }

  int listener_ = -1;
  int port_ = 0;
  int upstream_port_;
  std::size_t cut_after_;
  std::atomic<std::size_t> forwarded_{0};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace kvcache::testing
