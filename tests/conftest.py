def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: kill trials and other multi-process runs (CI runs them; `-m 'not slow'` skips them locally)"
    )
