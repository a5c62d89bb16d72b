#include "tools/router/stream_printer.h"

#include <utility>

#include "absl/strings/str_format.h"

namespace pdworker::router {

std::string EscapeForTerminal(absl::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (const char c : bytes) {
    const auto byte = static_cast<unsigned char>(c);
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (byte >= 0x20 && byte < 0x7f) {
      out += c;
    } else {
      absl::StrAppendFormat(&out, "\\x%02x", byte);
    }
  }
  return out;
}

StreamPrinter::StreamPrinter(std::ostream& out,
                             std::vector<std::string> prefixes)
    : out_(out) {
  lines_.resize(prefixes.size());
  for (size_t i = 0; i < prefixes.size(); ++i) {
    lines_[i].prefix = std::move(prefixes[i]);
  }
}

void StreamPrinter::Append(size_t line, absl::string_view text) {
  std::lock_guard<std::mutex> lock(mu_);
  if (line >= lines_.size() || lines_[line].finished) return;
  lines_[line].pending.append(text.data(), text.size());
  FlushLocked();
}

void StreamPrinter::Finish(size_t line, absl::string_view suffix) {
  std::lock_guard<std::mutex> lock(mu_);
  if (line >= lines_.size() || lines_[line].finished) return;
  lines_[line].suffix = std::string{suffix};
  lines_[line].finished = true;
  FlushLocked();
}

void StreamPrinter::FlushLocked() {
  while (current_ < lines_.size()) {
    Line& line = lines_[current_];
    if (!line.started) {
      out_ << line.prefix;
      line.started = true;
    }
    out_ << line.pending;
    line.pending.clear();
    if (!line.finished) break;
    out_ << line.suffix << '\n';
    ++current_;
  }
  out_.flush();
}

}  // namespace pdworker::router
