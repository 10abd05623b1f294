"""attention_client.transformers against the real attention_server (CPU backend): a small Llama
built from a config with random weights (no download; GQA; 4 layers) generates the same 32 greedy
tokens with its KV cache on the service (RemoteCache, attn_implementation=register(client)) as
with attn_implementation="sdpa" and transformers' own cache, at batch 1 and 4 (and with a
left-padded batch, with prompt lookup decoding, whose rejected candidates cache.crop drops, and
with beam search, whose reorders fork sessions); a selected and repeated batch steps as with
transformers' own cache; the cache's sessions are gone once it is released. The weights are scaled so
that the greedy output is not one token repeated (checked), which would hide wrong attention.

Run by ctest (label "python") with the Python of .python-env (scripts/install_deps.sh installs
torch and transformers there); exits 77 (skipped) with the reason when either is missing.
"""
import gc
import sys
import unittest

try:
    import torch
    import transformers
except ImportError as e:
    print(f"SKIP: torch or transformers is not installed for {sys.executable} ({e}); "
          "scripts/install_deps.sh installs them into .python-env", file=sys.stderr)
    sys.exit(77)

from test_attention_client import SEED, ServerTest

import attention_client.session
import attention_client.transformers as remote

NEW_TOKENS = 32


def tiny_llama(attn_implementation):
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.2, attn_implementation=attn_implementation)
    torch.manual_seed(SEED)
    model = transformers.LlamaForCausalLM(config).eval()
    return model


