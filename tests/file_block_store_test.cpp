// SPDX-License-Identifier: Apache-2.0
// FileBlockStore: the BlockStore contract on a directory; records replaced atomically (a writer
// killed part-way leaves the old record or none, a disk that refuses a write gives an error naming
// the file and the reason); and a paged cache reusing prefixes through it in every format, with
// every fault a record can carry, and across two processes.

#include <sys/resource.h>

#include <csignal>
#include <fstream>

#include "block_store_test_support.hpp"
#include "kvcache/file_block_store.hpp"

namespace kvcache::testing {
namespace {

/// A factory of stores sharing one directory, for the shared scenarios.
struct Files {
  TempDir dir{"kvcache_file_store"};
  [[nodiscard]] auto factory() const {
    return [this](const std::string& model) {
      return std::make_unique<FileBlockStore>(FileBlockStoreConfig{dir.path(), model});
    };
  }
};

/// The names in a directory and below it, files only.
std::vector<std::string> files_in(const std::filesystem::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir)) {
    if (entry.is_regular_file()) names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

TEST(FileBlockStore, KeepsTheContract) {
  const Files files;
  expect_block_store_contract(*files.factory()("m"));
}

TEST(FileBlockStore, ThreadsShareOneStore) {
  const Files files;
  expect_threads_share(*files.factory()("m"));
}

TEST(FileBlockStore, ARecordIsAFileNamedByItsKeyHoldingItsBytes) {
  const Files files;
  FileBlockStore store({files.dir.path(), "m"});
  const std::vector<BlockKey> keys = keys_from(0xAB, 1);
  const std::vector<std::string> records = {bytes_from(7, 4096)};
  store.put(keys, records);
  const std::filesystem::path path = files.dir.path() / "ab" / (keys[0].hex() + ".kvblock");
  EXPECT_EQ(store.path_of(keys[0]), path);
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(bytes, records[0]);
  EXPECT_EQ(files_in(files.dir.path()), std::vector<std::string>{keys[0].hex() + ".kvblock"});  // no temporary left
}

TEST(FileBlockStore, ABadConfigOrAnUnusableDirectoryIsRefusedNamingIt) {
  const Files files;
  EXPECT_THROW(FileBlockStore({"", "m"}), std::invalid_argument);
  EXPECT_THROW(FileBlockStore({files.dir.path(), ""}), std::invalid_argument);
  const std::filesystem::path file = files.dir.path() / "a_file";
  std::ofstream(file) << "not a directory";
  try {
    FileBlockStore store({file / "store", "m"});
    ADD_FAILURE() << "a directory under a file was accepted";
  } catch (const BlockStoreError& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("FileBlockStore"), HasSubstr((file / "store").string())));
  }
}

TEST(FileBlockStore, AWriteItCannotMakeNamesTheFileAndTheReasonAndWritesNothing) {
  const Files files;
  FileBlockStore store({files.dir.path(), "m"});
  const std::vector<BlockKey> keys = keys_from(0xCD, 2);
  std::ofstream(files.dir.path() / "cd") << "a file where the records' directory goes";
  const std::vector<std::string> records = {bytes_from(1, 10), bytes_from(2, 10)};
  try {
    store.put(keys, records);
    ADD_FAILURE() << "the put did not throw";
  } catch (const BlockStoreError& e) {
    EXPECT_THAT(e.what(),
                AllOf(HasSubstr("cannot create the directory"), HasSubstr((files.dir.path() / "cd").string())));
  }
  EXPECT_EQ(store.contains(keys), 0U);
  std::filesystem::remove(files.dir.path() / "cd");
  // A record that cannot be read: its path is a directory.
  std::filesystem::create_directories(store.path_of(keys[0]));
  std::vector<std::string> out(2);
  try {
    (void)store.get(keys, out);
    ADD_FAILURE() << "the get did not throw";
  } catch (const BlockStoreError& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("cannot read"), HasSubstr(store.path_of(keys[0]).string())));
  }
}

