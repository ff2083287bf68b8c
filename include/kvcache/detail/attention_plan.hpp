// SPDX-License-Identifier: Apache-2.0
#pragma once

// How an attention call's work is cut into items. Batch rows whose histories begin with the
// same stored rows (sequences forked from one, or sharing a prompt's blocks) form a prefix
// tree: each run of keys that several rows share becomes items whose rows are the query rows of
// all of them, so those keys are read once; each row's keys after the runs it shares are its
// own items. Items are split by keys where the work would otherwise leave threads idle, and a
// (batch row, kv head, block of queries) whose keys several items read is merged by log-sum-exp.

#include <algorithm>
#include <cstddef>
#include <numeric>
#include <span>
#include <utility>
#include <vector>

#include "kvcache/detail/worker_pool.hpp"
#include "kvcache/version.hpp"
#include "kvcache/views.hpp"

namespace kvcache {
inline namespace KVCACHE_ABI {
namespace detail {

/// One work item: the queries [first_query, first_query + queries) of kv head `kv_head` of the
/// batch rows `members` (empty: of `batch` alone), over keys [key_begin, key_end) of `batch`'s
/// history, which every member reads alike. An item with `slots` leaves each member's running
/// state in its partial slot; one without writes its row's output.
struct AttentionItem {
  std::size_t batch = 0;
  std::size_t kv_head = 0;
  std::size_t first_query = 0;
  std::size_t queries = 0;
  std::size_t key_begin = 0;
  std::size_t key_end = 0;
  std::size_t partial = 0;  // for merge(): the first partial slot of the (batch, kv head, block)
  std::span<const std::size_t> members{};
  std::span<const std::size_t> slots{};

  [[nodiscard]] std::size_t member_count() const noexcept { return members.empty() ? 1 : members.size(); }
  [[nodiscard]] std::size_t member(std::size_t m) const noexcept { return members.empty() ? batch : members[m]; }
};

/// Keys [key_begin, key_end) that the batch rows rows[rows_at, rows_at + count) all read from the
/// same stored rows, at the same place in their histories.
struct KeyRange {
  std::size_t rows_at = 0;
  std::size_t count = 0;
  std::size_t key_begin = 0;
  std::size_t key_end = 0;
};

/// The batch rows of a call over `segments` as a prefix tree of the keys they share: appends to
/// `ranges`, ancestors first, the runs of at least `min_shared` keys that several rows read from
/// the same stored rows (their rows listed in `rows`), then each row's keys after them (a row
/// with no key and no run gets an empty range, so that its output is written). `keys[b]` is the
/// keys batch row b reads.
template <class T>
void share_keys(std::span<const Segment<T>> segments, std::span<const std::size_t> keys, std::size_t min_shared,
                std::vector<std::size_t>& rows, std::vector<KeyRange>& ranges) {
  struct Group {
    std::vector<std::size_t> rows;
    std::size_t segment = 0;  // every row reads segments [0, segment) alike
    std::size_t key = 0;      // the keys of those segments
    std::size_t pending = 0;  // the first of them no emitted range covers
  };
  // What batch row b reads of segment s: rows alike there read the same keys.
  const auto read = [&](const Segment<T>& s, std::size_t b) {
    const std::size_t n = s.tokens(b);
    return std::pair{n, n == 0 ? std::size_t{0} : s.stored_row(b)};
  };
  const auto emit = [&](std::span<const std::size_t> members, std::size_t begin, std::size_t end) {
    ranges.push_back({rows.size(), members.size(), begin, end});
    rows.insert(rows.end(), members.begin(), members.end());
  };
  std::vector<Group> stack;
  stack.push_back({std::vector<std::size_t>(keys.size()), 0, 0, 0});
  std::iota(stack.back().rows.begin(), stack.back().rows.end(), std::size_t{0});
  while (!stack.empty()) {
    Group g = std::move(stack.back());
    stack.pop_back();
    if (g.rows.size() == 1) {
      const std::size_t b = g.rows.front();
      if (keys[b] > g.pending || g.pending == 0) emit(g.rows, g.pending, keys[b]);
      continue;
    }
    while (g.segment < segments.size()) {
      const Segment<T>& s = segments[g.segment];
      const auto first = read(s, g.rows.front());
      if (!std::all_of(g.rows.begin() + 1, g.rows.end(), [&](std::size_t b) { return read(s, b) == first; })) break;
      g.key += first.first;
      ++g.segment;
    }
    if (g.key - g.pending >= min_shared) {
      emit(g.rows, g.pending, g.key);
      g.pending = g.key;
    }
    if (g.segment == segments.size()) {  // every row read all its keys alike
      if (g.key > g.pending || g.pending == 0) emit(g.rows, g.pending, g.key);
      continue;
    }
    // Rows alike at the next segment go on together; pushed last first, so that they are taken
    // in order and ancestors' ranges always come before their descendants'.
    const Segment<T>& s = segments[g.segment];
    std::stable_sort(g.rows.begin(), g.rows.end(),
                     [&](std::size_t a, std::size_t b) { return read(s, a) < read(s, b); });
    std::vector<Group> children;
    for (std::size_t i = 0; i < g.rows.size();) {
      std::size_t j = i + 1;
      while (j < g.rows.size() && read(s, g.rows[j]) == read(s, g.rows[i])) ++j;
      children.push_back({std::vector<std::size_t>(g.rows.begin() + static_cast<std::ptrdiff_t>(i),
                                                   g.rows.begin() + static_cast<std::ptrdiff_t>(j)),
                          g.segment, g.key, g.pending});
      i = j;
    }
    for (auto c = children.rbegin(); c != children.rend(); ++c) stack.push_back(std::move(*c));
  }
}

/// The shape of a call, as the plan needs it.
struct PlanShape {
  std::size_t batch = 0;
  std::size_t kv_heads = 0;
  std::size_t queries = 0;
  std::size_t block_queries = 1;  // queries an item takes of each member
  std::size_t group = 1;          // query heads per kv head
  std::size_t row_bytes = 1;      // of one stored K (or V) row
};

/// A (batch row, kv head, block of queries) whose output is merged from `pieces` partial slots
/// from unit.partial on.
struct MergeUnit {
  AttentionItem unit;
  std::size_t pieces = 0;
};

/// The items of one call, the threads to run them on, and the merges that follow.
struct AttentionPlan {
  std::vector<AttentionItem> items;  // largest first
  std::vector<MergeUnit> merges;
  std::size_t partial_slots = 0;
  std::size_t threads = 1;
  std::size_t max_rows = 0;                 // query rows the largest item scores
  std::vector<std::size_t> members, slots;  // what the items' spans point into
};

/// Keys below which a run several rows share is left to each of them: an item of its own, and
/// the merge after it, cost about what reading that many keys again does.
inline constexpr std::size_t kMinSharedKeys = 64;
/// Query rows an item scores at most: a run shared by more rows than this is read once per this
/// many (the scores of a tile take rows x tile keys).
inline constexpr std::size_t kMaxItemRows = 64;
/// Keys below which an item is not split across threads.
inline constexpr std::size_t kMinSplitKeys = 512;
/// What reading a key costs, in rows scored against it: the weight items are balanced by.
inline constexpr std::size_t kKeyCost = 4;

/// Threads for a call: as requested, or (0) one per `per_thread` bytes of K and V read, at most
/// the hardware's.
inline std::size_t attention_threads(std::size_t requested, std::size_t work_bytes, std::size_t per_thread) noexcept {
  if (requested != 0) return requested;
  const std::size_t wanted = work_bytes / std::max<std::size_t>(per_thread, 1);
  if (wanted <= 1) return 1;
  return std::min(wanted, hardware_threads());
}

/// Cuts a call over `segments` into items: the prefix tree's ranges (share_keys) for every kv
/// head and block of queries, each split by keys where the work would otherwise leave threads
/// idle, largest first.
template <class T>
AttentionPlan plan_attention(std::span<const Segment<T>> segments, const PlanShape& shape,
                             std::size_t requested_threads, std::size_t bytes_per_thread) {
  AttentionPlan plan;
  std::vector<std::size_t> keys(shape.batch, 0);
  for (std::size_t b = 0; b < shape.batch; ++b) {
    for (const Segment<T>& s : segments) keys[b] += s.tokens(b);
  }
  std::vector<std::size_t> rows;
  std::vector<KeyRange> ranges;
  share_keys(segments, keys, kMinSharedKeys, rows, ranges);

  const std::size_t blocks = (shape.queries + shape.block_queries - 1) / shape.block_queries;
  const std::size_t per_member = shape.block_queries * shape.group;
  const std::size_t max_members = std::max<std::size_t>(1, kMaxItemRows / per_member);
  struct Piece {
    std::size_t range, first_member, members, kv_head, block, key_begin, key_end, cost;
  };
  std::vector<Piece> pieces;
  std::size_t work_bytes = 0;
  std::size_t total_cost = 0;
  for (std::size_t r = 0; r < ranges.size(); ++r) {
    const KeyRange& range = ranges[r];
    const std::size_t n = range.key_end - range.key_begin;
    for (std::size_t m = 0; m < range.count; m += max_members) {
      const std::size_t members = std::min(max_members, range.count - m);
      for (std::size_t h = 0; h < shape.kv_heads; ++h) {
        for (std::size_t q = 0; q < blocks; ++q) {
          const std::size_t queries = std::min(shape.block_queries, shape.queries - q * shape.block_queries);
          const std::size_t cost = n * (kKeyCost + members * queries * shape.group);
          pieces.push_back({r, m, members, h, q, range.key_begin, range.key_end, cost});
          work_bytes += 2 * n * shape.row_bytes;
          total_cost += cost;
        }
      }
    }
  }
  plan.threads = attention_threads(requested_threads, work_bytes, bytes_per_thread);

  // Splits: an item much larger than an even share of the work is cut by keys, so that the
  // last items to finish are short.
  if (plan.threads > 1) {
    const std::size_t share = std::max<std::size_t>(total_cost / (2 * plan.threads), 1);
    std::vector<Piece> split;
    for (const Piece& p : pieces) {
      const std::size_t n = p.key_end - p.key_begin;
      const std::size_t cuts =
          std::clamp<std::size_t>((p.cost + share - 1) / share, 1, std::max<std::size_t>(n / kMinSplitKeys, 1));
      for (std::size_t c = 0; c < cuts; ++c) {
        Piece part = p;
        part.key_begin = p.key_begin + n * c / cuts;
        part.key_end = p.key_begin + n * (c + 1) / cuts;
        part.cost = p.cost / cuts;
        split.push_back(part);
      }
    }
    pieces = std::move(split);
  }

  // Partial slots: a (batch row, kv head, block) read by several pieces, or by a piece of
  // several rows, has one slot per piece, in key order (the order pieces were made in).
  const auto unit_of = [&](std::size_t b, std::size_t h, std::size_t q) {
    return (b * shape.kv_heads + h) * blocks + q;
  };
  std::vector<std::size_t> count(shape.batch * shape.kv_heads * blocks, 0);
  std::vector<char> shared(count.size(), 0);
  for (const Piece& p : pieces) {
    for (std::size_t m = 0; m < p.members; ++m) {
      const std::size_t u = unit_of(rows[ranges[p.range].rows_at + p.first_member + m], p.kv_head, p.block);
      ++count[u];
      if (p.members > 1) shared[u] = 1;
    }
  }
  std::vector<std::size_t> next(count.size(), 0);
  for (std::size_t u = 0; u < count.size(); ++u) {
    if (count[u] < 2 && shared[u] == 0) continue;
    next[u] = plan.partial_slots;
    const std::size_t b = u / blocks / shape.kv_heads, h = u / blocks % shape.kv_heads, q = u % blocks;
    plan.merges.push_back({{.batch = b,
                            .kv_head = h,
                            .first_query = q * shape.block_queries,
                            .queries = std::min(shape.block_queries, shape.queries - q * shape.block_queries),
                            .partial = plan.partial_slots},
                           count[u]});
    plan.partial_slots += count[u];
  }

  struct Spans {
    std::size_t members_at, slots_at;
  };
  std::vector<Spans> spans;
  plan.items.reserve(pieces.size());
  spans.reserve(pieces.size());
  for (const Piece& p : pieces) {
    const KeyRange& range = ranges[p.range];
    const std::size_t first = rows[range.rows_at + p.first_member];
    const std::size_t queries = std::min(shape.block_queries, shape.queries - p.block * shape.block_queries);
    AttentionItem item{.batch = first,
                       .kv_head = p.kv_head,
                       .first_query = p.block * shape.block_queries,
                       .queries = queries,
                       .key_begin = p.key_begin,
                       .key_end = p.key_end};
    Spans at{plan.members.size(), plan.slots.size()};
    if (p.members > 1) {
      plan.members.insert(plan.members.end(),
                          rows.begin() + static_cast<std::ptrdiff_t>(range.rows_at + p.first_member),
                          rows.begin() + static_cast<std::ptrdiff_t>(range.rows_at + p.first_member + p.members));
    }
    for (std::size_t m = 0; m < p.members; ++m) {
      const std::size_t u = unit_of(rows[range.rows_at + p.first_member + m], p.kv_head, p.block);
      if (count[u] >= 2 || shared[u] != 0) plan.slots.push_back(next[u]++);
    }
    plan.max_rows = std::max(plan.max_rows, p.members * queries * shape.group);
    plan.items.push_back(item);
    spans.push_back(at);
  }
  for (std::size_t i = 0; i < plan.items.size(); ++i) {
    const std::size_t members_end = i + 1 < spans.size() ? spans[i + 1].members_at : plan.members.size();
    const std::size_t slots_end = i + 1 < spans.size() ? spans[i + 1].slots_at : plan.slots.size();
    plan.items[i].members =
        std::span<const std::size_t>(plan.members).subspan(spans[i].members_at, members_end - spans[i].members_at);
    plan.items[i].slots =
        std::span<const std::size_t>(plan.slots).subspan(spans[i].slots_at, slots_end - spans[i].slots_at);
  }
  if (plan.threads > 1) {
    std::vector<std::size_t> order(pieces.size());
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t a, std::size_t b) { return pieces[a].cost > pieces[b].cost; });
    std::vector<AttentionItem> sorted;
    sorted.reserve(order.size());
    for (const std::size_t i : order) sorted.push_back(plan.items[i]);
    plan.items = std::move(sorted);
  }
  plan.threads = std::min(plan.threads, std::max<std::size_t>(plan.items.size(), 1));
  return plan;
}

}  // namespace detail
}  // namespace KVCACHE_ABI
}  // namespace kvcache
