"""The torch engine's native Llama (deployments/compute/engines/llama.py) against
transformers' LlamaForCausalLM on the same checkpoints: the same logits (bit for bit on
CPU) for left-padded batches, cached decode steps and a suffix onto a cache, with grouped
KV heads, llama3 RoPE scaling, tied embeddings and biases; checkpoints it does not run
go to transformers; its tokenizer decodes as transformers' does; and an engine on the
tiny model never imports transformers."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deployments.compute.engines import llama
from deployments.compute.engines.kv_buffer import growable_cache

ROOT = Path(__file__).resolve().parents[2]

VARIANTS = {
    "gqa_llama3_rope": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "tied_biased": dict(
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
    ),
}


def _checkpoint(tmp_path: Path, name: str, **overrides) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        head_dim=32,
        max_position_embeddings=256,
        pad_token_id=0,
        **overrides,
    )
    model = LlamaForCausalLM(config).eval()
    path = tmp_path / name
    model.save_pretrained(path)
    return path


def _run(model, hf: bool, steps: list[dict]) -> list[torch.Tensor]:
    cache = growable_cache(model.config.num_hidden_layers, hf=hf)
    out = []
    with torch.inference_mode():
        for step in steps:
            out.append(model(past_key_values=cache, use_cache=True, **step).logits)
    return out


def _steps(vocab: int) -> list[dict]:
    """A left-padded batch of 3 (prefill), then 4 decode steps."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (3, 12), generator=g)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, :9] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    steps = [dict(input_ids=ids, attention_mask=mask, position_ids=pos)]
    for n in range(4):
        mask = torch.cat([mask, mask.new_ones(3, 1)], 1)
        pos = pos[:, -1:] + 1
        steps.append(dict(input_ids=torch.randint(1, vocab, (3, 1), generator=g), attention_mask=mask, position_ids=pos))
    return steps


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_equal_transformers(tmp_path, variant):
    from transformers import AutoModelForCausalLM

    path = _checkpoint(tmp_path, variant, **VARIANTS[variant])
    assert llama.unsupported(json.loads((path / "config.json").read_text())) is None
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    native = llama.LlamaForCausalLM.from_pretrained(path)
    steps = _steps(97)
    want, got = _run(reference, True, steps), _run(native, False, steps)
    real = steps[0]["attention_mask"].bool()
    torch.testing.assert_close(got[0][real], want[0][real], rtol=0, atol=1e-6)
    for w, g in zip(want[1:], got[1:]):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)

    # One unpadded sequence, then its suffix onto the cache (an imported prefix), with
    # only the last position's logits.
    ids = torch.randint(1, 97, (1, 20), generator=torch.Generator().manual_seed(2))
    steps = [
        dict(input_ids=ids[:, :13], attention_mask=torch.ones(1, 13, dtype=torch.long),
             position_ids=torch.arange(13)[None], logits_to_keep=1),
        dict(input_ids=ids[:, 13:], attention_mask=torch.ones(1, 20, dtype=torch.long),
             position_ids=torch.arange(13, 20)[None], logits_to_keep=1),
    ]
    for w, g in zip(_run(reference, True, steps), _run(native, False, steps)):
        assert g.shape == w.shape == (1, 1, 97)
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)


def test_an_older_config_layout_reads_the_same_rope():
    new = {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}
    old = {"rope_theta": 5e5, "rope_scaling": {"type": "llama3", "factor": 8.0}}
    assert llama._rope(new) == llama._rope(old) == {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}
    assert llama._rope({})["rope_type"] == "default"


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "architecture"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type 'yarn'"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantized"),
    ],
)
def test_what_it_does_not_run_goes_to_transformers(tmp_path, change, reason):
    from deployments.compute.engines.torch_engine import TorchEngine

    path = _checkpoint(tmp_path, "m", num_attention_heads=4, num_key_value_heads=4)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((ROOT / "models" / "tiny" / name).read_bytes())
    cfg = json.loads((path / "config.json").read_text())
    assert reason in (llama.unsupported({**cfg, **change}) or "")
    if change.get("model_type") == "mistral":
        # A real checkpoint of another architecture: auto takes transformers, native refuses.
        from transformers import MistralConfig, MistralForCausalLM

        mistral = tmp_path / "mistral"
        MistralForCausalLM(MistralConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                                         num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=4)).save_pretrained(mistral)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (mistral / name).write_bytes((path / name).read_bytes())
        assert TorchEngine(str(mistral)).model_impl == "transformers"
        with pytest.raises(ValueError, match="native cannot run"):
            TorchEngine(str(mistral), model_impl="native")
    assert TorchEngine(str(path)).model_impl == "native"
    assert TorchEngine(str(path), model_impl="transformers").model_impl == "transformers"


