"""Llama-family causal LMs in plain torch, for the torch engine.

Why not transformers here: a ComputeWorker replica that takes over from a dead one spends
most of its start importing. transformers' model classes pull in ``torch._dynamo``,
``torch.distributed.tensor``, sympy and much more (about 6 s of one core on the 2-core
machines here, against 3 s for torch itself); under load a replacement replica gets a third
of a core and took 30+ s to serve (tests/integration/test_faults_under_load.py). This
module imports torch, ``safetensors`` and ``tokenizers`` only.

It computes what transformers' ``LlamaForCausalLM`` computes, op for op (RMSNorm in
float32, RoPE from float32 frequencies, SDPA with the same boolean mask, or none where
transformers passes none), so the engine's tokens are the same as with transformers'
model; ``tests/unit/test_llama_native.py`` compares logits (padded batches and cached
decodes included), the engine's tests its greedy tokens with transformers' ``generate``. Architectures or options it does not implement
(:func:`unsupported`) run through transformers as before (``engine.torch_model_impl``).

The call is the subset of transformers' that the engine uses: ``model(input_ids=,
attention_mask=, position_ids=, past_key_values=, use_cache=, logits_to_keep=).logits``,
where ``past_key_values`` has ``layers`` whose ``update(keys, values)`` appends and returns
the layer's whole cache (``kv_buffer.GrowableLayer``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

ARCHITECTURES = ("LlamaForCausalLM",)
ROPE_TYPES = ("default", "llama3")


def read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def _rope(cfg: dict) -> dict:
    """RoPE parameters from either layout: ``rope_parameters`` (transformers 5) or
    ``rope_theta`` + ``rope_scaling`` (earlier checkpoints)."""
    params = dict(cfg.get("rope_parameters") or {})
    if not params:
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    return params


def unsupported(cfg: dict) -> Optional[str]:
    """Why this module cannot run a model of this ``config.json`` (None: it can)."""
    archs = cfg.get("architectures") or []
    if list(archs) != ["LlamaForCausalLM"] or cfg.get("model_type") != "llama":
        return f"architecture {archs or cfg.get('model_type')!r} (native: {', '.join(ARCHITECTURES)})"
    if cfg.get("hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.get('hidden_act')!r}"
    if int(cfg.get("pretraining_tp", 1) or 1) != 1:
        return "pretraining_tp != 1"
    rope_type = _rope(cfg)["rope_type"]
    if rope_type not in ROPE_TYPES:
        return f"rope_type {rope_type!r} (native: {', '.join(ROPE_TYPES)})"
    if cfg.get("quantization_config"):
        return "a quantized checkpoint"
    return None


def checkpoint_unsupported(path: str | Path) -> Optional[str]:
    """Why this module cannot run the checkpoint at ``path`` (None: it can): its config,
    or weights that are not in safetensors."""
    path = Path(path)
    why = unsupported(read_json(path / "config.json"))
    if why is None and not (
        (path / "model.safetensors").exists() or (path / "model.safetensors.index.json").exists()
    ):
        why = "no safetensors weights"
    return why


@dataclass(frozen=True)
class LlamaConfig:
    """The fields of a Llama ``config.json`` the model and the engine read (the engine reads
    ``vocab_size``, ``pad_token_id``, ``max_position_embeddings`` and, for its KV block
    shape, ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
    ``head_dim``, ``hidden_size``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: dict
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    pad_token_id: Optional[int] = None
    eos_token_id: Any = None

    @classmethod
    def from_dict(cls, cfg: dict) -> "LlamaConfig":
        why = unsupported(cfg)
        if why is not None:
            raise ValueError(f"not a model this module runs: {why}")
        heads = int(cfg["num_attention_heads"])
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rope=_rope(cfg),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            pad_token_id=cfg.get("pad_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
        )


def inv_freq(config: LlamaConfig) -> torch.Tensor:
    """RoPE inverse frequencies, as transformers computes them (float32)."""
    dim, base = config.head_dim, float(config.rope["rope_theta"])
    freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    if config.rope["rope_type"] == "llama3":
        r = config.rope
        factor, low, high = float(r["factor"]), float(r["low_freq_factor"]), float(r["high_freq_factor"])
        old_len = float(r["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > low_wavelen, freq / factor, freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        freq = torch.where(medium, smoothed, scaled)
    return freq


def _param(*shape: int) -> nn.Parameter:
    """A parameter with no memory yet: the checkpoint's tensor replaces it (``assign``).
    (Not ``nn.Linear`` under ``torch.device("meta")``: its random init goes through
    torch's reference ops, which import ``torch._dynamo``, 2.6 s.)"""
    return nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)


# A batch of rows of several adapters runs every loaded adapter's A on every row when
# their ranks add up to at most this many (then masks each row to its own adapter's
# part), else the A and B of the adapters in the batch only, copied out per call.
LORA_ALL_ADAPTERS_MAX_RANK = 256


class LoraRows:
    """Which LoRA adapters the rows of the batch in the forward pass use, shared by every
    adapted layer; set by :meth:`LlamaForCausalLM.forward` for its call."""

    __slots__ = ("single", "present", "mask")

    def __init__(self):
        self.single: Optional[int] = None  # the one adapter (slot) every row uses, if so
        # Rows of several adapters: the adapters the layers compute for (their indices,
        # slot - 1; None: every loaded one) and [batch, 1, ranks] with 1 where a row's
        # own adapter's ranks are.
        self.present: Optional[torch.Tensor] = None
        self.mask: Optional[torch.Tensor] = None


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None
        # LoRA (LlamaForCausalLM.set_adapters), adapters 1..n padded to one rank r:
        # A of all of them as one [n * r, in] matrix, B per adapter [n, out, r] and as one
        # [out, n * r] matrix (B times the adapter's scaling; an adapter that does not
        # adapt this layer has zeros), the batch's rows, and the adapters that adapt it.
        self.lora: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor, LoraRows, frozenset]] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.lora is None:
            return y
        a_cat, b, b_cat, which, adapted = self.lora
        if which.single is not None:
            if which.single not in adapted:
                return y
            r = b.shape[2]
            i = which.single - 1
            return y + F.linear(F.linear(x, a_cat[i * r : (i + 1) * r]), b[i])
        if which.mask is None:
            return y
        # Rows of several adapters (x is [batch, tokens, in]): two matmuls for all of them,
        # each row masked to its own adapter's ranks in between. (Per adapter, its rows
        # selected and added back: 0.6x of this one's throughput in the engine; an A and B
        # gathered per row: 0.8x, loadtests/lora_overhead.py.)
        if which.present is None:
            return y + F.linear(F.linear(x, a_cat) * which.mask, b_cat)
        n, out, r = b.shape
        idx = which.present
        a_p = a_cat.view(n, r, -1).index_select(0, idx).reshape(len(idx) * r, -1)
        b_p = b.index_select(0, idx).permute(1, 0, 2).reshape(out, len(idx) * r)
        return y + F.linear(F.linear(x, a_p) * which.mask, b_p)


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int):
        super().__init__()
        self.weight = _param(num, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = _param(size)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    if n == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, n, t, d).reshape(b, h * n, t, d)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        c = config
        self.head_dim = c.head_dim
        self.groups = c.num_attention_heads // c.num_key_value_heads
        self.scaling = c.head_dim**-0.5
        self.q_proj = Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)

    def forward(self, x, cos, sin, mask, is_causal: bool, layer_cache) -> torch.Tensor:
        b, t, _ = x.shape
        shape = (b, t, -1, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        q, k = (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)
        if layer_cache is not None:
            k, v = layer_cache.update(k, v)
        kwargs = {}
        if self.groups > 1:
            # As transformers: SDPA's own GQA without a mask, repeated heads with one.
            if mask is None and k.shape[-1] <= 256:
                kwargs["enable_gqa"] = True
            else:
                k, v = _repeat_kv(k, self.groups), _repeat_kv(v, self.groups)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=is_causal, scale=self.scaling, **kwargs
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1).contiguous())


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        c = config
        self.gate_proj = Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.up_proj = Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, mask, is_causal, layer_cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, is_causal, layer_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


