// SPDX-License-Identifier: Apache-2.0
#pragma once

// A block store on a Redis or Valkey server, through hiredis (Debian: libhiredis-dev), for
// engines on several machines: target kvcache::redis. Not part of kvcache.hpp, whose headers need
// only the standard library.

#include <hiredis/hiredis.h>

#include <chrono>
#include <cstddef>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvcache/block_store.hpp"
#include "kvcache/version.hpp"

namespace kvcache {
inline namespace KVCACHE_ABI {

/// Which server a RedisBlockStore uses and which model's blocks it holds.
struct RedisBlockStoreConfig {
  std::string host = "127.0.0.1";
  int port = 6379;
  std::string model{};  // the engine's id of the model and its weights: part of every key's namespace
  std::string key_prefix = "kvcache:block:";  // each record is at key_prefix + the key's 32 hex digits
  std::string user{};                         // an ACL user (Redis 6 or later); empty: the default user
  std::string password{};                     // empty: no AUTH
  std::chrono::milliseconds timeout{2000};    // to connect, and for each read or write on the socket
};

/// A block store on a Redis or Valkey server: one string value per block, written by SET (a
/// reader sees a record whole or not at all), read by GET, batched in pipelines. Eviction is the
/// server's: set `maxmemory` and `maxmemory-policy allkeys-lru` (docs/store.md). A full server
/// (noeviction) or one that refuses writes makes put() throw with the server's reply.
///
/// Safe to use from several threads: each call takes a connection of its own from a small pool
/// (connecting when none is idle) and gives it back after a clean exchange; a connection that
/// failed is closed, so the next call connects afresh.
///
///   kvcache::RedisBlockStore store({.host = "10.0.0.5", .port = 6379, .model = "Qwen3-0.6B@c1899de"});
///   kvcache::PrefixReuse hit = seq.reuse_prefix(prompt, store);
class RedisBlockStore {
 public:
  /// Checks the config; connects on first use. std::invalid_argument for an empty host or
  /// model, or a port outside 1..65535.
  explicit RedisBlockStore(RedisBlockStoreConfig config) : config_(std::move(config)) {
    if (config_.host.empty()) throw std::invalid_argument("RedisBlockStore: config.host: expected a host, given \"\"");
    if (config_.model.empty()) {
      throw std::invalid_argument("RedisBlockStore: config.model: expected the model's id, given an empty string");
    }
    if (config_.port < 1 || config_.port > 65535) {
      throw std::invalid_argument("RedisBlockStore: config.port: expected 1..65535, given " +
                                  std::to_string(config_.port));
    }
    where_ = "RedisBlockStore " + config_.host + ":" + std::to_string(config_.port);
  }
  RedisBlockStore(const RedisBlockStore&) = delete;
  RedisBlockStore& operator=(const RedisBlockStore&) = delete;

  [[nodiscard]] std::string_view model() const noexcept { return config_.model; }
  /// The server's key of a block's record.
  [[nodiscard]] std::string key_of(const BlockKey& key) const { return config_.key_prefix + key.hex(); }

  /// How many leading keys the server holds. BlockStoreError if it cannot be asked.
  [[nodiscard]] std::size_t contains(std::span<const BlockKey> keys) {
    std::size_t held = keys.size();
    exchange("EXISTS", keys, {}, [&](std::size_t i, const redisReply& reply) {
      if (reply.type != REDIS_REPLY_INTEGER) unexpected("EXISTS", keys[i], reply);
      if (reply.integer == 0 && i < held) held = i;
    });
    return held;
  }

  /// Reads the records of the leading keys held into records[0..n) and returns n.
  /// std::invalid_argument unless records.size() == keys.size(); BlockStoreError if the server
  /// cannot be reached or fails part-way (the records then are not to be used).
  std::size_t get(std::span<const BlockKey> keys, std::span<std::string> records) {
    check_sizes("get", keys.size(), records.size(), "records to fill");
    std::size_t held = keys.size();
    exchange("GET", keys, {}, [&](std::size_t i, const redisReply& reply) {
      if (reply.type == REDIS_REPLY_NIL) {
        if (i < held) held = i;
        return;
      }
      if (reply.type != REDIS_REPLY_STRING) unexpected("GET", keys[i], reply);
      if (i < held) records[i].assign(reply.str, static_cast<std::size_t>(reply.len));
    });
    return held;
  }

  /// SETs each record under its key. std::invalid_argument unless records.size() == keys.size();
  /// BlockStoreError naming the key and the server's reply for the first it refuses (out of
  /// memory under noeviction, no permission, a read-only replica), or the connection's failure.
  void put(std::span<const BlockKey> keys, std::span<const std::string> records) {
    check_sizes("put", keys.size(), records.size(), "records");
    exchange("SET", keys, records, [&](std::size_t i, const redisReply& reply) {
      if (reply.type != REDIS_REPLY_STATUS) unexpected("SET", keys[i], reply);
    });
  }

 private:
  struct Free {
    void operator()(redisContext* c) const noexcept { redisFree(c); }
  };
  using Connection = std::unique_ptr<redisContext, Free>;
  struct FreeReply {
    void operator()(void* r) const noexcept { freeReplyObject(r); }
  };

  [[noreturn]] void fail(const std::string& what, const std::string& reason) const {
    throw BlockStoreError(where_ + ": " + what + ": " + reason);
  }
  [[noreturn]] void unexpected(const char* command, const BlockKey& key, const redisReply& reply) const {
    const std::string text = reply.type == REDIS_REPLY_ERROR || reply.type == REDIS_REPLY_STATUS
                                 ? std::string(reply.str, static_cast<std::size_t>(reply.len))
                                 : "a reply of type " + std::to_string(reply.type);
    fail(std::string(command) + " " + key_of(key), text);
  }
  static void check_sizes(const char* call, std::size_t keys, std::size_t records, const char* what) {
    if (keys != records) {
      throw std::invalid_argument("RedisBlockStore::" + std::string(call) + ": " + what + ": expected " +
                                  std::to_string(keys) + " (one per key), given " + std::to_string(records));
    }
  }

  /// Sends `command` for every key (with its record, for SET) in one pipeline, then reads every
  /// reply in order, calling on_reply(i, reply). The connection goes back to the pool only if
  /// every reply was read; a server error reply is thrown after the rest are read.
  template <class OnReply>
  void exchange(const char* command, std::span<const BlockKey> keys, std::span<const std::string> records,
                const OnReply& on_reply) {
    if (keys.empty()) return;
    Connection c = acquire();
    std::vector<std::string> names;
    names.reserve(keys.size());
    for (const BlockKey& key : keys) names.push_back(key_of(key));
    const std::string_view verb(command);
    for (std::size_t i = 0; i < keys.size(); ++i) {
      std::vector<const char*> argv = {command, names[i].data()};
      std::vector<std::size_t> lengths = {verb.size(), names[i].size()};
      if (!records.empty()) {
        argv.push_back(records[i].data());
        lengths.push_back(records[i].size());
      }
      if (redisAppendCommandArgv(c.get(), static_cast<int>(argv.size()), argv.data(), lengths.data()) != REDIS_OK) {
        fail(std::string(command) + " " + names[i], c->errstr);
      }
    }
    std::exception_ptr refused;  // the first reply handled with an exception; the others are still read
    for (std::size_t i = 0; i < keys.size(); ++i) {
      void* raw = nullptr;
      if (redisGetReply(c.get(), &raw) != REDIS_OK || raw == nullptr) {
        fail(std::string(command) + " " + names[i], c->err != 0 ? std::string(c->errstr) : "no reply");
      }
      const std::unique_ptr<void, FreeReply> reply(raw);
      try {
        on_reply(i, *static_cast<const redisReply*>(raw));
      } catch (...) {
        if (!refused) refused = std::current_exception();
      }
    }
    release(std::move(c));
    if (refused) std::rethrow_exception(refused);
  }

  Connection acquire() {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      if (!idle_.empty()) {
        Connection c = std::move(idle_.back());
        idle_.pop_back();
        return c;
      }
    }
    return connect();
  }
  void release(Connection c) {
    const std::lock_guard<std::mutex> lock(mutex_);
    idle_.push_back(std::move(c));
  }

  Connection connect() const {
    const auto ms = config_.timeout.count();
    timeval tv{};
    tv.tv_sec = static_cast<decltype(tv.tv_sec)>(ms / 1000);
    tv.tv_usec = static_cast<decltype(tv.tv_usec)>((ms % 1000) * 1000);
    Connection c(redisConnectWithTimeout(config_.host.c_str(), config_.port, tv));
    if (!c) fail("connect", "cannot allocate a connection");
    if (c->err != 0) fail("connect", c->errstr);
    if (redisSetTimeout(c.get(), tv) != REDIS_OK) fail("connect", "cannot set the timeout: " + std::string(c->errstr));
    if (!config_.password.empty()) {
      std::vector<const char*> argv = {"AUTH"};
      std::vector<std::size_t> lengths = {4};
      if (!config_.user.empty()) {
        argv.push_back(config_.user.data());
        lengths.push_back(config_.user.size());
      }
      argv.push_back(config_.password.data());
      lengths.push_back(config_.password.size());
      const std::unique_ptr<void, FreeReply> reply(
          redisCommandArgv(c.get(), static_cast<int>(argv.size()), argv.data(), lengths.data()));
      if (!reply) fail("AUTH", c->errstr);
      const auto* r = static_cast<const redisReply*>(reply.get());
      if (r->type == REDIS_REPLY_ERROR) fail("AUTH", std::string(r->str, static_cast<std::size_t>(r->len)));
    }
    return c;
  }

  RedisBlockStoreConfig config_;
  std::string where_;  // "RedisBlockStore host:port", for messages
  std::mutex mutex_;
  std::vector<Connection> idle_;
};

static_assert(BlockStore<RedisBlockStore>);

}  // namespace KVCACHE_ABI
}  // namespace kvcache
