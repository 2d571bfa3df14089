"""A probe of a design this app does not have yet, for issue #4: vLLM and the OpenAI
endpoint in one Serve replica behind HAProxy ("direct streaming", as Ray Serve LLM's
experimental mode does it), so that a token crosses no second Python process, against
plain vLLM (and our app, in its default layout for one vLLM replica: the ingress and its
worker in one process) with ``compare_vllm``'s load, alternated.

    python -m loadtests.direct_streaming_probe [--rounds 3] [--concurrency 8,32]
        [--systems direct,vllm,ours] [--out FILE.json]

The ``direct`` replica is only what the ceiling needs: a completions endpoint that takes
token ids and streams one SSE chunk per engine delta, with usage; no validation,
sessions, KV data plane, admission or placement (the app's ingress and router do those).
Its point is where the CPU goes per 1000 output tokens (this machine's throughput moves
by tens of percent between minutes; the CPU split moves much less). Starts its own Ray or
vLLM server per system; loopback only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from pathlib import Path

from fastapi import FastAPI, Request
from ray import serve
from starlette.responses import JSONResponse, StreamingResponse

from loadtests import compare_vllm as cv

_app = FastAPI()


@serve.deployment(max_ongoing_requests=1024)
@serve.ingress(_app)
class Direct:
    async def __init__(self, app_args: dict):
        from app.config import AppConfig
        from deployments.compute.engines import create_engine

        self._engine = create_engine(AppConfig.model_validate(app_args))
        await self._engine.start()

    @_app.get("/ready")
    async def ready(self):
        return JSONResponse({"ready": True})

    @_app.post("/v1/completions")
    async def completions(self, request: Request):
        from deployments.compute.engines.protocol import GenerationRequest, SamplingParams

        body = await request.json()
        prompt = [int(t) for t in body["prompt"]]
        gen = GenerationRequest(
            uuid.uuid4().hex,
            prompt,
            SamplingParams(
                max_tokens=int(body["max_tokens"]),
                temperature=float(body.get("temperature", 1.0)),
                ignore_eos=bool(body.get("ignore_eos", False)),
            ),
        )
        head = {"id": "cmpl-" + gen.request_id, "object": "text_completion", "created": int(time.time()), "model": body["model"]}

        async def sse():
            n = 0
            async for d in self._engine.generate(gen):
                n += len(d.token_ids)
                choice = {"index": 0, "text": d.text, "logprobs": None, "finish_reason": d.finish_reason}
                yield "data: " + json.dumps(head | {"choices": [choice]}, separators=(",", ":")) + "\n\n"
            usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
            yield "data: " + json.dumps(head | {"choices": [], "usage": usage}, separators=(",", ":")) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")


class DirectApp(cv.OurApp):
    """A local Ray with the ``Direct`` replica (the vLLM engine as our config sets it up),
    behind HAProxy."""

    def __init__(self, model_path, args, port: int):
        super().__init__(model_path, args, port)
        self.ingress = "haproxy"

    def application(self):
        from app.builder import THROUGHPUT_ENV
        from app.config import AppConfig
        from deployments.compute.deployment import placement_options

        opts = placement_options(AppConfig.model_validate(self.app_args))
        opts["ray_actor_options"]["runtime_env"] = {"env_vars": dict(THROUGHPUT_ENV)}
        return Direct.options(**opts).bind(self.app_args)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.direct_streaming_probe")
    p.add_argument("--model-dir", default="models/tiny")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", default="8,32")
    p.add_argument("--systems", default="direct,vllm", help="of direct, vllm, ours (ours behind HAProxy)")
    p.add_argument("--prompts-per-slot", type=int, default=4)
    p.add_argument("--port", type=int, default=8124)
    p.add_argument("--out", default="loadtests/results/direct_streaming_probe.json")
    a = p.parse_args(argv)
    args = argparse.Namespace(
        model_dir=a.model_dir, input_len=128, output_len=64, prompts_per_slot=a.prompts_per_slot,
        min_prompts=16, max_num_seqs=32, kv_gib=1.0, stream_max_messages_per_s=None, ingress="haproxy",
        port=a.port, start_timeout_s=600, seed=0, concurrency=[int(c) for c in a.concurrency.split(",")],
    )
    from app.model_builder import ensure_model

    model_path = ensure_model(Path(args.model_dir), "tiny")
    args.vocab_size = json.loads((model_path / "config.json").read_text())["vocab_size"]
    systems = {
        "direct": lambda: DirectApp(model_path, args, args.port),
        "ours": lambda: cv.OurApp(model_path, args, args.port),
        "vllm": lambda: cv.VLLMServer(cv.vllm_flags(model_path, args), args.port, Path("/tmp/direct_streaming_probe_vllm.log")),
    }
    names = [s for s in a.systems.split(",") if s]
    unknown = [s for s in names if s not in systems]
    if unknown:
        p.error(f"unknown systems: {unknown}")
    levels: list[dict] = []
    for rnd in range(1, a.rounds + 1):
        for name in names:
            server = systems[name]()
            server.start(args.start_timeout_s)
            try:
                levels += cv.measure(f"http://127.0.0.1:{args.port}", name, rnd, args)
            finally:
                server.stop()
    for lv in levels:
        print(
            f"{lv['system']:7s} r{lv['round']} c={lv['concurrency']:<3d} out tok/s {lv['output_throughput']:8.1f} "
            f"TTFT p50 {lv['p50_ttft_ms']:7.1f} ms  CPU ms/1k tokens {json.dumps(lv.get('cpu_ms_per_1k_output_tokens', {}))}",
            flush=True,
        )
    summary = {s: cv.ratios(levels, args.concurrency, a=s, b="vllm") for s in names if s != "vllm" and "vllm" in names}
    print(json.dumps(summary, indent=1))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"levels": levels, "ratios": summary}, indent=1))
    print(f"[direct_streaming_probe] stored {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
