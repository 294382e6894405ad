"""dry_run=true: the plan of a recipe from its model's architecture, without weights."""

import pytest

from kvrl.config import load_config
from kvrl.preflight.plan import plan
from kvrl.run import main


def test_kv_memory_of_a_known_architecture_without_weights():
    # rl.algo=rl_sparse: rl_full's rule (kv.policy=full) is the config gate's
    cfg_args = [
        "recipe=tiny_rl_full",
        "rl.algo=rl_sparse",
        "model.path=deepseek-ai/DeepSeek-R1-Distill-Llama-8B",
        "model.dtype=bfloat16",
        "kv.policy=gkv",
        "kv.budget=2048",
        "kv.interval=128",
        "sampling.max_new_tokens=8192",
        "sampling.batch_size=16",
    ]
    p = plan(load_config(cfg_args))
    assert p["params"] == 8_030_261_248  # Llama-3.1-8B, counted on the meta device
    assert p["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads, bf16
    assert p["kept_tokens_per_sequence"] == 2048 + 128  # the cache peaks one interval above the budget
    assert p["kv_full_bytes_per_batch"] == 16 * 8192 * p["kv_bytes_per_token"]
    assert p["cpus"] == 1.5 and p["rollout_actors"] == 2
    # G-KV's ratio mode: the budget of the whole sequence, max(2048, 0.5 x 8192 new tokens)
    ratio = plan(load_config([*cfg_args, "kv.budget_ratio=0.5"]))
    assert ratio["tokens_per_sequence"] == 8192 and ratio["kept_tokens_per_sequence"] == 4096 + 128


def test_dry_run_prints_the_plan_and_loads_nothing(capsys):
    assert main(["recipe=tiny_rl_full", "dry_run=true"]) == 0
    out = capsys.readouterr().out
    assert "0.8 M parameters" in out and "the Ray cluster needs 1.5 CPUs" in out


def test_unknown_model_says_what_to_pass(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network here; an unknown hub id must fail cleanly
    assert main(["recipe=tiny_rl_full", "dry_run=true", f"model.path={tmp_path}/nope"]) == 2
    assert "pass a local folder with a config.json" in capsys.readouterr().err


CLUSTER = [
    "rlkv_r1_llama_8b",
    "rlkv_r1_qwen_7b",
    "rlkv_qwen3_4b_thinking",
    "gkv_r1_qwen_7b",
    "gkv_r1_llama_8b",
    "foresight_qwen3_4b",
    "foresight_qwen3_1_7b",
    "foresight_r1_qwen_7b",
]


@pytest.mark.parametrize("recipe", CLUSTER)
def test_every_cluster_recipe_fits_80_gb_gpus(recipe, capsys):
    from kvrl.preflight.plan import dry_run

    p = dry_run(load_config([f"recipe={recipe}"]))
    out = capsys.readouterr().out
    assert "rollout peak" in out and "learner peak" in out and "WARNING" not in out, out
    for actor, parts in p["memory"].items():
        assert parts["weights"] <= sum(parts.values()) < 80 * 2**30, (actor, parts)


def test_a_learner_that_would_not_fit_is_warned_with_the_fix(capsys):
    """G-KV's learner share (32 samples x ~4K tokens) in one pass keeps ~665 GB of activations."""
    from kvrl.preflight.plan import dry_run

    p = dry_run(
        load_config(["recipe=gkv_r1_qwen_7b", "trainer.micro_batch_tokens=0", "trainer.gradient_checkpointing=false"])
    )
    assert p["memory"]["learner"]["activations"] > 500 * 2**30
    assert "WARNING    the learner does not fit: set trainer.micro_batch_tokens" in capsys.readouterr().out


def test_the_trace_actors_are_planned_and_vllm_sizing_its_own_cache_is_warned(capsys):
    """A ForesightKV trace actor holds vLLM and the HF scorer; vLLM's own sizing fills 90 % of
    the GPU, so the recipes give it workers.kv_cache_gib."""
    from kvrl.preflight.plan import dry_run

    p = dry_run(load_config(["recipe=foresight_qwen3_4b", "workers.kv_cache_gib=0"]))
    parts = p["memory"]["trace actor"]
    assert parts["scoring weights"] == parts["weights"] == p["weights_bytes"] and parts["scoring forward"] > 0
    assert "WARNING    the trace actor does not fit: set workers.kv_cache_gib" in capsys.readouterr().out
    assert main(["recipe=tiny_foresight", "job=foresight_traces", "dry_run=true"]) == 0
    out = capsys.readouterr().out
    assert "traces     2 rollout actors (vllm + hf scoring" in out and "trace actor peak" in out
    assert "learner" not in out  # the data step alone starts no learner


@pytest.mark.parametrize("recipe", ["eval_math_qwen3_4b", "eval_math_r1_qwen_7b", "eval_math_r1_llama_8b"])
def test_eval_math_recipes_plan_the_papers_budgets(recipe, capsys):
    assert main([f"recipe={recipe}", "dry_run=true"]) == 0
    out = capsys.readouterr().out
    assert "x budgets 128, 256, 512, 1024, 2048, 4096" in out and "KV per sequence at 4096 tokens" in out


# The learner of RLKV, forward and backward, as kvrl.workers.learner runs it: weights frozen,
# the gates the only parameter, HFEngine.score under the mixed-gate attention. Resident-set
# growth above the process's state after a short warm-up (benchmarks/system/mixed_memory.py's method),
# read as the child's own high-water mark (VmHWM: getrusage's ru_maxrss keeps the parent's
# peak across fork and exec, 76.7 MiB "measured" here after the cluster-recipe tests), with
# glibc returning every block of ≥ 64 KiB to the system on free, so that the peak
# resident set follows the peak of the live tensors rather than the allocator's caching
# (measured: two runs within 0.2 %; without the setting the same step read 77.7 MiB against
# 60.4, the allocator's cached blocks counted as live).
LEARNER_PEAK = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from kvrl.engines.hf import HFEngine
from kvrl.policies import Mixed
path, rows, seq, prompt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), 16
torch.set_num_threads(1)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
model.requires_grad_(False)
model.train()
engine = HFEngine(model, AutoTokenizer.from_pretrained(path))
cfg = model.config
gates = torch.nn.Parameter(torch.full((cfg.num_hidden_layers, cfg.num_key_value_heads), 0.5))
g = torch.Generator().manual_seed(0)

def step(n):
    seqs = torch.randint(0, cfg.vocab_size, (rows, n), generator=g).tolist()
    engine.score(seqs, [prompt] * rows, policy=Mixed(gates, sink=4, recent=64)).logprobs.sum().backward()

def status(field):  # kB -> bytes
    return next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith(field + ":")) * 1024

