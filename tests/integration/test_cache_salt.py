"""vLLM's ``cache_salt`` through the real application, on both engines: a prompt's cached
KV (the engine's own prefix cache and the data plane's tiers) is reused only by a request
that sends the same salt; another salt, or none, reuses nothing and gets the same answer."""

from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.integration


def test_cached_kv_is_reused_only_under_the_same_cache_salt(served_app):
    rng = random.Random()
    prompt = [rng.randrange(100, 1000) for _ in range(4 * 16 + 1)]  # 4 whole blocks before the last token
    salt_a, salt_b = f"a-{rng.getrandbits(64):x}", f"b-{rng.getrandbits(64):x}"
    client = served_app.client()

    def ask(salt):
        extra = {} if salt is None else {"cache_salt": salt}
        reply = client.completions.create(model=served_app.model_id, prompt=prompt, max_tokens=4, temperature=0,
                                          extra_body=extra)
        return reply.choices[0].text, reply.usage.prompt_tokens_details.cached_tokens

    first, cached = ask(salt_a)
    assert cached == 0
    # The same salt reuses the prefix. (The torch engine recomputes a prefix it measured
    # slower to import than to prefill, and imports again after a few such skips.)
    for _ in range(6):
        again, cached = ask(salt_a)
        if cached:
            break
    assert cached == 64 and again == first
    for other in (salt_b, None):
        text, cached = ask(other)
        assert cached == 0, other
        assert text == first
    # The unsalted request left its own blocks: a salted one still reuses none of them.
    text, cached = ask(f"c-{rng.getrandbits(64):x}")
    assert cached == 0 and text == first
