"""Whether how and where the L2 is flushed changes the timing of a short memory-bound GEMM.

This probe found why the autotuner and the benchmark ranked 25 x 9216 x 7168 differently
(scripts/dev/tuner_probe.py): the benchmark Timer's flush buffer, made with device=None, lived
on the host, so its "flush" left the GPU's L2 warm with the previous run's operands (cuBLAS
~41 us, ours ~43.5), where the autotuner's flushed it (~49 and ~47). Both now flush the GPU
(autotune.flush_buffer). This checks what remains: whether the flush buffer's address, a read
instead of a write, or a larger buffer still move the times. The candidates are timed in the
benchmark's discipline (interleaved, ~1 ms queued ahead) under each flush:

- early_write / late_write: zero_() of a buffer allocated before / after the operands
- early_read / late_read:   a read (sum) of it instead: L2 then holds clean lines, nothing
                            to write back during the GEMM
- early_write_late_read / late_write_early_read: write one, then read the other
- late2_write:              another buffer allocated after the operands
- big_early_write / big_late_write: zero_() of an 8 x L2 buffer

``python scripts/dev/flush_probe.py [MxNxK ...]``; ``PROBE_OUT`` names the JSON."""

from __future__ import annotations

import time

import torch

from distgemm import dense
from distgemm.autotune import flush_buffer
from distgemm._library import ops
from distgemm.bench.common import Timer
from tuner_probe import format_times, shapes_from_argv, write_results  # beside this script

SHAPES = [(25, 9216, 7168), (16, 9216, 7168), (128, 16384, 7168), (4096, 4096, 4096)]
REPEATS = 3


def probe(m: int, n: int, k: int, timer: Timer, early: dict) -> dict:
    bf = torch.bfloat16
    a = torch.randn(m, k, device="cuda", dtype=bf)
    b = torch.randn(n, k, device="cuda", dtype=bf)
    names = dense._config_names(bf, bf, bf, True, 90)
    cands = {"cublas": lambda: torch.nn.functional.linear(a, b)}
    for i, name in enumerate(names):
        if name in ("pingpong_64x128_c1x1", "pingpong_128x128_c1x2"):
            cands[name] = lambda i=i: ops.gemm(a, b, None, 1.0, 0.0, bf, None, None, False, i)
    late, late2, big_late = flush_buffer(), flush_buffer(), flush_buffer(times_l2=8)

    def read(buf):
        buf.sum(dtype=torch.int64)

    flushes = {
        "early_write": lambda: early["2"].zero_(),
        "late_write": lambda: late.zero_(),
        "early_read": lambda: read(early["2"]),
        "late_read": lambda: read(late),
        "early_write_late_read": lambda: (early["2"].zero_(), read(late)),
        "late_write_early_read": lambda: (late.zero_(), read(early["2"])),
        "late2_write": lambda: late2.zero_(),
        "big_early_write": lambda: early["8"].zero_(),
        "big_late_write": lambda: big_late.zero_(),
    }
    runs = {name: [] for name in flushes}
    own = timer.queue_ahead
    try:
        for _ in range(REPEATS):
            for name, flush in flushes.items():
                def queue_ahead(flush=flush):
                    flush()
                    torch.cuda._sleep(2_000_000)
                timer.queue_ahead = queue_ahead
                runs[name].append(timer.compare(cands, reps=20))
    finally:
        timer.queue_ahead = own
    return {"shape": [m, n, k], "runs": runs}


def main() -> None:
    shapes = shapes_from_argv(SHAPES)
    t0 = time.time()
    timer = Timer()
    early = {"2": flush_buffer(), "8": flush_buffer(times_l2=8)}
    results = []
    for m, n, k in shapes:
        r = probe(m, n, k, timer, early)
        results.append(r)
        print(f"== {m}x{n}x{k} (us; cuBLAS time / each; {time.time() - t0:.0f} s in)")
        for flush, samples in r["runs"].items():
            for i, times in enumerate(samples):
                print(f"  {flush:<22} #{i}: {format_times(times)}", flush=True)
    write_results(results)


if __name__ == "__main__":
    main()
