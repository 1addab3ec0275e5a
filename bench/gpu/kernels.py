#!/usr/bin/env python3
"""Where the GPU's time goes, from Nsight Compute's raw CSV of one run
(`ncu --csv --page raw --metrics gpu__time_duration.sum`): the kernels by
total time, with their launch counts and mean durations, the share of the
total each takes, and the sum of every kernel's time. The sum against the
run's wall time without the profiler says how much of it the host spends
between launches.

  kernels.py NCU_CSV [TOP]
"""

import csv
import sys
from collections import defaultdict


NS_PER = {"nsecond": 1.0, "usecond": 1e3, "msecond": 1e6, "second": 1e9}


def rows(path):
    """(kernel name, nanoseconds) of every launch."""
    with open(path, newline="") as f:
        # ncu prints its own lines (==PROF== ...) around the table.
        lines = [l for l in f if l.startswith('"')]
    scale = 1.0
    for row in csv.DictReader(lines):
        value = row.get("gpu__time_duration.sum", "")
        if value in NS_PER:  # the units row
            scale = NS_PER[value]
            continue
        try:
            yield row["Kernel Name"], float(value.replace(",", "")) * scale
        except (KeyError, ValueError):
            continue  # a kernel without a reading


def main():
    path, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 25
    totals, counts = defaultdict(float), defaultdict(int)
    for name, ns in rows(path):
        name = name.split("(")[0][:60]
        totals[name] += ns
        counts[name] += 1
    total = sum(totals.values())
    if not total:
        sys.exit(f"{path}: no kernel durations")
    print(f"{'kernel':<60} {'launches':>9} {'mean us':>8} {'total ms':>9} {'share':>6}")
    for name, ns in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{name:<60} {counts[name]:>9} {ns / counts[name] / 1e3:>8.1f} {ns / 1e6:>9.2f} {ns / total:>6.1%}")
    print(f"{'all kernels':<60} {sum(counts.values()):>9} {'':>8} {total / 1e6:>9.2f}")


if __name__ == "__main__":
    main()
