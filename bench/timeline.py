#!/usr/bin/env python3
"""Where a train step's GPU time goes beside the input pipeline, from the timelines that
``bench/train.py --profile STEPS --trace DIR`` writes (a gzipped Chrome trace a row, torch.profiler's
CUDA activity: every kernel, copy and CUDA runtime call of the process):

  the step's stream   (the stream with the most kernel time) its kernels' busy time a step, and the time
                      it stood idle between them, split into idle while a kernel of another stream ran,
                      while only copies ran, and with nothing of the process on the GPU
  launch to start     how long the step's kernels waited on the GPU after their launch on the host: a
                      host far ahead of the GPU gives milliseconds; a short wait means the step's
                      kernels ran as soon as the host launched them (the host set the pace)
  host threads        each thread's CUDA runtime calls a step (count, time inside them, the median
                      kernel launch), and how many of its kernels ran on the step's stream

    python bench/timeline.py DIR/*.json.gz
"""

import argparse
import collections
import gzip
import json
import re
import statistics

GPU = ("kernel", "gpu_memcpy", "gpu_memset")


def _union(spans):
    merged = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def _overlap(u, v) -> float:
    """Time (us) two sorted, merged span lists share."""
    i = j = 0
    shared = 0.0
    while i < len(u) and j < len(v):
        shared += max(0.0, min(u[i][1], v[j][1]) - max(u[i][0], v[j][0]))
        if u[i][1] < v[j][1]:
            i += 1
        else:
            j += 1
    return shared


def _total(spans) -> float:
    return sum(b - a for a, b in spans)


def stream_of(event):
    """The CUDA stream of a trace's GPU event."""
    return event.get("args", {}).get("stream", event.get("tid"))


def step_stream(gpu_events):
    """The train step's stream: the one whose kernels were busy longest (bench/train.py's rule too)."""
    busy = collections.Counter()
    for e in gpu_events:
        if e["cat"] == "kernel":
            busy[stream_of(e)] += e["dur"]
    return busy.most_common(1)[0][0] if busy else None


def analyse(events, steps: int) -> dict:
    """The figures above, in ms a step (us for latencies), from a trace's events."""
    gpu = [e for e in events if e.get("cat") in GPU and "dur" in e]
    calls = [e for e in events if e.get("cat") == "cuda_runtime" and "dur" in e]
    if not gpu:
        raise ValueError("no GPU activity in the trace (profiled without CUDA, or CUPTI missing)")

    step_on = step_stream(gpu)
    step = [e for e in gpu if stream_of(e) == step_on and e["cat"] == "kernel"]
    t0, t1 = min(e["ts"] for e in step), max(e["ts"] + e["dur"] for e in step)
    step_busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in step])
    idle = [[a, b] for (_, a), (b, _) in zip(step_busy[:-1], step_busy[1:])]
    others = [e for e in gpu if stream_of(e) != step_on and t0 <= e["ts"] <= t1]
    other_kernels = _union([(e["ts"], e["ts"] + e["dur"]) for e in others if e["cat"] == "kernel"])
    other_any = _union([(e["ts"], e["ts"] + e["dur"]) for e in others])
    idle_total = _total(idle)
    idle_kernels = _overlap(idle, other_kernels)
    idle_any = _overlap(idle, other_any)
    per = 1e3 * steps
    out = {
        "steps": steps,
        "step_span_ms": round((t1 - t0) / per, 3),
        "step_kernels_busy_ms": round(_total(step_busy) / per, 3),
        "step_idle_ms": round(idle_total / per, 3),
        "idle_beside_other_kernels_ms": round(idle_kernels / per, 3),
        "idle_beside_copies_only_ms": round((idle_any - idle_kernels) / per, 3),
        "idle_gpu_empty_ms": round((idle_total - idle_any) / per, 3),
        "other_kernels_busy_ms": round(_total(other_kernels) / per, 3),
        "other_kernels_beside_step_ms": round(_overlap(step_busy, other_kernels) / per, 3),
    }
    by_correlation = {_correlation(e): e for e in calls}
    waits = sorted(e["ts"] - by_correlation[c]["ts"] for e in step if (c := _correlation(e)) in by_correlation)
    if waits:
        out["launch_to_start_us"] = {q: round(waits[int(f * (len(waits) - 1))]) for q, f in
                                     (("p10", 0.1), ("p50", 0.5), ("p90", 0.9))}
    gpu_by_correlation = {_correlation(e): e for e in gpu}
    threads = collections.defaultdict(list)
    for e in calls:
        threads[e["tid"]].append(e)
    rows = []
    for tid, mine in threads.items():
        launched = [gpu_by_correlation[c] for e in mine
                    if (c := _correlation(e)) in gpu_by_correlation and gpu_by_correlation[c]["cat"] == "kernel"]
        launches = [e["dur"] for e in mine if e["name"].startswith("cudaLaunchKernel")]
        rows.append({"thread": tid, "calls": round(len(mine) / steps, 1),
                     "inside_ms": round(sum(e["dur"] for e in mine) / per, 3),
                     "median_launch_us": round(statistics.median(launches), 1) if launches else None,
                     "kernels": round(len(launched) / steps, 1),
                     "on_step_stream": round(sum(1 for k in launched if stream_of(k) == step_on) / steps, 1),
                     "top": [n for n, _ in collections.Counter(e["name"] for e in mine).most_common(3)]})
    out["threads"] = sorted(rows, key=lambda r: -r["calls"])[:8]
    return out


def _correlation(event):
    """The id that ties a CUDA call on the host to the GPU work it launched, in a trace's events."""
    return event.get("args", {}).get("correlation")


def _steps(path: str, given) -> int:
    if given:
        return given
    found = re.search(r"-(\d+)steps\.json", path)
    if not found:
        raise SystemExit(f"{path}: no -NNsteps in the name; give --steps")
    return int(found.group(1))


def report(path: str, steps: int) -> str:
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
        r = analyse(json.load(f)["traceEvents"], steps)
    lines = [f"{path} ({r['steps']} steps), ms a step:",
             f"  the step's stream: span {r['step_span_ms']}, kernels busy {r['step_kernels_busy_ms']}, idle "
             f"{r['step_idle_ms']} (beside another stream's kernels {r['idle_beside_other_kernels_ms']}, beside "
             f"copies only {r['idle_beside_copies_only_ms']}, the GPU empty {r['idle_gpu_empty_ms']})",
             f"  other streams' kernels: busy {r['other_kernels_busy_ms']}, of which beside the step's "
             f"{r['other_kernels_beside_step_ms']}"]
    if "launch_to_start_us" in r:
        lines.append("  the step's kernels, launch to start (us): " +
                     ", ".join(f"{k} {v}" for k, v in r["launch_to_start_us"].items()))
    for t in r["threads"]:
        lines.append(f"  thread {t['thread']}: {t['calls']} CUDA calls a step, {t['inside_ms']} ms inside them, "
                     f"median launch {t['median_launch_us'] or '-'} us, {t['kernels']} kernels "
                     f"({t['on_step_stream']} on the step's stream); {', '.join(t['top'])}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", help="gzipped Chrome traces from bench/train.py --trace")
    parser.add_argument("--steps", type=int, help="steps a trace covers (default: from its -NNsteps name)")
    args = parser.parse_args(argv)
    for path in args.traces:
        print(report(path, _steps(path, args.steps)))


if __name__ == "__main__":
    main()
