"""Buffered asynchronous aggregators (paper 004): the server aggregates a buffer of b updates at a time.

Each buffered update j carries Delta_j = w_local - w_pulled and its staleness tau_j = (server version
at aggregation) - (version the client pulled). The aggregate update is sum_j alpha_j Delta_j, which the
server optimizer applies (``server=sgd``: w <- w + server_lr * update).
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass

import numpy as np

from fedrun.aggregators.base import Aggregation
from fedrun.aggregators.robust import RobustAggregator
from fedrun.cohort import RoundView
from fedrun.errors import ConfigError, check
from fedrun.lazy import torch
from fedrun.state import Stateful


@dataclass
class BufferReport:
    """What the server knows about a full buffer.

    Attributes:
        clients: The client of each buffered update, in arrival order (a client may appear twice).
        sizes: Each update's client sample count.
        staleness: tau_j of each update.
        version: The server version being aggregated into (0-based count of earlier aggregations).
        pulled: The global model each update started from (flat), for aggregators that mix models.
    """

    clients: np.ndarray
    sizes: np.ndarray
    staleness: np.ndarray
    version: int
    pulled: list[torch.Tensor]

    def subset(self, keep: np.ndarray) -> BufferReport:
        """The report of the buffered updates ``keep`` selects (a bool mask), in arrival order."""
        keep = np.asarray(keep, dtype=bool)
        pulled = [p for p, kept in zip(self.pulled, keep) if kept]
        return BufferReport(
            self.clients[keep], np.asarray(self.sizes)[keep], self.staleness[keep], self.version, pulled
        )


class AsyncAggregator(Stateful):
    """Base of the buffered asynchronous aggregators; they run on the asynchronous engine.

    Args:
        buffer_size: b, updates per aggregation.
    """

    STATE = ()  # FedStaleWeight's staleness windows are the only state of the family

    # Capabilities (fedrun.compat): buffered, so only the asynchronous engine runs it.
    asynchronous = True
    follows_sampler = False
    weights_follow_clients = False
    reads_second_update = False
    measures_losses = False
    alpha_informative = False  # as ``Aggregator.alpha_informative``: whether alpha follows the clients' staleness
    alpha_is_share = True  # as ``Aggregator.alpha_is_share``

    def reference(self, keep: np.ndarray) -> AsyncAggregator:
        """As ``Aggregator.reference``: a copy in its state now, for the buffer's updates ``keep`` selects alone."""
        return copy.deepcopy(self)

    def __init__(self, buffer_size: int = 5):
        check(isinstance(buffer_size, int) and buffer_size >= 1, "buffer_size", buffer_size, "an integer >= 1")
        self.buffer_size = buffer_size

    def observe(self, client: int, staleness: int) -> None:
        """Called at every arrival, before the update enters the buffer (for staleness statistics)."""

    def weights(self, buffer: BufferReport) -> np.ndarray:
        raise NotImplementedError

    def run_tags(self) -> dict[str, str]:
        """Run-level facts, logged as tags when the run closes (none for the buffered aggregators so far)."""
        return {}

    def aggregate(self, global_params: torch.Tensor, deltas: torch.Tensor, buffer: BufferReport) -> Aggregation:
        """The update sum_j alpha_j Delta_j, alpha over the buffer, and no diagnostics."""
        alpha = self.weights(buffer)
        return Aggregation(torch.as_tensor(alpha, dtype=deltas.dtype, device=deltas.device) @ deltas, alpha, {})


class FedBuff(AsyncAggregator):
    """FedBuff (Nguyen et al. 2022, Algorithm 1): the server accumulates s(tau_k) Delta_k over the buffer
    and divides by its size K, so alpha_k = s(tau_k) / K with s = 1 (default) or s(tau) = 1 / sqrt(1 + tau)
    with ``staleness_scaling``. The weights are not renormalised: a buffer of stale updates moves the model
    less, as in the paper and its reference implementation (a sum of weighted updates divided by K).

    Args:
        staleness_scaling: Down-weight stale updates by s(tau) = 1/sqrt(1 + tau).
        buffer_size: See ``AsyncAggregator``.
    """

    def __init__(self, buffer_size: int = 5, staleness_scaling: bool = False):
        super().__init__(buffer_size)
        self.staleness_scaling = staleness_scaling
        self.alpha_informative = bool(staleness_scaling)

    def weights(self, buffer):
        s = 1.0 / np.sqrt(1.0 + buffer.staleness) if self.staleness_scaling else np.ones(len(buffer.staleness))
        return s / len(s)


