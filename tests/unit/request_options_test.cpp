// The request options' table (server/frontend/include/frontend/request_options.h) without a
// server: valid values land in the ScheduledRequest; a wrong type, a value out of its range, too
// many items, a token id outside the vocabulary and the checks between options are refused
// with the message both APIs send and the parameter it names; an endpoint ignores the options
// it does not take; every gRPC option has a field of its name in burst.proto (the gRPC API reads
// them by name). End to end: tests/server/test_http.py, tests/server/test_grpc.py.
#include "frontend/request_options.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "burst/v1/burst.pb.h"

namespace burst::server {
namespace {

constexpr int kVocab = 32000;

RawValue ints(std::initializer_list<int64_t> v) {
  std::vector<RawValue> items;
  for (int64_t x : v) items.push_back(RawValue::integer(x));
  return RawValue::array(std::move(items));
}

// The error of parsing `raw` at `endpoint`, "" when accepted.
std::string error_of(const RawOptions& raw, Endpoint endpoint = kCompletions) {
  ParsedOptions o;
  const auto e = parse_options(raw, endpoint, kVocab, o);
  return e ? e->param + ": " + e->message : "";
}

TEST(RequestOptions, ValidValuesAreStored) {
  ParsedOptions o;
  o.request.prompt = {1, 2, 3};
  const RawOptions raw = {
      {"max_tokens", RawValue::integer(20)},
      {"temperature", RawValue::integer(0)},
      {"top_p", RawValue::number(0.5)},
      {"top_k", RawValue::integer(-1)},
      {"seed", RawValue::integer(-1)},  // gRPC's uint64 seed arrives as its bits
      {"presence_penalty", RawValue::number(-2)},
      {"repetition_penalty", RawValue::number(1.5)},
      {"logit_bias", RawValue::object({{"7", RawValue::integer(5)},
                                       {"3", RawValue::number(-100)}})},
      {"min_tokens", RawValue::integer(20)},
      {"ignore_eos", RawValue::boolean(true)},
      {"stop", RawValue::string("amen")},
      {"stop_token_ids", ints({13, 0, kVocab - 1})},
      {"logprobs", RawValue::integer(3)}};
  ASSERT_FALSE(parse_options(raw, kCompletions, kVocab, o).has_value());
  const ScheduledRequest& r = o.request;
  EXPECT_EQ(r.prompt, (std::vector<int32_t>{1, 2, 3}));  // what the table does not set stays
  EXPECT_EQ(r.max_tokens, 20);
  EXPECT_TRUE(o.max_tokens_given);
  EXPECT_EQ(r.sampling.temperature, 0.f);
  EXPECT_EQ(r.sampling.top_p, 0.5f);
  EXPECT_EQ(r.sampling.top_k, 0);
  EXPECT_EQ(r.sampling.seed, ~uint64_t{0});
  EXPECT_TRUE(o.seed_given);
  EXPECT_EQ(r.adjust.presence_penalty, -2.f);
  EXPECT_EQ(r.adjust.repetition_penalty, 1.5f);
  EXPECT_EQ(r.adjust.logit_bias, (std::vector<std::pair<int32_t, float>>{{3, -100.f}, {7, 5.f}}));
  EXPECT_EQ(r.adjust.min_tokens, 20);
  EXPECT_TRUE(r.ignore_eos);
  EXPECT_EQ(r.stop, std::vector<std::string>{"amen"});
  EXPECT_EQ(r.stop_token_ids, (std::vector<int32_t>{13, 0, kVocab - 1}));
  EXPECT_EQ(r.logprobs, 3);
}

TEST(RequestOptions, DefaultsAreHttps) {
  ParsedOptions o;
  ASSERT_FALSE(parse_options({}, kChat, kVocab, o).has_value());
  EXPECT_EQ(o.request.sampling.temperature, 1.f);
  EXPECT_EQ(o.request.sampling.top_p, 1.f);
  EXPECT_FALSE(o.max_tokens_given);
  EXPECT_FALSE(o.seed_given);
  EXPECT_EQ(o.request.logprobs, -1);
  EXPECT_TRUE(o.request.stop_token_ids.empty());
}

TEST(RequestOptions, WrongTypesNameTheOption) {
  EXPECT_EQ(error_of({{"temperature", RawValue::string("hot")}}),
            "temperature: 'temperature' must be a number");
  EXPECT_EQ(error_of({{"seed", RawValue::number(1.5)}}), "seed: 'seed' must be an integer");
  EXPECT_EQ(error_of({{"ignore_eos", RawValue::string("yes")}}),
            "ignore_eos: 'ignore_eos' must be a boolean");
  EXPECT_EQ(error_of({{"logprobs", RawValue::boolean(true)}}, kCompletions),
            "logprobs: 'logprobs' must be an integer");
  EXPECT_EQ(error_of({{"logprobs", RawValue::integer(3)}}, kChat),
            "logprobs: 'logprobs' must be a boolean");
  EXPECT_EQ(error_of({{"stop", RawValue::integer(3)}}),
            "stop: 'stop' must be a string or an array of up to 4 strings");
  EXPECT_EQ(error_of({{"stop_token_ids", RawValue::integer(3)}}),
            "stop_token_ids: 'stop_token_ids' must be an array of up to 64 token ids");
  EXPECT_EQ(error_of({{"stop_token_ids", RawValue::array({RawValue::string("3")})}}),
            "stop_token_ids: 'stop_token_ids' must be an array of up to 64 token ids");
  EXPECT_EQ(error_of({{"stop_token_ids", RawValue::array({RawValue{}})}}),  // [null]
            "stop_token_ids: 'stop_token_ids' must be an array of up to 64 token ids");
  EXPECT_EQ(error_of({{"logit_bias", ints({1})}}),
            "logit_bias: 'logit_bias' must be an object of token id -> number");
}

TEST(RequestOptions, LimitsAreChecked) {
  EXPECT_EQ(error_of({{"temperature", RawValue::number(-0.5)}}),
            "temperature: 'temperature' must be >= 0, got -0.5");
  EXPECT_EQ(error_of({{"top_p", RawValue::integer(0)}}),
            "top_p: 'top_p' must be in (0, 1], got 0");
  EXPECT_EQ(error_of({{"top_p", RawValue::number(1.5)}}),
            "top_p: 'top_p' must be in (0, 1], got 1.5");
  EXPECT_EQ(error_of({{"top_k", RawValue::integer(-2)}}),
            "top_k: 'top_k' must be >= -1 (-1 and 0: off), got -2");
  EXPECT_EQ(error_of({{"presence_penalty", RawValue::number(2.5)}}),
            "presence_penalty: 'presence_penalty' must be in [-2, 2], got 2.5");
  EXPECT_EQ(error_of({{"repetition_penalty", RawValue::integer(0)}}),
            "repetition_penalty: 'repetition_penalty' must be > 0, got 0");
  // Completions take max_tokens 0 (the prompt alone, with echo: http_api.cpp checks that).
  EXPECT_EQ(error_of({{"max_tokens", RawValue::integer(0)}}), "");
  EXPECT_EQ(error_of({{"max_tokens", RawValue::integer(-3)}}),
            "max_tokens: 'max_tokens' must be >= 0, got -3");
  EXPECT_EQ(error_of({{"max_tokens", RawValue::integer(0)}}, kChat),
            "max_tokens: 'max_tokens' must be > 0, got 0");
  EXPECT_EQ(error_of({{"max_tokens", RawValue::integer(0)}}, kGenerate),
            "max_tokens: 'max_tokens' must be > 0, got 0");
  EXPECT_EQ(error_of({{"logprobs", RawValue::integer(21)}}),
            "logprobs: 'logprobs' must be in [0, 20], got 21");
  EXPECT_EQ(error_of({{"min_tokens", RawValue::integer(-1)}}),
            "min_tokens: 'min_tokens' must be >= 0, got -1");
  // A number that is not finite (protobuf floats can be) is out of every range.
  EXPECT_EQ(error_of({{"temperature", RawValue::number(std::nan(""))}}),
            "temperature: 'temperature' must be >= 0, got nan");
  EXPECT_EQ(error_of({{"frequency_penalty", RawValue::number(HUGE_VAL)}}),
            "frequency_penalty: 'frequency_penalty' must be in [-2, 2], got inf");
}

TEST(RequestOptions, RefusalsNameTheValueReceived) {
  // JSON's 2^64 - 1 (and a protobuf uint64 past 2^63) is that number, not -1; a count is kept
  // as asked (the scheduler's limit check names 10^12, not a clamp of it).
  EXPECT_EQ(error_of({{"max_tokens", RawValue::unsigned_integer(UINT64_MAX)}}),
            "max_tokens: 'max_tokens' must be >= 0 and below 2^63, got 18446744073709551615");
  EXPECT_EQ(error_of({{"min_tokens", RawValue::unsigned_integer(UINT64_MAX)}}),
            "min_tokens: 'min_tokens' must be >= 0 and below 2^63, got 18446744073709551615");
  ParsedOptions o;
  ASSERT_FALSE(parse_options({{"max_tokens", RawValue::integer(1000000000000)}}, kCompletions,
                             kVocab, o));
  EXPECT_EQ(o.request.max_tokens, 1000000000000);
  // A seed takes all 64 bits.
  o = {};
  ASSERT_FALSE(parse_options({{"seed", RawValue::unsigned_integer(UINT64_MAX)}}, kCompletions,
                             kVocab, o));
  EXPECT_EQ(o.request.sampling.seed, UINT64_MAX);
}

TEST(RequestOptions, TokenIdsMustBeInTheVocabulary) {
  EXPECT_EQ(error_of({{"stop_token_ids", ints({5, kVocab})}}),
            "stop_token_ids: 'stop_token_ids' must hold token ids in [0, 32000): 32000 is not one");
  EXPECT_EQ(error_of({{"stop_token_ids", ints({-1})}}),
            "stop_token_ids: 'stop_token_ids' must hold token ids in [0, 32000): -1 is not one");
  std::vector<RawValue> many(kMaxStopTokenIds, RawValue::integer(1));
  EXPECT_EQ(error_of({{"stop_token_ids", RawValue::array(many)}}), "");
  many.push_back(RawValue::integer(1));
  EXPECT_EQ(error_of({{"stop_token_ids", RawValue::array(many)}}),
            "stop_token_ids: 'stop_token_ids' must be an array of up to 64 token ids");
  for (const char* key : {"abc", "32000", "-5", "5x", ""}) {
    EXPECT_EQ(error_of({{"logit_bias", RawValue::object({{key, RawValue::integer(1)}})}}),
              std::string("logit_bias: 'logit_bias' key '") + key +
                  "' is not a token id in [0, 32000)");
  }
  EXPECT_EQ(error_of({{"logit_bias", RawValue::object({{"5", RawValue::integer(101)}})}}),
            "logit_bias: 'logit_bias' values must be numbers in [-100, 100]");
  EXPECT_EQ(error_of({{"logit_bias", RawValue::object({{"5", RawValue::string("1")}})}}),
            "logit_bias: 'logit_bias' values must be numbers in [-100, 100]");
}

TEST(RequestOptions, StopStrings) {
  const RawValue five = RawValue::array({RawValue::string("a"), RawValue::string("b"),
                                         RawValue::string("c"), RawValue::string("d"),
                                         RawValue::string("e")});
  EXPECT_EQ(error_of({{"stop", five}}),
            "stop: 'stop' must be a string or an array of up to 4 strings");
  EXPECT_EQ(error_of({{"stop", RawValue::string("")}}),
            "stop: 'stop' must not hold an empty string");
  EXPECT_EQ(error_of({{"stop", RawValue::array({RawValue::string("a"), RawValue::integer(1)})}}),
            "stop: 'stop' must be a string or an array of up to 4 strings");
}

TEST(RequestOptions, ChecksBetweenOptions) {
  // min_tokens is checked against a given max_tokens at once, against the API's default once
  // it is set (check_min_tokens), with the values as asked.
  EXPECT_EQ(error_of({{"max_tokens", RawValue::integer(2)}, {"min_tokens", RawValue::integer(5)}}),
            "min_tokens: 'min_tokens' (5) must not exceed max_tokens (2)");
  EXPECT_EQ(error_of({{"min_tokens", RawValue::integer(5)}}), "");
  {
    ParsedOptions d;
    ASSERT_FALSE(parse_options({{"min_tokens", RawValue::integer(int64_t{1} << 40)}},
                               kCompletions, kVocab, d));
    d.request.max_tokens = 16;  // the API's default
    const auto e = check_min_tokens(d);
    ASSERT_TRUE(e.has_value());
    EXPECT_EQ(e->param, "min_tokens");
    EXPECT_EQ(e->message, "'min_tokens' (1099511627776) must not exceed max_tokens (16)");
    d.request.max_tokens = int64_t{1} << 40;
    EXPECT_FALSE(check_min_tokens(d).has_value());
  }
  // top_logprobs needs logprobs: true (chat, gRPC), after its own range.
  EXPECT_EQ(error_of({{"top_logprobs", RawValue::integer(2)}}, kChat),
            "top_logprobs: 'top_logprobs' needs 'logprobs': true");
  EXPECT_EQ(error_of({{"logprobs", RawValue::boolean(true)},
                      {"top_logprobs", RawValue::integer(21)}}, kGrpcChat),
            "top_logprobs: 'top_logprobs' must be in [0, 20], got 21");
  ParsedOptions o;
  ASSERT_FALSE(parse_options({{"logprobs", RawValue::boolean(true)},
                              {"top_logprobs", RawValue::integer(2)}},
                             kGrpcChat, kVocab, o));
  EXPECT_EQ(o.request.logprobs, 2);
  // The newer name wins over max_tokens (chat); both are checked.
  o = {};
  ASSERT_FALSE(parse_options({{"max_tokens", RawValue::integer(9)},
                              {"max_completion_tokens", RawValue::integer(3)}},
                             kChat, kVocab, o));
  EXPECT_EQ(o.request.max_tokens, 3);
  EXPECT_EQ(error_of({{"max_tokens", RawValue::integer(0)},
                      {"max_completion_tokens", RawValue::integer(3)}}, kChat),
            "max_tokens: 'max_tokens' must be > 0, got 0");
}

// vLLM's options: min_p in [0, 1], include_stop_str_in_output everywhere, add_generation_prompt
// for chats only (default true).
TEST(RequestOptions, VllmOptions) {
  ParsedOptions o;
  const RawOptions raw = {{"min_p", RawValue::number(0.05)},
                          {"include_stop_str_in_output", RawValue::boolean(true)},
                          {"add_generation_prompt", RawValue::boolean(false)}};
  ASSERT_FALSE(parse_options(raw, kGrpcChat, kVocab, o).has_value());
  EXPECT_EQ(o.request.sampling.min_p, 0.05f);
  EXPECT_TRUE(o.request.include_stop_str_in_output);
  EXPECT_FALSE(o.add_generation_prompt);
  ParsedOptions c;
  ASSERT_FALSE(parse_options(raw, kCompletions, kVocab, c).has_value());
  EXPECT_TRUE(c.add_generation_prompt);  // not a completions option: not looked at
  EXPECT_EQ(c.request.sampling.min_p, 0.05f);
  EXPECT_EQ(error_of({{"min_p", RawValue::number(1.5)}}),
            "min_p: 'min_p' must be in [0, 1] (0: off), got 1.5");
  EXPECT_EQ(error_of({{"min_p", RawValue::integer(1)}}), "");
  EXPECT_EQ(error_of({{"include_stop_str_in_output", RawValue::integer(1)}}),
            "include_stop_str_in_output: 'include_stop_str_in_output' must be a boolean");
}

TEST(RequestOptions, EndpointsTakeTheirOwnOptions) {
  // Generate requires max_tokens; the others default it.
  EXPECT_EQ(error_of({}, kGenerate), "max_tokens: 'max_tokens' is required: an integer > 0");
  EXPECT_EQ(error_of({}, kGrpcChat), "");
  // An option another endpoint takes is not looked at (the APIs refuse unknown names).
  EXPECT_EQ(error_of({{"max_completion_tokens", RawValue::integer(0)}}, kCompletions), "");
  EXPECT_EQ(error_of({{"top_logprobs", RawValue::integer(2)}}, kCompletions), "");
}

// The gRPC API reads an option from the request's field of its name, else from `sampling`'s.
TEST(RequestOptions, EveryGrpcOptionIsAProtoField) {
  for (const OptionSpec& o : option_table()) {
    for (const auto& [endpoint, desc] :
         {std::pair{kGenerate, burst::v1::GenerateRequest::descriptor()},
          std::pair{kGrpcChat, burst::v1::ChatRequest::descriptor()}}) {
      if (!(o.endpoints & endpoint)) continue;
      const bool found = desc->FindFieldByName(o.name) != nullptr ||
                         burst::v1::SamplingParams::descriptor()->FindFieldByName(o.name);
      EXPECT_TRUE(found) << o.name << " is not a field of " << desc->full_name();
    }
  }
}

}  // namespace
}  // namespace burst::server
