// SPDX-License-Identifier: Apache-2.0
// RedisBlockStore against real servers: the BlockStore contract; a paged cache reusing prefixes
// through it in every format, with every fault a record can carry; two processes sharing it; and
// the server's own faults: killed in the middle of a fetch, a value changed on it, full
// (maxmemory with noeviction), refusing writes (a read-only ACL user), not there at all. Each is a
// miss or an error naming what failed, the sequence holding exactly the rows before it.
//
// The shared server is the one at KVCACHE_REDIS_PORT (CI and scripts/test.sh start it); without
// it a test starts its own (redis-server, or $KVCACHE_REDIS_SERVER). Under CI=true a test that
// finds no server fails; elsewhere it is skipped, saying why.

#include "kvcache/redis_block_store.hpp"

#include <atomic>
#include <string>
#include <vector>

#include "block_store_test_support.hpp"
#include "redis/redis_server.hpp"

namespace kvcache::testing {
namespace {

/// Fails the test under CI, skips it elsewhere, when `what` is missing; `why` says why.
#define KVCACHE_REQUIRE_REDIS(what, why)   \
  if (!(what)) {                           \
    if (in_ci()) FAIL() << (why);          \
    GTEST_SKIP() << (why) << " (skipped)"; \
  }

/// A key prefix no other test uses on a shared server.
std::string unique_prefix() {
  static std::atomic<int> count{0};
  return "kvcache-test:" + std::to_string(::getpid()) + ":" + std::to_string(count.fetch_add(1)) + ":";
}

/// A factory of stores on one server under one key prefix, for the shared scenarios.
struct RedisFactory {
  int port = 0;
  std::string prefix = unique_prefix();
  [[nodiscard]] auto factory() const {
    return [port = port, prefix = prefix](const std::string& model) {
      return std::make_unique<RedisBlockStore>(
          RedisBlockStoreConfig{.port = port, .model = model, .key_prefix = prefix});
    };
  }
};

/// A command to the server at `port`, for setting a test up; its reply as text.
std::string command(int port, const std::vector<std::string>& words) {
  redisContext* c = redisConnect("127.0.0.1", port);
  std::vector<const char*> argv;
  std::vector<std::size_t> lengths;
  for (const std::string& w : words) {
    argv.push_back(w.data());
    lengths.push_back(w.size());
  }
  auto* reply =
      static_cast<redisReply*>(redisCommandArgv(c, static_cast<int>(argv.size()), argv.data(), lengths.data()));
  std::string text = reply == nullptr                     ? std::string("no reply: ") + c->errstr
                     : reply->type == REDIS_REPLY_INTEGER ? std::to_string(reply->integer)
                     : reply->str != nullptr ? std::string(reply->str, static_cast<std::size_t>(reply->len))
                                             : std::string();
  if (reply != nullptr) freeReplyObject(reply);
  redisFree(c);
  return text;
}

class RedisStore : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    server_ = redis_for_test(why);
    KVCACHE_REQUIRE_REDIS(server_, why);
    redis_.port = server_->port;
  }
  std::optional<RedisForTest> server_;
  RedisFactory redis_;
};

TEST_F(RedisStore, KeepsTheContract) { expect_block_store_contract(*redis_.factory()("m")); }

TEST_F(RedisStore, ThreadsShareOneStore) { expect_threads_share(*redis_.factory()("m")); }

TEST_F(RedisStore, ARecordIsAStringAtThePrefixAndTheKeysHex) {
  RedisBlockStore store({.port = redis_.port, .model = "m", .key_prefix = redis_.prefix});
  const std::vector<BlockKey> keys = keys_from(0x5A, 1);
  const std::vector<std::string> records = {bytes_from(11, 1000)};
  store.put(keys, records);
  EXPECT_EQ(store.key_of(keys[0]), redis_.prefix + keys[0].hex());
  EXPECT_EQ(command(redis_.port, {"GET", redis_.prefix + keys[0].hex()}), records[0]);
}

TEST(RedisStoreConfig, ABadConfigIsRefusedNamingTheField) {
  EXPECT_THROW(RedisBlockStore({.host = "", .model = "m"}), std::invalid_argument);
  EXPECT_THROW(RedisBlockStore({.model = ""}), std::invalid_argument);
  EXPECT_THROW(RedisBlockStore({.port = 0, .model = "m"}), std::invalid_argument);
  EXPECT_THROW(RedisBlockStore({.port = 70000, .model = "m"}), std::invalid_argument);
}

