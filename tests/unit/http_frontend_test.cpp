// The HTTP front end's framing checks (frontend/http_frontend.h): every head a request smuggler
// or a broken client sends is refused with its status and a message that names the fault, a
// valid head yields its body framing, and chunked bodies are delimited exactly (the next
// pipelined request's bytes are never part of the body). End to end: tests/server/test_hostile.py.
#include "frontend/http_frontend.h"

#include <gtest/gtest.h>

#include <string>

namespace burst::server {
namespace {

constexpr char kLine[] = "POST /v1/completions HTTP/1.1\r\n";

RequestHead head_of(const std::string& headers) {
  return parse_request_head(std::string(kLine) + headers + "\r\n");
}

TEST(HttpFrontend, ValidHeadsGiveTheirFraming) {
  RequestHead h = head_of("Host: x\r\nContent-Length: 12\r\n");
  EXPECT_EQ(h.status, 0) << h.message;
  EXPECT_EQ(h.content_length, 12);
  EXPECT_FALSE(h.chunked);
  h = head_of("Transfer-Encoding: Chunked\r\nX-Empty:\r\n");
  EXPECT_EQ(h.status, 0) << h.message;
  EXPECT_TRUE(h.chunked);
  const std::string expect = "Expect: 100-continue\r\n";
  h = head_of("Host: x\r\n" + expect + "Content-Length: 3\r\n");
  EXPECT_TRUE(h.expect_continue);
  const std::string whole = std::string(kLine) + "Host: x\r\n";
  EXPECT_EQ(h.expect_begin, whole.size());
  EXPECT_EQ(h.expect_end - h.expect_begin, expect.size());
  EXPECT_EQ(parse_request_head("GET / HTTP/1.0\r\n\r\n").status, 0);
}

TEST(HttpFrontend, BadHeadsAreRefusedNamingTheFault) {
  struct Case {
    std::string head;  // after the request line
    int status;
    const char* words;
  };
  const Case cases[] = {
      {"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n", 400, "smuggling"},
      {"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n", 400, "smuggling"},
      {"Host x\r\n", 400, "has no colon"},
      {"Host : x\r\n", 400, "not a token"},
      {": x\r\n", 400, "not a token"},
      {"X-A: 1\r\n folded\r\n", 400, "folding"},
      {"Content-Length: 1\r\nContent-Length: 1\r\n", 400, "more than one Content-Length"},
      {"Content-Length: -1\r\n", 400, "not a number"},
      {"Content-Length: 0x10\r\n", 400, "not a number"},
      {"Content-Length: 99999999999999999999\r\n", 400, "not a number"},
      {"Transfer-Encoding: gzip\r\n", 501, "only chunked"},
      {"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n", 400, "more than one"},
      {"Expect: 200-ok\r\n", 417, "100-continue"},
      {"X-A: a\x01z\r\n", 400, "control character"},
      {"X-A: 1\rX-B: 2\r\n", 400, "bare CR"},
  };
  for (const Case& c : cases) {
    const RequestHead h = head_of(c.head);
    EXPECT_EQ(h.status, c.status) << c.head;
    EXPECT_NE(h.message.find(c.words), std::string::npos) << c.head << " -> " << h.message;
  }
  EXPECT_EQ(parse_request_head("GET / HTTP/2.0\r\n\r\n").status, 505);
  EXPECT_EQ(parse_request_head("BREW / HTTP/1.1\r\n\r\n").status, 501);
  EXPECT_EQ(parse_request_head("GET /" + std::string(9000, 'a') + " HTTP/1.1\r\n\r\n").status,
            414);
  EXPECT_EQ(head_of("X-A: " + std::string(9000, 'a') + "\r\n").status, 431);
  EXPECT_EQ(parse_request_head("GET  / HTTP/1.1\r\n\r\n").status, 400);
  EXPECT_EQ(parse_request_head("GET /\r\n\r\n").status, 400);
  EXPECT_EQ(parse_request_head("GET / HTTP/1.1\nHost: x\r\n\r\n").status, 400);
  EXPECT_EQ(parse_request_head("GET / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n").status,
            400);
  std::string many;
  for (int i = 0; i < 101; ++i) many += "X-" + std::to_string(i) + ": 1\r\n";
  EXPECT_EQ(head_of(many).status, 431);
}

TEST(HttpFrontend, ChunkedBodiesEndExactly) {
  size_t end = 0;
  std::string why;
  const std::string body = "4;ext=1\r\nabcd\r\n0\r\n\r\n";
  EXPECT_EQ(scan_chunked_body(body + "GET / HTTP/1.1\r\n\r\n", 100, &end, &why),
            ChunkScan::kDone);
  EXPECT_EQ(end, body.size());
  for (size_t cut = 0; cut < body.size(); ++cut) {
    EXPECT_EQ(scan_chunked_body(body.substr(0, cut), 100, &end, &why), ChunkScan::kNeedMore)
        << cut;
  }
  EXPECT_EQ(scan_chunked_body("A\r\n0123456789\r\n0\r\n\r\n", 100, &end, &why),
            ChunkScan::kDone);
  EXPECT_EQ(scan_chunked_body("4\r\nabcd\r\n0\r\n\r\n", 3, &end, &why), ChunkScan::kTooLarge);
  EXPECT_EQ(scan_chunked_body("fffffffffffffff\r\n", 100, &end, &why), ChunkScan::kTooLarge);
  EXPECT_EQ(scan_chunked_body("zz\r\n", 100, &end, &why), ChunkScan::kBad);
  EXPECT_NE(why.find("chunk size"), std::string::npos);
  EXPECT_EQ(scan_chunked_body("4\r\nabcdXY0\r\n\r\n", 100, &end, &why), ChunkScan::kBad);
  EXPECT_EQ(scan_chunked_body("0\r\nX-Trailer: 1\r\n\r\n", 100, &end, &why), ChunkScan::kBad);
  EXPECT_NE(why.find("trailer"), std::string::npos);
}

TEST(HttpFrontend, NoClientOutsideARequest) { EXPECT_FALSE(client_disconnected()); }

}  // namespace
}  // namespace burst::server
