// PeerChannels: gRPC channels from this worker to other workers (the decode
// side pulling KV from prefill workers), one per address, created on first
// use and kept: a P/D pair talks for every handoff, so reconnecting each
// time would put a TCP (and TLS) handshake into every transfer.
#ifndef PDWORKER_WORKER_TRANSFER_PEER_CHANNELS_H_
#define PDWORKER_WORKER_TRANSFER_PEER_CHANNELS_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <mutex>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"

namespace pdworker {

// How this worker connects to peers.
struct PeerTls {
  bool enabled = false;         // false: plaintext
  std::string root_certs_pem;   // CA of the peers' certificates; empty: the
                                // system's roots
  std::string cert_chain_pem;   // our client certificate (mutual TLS) ...
  std::string private_key_pem;  // ... and its key; both empty: none
  // The name peers' certificates are checked against instead of the host
  // in their address (pods are dialled by IP; certificates rarely carry
  // pod IPs). Empty: the address's host.
  std::string server_name_override;
};

class PeerChannels {
 public:
  PeerChannels(const PeerTls& tls, int max_receive_message_bytes);

  std::shared_ptr<grpc::Channel> Get(absl::string_view address);

 private:
  std::shared_ptr<grpc::ChannelCredentials> credentials_;
  grpc::ChannelArguments args_;
  std::mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<grpc::Channel>> channels_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace pdworker

#endif  // PDWORKER_WORKER_TRANSFER_PEER_CHANNELS_H_
