"""What Golden Eviction keeps on the multihop reasoner that the learned scorer does not, and whether its features can see it.

Replays Golden Eviction (the oracle: it ranks a cached token by the most attention any future block pays it) over
the held-out traces of a finished ForesightKV run (``--run``, its ``traces/heldout``) at ``--budget`` tokens. At
every eviction step, layer and KV head, on the oracle's own cache, the run's stage-1 and stage-2 scorers rank the
same candidates; each candidate token is given its role in the trace:

* ``stmt``: a prompt statement's name or right-hand side (``F R`` of ``F R ;``), split by whether a later copy
  of that statement in the chain of thought reads it (``needed``: a copy line of F starts at or after the step's
  end) and, if needed, whether the chain of thought has already walked it once (``seen``) or not (``unseen``:
  no query of the trace has reached that statement yet);
* ``stmt_sep``, ``query`` (``? a b :``), ``cot_copy``, ``cot_value`` (``X = 0 ;``), ``answer``.

Prints one JSON line (``--no-record``) or records it in ``benchmarks/results/multihop_golden_gap_B.json``: per
role and per scorer the share of candidates it keeps beside Golden's, the recall of Golden's keep set, the
within-row AUC of the scorer's keep score between needed and never-needed statement tokens (all of them, and
the unseen ones), and the same AUC of the cumulative attention the token has received so far (the scorer's
strongest attention feature): how far the features alone can tell a statement a later query needs.

    python benchmarks/learning/multihop_golden_gap.py --run outputs/multihop_foresight/seeds/b117-s0 --budget 117
"""

import argparse
from collections import defaultdict
from pathlib import Path

import torch

from kvrl.bench import emit, record, train_commits
from kvrl.config import load_config
from kvrl.data.traces import SPLIT_SEEDS, load_traces
from kvrl.envs.eviction import ChunkedPass
from kvrl.models.tiny import load_model
from kvrl.policies import make_policy
from kvrl.policies.golden import GoldenEviction, record_attention
from kvrl.runlog import setup_process

RECIPE = "tiny_multihop_foresight"
STAGES = ("sft", "rl")


def roles(tokens: list[str], prompt_len: int) -> tuple[list[str], list[str | None], dict[str, list[int]]]:
    """Per position: its role, the statement variable it belongs to (prompt statements only), and per variable the
    positions where a chain-of-thought copy line of its statement starts."""
    role, var, copies = [None] * len(tokens), [None] * len(tokens), defaultdict(list)
    query = tokens.index("?")
    for p in range(1, query):
        k = (p - 1) % 3
        role[p], var[p] = ("stmt", tokens[p - k]) if k < 2 else ("stmt_sep", None)
    for p in range(query, prompt_len):
        role[p] = "query"
    line, p = [], prompt_len
    for p in range(prompt_len, len(tokens)):
        line.append(p)
        if tokens[p] == ";" or p == len(tokens) - 1:
            kind = "cot_value" if any(tokens[q] == "=" for q in line) else "cot_copy"
            if tokens[p] != ";":
                kind = "answer"
            if kind == "cot_copy" and len(line) == 3:
                copies[tokens[line[0]]].append(line[0])
            for q in line:
                role[q] = kind
            line = []
    role[0] = "bos"
    return role, var, copies


