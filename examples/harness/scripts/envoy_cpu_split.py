#!/usr/bin/env python3
"""Split Envoy's CPU samples between the filter's wasm code, Envoy called from it, and the rest.

Reads `perf script` output of `perf record --call-graph dwarf -p <envoy pid>` on stdin. V8's
compiled wasm sits in anonymous executable memory, which perf names `/tmp/perf-<pid>.map`:
a sample whose leaf is there is the filter's own code; one with such a frame above its leaf
is Envoy (or the kernel) serving a call the filter made (a host call: headers, buffers,
metrics, the hint's dispatch); everything else is Envoy proxying, entering the VM and
buffering, or the kernel. docs/benchmarks.md, "Data path cost", has the command around it.
"""

import collections
import sys


def where(frame):
    if "perf-" in frame:
        return "wasm"
    if "kernel" in frame:
        return "kernel"
    return "envoy"


def classify(frames):
    leaf = where(frames[0])
    if leaf == "wasm":
        return "the filter's wasm code"
    if any(where(f) == "wasm" for f in frames[1:]):
        return "called from the filter: " + leaf
    return "native: " + leaf


def main():
    counts, frames = collections.Counter(), []
    for line in list(sys.stdin) + [""]:
        if line.startswith((" ", "\t")) and line.strip():
            frames.append(line.strip())
        elif frames:
            counts[classify(frames)] += 1
            frames = []
    total = sum(counts.values())
    if not total:
        sys.exit("no samples with call chains on stdin")
    for name, n in counts.most_common():
        print(f"{100 * n / total:5.1f}%  {name}")
    print(f"{total} samples")


if __name__ == "__main__":
    main()
