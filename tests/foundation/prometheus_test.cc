// Proves prometheus-cpp core (text serialization) and pull (a real HTTP
// exposer scraped over loopback).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "prometheus/counter.h"
#include "prometheus/exposer.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"

namespace {

std::shared_ptr<prometheus::Registry> MakeRegistry() {
  auto registry = std::make_shared<prometheus::Registry>();
  auto& family = prometheus::BuildCounter()
                     .Name("pdworker_foundation_events_total")
                     .Help("Events counted by the foundation test.")
                     .Register(*registry);
  family.Add({{"kind", "a"}}).Increment(3);
  family.Add({{"kind", "b"}}).Increment();
  return registry;
}

TEST(PrometheusTest, RegistrySerializesToText) {
  auto registry = MakeRegistry();
  std::string text =
      prometheus::TextSerializer().Serialize(registry->Collect());
  EXPECT_NE(text.find("# TYPE pdworker_foundation_events_total counter"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("pdworker_foundation_events_total{kind=\"a\"} 3"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("pdworker_foundation_events_total{kind=\"b\"} 1"),
            std::string::npos)
      << text;
}

std::string HttpGet(int port, const std::string& path) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string out;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    std::string req =
        "GET " + path +
        " HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
    if (write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size())) {
      char buf[4096];
      ssize_t n;
      while ((n = read(fd, buf, sizeof(buf))) > 0) out.append(buf, n);
    }
  }
  close(fd);
  return out;
}

TEST(PrometheusTest, ExposerServesMetricsOverHttp) {
  prometheus::Exposer exposer("127.0.0.1:0");
  auto registry = MakeRegistry();
  exposer.RegisterCollectable(registry);
  auto ports = exposer.GetListeningPorts();
  ASSERT_EQ(ports.size(), 1u);
  std::string response = HttpGet(ports[0], "/metrics");
  EXPECT_NE(response.find("200 OK"), std::string::npos) << response;
  EXPECT_NE(response.find("pdworker_foundation_events_total{kind=\"a\"} 3"),
            std::string::npos)
      << response;
}

}  // namespace
