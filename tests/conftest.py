import os

# One thread per process (pytest's and every child's that does not choose): the test models are tiny, and a
# second thread per process on a 2-core machine already running another process (a rank, a server) makes each op
# wait for a time slice (measured: a 10-step tiny run, 32 s of CPU with 2 threads under load, 3.3 s with 1).
os.environ.setdefault("OMP_NUM_THREADS", "1")

from two_ranks import two_ranks  # noqa: F401  (the shared 2-rank launcher run, a session fixture)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: kill trials and other multi-process runs (CI runs them; `-m 'not slow'` skips them locally)"
    )
