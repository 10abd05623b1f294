#!/usr/bin/env python3
"""Runs cuda_attention_bench beside torch SDPA and FlashAttention-3 on the same shapes, in the same
process tree.

  python3 bench/cuda/run_bench.py BENCH_BINARY [--out DIR] [--what grid|fp8|all] [--confirm K]
                                  [--variant NAME] [--n N ...] [--d D ...] [--dry-run]

--what grid (part of all, the default): every shape of the FlashAttention grid (float16 and
bfloat16, D in {64,128,256}, N in {512..16384}, B = 16384/N, H = 2048/D, causal and not) timed
with torch's FLASH_ATTENTION and CUDNN_ATTENTION backends and with FlashAttention-3 (bfloat16
rows only: the fa3-fwd wheel has float16 compiled out), plus the float32 rows against
EFFICIENT_ATTENTION in float32.
--what fp8 (part of all): float8 e4m3 inputs, D in {128, 256}, N in {1024, 4096, 16384}, causal
and not, ours (descales 1, o in bfloat16) against FlashAttention-3's fp8 forward (descale tensors
of ones).

Every anchor is timed with triton.testing.do_bench (median, warm-up 25 ms, rep 100 ms) on fresh
random normal inputs: BHSD for SDPA; for FA3 the same drawn BHSD and made BSHD-contiguous (its
layout) before timing, so the transpose is not timed; float8 inputs are bfloat16 normals rounded
to torch.float8_e4m3fn. Our kernel's median comes from the binary's JSON line, one shape at a time
(`one`) just before that row's anchors, so both run in the card's same power state. The run prints one
table per part with the ratios ours/flash, ours/cuDNN and ours/FA3, a table of the issue's targets
(the lowest ratio and the rows below each bound), and writes DIR/cuda_bench.csv and
DIR/flash_grid.png (TFLOP/s vs N, one panel per (head dim, mask), two more panel rows for fp8).
TFLOP/s = 4 B H N^2 D / time, halved when causal. A column without a number is NaN.

FlashAttention-3 is `from fa3_fwd_interface import flash_attn_func` (the fa3-fwd wheel on
PYTHONPATH), checked first per dtype on small inputs against SDPA's math backend; when it cannot
be imported or a dtype fails its check, one line '# FA3 unavailable...' says why and those FA3
columns are NaN.

--n and --d keep only the rows of those sequence lengths and head dims (a quick A/B of a kernel
change on the rows it targets; the targets table then covers only those rows).

--variant NAME forces our forward kernel variant (e.g. mma_sm80; default: the planner's choice);
the variant each row ran, as the binary reports it, goes into the CSV and the tables (float8 rows
served by converting to bfloat16 first say "dequant+NAME").

With --confirm K, every target row (float16/bfloat16, D 64 or 128, N >= 1024) whose ratio to
FLASH_ATTENTION is below 1.03 is timed K more times, ours and FLASH_ATTENTION alternately (so
clock drift over the long grid run touches both alike), and a second table gives the medians.

--dry-run lists the rows and the columns each would get, and checks the FA3 import, without
timing anything (no GPU needed; the binary is run with --list).
"""
import argparse
import csv
import json
import math
import os
import statistics
import subprocess
import time

NAN = float("nan")
# The timed columns: key in a row, its header.
ANCHORS = (("flash", "flash"), ("cudnn", "cudnn"), ("fa3", "FA3"))
# Issue targets: (label, rows it covers, anchor, bound).
TARGETS = (
    ("ours/cudnn >= 1.0, bf16+fp16, N >= 1024",
     lambda r: r["dtype"] in ("bfloat16", "float16") and r["N"] >= 1024, "cudnn", 1.0),
    ("ours/FA3 >= 0.9, bf16, N >= 1024",
     lambda r: r["dtype"] == "bfloat16" and r["N"] >= 1024, "fa3", 0.9),
    ("ours/FA3-fp8 >= 0.8, fp8", lambda r: r["dtype"] == "float8_e4m3", "fa3", 0.8),
)


