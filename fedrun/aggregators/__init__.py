"""Aggregators: how the server combines a cohort's updates (weights alpha plus a server step)."""

from fedrun.aggregators.base import Aggregation, Aggregator
from fedrun.aggregators.buffered import (
    AsyncAggregator,
    BufferedRobust,
    BufferReport,
    FedAsync,
    FedBuff,
    FedStaleWeight,
)
from fedrun.aggregators.fair import AFL, QFFL, TERM
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
from fedrun.aggregators.normalised import MVR, FedNova
from fedrun.aggregators.robust import (
    Bulyan,
    ByzantineRobust,
    CenteredClip,
    FLTrust,
    GeoMed,
    Krum,
    Median,
    MultiKrum,
    NormBound,
    RobustAggregator,
    TrimmedMean,
)
from fedrun.cohort import RoundView

__all__ = [
    "TERM",
    "AFL",
    "QFFL",
    "Aggregation",
    "Aggregator",
    "AsyncAggregator",
    "BufferReport",
    "RoundView",
    "FedAsync",
    "FedBuff",
    "BufferedRobust",
    "FedStaleWeight",
    "FedAvg",
    "FedBetter",
    "FedBetterK",
    "FedMax",
    "FedMaxK",
    "FedNova",
    "FedSoftBetter",
    "FedSoftMax",
    "Hybrid",
    "LossWeighted",
    "MVR",
    "Bulyan",
    "ByzantineRobust",
    "CenteredClip",
    "FLTrust",
    "GeoMed",
    "Krum",
    "Median",
    "MultiKrum",
    "NormBound",
    "RobustAggregator",
    "TrimmedMean",
]