step(64)  # the libraries' own buffers and thread pools
base = status("VmRSS")
step(seq)
print(json.dumps({"peak": status("VmHWM") - base}))
"""


def test_the_rlkv_learners_plan_counts_its_attention_masks(tmp_path):
    """The dry run's learner activations, logits and attention masks at a shrunk shape
    (rlkv's Llama-3 R1 architecture, 2 layers, hidden 128; 2 sequences of 1,024 tokens, no
    checkpointing, float32 on CPU) are within 15 % of the measured peak of that learner's
    forward and backward (measured 60.4 MiB, planned 66.8 MiB: +11 %). Without the masks
    (20 MiB: 8 MiB per branch, kept for backward by scaled_dot_product_attention, and the bool
    masks) the plan was 46.8 MiB, 23 % low. With gradient checkpointing the sum of parts
    over-predicts (measured 37.7 MiB, planned 54.8): the parts peak at different times."""
    import json
    import os
    import subprocess
    import sys

    from kvrl.models import shrunk
    from kvrl.preflight.plan import memory, model_config

    rows, seq = 2, 1024
    path = shrunk.build("r1-llama", tmp_path / "model")
    cfg = load_config(
        [
            "recipe=tiny_rlkv",
            f"model.path={path}",
            "model.dtype=float32",
            f"trainer.batch_size={rows}",
            "rl.group_size=2",
            "trainer.micro_batch_tokens=0",
            "trainer.gradient_checkpointing=false",
        ]
    )
    p = plan(cfg)
    p["tokens_per_sequence"] = seq  # the measured sequences' length, whatever the environment's prompts
    parts = memory(cfg, model_config(cfg.model.path), p)["learner"]
    assert parts["gradients"] < 2**10 and parts["optimizer"] < 2**10  # 4 gates
    planned = parts["activations"] + parts["logits"] + parts["attention masks"]

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}
    res = subprocess.run(
        [sys.executable, "-c", LEARNER_PEAK, str(path), str(rows), str(seq)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    measured = json.loads(res.stdout.strip().splitlines()[-1])["peak"]
    print(
        f"RLKV learner at {rows} x {seq}: planned {planned / 2**20:.1f} MiB "
        f"(masks {parts['attention masks'] / 2**20:.1f}), measured {measured / 2**20:.1f} MiB"
    )
    assert abs(planned / measured - 1) <= 0.15, (planned, measured)
    assert planned - parts["attention masks"] < 0.85 * measured  # the term a plan without masks misses


def test_foresight_counts_the_gpu_its_stage_1_runs_on(capsys):
    """Before: 3 GPUs planned, while stage 1 ran in the driver on a GPU the total did not count."""
    from kvrl.preflight.plan import allocation_problems, dry_run

    p = dry_run(load_config(["recipe=foresight_qwen3_4b"]))
    assert (p["actor_gpus"], p["driver_gpus"], p["gpus"]) == (3, 1, 4)
    assert (
        "the Ray cluster needs 12 CPUs and 3 GPUs, plus 1 GPU for stage 1 in this process: 4 GPUs in all"
        in capsys.readouterr().out
    )
    cfg = load_config(["recipe=foresight_qwen3_4b"])
    assert allocation_problems(p, cfg, 1, 4, None) == []
    (problem,) = allocation_problems(p, cfg, 1, 3, None)
    assert "need 4 GPUs (2 rollout x 1 + 1 learners x 1 + 1 for stage 1 in the driver)" in problem
    assert dry_run(load_config(["recipe=foresight_qwen3_4b", "device=cpu"]))["gpus"] == 3
