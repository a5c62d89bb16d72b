// Default sanitizer suppressions, linked into every test through
// //third_party:gtest and into binaries tests start as subprocesses
// (//worker:pdworker). Only the sanitizer runtimes call these hooks, so they
// are inert in ordinary builds.
//
// Why: Debian's abseil, gRPC, protobuf, OpenSSL, glog, prometheus-cpp and
// libzmq are not built with -fsanitize=thread. ThreadSanitizer cannot see the
// synchronization inside them (abseil's futex-based Mutex, which gRPC uses
// internally), so it reports races between their own threads that are not real.
// We suppress only reports raised from inside those libraries; our own code
// synchronizes with std::mutex / std::atomic, which TSan understands, so races
// in our code are still reported.

extern "C" {

const char* __tsan_default_suppressions() {
  // race: patterns match function, source file or module names in a stack.
  return "race:libabsl_\n"
         "race:libgrpc.so\n"
         "race:libgrpc++.so\n"
         "race:libgpr.so\n"
         "race:libprotobuf.so\n"
         // gRPC's upb (its own protobuf runtime), e.g. the client's
         // deadline timer thread.
         "race:libupb.so\n"
         "race:libprometheus-cpp-\n"
         "race:absl::debian3::\n"
         "race:grpc_\n"
         "race:grpc::\n"
         "race:gpr_\n"
         "race:civetweb\n"
         "race:mg_\n"
         // OpenSSL (gRPC's TLS) synchronizes with its own atomics.
         "race:libcrypto.so\n"
         "race:libssl.so\n"
         // ZeroMQ (KV events) hands messages between a socket's thread and
         // its I/O thread through lock-free pipes and mailboxes.
         "race:libzmq.so\n"
         "deadlock:absl::debian3::\n"
         "deadlock:grpc_core::\n"
         "mutex:absl::debian3::\n";
}

// gRPC and protobuf keep process-lifetime singletons.
const char* __lsan_default_suppressions() {
  return "leak:libgrpc\n"
         "leak:libgpr\n"
         "leak:libprotobuf\n"
         "leak:libabsl_\n";
}

}  // extern "C"
