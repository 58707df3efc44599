// The paged KV cache's page allocation: a growing sequence keeps consecutive pages (what lets
// RingAttention read a cached prefix in place), a new sequence starts in the largest free run
// and halfway along it when another sequence ends right before it, a reservation that does not
// fit changes nothing, and release gives every page back; a write lands every row on its page,
// across runs of consecutive pages (one copy each) and the gaps between them.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "engine/backend.h"
#include "engine/kv_pages.h"

namespace burst::engine {
namespace {

std::vector<int32_t> run(int32_t first, int32_t n) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), first);
  return v;
}

TEST(PagedKvCachePages, GrowingSequencesKeepConsecutivePages) {
  auto backend = make_cpu_backend();
  auto made = PagedKvCache::create(*backend, {1, 2, 1, 8}, /*pages=*/64, /*page_size=*/4);
  ASSERT_TRUE(made.ok()) << made.message();
  PagedKvCache& c = *made.value();
  // A long prompt's first chunk (10 rows: 3 pages) on an empty pool: pages 0-2.
  ASSERT_TRUE(c.reserve(1, 10).ok());
  c.commit(1);
  EXPECT_EQ(c.pages(1), run(0, 3));
  // A short request arrives: the free run [3, 64) starts right after sequence 1, so it starts
  // halfway along (3 + 61 / 2 = 33), leaving sequence 1 room to grow.
  ASSERT_TRUE(c.reserve(2, 5).ok());
  c.commit(2);
  EXPECT_EQ(c.pages(2), run(33, 2));
  // The prompt's next chunk (14 rows: 2 + 4 rows -> pages 3-5) continues its run.
  ASSERT_TRUE(c.reserve(1, 14).ok());
  c.commit(1);
  EXPECT_EQ(c.pages(1), run(0, 6));
  // Sequence 2 decodes past its pages: 35 is free after 34.
  ASSERT_TRUE(c.reserve(2, 4).ok());
  EXPECT_EQ(c.pages(2), run(33, 3));
  c.commit(2);
  // Released, sequence 1's pages merge back into the run [0, 33): a new sequence starts at 0.
  c.release(1);
  ASSERT_TRUE(c.reserve(3, 9).ok());
  EXPECT_EQ(c.pages(3), run(0, 3));
  c.commit(3);
  EXPECT_EQ(c.usage().used_pages, 6);
  EXPECT_EQ(c.usage().sequences, 2);
}

TEST(PagedKvCachePages, BrokenRunsStillAllocateAndRefusalsChangeNothing) {
  auto backend = make_cpu_backend();
  auto made = PagedKvCache::create(*backend, {1, 2, 1, 8}, /*pages=*/8, /*page_size=*/2);
  ASSERT_TRUE(made.ok()) << made.message();
  PagedKvCache& c = *made.value();
  // Alternating growth: each sequence's next page is taken by the other at some point.
  for (int step = 0; step < 3; ++step) {
    for (uint64_t id : {1, 2}) {
      ASSERT_TRUE(c.reserve(id, 2).ok()) << "step " << step << " seq " << id;
      c.commit(id);
    }
  }
  EXPECT_EQ(c.free_pages(), 2);
  std::vector<int32_t> all = c.pages(1);
  all.insert(all.end(), c.pages(2).begin(), c.pages(2).end());
  std::sort(all.begin(), all.end());
  EXPECT_EQ(std::adjacent_find(all.begin(), all.end()), all.end()) << "a page given twice";
  // 3 more pages do not fit in 2: refused with kResourceExhausted, nothing taken.
  const Status st = c.reserve(3, 6);
  EXPECT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(c.free_pages(), 2);
  EXPECT_EQ(c.usage().sequences, 2);
  c.release(1);
  c.release(2);
  EXPECT_EQ(c.free_pages(), 8);
  EXPECT_EQ(c.usage().used_pages, 0);
}

TEST(PagedKvCacheWrite, RowsLandOnTheirPagesAcrossRunsAndGaps) {
  auto backend = make_cpu_backend();
  auto made = PagedKvCache::create(*backend, {1, 2, 1, 8}, /*pages=*/8, /*page_size=*/4);
  ASSERT_TRUE(made.ok()) << made.message();
  PagedKvCache& c = *made.value();
  // Two sequences growing in turn (as in the test above): 1 takes 0-2, 2 takes 4-6; then 1
  // grows into 3 and, 4 being taken, into 7: a run of four pages, then a gap.
  for (int step = 0; step < 3; ++step) {
    for (uint64_t id : {1, 2}) {
      ASSERT_TRUE(c.reserve(id, 4).ok());
      c.commit(id);
    }
  }
  ASSERT_TRUE(c.reserve(1, 8).ok());  // 20 rows: 5 pages
  const std::vector<int32_t> pages = c.pages(1);
  ASSERT_EQ(pages.size(), 5u);
  bool run = false, gap = false;
  for (size_t i = 1; i < pages.size(); ++i) {
    (pages[i] == pages[i - 1] + 1 ? run : gap) = true;
  }
  ASSERT_TRUE(run && gap) << "the layout this test needs: " << ::testing::PrintToString(pages);
  // Rows 3..18 (from the middle of the first page to the middle of the last) in one write.
  const int64_t first = 3, n = 16, w = 8;
  auto k = backend->alloc({n, w}, DType::kF32), v = backend->alloc({n, w}, DType::kF32);
  ASSERT_TRUE(k.ok() && v.ok());
  for (int64_t i = 0; i < n * w; ++i) {
    k.value().as<float>()[i] = 1000.f + float(i);
    v.value().as<float>()[i] = -1000.f - float(i);
  }
  ASSERT_TRUE(c.write(1, 0, first, k.value(), v.value()).ok());
  const float* kp = c.k_pool(0).as<float>();
  const float* vp = c.v_pool(0).as<float>();
  for (int64_t r = 0; r < n; ++r) {
    const int64_t j = first + r;
    const int64_t pool = int64_t{pages[static_cast<size_t>(j / 4)]} * 4 + j % 4;
    for (int64_t x = 0; x < w; ++x) {
      ASSERT_EQ(kp[pool * w + x], 1000.f + float(r * w + x)) << "row " << j;
      ASSERT_EQ(vp[pool * w + x], -1000.f - float(r * w + x)) << "row " << j;
    }
  }
}

}  // namespace
}  // namespace burst::engine
