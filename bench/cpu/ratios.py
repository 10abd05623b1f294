#!/usr/bin/env python3
"""Prints the CPU backend's GFLOP/s beside its anchors from one cpu_attention_bench JSON file.

  build-cpu/bench/cpu/cpu_attention_bench --benchmark_out=cpu.json --benchmark_out_format=json
  python3 bench/cpu/ratios.py cpu.json
"""
import json
import sys


def main(path):
    with open(path) as f:
        runs = json.load(f)["benchmarks"]
    # Keep the median when repetitions were asked for, else the single run.
    rate = {}
    for run in runs:
        if run.get("run_type") == "aggregate" and run.get("aggregate_name") != "median":
            continue
        if "GFLOP/s" not in run:  # the memory anchor (BM_StreamQkvToO) reports GB/s only
            continue
        name = run.get("run_name", run["name"])
        rate[name] = run["GFLOP/s"]

    def find(prefix):
        return next((v for k, v in rate.items() if k.startswith(prefix)), None)

    sgemm = find("BM_SgemmSquare")
    print(f"{'case':<34}{'ours GFLOP/s':>14}{'naive GFLOP/s':>15}{'ours/naive':>12}{'ours/sgemm':>12}")
    for label, causal in (("B=1 H=8 N=2048 D=64", 0), ("B=1 H=8 N=2048 D=64 causal", 1)):
        ours = find(f"BM_CpuBackend/causal:{causal}")
        naive = find(f"BM_NaiveBlas/causal:{causal}")
        print(f"{label:<34}{ours:>14.1f}{naive:>15.1f}{ours / naive:>12.2f}{ours / sgemm:>12.2f}")
    long = find("BM_CpuBackendLong")
    if long is not None:
        print(f"{'B=1 H=1 N=65536 D=64 causal':<34}{long:>14.1f}{'-':>15}{'-':>12}{long / sgemm:>12.2f}")
    print(f"{'sgemm 2048^3 (ceiling)':<34}{sgemm:>14.1f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cpu.json")
