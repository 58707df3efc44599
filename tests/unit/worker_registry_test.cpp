// The multi-node rendezvous (group/worker_registry.h): the coordinator's store (set, get that
// waits for a later set, wait, timeouts naming the key, a dissolved generation failing its
// waiters at once), the WorkerRegistry gRPC service as a `burst-worker --join` sees it (model
// mismatch and one-worker-too-many refusals, ranks once the group is complete, leave on
// dissolve) and two Gloo ranks meeting through the network store.
#include <gtest/gtest.h>
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include "burst/v1/worker.grpc.pb.h"
#include "engine/communicator.h"
#include "frontend/server_config.h"
#include "group/worker_registry.h"

namespace burst::server {
namespace {

namespace pb = burst::v1::internal;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

std::vector<char> bytes(const std::string& s) { return {s.begin(), s.end()}; }

TEST(MemoryStore, SetGetWaitAndTimeouts) {
  MemoryStore store;
  store.reset(7);
  ASSERT_TRUE(store.set(7, "a", bytes("one")).ok());
  auto a = store.get(7, "a", milliseconds(0));
  ASSERT_TRUE(a.ok()) << a.message();
  EXPECT_EQ(a.value(), bytes("one"));
  // A get blocks until another thread sets the key.
  std::thread later([&] {
    std::this_thread::sleep_for(milliseconds(100));
    EXPECT_TRUE(store.set(7, "b", bytes("two")).ok());
  });
  const auto t0 = Clock::now();
  auto b = store.get(7, "b", milliseconds(5000));
  later.join();
  ASSERT_TRUE(b.ok()) << b.message();
  EXPECT_EQ(b.value(), bytes("two"));
  EXPECT_LT(Clock::now() - t0, milliseconds(3000));
  EXPECT_TRUE(store.wait(7, {"a", "b"}, milliseconds(0)).ok());
  // A missing key is a timeout error that names it.
  auto c = store.get(7, "missing", milliseconds(50));
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.message().find("'missing'"), std::string::npos) << c.message();
  const Status w = store.wait(7, {"a", "absent"}, milliseconds(50));
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.message().find("'absent'"), std::string::npos) << w.message();
  // Another generation's calls are refused.
  EXPECT_FALSE(store.set(6, "a", bytes("stale")).ok());
  EXPECT_FALSE(store.get(8, "a", milliseconds(0)).ok());
}

TEST(MemoryStore, ResetFailsWaitersAtOnceAndDropsKeys) {
  MemoryStore store;
  store.reset(1);
  ASSERT_TRUE(store.set(1, "k", bytes("v")).ok());
  std::thread resetter([&] {
    std::this_thread::sleep_for(milliseconds(100));
    store.reset(2);
  });
  const auto t0 = Clock::now();
  auto r = store.get(1, "never", milliseconds(20000));
  resetter.join();
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.message().find("generation 1 is over"), std::string::npos) << r.message();
  EXPECT_LT(Clock::now() - t0, milliseconds(5000)) << "woken by reset, not by its timeout";
  EXPECT_FALSE(store.get(2, "k", milliseconds(0)).ok()) << "keys belong to one generation";
}

TEST(SplitHostPort, AcceptsHostsAndBracketedV6AndRefusesTheRest) {
  auto a = split_host_port("node-1:50052");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a.value().first, "node-1");
  EXPECT_EQ(a.value().second, 50052);
  auto b = split_host_port("[::1]:0");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b.value().first, "::1");
  EXPECT_EQ(b.value().second, 0);
  for (const char* bad : {"node", ":80", "host:", "host:99999", "host:8x", "[::1]80"}) {
    EXPECT_FALSE(split_host_port(bad).ok()) << bad;
  }
}

TEST(WorkerToken, RandomTokensAndConstantTimeComparison) {
  auto a = random_token();
  auto b = random_token();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a.value().size(), 64u);
  EXPECT_EQ(a.value().find_first_not_of("0123456789abcdef"), std::string::npos);
  EXPECT_NE(a.value(), b.value());
  EXPECT_TRUE(token_equal(a.value(), a.value()));
  EXPECT_FALSE(token_equal(a.value(), b.value()));
  EXPECT_FALSE(token_equal(a.value(), ""));
  EXPECT_FALSE(token_equal(a.value(), a.value().substr(0, 63)));
  EXPECT_FALSE(token_equal(a.value(), a.value() + "0"));
  EXPECT_FALSE(token_equal("abc", std::string("abc\0", 4)));
}

