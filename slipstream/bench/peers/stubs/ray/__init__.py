"""Import-only stand-in for `ray` (see ../slipstream_standin.py): verl imports it, the bench never calls it."""

from slipstream_standin import Placeholder, install

__getattr__ = install(__name__, globals())


def remote(*args, **kwargs):
    """`@ray.remote` / `@ray.remote(num_cpus=...)` run at import time: the decorated object becomes a placeholder."""
    if len(args) == 1 and not kwargs and callable(args[0]):
        return Placeholder(f"ray.remote({args[0].__qualname__})")
    return lambda obj: Placeholder(f"ray.remote({obj.__qualname__})")
