"""LoRA adapters through the real application, on both engines: a request whose ``model``
names an adapter (``model.lora_modules``) gets the greedy tokens of the base model with
that adapter merged into its weights (computed here, in-process, with the engine's own
model code: W + s * B A, what PEFT and vLLM compute), in a batch beside requests of the
base model and of another adapter; an adapter's cached KV is its own; /v1/models lists
the adapters; an unknown model is a 404."""

from __future__ import annotations

import concurrent.futures
import random

import httpx
import pytest
import torch

from app.model_builder import build_lora_adapter
from tests.fixtures.models import get_model_path, merged_lora_model
from tests.fixtures.serve_app import ENGINE_ARGS, app_args, deployed_app, vllm_importable, wait_for

pytestmark = pytest.mark.integration

MODEL = "tiny-llama"
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-adapters")
    model = get_model_path("tiny")
    return {
        "a1": build_lora_adapter(model, root / "a1", seed=11),
        # Another rank, attention only: the batch pads ranks and skips the MLP for it.
        "team/a2": build_lora_adapter(model, root / "a2", seed=12, rank=4, targets=["q_proj", "v_proj", "o_proj"]),
    }


@pytest.fixture(scope="module", params=sorted(ENGINE_ARGS))
def lora_app(request, ray_cluster, redis_server, http_port, adapters):
    engine = request.param
    if engine == "vllm" and not vllm_importable():
        pytest.skip("vLLM is not installed here (scripts/install_vllm_cpu.sh)")
    args = app_args(get_model_path("tiny"), redis_server.url, engine=ENGINE_ARGS[engine])
    args["model"]["lora_modules"] = [{"name": name, "path": str(path)} for name, path in adapters.items()]
    with deployed_app(args, "lora", "/lora", http_port) as base_url:
        yield base_url


def greedy_reference(adapter_path, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    """The base model's greedy tokens with the adapter at ``adapter_path`` (None: none)
    merged into its weights."""
    model = merged_lora_model(get_model_path("tiny"), adapter_path)
    ids, out = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(n):
            token = int(model(ids, use_cache=False).logits[0, -1].argmax())
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def complete(base_url: str, model: str, prompt, **extra) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **extra}
    return httpx.post(base_url + "/v1/completions", json=body, timeout=120)


def test_each_adapter_gives_its_merged_weights_tokens_in_one_batch(lora_app, adapters):
    rng = random.Random(7)
    prompt = [0] + [rng.randrange(10, 1000) for _ in range(20)]
    expected = {
        MODEL: greedy_reference(None, prompt),
        "a1": greedy_reference(adapters["a1"], prompt),
        "team/a2": greedy_reference(adapters["team/a2"], prompt),
    }
    # The adapters change the reply (else this test could not tell them apart).
    assert len({tuple(v) for v in expected.values()}) == 3, expected
    # Alone, then all three models at once twice over (the engines batch them together).
    for model, tokens in expected.items():
        reply = complete(lora_app, model, prompt)
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == model
        assert reply.json()["choices"][0]["token_ids"] == tokens, model
    models = list(expected) * 2
    with concurrent.futures.ThreadPoolExecutor(len(models)) as pool:
        replies = list(pool.map(lambda m: complete(lora_app, m, prompt), models))
    for model, reply in zip(models, replies):
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["token_ids"] == expected[model], model
    # Ray Serve LLM's form of the name: the same adapter.
    reply = complete(lora_app, f"{MODEL}:a1", prompt)
    assert reply.json()["choices"][0]["token_ids"] == expected["a1"]


def test_an_adapters_cached_kv_is_reused_by_that_adapter_only(lora_app):
    rng = random.Random()
    prompt = [rng.randrange(100, 1000) for _ in range(4 * 16 + 1)]  # 4 whole blocks before the last token

    def ask(model):
        reply = complete(lora_app, model, prompt)
        assert reply.status_code == 200, reply.text
        body = reply.json()
        return body["choices"][0]["token_ids"], body["usage"]["prompt_tokens_details"]["cached_tokens"]

    first, cached = ask("a1")
    assert cached == 0
    # The torch engine recomputes a prefix it measured slower to import than to prefill,
    # and imports again after a few such skips.
    for _ in range(6):
        again, cached = ask("a1")
        if cached:
            break
    assert cached == 64 and again == first
    # The base model and the other adapter computed none of it: nothing to reuse.
    for other in (MODEL, "team/a2"):
        tokens, cached = ask(other)
        assert cached == 0, other
        assert tokens != first, other


