"""The Ray that kvrl starts for itself: workers at the driver's priority, no dashboard.

Ray starts its worker processes at nice +15 unless told otherwise; beside other work at nice 0
the actors then get a sliver of the CPU.
"""

import os

import ray

from kvrl.config import load_config
from kvrl.workers import controller


@ray.remote(num_cpus=0)
def worker_nice() -> int:
    return os.nice(0)


def test_local_ray_runs_its_workers_at_the_driver_priority_without_a_dashboard():
    if ray.is_initialized():  # connect() would reuse it, and so would test another Ray than kvrl's
        ray.shutdown()
    cfg = load_config(["recipe=tiny_rl_full", "workers.num_cpus=1"])
    assert controller.connect(cfg)  # kvrl started it, the way every job does
    try:
        assert ray.get(worker_nice.remote(), timeout=120) == os.nice(0)
        node = ray._private.worker._global_node
        assert node.webui_url == ""  # no dashboard URL handed out ...
        for proc in node.all_processes.get("dashboard", []):  # ... and Ray's API process serves no UI
            assert "--disable-frontend" in proc.process.args
    finally:
        ray.shutdown()


def test_a_joined_cluster_gets_the_niceness_through_the_job_runtime_env(monkeypatch):
    """A cluster kvrl joins was started by someone else: its system config is fixed, so the
    niceness travels in the job's env_vars, which each worker reads at start."""
    seen = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw))
    controller.connect(load_config(["recipe=tiny_rl_full", "workers.address=auto", "workers.niceness=5"]))
    assert seen["address"] == "auto" and seen["runtime_env"] == {"env_vars": {"RAY_worker_niceness": "5"}}


def test_niceness_never_stops_a_resume():
    """A priority changes no result: a checkpoint saved before the knob existed, or with
    another niceness, resumes."""
    from kvrl.config import Config
    from kvrl.runlog import config_changes, flatten

    now = flatten(load_config(["recipe=tiny_rl_full"]))
    before_the_knob = {k: v for k, v in now.items() if k != "workers.niceness"}
    assert now["workers.niceness"] == 0
    assert config_changes(before_the_knob, now, Config.RESUMABLE) == []
    assert config_changes({**now, "workers.niceness": 15}, now, Config.RESUMABLE) == []
