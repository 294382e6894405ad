"""The tiny reasoner: a 0.8 M-parameter Llama (GQA, 4 layers x 2 KV heads) with a local
word-level tokenizer, shipped in ``kvrl/models/weights/tiny_reasoner`` and trained by
``python -m kvrl.run recipe=tiny_pretrain`` on running counts (``kvrl.envs.counts``).

Everything here builds locally: no hub access. ``load_model("tiny")`` gives the shipped
weights; :func:`resolve_path` is where every ``model.path`` becomes a folder: a kvrl run
directory gives the weights it trained, anything else is handed to transformers (a local
folder, or a hub id for users who have a network).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast

from kvrl.envs.chains import VOCAB
from kvrl.models import SHIPPED, seal_problem
from kvrl.runlog import trained_model

TINY_PATH = SHIPPED["tiny"][0]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Whitespace-split word-level tokenizer over the task vocabulary (names, digits,
    punctuation: shared by the counts and chains environments); adds <bos>."""
    vocab = {tok: i for i, tok in enumerate(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<pad>",
        padding_side="left",
    )


def tiny_config(
    tokenizer: PreTrainedTokenizerFast,
    *,
    layers: int = 4,
    hidden: int = 128,
    kv_heads: int = 2,
    intermediate: int = 384,
    max_positions: int = 1024,
) -> LlamaConfig:
    """A tiny Llama with query heads of size 32 (a head size vLLM's CPU kernels support) and
    tied embeddings. The defaults are the shipped counts reasoner's (tiny_reasoner.md's
    attempt 4): hidden 128, 4 query / 2 KV heads, 4 layers."""
    if hidden % 32 or (hidden // 32) % kv_heads:
        raise ValueError(
            f"hidden={hidden} must be a multiple of 32 whose {hidden // 32} query heads of size 32 "
            f"split into kv_heads={kv_heads} groups"
        )
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=kv_heads,
        head_dim=32,
        max_position_embeddings=max_positions,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


@functools.cache
def resolve_path(path: str) -> str:
    """``"tiny"`` and ``"tiny-multihop"`` name the shipped weights (:data:`SHIPPED`, checked against
    the SHA256SUMS shipped beside them, as is any folder a SHA256SUMS seals: :func:`kvrl.models.seal_problem`);
    a kvrl run directory (an ``output_dir``, without a
    config.json) names the weights that run trained, its final model or else its newest
    complete checkpoint's (:func:`kvrl.runlog.trained_model`: verified against their checksums,
    refused with what to pass instead for a run that trained no model weights), with a note on
    stderr saying which; anything else is passed through. Once per process: every caller
    (config, tokenizer, weights) gets the same folder, even if the run saves a newer one meanwhile."""
    if path in SHIPPED:
        folder, recipe = SHIPPED[path]
        if not (folder / "config.json").exists():
            raise FileNotFoundError(
                f"the {path} reasoner's weights are missing from {folder}; reinstall kvrl, or "
                f"train them with `python -m kvrl.run recipe={recipe}`"
            )
    why = seal_problem(path)  # a shipped or sealed folder is checked against its checksums before it loads
    if why is not None:
        raise ValueError(why)
    if path in SHIPPED:
        return str(SHIPPED[path][0])
    local = Path(path).expanduser()
    if local.is_dir() and not (local / "config.json").exists():
        found = trained_model(local)
        if found is not None:
            print(f"kvrl: model.path={path} is a run directory: loading {found[1]}", file=sys.stderr)
            return str(found[0])
    return path


def load_model(path: str = "tiny", dtype: str = "float32", device: str = "cpu", attn_implementation: str = "sdpa"):
    """(model in eval mode, tokenizer with left padding) from a local path or "tiny"."""
    path = resolve_path(path)
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, dtype), attn_implementation=attn_implementation
    )
    return model.to(device).eval(), tokenizer
