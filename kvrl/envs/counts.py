"""Running counts: the tiny reasoner's task family (``kvrl/counts-v0``).

The prompt is N random digits, each followed by ``;``. The chain of thought copies each
digit and writes after it how many digits so far are >= 5 (mod 10), and answers with the
last count in ``\\boxed{}``::

    prompt:      3 ; 7 ; 1 ; 9 ; ... 4 ; ?
    completion:  3 0 7 1 1 1 9 2 ... 4 3 \\boxed{ 3 }

Prompt and chain of thought both spend two tokens per digit, so every copy reads the
prompt exactly 2N tokens back, and each count only needs the two tokens before it. The whole
prompt is needed, each digit until the step that copies it.
The chain of thought is about half the sequence; a sink+recent window shorter than N
cannot see the digits, while an oracle that keeps the not-yet-consumed digits fits in half
the sequence — and must retire digits *during decoding* to stay there.

Why this shape (measured, see ``kvrl/jobs/pretrain_tiny.py``): this 0.8 M model learns a
fixed-distance read in ~100 steps, while content-keyed recall among statements
(``kvrl/chains-v0``) stayed at chance for 1,400 steps; writing a running sum directly
(without the copy) stalled at chance, and even with the copy, the running sum mod 10
stalled for 450 steps (knowing one operand of an addition says nothing about the
result). A count has partial signal: below 5 the count is copied.
"""

from __future__ import annotations

import numpy as np

from kvrl.envs.base import Reward, Task, TextEnv, correct, exact_cot


def make_count_task(rng: np.random.Generator, n_digits: int = 24) -> dict:
    """One task: ``prompt``, ``completion``, ``answer`` and the ``digits``."""
    digits = rng.integers(0, 10, size=n_digits)
    counts = np.cumsum(digits >= 5) % 10
    answer = str(counts[-1])
    return {
        "prompt": " ".join(f"{d} ;" for d in digits) + " ?",
        "completion": " ".join(f"{d} {c}" for d, c in zip(digits, counts)) + f" \\boxed{{ {answer} }}",
        "answer": answer,
        "digits": digits.tolist(),
    }


# 2 tokens a digit in the prompt and again in the chain of thought: 65,536 digits are 262,144 tokens, past the
# context of the models this runs on; 1e11 digits asked numpy for 745 GiB before a token was generated
MAX_DIGITS = 65536


class CountsEnv(TextEnv):
    """Running counts over ``n_digits`` digits; tasks drawn from ``np_random``.

    overlong_penalty: the weight of a penalty on text past the reference completion's length
    (:func:`overlong`; 0 = a metric only), for runs where stopping is what is learned.
    """

    arg_bounds = {"n_digits": (1, MAX_DIGITS)}

    def __init__(self, n_digits: int = 24, overlong_penalty: float = 0.0):
        if n_digits < 1:
            raise ValueError(f"n_digits must be >= 1 (got {n_digits})")
        super().__init__(
            rewards=[
                Reward(correct, 1.0, "correct"),
                Reward(exact_cot, 0.0, "exact_cot"),
                Reward(overlong, -overlong_penalty, "overlong"),
            ]
        )
        self.n_digits = n_digits

    def sample_task(self, rng: np.random.Generator) -> Task:
        t = make_count_task(rng, self.n_digits)
        return Task(
            id=f"counts-{int(rng.integers(2**62)):x}",
            prompt=t["prompt"],
            answer=t["answer"],
            meta={"completion": t["completion"], "digits": t["digits"]},
        )


def overlong(task: Task, completion: str) -> float:
    """Words past the reference completion's length, as a fraction of it (0 when the
    completion stopped in time): what a model that does not stop after its answer pays."""
    words = len(task.meta["completion"].split())
    return max(0, len(completion.split()) - words) / words
