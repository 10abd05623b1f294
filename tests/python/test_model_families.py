"""attention_client.transformers on model families, against the real attention_server (CPU
backend): tiny models built from configs in code (random weights, float32, no download) generate
with register()'s attention, through transformers' DynamicCache (an Attend per call) and through
a RemoteCache (sessions), the same greedy tokens as with eager attention locally, and every step's
logits within 1e-3; for a left-padded batch and a single prompt: Llama, Mistral (window), Qwen2,
Qwen3, Phi3, Cohere, GPT-2, OPT, Gemma 3 (windows), Gemma 2 (softcap and windows), gpt-oss (sinks
and windows), DeepSeek-V3 (MLA; its RemoteCache holds the latents, absorbed) and Llama 4 (chunked
attention). Unknown attention keywords and masks the service does not compute are refused by
name; a StaticCache's prefill gets SDPA's top-left alignment.

Run by ctest (label "python") with the Python of .python-env; exits 77 (skipped) with the reason
when torch or transformers is missing.
"""
import sys
import unittest
from unittest import mock

try:
    import torch
    import transformers
except ImportError as e:
    print(f"SKIP: torch or transformers is not installed for {sys.executable} ({e}); "
          "scripts/install_deps.sh installs them into .python-env", file=sys.stderr)
    sys.exit(77)

from test_attention_client import SEED, ServerTest

import attention_client.transformers as remote

NEW_TOKENS = 6
VOCAB = 96
# Shared by every config: 2 layers, 4 query heads over 2 KV heads, head dim 16.
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)

# Served families: name -> a function giving the config (a window shorter than the prompts where
# the family has one, so that it takes effect).
SERVED = {
    "llama": lambda: transformers.LlamaConfig(**COMMON),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=5),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=16),
    "phi3": lambda: transformers.Phi3Config(**COMMON, pad_token_id=0),
    "cohere": lambda: transformers.CohereConfig(**COMMON),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                            initializer_range=0.2),
    "opt": lambda: transformers.OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=96,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          word_embed_proj_dim=64, init_std=0.2),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **COMMON, head_dim=16, sliding_window=5,
        layer_types=["sliding_attention", "full_attention"]),
    # Logit softcapping (at 5, not Gemma 2's 50, so that it bites on these logits) and
    # alternating windows.
    "gemma2": lambda: transformers.Gemma2Config(**COMMON, head_dim=16, sliding_window=5,
                                                attn_logit_softcapping=5.0),
    # Attention sinks (s_aux) and alternating windows.
    "gpt_oss": lambda: transformers.GptOssConfig(
        **{**COMMON, "intermediate_size": 64}, head_dim=16, sliding_window=5,
        num_local_experts=4, num_experts_per_tok=2),
    # MLA: QK head dim 24 (16 + 8 rotary), V head dim 8; a RemoteCache holds the latents.
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4}, moe_intermediate_size=32, first_k_dense_replace=1,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=32,
        q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=8),
    # Chunked attention (chunks of 4) on the RoPE layers.
    "llama4": lambda: transformers.Llama4TextConfig(
        **COMMON, head_dim=16, intermediate_size_mlp=96, attention_chunk_size=4,
        num_local_experts=2),
}
def build(config_fn, attn_implementation):
    config = config_fn()
    config._attn_implementation = attn_implementation
    torch.manual_seed(SEED)
    return transformers.AutoModelForCausalLM.from_config(config).float().eval()