TEST(WorkerToken, TokenFileIsTrimmedAndMustBeARegularNonEmptyFile) {
  char tmpl[] = "/tmp/burst_token_XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  {
    std::FILE* f = std::fopen((dir + "/t").c_str(), "w");
    std::fputs("  tok-123\n", f);
    std::fclose(f);
  }
  auto t = read_token_file(dir + "/t");
  ASSERT_TRUE(t.ok()) << t.message();
  EXPECT_EQ(t.value(), "tok-123");
  {
    std::FILE* f = std::fopen((dir + "/e").c_str(), "w");
    std::fputs(" \n", f);
    std::fclose(f);
  }
  EXPECT_FALSE(read_token_file(dir + "/e").ok());
  auto d = read_token_file(dir);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.message().find("directory"), std::string::npos) << d.message();
  std::remove((dir + "/t").c_str());
  std::remove((dir + "/e").c_str());
  ::rmdir(dir.c_str());
}

TEST(ModelFingerprint, DependsOnConfigAndWeights) {
  auto cfg = models::preset_config("7b");
  ASSERT_TRUE(cfg.ok());
  const std::string a = model_fingerprint(cfg.value(), {"", "7b", 0, {}});
  EXPECT_EQ(a, model_fingerprint(cfg.value(), {"", "7b", 0, {}}));
  EXPECT_NE(a, model_fingerprint(cfg.value(), {"", "7b", 1, {}})) << "another random seed";
  auto other = cfg.value();
  other.vocab_size = 32001;
  EXPECT_NE(a, model_fingerprint(other, {"", "7b", 0, {}}));
}

// A registry on a free loopback port and a client channel to it.
struct Fixture {
  std::unique_ptr<WorkerRegistry> registry;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<pb::WorkerRegistry::Stub> stub;

  explicit Fixture(int world) {
    RegistryOptions o;
    o.listen = "127.0.0.1:0";
    o.world_size = world;
    o.fingerprint = "hidden=1 vocab=10";
    o.kv_capacity_per_rank = 64;
    o.kv_memory_fraction = 0.75;          // what a rank sizing from memory would use
    o.kv_reserve_bytes = int64_t{3} << 30;
    o.comm_timeout = milliseconds(10000);
    auto r = WorkerRegistry::start(o);
    EXPECT_TRUE(r.ok()) << r.message();
    registry = r.take();
    channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(registry->port()),
                                  grpc::InsecureChannelCredentials());
    stub = pb::WorkerRegistry::NewStub(channel);
  }

  static pb::JoinRequest request(const std::string& fingerprint = "hidden=1 vocab=10") {
    pb::JoinRequest req;
    req.set_fingerprint(fingerprint);
    req.set_device_kind("cpu");
    req.set_host("127.0.0.1");
    return req;
  }
};

// The first event of a Join stream, or the status that ended it.
struct JoinResult {
  std::unique_ptr<grpc::ClientContext> ctx = std::make_unique<grpc::ClientContext>();
  std::unique_ptr<grpc::ClientReader<pb::JoinEvent>> reader;
  pb::JoinEvent first;
  grpc::Status status;
  bool got = false;
};

std::unique_ptr<JoinResult> join(Fixture& f, const pb::JoinRequest& req) {
  auto j = std::make_unique<JoinResult>();
  j->ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  j->reader = f.stub->Join(j->ctx.get(), req);
  j->got = j->reader->Read(&j->first);
  if (!j->got) j->status = j->reader->Finish();
  return j;
}

