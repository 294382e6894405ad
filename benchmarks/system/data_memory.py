"""Peak memory of a driver that loads a large JSONL data set and draws 1,000 tasks.

Holding every row of a data file as a Task and tokenising all of them at once for the
prompt-length check made the RL driver of a 200 MB file grow to 4.2 GB. This generates a
``--mb`` MB GSM8K-like file in a temporary folder and, in a fresh interpreter per code path,
does what the driver does before and during a run: ``MathEnv(path)``, ``check_prompts``
over the whole data set with the tiny reasoner's tokenizer (as ``Controller.__init__``),
``reset(seed=0)`` and ``tasks(1000)``. It reports each path's peak RSS, its RSS after the
imports (the part the data does not cost), its CPU seconds, and the ratio of the data's
part before vs after (the CPU seconds are timed inside the child, by the child's own
clock: the old code has no :mod:`kvrl.bench`). ``--old`` is the code before lazy reading: a folder, or a git commit
of this repository, exported to a temporary folder (default: 787f1dc, the last commit
that held every row). Prints one JSON line.

    python benchmarks/system/data_memory.py [--mb 200] [--old 787f1dc | --old /path/to/checkout]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from kvrl.bench import emit

REPO = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, resource, sys, time

def rss_kib():  # current RSS
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

from transformers import AutoTokenizer
from kvrl.engines.base import check_prompts
from kvrl.envs.math import MathEnv
from kvrl.models.tiny import resolve_path

tok = AutoTokenizer.from_pretrained(resolve_path("tiny"))
base = rss_kib()
cpu = time.process_time()
env = MathEnv(sys.argv[1], template="{question}")
longest = check_prompts(env.data, tok, None)
env.reset(seed=0)
ids = [t.id for t in env.tasks(1000)]
print(json.dumps({"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "base_rss_mib": base / 1024,
                  "cpu_s": time.process_time() - cpu, "rows": env.num_tasks, "longest_prompt": longest,
                  "first_ids": ids[:3]}))
"""


def write_data(path: Path, mb: int) -> int:
    """GSM8K-like rows of ~1 KB until the file holds ``mb`` MB; returns the row count. In the tiny
    reasoner's words (single letters, digits, punctuation): a run refuses a task its tokenizer cannot read."""
    filler = " ".join(["a", "b", "\\boxed{", "3", "}", "Z"] * 48)
    rows, size = 0, 0
    with open(path, "w") as f:
        while size < mb * 1024**2:
            a, b = rows % 10, rows % 7
            line = (
                json.dumps(
                    {
                        "id": f"row-{rows}",
                        "question": f"{a} ; {b} = ? {filler}",
                        "answer": f"{a} ; {b}\n#### {(a + b) % 10}",
                    }
                )
                + "\n"
            )
            f.write(line)
            size, rows = size + len(line), rows + 1
    return rows


def measure(code: Path, data: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code), "PYTHONDONTWRITEBYTECODE": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, "-c", CHILD, str(data)], env=env, cwd=code, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{code}: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--old", default="787f1dc", help="the code before lazy reading: a folder or a git commit")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(args.old)
        if not old.is_dir():  # a commit: its tree, weights included, without touching this checkout
            old = Path(tmp) / "old"
            old.mkdir()
            archive = subprocess.run(["git", "-C", str(REPO), "archive", args.old], capture_output=True, check=True)
            subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
        data = Path(tmp) / "big.jsonl"
        rows = write_data(data, args.mb)
        before, after = measure(old, data), measure(REPO, data)
    assert before["first_ids"] == after["first_ids"], "the two code paths drew different tasks"
    part = {k: r["peak_rss_mib"] - r["base_rss_mib"] for k, r in (("before", before), ("after", after))}
    emit(
        {
            "file_mb": args.mb,
            "rows": rows,
            "before": before,
            "after": after,
            "data_rss_mib_before": round(part["before"], 1),
            "data_rss_mib_after": round(part["after"], 1),
            "peak_rss_ratio": round(before["peak_rss_mib"] / after["peak_rss_mib"], 2),
            "data_rss_ratio": round(part["before"] / max(part["after"], 1.0), 1),
        }
    )


if __name__ == "__main__":
    main()
