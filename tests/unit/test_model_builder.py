"""The offline checkpoint builder: deterministic bytes, idempotence, loadability."""

import json

import pytest
import torch

from app.model_builder import (
    BUILD_INFO_FILE,
    EOT_TOKEN,
    build_model,
    checkpoint_digest,
    ensure_model,
    is_up_to_date,
    main,
)


@pytest.fixture(scope="module")
def fresh_build(tmp_path_factory):
    out = tmp_path_factory.mktemp("build") / "tiny"
    assert main(["--preset", "tiny", "--out", str(out)]) == 0
    return out


def test_two_builds_are_byte_identical(fresh_build, tmp_path):
    again = build_model(tmp_path / "again", "tiny", quiet=True)
    assert sorted(p.name for p in again.iterdir()) == sorted(p.name for p in fresh_build.iterdir())
    assert checkpoint_digest(again) == checkpoint_digest(fresh_build)


def test_rebuild_is_a_noop_until_forced_or_stale(fresh_build, capsys):
    weights = fresh_build / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert ensure_model(fresh_build, "tiny", quiet=False) == fresh_build.resolve()
    assert "up to date" in capsys.readouterr().err
    assert weights.stat().st_mtime_ns == mtime
    # Another preset's marker means stale.
    assert not is_up_to_date(fresh_build, "small")
    info = json.loads((fresh_build / BUILD_INFO_FILE).read_text())
    assert info["preset"] == "tiny"


def test_missing_file_makes_a_build_stale(tmp_path):
    out = build_model(tmp_path / "m", "tiny", quiet=True)
    (out / "tokenizer.json").unlink()
    assert not is_up_to_date(out, "tiny")
    ensure_model(out, "tiny")
    assert is_up_to_date(out, "tiny") and (out / "tokenizer.json").is_file()


def test_unknown_preset_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown preset"):
        build_model(tmp_path / "x", "huge")


def test_loads_with_auto_classes_and_chat_template(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    cfg = model.config
    assert cfg.model_type == "llama"
    assert cfg.hidden_size // cfg.num_attention_heads == 64
    assert cfg.vocab_size == len(tok)
    assert tok.eos_token == EOT_TOKEN
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello café 🙂"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "And?"},
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>")
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert text.count("<|eot_id|>") == 4
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids) == text
    plain = "Unicode round trip: naïve über 日本 → €5"
    assert tok.decode(tok(plain, add_special_tokens=False)["input_ids"]) == plain


def test_logits_are_peaked_so_greedy_is_stable(tiny_model_path):
    """Batched decoding differs from unbatched by ~1e-5 in the logits; greedy only matches
    HF generate token-for-token if top-1/top-2 margins are far larger than that."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    input_ids = torch.randint(0, model.config.vocab_size, (16, 64), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        logits = model(input_ids).logits
    top2 = logits.topk(2, dim=-1).values
    margins = (top2[..., 0] - top2[..., 1]).flatten()
    assert margins.median() > 0.3
    assert margins.quantile(0.01) > 1e-3
