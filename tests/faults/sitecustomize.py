"""Test-only fault injection for live `tandem serve` processes, loaded from outside: a test
puts this folder on the child's PYTHONPATH and sets TANDEM_TEST_FAULT_SEED (Ray's worker
processes inherit both). Then the sampler fails every draw of a request seeded with that
value: a fault inside the engine, in one request's own sampling, that no validation can
see. Nothing else changes; production never loads this file."""

import importlib.abc
import importlib.machinery
import os
import sys

_SEED = os.environ.get("TANDEM_TEST_FAULT_SEED")


class _PatchSampler(importlib.abc.MetaPathFinder):
    """Wraps engine.sampler.position_seed as the module is first imported."""

    def find_spec(self, name, path=None, target=None):
        if name != "engine.sampler":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            real = module.position_seed

            def position_seed(seed: int, position: int) -> int:
                if seed == int(_SEED):
                    raise RuntimeError(f"fault injected by the test for seed {seed}")
                return real(seed, position)

            module.position_seed = position_seed

        spec.loader.exec_module = exec_and_patch
        return spec


if _SEED:
    sys.meta_path.insert(0, _PatchSampler())
