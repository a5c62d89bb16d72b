// The fuzz targets' regression test: runs LLVMFuzzerTestOneInput over every
// file of the seed corpus directories named on the command line (their
// paths relative to the runfiles root, where Bazel starts a test). Built in
// every configuration, so the seeds (and any crash input added to them)
// are replayed by the ordinary test run and under the sanitizers; libFuzzer
// itself is linked only into the fuzzers (bazel/fuzz.bzl).
#include <dirent.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
// Optional in a target (libFuzzer calls it once before the first input).
extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv)
    __attribute__((weak));

namespace {

std::vector<std::string>* corpus_dirs = nullptr;

std::vector<std::string> FilesIn(const std::string& dir) {
  std::vector<std::string> files;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return files;
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") files.push_back(dir + "/" + name);
  }
  closedir(d);
  std::sort(files.begin(), files.end());
  return files;
}

TEST(FuzzCorpus, EverySeedRuns) {
  ASSERT_FALSE(corpus_dirs->empty()) << "no corpus directory given";
  int inputs = 0;
  for (const std::string& dir : *corpus_dirs) {
    const std::vector<std::string> files = FilesIn(dir);
    // A target without seeds would pass vacuously.
    EXPECT_FALSE(files.empty()) << dir << " holds no seed";
    for (const std::string& path : files) {
      SCOPED_TRACE(path);
      std::ifstream in(path, std::ios::binary);
      ASSERT_TRUE(in.good()) << "cannot read " << path;
      std::stringstream bytes;
      bytes << in.rdbuf();
      const std::string input = bytes.str();
      // Failures are CHECKs inside the target: they abort the test.
      LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(input.data()),
                             input.size());
      ++inputs;
    }
  }
  RecordProperty("inputs", inputs);
}

}  // namespace

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  corpus_dirs = new std::vector<std::string>(argv + 1, argv + argc);
  if (LLVMFuzzerInitialize != nullptr) LLVMFuzzerInitialize(&argc, &argv);
  return RUN_ALL_TESTS();
}
