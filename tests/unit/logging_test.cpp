// The json log format's pieces that do not need a process (server/common/logging.h): a worker's
// raw stderr line as a record (worker_line_record), the escaping of hand-built records
// (json_quote) and cuts between UTF-8 characters (utf8_cut). Every record is checked by parsing
// it with nlohmann::json, strictly (bytes that are not UTF-8 fail the parse).
#include "common/logging.h"

#include <gtest/gtest.h>
#include <spdlog/spdlog.h>

#include <nlohmann/json.hpp>
#include <string>

namespace burst::server {
namespace {

using json = nlohmann::json;

json parsed(const std::string& record) {
  json j = json::parse(record, nullptr, /*allow_exceptions=*/false);
  EXPECT_FALSE(j.is_discarded()) << record;
  return j;
}

TEST(WorkerLineRecord, JsonObjectsPassThroughAsTheyAre) {
  const std::string own =
      R"({"time":"2026-11-28T10:00:00.000001Z","level":"info","logger":"burst-worker",)"
      R"("rank":1,"msg":"loaded"})";
  int level = 0;
  EXPECT_EQ(worker_line_record(own, 1, &level), own);
  EXPECT_EQ(level, -1);
}

TEST(WorkerLineRecord, RawTextIsWrappedWithTheRank) {
  int level = -1;
  const json j = parsed(worker_line_record("node0:12:12 [0] NCCL INFO Bootstrap", 3, &level));
  EXPECT_EQ(level, spdlog::level::info);
  EXPECT_EQ(j["level"], "info");
  EXPECT_EQ(j["logger"], "burst-worker");
  EXPECT_EQ(j["rank"], 3);
  EXPECT_EQ(j["msg"], "node0:12:12 [0] NCCL INFO Bootstrap");
  const std::string time = j["time"];
  ASSERT_EQ(time.size(), 27u) << time;  // 2026-11-28T10:00:00.000001Z, as spdlog's records
  EXPECT_EQ(time[10], 'T');
  EXPECT_EQ(time[19], '.');
  EXPECT_EQ(time.back(), 'Z');
  // The members in the order of the logger's own records, time first.
  EXPECT_EQ(worker_line_record("x", 0, &level).rfind("{\"time\":", 0), 0u);
}

TEST(WorkerLineRecord, TroubleIsAWarning) {
  for (const char* line : {"terminate called after throwing an instance of 'std::bad_alloc'",
                           "NCCL WARN Call to connect returned Connection refused",
                           "Segmentation fault: ERROR", "Aborted (core dumped)"}) {
    int level = 0;
    const json j = parsed(worker_line_record(line, 0, &level));
    EXPECT_EQ(level, spdlog::level::warn) << line;
    EXPECT_EQ(j["level"], "warning") << line;
    EXPECT_EQ(j["msg"], line);
  }
}

TEST(WorkerLineRecord, BytesThatAreNotUtf8AndBrokenJsonAreWrapped) {
  int level = 0;
  // Invalid bytes become U+FFFD; quotes, backslashes and controls are escaped.
  json j = parsed(worker_line_record("a\xff\xfe \"q\" \\ \t end", 0, &level));
  EXPECT_EQ(j["msg"], "a\xEF\xBF\xBD\xEF\xBF\xBD \"q\" \\ \t end");
  // A JSON object cut short, one with raw bytes in a string, and JSON that is not an object
  // are text, not records.
  for (const std::string& line : {std::string(R"({"msg":"cut)"), std::string("{\"m\":\"\xff\"}"),
                                  std::string("[1,2]"), std::string("{} trailing")}) {
    j = parsed(worker_line_record(line, 2, &level));
    EXPECT_EQ(j["rank"], 2) << line;
    EXPECT_NE(level, -1) << line;
  }
}

TEST(WorkerLineRecord, ACharacterCutAtTheEndIsDropped) {
  // A piece of a long line ends inside "模" (3 bytes): the cut part is dropped, the rest kept.
  const std::string piece = std::string("abc") + "\xe6\xa8";
  int level = 0;
  EXPECT_EQ(parsed(worker_line_record(piece, 0, &level))["msg"], "abc");
}

TEST(Utf8Cut, NeverEndsInsideACharacter) {
  const std::string s = "a\xc3\xa9\xe6\xa8\xa1\xf0\x9f\x98\x80";  // a é 模 😀: 1, 2, 3, 4 bytes
  const size_t whole[] = {0, 1, 1, 3, 3, 3, 6, 6, 6, 6, 10};
  for (size_t max = 0; max <= s.size(); ++max) {
    EXPECT_EQ(utf8_cut(s, max), s.substr(0, whole[max])) << max;
  }
}

TEST(JsonQuote, EscapesAndReplaces) {
  EXPECT_EQ(json_quote("a\"b\\c\n"), R"("a\"b\\c\n")");
  EXPECT_EQ(json::parse(json_quote("\xc3\x28")).get<std::string>(), "\xEF\xBF\xBD(");
}

}  // namespace
}  // namespace burst::server
