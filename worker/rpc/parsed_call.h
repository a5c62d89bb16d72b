// Our gRPC services (pdworker.v1.Worker, pdworker.v1.KvTransfer,
// vllm.grpc.engine.VllmEngine) register every method as raw (grpc::ByteBuffer
// in and out) and parse requests here.
//
// Why: gRPC C++'s callback server parses a typed method's request before any
// handler runs, and answers one that does not parse (random bytes, a
// truncated message, invalid UTF-8 in a proto3 string field) with
// UNIMPLEMENTED and an empty message (grpc 1.51's CallbackUnaryHandler and
// CallbackServerStreamingHandler). A router reads UNIMPLEMENTED as "this
// method does not exist". Parsing ourselves answers INVALID_ARGUMENT saying
// which message could not be parsed, and the handler never runs: nothing
// changes.
#ifndef PDWORKER_WORKER_RPC_PARSED_CALL_H_
#define PDWORKER_WORKER_RPC_PARSED_CALL_H_

#include <google/protobuf/message.h>
#include <grpcpp/grpcpp.h>

namespace pdworker {

// OK and `message` filled when `bytes` parse as it; INVALID_ARGUMENT naming
// the message type otherwise (`message` is then unspecified).
grpc::Status ParseRequest(const grpc::ByteBuffer& bytes,
                          google::protobuf::Message* message);

// `message` serialized into `bytes`, replacing what was there.
void SerializeMessage(const google::protobuf::Message& message,
                      grpc::ByteBuffer* bytes);

// For handlers that answer before returning: parses the request, runs
// `answer(const Request&, Response*) -> grpc::Status` when it parsed, and
// finishes with the response (on OK) or the status.
template <typename Request, typename Response, typename Answer>
grpc::ServerUnaryReactor* AnswerNow(grpc::CallbackServerContext* context,
                                    const grpc::ByteBuffer* raw_request,
                                    grpc::ByteBuffer* raw_response,
                                    Answer&& answer) {
  Request request;
  Response response;
  grpc::Status status = ParseRequest(*raw_request, &request);
  if (status.ok()) status = answer(request, &response);
  if (status.ok()) SerializeMessage(response, raw_response);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(status);
  return reactor;
}

// A unary call answered later (from the engine or an importer thread): owns
// the parsed request and the response. Check parse_status() first; Reply
// finishes exactly once. gRPC deletes the call in OnDone.
template <typename Request, typename Response>
class UnaryCall : public grpc::ServerUnaryReactor {
 public:
  UnaryCall(const grpc::ByteBuffer* raw_request, grpc::ByteBuffer* raw_response)
      : parse_status_(ParseRequest(*raw_request, &request_)),
        raw_response_(raw_response) {}

  const grpc::Status& parse_status() const { return parse_status_; }
  const Request& request() const { return request_; }
  Response& response() { return response_; }

  // Serializes the response (on OK) and finishes. The last use of `this`:
  // OnDone may delete it from another thread as soon as Finish is called.
  void Reply(const grpc::Status& status) {
    if (status.ok()) SerializeMessage(response_, raw_response_);
    Finish(status);
  }

  void OnDone() override { delete this; }

 private:
  Request request_;  // before parse_status_: filled by its initializer
  Response response_;
  const grpc::Status parse_status_;
  grpc::ByteBuffer* const raw_response_;
};

// A server stream of protobuf messages over a raw method. gRPC allows one
// write in flight, so one buffer holds it: the message is serialized when
// the write starts and may change or go right after.
class MessageWriter : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 protected:
  void StartWriteMessage(const google::protobuf::Message& message) {
    SerializeMessage(message, &write_buffer_);
    StartWrite(&write_buffer_);
  }
  // A message the caller serialized itself (e.g. around bytes it did not
  // want to copy twice).
  void StartWriteBytes(grpc::ByteBuffer bytes) {
    write_buffer_.Swap(&bytes);
    StartWrite(&write_buffer_);
  }

 private:
  grpc::ByteBuffer write_buffer_;
};

// A stream that writes `messages` and finishes with `status` (at once, for
// a refusal). Deletes itself in OnDone.
class ListWriter final : public MessageWriter {
 public:
  ListWriter(std::vector<grpc::ByteBuffer> messages, grpc::Status status);
  void OnWriteDone(bool ok) override;
  void OnDone() override { delete this; }

 private:
  void Next();
  std::vector<grpc::ByteBuffer> messages_;
  const grpc::Status status_;
  size_t next_ = 0;
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_RPC_PARSED_CALL_H_
