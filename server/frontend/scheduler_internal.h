// What the scheduler's files (scheduler.cpp, scheduler_group.cpp) share beside
// frontend/scheduler.h: the clock they time requests and steps with.
#pragma once

#include <chrono>

namespace burst::server {

using Clock = std::chrono::steady_clock;

inline double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

}  // namespace burst::server