def auc(pos: torch.Tensor, neg: torch.Tensor) -> tuple[float, int] | None:
    """P(a positive scores above a negative) + half the ties, and the number of pairs; None without pairs."""
    if len(pos) == 0 or len(neg) == 0:
        return None
    diff = pos[:, None] - neg[None, :]
    return float((diff > 0).float().sum() + 0.5 * (diff == 0).float().sum()), diff.numel()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True, help="a finished ForesightKV run (its held-out traces and scorers)")
    ap.add_argument("--budget", type=int, required=True, help="the budget to replay at")
    ap.add_argument("--traces", type=int, default=16, help="held-out traces replayed (~20 s each)")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    setup_process()  # one torch thread, denormals flushed: as every kvrl process
    run = Path(args.run)
    cfg = load_config([f"recipe={RECIPE}"])
    kv = cfg.kv
    budget = args.budget
    model, tok = load_model(cfg.model.path)
    model.requires_grad_(False)
    setting = dict(budget=budget, interval=kv.interval, window=kv.window, sink=kv.sink)
    scorers = {}
    for stage in (s for s in STAGES if (run / s / "scorer.safetensors").exists()):  # a run still in stage 2: SFT
        scorers[stage] = make_policy("learned", model.config, **setting)
        scorers[stage].load_scorer(run / stage / "scorer.safetensors")
    traces = load_traces(run / "traces" / "heldout")[: args.traces]

    kept = defaultdict(lambda: [0, 0])  # (who, role) -> [kept, candidates]
    recall = defaultdict(lambda: [0, 0])  # stage -> [golden's evictions the scorer makes too, golden's evictions]
    aucs = defaultdict(lambda: [0.0, 0])  # name -> [sum of wins, pairs]
    retention = defaultdict(lambda: defaultdict(lambda: [0, 0]))  # who -> kind -> [held, existing]
    for trace in traces:
        tokens = [tok.decode([i]) for i in trace.ids]
        role, var, copies = roles(tokens, trace.prompt_len)
        ids = torch.tensor(trace.ids)
        golden = GoldenEviction(**setting, attention=record_attention(model, ids, trace.prompt_len, kv.interval))
        chunked = ChunkedPass(model, ids, trace.prompt_len, scorers["sft"])
        while chunked.advance():
            for obs in chunked.observations():
                end = int(obs.query_pos[0, -1]) + 1
                pos = obs.key_pos[0]  # [H, N]
                cand = (pos >= 0) & ~scorers["sft"].always_kept(obs.key_pos)[0]
                label, _ = golden.score(obs)
                keeps = {"golden": golden.select(obs, label).keep[0]}
                scores = {}
                for stage, scorer in scorers.items():
                    score, state = scorer.score(obs)  # the features (and state) do not read the weights
                    scores[stage], keeps[stage] = score[0], scorer.select(obs, score).keep[0]
                cumsum = state[0, :, :, : scorers["sft"].group].amax(-1)  # [H, N] attention received so far
                tally(
                    pos, cand, end, role, var, copies, keeps, {"golden": label[0], **scores}, cumsum, kept, recall, aucs
                )
                chunked.apply(obs.layer, keeps["golden"][None], state)
        own = {"golden": golden, **scorers, "gkv": make_policy("gkv", model.config, **setting)}
        for who, policy in own.items():
            retained(model, ids, trace.prompt_len, policy, role, var, copies, retention[who])

    dropped = defaultdict(int)
    for (who, _), (k, c) in kept.items():
        dropped[who] += c - k
    line = {
        "benchmark": "multihop_golden_gap",
        "task": "multihop",
        "formulation": "foresight",
        "run": str(run),
        "budget": budget,
        "kv": setting,
        "heldout_traces": len(traces),
        "heldout_trace_seed": cfg.seed + SPLIT_SEEDS["heldout"],
        "train_commits": train_commits(run),
        # per eviction step: the share of a role's candidates each policy evicts, and what its evictions are
        "drop_rate": {f"{who}/{r}": round(1 - k / max(c, 1), 4) for (who, r), (k, c) in sorted(kept.items())},
        "evictions_by_role": {
            who: {r: round((c - k) / max(dropped[who], 1), 4) for (w, r), (k, c) in sorted(kept.items()) if w == who}
            for who in dropped
        },
        "candidates": {r: c for (who, r), (_, c) in sorted(kept.items()) if who == "golden"},
        # of the tokens Golden evicts at a step, the share the scorer evicts too (a random choice: the drop rate)
        "agreement_on_golden_evictions": {s: round(a / max(b, 1), 4) for s, (a, b) in recall.items()},
        # on each policy's own path, after each eviction: the share of the statement tokens a later copy reads
        # (seen: already walked once; unseen: not yet) and of those none reads again that a KV head still holds
        "statements_held": {
            who: {kind: round(h / max(e, 1), 4) for kind, (h, e) in sorted(kinds.items())}
            for who, kinds in retention.items()
        },
        "auc": {name: round(w / p, 4) if p else None for name, (w, p) in sorted(aucs.items())},
    }
    (emit if args.no_record else lambda x: record(f"multihop_golden_gap_{budget}", x))(line)


