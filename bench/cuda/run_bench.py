#!/usr/bin/env python3
"""Runs cuda_attention_bench beside torch SDPA on the same shapes, in the same process tree.

  python3 bench/cuda/run_bench.py BENCH_BINARY [--out DIR] [--confirm K] [--variant NAME]

For every shape of the FlashAttention grid (float16 and bfloat16, D in {64,128,256}, N in
{512..16384}, B = 16384/N, H = 2048/D, causal and not) it times torch's FLASH_ATTENTION and
CUDNN_ATTENTION backends with triton.testing.do_bench (median, warm-up 25 ms, rep 100 ms, random
normal BHSD inputs), reads our kernel's median from the binary's JSON lines, prints a table with
both ratios and writes DIR/cuda_bench.csv and DIR/flash_grid.png (TFLOP/s vs N, one panel per
(head dim, mask)). The float32 rows compare with EFFICIENT_ATTENTION in float32.
TFLOP/s = 4 B H N^2 D / time, halved when causal.

--variant NAME forces our forward kernel variant (e.g. mma_sm80; default: the planner's choice);
the variant each row ran, as the binary reports it, goes into the CSV and the tables.

With --confirm K, every target row (float16/bfloat16, D 64 or 128, N >= 1024) whose ratio to
FLASH_ATTENTION is below 1.03 is timed K more times, ours and FLASH_ATTENTION alternately (so
clock drift over the long grid run touches both alike), and a second table gives the medians.
"""
import argparse
import csv
import json
import os
import statistics
import subprocess

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def ours(binary, variant, *which):
    forced = ["--variant", variant] if variant else []
    out = subprocess.run([binary, *forced, *which], check=True, capture_output=True,
                         text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def torch_tflops(row, backend):
    b, h, n, d = row["B"], row["H"], row["N"], row["d"]
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=DTYPES[row["dtype"]]) for _ in range(3))
    try:
        with sdpa_kernel(backend):
            fn = lambda: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=row["causal"])
            fn()
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    except RuntimeError as e:  # backend unavailable for this shape
        print(f"# {backend} failed on {row}: {e}".splitlines()[0])
        return float("nan")
    finally:
        del q, k, v
    flops = 4.0 * b * h * n * n * d / (2 if row["causal"] else 1)
    return flops / ms / 1e9


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    dims = sorted({r["d"] for r in rows})
    fig, axes = plt.subplots(2, len(dims), figsize=(5 * len(dims), 8), squeeze=False)
    for col, d in enumerate(dims):
        for row_i, causal in enumerate([False, True]):
            ax = axes[row_i][col]
            for dt, style in (("bfloat16", "-"), ("float16", "--")):
                sel = sorted((r for r in rows if r["d"] == d and r["causal"] == causal
                              and r["dtype"] == dt), key=lambda r: r["N"])
                ns = [r["N"] for r in sel]
                for key, color in (("ours", "C0"), ("flash", "C1"), ("cudnn", "C2")):
                    ax.plot(ns, [r[key] for r in sel], style, color=color, marker="o",
                            label=f"{key} {dt}")
            ax.set_xscale("log", base=2)
            ax.set_title(f"D={d} {'causal' if causal else 'non-causal'}")
            ax.set_xlabel("N (B=16384/N, H=2048/D)")
            ax.set_ylabel("TFLOP/s")
            ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"attention forward on {torch.cuda.get_device_name()}: ours vs torch SDPA")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--confirm", type=int, default=0)
    ap.add_argument("--variant", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)

    rows = ours(args.binary, args.variant, "grid")
    for r in rows:
        r["ours"] = r.pop("TFLOPs")
        r["flash"] = torch_tflops(r, SDPBackend.FLASH_ATTENTION)
        r["cudnn"] = torch_tflops(r, SDPBackend.CUDNN_ATTENTION)
    fp32 = ours(args.binary, args.variant, "fp32")
    for r in fp32:
        r["ours"] = r.pop("TFLOPs")
        r["efficient"] = torch_tflops(r, SDPBackend.EFFICIENT_ATTENTION)

    with open(os.path.join(args.out, "cuda_bench.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["dtype", "d", "N", "B", "H", "causal", "variant", "ours", "flash", "cudnn",
                    "efficient"])
        for r in rows + fp32:
            w.writerow([r["dtype"], r["d"], r["N"], r["B"], r["H"], r["causal"], r["variant"],
                        r["ours"], r.get("flash", ""), r.get("cudnn", ""), r.get("efficient", "")])
    plot(rows, os.path.join(args.out, "flash_grid.png"))

    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"cuDNN {torch.backends.cudnn.version()}")
    print("| dtype | D | N | B | H | causal | variant | ours TFLOP/s | flash | cudnn | ours/flash | "
          "ours/cudnn |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['d']} | {r['N']} | {r['B']} | {r['H']} | {r['causal']} | "
              f"{r['variant']} | {r['ours']:.1f} | {r['flash']:.1f} | {r['cudnn']:.1f} | "
              f"{r['ours'] / r['flash']:.2f} | {r['ours'] / r['cudnn']:.2f} |")
    print("| dtype | D | N | B | H | causal | variant | ours TFLOP/s | torch EFFICIENT fp32 | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in fp32:
        print(f"| {r['dtype']} | {r['d']} | {r['N']} | {r['B']} | {r['H']} | {r['causal']} | "
              f"{r['variant']} | {r['ours']:.1f} | {r['efficient']:.1f} | "
              f"{r['ours'] / r['efficient']:.2f} |")
    if args.confirm:
        confirm(args.binary, args.variant, rows, args.confirm)


def confirm(binary, variant, rows, times):
    close = [r for r in rows if r["d"] in (64, 128) and r["N"] >= 1024
             and r["ours"] / r["flash"] < 1.03]
    print(f"| dtype | D | N | causal | variant | ours median of {times} | flash median of {times} | "
          "ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for r in close:
        ours_runs, flash_runs = [], []
        for _ in range(times):
            ours_runs.append(ours(binary, variant, "one", r["dtype"], str(r["d"]), str(r["N"]),
                                  "true" if r["causal"] else "false")[0]["TFLOPs"])
            flash_runs.append(torch_tflops(r, SDPBackend.FLASH_ATTENTION))
        o, f = statistics.median(ours_runs), statistics.median(flash_runs)
        print(f"| {r['dtype']} | {r['d']} | {r['N']} | {r['causal']} | {r['variant']} | {o:.1f} | "
              f"{f:.1f} | {o / f:.2f} |")


if __name__ == "__main__":
    main()
