#include "tests/model/reference_runner.h"

#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "tests/model/command.h"
#include "tests/model/test_paths.h"

namespace pdworker::model_testing {
namespace {

// Debian's interpreter with Debian's python3-numpy (scripts/install-deps).
constexpr char kPython[] = "/usr/bin/python3";

std::string TokensArgument(const std::vector<std::vector<int32_t>>& sequences) {
  std::vector<std::string> parts;
  parts.reserve(sequences.size());
  for (const auto& sequence : sequences) {
    parts.push_back(absl::StrJoin(sequence, ","));
  }
  return absl::StrJoin(parts, ";");
}

std::string ReferenceCommand(const std::string& model_dir,
                             const std::string& tokens) {
  return absl::StrCat(
      kPython, " ",
      ShellQuote(RunfilePath("tests/reference/llama_reference.py")),
      " --model=", ShellQuote(model_dir), " --tokens=", ShellQuote(tokens));
}

absl::Status CheckSequences(
    const std::vector<std::vector<int32_t>>& sequences) {
  if (sequences.empty()) {
    return absl::InvalidArgumentError("no sequences given");
  }
  for (const auto& sequence : sequences) {
    if (sequence.empty()) {
      return absl::InvalidArgumentError("empty sequence given");
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<std::vector<float>>> RunReferenceLogits(
    const std::string& model_dir,
    const std::vector<std::vector<int32_t>>& sequences) {
  if (absl::Status status = CheckSequences(sequences); !status.ok()) {
    return status;
  }
  const std::string out_path = MakeUniqueTempDir("reference") + "/logits.bin";
  auto run = RunCommand(
      absl::StrCat(ReferenceCommand(model_dir, TokensArgument(sequences)),
                   " --out=", ShellQuote(out_path)));
  if (!run.ok()) return run.status();

  std::ifstream file(out_path, std::ios::binary);
  std::ostringstream buffer;
  buffer << file.rdbuf();
  const std::string bytes = buffer.str();

  // [int32 n][int32 vocab][float32 n * vocab] per sequence, little-endian.
  std::vector<std::vector<float>> logits;
  size_t offset = 0;
  for (const auto& sequence : sequences) {
    int32_t header[2];
    if (bytes.size() - offset < sizeof(header)) {
      return absl::DataLossError(absl::StrCat(out_path, " ends early"));
    }
    std::memcpy(header, bytes.data() + offset, sizeof(header));
    offset += sizeof(header);
    const int32_t positions = header[0];
    const int32_t vocab = header[1];
    if (positions != static_cast<int32_t>(sequence.size()) || vocab <= 0) {
      return absl::DataLossError(
          absl::StrCat(out_path, ": header says ", positions, " positions x ",
                       vocab, " tokens for a sequence of ", sequence.size()));
    }
    const size_t count =
        static_cast<size_t>(positions) * static_cast<size_t>(vocab);
    if ((bytes.size() - offset) / sizeof(float) < count) {
      return absl::DataLossError(absl::StrCat(out_path, " ends early"));
    }
    std::vector<float> values(count);
    std::memcpy(values.data(), bytes.data() + offset, count * sizeof(float));
    offset += count * sizeof(float);
    logits.push_back(std::move(values));
  }
  if (offset != bytes.size()) {
    return absl::DataLossError(absl::StrCat(out_path, " has ",
                                            bytes.size() - offset,
                                            " unexpected trailing bytes"));
  }
  return logits;
}

absl::StatusOr<std::vector<int32_t>> RunReferenceGreedy(
    const std::string& model_dir, const std::vector<int32_t>& prompt,
    int steps) {
  if (absl::Status status = CheckSequences({prompt}); !status.ok()) {
    return status;
  }
  auto output = RunCommand(
      absl::StrCat(ReferenceCommand(model_dir, absl::StrJoin(prompt, ",")),
                   " --greedy=", steps));
  if (!output.ok()) return output.status();
  std::vector<int32_t> tokens;
  const absl::string_view line = absl::StripAsciiWhitespace(*output);
  if (line.empty()) {
    if (steps == 0) return tokens;
    return absl::DataLossError("reference printed no tokens");
  }
  for (const absl::string_view part : absl::StrSplit(line, ',')) {
    int32_t token;
    if (!absl::SimpleAtoi(part, &token)) {
      return absl::DataLossError(
          absl::StrCat("reference printed \"", line, "\""));
    }
    tokens.push_back(token);
  }
  if (static_cast<int>(tokens.size()) != steps) {
    return absl::DataLossError(absl::StrCat("reference printed ", tokens.size(),
                                            " tokens, expected ", steps));
  }
  return tokens;
}

}  // namespace pdworker::model_testing
