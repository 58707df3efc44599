#include "frontend/grpc_api.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/unknown_field_set.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <random>

#include "burst/v1/burst.grpc.pb.h"
#include "common/auth.h"
#include "common/chat_template.h"
#include "common/logging.h"
#include "frontend/grpc_reflection.h"
#include "frontend/request_options.h"

namespace burst::server {

namespace pb = burst::v1;

namespace {

grpc::StatusCode grpc_code(ErrorCode c) {
  switch (c) {
    case ErrorCode::kInvalidArgument: return grpc::StatusCode::INVALID_ARGUMENT;
    case ErrorCode::kUnauthenticated: return grpc::StatusCode::UNAUTHENTICATED;
    case ErrorCode::kNotFound: return grpc::StatusCode::NOT_FOUND;
    case ErrorCode::kTooLarge: return grpc::StatusCode::RESOURCE_EXHAUSTED;
    case ErrorCode::kUnavailable: return grpc::StatusCode::UNAVAILABLE;
    case ErrorCode::kInternal: return grpc::StatusCode::INTERNAL;
  }
  return grpc::StatusCode::INTERNAL;
}

std::string request_id() {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  char buf[32];
  std::snprintf(buf, sizeof(buf), "req-%016llx", static_cast<unsigned long long>(rng()));
  return buf;
}

// Why `bytes` are not a valid message of type `desc` (`path` names it in the message), or "".
// Protobuf's own parser only says "failed" (and logs invalid UTF-8 on stderr itself, which a
// client could use to write lines into the server's log), so the bytes are checked first: walked
// as an UnknownFieldSet (which accepts any well-formed encoding), checking what the typed parser
// also checks: every string field (nested messages, repeated fields and map entries included)
// must be well-formed UTF-8 (proto3).
std::string diagnose_request(const std::string& bytes, const google::protobuf::Descriptor* desc,
                             const std::string& path, int depth) {
  namespace gp = google::protobuf;
  gp::UnknownFieldSet fields;
  if (!fields.ParseFromString(bytes)) {
    return "malformed protobuf: " + path +
           " is not a valid encoding (truncated, a bad tag or wire type, or a length past the "
           "end)";
  }
  std::map<int, int> seen;  // field number -> occurrences so far, to name repeated elements
  for (int i = 0; i < fields.field_count(); ++i) {
    const gp::UnknownField& f = fields.field(i);
    const int index = seen[f.number()]++;
    const gp::FieldDescriptor* fd = desc->FindFieldByNumber(f.number());
    if (f.type() != gp::UnknownField::TYPE_LENGTH_DELIMITED || fd == nullptr) continue;
    const std::string name =
        path + "." + fd->name() + (fd->is_repeated() ? "[" + std::to_string(index) + "]" : "");
    if (fd->type() == gp::FieldDescriptor::TYPE_STRING) {
      if (Status st = validate_utf8(f.length_delimited()); !st.ok()) {
        return "field " + name + " (a string) is not valid UTF-8: " + st.message() +
               " (send text as UTF-8, or token ids)";
      }
    } else if (fd->type() == gp::FieldDescriptor::TYPE_MESSAGE) {
      if (depth >= 32) return "malformed protobuf: " + name + " is nested too deeply";
      std::string why = diagnose_request(f.length_delimited(), fd->message_type(), name, depth + 1);
      if (!why.empty()) return why;
    }
  }
  return "";
}

// Parses a request as received. The methods take raw bytes (see Service's constructor) so that
// a request that does not parse gets INVALID_ARGUMENT with the reason, not gRPC's own INTERNAL
// with empty details.
grpc::Status parse_request(const grpc::ByteBuffer& raw, google::protobuf::Message* msg) {
  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (raw.Valid() && raw.Dump(&slices).ok()) {
    bytes.reserve(raw.Length());
    for (const grpc::Slice& s : slices) {
      bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
  }
  const google::protobuf::Descriptor* desc = msg->GetDescriptor();
  std::string why = diagnose_request(bytes, desc, desc->full_name(), 0);
  if (why.empty() && msg->ParseFromString(bytes)) return grpc::Status::OK;
  if (why.empty()) why = "malformed protobuf: not a valid " + desc->full_name();
  return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, why);
}

namespace gp = google::protobuf;

// One value of a field (element `index` of a repeated one, -1: a singular one) as the request
// options' table reads it: integers of any width are kInt (uint64 as its bits: a seed).
RawValue raw_scalar(const gp::Message& m, const gp::FieldDescriptor* f, int index) {
  const gp::Reflection* r = m.GetReflection();
  const bool rep = index >= 0;
  switch (f->cpp_type()) {
    case gp::FieldDescriptor::CPPTYPE_BOOL:
      return RawValue::boolean(rep ? r->GetRepeatedBool(m, f, index) : r->GetBool(m, f));
    case gp::FieldDescriptor::CPPTYPE_INT32:
      return RawValue::integer(rep ? r->GetRepeatedInt32(m, f, index) : r->GetInt32(m, f));
    case gp::FieldDescriptor::CPPTYPE_INT64:
      return RawValue::integer(rep ? r->GetRepeatedInt64(m, f, index) : r->GetInt64(m, f));
    case gp::FieldDescriptor::CPPTYPE_UINT32:
      return RawValue::integer(rep ? r->GetRepeatedUInt32(m, f, index) : r->GetUInt32(m, f));
    case gp::FieldDescriptor::CPPTYPE_UINT64:
      return RawValue::unsigned_integer(rep ? r->GetRepeatedUInt64(m, f, index)
                                            : r->GetUInt64(m, f));
    case gp::FieldDescriptor::CPPTYPE_FLOAT:
      return RawValue::number(rep ? r->GetRepeatedFloat(m, f, index) : r->GetFloat(m, f));
    case gp::FieldDescriptor::CPPTYPE_DOUBLE:
      return RawValue::number(rep ? r->GetRepeatedDouble(m, f, index) : r->GetDouble(m, f));
    case gp::FieldDescriptor::CPPTYPE_STRING:
      return RawValue::string(rep ? r->GetRepeatedString(m, f, index) : r->GetString(m, f));
    default:
      return {};  // enums, messages: no option has such a type (refused as the wrong type)
  }
}

RawValue raw_struct(const gp::Struct& s);

// A google.protobuf.Value as the JSON value it stands for. Numbers are doubles there (JSON has
// one number type): a whole one within int64 reads as an integer, as HTTP's JSON gives it.
RawValue raw_json(const gp::Value& v) {
  switch (v.kind_case()) {
    case gp::Value::kBoolValue: return RawValue::boolean(v.bool_value());
    case gp::Value::kNumberValue: {
      const double d = v.number_value();
      const bool whole = std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e18;
      return whole ? RawValue::integer(static_cast<int64_t>(d)) : RawValue::number(d);
    }
    case gp::Value::kStringValue: return RawValue::string(v.string_value());
    case gp::Value::kListValue: {
      std::vector<RawValue> items;
      for (const gp::Value& x : v.list_value().values()) items.push_back(raw_json(x));
      return RawValue::array(std::move(items));
    }
    case gp::Value::kStructValue: return raw_struct(v.struct_value());
    default: return {};  // null_value, or no kind set
  }
}

// A google.protobuf.Struct as the JSON object it holds. Its fields are a map (no order): sorted
// by key, so that a template sees them the same way every time.
RawValue raw_struct(const gp::Struct& s) {
  std::vector<std::pair<std::string, RawValue>> fields;
  for (const auto& [key, x] : s.fields()) fields.emplace_back(key, raw_json(x));
  std::sort(fields.begin(), fields.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  return RawValue::object(std::move(fields));
}

// A set field as a RawValue: a map is an object (keys as text), a repeated field an array, a
// google.protobuf.Struct the JSON object it holds.
RawValue raw_field(const gp::Message& m, const gp::FieldDescriptor* f) {
  const gp::Reflection* r = m.GetReflection();
  if (f->message_type() == gp::Struct::descriptor()) {
    return raw_struct(static_cast<const gp::Struct&>(r->GetMessage(m, f)));
  }
  if (f->is_map()) {
    std::vector<std::pair<std::string, RawValue>> fields;
    for (int i = 0; i < r->FieldSize(m, f); ++i) {
      const gp::Message& entry = r->GetRepeatedMessage(m, f, i);
      const gp::Descriptor* d = entry.GetDescriptor();
      const RawValue key = raw_scalar(entry, d->map_key(), -1);
      fields.emplace_back(key.kind == RawValue::Kind::kString ? key.s : std::to_string(key.i),
                          raw_scalar(entry, d->map_value(), -1));
    }
    return RawValue::object(std::move(fields));
  }
  if (f->is_repeated()) {
    std::vector<RawValue> items;
    for (int i = 0; i < r->FieldSize(m, f); ++i) items.push_back(raw_scalar(m, f, i));
    return RawValue::array(std::move(items));
  }
  return raw_scalar(m, f, -1);
}

// The request's values of the table's options, found by name in the request or its `sampling`
// message. Unset is absent: an `optional` field not set, a repeated one empty, and (proto3
// cannot tell them apart) any other scalar at its zero value, which is why 0 documents "unset".
RawOptions raw_options(const gp::Message& req, Endpoint endpoint) {
  RawOptions raw;
  const gp::FieldDescriptor* sampling_field = req.GetDescriptor()->FindFieldByName("sampling");
  for (const OptionSpec& o : option_table()) {
    if (!(o.endpoints & endpoint)) continue;
    const gp::Message* m = &req;
    const gp::FieldDescriptor* f = req.GetDescriptor()->FindFieldByName(o.name);
    if (f == nullptr && sampling_field != nullptr) {
      m = &req.GetReflection()->GetMessage(req, sampling_field);
      f = m->GetDescriptor()->FindFieldByName(o.name);
    }
    if (f == nullptr) continue;
    const bool set = f->is_repeated() ? m->GetReflection()->FieldSize(*m, f) > 0
                                      : m->GetReflection()->HasField(*m, f);
    if (set) raw[o.name] = raw_field(*m, f);
  }
  return raw;
}

}  // namespace

const char* code_name(grpc::StatusCode c) {
  switch (c) {
    case grpc::StatusCode::OK: return "OK";
    case grpc::StatusCode::CANCELLED: return "CANCELLED";
    case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::UNAUTHENTICATED: return "UNAUTHENTICATED";
    case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
    case grpc::StatusCode::INTERNAL: return "INTERNAL";
    default: return "OTHER";
  }
}

// One call's access-log record (as HTTP's): method, status, latency, request id (the client's
// x-request-id metadata when printable, else a fresh one), tokens.
struct CallLog {
  std::string path, id, peer;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  int64_t prompt_tokens = -1, completion_tokens = 0;
  std::string finish;

