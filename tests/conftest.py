from two_ranks import two_ranks  # noqa: F401  (the shared 2-rank launcher run, a session fixture)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: kill trials and other multi-process runs (CI runs them; `-m 'not slow'` skips them locally)"
    )
