"""Placing new sessions by free KV pages over three real attention_servers (CPU backend, small KV
caches of 16 pages of 16 rows): ServerInfo's kv_page_bytes, kv_pages_total, kv_pages_free and
kv_pages_cached equal ListSessions' room as sessions come and go and prefixes are cached, and
attention_client.replicas.place_session puts each new session on the replica with the most room
(free plus cached pages), which moves as the replicas fill: replicas of different fill (fresh
random rows), the new session lands on the emptiest, its Steps match the float64 reference; a
replica that does not answer is passed over, and none answering is UNAVAILABLE naming each.
Inputs are fresh random each run; the seed is printed, and a failure message repeats it.

Run by ctest (label "python") like test_attention_client.py. Exits 77 (skipped) when grpcio or
numpy is missing.
"""
import socket
import unittest

from test_attention_client import (F32_BOUND, SEED, reference, rel_error, start_replicas,
                                   stop_replicas)

import grpc
import numpy as np
from attention_client import AttentionError, Client, replicas
from attention_client.session import session_owner

HQ, HKV, D = 4, 2, 64
# float32 K and V of a row: 2 * HKV * D * 4 = 1 KiB, so a 16 KiB page holds 16 rows; 16 pages.
PAGE_ROWS, PAGES = 16, 16
NAMES = ("r1", "r2", "r3")


class PlacementTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.rng = np.random.default_rng(SEED)
        cls.servers, cls.clients = start_replicas(NAMES, [
            f"--kv_page_bytes={PAGE_ROWS * 1024}", f"--kv_cache_bytes={PAGES * PAGE_ROWS * 1024}"])

    @classmethod
    def tearDownClass(cls):
        stop_replicas(cls.servers, cls.clients)

    def setUp(self):
        self.held = []

    def tearDown(self):
        for s in self.held:
            s.drop()

    def session(self, name, rows, tokens=None):
        """A session of `rows` fresh rows on replica `name` (kept until the test ends)."""
        k, v = (self.rng.standard_normal((HKV, rows, D)).astype(np.float32) for _ in range(2))
        s = self.clients[name].session(k=k, v=v, tokens=tokens)
        self.held.append(s)
        return s, k, v

    def assertRoom(self, name):
        """ServerInfo's room on `name` equals ListSessions'; returns its free + cached pages."""
        info, listed = self.clients[name].server_info(), self.clients[name].list_sessions()
        self.assertEqual(
            (info.kv_page_bytes, info.kv_pages_total, info.kv_pages_free, info.kv_pages_cached),
            (listed.page_bytes, listed.pages_total, listed.pages_free, listed.pages_cached), name)
        self.assertEqual((info.kv_page_bytes, info.kv_pages_total), (PAGE_ROWS * 1024, PAGES))
        return info.kv_pages_free + info.kv_pages_cached

    def place(self, pool):
        """A session placed over `pool` (names), stepped once against the reference; returns
        the name of the replica it landed on."""
        k, v = (self.rng.standard_normal((HKV, 20, D)).astype(np.float32) for _ in range(2))
        s = replicas.place_session([self.clients[n] for n in pool], k=k, v=v)
        self.held.append(s)
        q = self.rng.standard_normal((HQ, 1, D)).astype(np.float32)
        ref, _ = reference(q[None], k[None], v[None])
        err = rel_error(s.step(q), ref[0])
        self.assertLessEqual(err, F32_BOUND, f"relative error {err:.3g} (seed {SEED})")
        return session_owner(s.id)

    def test_server_info_reports_the_room_that_list_sessions_does(self):
        self.assertEqual(self.assertRoom("r1"), PAGES)
        s, _, _ = self.session("r1", 3 * PAGE_ROWS + 5)  # 4 pages
        self.assertEqual(self.assertRoom("r1"), PAGES - 4)
        with s.fork():  # shares the 3 full pages, copies the partial one
            self.assertEqual(self.assertRoom("r1"), PAGES - 5)
        tokens = self.rng.integers(0, 2**40, 2 * PAGE_ROWS)
        t, _, _ = self.session("r1", 2 * PAGE_ROWS, tokens=tokens)  # 2 full pages, cached
        self.held.remove(t)
        t.drop()  # its pages stay cached: not free, but room
        info = self.clients["r1"].server_info()
        self.assertEqual((info.kv_pages_free, info.kv_pages_cached), (PAGES - 6, 2))
        self.assertEqual(self.assertRoom("r1"), PAGES - 4)

    def test_new_sessions_go_to_the_replica_with_the_most_room(self):
        # r1 holds 9 pages, r2 3, r3 6: the next session goes to r2 (2 pages: 20 rows).
        for name, pages in (("r1", 9), ("r2", 3), ("r3", 6)):
            self.session(name, pages * PAGE_ROWS)
        room = {name: self.assertRoom(name) for name in NAMES}
        self.assertEqual(room, {"r1": 7, "r2": 13, "r3": 10})
        self.assertEqual(self.place(NAMES), "r2")
        # r2 now 11 free: fill it to 8 free (3 more pages) and r3 becomes the emptiest.
        self.session("r2", 3 * PAGE_ROWS)
        self.assertEqual(self.place(NAMES), "r3")
        self.assertEqual({name: self.assertRoom(name) for name in NAMES},
                         {"r1": 7, "r2": 8, "r3": 8})
        # Equal room: the first of them in the order given.
        self.assertEqual(self.place(("r1", "r3", "r2")), "r3")

    def test_a_replica_that_does_not_answer_is_passed_over(self):
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            dead = Client(f"127.0.0.1:{s.getsockname()[1]}", timeout=5)
        self.session("r1", 4 * PAGE_ROWS)
        with dead:
            pool = [dead, self.clients["r1"]]
            self.assertIs(replicas.emptiest(pool), self.clients["r1"])
            with self.assertRaises(AttentionError) as raised:
                replicas.emptiest([dead])
            self.assertEqual(raised.exception.code, grpc.StatusCode.UNAVAILABLE)
            self.assertIn(f"no replica to place a session on: {dead._target}: UNAVAILABLE",
                          raised.exception.details)


if __name__ == "__main__":
    unittest.main()
