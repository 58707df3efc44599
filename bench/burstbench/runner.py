# Contract: the run loop. run_requests(target, specs, args, rng, label, stop) sends the specs
# with the arrival process (--request-rate, gamma inter-arrivals of shape --burstiness, from
# rng) and the --max-concurrency limit, each under --request-timeout, shows progress on stderr,
# and returns (results, duration): one Result per request sent (a failure is data, never an
# exception). StopFlag and install_signals: the first SIGINT / SIGTERM cancels what is in flight
# and keeps the partial results; a second exits at once with 130.
import asyncio
import math
import os
import signal
import sys
import time

from .common import Result, log


class Progress:
    def __init__(self, total, enabled, label="requests"):
        self.total, self.enabled, self.label = total, enabled, label
        self.tty = sys.stderr.isatty()
        self.ok = self.failed = 0
        self.t0 = time.perf_counter()
        self.last_draw = 0.0
        self.last_decile = -1

    def update(self, res):
        if res.success:
            self.ok += 1
        elif not res.interrupted:
            self.failed += 1
        if not self.enabled:
            return
        done = self.ok + self.failed
        now = time.perf_counter()
        if self.tty:
            if now - self.last_draw < 0.1 and done < self.total:
                return
            self.last_draw = now
            width = 30
            fill = int(width * done / max(self.total, 1))
            sys.stderr.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{self.total} "
                             f"{self.label} ok {self.ok} failed {self.failed} "
                             f"{now - self.t0:.1f} s ")
            sys.stderr.flush()
        else:
            decile = 10 * done // max(self.total, 1)
            if decile != self.last_decile:
                self.last_decile = decile
                log(f"burst-bench: {done}/{self.total} {self.label} (ok {self.ok}, failed "
                    f"{self.failed}, {now - self.t0:.1f} s)")

    def close(self):
        if self.enabled and self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


async def one_request(target, spec, t0, sem, timeout):
    res = Result(index=spec.index, group=spec.group, input_len=spec.input_len or 0,
                 output_len_req=spec.output_len, prefix=spec.prefix)
    try:
        if sem is not None:
            async with sem:
                await asyncio.wait_for(target.send(spec, res, t0), timeout)
        else:
            await asyncio.wait_for(target.send(spec, res, t0), timeout)
    except asyncio.CancelledError:
        res.interrupted = True
        res.success = False
        res.error_kind, res.error = "interrupted", "the run was interrupted"
        res.output_len = res.output_len or res.chunks  # what had arrived
    except asyncio.TimeoutError:
        res.success = False
        res.error_kind, res.error = "timeout", f"no end of stream after {timeout} s"
    except Exception as e:  # noqa: BLE001 - a failed request is data, never a crash
        res.success = False
        kind = target.classify(e)
        res.error_kind, res.error = kind if kind else (type(e).__name__, str(e)[:300])
    if res.error_kind and res.success:
        res.success = False
    if not res.input_len and res.server_input_len:
        res.input_len = res.server_input_len
    return res


async def run_requests(target, specs, args, rng, label, stop):
    """Sends specs with the arrival process and the concurrency limit; returns (results,
    duration)."""
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    progress = Progress(len(specs), not args.no_progress, label)
    t0 = time.perf_counter()
    tasks = []
    last_done = [t0]

    def done_cb(task):
        last_done[0] = time.perf_counter()
        if not task.cancelled() and task.exception() is None:
            progress.update(task.result())

    for i, spec in enumerate(specs):
        if stop.is_set():
            break
        if i > 0 and math.isfinite(args.request_rate):
            theta = 1.0 / (args.request_rate * args.burstiness)
            delay = rng.gammavariate(args.burstiness, theta)
            try:
                await asyncio.wait_for(stop.wait(), delay)
                break
            except asyncio.TimeoutError:
                pass
        t = asyncio.create_task(one_request(target, spec, t0, sem, args.request_timeout))
        t.add_done_callback(done_cb)
        tasks.append(t)
        stop.tasks = tasks
    results = list(await asyncio.gather(*tasks)) if tasks else []
    # Requests an interrupt caught before they were sent are not part of the run.
    results = [r for r in results if r.sent or not r.interrupted]
    progress.close()
    end = last_done[0] if not stop.is_set() else time.perf_counter()
    return results, max(end - t0, 1e-9)


class StopFlag(asyncio.Event):
    def __init__(self):
        super().__init__()
        self.tasks = []
        self.signals = 0


def install_signals(loop, stop):
    def handler(signame):
        stop.signals += 1
        if stop.signals > 1:
            log("burst-bench: interrupted twice, exiting without results")
            os._exit(130)
        log(f"\nburst-bench: {signame}: stopping; in-flight requests are cancelled and the "
            "partial results reported (again to quit at once)")
        stop.set()
        for t in stop.tasks:
            t.cancel()

    for s in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(s, handler, s.name)
        except (NotImplementedError, RuntimeError):
            pass