class FedStaleWeight(AsyncAggregator):
    """FedStaleWeight (paper 004): alpha_j proportional to E[tau_j] * b + 1 (eq. 8), normalised over the buffer.

    E[tau_j] is a moving average of client j's staleness (paper 004 line 172: "we maintain a moving average
    of previous staleness for that agent"; the paper gives no window). fedrun keeps the client's last
    ``window`` values (5 by default, as the authors' afl-bench code does; the oldest value drops out) and,
    with ``include_current`` (default, as in that code, which records the buffer's staleness before
    weighing it), counts the updates of the buffer being aggregated; ``include_current: false`` averages only
    values from earlier buffers. (The authors' tracker pops the newest value when the window is full, which
    freezes its first four values; fedrun drops the oldest, as a moving average does.)
    The +1 keeps a buffer of fresh (tau = 0) updates at uniform weights; the paper's public code weighted
    by the window mean alone, which zeroed such a buffer and stopped the model.

    Args:
        form: ``eq8`` (E[tau] * b + 1) or ``algorithm`` (E[tau] + 1, as the paper's algorithm box writes it).
        window: How many recent staleness values per client the moving average keeps (the oldest drops out).
        include_current: Whether the updates in the buffer being aggregated count in E[tau].
        buffer_size: See ``AsyncAggregator``.
    """

    STATE = ("history", "fresh")

    def __init__(self, buffer_size: int = 5, form: str = "eq8", window: int = 5, include_current: bool = True):
        super().__init__(buffer_size)
        self.alpha_informative = True
        check(form in ("eq8", "algorithm"), "form", form, "eq8 or algorithm")
        check(isinstance(window, int) and window >= 1, "window", window, "an integer >= 1")
        self.form, self.window, self.include_current = form, window, include_current
        self.history: dict[int, deque] = {}
        self.fresh: dict[int, int] = {}  # values each client added since the last aggregation

    def observe(self, client, staleness):
        # Room for a whole buffer beyond the window, so excluding the current buffer still leaves ``window`` values.
        self.history.setdefault(int(client), deque(maxlen=self.window + self.buffer_size)).append(int(staleness))
        self.fresh[int(client)] = self.fresh.get(int(client), 0) + 1

    def expected_staleness(self, client: int) -> float:
        values = list(self.history.get(int(client), ()))
        if not self.include_current:
            values = values[: max(0, len(values) - self.fresh.get(int(client), 0))]
        values = values[-self.window :]
        return float(np.mean(values)) if values else 0.0

    def weights(self, buffer):
        expected = np.array([self.expected_staleness(c) for c in buffer.clients])
        self.fresh = {}
        raw = expected * (self.buffer_size if self.form == "eq8" else 1) + 1.0
        return raw / raw.sum()


class FedAsync(AsyncAggregator):
    """FedAsync (Xie et al. 2019): every update is applied alone (b = 1) by mixing models,
    w <- (1 - a) w + a w_local, with w_local = w_pulled + Delta and a = mixing * s(tau). The update it
    returns is a (w_local - w), so ``server=sgd`` with server_lr 1 applies exactly this mix.

    Args:
        mixing: alpha_0 in (0, 1].
        staleness_function: ``constant`` (s = 1), ``polynomial`` (s = (1 + tau)^-exponent) or
            ``hinge`` (s = 1 for tau <= hinge_b, else 1 / (hinge_a (tau - hinge_b) + 1)).
        exponent, hinge_a, hinge_b: Parameters of s.
    """

    def __init__(
        self,
        mixing: float = 0.6,
        staleness_function: str = "polynomial",
        exponent: float = 0.5,
        hinge_a: float = 10.0,
        hinge_b: int = 4,
    ):
        super().__init__(buffer_size=1)
        check(0 < mixing <= 1, "mixing", mixing, "a number in (0, 1]")
        check(
            staleness_function in ("constant", "polynomial", "hinge"),
            "staleness_function",
            staleness_function,
            "constant, polynomial or hinge",
        )
        check(exponent >= 0, "exponent", exponent, "a number >= 0")
        self.mixing, self.staleness_function = mixing, staleness_function
        self.exponent, self.hinge_a, self.hinge_b = exponent, hinge_a, hinge_b

    def s(self, tau: float) -> float:
        if self.staleness_function == "constant":
            return 1.0
        if self.staleness_function == "polynomial":
            return (1.0 + tau) ** -self.exponent
        return 1.0 if tau <= self.hinge_b else 1.0 / (self.hinge_a * (tau - self.hinge_b) + 1.0)

    def weights(self, buffer):
        return np.ones(1)

    def aggregate(self, global_params, deltas, buffer):
        a = self.mixing * self.s(float(buffer.staleness[0]))
        local = buffer.pulled[0] + deltas[0]
        return Aggregation(a * (local - global_params), np.ones(1), {"mixing_weight": a})


class BufferedRobust(AsyncAggregator):
    """A synchronous robust rule (``rule``: median, trimmed mean, Krum, geometric median, centered clipping, ...)
    over each full buffer of b asynchronous updates, as it would aggregate a round of b clients: what it discards
    and its alpha are the buffer's. Staleness is not weighed (the rule sees the b updates as they arrived); the rule's
    f counts attackers among the b. Its breakdown point is checked against b before the first event.

    Args:
        rule: The robust rule (a ``fedrun.aggregators.robust.RobustAggregator``).
        buffer_size: See ``AsyncAggregator``.
    """

    weights_follow_clients = True  # as the robust rules: privacy refuses it
    alpha_informative = True

    def __init__(self, rule, buffer_size: int = 10):
        super().__init__(buffer_size)
        check(isinstance(rule, RobustAggregator), "rule", type(rule).__name__, "a robust rule (median, krum, ...)")
        self.rule = rule

    @property
    def alpha_is_share(self) -> bool:
        return self.rule.alpha_is_share

    def state_dict(self) -> dict:
        return {"rule": self.rule.state_dict()}  # centered clipping's last aggregate

    def load_state_dict(self, state: dict) -> None:
        self.rule.load_state_dict(state.get("rule", {}))

    def bind(self, context) -> None:
        RobustAggregator.bind(self.rule, context)  # its seed (bucketing's stream); its own bind checks a round's cohort
        b = self.buffer_size
        f = self.rule.byzantine(b)
        if not self.rule.tolerates(self.rule.rows(b), f):
            raise ConfigError(
                "aggregator.buffer_size", b, f"a buffer the rule tolerates with f={f} ({type(self.rule).__name__})"
            )

    def aggregate(self, global_params: torch.Tensor, deltas: torch.Tensor, buffer: BufferReport) -> Aggregation:
        view = RoundView(np.asarray(buffer.clients), np.asarray(buffer.sizes), round=buffer.version + 1)
        return self.rule.aggregate(global_params, deltas, view)
