"""Aggregators: how the server combines a cohort's updates (weights alpha plus a server step)."""

from fedrun.aggregators.base import Aggregator, CohortReport
from fedrun.aggregators.loss_weighted import FedAvg, FedSoftMax

__all__ = ["Aggregator", "CohortReport", "FedAvg", "FedSoftMax"]
