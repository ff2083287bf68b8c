// SPDX-License-Identifier: Apache-2.0
#pragma once

// What every block store backend's tests share (file_block_store_test.cpp,
// redis/redis_block_store_test.cpp): the BlockStore contract; prefix reuse through a store, in
// every storage format, with every fault a record can carry (each a miss or an error naming what
// failed, the sequence then holding exactly the blocks before it, byte for byte, and the pool's
// invariants intact); and two processes sharing one store, whose logits equal recomputing.
// A backend's test gives a factory, make(model) -> std::unique_ptr<Store>, whose stores all
// share one place (a directory; a server and a key prefix).

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <Eigen/Core>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "cache_test_support.hpp"
#include "child_process.hpp"
#include "kvcache/block_store.hpp"
#include "kvcache/detail/block_record.hpp"
#include "kvcache/paged_kv_cache.hpp"
#include "qwen3/model.hpp"

namespace kvcache::testing {

using ::testing::AllOf;
using ::testing::HasSubstr;

/// A fresh directory under the system's temporary one, removed with everything in it.
class TempDir {
 public:
  explicit TempDir(const std::string& name) {
    static std::atomic<int> count{0};
    path_ = std::filesystem::temp_directory_path() /
            (name + "." + std::to_string(::getpid()) + "." + std::to_string(count.fetch_add(1)));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }

 private:
  std::filesystem::path path_;
};

/// `n` distinct keys, apart from those of another salt.
inline std::vector<BlockKey> keys_from(std::uint8_t salt, std::size_t n) {
  std::vector<BlockKey> keys(n);
  for (std::size_t i = 0; i < n; ++i) {
    keys[i].bytes.fill(salt);
    keys[i].bytes[15] = static_cast<std::uint8_t>(i);
  }
  return keys;
}

/// `n` seeded bytes, any value (NUL and CR LF included).
inline std::string bytes_from(std::uint64_t seed, std::size_t n) {
  std::mt19937_64 rng(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng() & 0xFFU);
  return s;
}

/// What every BlockStore does, on a store that holds none of keys_from(1, ..).
template <class Store>
void expect_block_store_contract(Store& store) {
  const std::vector<BlockKey> keys = keys_from(1, 4);
  const std::vector<std::string> records = {bytes_from(1, 100), bytes_from(2, 1), bytes_from(3, 70000),
                                            bytes_from(4, 5)};
  std::vector<std::string> out(4, "untouched");
  EXPECT_EQ(store.contains(keys), 0U);
  EXPECT_EQ(store.get(keys, out), 0U);
  EXPECT_EQ(out[0], "untouched");

  store.put(std::span(keys).first(2), std::span(records).first(2));
  EXPECT_EQ(store.contains(keys), 2U);
  EXPECT_EQ(store.get(keys, out), 2U);
  EXPECT_EQ(out[0], records[0]);
  EXPECT_EQ(out[1], records[1]);
  EXPECT_EQ(out[2], "untouched");  // past the leading run

  // A run stops at the first key missing, whatever follows.
  store.put(std::span(keys).subspan(3, 1), std::span(records).subspan(3, 1));
  EXPECT_EQ(store.contains(keys), 2U);
  const std::vector<BlockKey> gap = {keys[3], keys[2], keys[0]};
  EXPECT_EQ(store.contains(gap), 1U);
  EXPECT_EQ(store.get(gap, std::span(out).first(3)), 1U);
  EXPECT_EQ(out[0], records[3]);

  // A put replaces the record a key held.
  const std::vector<std::string> newer = {bytes_from(9, 333)};
  store.put(std::span(keys).first(1), newer);
  EXPECT_EQ(store.get(std::span(keys).first(1), std::span(out).first(1)), 1U);
  EXPECT_EQ(out[0], newer[0]);

  // Nothing asked, nothing done; counts that disagree are refused before anything is done.
  EXPECT_EQ(store.contains({}), 0U);
  EXPECT_EQ(store.get({}, {}), 0U);
  store.put({}, {});
  try {
    (void)store.get(keys, std::span(out).first(3));
    ADD_FAILURE() << "get with 3 records for 4 keys did not throw";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("expected 4"), HasSubstr("given 3")));
  }
  try {
    store.put(std::span(keys).subspan(2, 2), std::span(records).first(1));
    ADD_FAILURE() << "put with 1 record for 2 keys did not throw";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("expected 2"), HasSubstr("given 1")));
  }
  EXPECT_EQ(store.contains(std::span(keys).subspan(2, 1)), 0U);
}