@dataclass
class CausalLMOutput:
    logits: torch.Tensor


def attention_mask_4d(
    attention_mask: Optional[torch.Tensor], q_len: int, kv_len: int, device
) -> tuple[Optional[torch.Tensor], bool]:
    """(mask, is_causal) for SDPA, as transformers builds them: no mask where no position is
    padding and the query is one token or the whole sequence (then ``is_causal`` for a
    prefill); else a ``[batch, 1, q_len, kv_len]`` boolean mask, causal over cache
    positions (query i sits at ``kv_len - q_len + i``) and false at padding."""
    if attention_mask is None or bool(attention_mask[:, :kv_len].all()):
        if q_len == 1 or q_len == kv_len:
            return None, q_len > 1
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)
    causal = torch.arange(kv_len, device=device)[None, :] <= q_pos[:, None]  # [q, kv]
    mask = causal[None, None].expand(1 if attention_mask is None else attention_mask.shape[0], 1, q_len, kv_len)
    if attention_mask is not None:
        mask = mask & attention_mask[:, None, None, :kv_len].to(device=device, dtype=torch.bool)
    return mask, False


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.model = _Body(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("inv_freq", inv_freq(config), persistent=False)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> "LlamaForCausalLM":
        """Weights from the checkpoint's safetensors (one file or an index of shards),
        assigned in place of parameters that were never initialised."""
        from safetensors.torch import load_file

        path = Path(path)
        config = LlamaConfig.from_dict(read_json(path / "config.json"))
        index = read_json(path / "model.safetensors.index.json")
        files = sorted(set(index.get("weight_map", {}).values())) or ["model.safetensors"]
        state: dict[str, torch.Tensor] = {}
        for name in files:
            state.update(load_file(str(path / name)))
        if config.tie_word_embeddings or "lm_head.weight" not in state:
            if "lm_head.weight" not in state and not config.tie_word_embeddings:
                raise ValueError(f"{path}: no lm_head.weight and tie_word_embeddings is false")
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        # Checkpoints from before transformers 4.31 stored RoPE's frequencies; they are
        # computed from the config here, as there.
        state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
        model = cls(config)
        expected = set(model.state_dict())
        missing, unexpected = expected - set(state), set(state) - expected
        if missing or unexpected:
            raise ValueError(
                f"{path}: weights do not fit a Llama of this config "
                f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})"
            )
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True, strict=True)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        for p in model.parameters():
            p.requires_grad_(False)
        return model.eval()

    def lora_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each projection a LoRA adapter may adapt (lora.TARGET_MODULES)."""
        layer = self.model.layers[0]
        return {
            name: (proj.weight.shape[1], proj.weight.shape[0])
            for name, proj in (*layer.self_attn.named_children(), *layer.mlp.named_children())
            if isinstance(proj, Linear)
        }

    def set_adapters(self, adapters: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Serve these LoRA adapters (``lora.load_weights`` of each) beside the base
        weights: adapter i is slot i + 1 of ``forward``'s ``lora_rows``. Ranks are padded
        with zeros to the largest, so a batch of several adapters is two matmuls a layer."""
        self._lora_rows = LoraRows()
        self._lora_count = len(adapters)
        rank = max((a.shape[0] for weights in adapters for a, _ in weights.values()), default=0)
        self._lora_rank = rank
        for module in sorted({m for weights in adapters for m in weights}):
            linear = self.get_submodule(module)
            fan_out, fan_in = linear.weight.shape
            a = linear.weight.new_zeros((len(adapters), rank, fan_in))
            b = linear.weight.new_zeros((len(adapters), fan_out, rank))
            adapted = set()
            for slot, weights in enumerate(adapters, start=1):
                if module in weights:
                    la, lb = weights[module]
                    a[slot - 1, : la.shape[0]] = la.to(a.dtype)
                    b[slot - 1, :, : lb.shape[1]] = lb.to(b.dtype)
                    adapted.add(slot)
            a_cat = a.reshape(len(adapters) * rank, fan_in)
            b_cat = b.permute(1, 0, 2).reshape(fan_out, len(adapters) * rank).contiguous()
            linear.lora = (a_cat, b, b_cat, self._lora_rows, frozenset(adapted))

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        past_key_values=None,
        use_cache: bool = True,
        logits_to_keep: int = 0,
        lora_rows: Optional[list[int]] = None,
    ) -> CausalLMOutput:
        """``lora_rows``: the adapter slot of each row (``set_adapters``; 0 or None: the
        base model)."""
        which = getattr(self, "_lora_rows", None)
        if which is None or not lora_rows or not any(lora_rows):
            return self._forward(input_ids, attention_mask, position_ids, past_key_values, use_cache, logits_to_keep)
        if len(lora_rows) != input_ids.shape[0]:
            raise ValueError(f"lora_rows has {len(lora_rows)} slots for a batch of {input_ids.shape[0]}")
        slots = set(lora_rows)
        if len(slots) == 1:
            which.single = lora_rows[0]
        else:
            r = self._lora_rank
            if self._lora_count * r <= LORA_ALL_ADAPTERS_MAX_RANK:
                which.present, place = None, {s: s - 1 for s in range(1, self._lora_count + 1)}
            else:
                present = sorted(slots - {0})
                which.present = torch.tensor([s - 1 for s in present], device=input_ids.device)
                place = {s: i for i, s in enumerate(present)}
            mask = torch.zeros((len(lora_rows), 1, len(place) * r), dtype=self.lm_head.weight.dtype)
            for row, slot in enumerate(lora_rows):
                if slot:
                    mask[row, :, place[slot] * r : (place[slot] + 1) * r] = 1
            which.mask = mask.to(input_ids.device)
        try:
            return self._forward(input_ids, attention_mask, position_ids, past_key_values, use_cache, logits_to_keep)
        finally:
            which.single = which.present = which.mask = None

    def _forward(self, input_ids, attention_mask, position_ids, past_key_values, use_cache, logits_to_keep):
        layers = past_key_values.layers if (use_cache and past_key_values is not None) else None
        b, q_len = input_ids.shape
        past = 0 if layers is None else layers[0].num_tokens
        if position_ids is None:
            position_ids = torch.arange(past, past + q_len, device=input_ids.device)[None].expand(b, -1)
        x = self.model.embed_tokens(input_ids)
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
        mask, is_causal = attention_mask_4d(attention_mask, q_len, past + q_len, x.device)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, mask, is_causal, None if layers is None else layers[i])
        x = self.model.norm(x)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        return CausalLMOutput(logits=self.lm_head(x))


