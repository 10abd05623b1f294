"""The command-line tools fail loudly: attention_server, attn_echo_server, attn_client and
attn_bench, run as real binaries.

- --help lists each tool's own flags with their usage lines, by their path in the source tree
  (never the build machine's).

Run by ctest (label "python"), which sets ATTENTION_SERVER_BINARY, ATTN_ECHO_SERVER_BINARY,
ATTN_CLIENT_BINARY and ATTN_BENCH_BINARY. Needs only the standard library.
"""
import os
import re
import subprocess
import unittest

BINARIES = {
    "attention_server": os.environ.get("ATTENTION_SERVER_BINARY"),
    "attn_echo_server": os.environ.get("ATTN_ECHO_SERVER_BINARY"),
    "attn_client": os.environ.get("ATTN_CLIENT_BINARY"),
    "attn_bench": os.environ.get("ATTN_BENCH_BINARY"),
}


def run(tool, *args, timeout=60):
    return subprocess.run([BINARIES[tool], *args], capture_output=True, text=True,
                          timeout=timeout)


class HelpTest(unittest.TestCase):
    # A flag of each tool and a piece of its usage line.
    CASES = {
        "attention_server": ("--max_queue", "--backend"),
        "attn_echo_server": ("--port_file", "Port; 0 picks a free one."),
        "attn_client": ("--check", "compare with the float64 reference"),
        "attn_bench": ("--concurrency", "requests in flight at most"),
    }

    def test_help_lists_own_flags_without_build_paths(self):
        for tool, (flag, usage) in self.CASES.items():
            with self.subTest(tool=tool):
                p = run(tool, "--help")
                text = p.stdout + p.stderr
                self.assertNotIn("No flags matched", text)
                self.assertIn(flag + " (", text)
                self.assertIn(usage, text)
                # Flags are listed under their source file, relative to the source tree.
                self.assertRegex(text, r"Flags from (server|client|bench)/[\w/]+\.cc:")
                self.assertIsNone(re.search(r"Flags from /|/work/|/home/|/build/", text), text)


if __name__ == "__main__":
    unittest.main()
