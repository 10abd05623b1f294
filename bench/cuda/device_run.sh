#!/usr/bin/env bash
# One full pass on a GPU host, from a bundle made by scripts/bundle_device.sh .device
# (cuda_kernel_tests, cuda_attention_bench, and optionally attention_server + attn_client,
# cuda_paged_kv_tests, cuda_pipeline_tests, cuda_device_loss_tests, sessions_tests,
# client_session_tests, shared_memory_tests, request_ring_tests): tests,
# compute-sanitizer memcheck and racecheck on a small filter, the session, shared-memory and
# request-ring end-to-end suites against --backend=cuda (streams on the callback API and polled), torch CUDA
# tensors through CUDA regions (bench/torch/cuda_regions_check.py, with the Python stubs in GEN,
# default build/tests/python/gen), the server checked with the client, then the benchmark beside
# torch SDPA and FlashAttention-3 (tables last), and with either part the SASS check of the
# sm_90a kernels (sass_check.sh, sass.log). Logs and plots go to $OUT.
#   bench/cuda/device_run.sh [tests|bench|all]
# VARIANT=NAME forces the benchmark's forward kernel variant (run_bench.py --variant);
# BENCH_WHAT=grid|fp8|all (default all) limits the benchmark's rows (run_bench.py --what), and
# BENCH_N="1024 ..." / BENCH_D="128 ..." to those sequence lengths / head dims (--n, --d);
# CONFIRM=K re-times close rows K times (default 5; 0 skips it); SASS_REQUIRE=PATTERN makes the
# SASS check fail when a kernel named PATTERN lacks HGMMA or UTMALDG.
# FlashAttention-3 comes from the fa3-fwd wheel in .whl/ (docs/gpu-host.md: carry .whl
# with .device); without it the FA3 columns are NaN.
set -uo pipefail
what=${1:-all}
out=${OUT:-/tmp/out}
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD/.device/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
bin=$PWD/.device/bin
summary=()
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader

if [[ $what == tests || $what == all ]]; then
  "$bin/cuda_kernel_tests" --gtest_brief=1 >"$out/tests.log" 2>&1
  summary+=("cuda_kernel_tests: rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$out/tests.log" | tr '\n' ' ')")
  grep -E "^\[  FAILED|Failure|rel|seed" "$out/tests.log" | head -40
  filter='*n65_d256_causal*:*varlen_causal*:*gqa8_causal_bshd*:*window_both*:*n129_causal*:*prime17_d7*:*top_left_causal_nq129*'
  # Plus Hopper cases where a persistent CTA runs several work tiles (the D = 128 causal ones):
  # racecheck found an unordered shared read there (2026-12-02) that the cases above never hit.
  filter+=':*d128*causal*wgmma*'
  for tool in memcheck racecheck; do
    compute-sanitizer --tool $tool --error-exitcode 9 "$bin/cuda_kernel_tests" \
      --gtest_brief=1 --gtest_filter="$filter" >"$out/sanitizer_$tool.log" 2>&1
    summary+=("compute-sanitizer $tool: rc=$? $(grep -E '(ERROR|RACECHECK) SUMMARY' "$out/sanitizer_$tool.log" | tr '\n' ' ' )")
  done
  for t in cuda_paged_kv_tests cuda_pipeline_tests cuda_device_loss_tests; do
    [[ -x $bin/$t ]] || continue
    "$bin/$t" --gtest_brief=1 >"$out/$t.log" 2>&1
    summary+=("$t: rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$out/$t.log" | tr '\n' ' ')")
    grep -E "^\[  FAILED|Failure|seed" "$out/$t.log" | head -20
  done
  # The end-to-end suites that start their own server, pointed at the CUDA backend, with the
  # streams on gRPC's callback API and on the polled transport (--poll_streams).
  for t in sessions_tests client_session_tests shared_memory_tests request_ring_tests; do
    [[ -x $bin/$t && -x $bin/attention_server ]] || continue
    for flags in "--backend=cuda" "--backend=cuda --poll_streams"; do
      log=$out/$t${flags#--backend=cuda}.log
      ATTENTION_E2E_SERVER=$bin/attention_server ATTENTION_E2E_EXTRA_FLAGS=$flags \
        "$bin/$t" --gtest_brief=1 >"$log" 2>&1
      summary+=("$t on $flags: rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$log" | tr '\n' ' ')")
      grep -E "^\[  FAILED|Failure|seed" "$log" | head -20
    done
  done
  # torch CUDA tensors through CUDA regions (no host round trip) against a --backend=cuda server:
  # attention_client.torch beside torch's SDPA and the host path (needs torch and the stubs).
  if [[ -x $bin/attention_server && -d ${GEN:-build/tests/python/gen} ]] && python3 -c "import torch" 2>/dev/null; then
    OUT=$out python3 bench/torch/cuda_regions_check.py "$bin" >"$out/cuda_regions_check.log" 2>&1
    summary+=("cuda_regions_check.py: rc=$? $(tail -1 "$out/cuda_regions_check.log")")
    grep -E "^FAIL|^seed" "$out/cuda_regions_check.log" | head -20
  fi
  if [[ -x $bin/attention_server && -x $bin/attn_client ]]; then
    rm -f /tmp/ports
    "$bin/attention_server" --backend=cuda --port=0 --metrics_port=0 --port_file=/tmp/ports \
      >"$out/server.log" 2>&1 &
    server=$!
    for _ in $(seq 100); do [[ -s /tmp/ports ]] && break; sleep 0.1; done
    port=$(cut -d' ' -f1 /tmp/ports)
    for args in "--dtype=float32 --shape=2,4,300,64" "--dtype=float16 --shape=2,8,1000,128 --causal --lse" \
                "--dtype=bfloat16 --shape=1,8,777,256 --kv_heads=2 --layout=bshd" \
                "--dtype=float16 --shape=1,4,129,40 --nk=300 --window_left=20 --window_right=0 --lse" \
                "--dtype=bfloat16 --shape=2,8,200,128 --nk=500 --kv_heads=2 --causal --mask_alignment=top_left --lse" \
                "--dtype=float8_e4m3 --shape=2,8,300,128 --nk=500 --kv_heads=2 --causal --lse --q_descale=0.37 --k_descale=1.7 --v_descale=0.011" \
                "--dtype=float8_e4m3 --shape=1,4,129,40 --nk=300 --window_left=20 --window_right=0 --lse --v_descale=3.3"; do
      if "$bin/attn_client" --target=localhost:$port --check $args >>"$out/client.log" 2>&1; then r=pass; else r=FAIL; fi
      summary+=("attn_client --check $args: $r")
    done
    "$bin/attn_client" --target=localhost:$port --info >>"$out/client.log" 2>&1
    kill "$server"; wait "$server"
  fi
fi

if [[ $what == bench || $what == all ]]; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    if python3 -m pip install -q --upgrade --no-index --no-deps --target /tmp/site .whl/*.whl \
        >"$out/fa3_install.log" 2>&1; then
      export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    else
      summary+=("FA3 wheel: install failed, FA3 columns NaN (fa3_install.log)")
    fi
  else
    summary+=("FA3 wheel: no .whl/*.whl, FA3 columns NaN")
  fi
  PYTHONUNBUFFERED=1 python3 bench/cuda/run_bench.py "$bin/cuda_attention_bench" --out "$out" \
    --what "${BENCH_WHAT:-all}" --confirm "${CONFIRM:-5}" ${VARIANT:+--variant "$VARIANT"} \
    ${BENCH_N:+--n $BENCH_N} ${BENCH_D:+--d $BENCH_D} >"$out/bench.log" 2>&1
  summary+=("bench: rc=$?")
fi

# The instructions the sm_90a kernels were built with (the benchmark's binary holds every forward
# kernel of the library), whatever part ran.
if [[ -x $bin/cuda_attention_bench ]]; then
  bench/cuda/sass_check.sh ${SASS_REQUIRE:+--require-hgmma "$SASS_REQUIRE"} \
    "$bin/cuda_attention_bench" >"$out/sass.log" 2>&1
  summary+=("sass_check.sh cuda_attention_bench: rc=$? $(grep -E '^(sm_90a kernels|require)' "$out/sass.log" | tr '\n' ' ')")
fi

printf '%s\n' "${summary[@]}"
[[ -f $out/bench.log ]] && grep -E "^\||^GPU|#" "$out/bench.log"
exit 0
