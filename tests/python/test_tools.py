"""The command-line tools fail loudly: attention_server, attn_echo_server, attn_client and
attn_bench, run as real binaries.

- --help lists each tool's own flags with their usage lines, by their path in the source tree
  (never the build machine's).
- Bad flags and bad values exit 2 with the reason (client/README.md), from one --shape parser.

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


class BadFlagsTest(unittest.TestCase):
    def test_bad_shapes_exit_2_with_the_reason(self):
        for tool in ("attn_client", "attn_bench"):
            for shape, reason in (("1,-8,64,64", "'-8' is not a positive integer"),
                                  ("1,8,0,64", "'0' is not a positive integer"),
                                  ("1,8,x,64", "'x' is not a positive integer"),
                                  ("1,8,1.5,64", "'1.5' is not a positive integer"),
                                  ("1,8,64", "got 3 values")):
                with self.subTest(tool=tool, shape=shape):
                    # No server at the target: the shape must be refused before any call.
                    p = run(tool, f"--shape={shape}", "--target=127.0.0.1:1", "--progress=false"
                            if tool == "attn_bench" else "--repeat=1")
                    self.assertEqual(p.returncode, 2, p.stderr)
                    self.assertIn(reason, p.stderr)
                    self.assertNotIn("terminate called", p.stderr)

    def test_unknown_flags_and_bad_values_exit_2(self):
        for tool in ("attn_client", "attn_bench"):
            for args, reason in ((["--no_such_flag=1"], "unknown flag --no_such_flag"),
                                 (["--kv_heads=-2"], "--kv_heads and --nk must be positive"),
                                 (["--deadline_ms=soon" if tool == "attn_client"
                                   else "--concurrency=many"], "Illegal value")):
                with self.subTest(tool=tool, args=args):
                    p = run(tool, "--target=127.0.0.1:1", *args)
                    self.assertEqual(p.returncode, 2, p.stderr)
                    self.assertIn(reason, p.stderr)


if __name__ == "__main__":
    unittest.main()
