// SPDX-License-Identifier: Apache-2.0
// Files replaced atomically (detail/atomic_file.hpp), as save_state writes them: a writer stopped
// part-way, at bytes the test chooses, leaves the old file at the path, which loads whole (also
// while the writer is still alive), then killed leaves only a temporary file nothing reads; a
// writer that finishes leaves the new file; a write the system refuses names the file and the
// reason and leaves the path as it was.

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>

#include <Eigen/Core>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "child_process.hpp"
#include "kvcache/detail/atomic_file.hpp"
#include "kvcache/kv_cache.hpp"
#include "kvcache/state_file.hpp"

namespace kvcache::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

/// A directory of the test's own, removed afterwards.
struct Dir {
  std::filesystem::path path =
      std::filesystem::temp_directory_path() / ("kvcache_atomic_file_test." + std::to_string(::getpid()));
  Dir() {
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~Dir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
};

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

/// A cache of 2 layers holding `tokens` tokens whose values depend on `seed`.
KvCache<float> filled(std::size_t tokens, float seed) {
  KvCache<float> cache({.layers = 2, .kv_heads = 2, .head_dim = 16, .capacity = 256});
  std::vector<float> k(2 * tokens * 16), v(k.size());
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = seed + static_cast<float>(i);
    v[i] = seed - static_cast<float>(i);
  }
  for (std::size_t l = 0; l < 2; ++l) {
    (void)cache.update(l, TensorView<const float>(k.data(), {1, 2, tokens, 16}),
                       TensorView<const float>(v.data(), {1, 2, tokens, 16}), next_positions(0, tokens));
  }
  return cache;
}

/// The state file of `cache`, as bytes.
std::string state_bytes(const KvCache<float>& cache, const std::string& metadata) {
  std::ostringstream out;
  save_state(cache, out, metadata);
  return out.str();
}

/// What a forked writer's save to `path` came to, when it may write no more than `limit` bytes
/// to any file: when it reaches the limit it stops itself (SIGSTOP) in the write; this process
/// then calls `while_stopped` and kills it (SIGKILL). Returns whether it was stopped part-way
/// (false: it finished, exiting 0).
template <class WhileStopped>
bool save_stopped_at(const KvCache<float>& cache, const std::filesystem::path& path, rlim_t limit,
                     const WhileStopped& while_stopped) {
  const pid_t child = fork();
  if (child == 0) {
    std::signal(SIGXFSZ, [](int) { raise(SIGSTOP); });
    const rlimit r{limit, limit};
    if (setrlimit(RLIMIT_FSIZE, &r) != 0) _exit(kSkip);
    try {
      save_state(cache, path, "new");
    } catch (...) {
      _exit(1);
    }
    _exit(0);
  }
  int status = 0;
  EXPECT_EQ(waitpid(child, &status, WUNTRACED), child);
  if (WIFEXITED(status)) {
    EXPECT_EQ(WEXITSTATUS(status), 0) << (WEXITSTATUS(status) == kSkip ? "setrlimit refused" : "the save threw");
    return false;
  }
  EXPECT_TRUE(WIFSTOPPED(status));
  while_stopped();
  kill(child, SIGKILL);
  EXPECT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  return true;
}