TEST_F(RedisStore, AValueChangedOnTheServerIsCaughtByTheFetch) {
  using Scene = StoreScene<float>;
  auto store = redis_.factory()("m");
  const std::vector<TokenId> prompt = Scene::prompt(14, 9);
  Scene::save(*store, prompt);
  const std::string key = store->key_of(Scene::keys_of("m", prompt)[2]);
  EXPECT_EQ(command(redis_.port, {"SETRANGE", key, "100", "\x7f"}), command(redis_.port, {"STRLEN", key}));
  expect_fault_at<float>(*store, prompt, 2, {"checksum"});
}

// ---- the shared scenarios, in every format ----------------------------------------------------

template <class T>
class RedisStoreReuse : public RedisStore {
 protected:
  [[nodiscard]] auto factory() const { return redis_.factory(); }
};
KVCACHE_BLOCK_STORE_SCENARIOS(RedisStoreReuse)

TEST_F(RedisStore, ASecondProcessReusesTheFirstsPrefixWithTheLogitsOfRecomputing) {
  expect_two_processes_share(redis_.factory());
}

// ---- the server's own faults ------------------------------------------------------------------

TEST(RedisStoreFaults, AServerKilledInTheMiddleOfAFetchGivesTheBlocksBeforeTheBatchItCut) {
  using Scene = StoreScene<float>;
  std::string why;
  const auto server = own_redis(why);
  KVCACHE_REQUIRE_REDIS(server, why);
  const std::string prefix = unique_prefix();
  RedisBlockStore direct({.port = server->port(), .model = "m", .key_prefix = prefix});
  const std::vector<TokenId> prompt = Scene::prompt(27 * Scene::block + 2, 21);  // 27 blocks: batches of 16 and 11
  const std::vector<BlockKey> keys = Scene::keys_of("m", prompt);
  ASSERT_EQ(keys.size(), 27U);
  {
    BlockPool<float> writer({.layers = Scene::layers,
                             .kv_heads = Scene::kv_heads,
                             .head_dim = Scene::head_dim,
                             .block_tokens = Scene::block,
                             .blocks = 64});
    PagedKvCache<float> seq(writer);
    (void)seq.reuse_prefix(prompt);
    Scene::feed(seq, prompt, 0, prompt.size());
    const PrefixSave saved = seq.save_prefix(direct);
    ASSERT_EQ(saved.error, "");
    ASSERT_EQ(saved.written, 27U);
  }
  std::vector<std::string> one(1);
  ASSERT_EQ(direct.get(std::span(keys).first(1), one), 1U);
  const std::size_t reply = one[0].size() + std::to_string(one[0].size()).size() + 5;  // $<n>\r\n<bytes>\r\n
  const std::size_t cut = 16 * reply + reply / 2;  // in the middle of the second batch's first record

  RedisServer* victim = server.get();
  CuttingProxy proxy(server->port(), cut, [victim] { victim->stop(); });
  RedisBlockStore store({.port = proxy.port(), .model = "m", .key_prefix = prefix});
  BlockPool<float> pool({.layers = Scene::layers,
                         .kv_heads = Scene::kv_heads,
                         .head_dim = Scene::head_dim,
                         .block_tokens = Scene::block,
                         .blocks = 64});
  PagedKvCache<float> seq(pool);
  const PrefixReuse hit = seq.reuse_prefix(prompt, store);
  EXPECT_EQ(proxy.forwarded(), cut);
  EXPECT_EQ(hit.store_blocks, 16U);
  EXPECT_EQ(hit.tokens, 64U);
  EXPECT_THAT(hit.error, AllOf(HasSubstr("RedisBlockStore 127.0.0.1:" + std::to_string(proxy.port())),
                               HasSubstr("GET " + prefix + keys[16].hex())));
  EXPECT_EQ(pool.free_blocks(), 64U - 16U);
  pool.check_invariants();
  Scene::expect_holds(seq, prompt, 64);
  Scene::feed(seq, prompt, 64, prompt.size());
  Scene::expect_holds(seq, prompt, prompt.size());
  pool.check_invariants();

  // The server is gone: the next fetch connects afresh, is refused, and says so; the pool's own
  // blocks are still served.
  PagedKvCache<float> again(pool);
  RedisBlockStore gone({.port = server->port(), .model = "m", .key_prefix = prefix});
  const PrefixReuse miss = again.reuse_prefix(prompt, gone);
  EXPECT_EQ(miss.pool_blocks, 27U);
  EXPECT_EQ(miss.store_blocks, 0U);
  EXPECT_EQ(miss.error, "");
  PagedKvCache<float> other(pool);
  std::vector<TokenId> elsewhere = prompt;
  elsewhere[0] += 1;
  const PrefixReuse refused = other.reuse_prefix(elsewhere, gone);
  EXPECT_EQ(refused.tokens, 0U);
  EXPECT_THAT(refused.error, AllOf(HasSubstr("RedisBlockStore 127.0.0.1:" + std::to_string(server->port())),
                                   HasSubstr("connect"), HasSubstr("refused")));
  pool.check_invariants();
}

