// WorkerGroup's steps: one Session stream per rank carries the continuous batch; a broken
// stream names its cause and takes the session (and the group) with it.
#include <spdlog/spdlog.h>
#include <sys/wait.h>

#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include "group/step_codec.h"
#include "group/worker_registry.h"
#include "worker_group_internal.h"

namespace burst::server {

namespace pb = burst::v1::internal;

std::string describe_exit(int status) {
  if (WIFSIGNALED(status)) {
    return "killed by signal " + std::to_string(WTERMSIG(status)) + " (" +
           strsignal(WTERMSIG(status)) + ")";
  }
  return "exited with code " + std::to_string(WEXITSTATUS(status));
}


std::string rank_name(const WorkerGroup::Rank& r) {
  return "worker rank " + std::to_string(r.rank) +
         (r.pid ? " (pid " + std::to_string(r.pid) + ")" : " (" + r.address + ")");
}

void WorkerGroup::end_session() {
  std::lock_guard<std::mutex> lock(run_mu_);
  end_session_locked();
}

void WorkerGroup::end_session_locked() {
  if (!session_) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_.clear();
  }
  // A healthy rank answers WritesDone by ending its session (and freeing its pages); a dead or
  // hung one must not hold us: the calls are cancelled after a short grace. (A deadline cannot
  // be set on a call already started.)
  std::mutex done_mu;
  std::condition_variable done_cv;
  bool done = false;
  std::thread guard([&] {
    std::unique_lock<std::mutex> lock(done_mu);
    if (!done_cv.wait_for(lock, std::chrono::seconds(2), [&] { return done; })) {
      for (auto& c : session_->ctx) c->TryCancel();
    }
  });
  for (auto& st : session_->streams) st->WritesDone();
  for (auto& st : session_->streams) {
    pb::StepReply drain;
    while (st->Read(&drain)) {
    }
    st->Finish();
  }
  {
    std::lock_guard<std::mutex> lock(done_mu);
    done = true;
  }
  done_cv.notify_all();
  guard.join();
  session_.reset();
  steps_sent_ = 0;
}

Result<StepOutcome> WorkerGroup::step(const runtime::StepPlan& plan,
                                      const LayerProgress& on_layer) {
  std::lock_guard<std::mutex> lock(run_mu_);
  return step_locked(plan, on_layer);
}

Status WorkerGroup::open_session_locked() {
  const size_t n = ranks_.size();
  if (!session_) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!healthy_) {
      return Status::error(StatusCode::kUnavailable, "worker group unavailable: " + death_);
    }
    session_ = std::make_unique<Session>();
    for (size_t r = 0; r < n; ++r) {
      session_->ctx.push_back(std::make_unique<grpc::ClientContext>());
      authorize(*session_->ctx.back());
      in_flight_.push_back(session_->ctx.back().get());
    }
  }
  if (session_->streams.empty()) {
    for (size_t r = 0; r < n; ++r) {
      session_->streams.push_back(ranks_[r]->stub->Session(session_->ctx[r].get()));
    }
  }
  return {};
}

Status WorkerGroup::session_broken_locked(size_t r, const std::string& what, bool read_failed) {
  // A rank that fails a step ends its session with a status that says why, then exits. After a
  // failed Read that status has arrived: take it before the cancels, which would otherwise
  // replace it with "Cancelled". After a failed Write it may not have: cancel first, since
  // Finish waits for it.
  grpc::Status st;
  if (read_failed) st = session_->streams[r]->Finish();
  for (auto& c : session_->ctx) c->TryCancel();
  if (!read_failed) st = session_->streams[r]->Finish();
  const bool said = !st.ok() && st.error_code() != grpc::StatusCode::CANCELLED &&
                    !st.error_message().empty();
  std::string why;
  // The supervisor (waitpid every 20 ms) or the registry names a dead rank better than a
  // cancelled stream does: give it a moment.
  for (int i = 0; i < 25 && healthy_; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    why = death_;
    in_flight_.clear();
  }
  if (why.empty()) {
    why = rank_name(*ranks_[r]) + " " + what + ": " + st.error_message();
    if (remote()) options_.registry->dissolve(why);
    mark_dead(why);
  } else if (said) {
    // E.g. "worker rank 0 (pid 7) exited with code 3 (burst-worker rank 0: ... out of memory)".
    why += " (" + st.error_message() + ")";
  }
  for (size_t o = 0; o < session_->streams.size(); ++o) {
    if (o != r) session_->streams[o]->Finish();
  }
  session_.reset();
  steps_sent_ = 0;
  return Status::error(StatusCode::kUnavailable, "request failed: " + why);
}

