"""Progress lines of a long scoring step, and how many scorer actors `audit.actors=auto` starts."""

from __future__ import annotations

import pytest

from clarifier.runtime.progress import ProgressLines


def test_progress_lines_count_rate_and_time_left_from_the_first_count_seen():
    lines = ProgressLines("[label]", 1348)
    assert lines.tick(0, now=10.0) is None  # nothing scored yet (the actors are loading the model): no line
    assert lines.tick(40, now=40.0) == "[label] scored 40 of 1,348 turns (3%)"
    # the rate is from the first count seen: (640 - 40) turns in 300 s = 2.0/s; 708 left = about 6 min
    assert lines.tick(640, now=340.0) == "[label] scored 640 of 1,348 turns (47%), 2.0 turns/s, about 6 min left"
    assert lines.tick(640, now=370.0) is None  # a pool that did not move prints nothing new
    assert lines.tick(1300, now=370.0 + 300) == "[label] scored 1,300 of 1,348 turns (96%), 2.0 turns/s, about 24 s left"
    assert lines.tick(1348, now=700.0) == "[label] scored 1,348 of 1,348 turns (100%), 2.0 turns/s"
    assert lines.tick(1400, now=710.0) is None  # never past the total


class _Ray:
    def __init__(self, cpus, gpus=0):
        self.res = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}

    def cluster_resources(self):
        return self.res


@pytest.mark.parametrize("actors,cpus,gpus,per_cpu,per_gpu,rows,want", [
    (3, 64, 0, 1, 0, 10, 3),          # a number is taken as it is
    ("auto", 16, 0, 1, 0, 10_000, 16),  # as many as the cluster's CPUs hold ...
    ("auto", 16, 0, 4, 0, 10_000, 4),   # ... at cpus_per_actor each
    ("auto", 16, 0, 1, 0, 40, 2),       # no more than blocks of 4 x batch_size (8) turns: 40 turns -> 2
    ("auto", 16, 0, 1, 0, 5, 1),
    ("auto", 16, 2, 1, 0.5, 10_000, 4),  # GPU actors: the GPUs decide
    ("auto", 1, 0, 2, 0, 10_000, 1),     # never fewer than one
])
def test_pool_size_auto(monkeypatch, actors, cpus, gpus, per_cpu, per_gpu, rows, want):
    from clarifier.runtime import cluster

    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")  # a cluster: its CPUs, not this machine's cores
    assert cluster.pool_size(_Ray(cpus, gpus), actors, cpus_per_actor=per_cpu, gpus_per_actor=per_gpu, rows=rows,
                             rows_per_block=32) == want


def test_pool_size_auto_on_a_local_ray_counts_cores_not_its_logical_cpus(monkeypatch):
    from clarifier.runtime import cluster

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(cluster.os, "cpu_count", lambda: 2)  # a local Ray has cores + 2 logical CPUs
    assert cluster.pool_size(_Ray(4), "auto", cpus_per_actor=1, rows=10_000, rows_per_block=32) == 2


def test_audit_actors_config_takes_auto_or_a_positive_number():
    from clarifier.core.config import ConfigError, load_config

    assert load_config(None, []).audit.actors == "auto"
    assert load_config(None, ["audit.actors=3"]).audit.actors == 3
    for bad in ("audit.actors=0", "audit.actors=many"):
        with pytest.raises(ConfigError, match="audit.actors"):
            load_config(None, [bad])