  CallLog(grpc::ServerContext* ctx, const char* method)
      : path(std::string("/burst.v1.Burst/") + method), peer(ctx->peer()) {
    const auto& md = ctx->client_metadata();
    auto it = md.find("x-request-id");
    if (it != md.end()) id.assign(it->second.data(), it->second.size());
    const bool printable =
        std::all_of(id.begin(), id.end(), [](char ch) { return ch > 0x20 && ch < 0x7f; });
    if (id.empty() || id.size() > 200 || !printable) id = request_id();
  }
  grpc::Status done(grpc::Status st) const {
    const double ms = std::chrono::duration<double, std::milli>(
                          std::chrono::steady_clock::now() - start).count();
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.1f", ms);
    std::string line = std::string("access gRPC ") + path + " " + code_name(st.error_code()) +
                       " " + buf + " ms request_id=" + id + " client=" + peer;
    std::string fields = "\"method\":\"gRPC\",\"path\":" + json_quote(path) +
                         ",\"status\":" + json_quote(code_name(st.error_code())) +
                         ",\"latency_ms\":" + buf + ",\"request_id\":" + json_quote(id) +
                         ",\"client\":" + json_quote(peer);
    if (prompt_tokens >= 0) {
      line += " prompt_tokens=" + std::to_string(prompt_tokens) +
              " completion_tokens=" + std::to_string(completion_tokens) + " finish=" + finish;
      fields += ",\"prompt_tokens\":" + std::to_string(prompt_tokens) +
                ",\"completion_tokens\":" + std::to_string(completion_tokens) +
                ",\"finish\":" + json_quote(finish);
    }
    if (!st.ok()) {
      line += " error=" + json_quote(st.error_message().substr(0, 200));
      fields += ",\"error\":" + json_quote(st.error_message().substr(0, 200));
    }
    log_access(st.error_code() == grpc::StatusCode::INTERNAL ? SPDLOG_LEVEL_WARN
                                                             : SPDLOG_LEVEL_INFO,
               line, fields);
    return st;
  }
};

class GrpcApi::Service final : public pb::Burst::Service {
 public:
  // Every method is installed with a raw-bytes request: gRPC's generated handlers parse the
  // request before the method runs and answer a parse failure (malformed protobuf, invalid
  // UTF-8 in a proto3 string field) with INTERNAL and empty details, which tells the client
  // neither that the fault is theirs nor what it is. The handlers below are the ones the
  // generated WithSplitStreamingMethod_* / WithStreamedUnaryMethod_* classes install, with
  // grpc::ByteBuffer as the request type; parse_request turns the bytes into the message or
  // into INVALID_ARGUMENT naming the field. (Declaring the fields `bytes` in the .proto would
  // be wire-compatible, but the generated clients and grpcurl's JSON would then take base64 and
  // byte strings instead of text; a generic service would lose the typed responses.)
  using Streamer = grpc::ServerSplitStreamer<grpc::ByteBuffer, pb::GenerateResponse>;

