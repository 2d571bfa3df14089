pytest_plugins = [
    "tests.fixtures.models",
    "tests.fixtures.redis",
    "tests.fixtures.serve_app",
    "tests.fixtures.engines",
]
