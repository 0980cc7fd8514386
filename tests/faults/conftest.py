from tests.train.conftest import cache_dir, corpus  # noqa: F401
