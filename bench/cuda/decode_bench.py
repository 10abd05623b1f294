#!/usr/bin/env python3
"""Runs decode_bench (one paged decode step, split-KV) beside torch SDPA and a device copy.

  python3 bench/cuda/decode_bench.py DECODE_BENCH_BINARY [--out DIR] [--baseline BINARY]

Shape: bfloat16, B=8, Hq=32, Hkv=8, D=128, Nq=1, Nk in {4096, 32768, 131072}. torch's
FLASH_ATTENTION and CUDNN_ATTENTION backends run on contiguous K/V [B, Hkv, Nk, D] with
enable_gqa=True (no copy of K/V per query head); a backend that refuses enable_gqa is run on K/V
repeated to Hq heads with repeat_interleave before timing (it then reads Hq/Hkv times the bytes;
the table says so). Timing: triton.testing.do_bench (median, L2 flushed before each run). TB/s
counts the K/V bytes of the Hkv heads (B * Nk * Hkv * D * 2 bytes * 2) for every column. The
device-to-device rate is torch clone of a 4 GiB tensor, counted as bytes read + written.
--baseline: a decode_bench built from an earlier version, run in the same command (before ours'
torch timings); the table gets its planned rows' times as "before us". The roofline anchor
(decode_bench's "anchor" lines: read-only kernels over the same pool, timed the same way) goes in
the table as the fastest read of the K/V bytes at each Nk; a second table gives ours and the
anchor after a flush that leaves the L2 clean (no write-back inside the timed step). Writes
DIR/decode_bench.csv, DIR/decode_anchor.csv and prints markdown tables.
"""
import argparse
import csv
import json
import os
import subprocess

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

B, HQ, HKV, D = 8, 32, 8, 128


def ours(binary):
    """(step rows, anchor rows) of a decode_bench run; rows without "flush" are memset-flushed."""
    out = subprocess.run([binary], check=True, capture_output=True, text=True).stdout
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    for r in lines:
        r.setdefault("flush", "memset")
        r.setdefault("cluster", False)
    return ([r for r in lines if "anchor" not in r], [r for r in lines if "anchor" in r])


def merge(r):
    """How a row's splits merge: in a cluster, through tickets, or not at all (one split)."""
    return "cluster" if r["cluster"] else "tickets" if r["splits"] > 1 else "none"


def best_anchor(anchors, nk, flush):
    """The fastest read anchor (not the empty kernel) at nk after `flush`, or None."""
    reads = [a for a in anchors
             if a["nk"] == nk and a["flush"] == flush and a["anchor"] != "empty"]
    return min(reads, key=lambda a: a["us"]) if reads else None


def kv_bytes(nk):
    return 2.0 * B * nk * HKV * D * 2


