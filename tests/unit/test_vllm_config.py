"""Our config → vLLM's engine and sampling arguments. Pure mapping: runs without vLLM
(the last test also checks the names against vLLM's AsyncEngineArgs when it is there)."""

import importlib.util
import subprocess
import sys

import pytest

from app.config import AppConfig, VLLMOptions
from deployments.compute.engines.protocol import EngineError, GenerationRequest, SamplingParams
from deployments.compute.engines.vllm_engine import (
    cpu_reserved_cores_env,
    DEFAULT_CPU_KV_CACHE_GIB,
    GIB,
    KV_CONNECTOR_MODULE,
    KV_CONNECTOR_NAME,
    VLLMEngine,
    engine_args_kwargs,
    kv_transfer_kwargs,
    kv_transfer_params,
    delta_logprobs,
    sampling_params_kwargs,
    vllm_kv_block_size,
)


def _kwargs(options=None, *, on_cpu=True, **overrides):
    base = dict(
        model_path="/models/m",
        served_model_name="tiny-llama",
        dtype="float32",
        max_model_len=None,
        max_num_seqs=8,
        options=options or VLLMOptions(),
        on_cpu=on_cpu,
    )
    base.update(overrides)
    return engine_args_kwargs(**base)


def test_defaults_map_one_to_one():
    kw = _kwargs()
    assert kw["model"] == kw["tokenizer"] == "/models/m"
    assert kw["served_model_name"] == "tiny-llama"
    assert kw["dtype"] == "float32"
    assert kw["max_num_seqs"] == 8
    assert kw["tensor_parallel_size"] == 1 and kw["pipeline_parallel_size"] == 1
    assert kw["gpu_memory_utilization"] == 0.9
    assert kw["enable_prefix_caching"] is True
    assert kw["kv_cache_dtype"] == "auto"
    assert kw["enforce_eager"] is False
    assert kw["seed"] == 0
    assert kw["trust_remote_code"] is False
    assert kw["disable_log_stats"] is True
    # Unset options are left to vLLM.
    for absent in ("max_model_len", "max_num_batched_tokens", "quantization"):
        assert absent not in kw


def test_every_option_is_passed():
    options = VLLMOptions(
        tensor_parallel_size=2,
        pipeline_parallel_size=3,
        gpu_memory_utilization=0.5,
        max_num_batched_tokens=4096,
        enable_prefix_caching=False,
        kv_cache_dtype="fp8",
        quantization="awq",
        enforce_eager=True,
        cpu_kv_cache_space_gib=0.25,
        seed=7,
    )
    kw = _kwargs(options, max_model_len=512, dtype="bfloat16", max_num_seqs=3)
    assert kw["tensor_parallel_size"] == 2
    assert kw["pipeline_parallel_size"] == 3
    assert kw["gpu_memory_utilization"] == 0.5
    assert kw["max_num_batched_tokens"] == 4096
    assert kw["enable_prefix_caching"] is False
    assert kw["kv_cache_dtype"] == "fp8"
    assert kw["quantization"] == "awq"
    assert kw["enforce_eager"] is True
    assert kw["kv_cache_memory_bytes"] == GIB // 4  # fractions of a GiB are kept
    assert kw["seed"] == 7
    assert kw["max_model_len"] == 512
    assert kw["dtype"] == "bfloat16"
    assert kw["max_num_seqs"] == 3


def test_kv_cache_size_on_cpu_and_gpu():
    # CPU without a size: a bounded default, never a fraction of host memory.
    assert _kwargs(on_cpu=True)["kv_cache_memory_bytes"] == int(DEFAULT_CPU_KV_CACHE_GIB * GIB)
    # GPU without a size: vLLM sizes it from gpu_memory_utilization.
    assert "kv_cache_memory_bytes" not in _kwargs(on_cpu=False)
    # An explicit size applies on either.
    explicit = VLLMOptions(cpu_kv_cache_space_gib=2)
    assert _kwargs(explicit, on_cpu=False)["kv_cache_memory_bytes"] == 2 * GIB


