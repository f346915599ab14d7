"""The embedded demo: a small Llama-architecture model and four PEFT adapters, built on first use.

`ensure_demo_checkpoint()` writes, deterministically and once, a Hugging Face
model directory (config.json, generation_config.json, model.safetensors,
tokenizer.json, tokenizer_config.json) and four adapter directories
(adapter_config.json + adapter_model.safetensors) in the formats that
transformers and PEFT themselves write, so the demo exercises the real
loading path. The tokenizer is a byte-level BPE really trained on the built-in
corpus below; the weights are random but scaled so that greedy decoding
wanders over many tokens and every adapter visibly changes it.

The whole tree is built in a private temporary directory and renamed into
place, so a crash never leaves half a checkpoint and concurrent builders
(TP workers, several replicas on one node) agree on one copy.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# Bump when anything below changes what is written: a new version is a new cache directory.
DEMO_VERSION = 1
DEMO_MODEL_NAME = "lorafleet/demo-llama"
BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD)  # ids 0..3, as in Llama 2's tokenizer
VOCAB_SIZE = 1536

MODEL_CONFIG = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=128, intermediate_size=256,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32, hidden_act="silu",
    max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
    attention_bias=False, mlp_bias=False, attention_dropout=0.0, tie_word_embeddings=False,
    initializer_range=0.02, pretraining_tp=1, use_cache=True, torch_dtype="float32",
)
_ATTN, _MLP = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
ADAPTERS = {  # name -> (seed, adapter_config.json fields on top of _PEFT_DEFAULTS)
    "demo-sql": (11, dict(r=8, lora_alpha=16, target_modules=list(_ATTN))),
    "demo-chat": (12, dict(r=16, lora_alpha=32, use_rslora=True, target_modules=list(_ATTN + _MLP))),
    "demo-summarize": (13, dict(r=4, lora_alpha=8, target_modules=list(_MLP))),
    "demo-translate": (14, dict(r=32, lora_alpha=32, target_modules=list(_ATTN + _MLP))),
}
_PEFT_DEFAULTS = dict(
    peft_type="LORA", task_type="CAUSAL_LM", base_model_name_or_path=DEMO_MODEL_NAME, revision=None,
    inference_mode=True, bias="none", lora_dropout=0.0, use_rslora=False, use_dora=False, fan_in_fan_out=False,
    init_lora_weights=True, layers_to_transform=None, layers_pattern=None, rank_pattern={}, alpha_pattern={},
    modules_to_save=None, lora_bias=False,
)
# Llama 2's format. The template emits bos itself, so encode its output with add_special_tokens=False.
CHAT_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] -%}{%- set messages = messages[1:] -%}"
    "{%- else -%}{%- set system = '' -%}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{- bos_token + '[INST] ' -}}"
    "{%- if loop.first and system -%}{{- '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' -}}{%- endif -%}"
    "{{- message['content'] + ' [/INST]' -}}"
    "{%- elif message['role'] == 'assistant' -%}{{- ' ' + message['content'] + ' ' + eos_token -}}"
    "{%- endif -%}{%- endfor -%}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. A serving system answers many requests at once, and each request
may ask for a different adapter. The base model stays in memory while small low-rank adapters come and go.
When a request arrives, the router looks for a replica that already holds its adapter; if none does, it picks
the least busy one, which then loads the adapter from its host cache or from the object store.
Once upon a time there was a little town by the sea. Every morning the baker opened his shop before sunrise,
and the smell of fresh bread filled the narrow streets. Children ran to school, fishermen pulled their boats
onto the sand, and the old clock on the square struck seven. In the evening people sat outside, talking about
the weather, the harvest and the news from the city. It was a quiet place, and nobody wanted it to change.
SELECT name, count(*) AS orders FROM customers JOIN orders ON customers.id = orders.customer_id
WHERE orders.created_at >= '2024-01-01' GROUP BY name ORDER BY orders DESC LIMIT 10;
INSERT INTO users (id, email) VALUES (42, 'ada@example.com'); UPDATE users SET active = true WHERE id = 42;
User: Can you help me write a short poem about the autumn rain? Assistant: Of course! Here is a short poem:
grey clouds drift over the hills, the leaves turn gold and fall, and the rain sings softly on the roof.
User: What is the capital of France? Assistant: The capital of France is Paris, a city known for its museums.
Summary: The report describes how the team reduced latency by batching requests and caching adapters. Key
points: throughput doubled, memory use stayed flat, and the tail latency fell by forty percent.
Translate to French: Good morning, how are you? -> Bonjour, comment allez-vous ? Translate to German: Thank you
very much. -> Vielen Dank. Translate to Spanish: Where is the station? -> ¿Dónde está la estación?
The café served crème brûlée and a naïve little soufflé; the menu said «bon appétit» and the bill was 12,50 €.
Über den Wolken muss die Freiheit wohl grenzenlos sein. Ça va très bien, merci. Mañana será otro día.
日本語のテキストも少し含まれています。東京は大きな都市です。 Emoji too: 🙂 🚀 ✨ and the end.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 16 32 64 128 256 512 1024 2048 4096 3.14159 2.71828 1e-5 100%.
def add(a, b):
    return a + b
for i in range(10):
    print(i * i)
A language model predicts the next token from the tokens before it. Training shows it a great deal of text,
and it slowly learns grammar, facts and style. Fine-tuning with LoRA freezes the original weights and learns
two small matrices for each layer, so one base model can carry thousands of cheap adapters, one per customer.
Scientists study the stars, the oceans and the smallest particles of matter. Doctors care for the sick, and
teachers help their students understand the world. Farmers grow wheat, rice and vegetables in the fields.
In the kitchen, mix two cups of flour with one cup of warm water, add a pinch of salt, and knead the dough for
ten minutes. Let it rest for an hour, then bake it in a hot oven until the crust is golden and crisp.
"""