/// In a child whose files may not grow past `limit` bytes: puts `record` under `key` and exits 0,
/// or 1 if the put threw a BlockStoreError naming the file size limit; with `killed`, the system
/// kills it instead (SIGXFSZ) when the write reaches the limit.
int put_with_file_size_limit(const std::filesystem::path& dir, const BlockKey& key, const std::string& record,
                             rlim_t limit, bool killed) {
  return run_in_child(
      [&] {
        std::signal(SIGXFSZ, killed ? SIG_DFL : SIG_IGN);
        const rlimit r{limit, limit};
        if (setrlimit(RLIMIT_FSIZE, &r) != 0) return kSkip;
        try {
          FileBlockStore store({dir, "m"});
          store.put(std::span(&key, 1), std::span(&record, 1));
          return 0;
        } catch (const BlockStoreError& e) {
          return std::string(e.what()).find("File too large") != std::string::npos ? 1 : 2;
        }
      },
      std::chrono::seconds(60));
}

TEST(FileBlockStore, AFullDiskFailsThePutNamingTheReasonAndLeavesNoFile) {
  const Files files;
  const BlockKey key = keys_from(0x11, 1)[0];
  const int code = put_with_file_size_limit(files.dir.path(), key, bytes_from(3, 5000), 1000, false);
  ASSERT_NE(code, kSkip) << "setrlimit refused";
  EXPECT_EQ(code, 1) << "0: the put succeeded; 2: another error";
  EXPECT_EQ(FileBlockStore({files.dir.path(), "m"}).contains(std::span(&key, 1)), 0U);
  EXPECT_TRUE(files_in(files.dir.path()).empty());  // the temporary file is gone too
}

TEST(FileBlockStore, AWriterKilledPartWayLeavesTheOldRecordOrNoneNeverATornOne) {
  const Files files;
  FileBlockStore store({files.dir.path(), "m"});
  const std::vector<BlockKey> keys = keys_from(0x22, 2);
  const std::vector<std::string> old = {bytes_from(4, 3000)};
  store.put(std::span(keys).first(1), old);  // keys[0] holds a record, keys[1] none
  const std::string record = bytes_from(5, 5000);
  for (const BlockKey& key : keys) {
    const int code = put_with_file_size_limit(files.dir.path(), key, record, 2500, true);
    ASSERT_NE(code, kSkip) << "setrlimit refused";
    EXPECT_EQ(code, 128 + SIGXFSZ) << "the writer was not killed part-way";
  }
  std::vector<std::string> out(2);
  EXPECT_EQ(store.get(keys, out), 1U);
  EXPECT_EQ(out[0], old[0]);
  // The torn bytes exist, under temporary names nothing reads.
  std::size_t torn = 0;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(files.dir.path())) {
    if (entry.path().filename().string().find(".kvblock.tmp.") == std::string::npos) continue;
    EXPECT_EQ(entry.file_size(), 2500U);
    ++torn;
  }
  EXPECT_EQ(torn, 2U);
}

TEST(FileBlockStore, AByteChangedOnTheDiskIsCaughtByTheFetch) {
  const Files files;
  using Scene = StoreScene<float>;
  FileBlockStore store({files.dir.path(), "m"});
  const std::vector<TokenId> prompt = Scene::prompt(14, 9);
  Scene::save(store, prompt);
  const std::filesystem::path path = store.path_of(Scene::keys_of("m", prompt)[2]);
  {
    std::fstream file(path, std::ios::binary | std::ios::in | std::ios::out);
    file.seekp(100);
    file.put('\x7F');
  }
  expect_fault_at<float>(store, prompt, 2, {"checksum"});
}

// ---- the shared scenarios, in every format ----------------------------------------------------

template <class T>
class FileStoreReuse : public ::testing::Test {
 protected:
  [[nodiscard]] auto factory() const { return files.factory(); }
  Files files;
};
KVCACHE_BLOCK_STORE_SCENARIOS(FileStoreReuse)

TEST(FileBlockStoreProcesses, ASecondProcessReusesTheFirstsPrefixWithTheLogitsOfRecomputing) {
  const Files files;
  expect_two_processes_share(files.factory());
}

}  // namespace
}  // namespace kvcache::testing