def test_from_app_config(tiny_model_path):
    cfg = AppConfig.model_validate(
        {
            "model": {"id": "m1", "path": str(tiny_model_path), "max_model_len": 256},
            "engine": {"name": "vllm", "max_num_seqs": 4, "vllm": {"enforce_eager": True, "seed": 3}},
        }
    )
    engine = VLLMEngine.from_app_config(cfg)
    kw = engine.engine_kwargs
    assert kw["model"] == str(tiny_model_path.resolve())
    assert kw["served_model_name"] == "m1"
    assert kw["max_model_len"] == 256 and engine.max_model_len == 256
    assert kw["max_num_seqs"] == 4 and engine.max_num_seqs == 4
    assert kw["enforce_eager"] is True and kw["seed"] == 3
    assert engine.tokenizer is not None
    assert engine.capabilities.continuous_batching is True
    assert engine.capabilities.wants_router_batching is False
    # The default config reuses KV through the data plane: vLLM gets our connector.
    assert engine.kv_connected and engine.capabilities.supports_kv_export is True
    assert kw["kv_transfer_config"]["kv_connector"] == KV_CONNECTOR_NAME
    # Without a configured length the checkpoint's own applies.
    default = VLLMEngine.from_app_config(AppConfig.model_validate({"model": {"path": str(tiny_model_path)}}))
    assert "max_model_len" not in default.engine_kwargs
    assert default.max_model_len == 2048


def _kv(**overrides):
    base = dict(
        model_id="m1",
        block_size=32,
        redis_url="redis://10.0.0.5:6380/2",
        redis_password_env="REDIS_PASSWORD",
        socket_timeout_s=2.0,
        connect_timeout_s=1.0,
        retry_interval_s=1.0,
        kv_ttl_s=600,
        session_ttl_s=1800,
    )
    base.update(overrides)
    return kv_transfer_kwargs(**base)


def test_kv_transfer_kwargs_name_our_connector_and_never_the_password():
    kv = _kv()
    assert kv["kv_connector"] == KV_CONNECTOR_NAME
    assert kv["kv_connector_module_path"] == KV_CONNECTOR_MODULE
    assert kv["kv_role"] == "kv_both"
    assert kv["kv_load_failure_policy"] == "recompute"  # a bad block is recomputed, not an error
    extra = kv["kv_connector_extra_config"]
    assert extra["model_id"] == "m1" and extra["block_size"] == 32
    assert extra["redis_url"] == "redis://10.0.0.5:6380/2"
    assert extra["redis_password_env"] == "REDIS_PASSWORD"  # the variable's name only
    assert extra["kv_ttl_s"] == 600 and extra["session_ttl_s"] == 1800
    # engine_args_kwargs passes it through and pins vLLM's block size to the connector's.
    kw = _kwargs(kv_transfer=kv)
    assert kw["kv_transfer_config"] is kv and kw["block_size"] == 32
    assert "kv_transfer_config" not in _kwargs() and "block_size" not in _kwargs()


def test_vllm_block_size_on_cpu_is_a_multiple_of_32():
    assert vllm_kv_block_size(16, on_cpu=False) == 16
    assert vllm_kv_block_size(16, on_cpu=True) == 32
    assert vllm_kv_block_size(32, on_cpu=True) == 32
    assert vllm_kv_block_size(48, on_cpu=True) == 64


def test_with_our_connector_on_a_cpu_vllm_reserves_only_its_schedulers_cores():
    """vLLM's CPU build reserves one more core per rank for any KV connector (NIXL's
    threads); ours has none, and on 2 cores that reserve left the forward bound to both."""
    connected = {"kv_transfer_config": {"kv_connector": "DataPlaneKVConnector"}}
    assert cpu_reserved_cores_env(connected, on_cpu=True, environ={}) == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    sharded = {**connected, "tensor_parallel_size": 2, "pipeline_parallel_size": 2}
    assert cpu_reserved_cores_env(sharded, on_cpu=True, environ={}) == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "4"}
    # The operator's own setting stands; no connector or a GPU: nothing to change.
    assert cpu_reserved_cores_env(connected, on_cpu=True, environ={"VLLM_CPU_NUM_OF_RESERVED_CPU": "2"}) == {}
    assert cpu_reserved_cores_env({}, on_cpu=True, environ={}) == {}
    assert cpu_reserved_cores_env(connected, on_cpu=False, environ={}) == {}


