"""The host library: stream tensors through an intml aggregator (SwitchML-style in-network aggregation)."""

from worker.api import AllreduceTimeout, JoinError, Worker

__all__ = ["AllreduceTimeout", "JoinError", "Worker"]
