"""The ingress's checks of a parsed body that need no server: how deep its JSON nests."""

import json

import pytest

from app.ingress import MAX_JSON_DEPTH, json_depth_exceeds, lone_surrogate_at


def nested(depth: int, leaf="x"):
    """A dict holding lists ``depth`` containers deep in all (the dict is level 1)."""
    return json.loads('{"a": ' + "[" * (depth - 1) + json.dumps(leaf) + "]" * (depth - 1) + "}")


@pytest.mark.parametrize("depth, deeper", [(1, False), (MAX_JSON_DEPTH, False), (MAX_JSON_DEPTH + 1, True)])
def test_the_depth_limit_is_exact(depth, deeper):
    assert json_depth_exceeds(nested(depth)) is deeper


def test_depth_counts_dicts_and_lists_on_any_branch():
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "stop": ["a"]}
    assert not json_depth_exceeds(body, 5)  # dict > list > dict > list > dict
    assert json_depth_exceeds(body, 4)
    assert not json_depth_exceeds({"a": "x" * 10_000, "b": 1}, 1)


def test_within_the_limit_the_surrogate_walk_does_not_recurse_out():
    """Every body that passes the depth check can be walked by the recursive checks after it."""
    assert lone_surrogate_at(nested(MAX_JSON_DEPTH, "\ud800")) == "a" + ".0" * (MAX_JSON_DEPTH - 1)
