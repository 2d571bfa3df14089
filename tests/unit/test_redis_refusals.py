"""Which Redis error replies are a refused write (redis_store.refusal_code) or a server
that serves nobody now (unavailable_reply), as redis-py and the data plane's raw RESP
client (resp.py) parse them, and what a client is told of a refusal."""

from __future__ import annotations

import pickle

import pytest
from redis._parsers.base import BaseParser
from redis.exceptions import ResponseError

from app.errors import ServiceUnavailableError, to_api_error
from deployments.dataplane.redis_store import RedisRefused, RedisUnavailable, refusal_code, unavailable_reply
from deployments.dataplane.resp import _error

REFUSED = {
    "OOM": "OOM command not allowed when used memory > 'maxmemory'.",
    "MISCONF": "MISCONF Errors writing to the AOF file: No space left on device",
    "READONLY": "READONLY You can't write against a read only replica.",
    "NOREPLICAS": "NOREPLICAS Not enough good replicas to write.",
}
UNAVAILABLE = {
    "BUSY": "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.",
    "MASTERDOWN": "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
    "CLUSTERDOWN": "CLUSTERDOWN The cluster is down",
    "TRYAGAIN": "TRYAGAIN Multiple keys request during rehashing of slot",
}
OTHERS = [
    "WRONGTYPE Operation against a key holding the wrong kind of value",
    "NOSCRIPT No matching script. Please use EVAL.",
    "NOPERM User default has no permissions to run the 'set' command",
    "ERR unknown command 'FOO'",
    "oom in lower case is not a code",
]


@pytest.mark.parametrize("code", sorted(REFUSED))
def test_a_refused_write_is_recognised_from_either_client(code):
    line = REFUSED[code]
    parsed = BaseParser.parse_error(line)  # redis-py: the code leaves the message
    assert refusal_code(parsed) == code
    assert refusal_code(_error(b"-" + line.encode())) == code  # resp.py: the whole line


@pytest.mark.parametrize("code", sorted(UNAVAILABLE))
def test_a_server_that_serves_nobody_now_is_unavailable_not_refusing(code):
    line = UNAVAILABLE[code]
    for error in (BaseParser.parse_error(line), _error(b"-" + line.encode())):
        down = unavailable_reply(error)
        assert isinstance(down, RedisUnavailable) and str(down) == line
        assert refusal_code(error) is None


@pytest.mark.parametrize("line", OTHERS)
def test_other_error_replies_are_neither(line):
    for error in (BaseParser.parse_error(line), _error(b"-" + line.encode())):
        assert refusal_code(error) is None and unavailable_reply(error) is None


def test_only_error_replies_are_refusals():
    assert refusal_code(ConnectionError("OOM")) is None
    assert refusal_code(ValueError("READONLY")) is None


def test_a_refusal_is_a_503_that_crosses_serve_without_redis_words():
    refused = RedisRefused.of(ResponseError(REFUSED["OOM"]))
    assert refused.reply.startswith("OOM command not allowed")
    # redis-py takes the code off the message; the log line puts it back.
    parsed = RedisRefused.of(BaseParser.parse_error(REFUSED["READONLY"]))
    assert parsed.reply == REFUSED["READONLY"]
    assert isinstance(refused, ServiceUnavailableError) and refused.status_code == 503
    assert refused.code == "store_refusing_writes" and refused.headers == {"Retry-After": "5"}
    assert "maxmemory" not in refused.message  # the server's words stay in its log
    # As Ray carries it from the data plane to the ingress (APIError.__reduce__).
    crossed = pickle.loads(pickle.dumps(refused))
    assert type(crossed) is RedisRefused and crossed.body() == refused.body()
    assert to_api_error(crossed) is crossed