def ours(binary, variant, *which):
    forced = ["--variant", variant] if variant else []
    out = subprocess.run([binary, *forced, *which], check=True, capture_output=True,
                         text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def ours_row(binary, variant, row):
    """Times our kernel on one row (`one`), just before that row's anchors: so ours and the anchors
    run with the card in the same power state. (The binary's whole grid back to back held the
    700 W cap and ran at 1470-1800 MHz instead of 1980: D = 256, N = 4096 took 0.945 ms in the
    grid against 0.778 ms alone, 2026-12-01.)"""
    result = ours(binary, variant, "one", row["dtype"], str(row["d"]), str(row["N"]),
                  "true" if row["causal"] else "false")[0]
    row.update(result)
    row["ours"] = row.pop("TFLOPs")


def tflops(row, ms):
    b, h, n, d = row["B"], row["H"], row["N"], row["d"]
    return 4.0 * b * h * n * n * d / (2 if row["causal"] else 1) / ms / 1e9


def timed_tflops(row, name, make_fn, errors):
    """TFLOP/s of the callable make_fn() returns (it draws the inputs), as do_bench's median; NaN
    with one line naming the row when `errors` (exception types) are raised."""
    import triton.testing
    try:
        fn = make_fn()
        fn()
        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    except errors as e:  # backend unavailable for this shape
        print(f"# {name} failed on {row}: {e}".splitlines()[0])
        return NAN
    finally:
        fn = None  # frees the inputs
    return tflops(row, ms)


def randn_bhsd(row, dtype):
    import torch
    return [torch.randn(row["B"], row["H"], row["N"], row["d"], device="cuda", dtype=dtype)
            for _ in range(3)]


def torch_dtype(name):
    import torch
    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
            "float8_e4m3": torch.float8_e4m3fn}[name]


def sdpa_tflops(row, backend):
    import torch
    from torch.nn.attention import sdpa_kernel

    def make():
        q, k, v = randn_bhsd(row, torch_dtype(row["dtype"]))
        return lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=row["causal"])
    with sdpa_kernel(backend):
        return timed_tflops(row, backend, make, RuntimeError)


def fa3_inputs(row):
    """q, k, v as FA3 takes them ([B, N, H, D] contiguous; float8 rows as float8_e4m3fn drawn in
    bfloat16) and the keyword arguments of the call (descale tensors of ones, [B, H_kv], for
    float8)."""
    import torch
    fp8 = row["dtype"] == "float8_e4m3"
    q, k, v = (t.transpose(1, 2).contiguous() for t in
               randn_bhsd(row, torch.bfloat16 if fp8 else torch_dtype(row["dtype"])))
    kwargs = {"causal": row["causal"]}
    if fp8:
        q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
        ones = torch.ones(row["B"], row["H"], device="cuda", dtype=torch.float32)
        kwargs.update(q_descale=ones, k_descale=ones, v_descale=ones)
    return q, k, v, kwargs


def fa3_out(result):
    """FA3's o, whether the call returned o or (o, lse)."""
    return result[0] if isinstance(result, (tuple, list)) else result


def fa3_tflops(row, fa3):
    """FA3's TFLOP/s on the row; NaN when `fa3` (load_fa3) has no function for its dtype (float16:
    compiled out of the wheel)."""
    if row["dtype"] not in fa3:
        return NAN

    def make():
        q, k, v, kwargs = fa3_inputs(row)
        return lambda: fa3[row["dtype"]](q, k, v, **kwargs)
    # FA3 raises RuntimeError from its C++ checks, but also ValueError/TypeError/AssertionError
    # from its Python side; none of them should stop the run.
    return timed_tflops(row, "FA3", make, Exception)


def load_fa3():
    """FA3's flash_attn_func for each dtype (bfloat16, float8_e4m3) whose check on small inputs
    against SDPA's math backend passes: {dtype: function}, with one '# FA3 unavailable: ...' line
    for what cannot be used (the whole wheel, or one dtype)."""
    try:
        import importlib.metadata
        import torch
        from fa3_fwd_interface import flash_attn_func
        from torch.nn.attention import SDPBackend, sdpa_kernel
        version = importlib.metadata.version("fa3-fwd")
    except Exception as e:  # missing wheel, missing torch, ABI mismatch
        print(f"# FA3 unavailable: {type(e).__name__}: {e}".splitlines()[0])
        return {}
    # A sanity check (a wrong layout or scale is off by O(1)), bounded by the worst case of the
    # roundings: P rounded to bf16 (2^-9 relative) or to e4m3 (2^-4) moves o by at most that
    # times max |v| (~5 here), plus o's bf16 rounding (<= 2^-5 / 2 below 8).
    bounds = {"bfloat16": 0.05, "float8_e4m3": 0.35}
    usable = {}
    for dtype, bound in bounds.items():
        try:
            row = {"B": 2, "H": 4, "N": 384, "d": 128, "causal": True, "dtype": dtype}
            torch.manual_seed(1)
            q, k, v, kwargs = fa3_inputs(row)
            o = fa3_out(flash_attn_func(q, k, v, **kwargs)).float()
            # The reference sees the values FA3 saw: float8 and bfloat16 values are exact in fp32.
            with sdpa_kernel(SDPBackend.MATH):
                ref = torch.nn.functional.scaled_dot_product_attention(
                    *(t.float().transpose(1, 2) for t in (q, k, v)), is_causal=True)
            err = (o - ref.transpose(1, 2)).abs().max().item()
            if not err < bound:
                raise RuntimeError(f"max |o - SDPA math| {err:.3g} >= {bound}")
            print(f"# FA3 {dtype}: fa3-fwd {version}, max |o - SDPA math| {err:.3g}")
            usable[dtype] = flash_attn_func
        except Exception as e:  # FA3's C++ checks raise RuntimeError, its Python side others
            print(f"# FA3 unavailable for {dtype}: {type(e).__name__}: {e}".splitlines()[0])
    return usable