TEST(WorkerRegistry, RefusesAnotherModelAndOneWorkerTooMany) {
  Fixture f(1);
  auto bad = join(f, Fixture::request("hidden=1 vocab=11"));
  ASSERT_FALSE(bad->got);
  EXPECT_EQ(bad->status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(bad->status.error_message().find("model mismatch (vocab: server 10, worker 11)"),
            std::string::npos)
      << bad->status.error_message();
  auto cuda = Fixture::request();
  cuda.set_device_kind("cuda");
  auto dev = join(f, cuda);
  ASSERT_FALSE(dev->got);
  EXPECT_NE(dev->status.error_message().find("device mismatch"), std::string::npos);
  EXPECT_EQ(f.registry->registered(), 0) << "refused workers hold no slot";

  auto ok = join(f, Fixture::request());
  ASSERT_TRUE(ok->got) << ok->status.error_message();
  ASSERT_TRUE(ok->first.has_assigned());
  EXPECT_EQ(ok->first.assigned().rank(), 0);
  EXPECT_EQ(ok->first.assigned().world_size(), 1);
  EXPECT_EQ(ok->first.assigned().kv_capacity(), 64);
  EXPECT_EQ(ok->first.assigned().kv_memory_fraction(), 0.75);
  EXPECT_EQ(ok->first.assigned().kv_reserve_bytes(), int64_t{3} << 30);
  auto extra = join(f, Fixture::request());
  ASSERT_FALSE(extra->got);
  EXPECT_EQ(extra->status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(extra->status.error_message().find("one too many"), std::string::npos);
  auto again = Fixture::request();
  again.set_rejoin(true);
  auto rejoin = join(f, again);
  EXPECT_EQ(rejoin->status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << "a worker coming back from a broken group waits instead of exiting";

  // Dissolving tells the member to leave, and its generation's store refuses it from then on.
  const uint64_t gen = ok->first.assigned().generation();
  RegistryStore store(f.channel, gen);
  ASSERT_TRUE(store.set("k", bytes("v")).ok());
  f.registry->dissolve("test");
  pb::JoinEvent ev;
  ASSERT_TRUE(ok->reader->Read(&ev));
  ASSERT_TRUE(ev.has_leave());
  EXPECT_EQ(ev.leave().reason(), "test");
  EXPECT_EQ(f.registry->registered(), 0);
  auto stale = store.get("k", milliseconds(0));
  ASSERT_FALSE(stale.ok());
  EXPECT_NE(stale.message().find("is over"), std::string::npos) << stale.message();
}

TEST(WorkerRegistry, NetworkStoreSetGetWaitTimeout) {
  Fixture f(1);
  auto j = join(f, Fixture::request());
  ASSERT_TRUE(j->got && j->first.has_assigned());
  const uint64_t gen = j->first.assigned().generation();
  ASSERT_EQ(f.registry->wait_formed(milliseconds(0)), gen);
  RegistryStore store(f.channel, gen);
  ASSERT_TRUE(store.set("x", bytes("42")).ok());
  auto x = store.get("x", milliseconds(1000));
  ASSERT_TRUE(x.ok()) << x.message();
  EXPECT_EQ(x.value(), bytes("42"));
  // The coordinator's view of the same generation sees the worker's keys and vice versa.
  auto view = f.registry->store_view(gen);
  auto seen = view->get("x", milliseconds(0));
  ASSERT_TRUE(seen.ok());
  EXPECT_EQ(seen.value(), bytes("42"));
  std::thread later([&] {
    std::this_thread::sleep_for(milliseconds(150));
    EXPECT_TRUE(view->set("y", bytes("late")).ok());
  });
  auto y = store.get("y", milliseconds(5000));
  later.join();
  ASSERT_TRUE(y.ok()) << y.message();
  EXPECT_EQ(y.value(), bytes("late"));
  EXPECT_TRUE(store.wait({"x", "y"}, milliseconds(1000)).ok());
  const auto t0 = Clock::now();
  auto none = store.get("nothing", milliseconds(200));
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.message().find("'nothing'"), std::string::npos) << none.message();
  EXPECT_LT(Clock::now() - t0, milliseconds(5000));
  const Status w = store.wait({"x", "nope"}, milliseconds(100));
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.message().find("'nope'"), std::string::npos) << w.message();
}

TEST(WorkerRegistry, GlooRanksMeetThroughTheNetworkStore) {
  Fixture f(2);
  std::vector<std::unique_ptr<JoinResult>> joins(2);
  std::vector<std::string> errors(2);
  std::vector<std::vector<int32_t>> gathered(2);
  std::vector<std::thread> ranks;
  for (int i = 0; i < 2; ++i) {
    ranks.emplace_back([&, i] {
      joins[i] = join(f, Fixture::request());
      if (!joins[i]->got || !joins[i]->first.has_assigned()) {
        errors[i] = "no rank: " + joins[i]->status.error_message();
        return;
      }
      const auto& a = joins[i]->first.assigned();
      engine::GlooOptions o;
      o.rank = a.rank();
      o.world_size = a.world_size();
      o.store = std::make_shared<RegistryStore>(f.channel, a.generation());
      o.timeout = milliseconds(a.comm_timeout_ms());
      auto comm = engine::make_gloo_communicator(o);
      if (!comm.ok()) {
        errors[i] = comm.message();
        return;
      }
      const int32_t mine = 100 + a.rank();
      std::vector<int32_t> all(2);
      const Status st = comm.value()->all_gather(&mine, all.data(), sizeof mine);
      if (!st.ok()) errors[i] = st.message();
      gathered[a.rank()] = all;
    });
  }
  for (auto& t : ranks) t.join();
  ASSERT_EQ(errors[0], "");
  ASSERT_EQ(errors[1], "");
  for (const auto& g : gathered) EXPECT_EQ(g, (std::vector<int32_t>{100, 101}));
}

TEST(WorkerRegistry, MemberLostBeforeTheGroupFormsFreesItsSlot) {
  Fixture f(2);
  {
    grpc::ClientContext ctx;
    auto reader = f.stub->Join(&ctx, Fixture::request());
    const auto until = Clock::now() + std::chrono::seconds(5);
    while (f.registry->registered() != 1 && Clock::now() < until) {
      std::this_thread::sleep_for(milliseconds(10));
    }
    ASSERT_EQ(f.registry->registered(), 1);
    EXPECT_NE(f.registry->waiting_status().find("1/2 registered"), std::string::npos)
        << f.registry->waiting_status();
    ctx.TryCancel();  // the worker goes away while it waits for its peer
  }
  const auto until = Clock::now() + std::chrono::seconds(5);
  while (f.registry->registered() != 0 && Clock::now() < until) {
    std::this_thread::sleep_for(milliseconds(10));
  }
  EXPECT_EQ(f.registry->registered(), 0);
  EXPECT_FALSE(f.registry->wait_formed(milliseconds(0)).has_value());
}

Result<ServerConfig> parse_flags(std::vector<std::string> args) {
  args.insert(args.begin(), "burst-server");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  bool help = false;
  return parse_server_args(static_cast<int>(argv.size()), argv.data(), &help);
}

TEST(ServerConfigRemote, FlagsConfigFileAndMistakes) {
  auto flags = parse_flags({"--remote-workers", "3", "--worker-listen", "127.0.0.1:0"});
  ASSERT_TRUE(flags.ok()) << flags.message();
  EXPECT_EQ(flags.value().remote_workers, 3);
  EXPECT_EQ(flags.value().worker_listen, "127.0.0.1:0");
  auto file = parse_flags({"--config", std::string(BURST_SOURCE_DIR) + "/configs/multi-node.json"});
  ASSERT_TRUE(file.ok()) << file.message();
  EXPECT_EQ(file.value().remote_workers, 2);
  EXPECT_EQ(file.value().worker_listen, "0.0.0.0:50052");
  auto bad = parse_flags({"--remote-workers", "2", "--worker-listen", "nowhere"});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("worker_listen: 'nowhere' is not HOST:PORT"), std::string::npos)
      << bad.message();
  auto neg = parse_flags({"--remote-workers", "-1"});
  ASSERT_FALSE(neg.ok());
  EXPECT_NE(neg.message().find("remote_workers"), std::string::npos) << neg.message();
  auto join = parse_flags({"--join", "10.0.0.1:50052"});
  ASSERT_FALSE(join.ok());
  EXPECT_NE(join.message().find("burst-worker --join"), std::string::npos) << join.message();
}

}  // namespace
}  // namespace burst::server
