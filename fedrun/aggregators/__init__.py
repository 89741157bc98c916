"""Aggregators: how the server combines a cohort's updates (weights alpha plus a server step)."""

from fedrun.aggregators.base import Aggregator, CohortReport
from fedrun.aggregators.buffered import AsyncAggregator, BufferReport, FedAsync, FedBuff, FedStaleWeight
from fedrun.aggregators.normalised import MVR, FedNova
from fedrun.aggregators.loss_weighted import (
    FedAvg,
    FedBetter,
    FedBetterK,
    FedMax,
    FedMaxK,
    FedSoftBetter,
    FedSoftMax,
    Hybrid,
    LossWeighted,
)

__all__ = [
    "Aggregator", "AsyncAggregator", "BufferReport", "CohortReport", "FedAsync", "FedBuff", "FedStaleWeight", "FedAvg", "FedBetter", "FedBetterK", "FedMax", "FedMaxK",
    "FedNova", "FedSoftBetter", "FedSoftMax", "Hybrid", "LossWeighted", "MVR",
]