def test_from_app_config_connects_only_when_kv_reuse_is_on(tiny_model_path):
    def engine(dataplane):
        cfg = AppConfig.model_validate(
            {"model": {"id": "m1", "path": str(tiny_model_path)}, "engine": {"name": "vllm"}, "dataplane": dataplane}
        )
        return VLLMEngine.from_app_config(cfg)

    on = engine(
        {"block_size": 16, "kv_ttl_s": 99, "redis": {"url": "redis://r:1/0", "password_env": "PW"}}
    )
    extra = on.engine_kwargs["kv_transfer_config"]["kv_connector_extra_config"]
    assert extra["model_id"] == "m1" and extra["redis_url"] == "redis://r:1/0"
    assert extra["redis_password_env"] == "PW" and extra["kv_ttl_s"] == 99
    assert on.engine_kwargs["block_size"] == extra["block_size"] in (16, 32)  # GPU / CPU
    assert extra["kv_redis_url"] is None  # blocks share the one server
    split = engine({"redis": {"url": "redis://r:1/0"}, "kv_redis": {"url": "redis://kv:2/0", "password_env": "KVPW"}})
    extra = split.engine_kwargs["kv_transfer_config"]["kv_connector_extra_config"]
    assert extra["redis_url"] == "redis://r:1/0"
    assert (extra["kv_redis_url"], extra["kv_redis_password_env"]) == ("redis://kv:2/0", "KVPW")
    # The connector reads and writes blocks on the KV server, session block lists on the
    # durable one; with no KV server configured both are the one server.
    from deployments.compute.engines.vllm_kv_connector import _Redis

    assert _Redis(extra, "kv_redis_").url == "redis://kv:2/0" and _Redis(extra).url == "redis://r:1/0"
    assert _Redis({**extra, "kv_redis_url": None}, "kv_redis_").url == "redis://r:1/0"
    for off in ({"kv_reuse": False}, {"enabled": False}):
        eng = engine(off)
        assert "kv_transfer_config" not in eng.engine_kwargs
        assert not eng.kv_connected and eng.capabilities.supports_kv_export is False
        assert VLLMEngine.capabilities.supports_kv_export is False  # the class is untouched


def test_kv_transfer_params_carry_tenant_and_session():
    def req(**kw):
        return GenerationRequest(request_id="r", prompt_token_ids=[1], sampling=SamplingParams(max_tokens=1), **kw)

    assert kv_transfer_params(req()) == {"tenant": "default"}
    assert kv_transfer_params(req(tenant="acme", session_id="s1")) == {"tenant": "acme", "session_id": "s1"}
    # A stored response's blocks are listed under its id (its DELETE erases them).
    assert kv_transfer_params(req(kv_owner="resp_1")) == {"tenant": "default", "session_id": "resp_1"}
    assert kv_transfer_params(req(cache_salt="s")) == {"tenant": "default", "cache_salt": "s"}


def test_vllms_own_prefix_cache_is_salted_by_tenant_and_cache_salt():
    from deployments.compute.engines.vllm_engine import vllm_cache_salt

    def req(**kw):
        return GenerationRequest(request_id="r", prompt_token_ids=[1], sampling=SamplingParams(max_tokens=1), **kw)

    assert vllm_cache_salt(req()) is None
    assert vllm_cache_salt(req(tenant="acme")) == "acme"
    salted = {vllm_cache_salt(req(cache_salt="s")), vllm_cache_salt(req(tenant="acme", cache_salt="s")),
              vllm_cache_salt(req(tenant="acme", cache_salt="t"))}
    assert len(salted) == 3 and not salted & {None, "acme", "s"}


def test_sampling_params_mapping():
    greedy = sampling_params_kwargs(SamplingParams(max_tokens=5, temperature=0.0, top_p=0.5))
    assert greedy["temperature"] == 0.0 and greedy["top_p"] == 1.0  # top_p is moot when greedy
    assert greedy["max_tokens"] == 5 and greedy["n"] == 1
    assert "stop" not in greedy and greedy["seed"] is None and greedy["ignore_eos"] is False
    sampled = sampling_params_kwargs(
        SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, seed=42, stop=["\n", "END"], ignore_eos=True)
    )
    assert sampled == {
        "n": 1,
        "max_tokens": 9,
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 42,
        "ignore_eos": True,
        "skip_special_tokens": True,
        "include_stop_str_in_output": False,
        "stop": ["\n", "END"],
    }


