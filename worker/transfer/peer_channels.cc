#include "worker/transfer/peer_channels.h"

namespace pdworker {

PeerChannels::PeerChannels(const PeerTls& tls, int max_receive_message_bytes) {
  if (!tls.enabled) {
    credentials_ = grpc::InsecureChannelCredentials();
  } else {
    grpc::SslCredentialsOptions options;
    options.pem_root_certs = tls.root_certs_pem;
    options.pem_cert_chain = tls.cert_chain_pem;
    options.pem_private_key = tls.private_key_pem;
    credentials_ = grpc::SslCredentials(options);
  }
  args_.SetMaxReceiveMessageSize(max_receive_message_bytes);
  if (tls.enabled && !tls.server_name_override.empty()) {
    args_.SetSslTargetNameOverride(tls.server_name_override);
  }
}

std::shared_ptr<grpc::Channel> PeerChannels::Get(absl::string_view address) {
  std::lock_guard<std::mutex> lock(mu_);
  std::shared_ptr<grpc::Channel>& channel = channels_[address];
  if (channel == nullptr) {
    channel =
        grpc::CreateCustomChannel(std::string(address), credentials_, args_);
  }
  return channel;
}

}  // namespace pdworker