def torch_us(nk, backend):
    q = torch.randn(B, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, HKV, nk, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, HKV, nk, D, device="cuda", dtype=torch.bfloat16)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    how = "enable_gqa"
    try:
        with sdpa_kernel(backend):
            try:
                fn = lambda: sdpa(q, k, v, enable_gqa=True)
                fn()
            except RuntimeError:
                how = "repeat_interleave"
                kr = k.repeat_interleave(HQ // HKV, dim=1)
                vr = v.repeat_interleave(HQ // HKV, dim=1)
                fn = lambda: sdpa(q, kr, vr)
                fn()
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    except RuntimeError as e:
        print(f"# {backend} failed at nk={nk}: {str(e).splitlines()[0]}")
        return float("nan"), "failed"
    return ms * 1e3, how


def d2d_tbps():
    x = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    ms = triton.testing.do_bench(lambda: x.clone(), warmup=25, rep=200, return_mode="median")
    del x
    return 2.0 * (4 << 30) / (ms * 1e-3) / 1e12


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--baseline", help="decode_bench of an earlier version, timed in the same run")
    args = ap.parse_args()
    torch.manual_seed(0)

    rows, anchors = ours(args.binary)
    before = {}
    if args.baseline:
        for r in ours(args.baseline)[0]:
            if not r["forced_splits"] and r["flush"] == "memset":
                before[(r["nk"], r["page_bytes"])] = r["us"]
                print(f"# baseline nk={r['nk']} page={r['page_bytes'] >> 10} KiB "
                      f"splits={r['splits']}: {r['us']:.1f} us")
    d2d = d2d_tbps()
    nks = sorted({r["nk"] for r in rows})
    ref = {}
    for nk in nks:
        ref[nk] = {name: torch_us(nk, backend) for name, backend in
                   (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION))}
    d2d_after = d2d_tbps()

    with open(os.path.join(args.out, "decode_bench.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["nk", "page_bytes", "page_rows", "splits", "forced_splits", "merge", "ctas",
                    "flush", "us", "kv_tbps"])
        for r in rows:
            w.writerow([r["nk"], r["page_bytes"], r["page_rows"], r["splits"], r["forced_splits"],
                        merge(r), r["ctas"], r["flush"], r["us"], r["kv_tbps"]])
    with open(os.path.join(args.out, "decode_anchor.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["anchor", "nk", "flush", "ctas", "us", "kv_tbps"])
        for a in anchors:
            w.writerow([a["anchor"], a["nk"], a["flush"], a["ctas"], a["us"],
                        a.get("kv_tbps", "")])

    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"cuDNN {torch.backends.cudnn.version()}")
    print(f"# D2D copy (torch clone of 4 GiB, read + write): {d2d:.2f} TB/s before, "
          f"{d2d_after:.2f} TB/s after the torch runs")
    print("# all configurations of ours (us, K/V TB/s):")
    for r in rows:
        print(f"#   nk={r['nk']} page={r['page_bytes'] >> 10} KiB ({r['page_rows']} rows) "
              f"splits={r['splits']}{' (forced)' if r['forced_splits'] else ''} "
              f"merge={merge(r)} ctas={r['ctas']} flush={r['flush']}: {r['us']:.1f} us, {r['kv_tbps']:.2f} TB/s")
    print("# roofline anchors (read-only kernels over the same pool; us, K/V TB/s):")
    for a in anchors:
        rate = f", {a['kv_tbps']:.2f} TB/s" if "kv_tbps" in a else ""
        print(f"#   nk={a['nk']} {a['anchor']} ctas={a['ctas']} flush={a['flush']}: "
              f"{a['us']:.1f} us{rate}")
    print("| Nk | page | splits | merge |" + (" before us |" if before else "") +
          " ours us | ours TB/s | % of D2D | read anchor us (TB/s) | ours / anchor | "
          "flash us (TB/s) | cudnn us (TB/s) | ours / faster torch |")
    print("|---|---|---|---|" + ("---|" if before else "") + "---|---|---|---|---|---|---|---|")
    for nk in nks:
        planned = [r for r in rows
                   if r["nk"] == nk and not r["forced_splits"] and r["flush"] == "memset"]
        anchor = best_anchor(anchors, nk, "memset")
        anchor_us = anchor["us"] if anchor else float("nan")
        for r in planned:
            (fu, fhow), (cu, chow) = ref[nk]["flash"], ref[nk]["cudnn"]
            best = min(x for x in (fu, cu) if x == x) if (fu == fu or cu == cu) else float("nan")
            note = lambda how: "" if how == "enable_gqa" else f" [{how}]"
            was = before.get((nk, r["page_bytes"]), float("nan"))
            print(f"| {nk} | {r['page_bytes'] >> 10} KiB | {r['splits']} | {merge(r)} | "
                  + (f"{was:.1f} | " if before else "") + f"{r['us']:.1f} | "
                  f"{r['kv_tbps']:.2f} | {100 * r['kv_tbps'] / d2d:.0f}% | "
                  f"{anchor_us:.1f} ({kv_bytes(nk) / anchor_us / 1e6:.2f}) | "
                  f"{anchor_us / r['us']:.2f}x | "
                  f"{fu:.1f} ({kv_bytes(nk) / fu / 1e6:.2f}){note(fhow)} | "
                  f"{cu:.1f} ({kv_bytes(nk) / cu / 1e6:.2f}){note(chow)} | {best / r['us']:.2f}x |")

    print()
    print("After a flush that leaves the L2 clean (memset, then a read of the same 256 MiB):")
    print("| Nk | page | merge | ours us | ours TB/s | read anchor us (TB/s) | ours / anchor | "
          "empty kernel us |")
    print("|---|---|---|---|---|---|---|---|")
    for nk in nks:
        anchor = best_anchor(anchors, nk, "clean")
        anchor_us = anchor["us"] if anchor else float("nan")
        empty = [a["us"] for a in anchors
                 if a["nk"] == nk and a["flush"] == "clean" and a["anchor"] == "empty"]
        for r in rows:
            if r["nk"] != nk or r["forced_splits"] or r["flush"] != "clean":
                continue
            print(f"| {nk} | {r['page_bytes'] >> 10} KiB | {merge(r)} | {r['us']:.1f} | "
                  f"{r['kv_tbps']:.2f} | "
                  f"{anchor_us:.1f} ({kv_bytes(nk) / anchor_us / 1e6:.2f}) | "
                  f"{anchor_us / r['us']:.2f}x | {empty[0] if empty else float('nan'):.1f} |")


if __name__ == "__main__":
    main()
