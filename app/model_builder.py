"""Build a tiny random-weight Llama checkpoint offline, deterministically.

CI has no model hub, so the model every test and benchmark loads is made here: a
Llama-architecture ``LlamaForCausalLM`` with seeded random weights, plus a byte-level BPE
tokenizer trained on the spot on a built-in synthetic corpus, with a Llama-3-style chat
template. The output is a plain Hugging Face directory that ``AutoModelForCausalLM`` /
``AutoTokenizer`` (and vLLM) load like any downloaded checkpoint.

    python -m app.model_builder --preset tiny --out models/tiny [--force]
    python -m app.model_builder --model models/tiny --lora-seed 1 --out models/tiny-lora-1

The same preset gives the same bytes on every run (seeded corpus, single-threaded
tokenizer training, explicitly seeded weight init). ``build_info.json`` marks a finished
build, so rebuilding an up-to-date directory is a no-op.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Optional

# Bump when the produced bytes change, so older builds are rebuilt instead of reused.
BUILDER_VERSION = 2
BUILD_INFO_FILE = "build_info.json"

BOS_TOKEN = "<|begin_of_text|>"
END_OF_TEXT_TOKEN = "<|end_of_text|>"
START_HEADER_TOKEN = "<|start_header_id|>"
END_HEADER_TOKEN = "<|end_header_id|>"
EOT_TOKEN = "<|eot_id|>"
PAD_TOKEN = "<|finetune_right_pad_id|>"
SPECIAL_TOKENS = [BOS_TOKEN, END_OF_TEXT_TOKEN, START_HEADER_TOKEN, END_HEADER_TOKEN, EOT_TOKEN, PAD_TOKEN]

# Llama-3's template, minus the tool-calling branches.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "(message['content'] | trim) + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)


@dataclass(frozen=True, slots=True)
class Preset:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    corpus_chars: int
    seed: int = 1234
    # Random init at the usual std (0.02) makes a poor test model: attention is uniform
    # and its output is tiny next to the embeddings, so the model is nearly a bigram table
    # that ignores positions and context (a wrong position id or a KV mix-up in batching
    # would go unnoticed), and the logits are near-flat, so greedy argmax flips under
    # last-bit differences (batch padding, kernel choice). So: every linear layer gets
    # std gain/sqrt(fan_in) (outputs of order 1), q/k a larger gain (sharp, position-
    # dependent attention), and lm_head a scale that gives logits of std ``logit_std``
    # (peaked outputs, top-1/top-2 margins far above float noise).
    linear_gain: float = 1.0
    qk_gain: float = 2.0
    embed_std: float = 1.0
    logit_std: float = 6.0


PRESETS: dict[str, Preset] = {
    # head_dim 64: vLLM's CPU attention rejects 16.
    "tiny": Preset(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        corpus_chars=300_000,
    ),
    "small": Preset(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1536,
        # 4 layers: a 2k-token prefill takes ~1 s on 2 CPU cores (8 layers: ~1.8 s).
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        corpus_chars=600_000,
    ),
    # For accelerator runs (loadtests/engine_kv.py on a GPU), never built by the tests or
    # the run command: ~0.8B parameters (3.2 GB in fp32), grouped-query attention (8 KV
    # heads for 16 query heads) and head_dim 128, shapes the two above do not exercise.
    "medium": Preset(
        vocab_size=8192,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        corpus_chars=1_000_000,
    ),
}

_COMMON_WORDS = """
the of and to in is was that for on with as by at from his her they this had not are but
be have one all were when we there can an your which their said if do will each about how
up out them then she many some so these would other into has more two time like see him
could no make than first been its who now people my made over did down only way find use
may water long little very after words called just where most know get through back much
go good new write our me man too any day same right look think also around another came
come work three word must because does part even place well such here take why things
help put years different away again off went old number great tell men say small every
found still between name should home big give air line set own under read last never us
left end along while might next sound below saw something thought both few those always
looked show large often together asked house world going want school important until form
food keep children feet land side without boy once animals life enough took sometimes four
head above kind began almost live page got earth need far hand high year mother light parts
country father let night following picture being study second eyes soon times story boys
since white days ever paper hard near sentence better best across during today others however
sure means knew try told young miles sun ways thing whole hear example heard several change
answer room sea against top turned learn point city play toward five using himself usually
river model engine server token cache request batch memory cluster worker router latency
""".split()

_SYLLABLES = """
ka lo mi re su ta ne vo pi da ru sel mar ton bel fin gor hal ist ven dor lum pra que zen
cor tra ble ing ent ous ion ter ber nal qui rix sol vek yra ama ost ula ein ore sch eau
""".split()

# A little non-ASCII, so multi-byte UTF-8 characters show up split across tokens.
_UNICODE_WORDS = ["café", "naïve", "über", "façade", "smörgåsbord", "日本", "中文", "привет", "🙂", "→", "€5"]


def _synthetic_words(rng: random.Random, count: int) -> list[str]:
    words: set[str] = set()
    out: list[str] = []
    while len(out) < count:
        w = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4)))
        if w not in words:
            words.add(w)
            out.append(w)
    return out


def iter_corpus(num_chars: int, seed: int) -> Iterator[str]:
    """Deterministic English-ish lines: Zipf-weighted words, punctuation, numbers."""
    rng = random.Random(seed)
    vocab = _COMMON_WORDS + _synthetic_words(rng, 3000) + _UNICODE_WORDS
    weights = [1.0 / (rank + 1) ** 0.9 for rank in range(len(vocab))]
    produced = 0
    while produced < num_chars:
        sentences = []
        for _ in range(rng.randint(1, 4)):
            words = rng.choices(vocab, weights=weights, k=rng.randint(4, 18))
            if rng.random() < 0.15:
                words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
            sentence = " ".join(words)
            sentence = sentence[0].upper() + sentence[1:]
            sentences.append(sentence + rng.choice([".", ".", ".", "?", "!", ":", ";"]))
        line = " ".join(sentences)
        produced += len(line) + 1
        yield line


def _train_tokenizer(preset: Preset):
    # Training in parallel may break merge ties differently run to run.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=preset.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(iter_corpus(preset.corpus_chars, preset.seed)), trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tok


def _init_weights(model, preset: Preset) -> None:
    import torch

    gen = torch.Generator().manual_seed(preset.seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            if param.dim() < 2:
                param.zero_()
                continue
            fan_in = param.shape[1]
            if "embed_tokens" in name:
                std = preset.embed_std
            elif name.startswith("lm_head"):
                std = preset.logit_std / fan_in**0.5
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                std = preset.qk_gain / fan_in**0.5
            else:
                std = preset.linear_gain / fan_in**0.5
            param.copy_(torch.randn(param.shape, generator=gen) * std)


def _build_info(preset_name: str) -> dict:
    return {
        "preset": preset_name,
        "builder_version": BUILDER_VERSION,
        "params": asdict(PRESETS[preset_name]),
    }


def is_up_to_date(out: Path, preset_name: str) -> bool:
    info_path = Path(out) / BUILD_INFO_FILE
    if not info_path.is_file():
        return False
    try:
        info = json.loads(info_path.read_text())
    except ValueError:
        return False
    required = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    return info == _build_info(preset_name) and all((Path(out) / f).is_file() for f in required)


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[model_builder] {msg}", file=sys.stderr, flush=True)


def build_model(out: Path | str, preset_name: str = "tiny", *, force: bool = False, quiet: bool = False) -> Path:
    """Write the checkpoint of ``preset_name`` to ``out``; returns the directory.

    Writes into a temporary sibling directory and renames it into place, so a crash never
    leaves a half-written checkpoint that looks complete.
    """
    if preset_name not in PRESETS:
        raise ValueError(f"unknown preset {preset_name!r}; choose one of {sorted(PRESETS)}")
    out = Path(out).expanduser().resolve()
    if not force and is_up_to_date(out, preset_name):
        _log(f"{out} is up to date (preset {preset_name}, builder v{BUILDER_VERSION})", quiet)
        return out

    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    preset = PRESETS[preset_name]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        _log(f"training byte-level BPE tokenizer (vocab {preset.vocab_size}, "
             f"{preset.corpus_chars // 1000} KB corpus)", quiet)
        raw_tok = _train_tokenizer(preset)
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=raw_tok,
            bos_token=BOS_TOKEN,
            eos_token=EOT_TOKEN,
            pad_token=PAD_TOKEN,
            chat_template=CHAT_TEMPLATE,
            model_max_length=preset.max_position_embeddings,
            clean_up_tokenization_spaces=False,
        )
        # Template inside tokenizer_config.json, where older loaders look for it.
        tokenizer.save_pretrained(tmp, save_jinja_files=False)
        # transformers 5 writes its new class name "TokenizersBackend"; the old alias
        # loads in both 4.x (which vLLM may pin) and 5.x.
        tok_cfg_path = tmp / "tokenizer_config.json"
        tok_cfg = json.loads(tok_cfg_path.read_text())
        tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        tok_cfg.pop("backend", None)
        tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")

        vocab_size = raw_tok.get_vocab_size()
        bos_id = raw_tok.token_to_id(BOS_TOKEN)
        eos_ids = [raw_tok.token_to_id(EOT_TOKEN), raw_tok.token_to_id(END_OF_TEXT_TOKEN)]
        pad_id = raw_tok.token_to_id(PAD_TOKEN)
        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=preset.hidden_size,
            intermediate_size=preset.intermediate_size,
            num_hidden_layers=preset.num_hidden_layers,
            num_attention_heads=preset.num_attention_heads,
            num_key_value_heads=preset.num_key_value_heads,
            max_position_embeddings=preset.max_position_embeddings,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            tie_word_embeddings=False,
            bos_token_id=bos_id,
            eos_token_id=eos_ids,
            pad_token_id=pad_id,
            torch_dtype="float32",
        )
        _log(f"initialising weights (hidden {preset.hidden_size}, {preset.num_hidden_layers} layers, "
             f"vocab {vocab_size})", quiet)
        torch.manual_seed(preset.seed)
        model = LlamaForCausalLM(config)
        _init_weights(model, preset)
        model.generation_config = GenerationConfig(
            bos_token_id=bos_id, eos_token_id=eos_ids, pad_token_id=pad_id, do_sample=False
        )
        _log(f"writing weights ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params)", quiet)
        model.save_pretrained(tmp, safe_serialization=True)
        (tmp / BUILD_INFO_FILE).write_text(json.dumps(_build_info(preset_name), indent=2, sort_keys=True) + "\n")

        # mkdtemp makes the directory private; the checkpoint is meant to be shared read-only.
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _log(f"done at {out}", quiet)
    return out


def ensure_model(path: Path | str, preset: str = "tiny", *, quiet: bool = True) -> Path:
    """Return ``path`` resolved, building the ``preset`` checkpoint there first if it is
    missing or stale. Cheap when it is up to date."""
    return build_model(path, preset, force=False, quiet=quiet)


def checkpoint_digest(path: Path | str) -> str:
    """sha256 over every file's name and bytes: equal digests mean identical builds."""
    h = hashlib.sha256()
    for f in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        h.update(str(f.relative_to(path)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def build_lora_adapter(
    model: Path | str,
    out: Path | str,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    seed: int = 1,
    targets: Optional[list[str]] = None,
    scale: float = 0.2,
    quiet: bool = True,
) -> Path:
    """A random LoRA adapter for the checkpoint at ``model``, in PEFT's format
    (``adapter_config.json``, ``adapter_model.safetensors``), seeded: the same arguments
    give the same bytes. Both A and B are non-zero (a trained adapter's B is; PEFT's
    initial one is zero), so the adapter changes the model's output."""
    import torch
    from safetensors.torch import save_file

    from deployments.compute.engines.lora import TARGET_MODULES

    model, out = Path(model), Path(out)
    cfg = json.loads((model / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    shapes = {
        "self_attn.q_proj": (hidden, heads * head_dim), "self_attn.k_proj": (hidden, kv_heads * head_dim),
        "self_attn.v_proj": (hidden, kv_heads * head_dim), "self_attn.o_proj": (heads * head_dim, hidden),
        "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter), "mlp.down_proj": (inter, hidden),
    }
    targets = list(targets or TARGET_MODULES)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            if module.rsplit(".", 1)[1] not in targets:
                continue
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * scale
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
        "target_modules": targets, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "use_dora": False, "modules_to_save": None, "base_model_name_or_path": str(model),
    }, indent=2, sort_keys=True) + "\n")
    _log(f"LoRA adapter (rank {rank}, {len(tensors) // 2} projections adapted) at {out}", quiet)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--out", default=None, help="output directory (default: models/<preset>)")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument("--lora-seed", type=int, default=None,
                        help="build a random LoRA adapter (PEFT format) for the model at --model "
                             "into --out instead, from this seed")
    parser.add_argument("--model", default=None, help="with --lora-seed: the base checkpoint")
    parser.add_argument("--lora-rank", type=int, default=8)
    args = parser.parse_args(argv)
    if args.lora_seed is not None:
        if not args.model or not args.out:
            parser.error("--lora-seed needs --model and --out")
        build_lora_adapter(args.model, args.out, rank=args.lora_rank, seed=args.lora_seed, quiet=False)
        return 0
    build_model(args.out or f"models/{args.preset}", args.preset, force=args.force)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
