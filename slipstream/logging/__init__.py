"""Metric sinks: metrics.jsonl (always), rich console, TensorBoard and wandb (when available)."""

from slipstream.logging.backends import TensorBoardSink, WandbSink, make_tensorboard_sink, make_wandb_sink
from slipstream.logging.console import ConsoleSink
from slipstream.logging.jsonl import JsonlSink, read_metrics
from slipstream.logging.metrics_logger import MetricsLogger, Sink, build_sinks, make_metrics_logger

__all__ = [
    "ConsoleSink",
    "JsonlSink",
    "MetricsLogger",
    "Sink",
    "TensorBoardSink",
    "WandbSink",
    "build_sinks",
    "make_metrics_logger",
    "make_tensorboard_sink",
    "make_wandb_sink",
    "read_metrics",
]
