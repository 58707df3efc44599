#include "frontend/planner.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <unordered_map>
#include <unordered_set>

#include "frontend/scheduler.h"

namespace burst::server {

std::vector<int64_t> kv_pages_needed(int64_t prompt, int64_t max_tokens, int64_t chunk,
                                     int world, engine::ShardLayout layout, int page_size,
                                     bool mixed_chunks) {
  std::vector<int64_t> rows(static_cast<size_t>(world), 0);
  if (chunk <= 0) chunk = prompt;
  // Striped: rank r holds the positions congruent to r, however the prompt is chunked (the
  // loop below gives the same count for any chunk size).
  for (int64_t start = 0; start < prompt; start += chunk) {
    const auto plan =
        engine::ShardPlan::make(layout, std::min(chunk, prompt - start), world, start);
    for (int r = 0; r < world; ++r) rows[static_cast<size_t>(r)] += plan.real_rows(r);
  }
  if (mixed_chunks && layout != engine::ShardLayout::kStriped) {
    for (auto& n : rows) n = std::max(n, std::min(prompt, prompt / world + 2));
  }
  // Decode tokens at positions prompt .. prompt + max_tokens - 1 (the last one is never fed
  // back, counted anyway): rank p mod N caches position p.
  for (int r = 0; r < world; ++r) {
    const int64_t first = prompt + ((r - prompt % world) % world + world) % world;
    const int64_t end = prompt + max_tokens;
    rows[static_cast<size_t>(r)] += first < end ? (end - first + world - 1) / world : 0;
  }
  std::vector<int64_t> pages(rows.size());
  for (size_t r = 0; r < rows.size(); ++r) pages[r] = (rows[r] + page_size - 1) / page_size;
  return pages;
}

int64_t Planner::Seq::prompt_len() const { return static_cast<int64_t>(request->prompt.size()); }

void Planner::reset(int64_t pages, int page_size) {
  pages_ = pages;
  page_size_ = page_size;
  drop_all();
  deferred_full_ = false;
}

bool Planner::caching() const {
  return options_.prefix_caching && options_.layout == engine::ShardLayout::kStriped &&
         page_size_ > 0;
}

std::vector<int64_t> Planner::hits_for(const ScheduledRequest& r) const {
  if (!caching() || r.prompt_logprobs >= 0 || r.adjust.repetition_penalty != 1.f) return {};
  // The prompt's last token is always computed: its logits draw the first token.
  const auto prompt = static_cast<int64_t>(r.prompt.size());
  return cache_.match(r.prompt, prompt > 0 ? (prompt - 1) / cache_.block_tokens() : 0);
}

Planner::Fit Planner::fits(const ScheduledRequest& r, std::vector<int64_t>* need) const {
  *need = kv_pages_needed(static_cast<int64_t>(r.prompt.size()), r.max_tokens,
                          options_.prefill_chunk, options_.world, options_.layout, page_size_,
                          options_.prefill_chunk_decoding > 0);
  // Cached blocks it starts from are pages it does not take (one per rank each); blocks no
  // sequence holds can be evicted for it (but not the ones it is about to use).
  const std::vector<int64_t> hits = hits_for(r);
  int64_t evictable = cache_.evictable();
  for (int64_t id : hits) evictable -= cache_.refs(id) == 0 ? 1 : 0;
  bool later = false;
  for (size_t k = 0; k < need->size(); ++k) {
    if ((*need)[k] > pages_) return Fit::kNever;
    (*need)[k] -= static_cast<int64_t>(hits.size());
    later = later || (*need)[k] > free_pages_[k] + evictable;
  }
  return later ? Fit::kLater : Fit::kNow;
}

Planner::Pick Planner::pick(const std::vector<const ScheduledRequest*>& waiting) const {
  Pick out;
  if (full() || waiting.empty()) return out;
  // Sequences each owner runs. Owner 0 is a sequence alone.
  std::unordered_map<uint64_t, int> held;
  for (const auto& s : seqs_) {
    if (s->request->owner != 0) ++held[s->request->owner];
  }
  auto seqs_of = [&](uint64_t owner) {
    const auto it = owner == 0 ? held.end() : held.find(owner);
    return it == held.end() ? 0 : it->second;
  };
  // Rounded up: with 2 slots a request may run both of its choices (no reserve to speak of).
  // Pages have no share: a share of them would halve what a batch of long prompts runs at once,
  // and the order below gives a newcomer the next pages that free up anyway.
  const auto slot_cap = static_cast<int>(std::ceil(options_.max_share * options_.max_running));
  // Each owner's first waiting request, in arrival order, then by fewest running (stable).
  std::vector<int> firsts;
  std::unordered_set<uint64_t> seen;
  for (size_t i = 0; i < waiting.size(); ++i) {
    const uint64_t o = waiting[i]->owner;
    if (o == 0 || seen.insert(o).second) firsts.push_back(static_cast<int>(i));
  }
  std::stable_sort(firsts.begin(), firsts.end(), [&](int a, int b) {
    return seqs_of(waiting[static_cast<size_t>(a)]->owner) <
           seqs_of(waiting[static_cast<size_t>(b)]->owner);
  });
  for (int i : firsts) {
    const ScheduledRequest& r = *waiting[static_cast<size_t>(i)];
    std::vector<int64_t> need;
    const Fit fit = fits(r, &need);
    // At its share: its other choices wait for its own to end, others pass them.
    const int running = seqs_of(r.owner);
    if (running > 0 && running + 1 > slot_cap && fit != Fit::kNever) continue;
    out.index = i;
    out.fit = fit;
    out.need = std::move(need);
    return out;
  }
  return out;
}

uint64_t Planner::admit(const ScheduledRequest& r, std::vector<int64_t> need) {
  auto s = std::make_unique<Seq>();
  s->blocks = hits_for(r);
  cache_.acquire(s->blocks);
  int64_t short_by = 0;
  for (size_t k = 0; k < need.size() && k < free_pages_.size(); ++k) {
    short_by = std::max(short_by, need[k] - free_pages_[k]);
  }
  if (short_by > 0) {
    // Least recently used blocks that no sequence holds make room: their pages go back on
    // every rank in the next plan, before this request's first chunk.
    const std::vector<int64_t> gone = cache_.evict(short_by);
    to_evict_.insert(to_evict_.end(), gone.begin(), gone.end());
    cached_pages_ -= static_cast<int64_t>(gone.size());
    evicted_ += gone.size();
    for (auto& f : free_pages_) f += static_cast<int64_t>(gone.size());
  }
  for (size_t k = 0; k < need.size() && k < free_pages_.size(); ++k) free_pages_[k] -= need[k];
  s->id = next_id_++;
  s->request = &r;
  s->pages = std::move(need);
  s->hits = static_cast<int64_t>(s->blocks.size());
  s->prefilled = s->cached = s->hits * cache_.block_tokens();
  const uint64_t id = s->id;
  seqs_.push_back(std::move(s));
  return id;
}

void Planner::finish(uint64_t id) {
  const auto it = std::find_if(seqs_.begin(), seqs_.end(),
                               [&](const std::unique_ptr<Seq>& s) { return s->id == id; });
  if (it == seqs_.end()) return;
  const Seq& s = **it;
  // Its own pages that became blocks stay, as cache pages; the rest go back.
  for (size_t r = 0; r < s.pages.size() && r < free_pages_.size(); ++r) {
    free_pages_[r] += s.pages[r] - s.published;
  }
  cached_pages_ += s.published;
  cache_.release(s.blocks);
  to_release_.push_back(id);
  seqs_.erase(it);
}

void Planner::drop_all() {
  seqs_.clear();
  to_release_.clear();
  to_publish_.clear();
  to_evict_.clear();
  cache_ = PrefixCache(runtime::block_tokens(options_.world, std::max(page_size_, 1)));
  cached_pages_ = 0;
  free_pages_.assign(static_cast<size_t>(options_.world), pages_);
}

void Planner::publish_blocks(Seq& s) {
  if (!caching()) return;
  const ScheduledRequest& r = *s.request;
  const int64_t g = cache_.block_tokens(), prompt = s.prompt_len();
  // Tokens whose K/V the ranks hold: the prompt's prefilled rows, then each generated token
  // fed back (the last one drawn is not fed yet).
  const int64_t computed =
      s.decoding() ? prompt + std::max<int64_t>(0, static_cast<int64_t>(s.output.size()) - 1)
                   : s.prefilled;
  std::vector<int32_t> ids(static_cast<size_t>(g));
  for (auto k = static_cast<int64_t>(s.blocks.size()); (k + 1) * g <= computed; ++k) {
    for (int64_t i = 0; i < g; ++i) {
      const int64_t p = k * g + i;
      ids[static_cast<size_t>(i)] = p < prompt ? r.prompt[static_cast<size_t>(p)]
                                               : s.output[static_cast<size_t>(p - prompt)];
    }
    const auto [id, inserted] = cache_.insert(s.blocks.empty() ? -1 : s.blocks.back(), ids.data());
    s.blocks.push_back(id);
    if (inserted) {
      to_publish_.push_back({s.id, k, id});
      ++s.published;
    }
  }
}

void Planner::take_pending(runtime::StepPlan& step) {
  step.layout = options_.layout;
  step.publish.swap(to_publish_);
  step.release.swap(to_release_);
  step.evict.swap(to_evict_);
}

const Planner::Seq* Planner::find(uint64_t id) const {
  for (const auto& s : seqs_) {
    if (s->id == id) return s.get();
  }
  return nullptr;
}

Planner::Seq* Planner::find_mut(uint64_t id) { return const_cast<Seq*>(find(id)); }

runtime::SeqWork Planner::decode_row(const Seq& s, int32_t token, int64_t pos) const {
  const ScheduledRequest& r = *s.request;
  runtime::SeqWork w = runtime::decode_work(s.id, token, pos, s.prompt_len(), r.sampling);
  w.adjust = r.adjust;
  w.logprobs = r.logprobs;
  return w;
}

runtime::SeqWork Planner::prefill_row(const Seq& s, int64_t len) const {
  const ScheduledRequest& r = *s.request;
  runtime::SeqWork w = runtime::prefill_work(s.id, r.prompt, s.prefilled, len, r.sampling);
  // Its first chunk starts from the prefix blocks it found.
  if (s.hits > 0 && s.prefilled == s.hits * cache_.block_tokens()) {
    w.reuse.assign(s.blocks.begin(), s.blocks.begin() + s.hits);
  }
  w.adjust = r.adjust;
  w.logprobs = r.logprobs;
  w.prompt_logprobs = r.prompt_logprobs;
  if (w.prompt_logprobs >= 0 && s.prefilled + len < s.prompt_len()) {
    w.next_token = r.prompt[static_cast<size_t>(s.prefilled + len)];
  }
  return w;
}

Planner::Plan Planner::plan() {
  Plan p;
  take_pending(p.step);
  int64_t budget = options_.max_batched_tokens;
  // Decode first: every sequence past its prompt advances one token per step.
  for (const auto& sp : seqs_) {
    const Seq& s = *sp;
    if (!s.decoding()) continue;
    p.step.seqs.push_back(decode_row(s, s.last_token, s.prompt_len() + s.generated - 1));
    --budget;
  }
  // Decoding sequences wait one step per token: while any decode, prefill in smaller chunks.
  int64_t chunk = options_.prefill_chunk;
  if (!p.step.seqs.empty() && options_.prefill_chunk_decoding > 0) {
    chunk = options_.prefill_chunk_decoding;
  }
  add_prefills(p, budget, chunk);
  return p;
}

void Planner::add_prefills(Plan& p, int64_t budget, int64_t chunk) {
  // The prompt with the fewest tokens left first (shortest remaining work first: a 100-token
  // prompt that arrives during a 128K prefill goes into the next step), in arrival order among
  // equals, while the budget lasts; a chunk that does not fit waits for the next step, but a
  // step always makes progress.
  std::vector<Seq*> waiting;
  for (auto& sp : seqs_) {
    if (!sp->decoding()) waiting.push_back(sp.get());
  }
  auto left = [](const Seq* s) { return s->prompt_len() - s->prefilled; };
  std::stable_sort(waiting.begin(), waiting.end(),
                   [&](Seq* a, Seq* b) { return left(a) < left(b); });
  // Round-robin over owners: each owner's shortest chunk, then each one's second, ... (shortest
  // first within a round), so one request's n choices share one share of the budget.
  std::unordered_map<uint64_t, int> taken;
  std::unordered_map<const Seq*, int> round;
  for (const Seq* s : waiting) {
    const uint64_t o = s->request->owner;
    round[s] = o == 0 ? 0 : taken[o]++;
  }
  std::stable_sort(waiting.begin(), waiting.end(),
                   [&](Seq* a, Seq* b) { return round[a] < round[b]; });
  // A prompt that fits in one chunk and waits while a long prompt's full chunk would share its
  // step runs in a step of its own first (a few ms instead of a chunk's time: its TTFT), but
  // never twice in a row, so a stream of short prompts cannot stall a long prefill.
  const int64_t full = chunk > 0 ? chunk : std::numeric_limits<int64_t>::max();
  bool short_waiting = false;
  for (Seq* s : waiting) short_waiting |= left(s) < full;
  const bool defer_full = short_waiting && !deferred_full_;
  deferred_full_ = false;
  for (Seq* sp : waiting) {
    Seq& s = *sp;
    if (defer_full && left(&s) >= full) {
      deferred_full_ = true;
      continue;
    }
    const int64_t len = std::min(chunk > 0 ? chunk : s.prompt_len(), left(&s));
    if (len > budget && !p.step.seqs.empty()) continue;
    p.step.seqs.push_back(prefill_row(s, len));
    p.chunks.push_back({s.id, s.prefilled, len});
    budget -= len;
  }
}

bool Planner::can_look_ahead(const Plan& p, bool queue_empty) const {
  if (!options_.decode_lookahead || p.step.seqs.empty() || !p.chunks.empty()) return false;
  for (const auto& s : seqs_) {
    if (!s->decoding()) return false;
  }
  return queue_empty;
}

Planner::Plan Planner::continue_decode(const Plan& p) {
  Plan next;
  take_pending(next.step);
  for (const runtime::SeqWork& w : p.step.seqs) {
    const Seq* s = find(w.id);
    // `p` draws token number generated + 1; the next row feeds it. A sequence `p` ends by EOS
    // runs one wasted row: its token is dropped and it is released a step later.
    if (s == nullptr || s->generated + 1 >= s->request->max_tokens) continue;
    next.step.seqs.push_back(
        decode_row(*s, runtime::kPreviousToken, s->prompt_len() + s->generated));
  }
  return next;
}

void Planner::keep(runtime::StepPlan leftover) {
  // Ahead of whatever was queued since: the order the ranks must apply them in.
  leftover.publish.insert(leftover.publish.end(), to_publish_.begin(), to_publish_.end());
  leftover.release.insert(leftover.release.end(), to_release_.begin(), to_release_.end());
  leftover.evict.insert(leftover.evict.end(), to_evict_.begin(), to_evict_.end());
  to_publish_.swap(leftover.publish);
  to_release_.swap(leftover.release);
  to_evict_.swap(leftover.evict);
}

Planner::Update Planner::update(const Plan& p, const std::vector<runtime::SampledToken>& tokens,
                                int32_t eos) {
  Update u;
  for (const Chunk& c : p.chunks) {
    Seq* s = find_mut(c.id);
    if (s == nullptr) continue;
    s->prefilled += c.len;
    u.chunks.push_back({s->id, s->prefilled, s->prefilled == s->prompt_len()});
  }
  std::unordered_map<uint64_t, int32_t> sampled;
  for (const auto& t : tokens) sampled[t.id] = t.token;
  std::vector<uint64_t> ended;
  for (const auto& sp : seqs_) {
    Seq& s = *sp;
    const auto it = sampled.find(s.id);
    if (it == sampled.end()) continue;
    const ScheduledRequest& r = *s.request;
    Token t;
    t.id = s.id;
    t.token = it->second;
    if (r.max_tokens == 0) {
      t.ends = t.discard = true;
      ended.push_back(s.id);
      u.tokens.push_back(t);
      continue;
    }
    ++s.generated;
    s.last_token = t.token;
    s.output.push_back(t.token);
    const bool stop_id =
        std::find(r.stop_token_ids.begin(), r.stop_token_ids.end(), t.token) !=
            r.stop_token_ids.end() &&
        s.generated > r.adjust.min_tokens;
    t.is_stop = (t.token == eos && !r.ignore_eos) || stop_id;
    if (t.is_stop || s.generated >= r.max_tokens) {
      t.ends = true;
      t.reason = t.is_stop ? runtime::FinishReason::kStop : runtime::FinishReason::kLength;
      ended.push_back(s.id);
    }
    u.tokens.push_back(t);
  }
  u.dropped = tokens.size() - u.tokens.size();
  // Full blocks of what the step computed become prefix blocks (before any release).
  for (const runtime::SeqWork& w : p.step.seqs) {
    if (Seq* s = find_mut(w.id)) publish_blocks(*s);
  }
  for (uint64_t id : ended) finish(id);
  return u;
}

}  // namespace burst::server
