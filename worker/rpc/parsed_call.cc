#include "worker/rpc/parsed_call.h"

// SerializationTraits for protobuf messages (what generated stubs use).
#include <grpcpp/impl/codegen/proto_utils.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace pdworker {

grpc::Status ParseRequest(const grpc::ByteBuffer& bytes,
                          google::protobuf::Message* message) {
  std::vector<grpc::Slice> slices;
  bool parsed = false;
  if (bytes.Valid() && bytes.Dump(&slices).ok()) {
    if (slices.size() == 1) {
      parsed = message->ParseFromArray(slices[0].begin(),
                                       static_cast<int>(slices[0].size()));
    } else {
      std::string joined;
      joined.reserve(bytes.Length());
      for (const grpc::Slice& s : slices) {
        joined.append(reinterpret_cast<const char*>(s.begin()), s.size());
      }
      parsed = message->ParseFromString(joined);
    }
  }
  if (parsed) return grpc::Status::OK;
  return grpc::Status(
      grpc::StatusCode::INVALID_ARGUMENT,
      absl::StrCat("the request could not be parsed as ",
                   message->GetDescriptor()->full_name(), " (",
                   bytes.Valid() ? bytes.Length() : 0,
                   " bytes): not that message's wire format, truncated, or a "
                   "string field that is not UTF-8"));
}

void SerializeMessage(const google::protobuf::Message& message,
                      grpc::ByteBuffer* bytes) {
  bytes->Clear();  // gRPC's writer serializes only into an empty buffer
  bool own_buffer = false;
  // Sizes the slice exactly and serializes into it: no extra copy.
  const grpc::Status s =
      grpc::SerializationTraits<google::protobuf::Message>::Serialize(
          message, bytes, &own_buffer);
  // Serializing a message we built cannot fail (it is under protobuf's
  // 2 GiB limit: outputs are bounded by max_model_len, KV chunks by
  // --max_chunk_bytes).
  CHECK(s.ok()) << s.error_message();
}

ListWriter::ListWriter(std::vector<grpc::ByteBuffer> messages,
                       grpc::Status status)
    : messages_(std::move(messages)), status_(std::move(status)) {
  Next();
}

void ListWriter::OnWriteDone(bool ok) {
  if (!ok) {
    Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the client went away"));
    return;
  }
  ++next_;
  Next();
}

void ListWriter::Next() {
  if (next_ < messages_.size()) {
    StartWrite(&messages_[next_]);
  } else {
    Finish(status_);
  }
}

}  // namespace pdworker
