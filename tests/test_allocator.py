import os
import subprocess
import sys

from pipeline.train.allocator import fix_cpu_malloc_threshold


def test_fixes_glibc_threshold_unless_the_user_did(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert fix_cpu_malloc_threshold() is False  # the user's setting wins
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    code = "from pipeline.train.allocator import fix_cpu_malloc_threshold as f; print(f())"
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip() == "True"  # this machine's C library is glibc
