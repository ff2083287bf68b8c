// SPDX-License-Identifier: Apache-2.0
// The two prefix-reuse scenarios of a paged pool, as an engine drives them, built against any
// revision's headers: exit 0 if a prefix hit hands out only the rows of its prompt's tokens and
// a freed prefix loses its tail first, 1 otherwise. Every value of a token's K and V rows is its
// id, so the rows a hit hands out say which tokens they belong to.
//
//   g++ -std=c++20 -I include tests/scenarios/paged_prefix_reuse.cpp -o scenarios && ./scenarios

#include <cstdint>
#include <cstdio>
#include <kvcache/kvcache.hpp>
#include <vector>

namespace {

using Ids = std::vector<kvcache::TokenId>;
constexpr std::size_t kDim = 4;

/// Feeds token `id` at the sequence's next position, its K and V rows holding the id.
void feed(kvcache::PagedKvCache<float>& seq, kvcache::TokenId id) {
  const std::vector<float> row(kDim, static_cast<float>(id));
  const kvcache::TensorView<const float> kv(row.data(), {1, 1, 1, kDim});
  const auto position = static_cast<std::int64_t>(seq.length());
  (void)seq.update(0, kv, kv, position);
}

/// The token each position of the sequence holds, read from its rows.
Ids held(kvcache::PagedKvCache<float>& seq) {
  Ids tokens;
  for (const auto& segment : seq.history(0).segments) {
    for (std::size_t t = 0; t < segment.tokens(0); ++t)
      tokens.push_back(static_cast<kvcache::TokenId>(*segment.keys.row(0, 0, t)));
  }
  return tokens;
}

/// Serves a prompt as docs/paged.md says, then generates `generated`, each id given before its
/// token; returns the tokens reused.
std::size_t serve(kvcache::PagedKvCache<float>& seq, const Ids& prompt, const Ids& generated) {
  std::size_t skip = seq.reuse_prefix(prompt);
  const std::size_t reused = skip;
  if (skip == prompt.size()) {  // an older revision's recipe for a prompt found whole
    seq.truncate(prompt.size() - 1);
    skip = prompt.size() - 1;
  }
  for (std::size_t i = skip; i < prompt.size(); ++i) feed(seq, prompt[i]);
  for (const kvcache::TokenId id : generated) {
    seq.add_token_ids(Ids{id});
    feed(seq, id);
  }
  return reused;
}

}  // namespace

int main() {
  int failures = 0;
  {  // 1: a block keyed by ids that are not its rows'
    kvcache::BlockPool<float> pool({.layers = 1, .kv_heads = 1, .head_dim = kDim, .block_tokens = 4, .blocks = 16});
    const Ids prompt = {1, 2, 3, 4, 5, 6, 7, 8}, generated = {100, 101, 102, 103};
    for (int request = 0; request < 2; ++request) {
      kvcache::PagedKvCache<float> seq(pool);
      (void)serve(seq, prompt, generated);
    }
    const Ids other = {1, 2, 3, 4, 5, 6, 7, 100, 9};
    kvcache::PagedKvCache<float> seq(pool);
    const std::size_t reused = serve(seq, other, {});
    const bool right = held(seq) == other;
    std::printf("scenario 1: prompt 1..7,100,9 after two requests 1..8 + 100..103: reused %zu tokens, rows %s\n",
                reused, right ? "its own" : "of OTHER tokens");
    failures += right ? 0 : 1;
  }
  {  // 2: a freed prefix evicted root first
    kvcache::BlockPool<float> pool({.layers = 1, .kv_heads = 1, .head_dim = kDim, .block_tokens = 4, .blocks = 4});
    const Ids prompt = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13};
    {
      kvcache::PagedKvCache<float> seq(pool);
      (void)serve(seq, prompt, {});
    }
    {
      kvcache::PagedKvCache<float> filler(pool);  // takes the never-keyed block, then evicts one
      for (const kvcache::TokenId id : {50, 51, 52, 53, 54}) feed(filler, id);
    }
    kvcache::PagedKvCache<float> seq(pool);
    const std::size_t reused = seq.reuse_prefix(prompt);
    std::printf("scenario 2: a 13-token prompt again after one of its 3 freed blocks was evicted: reused %zu (8 %s)\n",
                reused, reused == 8 ? "expected" : "EXPECTED");
    failures += reused == 8 ? 0 : 1;
  }
  return failures == 0 ? 0 : 1;
}