class TransformersTest(ServerTest):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        transformers.logging.set_verbosity_error()
        cls.name = remote.register(cls.client)
        cls.local = tiny_llama("sdpa")
        cls.served = tiny_llama(cls.name)
        cls.served.load_state_dict(cls.local.state_dict())
        cls.gen = torch.Generator().manual_seed(SEED)

    def generate(self, model, ids, **kwargs):
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                  do_sample=False, pad_token_id=0, **kwargs)

    def served_sessions(self):
        return {s.session_id for s in self.client.list_sessions().sessions}

    def check_same_tokens(self, ids, attention_mask=None):
        kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
        want = self.generate(self.local, ids, **kwargs)
        cache = remote.RemoteCache(self.client, self.served.config)
        calls = {"step_many": 0, "step_batch": 0}

        def counted(name):
            method = getattr(self.client, name)

            def call(*args, **kwargs):
                calls[name] += 1
                return method(*args, **kwargs)
            return call

        for name in calls:
            setattr(self.client, name, counted(name))
        try:
            got = self.generate(self.served, ids, past_key_values=cache, **kwargs)
        finally:
            for name in calls:
                delattr(self.client, name)
        # The prefill's Step per layer has an entry per sequence; every decode step after it is
        # one packed Step per layer (each sequence keeps its new position).
        self.assertEqual(calls, {"step_many": 4, "step_batch": 4 * (NEW_TOKENS - 1)})
        ids_held = set(cache.session_ids)
        # One session per sequence holding its 4 layers, all on the server while the cache lives.
        self.assertEqual(len(ids_held), ids.shape[0])
        self.assertTrue(all(s.layers == 4 for s in cache._sessions))
        self.assertLessEqual(ids_held, self.served_sessions())
        self.assertEqual(cache.get_seq_length(), ids.shape[1] + NEW_TOKENS - 1)
        del cache
        gc.collect()
        self.assertFalse(ids_held & self.served_sessions(), "sessions outlived their cache")
        new = want[:, ids.shape[1]:]
        for row in new:
            self.assertGreater(len(set(row.tolist())), 4, f"greedy output repeats: {row.tolist()}")
        self.assertEqual(got.tolist(), want.tolist(), f"seed {SEED}")

    def test_batch_1_same_greedy_tokens(self):
        self.check_same_tokens(torch.randint(1, 256, (1, 11), generator=self.gen))

    def test_batch_4_same_greedy_tokens(self):
        self.check_same_tokens(torch.randint(1, 256, (4, 9), generator=self.gen))

    def test_left_padded_batch(self):
        ids = torch.randint(1, 256, (3, 10), generator=self.gen)
        mask = torch.ones_like(ids)
        mask[1, :4] = 0
        mask[2, :1] = 0
        ids[mask == 0] = 0
        self.check_same_tokens(ids, mask)

    def test_prompt_lookup_decoding_crops_the_rejected_tokens(self):
        # Speculative decoding without an assistant model: candidates looked up in a repetitive
        # prompt, verified in one forward, the rejected ones dropped by cache.crop.
        ids = torch.randint(1, 256, (1, 6), generator=self.gen).repeat(1, 4)
        want = self.generate(self.local, ids, prompt_lookup_num_tokens=4)
        cache = remote.RemoteCache(self.client, self.served.config)
        dropped = []
        crop = cache.crop

        def counting_crop(max_length):
            dropped.append(-max_length)
            crop(max_length)

        cache.crop = counting_crop
        got = self.generate(self.served, ids, past_key_values=cache, prompt_lookup_num_tokens=4)
        self.assertGreater(sum(dropped), 0, "no candidate token was rejected")
        self.assertEqual(got.tolist(), want.tolist(), f"seed {SEED}")
        # Each session holds the rows of the positions kept.
        lengths = {s.session_id: s.length for s in self.client.list_sessions().sessions}
        for layer in cache.layers:
            self.assertEqual(lengths[layer.sessions[0].id], layer.get_seq_length())
        with self.assertRaisesRegex(ValueError, "max_length"):
            cache.crop(3)  # transformers' DynamicCache refuses a positive length too
        cache.close()

    def test_beam_search_reorders_by_forks(self):
        # After every step beam search reorders the cache: beams that continue one beam get
        # forks of its sessions, the beams none continues are dropped.
        ids = torch.randint(1, 256, (2, 9), generator=self.gen)
        want = self.generate(self.local, ids, num_beams=3)
        cache = remote.RemoteCache(self.client, self.served.config)
        forks = []
        fork = attention_client.session.Session.fork

        def counting_fork(session, *args, **kwargs):
            forks.append(session.id)
            return fork(session, *args, **kwargs)

        attention_client.session.Session.fork = counting_fork
        try:
            got = self.generate(self.served, ids, past_key_values=cache, num_beams=3)
        finally:
            attention_client.session.Session.fork = fork
        self.assertTrue(forks, "no beam was continued twice")
        self.assertEqual(got.tolist(), want.tolist(), f"seed {SEED}")
        # One session per beam, holding every layer: forks replaced the dropped beams'.
        self.assertEqual(len(cache.session_ids), 2 * 3)
        self.assertLessEqual(set(cache.session_ids), self.served_sessions())
        cache.close()

    def test_selected_and_repeated_sequences_continue_as_local(self):
        # batch_select_indices and batch_repeat_interleave (forks for the repeated sequences):
        # the next step's logits equal those of transformers' own cache under the same selection.
        ids = torch.randint(1, 256, (3, 8), generator=self.gen)
        local = transformers.DynamicCache(config=self.local.config)
        served = remote.RemoteCache(self.client, self.served.config)
        with torch.no_grad():
            self.local(ids, past_key_values=local)
            self.served(ids, past_key_values=served)
            for cache in (local, served):
                cache.batch_select_indices(torch.tensor([2, 0, 2]))
                cache.batch_repeat_interleave(2)
            step = torch.randint(1, 256, (6, 1), generator=self.gen)
            want = self.local(step, past_key_values=local).logits
            got = self.served(step, past_key_values=served).logits
        err = float((got - want).norm() / want.norm())
        self.assertLess(err, 1e-5, f"logits relative error {err:.3g} (seed {SEED})")
        self.assertEqual(len(served.session_ids), 6)
        served.close()

    def test_without_remote_cache_each_call_sends_its_keys(self):
        ids = torch.randint(1, 256, (2, 7), generator=self.gen)
        with torch.no_grad():
            want = self.local(ids).logits
            got = self.served(ids).logits
        err = float((got - want).norm() / want.norm())
        self.assertLess(err, 1e-5, f"logits relative error {err:.3g} (seed {SEED})")

    def test_remote_cache_needs_the_registered_attention(self):
        cache = remote.RemoteCache(self.client, self.local.config)
        with self.assertRaisesRegex(RuntimeError, "register"):
            self.generate(self.local, torch.randint(1, 256, (1, 5), generator=self.gen),
                          past_key_values=cache)
        cache.close()


if __name__ == "__main__":
    unittest.main()
