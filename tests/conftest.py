pytest_plugins = ["tests.fixtures.models", "tests.fixtures.serve_app"]