def test_weights_not_in_safetensors_go_to_transformers(tmp_path):
    path = _checkpoint(tmp_path, "m", num_attention_heads=4, num_key_value_heads=4)
    assert llama.checkpoint_unsupported(path) is None
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    assert llama.checkpoint_unsupported(path) == "no safetensors weights"


def test_weights_that_do_not_fit_the_config_are_an_error(tmp_path):
    from safetensors.torch import load_file, save_file

    path = _checkpoint(tmp_path, "m", num_attention_heads=4, num_key_value_heads=4)
    # Old checkpoints' stored RoPE frequencies are no misfit.
    state = load_file(str(path / "model.safetensors"))
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(16)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    llama.LlamaForCausalLM.from_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match="missing"):
        llama.LlamaForCausalLM.from_pretrained(path)


@pytest.mark.parametrize("model", ["tiny", "small"])
def test_tokenizer_decodes_as_transformers(model):
    from transformers import AutoTokenizer

    path = ROOT / "models" / model
    if not (path / "tokenizer.json").exists():
        pytest.skip(f"models/{model} is not built (loadtests build it)")
    reference, fast = AutoTokenizer.from_pretrained(path), llama.FastTokenizer(path)
    assert fast.eos_token_id == reference.eos_token_id is not None
    rng = random.Random(0)
    for _ in range(500):
        ids = [rng.randrange(len(reference)) for _ in range(rng.randrange(1, 24))]
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
        text = reference.decode(ids)
        assert fast(text)["input_ids"] == reference(text)["input_ids"]
        assert fast.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)


def test_an_engine_on_the_tiny_model_never_imports_transformers(tiny_model_path):
    """The point of the native model: a replica's start without transformers (nor
    torch._dynamo, which transformers imports)."""
    code = (
        "import asyncio, sys\n"
        "from deployments.compute.engines.torch_engine import TorchEngine\n"
        f"e = TorchEngine({str(tiny_model_path)!r}, num_threads=1)\n"
        "asyncio.run(e.start())\n"
        "print(e.model_impl, sorted(m for m in ('transformers', 'torch._dynamo') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "native []"


async def test_auto_runs_what_the_native_model_cannot_load_through_transformers(tmp_path):
    """A Llama whose weights the native model refuses (here: a tensor it does not know;
    transformers ignores it, or converts legacy names) still runs under ``auto``, through
    transformers, with its cache layers; ``native`` refuses it at start."""
    from safetensors.torch import load_file, save_file

    from deployments.compute.engines.torch_engine import TorchEngine

    path = _checkpoint(tmp_path, "m", num_attention_heads=4, num_key_value_heads=4)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((ROOT / "models" / "tiny" / name).read_bytes())
    state = load_file(str(path / "model.safetensors"))
    state["model.extra.weight"] = torch.ones(2)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected"):
        llama.LlamaForCausalLM.from_pretrained(path)

    engine = TorchEngine(str(path), num_threads=1)
    assert engine.model_impl == "native"  # as far as the config tells
    await engine.start()  # runs a prefill and a decode step on the loop thread
    try:
        assert engine.model_impl == "transformers"
        assert type(engine.model).__module__.startswith("transformers.")
    finally:
        await engine.shutdown()
    with pytest.raises(ValueError, match="unexpected"):
        await TorchEngine(str(path), num_threads=1, model_impl="native").start()
