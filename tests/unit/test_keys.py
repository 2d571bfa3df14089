"""The Redis key schema's quoting (deployments/dataplane/keys.py): a part that needs no
quoting is taken as it is, everything else percent-quoted exactly as before, so no
tenant or id can forge another key."""

import random
from urllib.parse import quote

import pytest

from deployments.dataplane import keys


def _as_before(part: str) -> str:
    return quote(part, safe="-_.")


@pytest.mark.parametrize(
    "part",
    [
        "default", "0123456789abcdef" * 2, "A-Z_a.z~0", "a:kv:b", "a b", "a%3Ab", "ü", "a/b",
        "abc\n", "\nabc", "a|b", "-", "~", ".", "..", "日本", "a\u00a0b", "ab\x00",
    ],
)
def test_quoting_is_unchanged(part):
    assert keys._q(part) == _as_before(part)


def test_quoting_is_unchanged_for_random_parts():
    rng = random.Random(7)
    alphabet = "abcXYZ019-_.~:%/ |\n\t\u00e9\u4e2d\U0001f600"
    for _ in range(2000):
        part = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))
        assert keys._q(part) == _as_before(part), part


def test_a_tenant_cannot_forge_another_key():
    # "t:kv:h" as a tenant must not name tenant "t"'s block "h".
    assert keys.block_key("t:kv:h", "x") != keys.block_key("t", "h:kv:x")
    assert keys.block_key("t:kv:h", "x") == "llm:t%3Akv%3Ah:kv:x"
    assert keys.split_block_key(keys.block_key("t:kv:h", "a:b")) == ("t:kv:h", "a:b")


def test_empty_parts_are_refused():
    with pytest.raises(ValueError):
        keys.block_key("", "h")
    with pytest.raises(ValueError):
        keys.session_key("t", "")
