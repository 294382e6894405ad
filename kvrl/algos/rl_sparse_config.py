"""rl.algo=rl_sparse's rules (the algorithm: :mod:`kvrl.algos.rl_sparse`): rollouts under eviction.

It has no keys of its own: the eviction is the kv section's (kv.budget, kv.interval, kv.window,
kv.sink, kv.budget_ratio, kv.kwargs), whose rules (`uses=("kv",)`: a bounded budget that leaves
room for one token chosen by score) run with these. Under kv.policy=learned the rollouts evict with a
trained ForesightKV scorer, frozen, named by kv.kwargs.run as job=eval's learned lines name theirs
(eval.settings.NAME.run): on the config path the key must be set; just before the run, `kvrl.preflight.machine` asks
`scorer_problems` whether it holds a trained scorer. Light on purpose (no torch): the config gate imports it.
"""

from pathlib import Path

from kvrl.runlog import SCORER_FILES, scorer_file
from kvrl.section import SECTIONS, register_section

# where a job=foresight run's output_dir holds its trained scorer: stage 2's, else stage 1's (kvrl.jobs.foresight)
TRAIN_ONE = (
    "train one with job=foresight on the same model.path (python -m kvrl.run recipe=tiny_foresight output_dir=DIR "
    "for model.path=tiny, recipe=tiny_multihop_foresight for tiny-multihop: benchmarks/learning/multihop_foresight.py "
    "trains that one into outputs/multihop_foresight/run) and set kv.kwargs.run=DIR"
)


def problems(cfg) -> list[str]:
    """Also Distill's (:mod:`kvrl.algos.distill_config`), whose rollouts are RL-Sparse's."""
    # any token policy of the zoo or of your own (kv.policy=pkg.module:Class) evicts; full does not
    if cfg.kv.policy == "full":
        return [
            f"{cfg.rl.algo} trains under the eviction it is served with (G-KV's: gkv), but kv.policy="
            f"{cfg.kv.policy!r} keeps every token; set kv.policy=gkv with kv.budget > 0 (rl.algo=rl_full "
            "trains with the full cache)"
        ]
    if cfg.kv.policy == "learned" and "run" not in cfg.kv.kwargs:  # an untrained scorer's eviction is arbitrary
        return [
            f"{cfg.rl.algo} with kv.policy=learned rolls out under a trained ForesightKV scorer (frozen), but "
            f"kv.kwargs.run does not name one; {TRAIN_ONE}, or set kv.policy=gkv"
        ]
    return []


def scorer_problems(cfg) -> list[str]:
    """`kvrl.preflight.machine.run_problems`' (it looks outside the config): an RL job whose rl.algo evicts with kv.* under
    kv.policy=learned names, in kv.kwargs.run, a folder (or file) that holds a trained scorer."""
    section = SECTIONS.get(cfg.rl.algo)
    if section is None or "kv" not in section.uses or cfg.kv.policy != "learned" or "run" not in cfg.kv.kwargs:
        return []  # rules that are the config path's (problems above) are not repeated
    run = cfg.kv.kwargs["run"]
    if scorer_file(run) is not None:
        return []
    found = "no such file or folder" if not Path(str(run)).expanduser().exists() else "no trained scorer in it"
    return [
        f"kv.kwargs.run={run!r}: {found} (a job=foresight run's output_dir holds {' or '.join(SCORER_FILES)}), "
        f"but {cfg.rl.algo} with kv.policy=learned rolls out under a trained ForesightKV scorer; {TRAIN_ONE}"
    ]


register_section("rl_sparse", problems=problems, uses=("kv",))
