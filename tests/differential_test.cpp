// SPDX-License-Identifier: Apache-2.0
// Seeded random operation sequences (chunked updates, passes stopped part-way, truncates,
// resets, bad calls) on every variant, checked after every operation against the reference model
// (support/reference_model.hpp): what each position of each layer was given, the window applied
// by position, and now and then attention against its uncached attention. Paged sequences also as the rows of
// PagedBatch calls (forks sharing blocks, with and without a window), the pool's invariants checked after every
// operation.

#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <random>
#include <set>
#include <stdexcept>

#include "cache_test_support.hpp"
#include "kvcache/attention.hpp"
#include "kvcache/paged_batch.hpp"

namespace kvcache::testing {
namespace {

template <class Cache>
class Differential : public ::testing::Test {};
TYPED_TEST_SUITE(Differential, AllCaches, CacheName);

struct Limits {
  std::size_t window = 0, sinks = 0, slack = 0;
};

/// What the contract says a layer must hold, independent of how any cache stores it.
template <class T>
struct ReferenceLayer {
  std::vector<Stream<T>> written;  // per batch row, every position written and not truncated away
  std::set<std::int64_t> held;     // what the layer's last update returned (it may hold more)

  explicit ReferenceLayer(std::size_t batch) : written(batch) {}
  /// The row flatten() gives position p.
  [[nodiscard]] Row row(std::int64_t p) const {
    std::vector<const StoredToken<T>*> tokens;
    for (const Stream<T>& stream : written) tokens.push_back(&stream.at(static_cast<std::size_t>(p)));
    return row_of(tokens);
  }
  [[nodiscard]] std::vector<const Stream<T>*> streams() const {
    std::vector<const Stream<T>*> each;
    for (const Stream<T>& stream : written) each.push_back(&stream);
    return each;
  }
};

TYPED_TEST(Differential, RandomOperationSequencesMatchTheReference) {
  using Cache = TypeParam;
  using T = typename Cache::value_type;
  constexpr std::size_t layers = 3, batch = batch_of<Cache>, kv_heads = 2, head_dim = 3, capacity = 64;
  constexpr int sequences = 150, operations = 40;

  std::mt19937_64 rng(20261130);
  const auto pick = [&](std::size_t lo, std::size_t hi) {  // uniform in [lo, hi]
    return std::uniform_int_distribution<std::size_t>(lo, hi)(rng);
  };

  for (int sequence = 0; sequence < sequences; ++sequence) {
    Limits limits;
    KvCacheConfig config{
        .layers = layers, .batch = batch, .kv_heads = kv_heads, .head_dim = head_dim, .capacity = capacity};
    // Rings always have a window; slots and pages every other sequence (a slot's slack at least
    // the longest chunk less one, so that chunks may wrap it).
    if (is_ring<Cache> || ((is_slot<Cache> || is_paged<Cache>)&&sequence % 2 == 1)) {
      limits = {pick(1, 8), pick(0, 3), is_slot<Cache> ? pick(11, 14) : pick(0, 4)};
      config.window = limits.window;
      config.sinks = limits.sinks;
      config.slack = limits.slack;
    }
    Cache cache(test_config<T>(config));
    const WindowRule rule{limits.window, limits.sinks};
    std::vector<ReferenceLayer<T>> reference(layers, ReferenceLayer<T>(batch));
    std::vector<std::size_t> lengths(layers, 0);
    SCOPED_TRACE("sequence " + std::to_string(sequence) + " window " + std::to_string(limits.window) + " sinks " +
                 std::to_string(limits.sinks) + " slack " + std::to_string(limits.slack));

    const auto check_length = [&] {
      const bool agree = std::all_of(lengths.begin(), lengths.end(), [&](std::size_t n) { return n == lengths[0]; });
      if (agree) {
        ASSERT_EQ(cache.length(), lengths[0]);
      } else {
        ASSERT_THROW((void)cache.length(), std::runtime_error);
      }
    };

    // Updates one layer with `tokens` fresh tokens and checks the returned history.
    const auto update = [&](std::size_t layer, std::size_t tokens) {
      const std::size_t start = lengths[layer];
      const Block<input_t<T>> k({batch, kv_heads, tokens, head_dim}, rng());
      const Block<input_t<T>> v({batch, kv_heads, tokens, head_dim}, rng());
      const auto history = cache.update(layer, k.view(), v.view(), arange(start, tokens));
      ReferenceLayer<T>& ref = reference[layer];
      for (std::size_t t = 0; t < tokens; ++t) {
        std::vector<StoredToken<T>> token = store_tokens<T>(k.view(), v.view(), t);
        for (std::size_t b = 0; b < batch; ++b) ref.written[b].push_back(std::move(token[b]));
      }
      lengths[layer] = start + tokens;

      const auto rows = flatten(history);
      ref.held.clear();
      for (const auto& [position, row] : rows) {
        ASSERT_LT(position, static_cast<std::int64_t>(lengths[layer]));
        ASSERT_EQ(row, ref.row(position)) << "data of position " << position;
        ref.held.insert(position);
      }
      // A slot's ring and a sequence's blocks return what they hold around the window: at most
      // the ring, or the window's blocks and the sinks'.
      std::size_t most = limits.sinks + limits.window - 1 + tokens;
      if (is_slot<Cache>) most = limits.sinks + limits.window + limits.slack;
      if (is_paged<Cache>) most += 2 * (kPooledBlockTokens - 1);
      // Every key some query of this chunk may see must be there.
      for (std::size_t p = 0; p < lengths[layer]; ++p) {
        if (rule.read_from(start, p)) {
          ASSERT_TRUE(ref.held.count(static_cast<std::int64_t>(p))) << "missing position " << p;
        }
      }
      if (limits.window != 0) {
        ASSERT_LE(rows.size(), most);  // nothing no query reads, or not much
        ASSERT_EQ(history.window, limits.window);
        ASSERT_EQ(history.sinks, limits.sinks);
      }
      // The chunk's last query reads what the reference model's uncached attention reads.
      if (tokens != 0 && pick(0, 3) == 0) {
        const std::vector<std::int64_t> last{static_cast<std::int64_t>(start + tokens - 1)};
        expect_reference_attention(history, ref.streams(), last, rule, kv_heads, 2, head_dim, rng());
      }
    };

    for (int op = 0; op < operations; ++op) {
      const std::size_t kind = pick(0, 9);
      const std::size_t common = *std::min_element(lengths.begin(), lengths.end());
      if (kind <= 4) {  // a forward pass, sometimes stopped part-way
        const std::size_t tokens = pick(0, 3) == 0 ? pick(2, 12) : 1;
        if (common + tokens > capacity) continue;
        const std::size_t stop = pick(0, 5) == 0 ? pick(1, layers) : layers;
        const bool agree = std::all_of(lengths.begin(), lengths.end(), [&](std::size_t n) { return n == common; });
        if (!agree) continue;
        for (std::size_t layer = 0; layer < stop; ++layer) update(layer, tokens);
      } else if (kind <= 6) {  // truncate, valid or not
        const std::size_t n = pick(0, common + 2);
        const auto forget_after = [&] {
          for (ReferenceLayer<T>& ref : reference) {
            for (Stream<T>& stream : ref.written) stream.resize(n);
            ref.held.erase(ref.held.lower_bound(static_cast<std::int64_t>(n)), ref.held.end());
          }
          std::fill(lengths.begin(), lengths.end(), n);
        };
        // Valid for sure when every layer's last update returned what a query at n reads.
        bool returned = true;
        for (std::size_t layer = 0; layer < layers && limits.window != 0; ++layer) {
          const std::size_t from = std::max(limits.sinks, rule.first_read(n));
          for (std::size_t p = from; p < n; ++p)
            returned = returned && reference[layer].held.count(static_cast<std::int64_t>(p));
        }
        // A paged sequence gave back whole blocks: it cannot go back into one.
        if constexpr (is_paged<Cache>) {
          const std::size_t last = n == 0 ? 0 : (n - 1) / kPooledBlockTokens;
          if (n != 0 && last < cache.block_table().size() && cache.block_table()[last] == PagedKvCache<T>::kReleased)
            returned = false;
        }
        if (n > common) {
          ASSERT_THROW(cache.truncate(n), std::out_of_range) << "truncate(" << n << ")";
        } else if (returned) {
          ASSERT_NO_THROW(cache.truncate(n)) << "truncate(" << n << ")";
          forget_after();
        } else {
          // A ring holds older keys than it returns (its slack, for truncate): it may take this
          // or throw, and if it takes it, the updates after check every key a query reads.
          bool taken = true;
          try {
            cache.truncate(n);
          } catch (const std::out_of_range&) {
            taken = false;
          }
          if (taken) forget_after();
        }
      } else if (kind == 7) {
        cache.reset();
        reference.assign(layers, ReferenceLayer<T>(batch));
        std::fill(lengths.begin(), lengths.end(), 0);
      } else {  // a bad call: must throw and change nothing (the next update checks the data)
        const std::size_t layer = pick(0, layers - 1);
        const Block<input_t<T>> k({batch, kv_heads, 1, head_dim}, rng());
        const Block<input_t<T>> wrong({batch, kv_heads + 1, 1, head_dim}, rng());
        switch (pick(0, 3)) {
          case 0:
            ASSERT_THROW(cache.update(layers, k.view(), k.view(), arange(lengths[0], 1)), std::out_of_range);
            break;
          case 1:
            ASSERT_THROW(cache.update(layer, k.view(), k.view(), arange(lengths[layer] + 1, 1)), std::invalid_argument);
            break;
          case 2:
            ASSERT_THROW(cache.update(layer, k.view(), wrong.view(), arange(lengths[layer], 1)), std::invalid_argument);
            break;
          default:
            ASSERT_THROW(cache.update(layer, k.view(), k.view(), arange(lengths[layer], 2)), std::invalid_argument);
        }
      }
      check_length();
      if constexpr (is_paged<Cache>) {
        ASSERT_NO_THROW(cache.block_pool().check_invariants());
        // A windowed sequence holds the sinks' blocks and those of its window, its slack and a
        // chunk, however long it ran.
        if (limits.window != 0) {
          const std::size_t b = kPooledBlockTokens;
          const std::size_t most = (limits.sinks + b - 1) / b + (limits.window + limits.slack + 12 + b - 1) / b + 1;
          ASSERT_LE(cache.bytes(), most * cache.block_pool().block_bytes());
        }
      }
    }
  }
}

// ---- paged sequences as the rows of one batch --------------------------------------------------

template <class T>
class BatchDifferential : public ::testing::Test {};
using BatchFormats = gtest_types<filter<own_code_path, formats>>;
TYPED_TEST_SUITE(BatchDifferential, BatchFormats, FormatName);

// Up to four sequences of one pool (new ones, forks of live ones) written through PagedBatch
// updates of random subsets of them in random order, passes stopped part-way, truncates, resets
// and bad batch calls; after every operation the pool's invariants hold, each sequence's history
// holds what the reference says a query reads (and, with a window, its blocks stay bounded), and
// now and then attention over the batch equals a call per sequence.
TYPED_TEST(BatchDifferential, RandomBatchOperationsMatchTheReferenceAndKeepThePoolConsistent) {
  using T = TypeParam;
  using In = input_t<T>;
  constexpr std::size_t layers = 2, kv_heads = 2, q_heads = 4, head_dim = 8, block = 4, capacity = 48, most = 4;
  std::mt19937_64 rng(20261205);
  const auto pick = [&](std::size_t lo, std::size_t hi) {
    return std::uniform_int_distribution<std::size_t>(lo, hi)(rng);
  };
  std::size_t batch_updates = 0, shared_reads = 0, given_back = 0, refused = 0;

  for (int run = 0; run < 40; ++run) {
    const std::size_t window = run % 2 == 1 ? pick(2, 10) : 0, sinks = window != 0 ? pick(0, 3) : 0;
    const std::size_t slack = window != 0 ? pick(0, 3) : 0;
    const WindowRule rule{window, sinks};
    SCOPED_TRACE("run " + std::to_string(run) + " window " + std::to_string(window) + " sinks " +
                 std::to_string(sinks) + " slack " + std::to_string(slack));
    const KvCacheConfig scales = test_config<T>({.layers = layers, .kv_heads = kv_heads, .head_dim = head_dim});
    // Enough blocks that every sequence reaches capacity: no valid call runs out.
    BlockPool<T> pool({.layers = layers,
                       .kv_heads = kv_heads,
                       .head_dim = head_dim,
                       .block_tokens = block,
                       .blocks = most * (capacity / block + 1),
                       .capacity = capacity,
                       .window = window,
                       .sinks = sinks,
                       .slack = slack,
                       .key_scales = scales.key_scales,
                       .value_scales = scales.value_scales});
    struct Live {
      std::unique_ptr<PagedKvCache<T>> seq;
      std::vector<std::map<std::int64_t, Row>> written;  // per layer: position -> stored row
    };
    std::vector<Live> live;
    const auto length = [](const Live& l, std::size_t layer) { return l.seq->length(layer); };

    // Every sequence's history against its reference: the data of what it returns, and every
    // position a query at its length reads.
    const auto check_all = [&] {
      ASSERT_NO_THROW(pool.check_invariants());
      for (const Live& l : live) {
        for (std::size_t layer = 0; layer < layers; ++layer) {
          const std::size_t n = length(l, layer);
          const auto held = flatten(l.seq->history(layer));
          for (const auto& [p, row] : held) {
            ASSERT_LT(p, static_cast<std::int64_t>(n));
            ASSERT_EQ(row, l.written[layer].at(p)) << "layer " << layer << " position " << p;
          }
          for (std::size_t p = 0; p < n; ++p) {
            if (rule.reads(n, p)) {
              ASSERT_TRUE(held.count(static_cast<std::int64_t>(p))) << "layer " << layer << " position " << p;
            }
          }
        }
        if (window != 0) {
          const std::size_t bound = (sinks + block - 1) / block + (window + slack + 8 + block - 1) / block + 1;
          ASSERT_LE(l.seq->bytes(), bound * pool.block_bytes());
          given_back += static_cast<std::size_t>(
              std::count(l.seq->block_table().begin(), l.seq->block_table().end(), PagedKvCache<T>::kReleased));
        }
      }
    };

    for (int op = 0; op < 60; ++op) {
      const std::size_t kind = pick(0, 9);
      if (live.empty() || (kind == 0 && live.size() < most)) {  // a new sequence, or a fork of a live one
        if (live.empty() || pick(0, 1) == 0) {
          live.push_back({std::make_unique<PagedKvCache<T>>(pool), std::vector<std::map<std::int64_t, Row>>(layers)});
        } else {
          const Live& from = live[pick(0, live.size() - 1)];
          live.push_back({std::make_unique<PagedKvCache<T>>(from.seq->fork()), from.written});
        }
      } else if (kind <= 5) {  // a pass over some sequences, in any order, maybe stopped part-way
        std::vector<std::size_t> rows;
        for (std::size_t i = 0; i < live.size(); ++i) {
          if (pick(0, 2) != 0) rows.insert(rows.begin() + static_cast<std::ptrdiff_t>(pick(0, rows.size())), i);
        }
        if (rows.empty()) continue;
        const std::size_t tokens = pick(0, 3) == 0 ? pick(2, 8) : 1;
        bool room = true;
        for (const std::size_t r : rows)
          for (std::size_t layer = 0; layer < layers; ++layer)
            room = room && length(live[r], layer) + tokens <= capacity;
        if (!room) continue;
        std::vector<PagedKvCache<T>*> members;
        for (const Live& l : live) members.push_back(l.seq.get());
        PagedBatch<T> batch(members);
        const std::size_t stop = pick(0, 4) == 0 ? pick(1, layers) : layers;
        for (std::size_t layer = 0; layer < stop; ++layer) {
          const Block<In> k({rows.size(), kv_heads, tokens, head_dim}, rng()),
              v({rows.size(), kv_heads, tokens, head_dim}, rng());
          std::vector<std::int64_t> positions;
          for (const std::size_t r : rows) {
            const auto p = arange(length(live[r], layer), tokens);
            positions.insert(positions.end(), p.begin(), p.end());
          }
          const History<T> history = batch.update(
              layer, k.view(), v.view(), Positions(positions.data(), tokens, tokens), Rows(rows.data(), rows.size()));
          ++batch_updates;
          for (std::size_t i = 0; i < rows.size(); ++i) {
            Live& l = live[rows[i]];
            const std::size_t row_offset = i * kv_heads * tokens * head_dim;
            const TensorView<const In> k_row(k.data.data() + row_offset, {1, kv_heads, tokens, head_dim});
            const TensorView<const In> v_row(v.data.data() + row_offset, {1, kv_heads, tokens, head_dim});
            for (std::size_t t = 0; t < tokens; ++t)
              l.written[layer][positions[i * tokens + t]] = row_of<T>(k_row, v_row, t);
            ASSERT_EQ(flatten_row(history, i), flatten(l.seq->history(layer))) << "batch row " << i;
          }
          ASSERT_EQ(history.window, window);
        }
      } else if (kind == 6) {  // attention over the batch's history equals a call per sequence
        std::vector<PagedKvCache<T>*> members;
        for (const Live& l : live) members.push_back(l.seq.get());
        PagedBatch<T> batch(members);
        const std::size_t layer = pick(0, layers - 1);
        std::vector<std::int64_t> positions;
        for (const Live& l : live) positions.push_back(static_cast<std::int64_t>(length(l, layer)));
        const Block<float> q({live.size(), q_heads, 1, head_dim}, rng());
        std::vector<float> out(q.data.size(), std::numeric_limits<float>::quiet_NaN());
        const History<T> history = batch.history(layer);
        causal_attention(q.view(), Positions(positions.data(), 1, 1), history, TensorView<float>(out.data(), q.shape),
                         {.threads = pick(1, 2)});
        for (std::size_t i = 0; i < live.size(); ++i) {
          std::vector<float> alone(q_heads * head_dim, std::numeric_limits<float>::quiet_NaN());
          const TensorView<const float> q_row(q.data.data() + i * alone.size(), {1, q_heads, 1, head_dim});
          causal_attention(q_row, Positions(positions[i]), live[i].seq->history(layer),
                           TensorView<float>(alone.data(), q_row.shape()));
          for (std::size_t x = 0; x < alone.size(); ++x)
            ASSERT_NEAR(out[i * alone.size() + x], alone[x], 1e-5) << "sequence " << i << " layer " << layer;
        }
        bool shared = false;  // two batch rows read one stored block
        for (const Segment<T>& segment : history.segments) {
          std::set<std::size_t> stored;
          for (std::size_t i = 0; i < segment.batch(); ++i)
            if (segment.tokens(i) != 0 && !stored.insert(segment.stored_row(i)).second) shared = true;
        }
        if (shared) ++shared_reads;
      } else if (kind == 7) {  // truncate one sequence: refused only where it gave back what a query there reads
        Live& l = live[pick(0, live.size() - 1)];
        const std::size_t n = pick(0, std::min(length(l, 0), length(l, 1)));
        bool gone = false;
        for (std::size_t p = std::max(sinks, rule.first_read(n)); p < n; ++p)
          gone = gone || l.seq->block_table()[p / block] == PagedKvCache<T>::kReleased;
        if (gone) {
          const std::size_t free = pool.free_blocks();
          ASSERT_THROW(l.seq->truncate(n), std::out_of_range) << "truncate(" << n << ")";
          ASSERT_EQ(pool.free_blocks(), free);
          ++refused;
        } else {
          ASSERT_NO_THROW(l.seq->truncate(n)) << "truncate(" << n << ")";
          for (auto& w : l.written) w.erase(w.lower_bound(static_cast<std::int64_t>(n)), w.end());
        }
      } else if (kind == 8) {  // a sequence finishes, or is emptied
        const std::size_t i = pick(0, live.size() - 1);
        if (pick(0, 1) == 0) {
          live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
        } else {
          live[i].seq->reset();
          for (auto& w : live[i].written) w.clear();
        }
      } else {  // a bad batch call: it throws and nothing changes
        std::vector<PagedKvCache<T>*> members;
        for (const Live& l : live) members.push_back(l.seq.get());
        PagedBatch<T> batch(members);
        const std::size_t layer = pick(0, layers - 1), r = pick(0, live.size() - 1);
        const Block<In> k({2, kv_heads, 1, head_dim}, rng());
        std::vector<std::int64_t> positions{static_cast<std::int64_t>(length(live[r], layer)),
                                            static_cast<std::int64_t>(length(live[r], layer))};
        std::vector<std::vector<std::map<std::int64_t, Row>>> before;
        for (const Live& l : live) {
          before.emplace_back();
          for (std::size_t x = 0; x < layers; ++x) before.back().push_back(flatten(l.seq->history(x)));
        }
        const std::size_t free = pool.free_blocks();
        const std::vector<std::size_t> twice{r, r}, past{r, live.size()};
        switch (pick(0, 2)) {
          case 0:
            ASSERT_THROW(
                batch.update(layer, k.view(), k.view(), Positions(positions.data(), 1, 1), Rows(twice.data(), 2)),
                std::invalid_argument);
            break;
          case 1:
            ASSERT_THROW(
                batch.update(layer, k.view(), k.view(), Positions(positions.data(), 1, 1), Rows(past.data(), 2)),
                std::out_of_range);
            break;
          default: {
            const Block<In> one({1, kv_heads, 1, head_dim}, rng());
            const std::int64_t skipped = positions[0] + 1;
            ASSERT_THROW(batch.update(layer, one.view(), one.view(), Positions(skipped), Rows(r)),
                         std::invalid_argument);
          }
        }
        ASSERT_EQ(pool.free_blocks(), free);
        for (std::size_t i = 0; i < live.size(); ++i)
          for (std::size_t x = 0; x < layers; ++x) ASSERT_EQ(flatten(live[i].seq->history(x)), before[i][x]);
      }
      check_all();
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
  EXPECT_GT(batch_updates, 1000U);
  EXPECT_GT(shared_reads, 20U);
  EXPECT_GT(given_back, 200U);
  EXPECT_GT(refused, 5U);
}

}  // namespace
}  // namespace kvcache::testing
