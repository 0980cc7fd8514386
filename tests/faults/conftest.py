from tests.train.conftest import corpus, cache_dir  # noqa: F401
