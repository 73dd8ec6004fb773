"""Typed configuration: `Config` and its sections, plus YAML / override loading."""

from slipstream.config.loader import dump_yaml, load_config
from slipstream.config.schema import Config

__all__ = ["Config", "dump_yaml", "load_config"]