def ratio(row, key):
    a = row.get(key, NAN)
    return row["ours"] / a if a and not math.isnan(a) else NAN


def write_csv(rows, path):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["dtype", "d", "N", "B", "H", "causal", "variant", "ours", "flash", "cudnn",
                    "fa3", "efficient"])
        for r in rows:
            w.writerow([r["dtype"], r["d"], r["N"], r["B"], r["H"], r["causal"], r["variant"],
                        r["ours"], *(r.get(k, "") for k in ("flash", "cudnn", "fa3", "efficient"))])


def print_table(rows, keys):
    """One markdown table: the shape, ours, the anchors in `keys` and ours/each."""
    names = dict(ANCHORS, efficient="torch EFFICIENT fp32")
    print("| dtype | D | N | B | H | causal | variant | ours TFLOP/s | "
          + " | ".join(names[k] for k in keys) + " | "
          + " | ".join(f"ours/{names[k]}" for k in keys) + " |")
    print("|---" * (8 + 2 * len(keys)) + "|")
    for r in rows:
        print(f"| {r['dtype']} | {r['d']} | {r['N']} | {r['B']} | {r['H']} | {r['causal']} | "
              f"{r['variant']} | {r['ours']:.1f} | "
              + " | ".join(f"{r[k]:.1f}" for k in keys) + " | "
              + " | ".join(f"{ratio(r, k):.2f}" for k in keys) + " |")


SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float8_e4m3": "fp8", "float32": "fp32"}


def print_targets(rows, shown=6):
    """The issue's targets: for each, the lowest ratio over the rows it covers that have the
    anchor, and how many rows are below the bound (the lowest `shown` of them named)."""
    print("| target | rows with the anchor | lowest ratio | rows below |")
    print("|---|---|---|---|")
    for label, covers, key, bound in TARGETS:
        have = [r for r in rows if covers(r) and not math.isnan(ratio(r, key))]
        if not have:
            print(f"| {label} | 0 | - | - |")
            continue
        below = sorted((r for r in have if ratio(r, key) < bound), key=lambda r: ratio(r, key))
        names = ", ".join(f"{SHORT_DTYPE[r['dtype']]} D{r['d']} N{r['N']}"
                          f"{' causal' if r['causal'] else ''} {ratio(r, key):.2f}"
                          for r in below[:shown])
        more = f", {len(below) - shown} more" if len(below) > shown else ""
        print(f"| {label} | {len(have)} | {min(ratio(r, key) for r in have):.2f} | {len(below)}"
              f"{': ' + names + more if below else ''} |")


