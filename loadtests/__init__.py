"""Load tests and benchmarks for the OpenAI-compatible API (see loadtests/README.md)."""
