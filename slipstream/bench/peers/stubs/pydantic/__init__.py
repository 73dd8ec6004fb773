"""Import-only stand-in for `pydantic` (see ../slipstream_standin.py).

verl's rollout schemas import it, the bench never calls it.
"""

from slipstream_standin import install

__getattr__ = install(__name__, globals())
