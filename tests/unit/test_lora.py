"""LoRA adapters: reading PEFT's format, and the native model's per-row application
against the same adapter merged into the weights (W + s * B A), which is what PEFT and
vLLM compute (an integration test compares the served replies on both engines)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from app.model_builder import build_lora_adapter
from deployments.compute.engines import llama, lora
from deployments.compute.engines.kv import block_hashes
from deployments.compute.engines.llama import LlamaForCausalLM
from tests.fixtures.models import merged_lora_model, tiny_model_path  # noqa: F401 - fixture


@pytest.fixture(scope="module")
def adapters(tiny_model_path, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("lora")
    return {
        "a1": build_lora_adapter(tiny_model_path, root / "a1", seed=1),
        # Another rank, attention layers only, rsLoRA's scaling.
        "a2": build_lora_adapter(tiny_model_path, root / "a2", seed=2, rank=4, targets=["q_proj", "v_proj"]),
    }


def _rslora(path):
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg["use_rslora"] = True
    (path / "adapter_config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("all_adapters", [True, False], ids=["every-adapter", "the-batch's-adapters"])
def test_rows_of_different_adapters_match_each_adapter_merged(tiny_model_path, adapters, all_adapters, monkeypatch):  # noqa: F811
    if not all_adapters:  # the path for many loaded adapters: only those in the batch
        monkeypatch.setattr(llama, "LORA_ALL_ADAPTERS_MAX_RANK", 0)
    _rslora(adapters["a2"])
    infos = [lora.read_adapter(name, path) for name, path in adapters.items()]
    assert infos[1].rslora and infos[1].scaling == pytest.approx(16 / 2)  # alpha / sqrt(4)
    model = LlamaForCausalLM.from_pretrained(tiny_model_path)
    shapes = model.lora_shapes()
    model.set_adapters([lora.load_weights(i, model.config.num_hidden_layers, shapes) for i in infos])
    references = [merged_lora_model(tiny_model_path, path) for path in (None, adapters["a1"], adapters["a2"])]
    ids = torch.tensor([[0, 10, 11, 12, 13, 14, 15, 16]] * 4)
    with torch.no_grad():
        expected = [ref(ids[:1], use_cache=False).logits[0] for ref in references]
        # The adapters change the output (else the comparisons below prove nothing).
        assert (expected[1] - expected[0]).abs().max() > 0.1 and (expected[2] - expected[0]).abs().max() > 0.1
        # Rows of all three; of one adapter beside the base model's; of one adapter (its
        # own path); of the other adapter only.
        for rows in ([0, 1, 2, 1], [2, 0, 0, 2], [1, 1], [2]):
            out = model(ids[: len(rows)], use_cache=False, lora_rows=rows).logits
            for row, slot in enumerate(rows):
                torch.testing.assert_close(out[row], expected[slot], rtol=1e-3, atol=1e-3, msg=f"{rows} row {row}")
        # After a call with adapters, a call without is the base model again.
        torch.testing.assert_close(model(ids[:1], use_cache=False).logits[0], expected[0])
        with pytest.raises(ValueError, match="lora_rows"):
            model(ids, use_cache=False, lora_rows=[1, 0])


def test_read_adapter_refuses_what_the_engines_do_not_apply(tiny_model_path, tmp_path, adapters):  # noqa: F811
    info = lora.read_adapter("a1", adapters["a1"])
    assert (info.rank, info.alpha, info.scaling) == (8, 16.0, 2.0)
    cfg = json.loads((adapters["a1"] / "adapter_config.json").read_text())
    for change, words in (
        ({"use_dora": True}, "use_dora"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "bias"),
        ({"peft_type": "IA3"}, "peft_type"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
        ({"r": 1024}, "rank 1024"),
    ):
        bad = tmp_path / words.replace(" ", "_")
        bad.mkdir()
        (bad / "adapter_config.json").write_text(json.dumps({**cfg, **change}))
        (bad / "adapter_model.safetensors").write_bytes((adapters["a1"] / "adapter_model.safetensors").read_bytes())
        with pytest.raises(ValueError, match=words):
            lora.read_adapter("x", bad)
    with pytest.raises(ValueError, match="not a directory"):
        lora.read_adapter("x", tmp_path / "nowhere")
    with pytest.raises(ValueError, match="name"):
        lora.read_adapter("has space", adapters["a1"])
    # Weights of another model's shapes: named, not a crash inside a matmul later.
    other = build_lora_adapter(tiny_model_path, tmp_path / "other", seed=3)
    model = LlamaForCausalLM.from_pretrained(tiny_model_path)
    shapes = {**model.lora_shapes(), "q_proj": (7, 9)}
    with pytest.raises(ValueError, match="q_proj has A"):
        lora.load_weights(lora.read_adapter("o", other), model.config.num_hidden_layers, shapes)
    with pytest.raises(ValueError, match="names layer 1, the model has 1"):
        lora.load_weights(lora.read_adapter("o", other), 1, model.lora_shapes())


def test_vllm_max_lora_rank_is_the_smallest_allowed_that_fits():
    def info(rank):
        return lora.AdapterInfo("a", "/", rank, 16.0, False)

    assert lora.vllm_max_lora_rank([info(4)]) == 8
    assert lora.vllm_max_lora_rank([info(8), info(16)]) == 16
    assert lora.vllm_max_lora_rank([info(300)]) == 320


def test_adapter_of_reads_both_forms_of_the_model_field():
    names = {"sql", "chat-v2"}
    assert lora.adapter_of("base", "base", names) is None
    assert lora.adapter_of("sql", "base", names) == "sql"
    assert lora.adapter_of("base:chat-v2", "base", names) == "chat-v2"
    for unknown in ("other", "base:other", "sql:base"):
        with pytest.raises(KeyError):
            lora.adapter_of(unknown, "base", names)


def test_an_adapters_blocks_hash_apart_from_the_base_models_and_each_others():
    ids = list(range(64))
    base = block_hashes("m", "t", ids, 16)
    a1, a2 = block_hashes("m", "t", ids, 16, lora="a1"), block_hashes("m", "t", ids, 16, lora="a2")
    assert len({base[0], a1[0], a2[0]}) == 3
    assert block_hashes("m", "t", ids, 16, lora="a1") == a1
    assert block_hashes("m", "t", ids, 16, salt="s", lora="a1")[0] not in (a1[0], block_hashes("m", "t", ids, 16, salt="s")[0])


def _info(name, rank):
    return lora.AdapterInfo(name, f"/adapters/{name}", rank, 16.0, False)


def test_vllm_lora_options_keep_an_empty_slot_on_a_cpu():
    from app.config import VLLMOptions
    from deployments.compute.engines.vllm_engine import engine_args_kwargs, lora_kwargs

    two = [_info("a", 8), _info("b", 16)]
    assert lora_kwargs([], VLLMOptions(), on_cpu=False) is None
    # A GPU: every adapter in a batch (up to 8), the smallest rank that fits all.
    assert lora_kwargs(two, VLLMOptions(), on_cpu=False) == {"max_loras": 2, "max_lora_rank": 16, "max_cpu_loras": 2}
    assert lora_kwargs(two, VLLMOptions(max_loras=1, max_lora_rank=32), on_cpu=False) == {
        "max_loras": 1, "max_lora_rank": 32, "max_cpu_loras": 2}
    # A CPU: one slot more than adapters, whatever was asked (vLLM's CPU ops read a base
    # row's slot -1 as the last slot, which must stay empty).
    assert lora_kwargs(two, VLLMOptions(), on_cpu=True)["max_loras"] == 3
    assert lora_kwargs(two, VLLMOptions(max_loras=1), on_cpu=True)["max_loras"] == 3
    with pytest.raises(ValueError, match=r"max_lora_rank is 8; adapters above it: b \(rank 16\)"):
        lora_kwargs(two, VLLMOptions(max_lora_rank=8), on_cpu=False)
    kwargs = engine_args_kwargs(
        model_path="/m", served_model_name="m", dtype="float32", max_model_len=None, max_num_seqs=8,
        options=VLLMOptions(), on_cpu=True, lora=lora_kwargs(two, VLLMOptions(), on_cpu=True),
    )
    assert (kwargs["enable_lora"], kwargs["max_loras"], kwargs["max_lora_rank"], kwargs["max_cpu_loras"]) == (True, 3, 16, 3)
    assert "enable_lora" not in engine_args_kwargs(
        model_path="/m", served_model_name="m", dtype="float32", max_model_len=None, max_num_seqs=8,
        options=VLLMOptions(), on_cpu=True,
    )


def test_the_config_refuses_adapters_it_cannot_serve():
    from pydantic import ValidationError

    from app.config import AppConfig

    ok = AppConfig.model_validate({"model": {"lora_modules": [{"name": "sql", "path": "adapters/sql"}]}})
    assert ok.model.lora_paths() == {"sql": str((Path("adapters/sql")).resolve())}
    for model, engine, words in (
        ({"lora_modules": [{"name": "a", "path": "x"}, {"name": "a", "path": "y"}]}, {}, "names \\['a'\\] more than once"),
        ({"id": "m", "lora_modules": [{"name": "m", "path": "x"}]}, {}, "may not be called 'm'"),
        ({"lora_modules": [{"name": "has space", "path": "x"}]}, {}, "pattern"),
        ({"lora_modules": [{"name": "a", "path": "x"}]}, {"model_impl": "transformers"}, "native model"),
        ({}, {"vllm": {"max_loras": 2}}, "need model.lora_modules"),
        ({"lora_modules": [{"name": "a", "path": "x"}]}, {"name": "vllm", "vllm": {"max_lora_rank": 12}}, "max_lora_rank"),
    ):
        with pytest.raises(ValidationError, match=words):
            AppConfig.model_validate({"model": model, "engine": engine})


def test_the_torch_engine_refuses_an_adapter_it_does_not_hold(tiny_model_path, adapters):  # noqa: F811
    import asyncio

    from deployments.compute.engines.protocol import GenerationRequest, RequestRejected, SamplingParams
    from deployments.compute.engines.torch_engine import TorchEngine

    engine = TorchEngine(str(tiny_model_path), lora_modules={"a1": str(adapters["a1"])})
    with pytest.raises(RequestRejected, match="no LoRA adapter 'a2'") as e:
        asyncio.run(anext(engine.generate(GenerationRequest("r", [1, 2, 3], SamplingParams(max_tokens=2), lora="a2"))))
    assert e.value.param == "model"
    with pytest.raises(ValueError, match="native model"):
        TorchEngine(str(tiny_model_path), model_impl="transformers", lora_modules={"a1": str(adapters["a1"])})


def test_build_app_refuses_an_adapter_before_any_replica_starts(tmp_path, adapters):
    from app.builder import build_app

    base = {"model": {"lora_modules": [{"name": "a1", "path": str(adapters["a1"])}]}}
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora"):
        build_app({"model": {"lora_modules": [{"name": "d", "path": str(tmp_path)}]}})
    with pytest.raises(ValueError, match=r"max_lora_rank is 1; adapters above it: a1 \(rank 8\)"):
        build_app({**base, "engine": {"name": "vllm", "vllm": {"max_lora_rank": 1}}})


def test_an_adapters_tenants_are_checked_names():
    from pydantic import ValidationError

    from app.config import AppConfig

    cfg = AppConfig.model_validate({"model": {"lora_modules": [
        {"name": "a", "path": "x", "tenants": ["acme", "globex"]}, {"name": "b", "path": "y"}]}})
    assert cfg.model.lora_tenants() == {"a": frozenset({"acme", "globex"}), "b": None}
    for tenants in ([], ["not a tenant"]):
        with pytest.raises(ValidationError):
            AppConfig.model_validate({"model": {"lora_modules": [{"name": "a", "path": "x", "tenants": tenants}]}})