def plot(grid, fp8, path, gpu):
    """TFLOP/s vs N: a panel per (head dim, mask) for the 16-bit grid (solid bfloat16, dashed
    float16), then two panel rows for float8 (ours vs FA3 fp8); lines without numbers are left
    out, panels without rows are blank."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    dims = sorted({r["d"] for r in grid + fp8})
    parts = [(grid, (("bfloat16", "-"), ("float16", "--")))] if grid else []
    if fp8:
        parts.append((fp8, (("float8_e4m3", "-"),)))
    fig, axes = plt.subplots(2 * len(parts), len(dims), figsize=(5 * len(dims), 4 * 2 * len(parts)),
                             squeeze=False)
    colors = {"ours": "C0", "flash": "C1", "cudnn": "C2", "fa3": "C3"}
    for part_i, (rows, styles) in enumerate(parts):
        legend_drawn = False
        for col, d in enumerate(dims):
            for mask_i, causal in enumerate([False, True]):
                ax = axes[2 * part_i + mask_i][col]
                drawn = False
                for dt, style in styles:
                    sel = sorted((r for r in rows if r["d"] == d and r["causal"] == causal
                                  and r["dtype"] == dt), key=lambda r: r["N"])
                    for key, color in colors.items():
                        ys = [r.get(key, NAN) for r in sel]
                        if all(math.isnan(y) for y in ys):
                            continue
                        label = "FA3" if key == "fa3" else key
                        ax.plot([r["N"] for r in sel], ys, style, color=color, marker="o",
                                label=f"{label} {dt}")
                        drawn = True
                if not drawn:
                    ax.axis("off")
                    continue
                ax.set_xscale("log", base=2)
                ax.set_title(f"{styles[0][0] if len(styles) == 1 else '16-bit'} D={d} "
                             f"{'causal' if causal else 'non-causal'}")
                ax.set_xlabel("N (B=16384/N, H=2048/D)")
                ax.set_ylabel("TFLOP/s")
                ax.grid(True, alpha=0.3)
                if not legend_drawn:  # the part's first panel has every line of the part
                    ax.legend(fontsize=7)
                    legend_drawn = True
    fig.suptitle(f"attention forward on {gpu}: ours vs torch SDPA and FlashAttention-3")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def dry_run(args, parts, listed):
    fa3 = load_fa3()
    for part in parts:
        for which in {"grid": ("grid", "fp32"), "fp8": ("fp8",)}[part]:
            rows = listed("--list", which)
            print(f"# {which}: {len(rows)} rows")
            for r in rows:
                cols = (["efficient"] if r["dtype"] == "float32"
                        else ["fa3"] if r["dtype"] == "float8_e4m3" else ["flash", "cudnn", "fa3"])
                if "fa3" in cols and r["dtype"] not in fa3:
                    cols[cols.index("fa3")] = "fa3 (NaN: unavailable for this dtype)"
                print(f"{r['dtype']} D={r['d']} N={r['N']} B={r['B']} H={r['H']} "
                      f"causal={r['causal']}: ours, {', '.join(cols)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--what", choices=("grid", "fp8", "all"), default="all")
    ap.add_argument("--confirm", type=int, default=0)
    ap.add_argument("--variant", default=None)
    ap.add_argument("--n", type=int, nargs="+", default=None)
    ap.add_argument("--d", type=int, nargs="+", default=None)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    parts = ("grid", "fp8") if args.what == "all" else (args.what,)

    def listed(*which):
        return [r for r in ours(args.binary, args.variant, *which)
                if (args.n is None or r["N"] in args.n) and (args.d is None or r["d"] in args.d)]
    if args.dry_run:
        dry_run(args, parts, listed)
        return

    import torch
    from torch.nn.attention import SDPBackend
    torch.manual_seed(0)
    fa3 = load_fa3()
    started = time.monotonic()
    grid, fp32, fp8 = [], [], []
    if "grid" in parts:
        grid = listed("--list", "grid")
        for r in grid:
            ours_row(args.binary, args.variant, r)
            r["flash"] = sdpa_tflops(r, SDPBackend.FLASH_ATTENTION)
            r["cudnn"] = sdpa_tflops(r, SDPBackend.CUDNN_ATTENTION)
            r["fa3"] = fa3_tflops(r, fa3)
        fp32 = listed("fp32")
        for r in fp32:
            r["ours"] = r.pop("TFLOPs")
            r["efficient"] = sdpa_tflops(r, SDPBackend.EFFICIENT_ATTENTION)
    grid_s = time.monotonic() - started
    if "fp8" in parts:
        fp8 = listed("--list", "fp8")
        for r in fp8:
            ours_row(args.binary, args.variant, r)
            r["flash"] = r["cudnn"] = NAN  # SDPA takes no float8
            r["fa3"] = fa3_tflops(r, fa3)
    fp8_s = time.monotonic() - started - grid_s

    write_csv(grid + fp8 + fp32, os.path.join(args.out, "cuda_bench.csv"))
    gpu = torch.cuda.get_device_name()
    plot(grid, fp8, os.path.join(args.out, "flash_grid.png"), gpu)
    print(f"GPU: {gpu}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    if grid:
        print_table(grid, ("flash", "cudnn", "fa3"))
        print_table(fp32, ("efficient",))
    if fp8:
        print_table(fp8, ("fa3",))
    print_targets(grid + fp8)
    if args.confirm and grid:
        confirm(args.binary, args.variant, grid, args.confirm)
    print(f"# timed in {time.monotonic() - started:.0f} s (grid and fp32 {grid_s:.0f} s, "
          f"fp8 {fp8_s:.0f} s, the rest confirm)")


def confirm(binary, variant, rows, times):
    from torch.nn.attention import SDPBackend
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
            flash_runs.append(sdpa_tflops(r, SDPBackend.FLASH_ATTENTION))
        o, f = statistics.median(ours_runs), statistics.median(flash_runs)
        print(f"| {r['dtype']} | {r['d']} | {r['N']} | {r['causal']} | {r['variant']} | {o:.1f} | "
              f"{f:.1f} | {o / f:.2f} |")


if __name__ == "__main__":
    main()