class ModelFamiliesTest(ServerTest):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        transformers.logging.set_verbosity_error()
        cls.name = remote.register(cls.client)

    def prompts(self):
        """A left-padded batch of 2 (ids, mask) and a single prompt, longer than the windows."""
        gen = torch.Generator().manual_seed(SEED)
        ids = torch.randint(1, VOCAB, (2, 9), generator=gen)
        mask = torch.ones_like(ids)
        mask[1, :3] = 0
        ids[mask == 0] = 0
        single = torch.randint(1, VOCAB, (1, 8), generator=gen)
        return [(ids, mask), (single, torch.ones_like(single))]

    def generate(self, model, ids, mask, **kwargs):
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                                 output_logits=True, return_dict_in_generate=True, **kwargs)
        return out.sequences, torch.stack(out.logits)

    def check_family(self, config_fn, remote_cache=True, modify=None, inspect=None, **kwargs):
        """`modify(model)` changes both models after they are built; `inspect(cache)` looks at
        each RemoteCache after its generate."""
        local = build(config_fn, "eager")
        served = build(config_fn, self.name)
        if modify is not None:
            modify(local)
            modify(served)
        served.load_state_dict(local.state_dict())
        for ids, mask in self.prompts():
            want, want_logits = self.generate(local, ids, mask, **kwargs)
            caches = [("DynamicCache", None)]
            if remote_cache:
                caches.append(("RemoteCache", remote.RemoteCache(self.client, served.config)))
            for what, cache in caches:
                extra = {} if cache is None else {"past_key_values": cache}
                got, logits = self.generate(served, ids, mask, **extra, **kwargs)
                if cache is not None:
                    if inspect is not None:
                        inspect(cache)
                    cache.close()
                where = f"{what}, batch {ids.shape[0]}, seed {SEED}"
                err = float((logits - want_logits).abs().max())
                scale = max(1.0, float(want_logits.abs().max()))
                self.assertLess(err, 1e-3 * scale, f"logits differ by {err:.3g} ({where})")
                self.assertEqual(got.tolist(), want.tolist(), where)

    def test_served_families(self):
        for family, config_fn in SERVED.items():
            with self.subTest(family=family):
                self.check_family(config_fn)

    def test_a_layer_of_another_kv_shape_keeps_sessions_of_its_own(self):
        # Llama with one KV head in layer 1 (two in layer 0): layer 0 holds its K/V in the
        # sessions shared by the layers, layer 1 in sessions of its own; the same tokens.
        def one_kv_head(model):
            attn = model.model.layers[1].self_attn
            attn.k_proj = torch.nn.Linear(64, 16, bias=False)
            attn.v_proj = torch.nn.Linear(64, 16, bias=False)
            attn.num_key_value_groups = 4

        def inspect(cache):
            self.assertEqual(cache._shared.members, {0})
            self.assertEqual(len(cache.layers[1].own), len(cache._shared.sessions))
            self.assertTrue(all(s.layers == 2 for s in cache._shared.sessions))

        self.check_family(SERVED["llama"], modify=one_kv_head, inspect=inspect)

    def test_mla_sessions_hold_the_latent_once(self):
        # DeepSeek-V3 through a RemoteCache on a server whose sessions keep v as k's first
        # features (the CPU and CUDA backends): one KV head of K = [latent 32, rotary 8] whose
        # first 32 features are V, stored once (v_from_k), no zero padding; the same tokens as
        # eager.
        def inspect(cache):
            self.assertEqual(cache._shared.shape[1:], (1, 40, 32))
            self.assertTrue(all((s.head_dim, s.v_head_dim, s.v_from_k) == (40, 32, True)
                                for s in cache._shared.sessions))

        self.check_family(SERVED["deepseek_v3"], inspect=inspect)

    def test_mla_sessions_hold_v_of_its_own_head_dim(self):
        # On a server whose sessions take a V head dim of their own but not v_from_k: V = the
        # latent sent beside K; the same tokens.
        def inspect(cache):
            self.assertTrue(all((s.head_dim, s.v_head_dim, s.v_from_k) == (40, 32, False)
                                for s in cache._shared.sessions))

        with mock.patch.object(remote, "_serves_v_from_k", return_value=False):
            self.check_family(SERVED["deepseek_v3"], inspect=inspect)

    def test_mla_on_a_server_whose_sessions_take_one_head_dim(self):
        # As a CUDA server answers (no "v_head_dim" in its devices' options): v padded with zero
        # features to the QK head dim, sessions of one head dim 40; the same tokens.
        def inspect(cache):
            self.assertEqual(cache._shared.shape[1:], (1, 40, 40))

        with mock.patch.object(remote, "_serves_v_head_dim", return_value=False):
            self.check_family(SERVED["deepseek_v3"], inspect=inspect)

    def test_static_cache_prefill_is_aligned_top_left(self):
        # The StaticCache hands the prefill all its max_cache_len keys, unwritten ones included,
        # with no mask and is_causal: SDPA's top-left causal mask hides those past each query.
        self.check_family(SERVED["llama"], remote_cache=False, cache_implementation="static")

    def test_unknown_attention_keywords_are_refused_by_name(self):
        forward = transformers.AttentionInterface()[self.name]
        module = torch.nn.Module()
        q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
        with self.assertRaisesRegex(NotImplementedError, "some_new_option"):
            forward(module, q, k, k, None, some_new_option=1)
        for word, value in [("output_attentions", True), ("cu_seq_lens_q", torch.zeros(2)),
                            ("position_bias", torch.zeros(1))]:
            with self.assertRaisesRegex(NotImplementedError, word):
                forward(module, q, k, k, None, **{word: value})
        o, _ = forward(module, q, k, k, None, output_attentions=False, position_ids=None)
        self.assertEqual(tuple(o.shape), (1, 3, 2, 8))

    def test_masks_the_service_does_not_compute_are_refused(self):
        # A window the mask does not show (sliding_window given, the mask plain causal).
        forward = transformers.AttentionInterface()[self.name]
        q = torch.randn(1, 2, 6, 8)
        mask = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
        with self.assertRaisesRegex(NotImplementedError, "sliding window"):
            forward(torch.nn.Module(), q, q, q, mask, sliding_window=3)


if __name__ == "__main__":
    unittest.main()