/// Several threads sharing one store, each writing and reading a key of its own and one they all
/// write: every record read is one that was written, whole.
template <class Store>
void expect_threads_share(Store& store) {
  constexpr std::size_t kThreads = 4, kRounds = 25;
  const std::vector<BlockKey> common = keys_from(200, 1);
  std::vector<std::string> versions;
  for (std::size_t t = 0; t < kThreads; ++t) versions.push_back(bytes_from(100 + t, 20000 + t));
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      try {
        const std::vector<BlockKey> own = keys_from(static_cast<std::uint8_t>(10 + t), 1);
        const std::span<const std::string> mine(&versions[t], 1);
        std::vector<std::string> out(1);
        for (std::size_t round = 0; round < kRounds; ++round) {
          store.put(own, mine);
          store.put(common, mine);
          if (store.get(own, out) != 1 || out[0] != versions[t]) ++wrong;
          if (store.get(common, out) != 1 || std::find(versions.begin(), versions.end(), out[0]) == versions.end())
            ++wrong;
        }
      } catch (const std::exception& e) {
        ADD_FAILURE() << e.what();
        ++wrong;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
}

/// Pools of a small shape storing T (heads of `HeadDim` values), and the rows a sequence of
/// token ids holds: token p's K and V a function of ids[0..p], as a model's are, so rows fetched
/// for a prefix must equal the rows computing it gives.
template <class T, std::size_t HeadDim = 8>
struct StoreScene {
  using In = input_t<T>;
  static constexpr std::size_t layers = 2, kv_heads = 2, head_dim = HeadDim, block = 4;

  /// A pool of `blocks` blocks; formats with head scales get `scale` for every head.
  static std::unique_ptr<BlockPool<T>> pool(std::size_t blocks, float scale = kTestHeadScale) {
    static thread_local std::vector<float> scales;
    BlockPoolConfig c{.layers = layers,
                      .kv_heads = kv_heads,
                      .head_dim = head_dim,
                      .block_tokens = block,
                      .blocks = blocks,
                      .capacity = 64};
    if constexpr (detail::has_head_scales<T>) {
      scales.assign(layers * kv_heads, scale);
      c.key_scales = scales;
      c.value_scales = scales;
    }
    return std::make_unique<BlockPool<T>>(c);
  }

  static std::vector<TokenId> prompt(std::size_t n, std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<TokenId> ids(n);
    for (TokenId& id : ids) id = static_cast<TokenId>(rng() % 50000);
    return ids;
  }

  static Block<In> rows_after(std::span<const TokenId> ids, std::size_t p, std::uint64_t salt) {
    std::uint64_t h = salt;
    for (std::size_t i = 0; i <= p; ++i) h = h * 1000003U + static_cast<std::uint64_t>(ids[i]) + 1;
    return Block<In>({1, kv_heads, 1, head_dim}, h);
  }

  /// Feeds ids[from, to) into every layer of `seq`.
  static void feed(PagedKvCache<T>& seq, std::span<const TokenId> ids, std::size_t from, std::size_t to) {
    for (std::size_t layer = 0; layer < layers; ++layer) {
      for (std::size_t p = from; p < to; ++p) {
        const Block<In> k = rows_after(ids, p, 2 * layer), v = rows_after(ids, p, 2 * layer + 1);
        const auto at = static_cast<std::int64_t>(p);
        seq.update(layer, k.view(), v.view(), at);
      }
    }
  }

  /// Checks that `seq` holds exactly the rows of ids[0, n), in every layer.
  static void expect_holds(PagedKvCache<T>& seq, std::span<const TokenId> ids, std::size_t n) {
    ASSERT_EQ(seq.length(), n);
    for (std::size_t layer = 0; layer < layers; ++layer) {
      std::map<std::int64_t, Row> rows;
      for (std::size_t p = 0; p < n; ++p) {
        const Block<In> k = rows_after(ids, p, 2 * layer), v = rows_after(ids, p, 2 * layer + 1);
        rows[static_cast<std::int64_t>(p)] = row_of<T>(k.view(), v.view(), 0);
      }
      EXPECT_EQ(flatten(seq.history(layer)), rows) << "layer " << layer;
    }
  }

  /// A sequence of a pool of its own fed `ids` and saved to `store`: what another process leaves.
  template <class Store>
  static void save(Store& store, std::span<const TokenId> ids) {
    auto writer = pool(32);
    PagedKvCache<T> seq(*writer);
    (void)seq.reuse_prefix(ids);
    feed(seq, ids, 0, ids.size());
    const PrefixSave saved = seq.save_prefix(store);
    EXPECT_EQ(saved.error, "");
    EXPECT_EQ(saved.held + saved.written, ids.size() / block);
  }

  /// The store keys of `ids`' blocks in a pool of this scene, for a store of `model`.
  static std::vector<BlockKey> keys_of(std::string_view model, std::span<const TokenId> ids,
                                       float scale = kTestHeadScale) {
    const std::vector<float> scales(detail::has_head_scales<T> ? layers * kv_heads : 0, scale);
    const detail::BlockSpace space = detail::block_space<T>(model, block, layers, kv_heads, head_dim, scales, scales);
    return detail::prompt_keys(space, ids, block, ids.size() / block);
  }
};

/// A sequence of `pool` fetching `prompt` from `store` where block `bad` is faulty: it takes the
/// blocks before it and no other, the result names what failed, the pool gives nothing else, and
/// the sequence goes on to hold exactly the prompt's rows.
template <class T, class Store>
void expect_fault_at(Store& store, std::span<const TokenId> prompt, std::size_t bad,
                     const std::vector<std::string>& parts) {
  using Scene = StoreScene<T>;
  auto pool = Scene::pool(16);
  const std::size_t free = pool->free_blocks();
  PagedKvCache<T> seq(*pool);
  const PrefixReuse hit = seq.reuse_prefix(prompt, store);
  EXPECT_EQ(hit.store_blocks, bad);
  EXPECT_EQ(hit.tokens, bad * Scene::block);
  EXPECT_THAT(hit.error, HasSubstr("block " + std::to_string(bad) + " of the prompt"));
  for (const std::string& part : parts) EXPECT_THAT(hit.error, HasSubstr(part));
  EXPECT_EQ(pool->free_blocks(), free - bad);
  pool->check_invariants();
  Scene::expect_holds(seq, prompt, bad * Scene::block);
  Scene::feed(seq, prompt, hit.tokens, prompt.size());
  Scene::expect_holds(seq, prompt, prompt.size());
  pool->check_invariants();
}

/// The record under `key` after `change`, written back (the store's own bytes, changed).
template <class Store, class Change>
void rewrite(Store& store, const BlockKey& key, const Change& change) {
  std::vector<std::string> record(1);
  ASSERT_EQ(store.get(std::span(&key, 1), record), 1U);
  change(record[0]);
  store.put(std::span(&key, 1), record);
}

/// The offset of `tag`'s payload in a record, for crafted faults.
inline std::size_t payload_offset(const std::string& record, std::string_view tag) {
  std::size_t at = detail::kBlockMagic.size() + 4;
  while (at + sizeof(detail::SectionHeader) <= record.size()) {
    detail::SectionHeader h;
    std::memcpy(&h, record.data() + at, sizeof h);
    if (std::string_view(h.tag.data(), 4) == tag) return at + sizeof h;
    at += sizeof h + static_cast<std::size_t>(h.bytes) + 4;
  }
  ADD_FAILURE() << "no section " << tag;
  return record.size();
}

/// Replaces bytes of `tag`'s payload at `offset` and repairs its checksum: a record whose
/// checksums all match but whose fields lie.
inline void patch_section(std::string& record, std::string_view tag, std::size_t offset, std::string_view bytes) {
  const std::size_t payload = payload_offset(record, tag);
  detail::SectionHeader h;
  std::memcpy(&h, record.data() + payload - sizeof h, sizeof h);
  record.replace(payload + offset, bytes.size(), bytes);
  const std::uint32_t crc =
      detail::crc32c(detail::crc32c(0, &h, sizeof h), record.data() + payload, static_cast<std::size_t>(h.bytes));
  std::memcpy(record.data() + payload + h.bytes, &crc, sizeof crc);
}

// ---- prefix reuse through a store, for every format ------------------------------------------

/// Another pool's saved prefix reused: the rows computing gives, keyed for the pool's own reuse.
template <class T, class Make>
void expect_prefix_from_another_pool(const Make& make) {
  using Scene = StoreScene<T>;
  auto store = make("model-a");
  const std::vector<TokenId> prompt = Scene::prompt(14, 1);  // 3 full blocks and 2 tokens
  Scene::save(*store, prompt);
  auto pool = Scene::pool(16);
  {
    PagedKvCache<T> seq(*pool);
    const PrefixReuse hit = seq.reuse_prefix(prompt, *store);
    EXPECT_EQ(hit.error, "");
    EXPECT_EQ(hit.tokens, 12U);
    EXPECT_EQ(hit.pool_blocks, 0U);
    EXPECT_EQ(hit.store_blocks, 3U);
    EXPECT_EQ(seq.token_ids().size(), prompt.size());
    pool->check_invariants();
    Scene::expect_holds(seq, prompt, 12);
    Scene::feed(seq, prompt, 12, 14);
    Scene::expect_holds(seq, prompt, 14);
    pool->check_invariants();
    // Already held: a second save writes nothing.
    const PrefixSave again = seq.save_prefix(*store);
    EXPECT_EQ(again.error, "");
    EXPECT_EQ(again.held, 3U);
    EXPECT_EQ(again.written, 0U);
  }
  // Fetched blocks are keyed like computed ones: the pool alone serves the prefix now.
  PagedKvCache<T> next(*pool);
  EXPECT_EQ(next.reuse_prefix(prompt), 12U);
  Scene::expect_holds(next, prompt, 12);
  pool->check_invariants();
}

/// A prompt found whole (pool first, then the store): its last token is left to be fed, and
/// fed, the last block holds the prompt's rows.
template <class T, class Make>
void expect_whole_prompt_and_pool_first(const Make& make) {
  using Scene = StoreScene<T>;
  auto store = make("model-a");
  const std::vector<TokenId> prompt = Scene::prompt(12, 2);
  Scene::save(*store, prompt);
  auto pool = Scene::pool(16);
  PagedKvCache<T> first(*pool);  // holds the first block in the pool
  (void)first.reuse_prefix(std::span(prompt).first(5));
  Scene::feed(first, prompt, 0, 5);
  PagedKvCache<T> seq(*pool);
  const PrefixReuse hit = seq.reuse_prefix(prompt, *store);
  EXPECT_EQ(hit.error, "");
  EXPECT_EQ(hit.pool_blocks, 1U);
  EXPECT_EQ(hit.store_blocks, 2U);
  EXPECT_EQ(hit.tokens, 11U);
  pool->check_invariants();
  Scene::expect_holds(seq, prompt, 11);
  Scene::feed(seq, prompt, 11, 12);
  Scene::expect_holds(seq, prompt, 12);
  Scene::expect_holds(first, prompt, 5);
  pool->check_invariants();
}

/// What is not the pool's is a plain miss: another model's store, other head scales, another
/// prompt; and a pool without room takes what fits and says so.
template <class T, class Make>
void expect_misses_and_a_full_pool(const Make& make) {
  using Scene = StoreScene<T>;
  auto store = make("model-a");
  const std::vector<TokenId> prompt = Scene::prompt(14, 3);
  Scene::save(*store, prompt);
  const auto miss = [&](auto& pool, auto& from, std::span<const TokenId> ids) {
    PagedKvCache<T> seq(*pool);
    const PrefixReuse hit = seq.reuse_prefix(ids, from);
    EXPECT_EQ(hit.tokens, 0U);
    EXPECT_EQ(hit.store_blocks, 0U);
    EXPECT_EQ(hit.error, "");
    EXPECT_EQ(pool->free_blocks(), pool->blocks());
    pool->check_invariants();
  };
  auto pool = Scene::pool(16);
  auto other_model = make("model-b");
  miss(pool, *other_model, prompt);
  std::vector<TokenId> other_prompt = prompt;
  other_prompt[0] += 1;  // every key hashes from the first block
  miss(pool, *store, other_prompt);
  if constexpr (detail::has_head_scales<T>) {
    auto scaled = Scene::pool(16, 2 * kTestHeadScale);
    miss(scaled, *store, prompt);
  }

  auto small = Scene::pool(2);
  PagedKvCache<T> seq(*small);
  const PrefixReuse hit = seq.reuse_prefix(prompt, *store);
  EXPECT_EQ(hit.store_blocks, 2U);
  EXPECT_EQ(hit.tokens, 8U);
  EXPECT_THAT(hit.error, HasSubstr("no free block"));
  small->check_invariants();
  Scene::expect_holds(seq, prompt, 8);
}

/// Every fault a record can carry, at block 1 of 3 (block 0 is fetched, nothing after it), and at
/// block 0 (nothing is fetched, the pool is as it was).
template <class T, class Make>
void expect_record_faults(const Make& make) {
  using Scene = StoreScene<T>;
  auto store = make("model-a");
  const std::vector<TokenId> prompt = Scene::prompt(14, 4);
  const std::vector<BlockKey> keys = Scene::keys_of("model-a", prompt);
  Scene::save(*store, prompt);
  std::vector<std::string> good(3);
  ASSERT_EQ(store->get(keys, good), 3U);
  const auto restore = [&] { store->put(keys, good); };

  {  // a byte of the rows flipped
    SCOPED_TRACE("corrupt row byte");
    rewrite(*store, keys[1], [](std::string& r) { r[r.size() - 40] = static_cast<char>(r[r.size() - 40] ^ 0x10); });
    expect_fault_at<T>(*store, prompt, 1, {"checksum", "ROWS[1]"});
    restore();
  }
  {  // cut short
    SCOPED_TRACE("truncated");
    rewrite(*store, keys[1], [](std::string& r) { r.resize(r.size() / 2); });
    expect_fault_at<T>(*store, prompt, 1, {"bytes"});
    restore();
  }
  {  // not a record at all
    SCOPED_TRACE("garbage");
    rewrite(*store, keys[0], [](std::string& r) { r = "GET / HTTP/1.1\r\n\r\n"; });
    expect_fault_at<T>(*store, prompt, 0, {"magic"});
    restore();
  }
  {  // another block's record under this key
    SCOPED_TRACE("another key's record");
    rewrite(*store, keys[1], [&](std::string& r) { r = good[2]; });
    expect_fault_at<T>(*store, prompt, 1, {"key: expected " + keys[1].hex(), "found " + keys[2].hex()});
    restore();
  }
  {  // the right key, checksums repaired, another token id
    SCOPED_TRACE("forged ids");
    rewrite(*store, keys[1], [&](std::string& r) {
      const std::int64_t id = prompt[6] + 1;
      patch_section(r, "BLCK", 32 + 8 + 2 * 8, std::string_view(reinterpret_cast<const char*>(&id), sizeof id));
    });
    expect_fault_at<T>(*store, prompt, 1, {"token id 2: expected " + std::to_string(prompt[6]), "(the prompt's)"});
    restore();
  }
  {  // another model's record at this model's key
    SCOPED_TRACE("another model");
    auto other = make("model-b");
    Scene::save(*other, prompt);
    std::vector<std::string> foreign(1);
    const std::vector<BlockKey> theirs = Scene::keys_of("model-b", prompt);
    ASSERT_EQ(other->get(std::span(theirs).first(1), foreign), 1U);
    store->put(std::span(keys).first(1), foreign);
    expect_fault_at<T>(*store, prompt, 0, {"namespace: model: expected \"model-a\"", "found \"model-b\""});
    restore();
  }
  {  // another format's record at this format's key, checksums repaired
    SCOPED_TRACE("another format");
    using Other = std::conditional_t<std::is_same_v<T, float>, double, float>;
    auto other = make("model-a");
    StoreScene<Other>::save(*other, prompt);
    std::vector<std::string> foreign(1);
    const std::vector<BlockKey> theirs = StoreScene<Other>::keys_of("model-a", prompt);
    ASSERT_EQ(other->get(std::span(theirs).first(1), foreign), 1U);
    store->put(std::span(keys).first(1), foreign);
    expect_fault_at<T>(*store, prompt, 0,
                       {std::string("namespace: format: expected \"") + storage_codec<T>::name + "\"",
                        std::string("found \"") + storage_codec<Other>::name + "\""});
    restore();
  }

  // A sequence that found block 1 corrupt writes it again when it saves: the store heals.
  rewrite(*store, keys[1], [](std::string& r) { r[r.size() / 2] = static_cast<char>(r[r.size() / 2] ^ 1); });
  auto pool = Scene::pool(16);
  {
    PagedKvCache<T> seq(*pool);
    const PrefixReuse hit = seq.reuse_prefix(prompt, *store);
    EXPECT_EQ(hit.store_blocks, 1U);
    Scene::feed(seq, prompt, hit.tokens, prompt.size());
    const PrefixSave saved = seq.save_prefix(*store);
    EXPECT_EQ(saved.error, "");
    EXPECT_EQ(saved.held, 1U);
    EXPECT_EQ(saved.written, 2U);
  }
  auto fresh = Scene::pool(16);
  PagedKvCache<T> seq(*fresh);
  const PrefixReuse hit = seq.reuse_prefix(prompt, *store);
  EXPECT_EQ(hit.error, "");
  EXPECT_EQ(hit.store_blocks, 3U);
  Scene::expect_holds(seq, prompt, 12);
}

/// reuse_prefix(prompt, store) on a sequence holding anything: std::logic_error, nothing changed.
template <class T, class Make>
void expect_only_on_an_empty_sequence(const Make& make) {
  using Scene = StoreScene<T>;
  auto store = make("model-a");
  const std::vector<TokenId> prompt = Scene::prompt(8, 5);
  Scene::save(*store, prompt);
  auto pool = Scene::pool(16);
  PagedKvCache<T> seq(*pool);
  Scene::feed(seq, prompt, 0, 1);
  const std::size_t free = pool->free_blocks();
  EXPECT_THROW((void)seq.reuse_prefix(prompt, *store), std::logic_error);
  EXPECT_EQ(pool->free_blocks(), free);
  EXPECT_EQ(seq.length(), 1U);
  EXPECT_TRUE(seq.token_ids().empty());
  pool->check_invariants();
}

/// Every storage format, for the typed suites of the scenarios above.
using StoreFormats = gtest_types<formats>;

/// The scenarios above as the typed suite `Suite` over every format: `Suite` is a fixture
/// template whose factory() makes the backend's stores.
#define KVCACHE_BLOCK_STORE_SCENARIOS(Suite)                                         \
  TYPED_TEST_SUITE(Suite, StoreFormats, FormatName);                                 \
  TYPED_TEST(Suite, APrefixSavedByAnotherPoolIsReusedWithTheRowsOfComputingIt) {     \
    expect_prefix_from_another_pool<TypeParam>(this->factory());                     \
  }                                                                                  \
  TYPED_TEST(Suite, APromptFoundWholeInThePoolAndTheStoreLeavesItsLastTokenToFeed) { \
    expect_whole_prompt_and_pool_first<TypeParam>(this->factory());                  \
  }                                                                                  \
  TYPED_TEST(Suite, AnotherModelScalesOrPromptIsAMissAndAFullPoolTakesWhatFits) {    \
    expect_misses_and_a_full_pool<TypeParam>(this->factory());                       \
  }                                                                                  \
  TYPED_TEST(Suite, EveryFaultOfARecordStopsTheFetchBeforeItNamingIt) {              \
    expect_record_faults<TypeParam>(this->factory());                                \
  }                                                                                  \
  TYPED_TEST(Suite, OnlyAnEmptySequenceReuses) { expect_only_on_an_empty_sequence<TypeParam>(this->factory()); }

// ---- two processes sharing a store -----------------------------------------------------------

/// A child process runs a prompt through the tiny Qwen3 model over a paged cache and saves its
/// blocks to a store made by `make`; this process then reuses them and feeds the rest: its logits
/// equal recomputing the whole prompt (1e-5), and so do those of the tokens decoded after it.
template <class Make>
void expect_two_processes_share(const Make& make) {
  qwen3::Model model(qwen3::random_weights(qwen3::Config{}));
  const qwen3::Config& c = model.config();
  const BlockPoolConfig shape{
      .layers = c.layers, .kv_heads = c.kv_heads, .head_dim = c.head_dim, .block_tokens = 4, .blocks = 64};
  std::vector<TokenId> tokens(46);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<TokenId>((i * 37 + 11) % 256);
  const std::span<const TokenId> prompt = std::span<const TokenId>(tokens).first(43);  // 10 blocks and 3 tokens

  const int code = run_in_child(
      [&] {
        try {
          auto store = make("tiny-qwen3");
          BlockPool<float> pool(shape);
          PagedKvCache<float> seq(pool);
          if (seq.reuse_prefix(prompt, *store).tokens != 0) return 2;  // the store starts empty
          (void)model.forward(prompt, seq, qwen3::Logits::last);
          const PrefixSave saved = seq.save_prefix(*store);
          return saved.error.empty() && saved.written == 10 ? 0 : 3;
        } catch (...) {
          return 4;
        }
      },
      std::chrono::seconds(120));
  ASSERT_EQ(code, 0) << "2: the store was not empty; 3: the save failed; 4: an exception; " << kHung << ": it hung";

  auto store = make("tiny-qwen3");
  BlockPool<float> pool(shape);
  PagedKvCache<float> seq(pool);
  const PrefixReuse hit = seq.reuse_prefix(prompt, *store);
  EXPECT_EQ(hit.error, "");
  ASSERT_EQ(hit.store_blocks, 10U);
  ASSERT_EQ(hit.tokens, 40U);
  const qwen3::Matrix rest = model.forward(prompt.subspan(40), seq);
  const qwen3::Matrix all = model.forward_uncached(tokens);
  EXPECT_LE((rest - all.middleRows(40, 3)).cwiseAbs().maxCoeff(), 1e-5F);
  for (std::size_t p = 43; p < tokens.size(); ++p) {  // decoding on
    const TokenId next = tokens[p];
    seq.add_token_ids({&next, 1});
    const qwen3::Matrix step = model.forward({&next, 1}, seq);
    EXPECT_LE((step - all.row(static_cast<Eigen::Index>(p))).cwiseAbs().maxCoeff(), 1e-5F) << "position " << p;
  }
  pool.check_invariants();
  // The comparison can fail: rows of another prompt give other logits.
  EXPECT_GT((all.row(42) - model.forward_uncached(std::span<const TokenId>(tokens).subspan(1, 42)).row(41))
                .cwiseAbs()
                .maxCoeff(),
            1e-2F);
}

}  // namespace kvcache::testing
