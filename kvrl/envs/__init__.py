"""Environments: tasks and rewards for text rollouts, and eviction MDPs over fixed traces.

Public API::

    from kvrl.envs import Task, Reward, RewardError, Env, TextEnv, TraceEnv
    from kvrl.envs import register, make, registered, check_env, EnvCheckError

    env = make("kvrl/math-v0", path="aime24.jsonl")   # or make("my_pkg.envs:MyEnv")
    task, info = env.reset(seed=0)
    _, reward, terminated, truncated, info = env.step(completion)

Built-in ids (entry points are imported only by ``make``):

* ``kvrl/math-v0``   -> :class:`kvrl.envs.math.MathEnv` (JSONL/parquet math sets, math-verify reward)
* ``kvrl/counts-v0`` -> :class:`kvrl.envs.counts.CountsEnv` (running counts: the tiny reasoner's tasks)
* ``kvrl/multihop-v0`` -> :class:`kvrl.envs.multihop.MultiHopEnv` (multi-query chains: the
  multihop reasoner's tasks, with a long chain of thought that re-reads itself)
* ``kvrl/chains-v0`` -> :class:`kvrl.envs.chains.ChainsEnv` (single-query variable chains)
* ``kvrl/eviction-v0`` -> :class:`kvrl.envs.eviction.EvictionEnv` (ForesightKV's eviction MDP over stored traces)
"""

from kvrl.envs.base import Env, Reward, RewardError, Task, TextEnv, TraceEnv
from kvrl.envs.check import EnvCheckError, check_env
from kvrl.envs.registry import EnvNotFoundError, make, register, registered

register("kvrl/math-v0", "kvrl.envs.math:MathEnv")
register("kvrl/chains-v0", "kvrl.envs.chains:ChainsEnv")
register("kvrl/counts-v0", "kvrl.envs.counts:CountsEnv")
register("kvrl/multihop-v0", "kvrl.envs.multihop:MultiHopEnv")
register("kvrl/eviction-v0", "kvrl.envs.eviction:EvictionEnv")

__all__ = [
    "Env",
    "EnvCheckError",
    "EnvNotFoundError",
    "Reward",
    "RewardError",
    "Task",
    "TextEnv",
    "TraceEnv",
    "check_env",
    "make",
    "register",
    "registered",
]
