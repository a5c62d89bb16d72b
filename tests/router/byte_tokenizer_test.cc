// The demo's byte tokenizer: one id per UTF-8 byte, lossless both ways, and
// ids beyond a byte shown rather than dropped. Also the CLI's terminal
// escaping and ordered streaming of concurrent requests' lines.
#include "tools/router/byte_tokenizer.h"

#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tools/router/stream_printer.h"

namespace pdworker::router {
namespace {

using ::testing::ElementsAre;

TEST(ByteTokenizerTest, AsciiIsOneTokenPerCharacter) {
  EXPECT_THAT(ByteTokenizer::Encode("Hi!"), ElementsAre(72, 105, 33));
  EXPECT_EQ(ByteTokenizer::Decode({72, 105, 33}), "Hi!");
}

TEST(ByteTokenizerTest, Utf8IsOneTokenPerByte) {
  // "é" is 0xC3 0xA9; "✓" is 0xE2 0x9C 0x93.
  EXPECT_THAT(ByteTokenizer::Encode("é✓"),
              ElementsAre(0xC3, 0xA9, 0xE2, 0x9C, 0x93));
}

TEST(ByteTokenizerTest, EveryByteRoundTrips) {
  std::string all;
  for (int b = 0; b < 256; ++b) all += static_cast<char>(b);
  const std::vector<int32_t> ids = ByteTokenizer::Encode(all);
  ASSERT_EQ(ids.size(), 256u);
  for (int b = 0; b < 256; ++b) EXPECT_EQ(ids[b], b);
  EXPECT_EQ(ByteTokenizer::Decode(ids), all);
  const std::string text = "Grüße, 世界\n\t";
  EXPECT_EQ(ByteTokenizer::Decode(ByteTokenizer::Encode(text)), text);
}

TEST(ByteTokenizerTest, IdsBeyondAByteAreShownNotDropped) {
  EXPECT_EQ(ByteTokenizer::Decode({65, 256, 66, 31999, -1}),
            "A<256>B<31999><-1>");
  EXPECT_EQ(ByteTokenizer::DecodeOne(1000), "<1000>");
}

TEST(EscapeForTerminalTest, KeepsPrintableAsciiEscapesTheRest) {
  EXPECT_EQ(EscapeForTerminal("ab c~"), "ab c~");
  EXPECT_EQ(EscapeForTerminal(std::string("a\nb\\\t\x01\x7f\xff", 8)),
            "a\\nb\\\\\\t\\x01\\x7f\\xff");
}

TEST(StreamPrinterTest, LinesStayWholeAndInOrder) {
  std::ostringstream out;
  StreamPrinter printer(out, {"a: ", "b: ", "c: "});
  printer.Append(1, "b1");  // held: line a is not done
  EXPECT_EQ(out.str(), "a: ");
  printer.Append(0, "a1");
  EXPECT_EQ(out.str(), "a: a1");
  printer.Append(2, "c1");
  printer.Finish(2, " [c done]");
  printer.Finish(0);
  // a ends, b catches up and streams on, c waits for b.
  EXPECT_EQ(out.str(), "a: a1\nb: b1");
  printer.Append(1, "b2");
  EXPECT_EQ(out.str(), "a: a1\nb: b1b2");
  printer.Finish(1);
  EXPECT_EQ(out.str(), "a: a1\nb: b1b2\nc: c1 [c done]\n");
  printer.Append(0, "late");  // ignored after Finish
  EXPECT_EQ(out.str(), "a: a1\nb: b1b2\nc: c1 [c done]\n");
}

}  // namespace
}  // namespace pdworker::router
