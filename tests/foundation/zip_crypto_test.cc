// Proves libzip and OpenSSL's libcrypto link and behave (the tokenizer bundle
// GetTokenizer streams: a ZIP made in memory, checked by its SHA-256).
#include <openssl/evp.h>
#include <zip.h>

#include <string>

#include "gtest/gtest.h"

namespace {

std::string Sha256Hex(const std::string& bytes) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  EXPECT_EQ(EVP_Digest(bytes.data(), bytes.size(), digest, &size, EVP_sha256(),
                       nullptr),
            1);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  for (unsigned int i = 0; i < size; ++i) {
    hex += kHex[digest[i] >> 4];
    hex += kHex[digest[i] & 15];
  }
  return hex;
}

TEST(OpenSslCryptoTest, Sha256MatchesFips180Vector) {
  EXPECT_EQ(Sha256Hex("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(LibzipTest, WritesAndReadsBackAnInMemoryArchive) {
  zip_error_t error;
  zip_error_init(&error);
  zip_source_t* sink = zip_source_buffer_create(nullptr, 0, 0, &error);
  ASSERT_NE(sink, nullptr);
  zip_t* writer = zip_open_from_source(sink, ZIP_TRUNCATE, &error);
  ASSERT_NE(writer, nullptr) << zip_error_strerror(&error);
  zip_source_keep(sink);
  const std::string text(10000, 'a');  // deflates well
  zip_source_t* data = zip_source_buffer(writer, text.data(), text.size(), 0);
  ASSERT_NE(data, nullptr);
  ASSERT_GE(zip_file_add(writer, "a.txt", data, 0), 0);
  ASSERT_EQ(zip_set_file_compression(writer, 0, ZIP_CM_DEFLATE, 0), 0);
  ASSERT_EQ(zip_close(writer), 0);

  // The buffer now holds the archive; read it back through a second handle.
  zip_t* reader = zip_open_from_source(sink, ZIP_RDONLY, &error);
  ASSERT_NE(reader, nullptr) << zip_error_strerror(&error);
  ASSERT_EQ(zip_get_num_entries(reader, 0), 1);
  zip_stat_t stat;
  ASSERT_EQ(zip_stat_index(reader, 0, 0, &stat), 0);
  EXPECT_STREQ(stat.name, "a.txt");
  EXPECT_EQ(stat.comp_method, ZIP_CM_DEFLATE);
  EXPECT_EQ(stat.size, text.size());
  EXPECT_LT(stat.comp_size, stat.size / 10);
  zip_file_t* file = zip_fopen_index(reader, 0, 0);
  ASSERT_NE(file, nullptr);
  std::string back(text.size(), '\0');
  EXPECT_EQ(zip_fread(file, back.data(), back.size()),
            static_cast<zip_int64_t>(text.size()));
  zip_fclose(file);
  EXPECT_EQ(back, text);
  zip_discard(reader);  // also drops the reference zip_source_keep took
  zip_error_fini(&error);
}

}  // namespace