@dataclass(frozen=True)
class DemoPaths:
    """Where the demo lives: the HF model directory and each PEFT adapter directory by name."""

    model_dir: Path
    adapters: dict[str, Path]


def default_cache_dir() -> Path:
    root = os.environ.get("LORAFLEET_CACHE")
    return Path(root) / "demo" if root else Path.home() / ".cache" / "lorafleet" / "demo"


def ensure_demo_checkpoint(cache_dir: str | Path | None = None) -> DemoPaths:
    """The demo's paths, building them first unless a complete build is already there.

    Layout: <cache_dir>/v<DEMO_VERSION>/model and .../adapters/<name>; cache_dir defaults to
    $LORAFLEET_CACHE/demo, else ~/.cache/lorafleet/demo.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / f"v{DEMO_VERSION}"
    paths = DemoPaths(final / "model", {name: final / "adapters" / name for name in ADAPTERS})
    if _is_complete(paths):
        return paths
    root.mkdir(parents=True, exist_ok=True)
    if final.exists():  # damaged after the build (files deleted by hand): move it out of the way
        aside = Path(tempfile.mkdtemp(prefix=".damaged-", dir=root))
        try:
            os.rename(final, aside / "old")
        except FileNotFoundError:  # another process moved it first
            pass
        shutil.rmtree(aside, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".v{DEMO_VERSION}-building-", dir=root))
    tmp.chmod(0o755)  # mkdtemp's 0700 would hide the cache from other users of a shared machine
    try:
        write_demo(tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first; its copy is identical
            if not _is_complete(paths):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return paths


def _is_complete(paths: DemoPaths) -> bool:
    model_files = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                   "tokenizer_config.json")
    return all((paths.model_dir / f).is_file() for f in model_files) and all(
        (d / f).is_file() for d in paths.adapters.values()
        for f in ("adapter_config.json", "adapter_model.safetensors"))


def write_demo(out: Path) -> None:
    """Write model/ and adapters/<name>/ under out (no caching, no atomicity: see ensure_demo_checkpoint)."""
    model_dir = out / "model"
    model_dir.mkdir(parents=True)
    tokenizer = train_tokenizer()
    tokenizer.save(str(model_dir / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size()
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    _write_json(model_dir / "tokenizer_config.json", dict(
        tokenizer_class="PreTrainedTokenizerFast", bos_token=BOS, eos_token=EOS, unk_token=UNK, pad_token=PAD,
        model_max_length=MODEL_CONFIG["max_position_embeddings"], clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE))
    _write_json(model_dir / "config.json", dict(
        MODEL_CONFIG, vocab_size=vocab, bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD]))
    _write_json(model_dir / "generation_config.json", dict(
        bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD], do_sample=False))
    save_file(model_weights(vocab, ids.values()), str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    for name, (seed, fields) in ADAPTERS.items():
        adapter_dir = out / "adapters" / name
        adapter_dir.mkdir(parents=True)
        save_file(adapter_weights(fields, seed), str(adapter_dir / "adapter_model.safetensors"),
                  metadata={"format": "pt"})
        _write_json(adapter_dir / "adapter_config.json", {**_PEFT_DEFAULTS, **fields})


def train_tokenizer() -> Tokenizer:
    """A byte-level BPE (GPT-2 / Llama 3 style) trained on CORPUS; adds <s> in front of every encoding."""
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=1, show_progress=False, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS}:1 $B:1", special_tokens=[(BOS, bos)])
    return tok


def model_weights(vocab: int, special_ids: Iterable[int] = ()) -> dict[str, torch.Tensor]:
    """Random Llama weights under HF names, scaled so each layer moves the residual stream noticeably."""
    c = MODEL_CONFIG
    h, inter, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q_out, kv_out = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    gen = torch.Generator().manual_seed(0)

    def linear(out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=gen) * (gain / math.sqrt(in_f))

    w = {"model.embed_tokens.weight": torch.randn(vocab, h, generator=gen)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen)
        w[p + "self_attn.q_proj.weight"] = linear(q_out, h, 2.0)  # sharper attention than uniform
        w[p + "self_attn.k_proj.weight"] = linear(kv_out, h, 2.0)
        w[p + "self_attn.v_proj.weight"] = linear(kv_out, h)
        w[p + "self_attn.o_proj.weight"] = linear(h, q_out)
        w[p + "post_attention_layernorm.weight"] = 1.0 + 0.1 * torch.randn(h, generator=gen)
        w[p + "mlp.gate_proj.weight"] = linear(inter, h)
        w[p + "mlp.up_proj.weight"] = linear(inter, h)
        w[p + "mlp.down_proj.weight"] = linear(h, inter, 2.0)
    w["model.norm.weight"] = torch.ones(h)
    w["lm_head.weight"] = linear(vocab, h, 4.0)  # logits with std ~4: clear argmax margins
    w["lm_head.weight"][list(special_ids)] = 0.0  # logit 0: never the greedy pick, rarely sampled
    return {k: v.contiguous() for k, v in w.items()}


def adapter_weights(fields: dict, seed: int) -> dict[str, torch.Tensor]:
    """PEFT-named lora_A [r, in] / lora_B [out, r]; B is non-zero (as after training), unlike PEFT's init."""
    c = MODEL_CONFIG
    h, inter, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    dims = {"q_proj": (h, c["num_attention_heads"] * hd), "k_proj": (h, c["num_key_value_heads"] * hd),
            "v_proj": (h, c["num_key_value_heads"] * hd), "o_proj": (c["num_attention_heads"] * hd, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}  # (in, out)
    r, alpha = fields["r"], fields["lora_alpha"]
    scaling = alpha / (math.sqrt(r) if fields.get("use_rslora") else r)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(c["num_hidden_layers"]):
        for module in fields["target_modules"]:
            d_in, d_out = dims[module]
            key = f"base_model.model.model.layers.{i}.{'self_attn' if module in _ATTN else 'mlp'}.{module}"
            # Scaled so that scaling * B @ A has entries about as large as the base weight's.
            tensors[key + ".lora_A.weight"] = torch.randn(r, d_in, generator=gen) / math.sqrt(d_in)
            tensors[key + ".lora_B.weight"] = torch.randn(d_out, r, generator=gen) / (scaling * math.sqrt(r))
    return tensors


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
