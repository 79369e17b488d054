"""Test-only fault injection for live `tandem serve` processes, loaded from outside: a test
puts this folder on the child's PYTHONPATH and sets the variables below (Ray's worker
processes inherit both). Nothing else changes; production never loads this file.

- TANDEM_TEST_FAULT_SEED=S: the sampler fails every draw of a request seeded with S, a fault
  inside the engine, in one request's own sampling, that no validation can see.
- TANDEM_TEST_ENGINE_DEATH=S:P: drawing position P or later of a request seeded with S kills
  the engine loop of the worker that draws it (an error no step catches), as a bug outside one
  request's own work would. With a short prompt and P past its end, only the decode worker
  draws there (the prefill worker draws the first token only)."""

import importlib.abc
import importlib.machinery
import os
import sys

_SEED = os.environ.get("TANDEM_TEST_FAULT_SEED")
_DEATH = os.environ.get("TANDEM_TEST_ENGINE_DEATH")


class EngineDeath(BaseException):
    """Not an Exception: the engine step's error handling lets it through, and the loop dies."""


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
            death_seed, death_position = (int(v) for v in _DEATH.split(":")) if _DEATH else (None, None)

            def position_seed(seed: int, position: int) -> int:
                if _SEED and seed == int(_SEED):
                    raise RuntimeError(f"fault injected by the test for seed {seed}")
                if seed == death_seed and position >= death_position:
                    raise EngineDeath(f"engine death injected by the test at position {position}")
                return real(seed, position)

            module.position_seed = position_seed

        spec.loader.exec_module = exec_and_patch
        return spec


if _SEED or _DEATH:
    sys.meta_path.insert(0, _PatchSampler())