def test_a_negative_seed_reaches_vllm_as_the_seed_torch_would_use():
    import torch

    for seed in (-1, -2, -(2**63)):
        mapped = sampling_params_kwargs(SamplingParams(max_tokens=1, temperature=1.0, seed=seed))["seed"]
        assert mapped >= 0 and mapped == torch.Generator().manual_seed(seed).initial_seed()
    assert sampling_params_kwargs(SamplingParams(max_tokens=1, seed=0))["seed"] == 0
    assert sampling_params_kwargs(SamplingParams(max_tokens=1, seed=2**63 - 1))["seed"] == 2**63 - 1


def _vllm_config(vllm: dict, **engine):
    return AppConfig.model_validate({"engine": {"name": "vllm", "vllm": vllm, **engine}})


@pytest.mark.parametrize(
    "vllm, engine, names",
    [
        ({"tensor_paralel_size": 2}, {}, "tensor_paralel_size"),  # a typo names itself
        ({"gpu_memory_utilization": 0}, {}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": 0.96}, {}, "gpu_memory_utilization"),
        ({"tensor_parallel_size": 0}, {}, "tensor_parallel_size"),
        ({"quantization": "notaquant"}, {}, "quantization"),
        ({"kv_cache_dtype": "int3"}, {}, "kv_cache_dtype"),
        ({"cpu_kv_cache_space_gib": 0}, {}, "cpu_kv_cache_space_gib"),
        ({"max_num_batched_tokens": 16}, {"max_num_seqs": 32}, "max_num_batched_tokens"),
    ],
)
def test_a_bad_vllm_option_is_an_error_that_names_it(vllm, engine, names):
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as err:
        _vllm_config(vllm, **engine)
    assert names in str(err.value)


def test_vllm_options_at_their_bounds_are_taken():
    cfg = _vllm_config(
        {"gpu_memory_utilization": 0.95, "quantization": "awq", "max_num_batched_tokens": 32}, max_num_seqs=32
    )
    assert cfg.engine.vllm.gpu_memory_utilization == 0.95 and cfg.engine.vllm.quantization == "awq"
    assert VLLMOptions().gpu_memory_utilization == 0.9


def test_module_imports_without_vllm():
    code = (
        "import sys; import deployments.compute.engines.vllm_engine as m; "
        "assert 'vllm' not in sys.modules, 'vllm imported at module import'; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_kwargs_are_valid_vllm_engine_args():
    from vllm.engine.arg_utils import AsyncEngineArgs

    options = VLLMOptions(max_num_batched_tokens=4096, quantization="awq", cpu_kv_cache_space_gib=0.5)
    kw = _kwargs(options, max_model_len=512, kv_transfer=_kv(),
                 lora={"max_loras": 3, "max_lora_rank": 16, "max_cpu_loras": 3})
    kv = kw.pop("kv_transfer_config")
    args = AsyncEngineArgs(**kw)  # a dataclass: an unknown name raises TypeError
    for key, value in kw.items():
        assert getattr(args, key) == value, key
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(**kv)  # every name is a KVTransferConfig field
    assert ktc.kv_connector == KV_CONNECTOR_NAME and ktc.kv_load_failure_policy == "recompute"
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    cls = KVConnectorFactory.get_connector_class(ktc)  # importable by vLLM, new-style signature
    assert cls.__name__ == KV_CONNECTOR_NAME
    import vllm

    params = vllm.SamplingParams(**sampling_params_kwargs(SamplingParams(max_tokens=4, temperature=0, stop=["x"])))
    assert params.max_tokens == 4 and params.stop == ["x"]
    seeded = vllm.SamplingParams(**sampling_params_kwargs(SamplingParams(max_tokens=4, temperature=1.0, seed=-1)))
    assert seeded.seed == 2**64 - 1  # vLLM would have dropped -1
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    # Our list of quantization methods is vLLM's.
    assert set(VLLMOptions.model_fields["quantization"].annotation.__args__[0].__args__) == set(QUANTIZATION_METHODS)


def test_sharded_replica_gets_a_placement_group_and_ray_executor():
    from deployments.compute.deployment import placement_options

    single = AppConfig.model_validate({"engine": {"name": "vllm"}, "compute": {"num_gpus": 1}})
    assert placement_options(single) == {"ray_actor_options": {"num_cpus": 1.0, "num_gpus": 1.0}}
    tp = AppConfig.model_validate(
        {"engine": {"name": "vllm", "vllm": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}}, "compute": {"num_cpus": 2}}
    )
    opts = placement_options(tp)
    assert opts["placement_group_bundles"] == [{"CPU": 2.0}] + [{"GPU": 1, "CPU": 1}] * 4
    assert opts["placement_group_strategy"] == "PACK"
    assert opts["ray_actor_options"]["num_gpus"] == 0
    tp_only = AppConfig.model_validate({"engine": {"name": "vllm", "vllm": {"tensor_parallel_size": 2}}})
    assert placement_options(tp_only)["placement_group_strategy"] == "STRICT_PACK"
    kwargs = engine_args_kwargs(
        model_path="/m", served_model_name=None, dtype="bfloat16", max_model_len=None,
        max_num_seqs=8, options=tp.engine.vllm, on_cpu=False,
    )
    assert kwargs["distributed_executor_backend"] == "ray"
    assert "distributed_executor_backend" not in engine_args_kwargs(
        model_path="/m", served_model_name=None, dtype="bfloat16", max_model_len=None,
        max_num_seqs=8, options=single.engine.vllm, on_cpu=False,
    )


def test_vllm_logprobs_become_the_protocols_entries():
    from dataclasses import dataclass

    @dataclass
    class Logprob:  # vllm.logprobs.Logprob's fields
        logprob: float
        rank: int
        decoded_token: str = ""

    assert sampling_params_kwargs(SamplingParams(max_tokens=1, logprobs=0))["logprobs"] == 0
    assert "logprobs" not in sampling_params_kwargs(SamplingParams(max_tokens=1))
    # The sampled token (rank 5, outside the top 2) comes first in vLLM's dict.
    positions = [{9: Logprob(-3.0, 5), 4: Logprob(-0.5, 2), 2: Logprob(-0.2, 1)}, {2: Logprob(-0.1, 1)}]
    assert delta_logprobs([9, 2], positions, 2) == [(-3.0, [(2, -0.2), (4, -0.5)]), (-0.1, [(2, -0.1)])]
    assert delta_logprobs([9], positions[:1], 0) == [(-3.0, [])]
    with pytest.raises(EngineError):
        delta_logprobs([9, 2], positions[:1], 2)


def test_the_further_sampling_controls_reach_vllm_only_when_set():
    kw = sampling_params_kwargs(SamplingParams(
        max_tokens=3, top_k=5, min_p=0.1, presence_penalty=0.5, frequency_penalty=-0.2,
        repetition_penalty=1.1, logit_bias={3: 1.0}, min_tokens=2,
    ))
    assert {k: kw[k] for k in ("top_k", "min_p", "presence_penalty", "frequency_penalty",
                               "repetition_penalty", "logit_bias", "min_tokens")} == {
        "top_k": 5, "min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": -0.2,
        "repetition_penalty": 1.1, "logit_bias": {3: 1.0}, "min_tokens": 2}
    plain = sampling_params_kwargs(SamplingParams(max_tokens=3))
    assert not {"top_k", "min_p", "presence_penalty", "repetition_penalty", "logit_bias", "min_tokens"} & set(plain)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_the_benchmarks_vllm_serve_flags_parse_as_our_engine_args(tiny_model_path):
    """``loadtests.compare_vllm`` runs plain vLLM with our engine arguments as
    ``api_server`` flags: vLLM's own parser takes them and gives the same values (a dict
    went as its Python repr once, and vLLM's server exited at start)."""
    import argparse

    from loadtests import compare_vllm
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = argparse.Namespace(max_num_seqs=32, kv_gib=1.0, output_len=64)
    flags = compare_vllm.vllm_flags(tiny_model_path, args)
    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(flags)
    assert parsed.structured_outputs_config.backend == "xgrammar"
    assert parsed.structured_outputs_config.disable_any_whitespace is True
    assert (parsed.max_num_seqs, parsed.enable_prefix_caching, parsed.dtype) == (32, True, "float32")