class FastTokenizer:
    """The part of a transformers fast tokenizer the engine uses (``decode`` with
    ``skip_special_tokens``, ``eos_token_id``; and encoding, as ``engine.tokenizer``), straight from ``tokenizer.json`` with the
    ``tokenizers`` library that transformers' fast tokenizers wrap; ``decode`` cleans up
    spaces where transformers 5 would (``clean_up_tokenization_spaces``, never for BPE
    unless forced)."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        path = Path(path)
        self._tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        cfg = read_json(path / "tokenizer_config.json")
        clean = bool(cfg.get("clean_up_tokenization_spaces", False))
        if clean and type(self._tok.model).__name__ == "BPE":
            clean = bool(cfg.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
        self._clean = clean
        eos = cfg.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        self.eos_token_id = self._tok.token_to_id(eos) if isinstance(eos, str) else None

    @staticmethod
    def supports(path: str | Path) -> Optional[str]:
        """Why transformers' tokenizer is needed for this checkpoint (None: it is not)."""
        path = Path(path)
        if not (path / "tokenizer.json").exists():
            return "no tokenizer.json"
        cls = read_json(path / "tokenizer_config.json").get("tokenizer_class")
        if cls not in (None, "PreTrainedTokenizerFast", "TokenizersBackend"):
            return f"tokenizer_class {cls!r}"
        return None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        """``{"input_ids": [...]}``, as transformers' tokenizers answer a call."""
        return {"input_ids": self.encode(text, add_special_tokens)}

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        text = self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        if self._clean:
            for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                         (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(a, b)
        return text
