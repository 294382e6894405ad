"""Shrunk models: small random-initialised copies of the seed architectures, with tokenizers
that behave like the real ones. For tests and shrunk cluster-recipe smoke runs; nothing is
downloaded.

``build(arch, out_dir)`` writes a model folder (config.json, safetensors, tokenizer files,
generation_config.json) that transformers and vLLM load like the hub model: the family's
model_type and config quirks (Qwen3's explicit head_dim and tied embeddings, Qwen2's missing
head_dim and q/k/v bias, Llama-3's ``llama3`` rope scaling), its special tokens under their
real names, chat template, BOS handling, pad token and stop ids. What is shrunk: a few layers
of random weights (fixed seed) and a byte-level BPE of ~1,500 tokens trained on a built-in
corpus in a fraction of a second.
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

ARCHITECTURES = Path(__file__).parent / "architectures.json"

BPE_VOCAB = 1536  # before the added tokens; the corpus has enough distinct pieces for it

# The real pre-tokenizer splits: Qwen puts every digit alone, Llama-3 groups up to three.
SPLITS = {
    "qwen": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
    "llama3": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
}

THINK = ("<think>", "</think>")  # ordinary added tokens (not special), as in the real tokenizers:
# decoding with skip_special_tokens keeps them, so reasoning parsers still find them

# Simplified versions of the hub templates (no tools); past assistant turns lose their reasoning.
QWEN3_TURNS = """\
{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{%- set content = message.content %}
{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}
{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
"""
QWEN3_TEMPLATE = (
    QWEN3_TURNS
    + """\
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""
)
# Qwen3-Thinking-2507 always thinks: its generation prompt opens the think block.
QWEN3_THINKING_TEMPLATE = (
    QWEN3_TURNS
    + """\
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"""
)

R1_TEMPLATE = """\
{%- set ns = namespace(system='') %}
{%- for message in messages %}{%- if message.role == 'system' %}{%- set ns.system = message.content %}{%- endif %}{%- endfor %}
{{- bos_token + ns.system }}
{%- for message in messages %}
{%- if message.role == 'user' %}{{- '<｜User｜>' + message.content }}
{%- elif message.role == 'assistant' %}
{%- set content = message.content %}
{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1] %}{%- endif %}
{{- '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<｜Assistant｜><think>\\n' }}{%- endif %}"""

LLAMA3_TEMPLATE = """\
{{- bos_token }}
{%- for message in messages %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""

BOS_R1, EOS_R1 = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass(frozen=True)
class Family:
    hub_id: str  # the architectures.json entry whose model_type, head_dim and tying it copies
    split: str  # key of SPLITS
    added: tuple[str, ...]  # added tokens in id order (all special but THINK), after the BPE
    eos: str  # the tokenizer's eos_token
    pad: str
    stops: tuple[str, ...]  # generation_config eos_token_id (a list when more than one)
    template: str
    rope: dict  # rope_theta (+ rope_scaling), as in the hub config
    bos: str | None = None  # prepended to plain text when set (Llama-3 and R1 tokenizers)
    sampling: dict = field(default_factory=dict)  # the hub generation_config's defaults


QWEN3_ADDED = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", *THINK)
QWEN3_SAMPLING = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}
R1_SAMPLING = {"do_sample": True, "temperature": 0.6, "top_p": 0.95}

FAMILIES = {
    "qwen3": Family(
        "Qwen/Qwen3-4B",
        "qwen",
        QWEN3_ADDED,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        stops=("<|im_end|>", "<|endoftext|>"),
        template=QWEN3_TEMPLATE,
        rope={"rope_theta": 1_000_000.0},
        sampling=QWEN3_SAMPLING,
    ),
    "qwen3-thinking": Family(
        "Qwen/Qwen3-4B-Thinking-2507",
        "qwen",
        QWEN3_ADDED,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        stops=("<|im_end|>", "<|endoftext|>"),
        template=QWEN3_THINKING_TEMPLATE,
        rope={"rope_theta": 5_000_000.0},
        sampling=QWEN3_SAMPLING,
    ),
    # R1-Distill keeps its base model's vocabulary with renamed specials; pad is eos, as on the hub
    "r1-qwen": Family(
        "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
        "qwen",
        (EOS_R1, "<｜User｜>", "<｜Assistant｜>", BOS_R1, *THINK),
        eos=EOS_R1,
        pad=EOS_R1,
        stops=(EOS_R1,),
        template=R1_TEMPLATE,
        rope={"rope_theta": 10_000.0},
        bos=BOS_R1,
        sampling=R1_SAMPLING,
    ),
    # <|eot_id|> survives from Llama-3.1's vocabulary; listing it as a second stop exercises
    # multi-stop outside Qwen (the hub generation_config stops on end-of-sentence alone)
    "r1-llama": Family(
        "deepseek-ai/DeepSeek-R1-Distill-Llama-8B",
        "llama3",
        (BOS_R1, EOS_R1, "<|eot_id|>", "<｜User｜>", "<｜Assistant｜>", *THINK),
        eos=EOS_R1,
        pad=EOS_R1,
        stops=(EOS_R1, "<|eot_id|>"),
        template=R1_TEMPLATE,
        rope={"rope_theta": 500_000.0, "rope_scaling": LLAMA3_ROPE},
        bos=BOS_R1,
        sampling=R1_SAMPLING,
    ),
    # Llama-3.1-8B-Instruct's tokens and template (R1-Distill-Llama-8B is a fine-tuned Llama-3.1-8B)
    "llama3": Family(
        "deepseek-ai/DeepSeek-R1-Distill-Llama-8B",
        "llama3",
        (
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|finetune_right_pad_id|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ),
        eos="<|eot_id|>",
        pad="<|finetune_right_pad_id|>",
        stops=("<|end_of_text|>", "<|eot_id|>"),
        template=LLAMA3_TEMPLATE,
        rope={"rope_theta": 500_000.0, "rope_scaling": LLAMA3_ROPE},
        bos="<|begin_of_text|>",
        sampling={"do_sample": True, "temperature": 0.6, "top_p": 0.9},
    ),
}

HUB_IDS = {
    "Qwen/Qwen3-4B": "qwen3",
    "Qwen/Qwen3-1.7B": "qwen3",
    "Qwen/Qwen3-4B-Thinking-2507": "qwen3-thinking",
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B": "r1-qwen",
    "deepseek-ai/DeepSeek-R1-Distill-Llama-8B": "r1-llama",
}

# ---- the tokenizer ----

WORDS = """the a an of and to in is it that for on with as was be by this are or from at not but have
one two three four five six seven eight nine ten eleven twelve twenty thirty hundred thousand
first second third next last then so therefore thus hence because since if when while each every
all some many more most less least few number numbers sum total difference product quotient
answer question problem step steps solution solve find compute calculate check verify result
let us we me i you he she they them their our my your its his her who what which where why how
add plus minus times divided multiply subtract equals equal greater smaller larger than between
value values integer integers even odd prime factor factors divisible remainder digit digits
square root cube power powers fraction half quarter percent ratio rate average mean median
apples oranges books coins cars boxes students teachers friends people days hours minutes
seconds weeks months years price cost money dollars cents buy buys bought sell sold gives gave
takes took has had makes made gets got needs needed wants wanted left right start end begin
think thinking thought wait hmm okay actually maybe perhaps sure right wrong correct incorrect
again also only just still already yet very much good better best bad worse same different
new old big small long short high low fast slow early late before after during until
time speed distance length width height area volume perimeter circle triangle rectangle
angle side sides line lines point points graph function equation equations variable variables
expression term terms coefficient constant linear quadratic solve solving solved simplify
substitute substituting recall note notice means mean suppose assume given gives consider
case cases example examples pattern sequence series count counting counted probability
chance random choose chosen ways way order arrange arrangement combination permutation
john mary alice bob tom anna sam lisa mark emma james sarah david kate peter lucy
store school class game team city farm garden table room house car train bus road
water milk bread cake pizza cookies candies marbles pencils pens stickers cards shells
red blue green yellow white black small large round heavy light full empty
write writing written read reading said says say tell told ask asked know known
final finally first therefore hence conclude conclusion box boxed format output
user assistant system"""

TEMPLATES = [
    "{A} has {a} {n}. {B} gives {A} {b} more. How many {n} does {A} have now?",
    "{a} + {b} = {s}",
    "{a} - {b} = {d}",
    "{a} * {b} = {p}",
    "{a} \\times {b} = {p}",
    "So {a} + {b} = {s}, and the answer is \\boxed{{{s}}}.",
    "The answer is {s}.",
    "The answer is \\boxed{{{p}}}",
    "Therefore, the final answer is $\\boxed{{{d}}}$.",
    "Let me think step by step. First, {a} times {b} is {p}. Then we add {c} to get {q}.",
    "Wait, let me check that again: {p} + {c} = {q}. Yes, that is correct.",
    "Okay, so we need to find the total number of {n}. {A} bought {a} and {B} bought {b}.",
    "Hmm, maybe I should verify: {s} - {b} = {a}. Right.",
    "If x + {a} = {s}, then x = {b}.",
    "Solve for y: {a}y = {p}. So y = {b}.",
    "$\\frac{{{p}}}{{{a}}} = {b}$",
    "The sum of {a}, {b} and {c} is {t}.",
    "What is {a} + {b}? Answer: {s}",
    "Let me think.\n\n{a} + {b} = {s}\n\nThe answer is {s}.\n\n",
    "system\nYou are a helpful assistant.\nuser\nWhat is {a} + {b}?\nassistant\n",
    "Question: {A} had {s} {n} and gave away {b}. How many are left?",
]


def _corpus(n: int = 2000, seed: int = 0):
    """Short sentences of English and arithmetic, fixed by ``seed``."""
    rng = random.Random(seed)
    words = WORDS.split()
    names = [w.capitalize() for w in "john mary alice bob tom anna sam lisa mark emma".split()]
    nouns = "apples oranges books coins cars boxes marbles pencils stickers cards".split()
    for _ in range(n):
        a, b, c = rng.randint(0, 999), rng.randint(1, 99), rng.randint(0, 50)
        yield rng.choice(TEMPLATES).format(
            A=rng.choice(names),
            B=rng.choice(names),
            n=rng.choice(nouns),
            a=a,
            b=b,
            c=c,
            s=a + b,
            d=a - b,
            p=a * b,
            q=a * b + c,
            t=a + b + c,
        )
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 14)))
        yield sentence.capitalize() + rng.choice([".", "?", "!", ",", ":", "\n"])


@functools.cache
def _bpe(split: str) -> str:
    """The trained byte-level BPE (no added tokens) as tokenizer.json text; once per process."""
    tok = Tokenizer(models.BPE())
    if split == "qwen":
        tok.normalizer = normalizers.NFC()  # as Qwen's tokenizer.json
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLITS[split]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_corpus(), trainer)
    return tok.to_str()


def build_tokenizer(family: Family, max_positions: int = 4096) -> PreTrainedTokenizerFast:
    """The family's tokenizer: the shared BPE plus its added tokens, template and BOS rule."""
    tok = Tokenizer.from_str(_bpe(family.split))
    for content in family.added:  # one at a time: ids follow the tuple's order
        special = content not in THINK
        tok.add_tokens([AddedToken(content, special=special, normalized=False)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=family.bos,
        eos_token=family.eos,
        pad_token=family.pad,
        add_bos_token=family.bos is not None,
        padding_side="left",
        chat_template=family.template,
        model_max_length=max_positions,
        clean_up_tokenization_spaces=False,
    )


# ---- the model ----


def resolve(arch: str) -> Family:
    """A family name or an architectures.json hub id -> its Family."""
    name = HUB_IDS.get(arch, arch)
    if name not in FAMILIES:
        known = sorted(FAMILIES) + sorted(HUB_IDS)
        raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(known)}")
    return FAMILIES[name]


def build(
    arch: str,
    out_dir,
    *,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 256,
    max_positions: int = 4096,
    seed: int = 0,
    dtype: str = "float32",
    head_dim: int | None = None,
    tied: bool | None = None,
) -> Path:
    """Write a shrunk ``arch`` (a family name or a hub id, see ``FAMILIES``/``HUB_IDS``) to
    ``out_dir``; returns its path. head_dim: default hidden / heads (32 by default: vLLM's
    CPU attention takes 32/64/128); another value is written to config.json even for a
    family whose hub config has none (Qwen2: transformers honours it, vLLM does not).
    tied: tie_word_embeddings, default the hub model's. max_positions is
    max_position_embeddings, at least 16384 for the Llama families. Same arguments, same
    weights."""
    family = resolve(arch)
    hub = json.loads(ARCHITECTURES.read_text())[family.hub_id]
    out = Path(out_dir)
    if "rope_scaling" in family.rope:  # transformers warns on every load unless the llama3 rope's
        # original context (8192) is below max_position_embeddings (the hub has 16x it)
        max_positions = max(max_positions, 2 * LLAMA3_ROPE["original_max_position_embeddings"])
    tokenizer = build_tokenizer(family, max_positions)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in family.added}
    bos = ids[family.bos] if family.bos else None
    config = AutoConfig.for_model(
        hub["model_type"],
        vocab_size=-(-len(tokenizer) // 64) * 64,  # padded embedding, as on the hub
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim or hidden // heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=hub["tie_word_embeddings"] if tied is None else tied,
        rope_parameters={
            "rope_type": "default",
            **family.rope.get("rope_scaling", {}),
            "rope_theta": family.rope["rope_theta"],
        },
        initializer_range=0.05,  # peakier attention than 0.02: scores further from ties
        rms_norm_eps=1e-5 if hub["model_type"] == "llama" else 1e-6,
        bos_token_id=bos,
        eos_token_id=ids[family.eos],
        pad_token_id=ids[family.pad],
    )
    with torch.random.fork_rng(devices=[]):  # deterministic without touching the caller's RNG
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # zero-initialised biases (Qwen2's q/k/v) would be invisible
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.2)
    model.to(getattr(torch, dtype)).save_pretrained(out)
    GenerationConfig(  # replaces the one save_pretrained derived from the config
        bos_token_id=bos if bos is not None else ids[family.pad],
        pad_token_id=ids[family.pad],
        eos_token_id=[ids[t] for t in family.stops] if len(family.stops) > 1 else ids[family.stops[0]],
        **family.sampling,
    ).save_pretrained(out)
    tokenizer.save_pretrained(out, save_jinja_files=False)  # template inside tokenizer_config.json, as the hub's
    _hub_style_config(out / "config.json", family, hub)
    return out


def _hub_style_config(path: Path, family: Family, hub: dict) -> None:
    """Rewrite transformers 5's config.json in the form the hub configs have (which is what
    loaders meet in practice): rope_theta/rope_scaling instead of rope_parameters, no
    head_dim where the hub has none and it is hidden/heads (Qwen2 derives it), and Qwen2's
    inactive sliding window."""
    cfg = json.loads(path.read_text())
    cfg.pop("rope_parameters", None)
    cfg.update(family.rope)
    if "head_dim" not in hub and cfg.get("head_dim") == cfg["hidden_size"] // cfg["num_attention_heads"]:
        cfg.pop("head_dim", None)
    if hub["model_type"] == "qwen2":
        cfg.update(use_sliding_window=False, sliding_window=4096, max_window_layers=cfg["num_hidden_layers"])
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
