#!/usr/bin/env python3
"""What this GPU does at best, measured with CUDA events: the bf16 matrix
product rate (FLOP/s of an 8192^3 product) and the device-to-device copy
bandwidth (bytes read plus written per second, 2 GiB buffers). Prints one
JSON line: {"device", "bf16_tflops", "bandwidth_gbs"}. The benchmark's
utilisation and memory-floor figures divide by these.
"""

import json

import torch


def best_seconds(fn, reps=20, rounds=5):
    """The fastest of `rounds` timings of `reps` calls, per call."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000 / reps)
    return best


def main():
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    matmul = best_seconds(lambda: torch.matmul(a, b, out=c))
    del a, b, c
    words = (2 << 30) // 4
    src = torch.empty(words, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    copy = best_seconds(lambda: dst.copy_(src), reps=10)
    print(json.dumps({
        "device": torch.cuda.get_device_name(),
        "bf16_tflops": round(2 * n**3 / matmul / 1e12, 1),
        "bandwidth_gbs": round(2 * src.numel() * 4 / copy / 1e9, 1),
    }))


if __name__ == "__main__":
    main()