TEST(AtomicSave, AWriterKilledAtAnyPointLeavesTheOldFileOrTheNewNeverATornOne) {
  const Dir dir;
  const std::filesystem::path path = dir.path / "prompt.kvstate";
  const KvCache<float> old_cache = filled(40, 1.0F), new_cache = filled(60, 2.0F);
  save_state(old_cache, path, "old");
  const std::string old_bytes = read_file(path), new_bytes = state_bytes(new_cache, "new");
  ASSERT_EQ(old_bytes, state_bytes(old_cache, "old"));
  ASSERT_NE(old_bytes, new_bytes);

  const auto loads_as = [&](const std::string& expected) {
    KvCache<float> loaded({.layers = 2, .kv_heads = 2, .head_dim = 16, .capacity = 256});
    EXPECT_EQ(load_state(loaded, path), expected);
    EXPECT_EQ(read_file(path), expected == "old" ? old_bytes : new_bytes);
  };
  for (const std::size_t at : {std::size_t{1}, std::size_t{12}, std::size_t{4096}, new_bytes.size() / 2,
                               new_bytes.size() - 4, new_bytes.size() - 1}) {
    SCOPED_TRACE("stopped at byte " + std::to_string(at));
    const bool stopped = save_stopped_at(new_cache, path, static_cast<rlim_t>(at), [&] { loads_as("old"); });
    EXPECT_TRUE(stopped);
    loads_as("old");
    // The torn bytes are there, under a temporary name nothing reads.
    std::vector<std::filesystem::path> torn;
    for (const auto& entry : std::filesystem::directory_iterator(dir.path)) {
      if (entry.path() != path) torn.push_back(entry.path());
    }
    ASSERT_EQ(torn.size(), 1U);
    EXPECT_THAT(torn[0].filename().string(), HasSubstr("prompt.kvstate.tmp."));
    EXPECT_EQ(read_file(torn[0]), new_bytes.substr(0, at));
    std::filesystem::remove(torn[0]);
  }
  // Room for every byte: the writer finishes, and the path holds the new file.
  EXPECT_FALSE(save_stopped_at(new_cache, path, static_cast<rlim_t>(new_bytes.size()), [] {}));
  loads_as("new");
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path), std::filesystem::directory_iterator()), 1);
}

TEST(AtomicSave, AWriteTheSystemRefusesNamesTheFileAndTheReasonAndLeavesThePath) {
  const Dir dir;
  const std::filesystem::path path = dir.path / "prompt.kvstate";
  const KvCache<float> old_cache = filled(8, 1.0F);
  save_state(old_cache, path, "old");
  const std::string old_bytes = read_file(path);
  const int code = run_in_child(
      [&] {
        std::signal(SIGXFSZ, SIG_IGN);  // a write past the limit fails with EFBIG, as on a full disk
        const rlimit r{1000, 1000};
        if (setrlimit(RLIMIT_FSIZE, &r) != 0) return kSkip;
        try {
          save_state(filled(60, 2.0F), path, "new");
        } catch (const std::runtime_error& e) {
          const std::string what = e.what();
          return what.find("kvcache::save_state: cannot write") != std::string::npos &&
                         what.find(path.string() + ".tmp.") != std::string::npos &&
                         what.find("File too large") != std::string::npos
                     ? 0
                     : 2;
        }
        return 1;
      },
      std::chrono::seconds(60));
  ASSERT_NE(code, kSkip) << "setrlimit refused";
  EXPECT_EQ(code, 0) << "1: the save succeeded; 2: its message did not name the file and the reason";
  EXPECT_EQ(read_file(path), old_bytes);
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path), std::filesystem::directory_iterator()), 1);
}

TEST(AtomicFile, CommitsOnlyWhenAskedAndNamesAFileItCannotCreate) {
  const Dir dir;
  const std::filesystem::path path = dir.path / "f";
  {
    detail::AtomicFile file(path, "test");
    file.write("abandoned");
    EXPECT_TRUE(std::filesystem::exists(file.temporary()));
  }
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path), std::filesystem::directory_iterator()), 0);
  {
    detail::AtomicFile file(path, "test");
    file.write("first");
    file.commit();
  }
  EXPECT_EQ(read_file(path), "first");
  try {
    detail::AtomicFile file(dir.path / "missing" / "f", "test");
    ADD_FAILURE() << "a file in a missing directory was created";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("test: cannot create"), HasSubstr((dir.path / "missing").string()),
                                HasSubstr("No such file or directory")));
  }
}

}  // namespace
}  // namespace kvcache::testing
