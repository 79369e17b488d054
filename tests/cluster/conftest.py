"""A real Ray cluster (this machine) for the worker-pool tests, started once per session."""

from __future__ import annotations

import os

import pytest

# Ray's own control plane (which pickles) authenticated with a token, as DESIGN.md asks; Ray
# reads this when it is imported, so it is set before any test module imports it.
os.environ.setdefault("RAY_AUTH_MODE", "token")


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from cluster.actors import init_ray

    # Custom resources place the workers; CPUs are fractional so 2 cores host all of them.
    init_ray(num_cpus=2, resources={"prefill": 8, "decode": 8}, include_dashboard=False,
             object_store_memory=128 << 20, logging_level="warning", configure_logging=True)
    yield ray
    ray.shutdown()
