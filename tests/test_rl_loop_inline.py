"""The RL loop with ``workers.address=inline``: the actors in this process, no Ray. A call runs
when it is made, what crosses is copied as on Ray, a worker's failed start frees the output
dir, rollout time is the shards' own, and what the actors print goes to their log.
"""

import os
import subprocess
import sys
import time

import pytest
import ray
import torch
from rl_loop_common import ROOT, DigitsEnv, assert_steps_cover_their_parts, config, digits, train

from kvrl.envs.base import Reward, TextEnv
from kvrl.workers.controller import Controller


class FailsAfterTheDriver(DigitsEnv):
    """Builds once (the controller's copy), raises after (a rollout worker's, inline)."""

    built = 0

    def __init__(self, **ignored):
        FailsAfterTheDriver.built += 1
        if FailsAfterTheDriver.built > 1:
            raise RuntimeError("this environment cannot start on a rollout actor")
        super().__init__()


def test_an_inline_worker_that_cannot_start_raises_its_error_and_frees_the_output_dir(random_model, tmp_path):
    from kvrl.runlog import OutputLock

    with pytest.raises(RuntimeError, match="cannot start on a rollout actor") as failed:
        Controller(config(tmp_path, random_model, f"env.id={__name__}:FailsAfterTheDriver", "workers.address=inline"))
    # the failed start let go of output_dir itself: its traceback (held here) keeps the controller alive
    assert failed.tb is not None
    OutputLock(tmp_path).release()


def test_inline_one_step_ahead_generates_before_the_update(random_model, tmp_path):
    """rl.async_steps=1 inline: a call runs when it is made, so step t+1's samples are generated
    before step t's update, with the old weights (a call deferred to its get() would generate
    after it: staleness 0 and ratios of 1)."""
    records, _ = train(config(tmp_path, random_model, "workers.address=inline", "rl.async_steps=1", "trainer.steps=3"))
    assert [r["staleness_max"] for r in records] == [0, 1, 1]
    assert max(r["ratio_max"] for r in records[1:]) > 1.0 + 1e-4
    assert_steps_cover_their_parts(records)


SLOW_S = 0.02


def slow_digits(task, completion):
    time.sleep(SLOW_S)
    return digits(task, completion)


class SlowEnv(DigitsEnv):
    """Scoring a sample waits SLOW_S: a rollout takes at least that long per sample."""

    def __init__(self, **ignored):
        TextEnv.__init__(self, rewards=[Reward(slow_digits, 1.0, "digits")])


def test_inline_rollout_time_is_the_time_the_shards_took(random_model, tmp_path):
    """Inline, a shard runs when it is dispatched; rollout_s counts the shards' own seconds
    (not the instant between dispatch and collection), so gen_tokens_per_s is the rate the
    workers generated at. Each of the 16 samples a step scores waits SLOW_S: the rollout
    takes at least 16 · SLOW_S."""
    records, _ = train(
        config(tmp_path, random_model, "workers.address=inline", f"env.id={__name__}:SlowEnv", "trainer.steps=2")
    )
    for r in records:
        assert r["rollout_s"] >= 16 * SLOW_S, r
        assert r["gen_tokens_per_s"] == pytest.approx(r["gen_tokens"] / r["rollout_s"])
    assert_steps_cover_their_parts(records)


class Box:
    def __init__(self, held):
        self.held = held

    def keep(self, value):
        self.held = value
        return self.held

    @ray.method(num_returns=2)
    def pair(self):
        return self.held, self.held.sum()


def test_inline_actors_copy_what_crosses_as_ray_does():
    """What an inline actor is given or returns is a copy, as on Ray: an in-place update on either
    side (a learner's optimizer step, a controller's edit) never reaches the other. A result passed
    as an argument arrives as its value, and num_returns=2 gives two results."""
    from kvrl.workers.inline import Actor

    given = torch.zeros(3)
    box = Actor(ray.remote(Box), given)
    given += 1
    assert box.obj.held.sum() == 0
    kept = box.keep.remote(given)
    given += 1
    kept.value.mul_(10)
    assert box.obj.held.tolist() == [1.0, 1.0, 1.0]
    held, total = box.pair.remote()
    assert total.value == 3 and box.keep.remote(held).value.tolist() == [1.0, 1.0, 1.0]


NOISY = """
import logging, os, sys, warnings
import ray
from kvrl.workers.inline import Actor

class Noisy:
    # prints as vLLM and DeepSpeed do when they start and run: Python's print, a warning, a log
    # record (logging's last-resort handler) and a C-level write to file descriptor 2
    def __init__(self, word):
        self.word = word
        self.say("start")

    def say(self, when):
        print(f"{self.word} print {when}")
        warnings.warn(f"{self.word} warning {when}", FutureWarning, stacklevel=1)
        logging.getLogger("noisy").warning("%s log %s", self.word, when)
        os.write(2, f"{self.word} fd2 {when}\\n".encode())
        return when

warnings.simplefilter("always")
quiet = Actor(ray.remote(Noisy), "quiet", log=sys.argv[1])
assert quiet.say.remote("call").value == "call"
print("kvrl line")
loud = Actor(ray.remote(Noisy), "loud")
"""


def test_inline_actors_print_to_their_log_not_the_console(tmp_path):
    """Inline, what an actor prints at start and in its calls, by any route, goes to its log
    (the console is left to kvrl's own lines), as a Ray actor's goes to Ray's log files. In a
    child process: pytest's capture replaces the streams that the redirection works below."""
    log = tmp_path / "actors.log"
    res = subprocess.run(
        [sys.executable, "-c", NOISY, str(log)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "quiet" not in res.stdout + res.stderr and "kvrl line" in res.stdout
    assert "loud print start" in res.stdout and "loud fd2 start" in res.stderr, "without a log, the console"
    text = log.read_text()
    for route in ("print", "warning", "log", "fd2"):
        for when in ("start", "call"):
            assert f"quiet {route} {when}" in text, (route, when)
