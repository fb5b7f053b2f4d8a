"""Integration fixtures: one local Ray per test module, started after the S3 and MLflow servers."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ray_local(request, s3_server, mlflow_server):
    """A local Ray instance of this module's own (``RAY_CPUS`` in the module, default 4 logical CPUs).

    It starts after the S3 and MLflow fixtures so that workers inherit their endpoints and
    credentials (``clarifier.runtime.init_ray`` forwards them), and always as a fresh instance
    (``address="local"``), never joining a ``ray start`` head that another test left running.
    """
    import ray

    from clarifier.runtime import init_ray

    if ray.is_initialized():
        ray.shutdown()
    init_ray(num_cpus=getattr(request.module, "RAY_CPUS", 4))
    yield ray
    ray.shutdown()