def test_models_lists_the_adapters_and_an_unknown_model_is_a_404(lora_app):
    cards = httpx.get(lora_app + "/v1/models", timeout=30).json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [(MODEL, None), ("a1", MODEL), ("team/a2", MODEL)]
    card = httpx.get(lora_app + "/v1/models/team/a2", timeout=30)
    assert card.status_code == 200 and card.json()["parent"] == MODEL
    assert httpx.get(lora_app + "/v1/models/a3", timeout=30).status_code == 404
    for unknown in ("a3", f"{MODEL}:a3", "a1:" + MODEL):
        reply = complete(lora_app, unknown, [1, 2, 3])
        assert reply.status_code == 404, unknown
        error = reply.json()["error"]
        assert error["code"] == "model_not_found" and "'a1'" in error["message"], error
    # A chat request names an adapter the same way.
    chat = httpx.post(lora_app + "/v1/chat/completions", timeout=120, json={
        "model": "a1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert chat.status_code == 200 and chat.json()["model"] == "a1", chat.text


def test_usage_is_counted_per_adapter(lora_app):
    assert complete(lora_app, "team/a2", [5, 6, 7]).status_code == 200

    def counted():
        text = httpx.get(lora_app + "/metrics", timeout=30).text
        lines = text.splitlines()
        tokens = any(line.startswith("ray_llm_generation_tokens_total") and 'model="team/a2"' in line for line in lines)
        feature = any(line.startswith("ray_llm_request_features_total") and 'feature="lora"' in line for line in lines)
        return tokens and feature

    wait_for(counted, 60, "llm_generation_tokens_total{model=\"team/a2\"} and llm_request_features{feature=\"lora\"}")


def test_grpc_names_the_adapter_as_rest_does(lora_app, grpc_port):
    import grpc

    from app.grpc_api import llm_pb2 as pb
    from app.grpc_api import llm_pb2_grpc

    app = (("application", "lora"),)
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = llm_pb2_grpc.LLMStub(channel)
        models = stub.ListModels(pb.ListModelsRequest(), metadata=app, timeout=60).data
        assert [(m.id, m.parent if m.HasField("parent") else None, m.root) for m in models] == [
            (MODEL, None, MODEL), ("a1", MODEL, MODEL), ("team/a2", MODEL, MODEL)]
        prompt = [0, 21, 22, 23, 24, 25]
        got = stub.Completion(pb.CompletionRequest(model="team/a2", prompt_token_ids=prompt, max_tokens=NEW_TOKENS,
                                                   temperature=0), metadata=app, timeout=120)
        want = complete(lora_app, "team/a2", prompt).json()
        assert got.model == "team/a2" and got.choices[0].text == want["choices"][0]["text"]
        base = stub.Completion(pb.CompletionRequest(model=MODEL, prompt_token_ids=prompt, max_tokens=NEW_TOKENS,
                                                    temperature=0), metadata=app, timeout=120)
        assert base.choices[0].text != got.choices[0].text
        with pytest.raises(grpc.RpcError) as e:
            stub.Completion(pb.CompletionRequest(model="a3", prompt_token_ids=prompt, max_tokens=2),
                            metadata=app, timeout=60)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_session_turn_with_an_adapter_reuses_its_history_kv(lora_app):
    sid = httpx.post(lora_app + "/v1/sessions", timeout=30).json()["id"]
    words = " ".join(f"w{i}" for i in range(60))  # a first turn of several whole blocks

    def turn(text):
        reply = httpx.post(lora_app + "/v1/chat/completions", headers={"X-Session-Id": sid}, timeout=120, json={
            "model": "a1", "messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == "a1"
        return reply.json()["usage"]

    first = turn(words)
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    # The next turns' prompts start with the first turn's (its KV, computed with a1). The
    # torch engine recomputes a prefix it measured slower to import, then imports again.
    cached = 0
    for i in range(4):
        cached = turn(f"and {i}")["prompt_tokens_details"]["cached_tokens"]
        if cached:
            break
    assert cached >= 16
