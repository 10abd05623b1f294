#!/usr/bin/env python3
"""attention_client.torch on CUDA tensors through CUDA regions (no host round trip), on a GPU host:
starts attention_server --backend=cuda --allow_shared_memory from BIN_DIR and checks

1. the SDPA drop-in (scaled_dot_product_attention) on CUDA tensors against a float64 torch
   reference (relative error within the API's bounds: 1e-5 float32, 1e-2 float16/bfloat16; torch's
   own SDPA is measured beside it), over causal and not, GQA, Nq != Nk, leading dims, every dtype
   the server serves, and that it equals, bit for bit, the same call through the host path
   (Client(cuda_regions="off")); flash_attn_func (windows, LSE), flash_attn_varlen_func (LSE)
   and a V holding NaN and Inf outside rows' windows the same way;
2. that no byte went through the host: the server reports h2d_us == 0 and d2h_us == 0 for a call
   computed in place, the answer carries no tensor bytes, and repeated calls register no new
   region (the segment cache);
3. packed Steps (Client.step_batch) of CUDA tensors in stream order: the inputs written by the
   current stream behind a long GPU sleep (the server must wait for the caller's event, not read
   them early), o and lse read by the current stream at once (the caller must wait for the
   server's event), bit for bit equal to the same Steps through the host path (given host
   tensors, and given CUDA views written behind a GPU sleep, which the host path copies to host
   after the stream's work), every dtype, three steps over ragged sessions, with no host copy in
   the server's timing; then three more ordered
   by counters and posted on the ring without waiting for the answer; and a ready_counter the
   caller never writes, which the server writes itself after --stream_wait_timeout_s, and a
   ready_event that completes only after it, which the server's stream stops waiting for;
4. attention_client.transformers' RemoteCache on CUDA tensors (where transformers is installed):
   a tiny Llama's and a tiny DeepSeek-V3's decode Steps (MLA: the latent in sessions of v_from_k,
   k alone sent) posted on the ring in stream order, the tokens and logits of the host path bit
   for bit, and a session dropped behind its back failing the forward that steps it;
5. a timing table, per call (median of 20, after warm-up): CUDA regions, the host path and local
   torch SDPA, for a decode-like and a prefill-like shape.

    python3 bench/torch/cuda_regions_check.py [BIN_DIR]       # default .device/bin
Stubs: GEN (default build/tests/python/gen) on PYTHONPATH, or an installed attention_client.
--device=cpu runs the checks of 1 through the host path only (a CPU-only machine, --backend=cpu).
Exit status 0 when every check passed. About 40 s on an H200.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [os.path.join(ROOT, "client", "python"),
                os.path.join(ROOT, os.environ.get("GEN", "build/tests/python/gen"))]

import grpc  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import attention_client  # noqa: E402
from attention_client import torch as remote  # noqa: E402
from attention_client._stubs import attention_pb2 as pb  # noqa: E402

BOUND = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
STREAM_WAIT_TIMEOUT_S = 2  # the server's bound on a wait for a caller's ready_counter or event
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def rel(x, ref):
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


def same_bits(a, b):
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.float32:
        return bool(torch.equal(a.view(torch.int32), b.view(torch.int32)))
    return bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))


def start_server(bin_dir, backend, log_path):
    env = dict(os.environ)
    lib = os.path.join(os.path.dirname(os.path.abspath(bin_dir)), "lib")
    if os.path.isdir(lib):
        env["LD_LIBRARY_PATH"] = lib + (":" + env["LD_LIBRARY_PATH"]
                                        if env.get("LD_LIBRARY_PATH") else "")
    ports = tempfile.NamedTemporaryFile(delete=False).name
    os.unlink(ports)
    log = open(log_path, "w")
    server = subprocess.Popen(
        [os.path.join(bin_dir, "attention_server"), f"--backend={backend}", "--host=127.0.0.1",
         "--port=0", "--metrics_port=0", f"--port_file={ports}", "--allow_shared_memory",
         "--max_message_mb=2047", f"--stream_wait_timeout_s={STREAM_WAIT_TIMEOUT_S}"],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 60
    while not (os.path.exists(ports) and open(ports).read().strip()):
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            sys.exit(f"attention_server did not start; see {log_path}")
        time.sleep(0.1)
    return server, int(open(ports).read().split()[0])


def sdpa_grid(device, on_gpu, direct, host, dtypes):
    gen = torch.Generator(device="cpu").manual_seed(int.from_bytes(os.urandom(4), "little"))
    print(f"seed {gen.initial_seed()}")
    # (lead dims, Hq, Hkv, Nq, Nk, E)
    shapes = [((2,), 8, 8, 128, 128, 64), ((1,), 32, 8, 77, 300, 128), ((2, 3), 4, 2, 129, 65, 96),
              ((1,), 8, 2, 1, 1000, 128), ((3,), 4, 4, 200, 520, 40)]
    for dtype in dtypes:
        for lead, hq, hkv, nq, nk, e in shapes:
            for causal in (False, True):
                q = torch.randn(*lead, hq, nq, e, generator=gen).to(device, dtype)
                k = torch.randn(*lead, hkv, nk, e, generator=gen).to(device, dtype)
                v = torch.randn(*lead, hkv, nk, e, generator=gen).to(device, dtype)
                gqa = hq != hkv
                ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                     is_causal=causal, enable_gqa=gqa)
                ours = remote.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                           enable_gqa=gqa, client=direct)
                theirs = F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                        enable_gqa=gqa)
                name = (f"sdpa {str(dtype)[6:]} lead={lead} Hq={hq} Hkv={hkv} Nq={nq} Nk={nk} "
                        f"E={e} causal={causal}")
                err = rel(ours, ref)
                check(ours.device == q.device and ours.dtype == dtype and err <= BOUND[dtype],
                      f"{name}: rel err {err:.2e} (torch's own {rel(theirs, ref):.2e})")
                if on_gpu:
                    via_host = remote.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                   enable_gqa=gqa, client=host)
                    check(same_bits(ours, via_host), f"{name}: equals the host path bit for bit")


def flash_checks(device, on_gpu, direct, host, dtypes):
    gen = torch.Generator(device="cpu").manual_seed(int.from_bytes(os.urandom(4), "little"))
    for dtype in dtypes:
        d = str(dtype)[6:]
        q = torch.randn(2, 100, 8, 64, generator=gen).to(device, dtype)
        k = torch.randn(2, 260, 2, 64, generator=gen).to(device, dtype)
        v = torch.randn(2, 260, 2, 64, generator=gen).to(device, dtype)
        o, lse, _ = remote.flash_attn_func(q, k, v, causal=True, window_size=(50, 0),
                                           return_attn_probs=True, client=direct)
        ref = flash_reference(q, k, v, left=50, right=0)
        err = rel(o, ref)
        check(err <= BOUND[dtype] and lse.is_cuda == q.is_cuda and lse.shape == (2, 8, 100),
              f"flash_attn_func {d} window (50, 0) bshd GQA, lse: rel err {err:.2e}")
        if on_gpu:
            o2, lse2, _ = remote.flash_attn_func(q, k, v, causal=True, window_size=(50, 0),
                                                 return_attn_probs=True, client=host)
            check(same_bits(o, o2) and same_bits(lse, lse2),
                  f"flash_attn_func {d}: o and lse equal the host path bit for bit")
        # Varlen, LSE [Hq, total_q].
        cu_q, cu_k = [0, 30, 31, 131], [0, 70, 200, 333]
        qv = torch.randn(131, 4, 128, generator=gen).to(device, dtype)
        kv = torch.randn(333, 2, 128, generator=gen).to(device, dtype)
        vv = torch.randn(333, 2, 128, generator=gen).to(device, dtype)
        o, lse, _ = remote.flash_attn_varlen_func(qv, kv, vv, torch.tensor(cu_q),
                                                  torch.tensor(cu_k), causal=True,
                                                  return_attn_probs=True, client=direct)
        ref = torch.cat([flash_reference(qv[None, cu_q[b]:cu_q[b + 1]],
                                         kv[None, cu_k[b]:cu_k[b + 1]],
                                         vv[None, cu_k[b]:cu_k[b + 1]], left=None, right=0)[0]
                         for b in range(3)])
        err = rel(o, ref)
        check(err <= BOUND[dtype] and lse.shape == (4, 131),
              f"flash_attn_varlen_func {d} causal, lse: rel err {err:.2e}")
        if on_gpu:
            o2, lse2, _ = remote.flash_attn_varlen_func(qv, kv, vv, torch.tensor(cu_q),
                                                        torch.tensor(cu_k), causal=True,
                                                        return_attn_probs=True, client=host)
            check(same_bits(o, o2) and same_bits(lse, lse2),
                  f"flash_attn_varlen_func {d}: o and lse equal the host path bit for bit")
        # NaN and Inf in V at keys no row sees (top-left causal, Nk > Nq) and at one key the last
        # rows see (bottom-right window): the exact path, from device memory as from the host.
        q = torch.randn(1, 4, 65, 64, generator=gen).to(device, dtype)
        k = torch.randn(1, 4, 129, 64, generator=gen).to(device, dtype)
        v = torch.randn(1, 4, 129, 64, generator=gen).to(device, dtype)
        clean = v.clone()
        v[:, :, 100] = float("nan")
        v[:, :, 120] = float("inf")
        o = remote.scaled_dot_product_attention(q, k, v, is_causal=True, client=direct)
        # The reference over the finite V (torch's math multiplies a masked key's 0 by NaN).
        ref = F.scaled_dot_product_attention(q.double(), k.double(), clean.double(),
                                             is_causal=True)
        err = rel(o, ref)
        check(bool(torch.isfinite(o).all()) and err <= BOUND[dtype],
              f"sdpa {d} causal with NaN/Inf in V outside every window: finite, rel err {err:.2e}")
        if on_gpu:
            o2 = remote.scaled_dot_product_attention(q, k, v, is_causal=True, client=host)
            check(same_bits(o, o2), f"sdpa {d} non-finite V: equals the host path bit for bit")
            # A key only some rows see (bottom-right causal: only the last row sees key 128).
            v = clean.clone()
            v[:, :, 128] = float("nan")
            qs, ks, vs = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # BSHD
            o = remote.flash_attn_func(qs, ks, vs, causal=True, client=direct)
            o2 = remote.flash_attn_func(qs, ks, vs, causal=True, client=host)
            rows_ok = bool(torch.isfinite(o[:, :64]).all()) and bool(torch.isnan(o[:, 64]).all())
            check(rows_ok and same_bits(o, o2),
                  f"flash_attn_func {d} NaN V at a key the last row sees: only that row NaN, "
                  "equal to the host path")


def flash_reference(q, k, v, left, right):
    """float64 attention of BSHD q [B, Sq, Hq, D], k, v [B, Sk, Hkv, D], masks bottom-right."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    kd = kd.repeat_interleave(hq // hkv, dim=1)
    vd = vd.repeat_interleave(hq // hkv, dim=1)
    s = qd @ kd.transpose(-1, -2) / d ** 0.5
    i = torch.arange(sq, device=q.device)[:, None] + sk - sq
    j = torch.arange(sk, device=q.device)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if left is not None:
        keep &= j >= i - left
    if right is not None:
        keep &= j <= i + right
    s = s.masked_fill(~keep, float("-inf"))
    return (torch.softmax(s, -1) @ vd).transpose(1, 2)


def no_round_trip(direct):
    q = torch.randn(2, 8, 256, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 8, 512, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 8, 512, 128, device="cuda", dtype=torch.bfloat16)
    for causal in (False, True):
        r = direct.attend(q, k, v, causal=causal, return_lse=True, return_info=True)
        t = r.timing
        check(r.o.is_cuda and r.lse.is_cuda and t.h2d_us == 0 and t.d2h_us == 0,
              f"no host round trip (causal={causal}): server h2d_us={t.h2d_us} d2h_us={t.d2h_us} "
              f"compute_us={t.compute_us:.0f}, o and lse on {r.o.device}")
    # Fresh tensors each call: the allocator reuses its blocks (after a few calls have grown its
    # pool), so no new segment and no Register.
    for _ in range(5):
        direct.attend(torch.randn_like(q), k, v, causal=True)
    before = direct._cuda_segments.registrations
    for _ in range(20):
        direct.attend(torch.randn_like(q), k, v, causal=True)
    after = direct._cuda_segments.registrations
    check(after == before, f"20 more calls registered {after - before} new regions "
          f"({after} in all, {len(direct.list_shared_memory())} on the server)")


def packed_steps_in_stream_order(direct, host, dtypes):
    gen = torch.Generator(device="cpu").manual_seed(int.from_bytes(os.urandom(4), "little"))
    print(f"seed {gen.initial_seed()}")
    b, hq, hkv, d = 6, 8, 2, 128
    lengths = [1, 17, 100, 300, 64, 1000]
    for dtype in dtypes:
        name = str(dtype)[6:]
        kv = [(torch.randn(hkv, n, d, generator=gen).to(dtype),
               torch.randn(hkv, n, d, generator=gen).to(dtype)) for n in lengths]
        on_device = [direct.session(k=k, v=v) for k, v in kv]
        via_host = [host.session(k=k, v=v) for k, v in kv]
        cuda_via_host = [host.session(k=k, v=v) for k, v in kv]
        try:
            for step in range(6):
                # Steps 0-2 by events (answered once queued); 3-5 by counters, posted on the ring
                # without waiting for the answer (step_batch(wait=False, stream="ring")).
                by = "events" if step < 3 else "counters"
                q, k1, v1 = (torch.randn(b, h, 1, d, generator=gen).to(dtype)
                             for h in (hq, hkv, hkv))
                # The inputs reach the GPU only after a ~20 ms sleep on the current stream.
                inputs = [torch.full(t.shape, float("nan"), dtype=dtype, device="cuda")
                          for t in (q, k1, v1)]
                torch.cuda.synchronize()
                torch.cuda._sleep(40_000_000)
                for dev, t in zip(inputs, (q, k1, v1)):
                    dev.copy_(t.pin_memory(), non_blocking=True)
                start = time.perf_counter()
                if by == "events":
                    r = direct.step_batch(on_device, *inputs, causal=True, return_lse=True,
                                          return_info=True)
                    o, lse = r.o.clone(), r.lse.clone()  # on the stream: after the server's
                else:
                    posted = direct.step_batch(on_device, *inputs, causal=True, return_lse=True,
                                               return_info=True, wait=False, stream="ring")
                    o, lse = posted.o.clone(), posted.lse.clone()
                answered_ms = (time.perf_counter() - start) * 1e3
                pending = not torch.cuda.current_stream().query()
                if by == "counters":
                    r = posted.result()
                want = host.step_batch(via_host, q, k1, v1, causal=True, return_lse=True,
                                       return_info=True)
                t = r.timing
                check(same_bits(o.cpu(), want.o) and same_bits(lse.cpu(), want.lse)
                      and r.lengths == want.lengths and t.h2d_us == 0 and t.d2h_us == 0,
                      f"packed Step {name} step {step} in stream order by {by}: o, lse equal the "
                      f"host path "
                      f"bit for bit, lengths {r.lengths}, server h2d_us={t.h2d_us} "
                      f"d2h_us={t.d2h_us}")
                # The host path given CUDA tensors (a Client without CUDA regions): views of one
                # projection's output as a model hands them, written behind a sleep on the
                # current stream; step_batch copies them to host after it (one pinned buffer,
                # one wait) and o, lse come back on the GPU.
                y = torch.cat([x.transpose(1, 2).reshape(b, 1, -1) for x in (q, k1, v1)], -1)
                on_gpu = torch.full(y.shape, float("nan"), dtype=dtype, device="cuda")
                torch.cuda._sleep(40_000_000)
                on_gpu.copy_(y.pin_memory(), non_blocking=True)
                views = [x.view(b, 1, -1, d).transpose(1, 2)
                         for x in on_gpu.split([hq * d, hkv * d, hkv * d], -1)]
                via_cuda = host.step_batch(cuda_via_host, *views, causal=True, return_lse=True)
                check(all(x.is_cuda and same_bits(x.cpu(), w)
                          for x, w in zip(via_cuda, (want.o, want.lse))),
                      f"packed Step {name} step {step}, CUDA views through the host path: o, lse "
                      f"on the GPU, equal the host path's of host tensors bit for bit")
                # The first Step of a shape may grow the pool's buffers, which waits for its
                # stream (not checked); later ones must not wait.
                if step % 3 > 0:
                    check(pending and answered_ms < 15,
                          f"packed Step {name} step {step} by {by}: returned in "
                          f"{answered_ms:.2f} ms, the stream still asleep: {pending}")
        finally:
            for s in on_device + via_host + cuda_via_host:
                s.drop()


def remote_cache_in_stream_order(direct, host):
    """attention_client.transformers' RemoteCache on CUDA tensors: a tiny Llama and a tiny
    DeepSeek-V3 (MLA: its latent in sessions of v_from_k; random weights, float32) generate
    through register()'s attention with their K/V in sessions, each decode layer's
    packed Step posted on the ring in stream order without waiting (client._step_rings opened),
    the same tokens and logits bit for bit as the same cache through the host path; then a
    session dropped behind the cache's back fails the next forward with the server's refusal
    (raised in that forward, not later, and no hang). Skipped where transformers is missing."""
    try:
        import transformers
        from attention_client import transformers as remote_tf
    except ImportError as e:
        print(f"SKIP RemoteCache in stream order: {e}")
        return
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2, initializer_range=0.2)
    ids = torch.randint(0, 96, (3, 11), generator=torch.Generator().manual_seed(7)).cuda()
    configs = [("Llama", config)]
    if hasattr(transformers, "DeepseekV3Config"):
        # MLA: the latent in sessions of v_from_k (k alone in each Step) where the server lists it.
        configs.append(("DeepSeek-V3", transformers.DeepseekV3Config(
            vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, initializer_range=0.2,
            moe_intermediate_size=32, first_k_dense_replace=1, n_routed_experts=4,
            num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=32, q_lora_rank=None,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=8)))
    for family, config in configs:
        results = {}
        for name, client in (("direct", direct), ("host", host)):
            config._attn_implementation = remote_tf.register(client)
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(config).float().eval().cuda()
            with remote_tf.RemoteCache(client, config) as cache:
                out = model.generate(ids, max_new_tokens=8, do_sample=False, past_key_values=cache,
                                     output_logits=True, return_dict_in_generate=True)
                results[name] = (out.sequences.cpu(), torch.stack(out.logits).cpu())
                latent = [s.v_from_k for s in cache._shared.sessions]
            if name == "direct":
                check(bool(client._step_rings), f"RemoteCache on CUDA tensors ({family}): its "
                      "decode Steps went through the request ring")
        if family == "DeepSeek-V3":
            check(all(latent), "RemoteCache (DeepSeek-V3): the latent kept once (v_from_k)")
        (tokens, logits), (want_tokens, want_logits) = results["direct"], results["host"]
        check(torch.equal(tokens, want_tokens) and same_bits(logits, want_logits),
              f"RemoteCache in stream order ({family}): the tokens and logits of the host path, "
              "bit for bit")
    config = configs[0][1]
    # A session gone from under the cache: the next decode forward raises NOT_FOUND.
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval().cuda()
    cache = remote_tf.RemoteCache(direct, config)
    raised = []

    def forward():
        try:
            with torch.no_grad():
                first = model(ids, past_key_values=cache, use_cache=True)
                direct._call(direct._sessions_stub.DropSession,
                             pb.DropSessionRequest(session_id=cache.session_ids[0]), None, None)
                model(first.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
                torch.cuda.synchronize()
        except attention_client.AttentionError as e:
            raised.append(e)

    thread = threading.Thread(target=forward, daemon=True)
    thread.start()
    thread.join(timeout=60)
    check(not thread.is_alive() and len(raised) == 1
          and raised[0].code == grpc.StatusCode.NOT_FOUND,
          f"RemoteCache in stream order: a dropped session fails the forward that steps it "
          f"({'hung' if thread.is_alive() else raised})")
    cache.close()


def late_ready_counter(direct):
    """A ready_counter the caller never writes: the server writes it itself after
    --stream_wait_timeout_s (so the stream serving every session goes on), and refuses the next
    Step naming that counter by name; the Step after that is served."""
    b, hq, hkv, d = 2, 4, 1, 64
    sessions = [direct.session(k=torch.randn(hkv, 5, d), v=torch.randn(hkv, 5, d))
                for _ in range(b)]
    try:
        q, k1, v1 = (torch.randn(b, h, 1, d, device="cuda") for h in (hq, hkv, hkv))
        o = torch.empty_like(q)
        counters = torch.zeros(2, dtype=torch.int64, device="cuda")
        torch.cuda.synchronize()  # zero before the server's stream looks at them
        direct._cuda_segments.ensure([q, k1, v1, o, counters])
        ready, done = counters[0:1], counters[1:2]
        start = time.perf_counter()
        direct.step_batch(sessions, q, k1, v1, causal=True, out=o, ready_counter=(ready, 7),
                          done_counter=(done, 7))
        answered = time.perf_counter() - start
        while int(done.item()) != 7 and time.perf_counter() - start < 5 * STREAM_WAIT_TIMEOUT_S:
            time.sleep(0.05)
        waited = time.perf_counter() - start
        check(int(done.item()) == 7 and
              STREAM_WAIT_TIMEOUT_S * 0.9 <= waited < STREAM_WAIT_TIMEOUT_S + 2,
              f"a ready_counter never written: answered in {answered * 1e3:.1f} ms, done written "
              f"after {waited:.2f} s (--stream_wait_timeout_s={STREAM_WAIT_TIMEOUT_S})")
        ready.fill_(8)
        try:
            direct.step_batch(sessions, q, k1, v1, causal=True, out=o, ready_counter=(ready, 8),
                              done_counter=(done, 8))
            check(False, "the Step after a timed-out ready_counter was served")
        except attention_client.AttentionError as e:
            check(e.code.name == "FAILED_PRECONDITION" and "ready_counter" in e.details,
                  f"the Step after a timed-out ready_counter: {e.code.name}: {e.details[:120]}")
        direct.step_batch(sessions, q, k1, v1, causal=True, out=o, ready_counter=(ready, 8),
                          done_counter=(done, 9))
        torch.cuda.synchronize()
        check(int(done.item()) == 9 and bool(torch.isfinite(o).all()),
              "the Step after the refusal is served")
    finally:
        for s in sessions:
            s.drop()


def late_ready_event(direct):
    """A ready_event that completes only after --stream_wait_timeout_s (recorded behind a GPU
    sleep of three times that): the server's stream goes on without it after the timeout (it serves
    every session), the next Step naming that event is refused by name, and once the event
    completed, Steps naming it are served."""
    b, hq, hkv, d = 2, 4, 1, 64
    sessions = [direct.session(k=torch.randn(hkv, 5, d), v=torch.randn(hkv, 5, d))
                for _ in range(b)]
    held = torch.cuda.Stream()
    try:
        q, k1, v1 = (torch.randn(b, h, 1, d, device="cuda") for h in (hq, hkv, hkv))
        o = torch.empty_like(q)
        direct._cuda_segments.ensure([q, k1, v1, o])
        ready, done = (torch.cuda.Event(interprocess=True) for _ in range(2))
        torch.cuda.synchronize()
        with torch.cuda.stream(held):
            torch.cuda._sleep(3 * STREAM_WAIT_TIMEOUT_S * 2_000_000_000)  # ~2 GHz
            ready.record(held)
        events = {"ready_event": ready.ipc_handle(), "done_event": done.ipc_handle()}
        start = time.perf_counter()
        direct.step_batch(sessions, q, k1, v1, causal=True, out=o, **events)
        answered = time.perf_counter() - start
        while not done.query() and time.perf_counter() - start < 5 * STREAM_WAIT_TIMEOUT_S:
            time.sleep(0.05)
        waited = time.perf_counter() - start
        check(done.query() and not ready.query() and
              STREAM_WAIT_TIMEOUT_S * 0.9 <= waited < STREAM_WAIT_TIMEOUT_S + 2,
              f"a ready_event completing after the timeout: answered in {answered * 1e3:.1f} ms, "
              f"the server went on after {waited:.2f} s, the event then still pending: "
              f"{not ready.query()} (--stream_wait_timeout_s={STREAM_WAIT_TIMEOUT_S})")
        try:
            direct.step_batch(sessions, q, k1, v1, causal=True, out=o, **events)
            check(False, "the Step after a timed-out ready_event was served")
        except attention_client.AttentionError as e:
            check(e.code.name == "FAILED_PRECONDITION" and "ready_event" in e.details,
                  f"the Step after a timed-out ready_event: {e.code.name}: {e.details[:120]}")
        held.synchronize()
        ready.record(held)
        direct.step_batch(sessions, q, k1, v1, causal=True, out=o, **events)
        done.synchronize()
        check(bool(torch.isfinite(o).all()), "the Step after the event completed is served")
    finally:
        held.synchronize()
        for s in sessions:
            s.drop()


def timing(direct, host):
    rows = []
    shapes = {"decode B=8 Hq=32 Hkv=8 Nq=1 Nk=4096 D=128": (8, 32, 8, 1, 4096),
              "prefill B=1 Hq=32 Hkv=8 N=4096 D=128": (1, 32, 8, 4096, 4096)}
    for name, (b, hq, hkv, nq, nk) in shapes.items():
        q = torch.randn(b, hq, nq, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, hkv, nk, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, hkv, nk, 128, device="cuda", dtype=torch.bfloat16)
        calls = {
            "cuda regions": lambda: remote.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True, client=direct),
            "host path": lambda: remote.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True, client=host),
            "torch sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                 enable_gqa=True),
        }
        ms = {}
        for label, call in calls.items():
            for _ in range(3):
                call()
            torch.cuda.synchronize()
            samples = []
            for _ in range(20):
                start = time.perf_counter()
                call()
                torch.cuda.synchronize()
                samples.append((time.perf_counter() - start) * 1e3)
            ms[label] = statistics.median(samples)
        rows.append((name, ms))
    print("\n| shape (bf16, causal) | cuda regions ms | host path ms | torch sdpa ms | "
          "host / regions |")
    print("|---|---|---|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms['cuda regions']:.3f} | {ms['host path']:.3f} | "
              f"{ms['torch sdpa']:.3f} | {ms['host path'] / ms['cuda regions']:.1f}x |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("bin_dir", nargs="?", default=".device/bin")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--log", default=os.path.join(os.environ.get("OUT", "/tmp"),
                                                      "cuda_regions_server.log"))
    args = parser.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.log)), exist_ok=True)
    on_gpu = args.device == "cuda"
    server, port = start_server(args.bin_dir, "cuda" if on_gpu else "cpu", args.log)
    try:
        target = f"127.0.0.1:{port}"
        with attention_client.Client(target, cuda_regions="on" if on_gpu else "off") as direct, \
                attention_client.Client(target, cuda_regions="off") as host:
            info = direct.server_info()
            served = {pb.DTYPE_FLOAT32: torch.float32, pb.DTYPE_FLOAT16: torch.float16,
                      pb.DTYPE_BFLOAT16: torch.bfloat16}
            dtypes = [served[d] for d in info.dtypes if d in served]
            print(f"server {info.version} backend {info.backend} "
                  f"{[d.description for d in info.devices]}; torch {torch.__version__}")
            with torch.no_grad():
                sdpa_grid(args.device, on_gpu, direct, host, dtypes)
                flash_checks(args.device, on_gpu, direct, host, dtypes)
                if on_gpu:
                    no_round_trip(direct)
                    packed_steps_in_stream_order(direct, host, dtypes)
                    remote_cache_in_stream_order(direct, host)
                    late_ready_counter(direct)
                    late_ready_event(direct)
                    timing(direct, host)
    finally:
        server.terminate()
        server.wait(timeout=60)
    print(f"\n{len(failures)} check(s) failed" if failures else "\nall checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