void WorkerGroup::arm_step_deadline(const runtime::StepPlan& plan) {
  if (options_.step_timeout.count() <= 0) return;
  int64_t tokens = 0;
  for (const runtime::SeqWork& s : plan.seqs) tokens += static_cast<int64_t>(s.tokens.size());
  const auto budget = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      options_.step_timeout + std::chrono::duration<double, std::milli>(
                                  options_.step_ms_per_token * static_cast<double>(tokens)));
  std::lock_guard<std::mutex> lock(mu_);
  step_running_ = true;
  step_tokens_ = tokens;
  step_deadline_ = std::chrono::steady_clock::now() + budget;
}

Status WorkerGroup::send_locked(const runtime::StepPlan& plan, bool report_progress) {
  const size_t n = ranks_.size();
  BURST_RETURN_IF_ERROR(open_session_locked());
  const pb::StepRequest req = encode_plan(plan, report_progress);
  // The step deadline, watched by the monitor thread: it cancels the streams (mark_dead) of a
  // step that runs past it. A broken stream (the rank died or cannot be reached) takes the
  // session with it, and the group too (the ranks are mid-step, out of lockstep). A second
  // step sent while one runs re-arms it: the deadline then covers both, generously.
  arm_step_deadline(plan);
  ++steps_sent_;
  for (size_t r = 0; r < n; ++r) {
    if (!session_->streams[r]->Write(req)) {
      return session_broken_locked(r, "did not take the step", false);
    }
  }
  return {};
}

Result<StepOutcome> WorkerGroup::receive_locked(const LayerProgress& on_layer) {
  const size_t n = ranks_.size();
  if (!session_ || steps_sent_ == 0) {
    return Status::error(StatusCode::kInternal, "receive_step without a step in flight");
  }
  struct StepDone {
    WorkerGroup* g;
    ~StepDone() {
      if (g->steps_sent_ > 0) --g->steps_sent_;
      if (g->steps_sent_ > 0) return;
      std::lock_guard<std::mutex> lock(g->mu_);
      g->step_running_ = false;
    }
  } step_done{this};
  StepOutcome out;
  // One count per ring rank: a tensor-parallel group's ranks hold the same rows.
  const size_t tp = static_cast<size_t>(std::max(options_.tp, 1));
  out.kv_used_pages.assign(n / tp, 0);
  pb::StepReply error_reply;
  for (size_t r = 0; r < n; ++r) {
    pb::StepReply reply;
    while (true) {
      if (!session_->streams[r]->Read(&reply)) {
        return session_broken_locked(r, "ended its session", true);
      }
      if (reply.final()) break;
      if (r == 0 && on_layer) on_layer(reply.layers_done(), reply.layers());
    }
    if (reply.error_code() != 0) {
      error_reply = reply;
      continue;
    }
    if (r % tp == 0) out.kv_used_pages[r / tp] = reply.kv_used_pages();
    if (r == 0) static_cast<runtime::StepResult&>(out) = decode_result(reply);
  }
  if (error_reply.error_code() != 0) {
    // Every rank refused the same plan before any collective: the session goes on.
    return Status::error(static_cast<StatusCode>(error_reply.error_code()), error_reply.error());
  }
  return out;
}

Result<StepOutcome> WorkerGroup::step_locked(const runtime::StepPlan& plan,
                                             const LayerProgress& on_layer) {
  BURST_RETURN_IF_ERROR(send_locked(plan, static_cast<bool>(on_layer)));
  return receive_locked(on_layer);
}

Status WorkerGroup::send_step(const runtime::StepPlan& plan, bool report_progress) {
  std::lock_guard<std::mutex> lock(run_mu_);
  return send_locked(plan, report_progress);
}

Result<StepOutcome> WorkerGroup::receive_step(const LayerProgress& on_layer) {
  std::lock_guard<std::mutex> lock(run_mu_);
  return receive_locked(on_layer);
}

Result<runtime::StepResult> WorkerGroup::run_step(const runtime::StepPlan& plan,
                                                  const runtime::StepProgress& on_layer) {
  LayerProgress layer;
  if (on_layer) layer = [&](int done, int layers) { (void)on_layer(done, layers); };
  auto r = step(plan, layer);
  if (!r.ok()) return r.status();
  return runtime::StepResult(std::move(r.value()));
}

}  // namespace burst::server