  template <typename Resp>
  using RawStreaming = grpc::internal::SplitServerStreamingHandler<grpc::ByteBuffer, Resp>;
  template <typename Resp>
  using RawUnary = grpc::internal::StreamedUnaryHandler<grpc::ByteBuffer, Resp>;
  template <typename Resp>
  using UnaryStreamer = grpc::ServerUnaryStreamer<grpc::ByteBuffer, Resp>;

  Service(const ServerConfig& config, Scheduler& scheduler, const Tokenizer& tokenizer,
          const GrpcLimits& limits)
      : config_(config), scheduler_(scheduler), tokenizer_(tokenizer), limits_(limits) {
    MarkMethodStreamed(
        method_index("Generate"),
        new RawStreaming<pb::GenerateResponse>([this](grpc::ServerContext* ctx, Streamer* s) {
          return streamed(ctx, s, "Generate", &Service::generate);
        }));
    MarkMethodStreamed(method_index("Chat"), new RawStreaming<pb::GenerateResponse>(
                                                 [this](grpc::ServerContext* ctx, Streamer* s) {
                                                   return streamed(ctx, s, "Chat", &Service::chat);
                                                 }));
    MarkMethodStreamed(
        method_index("Tokenize"),
        new RawUnary<pb::TokenizeResponse>(
            [this](grpc::ServerContext* ctx, UnaryStreamer<pb::TokenizeResponse>* s) {
              return unary(ctx, s, "Tokenize", &Service::tokenize);
            }));
    MarkMethodStreamed(
        method_index("ModelInfo"),
        new RawUnary<pb::ModelInfoResponse>(
            [this](grpc::ServerContext* ctx, UnaryStreamer<pb::ModelInfoResponse>* s) {
              return unary(ctx, s, "ModelInfo", &Service::model_info);
            }));
  }

