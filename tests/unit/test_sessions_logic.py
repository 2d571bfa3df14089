"""Session id validation, the context-overflow policy and block hashing (pure logic)."""

import pytest

from app.errors import InvalidRequestError
from app.sessions import MAX_SESSION_TTL_S, check_session_id, fit_history, session_create_ttl
from deployments.compute.engines.kv import block_hashes


def count_words(messages):
    return sum(len(m["content"].split()) for m in messages)


def msg(role, n, tag="w"):
    return {"role": role, "content": " ".join(f"{tag}{i}" for i in range(n))}


def test_session_id_format():
    good = "sess_" + "0" * 32
    assert check_session_id(good) == good
    for bad in ["", "sess_", "sess_" + "g" * 32, "x" * 37, "sess_" + "0" * 31, "../../etc"]:
        with pytest.raises(InvalidRequestError):
            check_session_id(bad)


def test_a_session_create_body_takes_ttl_s_alone_and_only_a_whole_number():
    assert session_create_ttl({}) is None
    assert session_create_ttl({"ttl_s": None}) is None
    assert session_create_ttl({"ttl_s": 1}) == 1
    assert session_create_ttl({"ttl_s": MAX_SESSION_TTL_S}) == MAX_SESSION_TTL_S
    # JSON true is Python's True, an int: it made a session that expired after 1 s.
    for bad in (True, False, 0, -5, MAX_SESSION_TTL_S + 1, 1.5, 60.0, "60", [60]):
        with pytest.raises(InvalidRequestError) as e:
            session_create_ttl({"ttl_s": bad})
        assert e.value.param == "ttl_s"
    # A field the server would drop gives the client a session it did not ask for.
    with pytest.raises(InvalidRequestError) as e:
        session_create_ttl({"ttl": 60})
    assert e.value.param == "ttl" and "only 'ttl_s'" in e.value.message
    with pytest.raises(InvalidRequestError) as e:
        session_create_ttl({"ttl_s": 60, "messages": [{"role": "system", "content": "terse"}]})
    assert e.value.param == "messages" and "first chat turn" in e.value.message


def test_history_that_fits_is_kept_whole():
    history = [msg("user", 10), msg("assistant", 10)]
    new = [msg("user", 5)]
    messages, n = fit_history(history, new, count_tokens=count_words, max_new_tokens=10, max_model_len=100, policy="error")
    assert messages == history + new and n == 25


def test_overflow_error_says_how_many_tokens_over():
    history = [msg("user", 50), msg("assistant", 40)]
    with pytest.raises(InvalidRequestError) as e:
        fit_history(history, [msg("user", 5)], count_tokens=count_words, max_new_tokens=10, max_model_len=100, policy="error")
    # 95 prompt + 10 completion = 105 -> 5 over a context of 100
    assert "5 over" in e.value.message and "100" in e.value.message and "105" in e.value.message


def test_truncate_oldest_drops_oldest_non_system_first():
    system = msg("system", 5, "s")
    history = [system, msg("user", 30, "a"), msg("assistant", 30, "b"), msg("user", 20, "c")]
    new = [msg("user", 5, "n")]
    messages, n = fit_history(history, new, count_tokens=count_words, max_new_tokens=10, max_model_len=70, policy="truncate_oldest")
    # 5 + 30 + 30 + 20 + 5 = 90 (+10) too big; drop "a" -> 60+10 = 70 fits.
    assert messages == [system, history[2], history[3]] + new
    assert n == 60


@pytest.mark.parametrize("max_model_len", [100, 70, 5])
def test_the_last_count_is_of_the_returned_messages(max_model_len):
    """The ingress reuses the prompt built by the last count instead of building it again."""
    system = msg("system", 5, "s")
    history = [system, msg("user", 30, "a"), msg("assistant", 30, "b"), msg("user", 20, "c")]
    counted = []

    def count(messages):
        counted.append(list(messages))
        return count_words(messages)

    messages, n = fit_history(history, [msg("user", 5, "n")], count_tokens=count, max_new_tokens=10,
                              max_model_len=max_model_len, policy="truncate_oldest")
    assert counted[-1] == messages and count_words(messages) == n
    assert len(counted) == {100: 1, 70: 2, 5: 4}[max_model_len]


def test_block_hashes_chain_and_tenant_isolation():
    tokens = list(range(40))
    h = block_hashes("m", "t1", tokens, 16)
    assert len(h) == 2  # the partial third block is skipped
    assert block_hashes("m", "t1", tokens[:32], 16) == h
    # Same block tokens after a different prefix: different hash (chained).
    other = block_hashes("m", "t1", [99] + tokens[1:], 16)
    assert other[0] != h[0] and other[1] != h[1]
    assert block_hashes("m", "t2", tokens, 16)[0] != h[0]
    assert block_hashes("m2", "t1", tokens, 16)[0] != h[0]
    assert block_hashes("m", "t1", tokens[:15], 16) == []


def test_a_cache_salt_is_in_every_block_hash():
    """vLLM's cache_salt: the same tokens share blocks only under the same salt (and
    tenant); no salt is the unsalted chain."""
    tokens = list(range(40))
    plain = block_hashes("m", "t1", tokens, 16)
    assert block_hashes("m", "t1", tokens, 16, None) == plain
    salted = block_hashes("m", "t1", tokens, 16, "s3cret")
    assert block_hashes("m", "t1", tokens, 16, "s3cret") == salted
    assert len(salted) == 2 and not set(salted) & set(plain)
    assert not set(block_hashes("m", "t1", tokens, 16, "other")) & set(salted)
    assert not set(block_hashes("m", "t2", tokens, 16, "s3cret")) & set(salted)
