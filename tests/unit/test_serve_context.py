"""serve_context.spawn: a task whose Serve handle calls carry an internal request id of
their own (two calls to one deployment in flight from one request are otherwise mistaken
for each other by Serve's router), keeping the request's public id for its log lines."""

from __future__ import annotations

import asyncio
import dataclasses

from ray.serve import context as serve_context

from app.serve_context import spawn


def _ids() -> tuple[str, str]:
    ctx = serve_context._get_serve_request_context()
    return ctx.request_id, ctx._internal_request_id


def test_a_spawned_task_gets_its_own_internal_id_and_keeps_the_request_id():
    async def main():
        base = serve_context._get_serve_request_context()
        serve_context._serve_request_context.set(
            dataclasses.replace(base, request_id="req-1", _internal_request_id="internal-1")
        )

        async def ids():
            return _ids()

        first, second = await asyncio.gather(spawn(ids()), spawn(ids()))
        assert first[0] == second[0] == "req-1"
        assert len({first[1], second[1], "internal-1"}) == 3
        assert _ids() == ("req-1", "internal-1")  # the request's own context is untouched

    asyncio.run(main())


def test_outside_a_request_nothing_changes():
    async def main():
        async def ids():
            return _ids()

        assert await spawn(ids()) == _ids()

    asyncio.run(main())