  // The index the generated Service registered the rpc `name` under: the .proto's order, which
  // is the service descriptor's.
  static int method_index(const char* name) {
    const google::protobuf::MethodDescriptor* m =
        pb::GenerateRequest::descriptor()->file()->FindServiceByName("Burst")->FindMethodByName(
            name);
    if (m == nullptr) {
      spdlog::critical("burst.v1.Burst has no rpc {}", name);
      std::abort();
    }
    return m->index();
  }

  // The typed entry points are replaced by the raw handlers above and never called.
  grpc::Status Generate(grpc::ServerContext*, const pb::GenerateRequest*,
                        grpc::ServerWriter<pb::GenerateResponse>*) override {
    return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "");
  }
  grpc::Status Chat(grpc::ServerContext*, const pb::ChatRequest*,
                    grpc::ServerWriter<pb::GenerateResponse>*) override {
    return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "");
  }
  grpc::Status Tokenize(grpc::ServerContext*, const pb::TokenizeRequest*,
                        pb::TokenizeResponse*) override {
    return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "");
  }
  grpc::Status ModelInfo(grpc::ServerContext*, const pb::ModelInfoRequest*,
                         pb::ModelInfoResponse*) override {
    return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "");
  }

  // What every call starts with: the API key (before any byte of the request is looked at),
  // then the one request message, read raw and parsed.
  template <typename Req, typename Reader>
  grpc::Status receive(grpc::ServerContext* ctx, Reader* reader, Req* req) const {
    if (grpc::Status st = check_auth(ctx); !st.ok()) return st;
    grpc::ByteBuffer raw;
    if (!reader->Read(&raw)) {
      // GrpcLimits' watchdog cancels a call whose message is late with DEADLINE_EXCEEDED,
      // which fails this read: the log gets the status the client got.
      if (ctx->IsCancelled() && limits_.cancelled_late(ctx)) {
        return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                            "the request message did not arrive within " +
                                std::to_string(config_.grpc_message_timeout_ms) +
                                " ms of the call's start (--grpc-message-timeout-ms)");
      }
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no request message");
    }
    return parse_request(raw, req);
  }

  // Calls of this service whose handler runs (GrpcApi::stop waits for them).
  int in_flight() const { return in_flight_.load(); }

  // A server-streaming call: receives the request, runs `body`.
  template <typename Req>
  grpc::Status streamed(grpc::ServerContext* ctx, Streamer* stream, const char* method,
                        grpc::Status (Service::*body)(grpc::ServerContext*, const Req*, Streamer*,
                                                      CallLog*)) {
    const InFlight counted(in_flight_);
    CallLog log(ctx, method);
    const GrpcLimits::ClientCall client(limits_, ctx->peer());
    if (!client.admitted()) return log.done(too_many_calls(client));
    Req req;
    if (grpc::Status st = receive(ctx, stream, &req); !st.ok()) return log.done(st);
    return guarded(log, [&] { return (this->*body)(ctx, &req, stream, &log); });
  }

  // A unary call: receives the request, runs `body`, sends the response when OK.
  template <typename Req, typename Resp>
  grpc::Status unary(grpc::ServerContext* ctx, UnaryStreamer<Resp>* s, const char* method,
                     grpc::Status (Service::*body)(grpc::ServerContext*, const Req*, Resp*)) {
    const InFlight counted(in_flight_);
    CallLog log(ctx, method);
    const GrpcLimits::ClientCall client(limits_, ctx->peer());
    if (!client.admitted()) return log.done(too_many_calls(client));
    Req req;
    if (grpc::Status st = receive(ctx, s, &req); !st.ok()) return log.done(st);
    Resp resp;
    grpc::Status st = guarded(log, [&] { return (this->*body)(ctx, &req, &resp); });
    if (st.ok()) s->Write(resp);
    return st;
  }

  // One client's calls beyond --grpc-max-calls-per-client: refused before their message is
  // read, so that their threads go back at once.
  static grpc::Status too_many_calls(const GrpcLimits::ClientCall& client) {
    spdlog::warn("gRPC: {}", client.refusal());
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, client.refusal());
  }

  // Runs a call's body: no exception leaves the service (it would end the process), and the
  // access log gets the final status either way.
  template <typename F>
  static grpc::Status guarded(CallLog& log, F&& body) {
    try {
      return log.done(body());
    } catch (const std::exception& e) {
      return log.done(
          grpc::Status(grpc::StatusCode::INTERNAL, std::string("internal error: ") + e.what()));
    }
  }

 private:
  grpc::Status tokenize(grpc::ServerContext*, const pb::TokenizeRequest* req,
                        pb::TokenizeResponse* resp) {
    if (auto e = scheduler_.check_prompt_text(req->text().size())) {
      return grpc::Status(grpc_code(e->code), e->message);
    }
    auto ids = tokenizer_.encode(req->text(), req->add_bos(), false);
    if (!ids.ok()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "text: " + ids.message());
    }
    resp->mutable_ids()->Add(ids.value().begin(), ids.value().end());
    return grpc::Status::OK;
  }

  grpc::Status model_info(grpc::ServerContext*, const pb::ModelInfoRequest*,
                          pb::ModelInfoResponse* resp) {
    resp->set_model(config_.model_name);
    resp->set_vocab_size(scheduler_.vocab_size());
    resp->set_max_context(scheduler_.max_context());
    resp->set_workers(scheduler_.workers());
    resp->set_device(scheduler_.device());
    return grpc::Status::OK;
  }

  grpc::Status check_auth(grpc::ServerContext* ctx) const {
    if (config_.api_key.empty()) return grpc::Status::OK;
    const auto& md = ctx->client_metadata();
    auto it = md.find("authorization");
    if (it == md.end()) {
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                          "missing API key (metadata authorization: Bearer KEY)");
    }
    if (!token_equal("Bearer " + config_.api_key,
                     std::string(it->second.data(), it->second.size()))) {
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "wrong API key");
    }
    return grpc::Status::OK;
  }

  grpc::Status generate(grpc::ServerContext* ctx, const pb::GenerateRequest* req, Streamer* writer,
                        CallLog* log) {
    if (auto st = check_model(req->model()); !st.ok()) return st;
    ScheduledRequest r;  // its prompt
    switch (req->prompt_case()) {
      case pb::GenerateRequest::kText: {
        if (req->text().empty()) {
          return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "the prompt is empty");
        }
        if (auto e = scheduler_.check_prompt_text(req->text().size())) {
          return grpc::Status(grpc_code(e->code), e->message);
        }
        auto ids = tokenizer_.encode(req->text(), true, false);
        if (!ids.ok()) {
          return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "prompt: " + ids.message());
        }
        r.prompt.assign(ids.value().begin(), ids.value().end());
        break;
      }
      case pb::GenerateRequest::kTokenIds:
        r.prompt.assign(req->token_ids().ids().begin(), req->token_ids().ids().end());
        break;
      default:
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "the prompt is empty");
    }
    ParsedOptions o;
    if (grpc::Status st = parse(*req, kGenerate, o); !st.ok()) return st;
    o.request.prompt = std::move(r.prompt);
    o.request.id = log->id;
    return submit(std::move(o), ctx, writer, log);
  }

  grpc::Status chat(grpc::ServerContext* ctx, const pb::ChatRequest* req, Streamer* writer,
                    CallLog* log) {
    if (auto st = check_model(req->model()); !st.ok()) return st;
    std::vector<std::string> roles, contents;
    size_t text_bytes = 0;
    for (const auto& m : req->messages()) {
      roles.push_back(m.role());
      contents.push_back(m.content());
      text_bytes += m.content().size();
    }
    if (auto e = scheduler_.check_prompt_text(text_bytes)) {
      return grpc::Status(grpc_code(e->code), e->message);
    }
    // The options first: add_generation_prompt and chat_template_kwargs shape the prompt.
    ParsedOptions o;
    if (grpc::Status st = parse(*req, kGrpcChat, o); !st.ok()) return st;
    auto ids = apply_chat_template(tokenizer_, roles, contents, o.add_generation_prompt,
                                   chat_template_variables(o));
    if (!ids.ok()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, ids.message());
    o.request.id = log->id;
    o.request.prompt = ids.take();
    return submit(std::move(o), ctx, writer, log);
  }

  // The request options' table (the options HTTP takes, with its checks and defaults).
  grpc::Status parse(const google::protobuf::Message& req, Endpoint endpoint,
                     ParsedOptions& o) const {
    if (auto e = parse_options(raw_options(req, endpoint), endpoint, scheduler_.vocab_size(), o)) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, e->message);
    }
    return grpc::Status::OK;
  }

  // What Generate and Chat share after the options and the prompt: Chat's default
  // max_tokens, min_tokens against it, and the run.
  grpc::Status submit(ParsedOptions o, grpc::ServerContext* ctx, Streamer* writer,
                      CallLog* log) {
    if (!o.max_tokens_given) {
      // Chat (Generate requires max_tokens), as HTTP chat: until EOS, bounded by what is left
      // of the KV capacity.
      o.request.max_tokens = scheduler_.default_max_tokens(
          static_cast<int64_t>(o.request.prompt.size()), scheduler_.max_tokens_limit());
    }
    if (auto e = check_min_tokens(o)) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, e->message);
    }
    return run(ctx, std::move(o.request), writer, log);
  }

  // The model a request names: this server's, or none; another is NOT_FOUND (HTTP's 404).
  grpc::Status check_model(const std::string& model) const {
    if (model.empty() || model == config_.model_name) return grpc::Status::OK;
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        "unknown model '" + model + "'; this server serves '" +
                            config_.model_name + "'");
  }

  // Submits and streams the events until the end.
  grpc::Status run(grpc::ServerContext* ctx, ScheduledRequest r, Streamer* writer, CallLog* log) {
    const std::string id = r.id;
    ApiError err;
    auto stream = scheduler_.submit(std::move(r), &err);
    if (!stream) return grpc::Status(grpc_code(err.code), err.message);
    for (;;) {
      // Polls the call's cancellation between events: a cancelled call (or a gone client)
      // stops generation at the next token.
      if (ctx->IsCancelled()) {
        stream->cancel();
        return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the client");
      }
      auto ev = stream->next(std::chrono::milliseconds(100));
      if (!ev) continue;
      pb::GenerateResponse out;
      switch (ev->kind) {
        case Event::Kind::kStarted: {
          auto* s = out.mutable_started();
          s->set_request_id(id);
          s->set_prompt_tokens(static_cast<int32_t>(ev->prompt_tokens));
          s->set_queue_ms(ev->queue_ms);
          break;
        }
        case Event::Kind::kProgress:
          out.mutable_progress()->set_prefilled_fraction(ev->fraction);
          break;
        case Event::Kind::kToken: {
          auto* t = out.mutable_token();
          t->set_id(ev->token);
          t->set_text(ev->text);
          if (ev->ttft_ms >= 0) t->set_ttft_ms(ev->ttft_ms);
          if (ev->has_logprob) {
            t->set_logprob(ev->logprob);
            for (const auto& [id, lp] : ev->top_logprobs) {
              auto* a = t->add_top_logprobs();
              a->set_id(id);
              a->set_text(tokenizer_.piece_text(id));  // byte pieces stay <0xNN>: valid UTF-8
              a->set_logprob(lp);
            }
          }
          break;
        }
        case Event::Kind::kFinished: {
          auto* f = out.mutable_finished();
          const FinishInfo& fi = ev->finish;
          log->prompt_tokens = fi.prompt_tokens;
          log->completion_tokens = fi.completion_tokens;
          log->finish = runtime::finish_reason_name(fi.reason);
          f->set_finish_reason(runtime::finish_reason_name(fi.reason));
          f->set_prompt_tokens(static_cast<int32_t>(fi.prompt_tokens));
          f->set_completion_tokens(static_cast<int32_t>(fi.completion_tokens));
          f->set_prefill_ms(fi.prefill_ms);
          f->set_decode_tokens_per_s(fi.decode_tokens_per_s);
          f->set_ttft_ms(fi.ttft_ms);
          f->set_queue_ms(fi.queue_ms);
          f->set_cached_tokens(static_cast<int32_t>(fi.cached_tokens));
          writer->Write(out);
          return grpc::Status::OK;
        }
        case Event::Kind::kError:
          return grpc::Status(grpc_code(ev->error.code), ev->error.message);
        case Event::Kind::kPromptLogprobs:
          continue;  // not requested by this API
      }
      if (!writer->Write(out)) {
        stream->cancel();
        return grpc::Status(grpc::StatusCode::CANCELLED, "the client is gone");
      }
    }
  }

  // Counts a handler while it runs.
  struct InFlight {
    explicit InFlight(std::atomic<int>& n) : n_(n) { ++n_; }
    ~InFlight() { --n_; }
    InFlight(const InFlight&) = delete;
    InFlight& operator=(const InFlight&) = delete;
    std::atomic<int>& n_;
  };

  const ServerConfig& config_;
  Scheduler& scheduler_;
  const Tokenizer& tokenizer_;
  const GrpcLimits& limits_;
  std::atomic<int> in_flight_{0};
};