TEST(RedisStoreFaults, AFullServerRefusesWritesNamingItAndHoldsOnlyWholeRecords) {
  using Scene = StoreScene<float, 1024>;  // records of 128 KiB, which a server holds apart from its buffers
  std::string why;
  const auto server = own_redis(why, {"--maxmemory-policy", "noeviction"});
  KVCACHE_REQUIRE_REDIS(server, why);
  // Room for a few records past what the server uses now.
  const std::string info = command(server->port(), {"INFO", "memory"});
  const std::size_t at = info.find("used_memory:");
  ASSERT_NE(at, std::string::npos);
  const long long in_use = std::stoll(info.substr(at + 12));
  EXPECT_EQ(command(server->port(), {"CONFIG", "SET", "maxmemory", std::to_string(in_use + (600 << 10))}), "OK");

  RedisBlockStore store({.port = server->port(), .model = "m", .key_prefix = "k:"});
  const std::vector<TokenId> prompt = Scene::prompt(16 * Scene::block, 22);
  auto pool = Scene::pool(16);
  PagedKvCache<float> seq(*pool);
  (void)seq.reuse_prefix(prompt);
  Scene::feed(seq, prompt, 0, prompt.size());
  const PrefixSave saved = seq.save_prefix(store);
  EXPECT_THAT(saved.error, AllOf(HasSubstr("RedisBlockStore"), HasSubstr("SET k:"), HasSubstr("OOM")));
  EXPECT_GE(saved.written, 1U);  // some records fit, then the server refused the rest
  EXPECT_LT(saved.written, 16U);
  const std::vector<BlockKey> keys = Scene::keys_of("m", prompt);
  EXPECT_EQ(store.contains(keys), saved.written);
  Scene::expect_holds(seq, prompt, prompt.size());  // the sequence is as it was
  pool->check_invariants();

  // What the server holds is whole: another pool reuses it, then misses.
  auto reader = Scene::pool(16);
  PagedKvCache<float> next(*reader);
  const PrefixReuse hit = next.reuse_prefix(prompt, store);
  EXPECT_EQ(hit.error, "");
  EXPECT_EQ(hit.store_blocks, saved.written);
  Scene::expect_holds(next, prompt, hit.tokens);
  reader->check_invariants();
}

TEST(RedisStoreFaults, AServerRefusingWritesOrCredentialsIsAnErrorNamingItAndReadsStillServe) {
  using Scene = StoreScene<float>;
  std::string why;
  const auto server = own_redis(why);
  KVCACHE_REQUIRE_REDIS(server, why);
  ASSERT_EQ(command(server->port(), {"ACL", "SETUSER", "reader", "on", ">secret", "~*", "+@read", "+ping"}), "OK");
  const std::vector<TokenId> prompt = Scene::prompt(3 * Scene::block, 23);
  RedisBlockStore writer({.port = server->port(), .model = "m", .key_prefix = "k:"});
  Scene::save(writer, prompt);

  RedisBlockStore reader(
      {.port = server->port(), .model = "m", .key_prefix = "k:", .user = "reader", .password = "secret"});
  auto pool = Scene::pool(16);
  PagedKvCache<float> seq(*pool);
  const PrefixReuse hit = seq.reuse_prefix(prompt, reader);
  EXPECT_EQ(hit.error, "");
  EXPECT_EQ(hit.store_blocks, 3U);
  std::vector<TokenId> longer = prompt;
  for (std::size_t i = 0; i < Scene::block; ++i) longer.push_back(static_cast<TokenId>(i));
  seq.add_token_ids(std::span(longer).subspan(prompt.size()));
  Scene::feed(seq, longer, hit.tokens, longer.size());
  const PrefixSave refused = seq.save_prefix(reader);
  EXPECT_EQ(refused.held, 3U);
  EXPECT_EQ(refused.written, 0U);
  EXPECT_THAT(refused.error, AllOf(HasSubstr("SET k:"), HasSubstr("NOPERM")));

  RedisBlockStore wrong({.port = server->port(), .model = "m", .key_prefix = "k:", .user = "reader", .password = "x"});
  auto other = Scene::pool(16);
  PagedKvCache<float> denied(*other);
  const PrefixReuse no = denied.reuse_prefix(prompt, wrong);
  EXPECT_EQ(no.tokens, 0U);
  EXPECT_THAT(no.error, HasSubstr("AUTH"));
  EXPECT_EQ(other->free_blocks(), other->blocks());
  other->check_invariants();
}

}  // namespace
}  // namespace kvcache::testing
