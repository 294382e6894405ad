"""Shrunk models of the seed architectures (kvrl.models.shrunk): configs, tokenizers, chat
templates and stop ids as the hub models have them; transformers and vLLM load them."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from kvrl.models import shrunk

FAMILIES = ["qwen3", "qwen3-thinking", "r1-qwen", "r1-llama", "llama3"]
QUESTION = [{"role": "user", "content": "What is 2+3?"}]
BOS = {"r1-qwen": "<｜begin▁of▁sentence｜>", "r1-llama": "<｜begin▁of▁sentence｜>", "llama3": "<|begin_of_text|>"}
# what add_generation_prompt renders for QUESTION
RENDERED = {
    "qwen3": "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n",
    "qwen3-thinking": "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n<think>\n",
    "r1-qwen": "<｜begin▁of▁sentence｜><｜User｜>What is 2+3?<｜Assistant｜><think>\n",
    "r1-llama": "<｜begin▁of▁sentence｜><｜User｜>What is 2+3?<｜Assistant｜><think>\n",
    "llama3": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+3?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
}
STOPS = {
    "qwen3": ["<|im_end|>", "<|endoftext|>"],
    "qwen3-thinking": ["<|im_end|>", "<|endoftext|>"],
    "r1-qwen": ["<｜end▁of▁sentence｜>"],
    "r1-llama": ["<｜end▁of▁sentence｜>", "<|eot_id|>"],
    "llama3": ["<|end_of_text|>", "<|eot_id|>"],
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """family -> its model folder (one build each: ~0.1 s after the first)."""
    root = tmp_path_factory.mktemp("shrunk")
    return {f: shrunk.build(f, root / f) for f in FAMILIES}


def tokenizer(path):
    return AutoTokenizer.from_pretrained(path)


def stop_ids(path):
    eos = GenerationConfig.from_pretrained(path).eos_token_id
    return eos if isinstance(eos, list) else [eos]


def test_unknown_architecture_lists_the_known_ones():
    with pytest.raises(ValueError, match="r1-qwen.*Qwen/Qwen3-4B"):
        shrunk.resolve("gpt2")


def test_every_hub_id_of_the_recipes_is_buildable():
    hub = {k: v for k, v in json.loads(shrunk.ARCHITECTURES.read_text()).items() if not k.startswith("_")}
    assert set(hub) <= set(shrunk.HUB_IDS)
    for hub_id in hub:
        assert shrunk.resolve(hub_id).hub_id in hub


@pytest.mark.parametrize("family", FAMILIES)
def test_config_keeps_the_architecture(built, family):
    cfg = json.loads((built[family] / "config.json").read_text())
    tok = tokenizer(built[family])
    assert 1000 <= len(tok) <= 2000 and cfg["vocab_size"] == -(-len(tok) // 64) * 64
    assert "rope_parameters" not in cfg  # hub-style rope_theta / rope_scaling
    model_type = {"qwen3": "qwen3", "qwen3-thinking": "qwen3", "r1-qwen": "qwen2"}.get(family, "llama")
    assert cfg["model_type"] == model_type
    assert cfg["architectures"] == [
        {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[model_type]
    ]
    model = AutoModelForCausalLM.from_pretrained(built[family]).eval()
    weights = load_file(built[family] / "model.safetensors")
    if model_type == "qwen3":
        assert cfg["head_dim"] == 32 and cfg["tie_word_embeddings"] is True
        assert "model.layers.0.self_attn.q_norm.weight" in weights
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    if model_type == "qwen2":
        assert "head_dim" not in cfg and cfg["tie_word_embeddings"] is False
        assert cfg["use_sliding_window"] is False and model.config.sliding_window is None
        bias = weights["model.layers.0.self_attn.k_proj.bias"]
        assert bias.abs().max() > 0  # random, so a loader that dropped it would change outputs
    if model_type == "llama":
        assert cfg["rope_theta"] == 500000.0 and cfg["tie_word_embeddings"] is False
        assert cfg["rope_scaling"] == shrunk.LLAMA3_ROPE
        assert model.config.rope_parameters["rope_type"] == "llama3"
    ids = tok("The answer is \\boxed{12}", return_tensors="pt").input_ids
    with torch.no_grad():
        assert model(ids).logits.shape == (1, ids.shape[1], cfg["vocab_size"])


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_template_renders_the_family_markers(built, family):
    tok = tokenizer(built[family])
    text = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert text == RENDERED[family]
    ids = tok(text, add_special_tokens=False).input_ids
    if family in BOS:  # the template writes the BOS; plain text gets it from the tokenizer
        bos = tok.convert_tokens_to_ids(BOS[family])
        assert ids.count(bos) == 1 and ids[0] == bos
        assert tok("The answer is 42").input_ids[0] == bos
    else:
        assert tok.bos_token is None and tok("The answer is 42").input_ids[0] not in tok.all_special_ids
    # every marker is one token, so the model sees the real structure
    for marker in ["<think>", "<|im_start|>", "<｜User｜>", "<|start_header_id|>"]:
        if marker in text:
            assert tok.convert_tokens_to_ids(marker) in ids


def test_qwen3_can_switch_thinking_off(built):
    tok = tokenizer(built["qwen3"])
    text = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    history = QUESTION + [{"role": "assistant", "content": "<think>\nadd</think>\n\n5"}]
    assert tok.apply_chat_template(history, tokenize=False).endswith("<|im_start|>assistant\n5<|im_end|>\n")


@pytest.mark.parametrize(
    "family, start",
    [
        ("qwen3", "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"),
        ("r1-qwen", "<｜begin▁of▁sentence｜>Be brief.<｜User｜>"),
        ("llama3", "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"),
    ],
)
def test_system_prompt(built, family, start):
    messages = [{"role": "system", "content": "Be brief."}] + QUESTION
    assert tokenizer(built[family]).apply_chat_template(messages, tokenize=False).startswith(start)


@pytest.mark.parametrize("family", FAMILIES)
def test_stop_ids_pad_and_think_tags(built, family):
    tok = tokenizer(built[family])
    assert tok.convert_ids_to_tokens(stop_ids(built[family])) == STOPS[family]
    assert tok.eos_token_id in stop_ids(built[family])
    assert tok.pad_token is not None and tok.padding_side == "left"
    batch = tok(["5", "The answer is 42"], padding=True).input_ids
    assert batch[0][0] == tok.pad_token_id and len(batch[0]) == len(batch[1])
    if family != "llama3":  # reasoning parsers need the think tags in decoded text
        ids = tok("<think>\nok</think>5", add_special_tokens=False).input_ids
        assert tok.decode(ids, skip_special_tokens=True) == "<think>\nok</think>5"


def test_same_seed_same_weights(tmp_path, built):
    again = shrunk.build("r1-llama", tmp_path / "again")
    other = shrunk.build("r1-llama", tmp_path / "other", seed=1)
    a, b, c = (load_file(p / "model.safetensors") for p in (built["r1-llama"], again, other))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert (again / "tokenizer.json").read_bytes() == (built["r1-llama"] / "tokenizer.json").read_bytes()


def test_sizes_and_dtype(tmp_path):
    path = shrunk.build("Qwen/Qwen3-1.7B", tmp_path, layers=1, hidden=256, heads=4, kv_heads=1, dtype="bfloat16")
    cfg = json.loads((path / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["head_dim"], cfg["num_key_value_heads"]) == (
        1,
        256,
        64,
        1,
    )
    assert cfg["dtype"] == "bfloat16"
    assert load_file(path / "model.safetensors")["model.embed_tokens.weight"].dtype == torch.bfloat16


@pytest.mark.vllm  # ~12 s, most of it importing vLLM and starting the engine
def test_vllm_runs_the_qwen2_family_without_head_dim(built, monkeypatch):
    """R1-Distill-Qwen (no head_dim, q/k/v bias, an inactive sliding window) in kvrl's vLLM
    engine: greedy tokens match the HF engine, and an evicting policy is accepted."""
    pytest.importorskip("vllm")
    from kvrl.engines.base import Sampling
    from kvrl.engines.hf import HFEngine
    from kvrl.engines.vllm.engine import VLLMEngine
    from kvrl.policies import make_policy

    monkeypatch.setitem(os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    path = str(built["r1-qwen"])
    engine = VLLMEngine(path, dtype="float32", kv_cache_gib=0.25, max_model_len=1024)
    assert engine.llm.llm_engine.vllm_config.model_config.get_sliding_window() is None
    prompts = ["What is 2+3?", "The answer is"]
    out = engine.generate(prompts, Sampling(max_new_tokens=8))
    assert all(len(t) == 8 or r == "stop" for t, r in zip(out.tokens, out.finish_reasons))
    hf = HFEngine(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), engine.tokenizer)
    assert out.tokens == [hf.generate([p], Sampling(max_new_tokens=8)).tokens[0] for p in prompts]
    policy = make_policy("streaming", budget=8, interval=4, window=4, sink=2)
    evicted = engine.generate(prompts, Sampling(max_new_tokens=8), policy=policy)
    assert [len(t) for t in evicted.tokens] == [len(t) for t in out.tokens] and evicted.traces is not None