GrpcApi::GrpcApi(const ServerConfig& config, Scheduler& scheduler, const Tokenizer& tokenizer)
    : config_(config), scheduler_(scheduler), tokenizer_(tokenizer), limits_(config),
      service_(std::make_unique<Service>(config, scheduler, tokenizer, limits_)) {}

GrpcApi::~GrpcApi() { stop(); }

Result<int> GrpcApi::start() {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  limits_.apply(builder);
  int port = 0;
  const std::string host = config_.host.find(':') != std::string::npos
                               ? "[" + config_.host + "]"
                               : config_.host;
  // No SO_REUSEPORT: with it gRPC clones the listening socket once per polling thread, and a
  // clone of port 0 binds another free port, which nobody reports (two gRPC ports, one unknown);
  // it would also let another process of this user bind the same port beside us.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(host + ":" + std::to_string(config_.grpc_port),
                           grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(service_.get());
  // Reflection v1 lists what the server serves: the API, health, and both reflections.
  reflection_v1_ = make_reflection_v1_service(
      {"burst.v1.Burst", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
       "grpc.reflection.v1alpha.ServerReflection"});
  builder.RegisterService(reflection_v1_.get());
  builder.SetMaxReceiveMessageSize(static_cast<int>(config_.max_body_bytes));
  server_ = builder.BuildAndStart();
  if (!server_ || port == 0) {
    return Status::error("cannot bind gRPC on " + config_.host + ":" +
                         std::to_string(config_.grpc_port));
  }
  health_thread_ = std::thread([this] {
    int last = -1;
    while (!stop_) {
      const int now = scheduler_.healthy() && !scheduler_.draining() ? 1 : 0;
      if (now != last) {
        server_->GetHealthCheckService()->SetServingStatus(now == 1);
        server_->GetHealthCheckService()->SetServingStatus("burst.v1.Burst", now == 1);
        last = now;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });
  return port;
}

void GrpcApi::stop() {
  if (!server_) return;
  stop_ = true;
  if (health_thread_.joinable()) health_thread_.join();
  server_->GetHealthCheckService()->Shutdown();
  // The drain came first (server_main): the calls still running are sending their last
  // messages, or wait for a request message (GrpcLimits cancels those). They get up to 5 s;
  // then the server shuts down at once. Shutdown's deadline is not that wait: gRPC holds
  // Shutdown until every connection is gone or the deadline passes, so an idle client's channel
  // made every stop 5 s late.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (service_->in_flight() > 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
  server_->Wait();
  server_.reset();
}

}  // namespace burst::server