def statement_kind(p: int, end: int, role, var, copies) -> str | None:
    """A prompt statement token's kind at a step ending at ``end``: never (no copy line of it starts at or
    after ``end``), needed_seen (one does and one already did), needed_unseen; None for other tokens."""
    if role[p] != "stmt":
        return None
    starts = copies.get(var[p], [])
    if not any(s >= end for s in starts):
        return "stmt_never"
    return "stmt_needed_seen" if any(s < end for s in starts) else "stmt_needed_unseen"


def retained(model, ids, prompt_len, policy, role, var, copies, counts) -> None:
    """Run ``policy`` on its own cache over the trace; after every eviction, count the statement tokens of each
    kind that some KV head of the layer holds, among those written so far (over all layers, and per layer)."""
    run = ChunkedPass(model, ids, prompt_len, policy)
    while run.advance():
        for obs in run.observations():
            end = int(obs.query_pos[0, -1]) + 1
            scores, state = policy.score(obs)
            keep = policy.select(obs, scores).keep
            run.apply(obs.layer, keep, state)
            kept = set(obs.key_pos[0].gather(1, keep[0]).flatten().tolist())  # in any KV head of the layer
            for p in range(1, min(end, prompt_len)):
                kind = statement_kind(p, end, role, var, copies)
                if kind:
                    for key in (kind, f"layer{obs.layer}/{kind}"):
                        counts[key][0] += p in kept
                        counts[key][1] += 1


def tally(pos, cand, end, role, var, copies, keeps, scores, cumsum, kept, recall, aucs) -> None:
    """Add one (step, layer) of every KV head to the running counts."""
    H, N = pos.shape
    kept_mask = {}
    for who, keep in keeps.items():
        m = torch.zeros(H, N, dtype=torch.bool)
        m.scatter_(1, keep, True)
        kept_mask[who] = m & cand
    for h in range(H):
        groups = defaultdict(list)  # role -> slots
        for n in torch.nonzero(cand[h]).flatten().tolist():
            p = int(pos[h, n])
            r = role[p]
            groups[statement_kind(p, end, role, var, copies) or r].append(n)
        for r, slots in groups.items():
            idx = torch.tensor(slots)
            for who, m in kept_mask.items():
                kept[(who, r)][0] += int(m[h, idx].sum())
                kept[(who, r)][1] += len(slots)
        g = cand[h] & ~kept_mask["golden"][h]  # what the oracle evicts
        for stage in (s for s in scores if s != "golden"):
            recall[stage][0] += int((g & ~kept_mask[stage][h]).sum())
            recall[stage][1] += int(g.sum())
        for name, values in (("cumulative_attention", cumsum[h]), *((s, scores[s][h]) for s in scores)):
            got = auc(values[kept_mask["golden"][h]], values[g])
            if got:
                aucs[f"{name}/golden_kept_vs_evicted"][0] += got[0]
                aucs[f"{name}/golden_kept_vs_evicted"][1] += got[1]
        never = torch.tensor(groups.get("stmt_never", []), dtype=torch.long)
        for subset in ("all", "unseen"):
            names = ("stmt_needed_unseen",) if subset == "unseen" else ("stmt_needed_seen", "stmt_needed_unseen")
            needed = torch.tensor([n for r in names for n in groups.get(r, [])], dtype=torch.long)
            for name, values in (("cumulative_attention", cumsum[h]), *((s, scores[s][h]) for s in scores)):
                got = auc(values[needed], values[never])
                if got:
                    aucs[f"{name}/{subset}"][0] += got[0]
                    aucs[f"{name}/{subset}"][1] += got[1]


if __name__ == "__main__":
    main()
