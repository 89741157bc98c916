"""Server optimizers: the ``server`` group. Each turns the aggregated update Delta into a step on w.

Delta = sum_i alpha_i Delta_i is a pseudo-gradient pointing downhill (Reddi et al. 2020 use its negative).
State (momentum, second moments) persists across rounds. Momentum starts at zero; the adaptive
servers' second moment starts at tau^2 as Reddi et al. (2021) initialise it (``v0: paper``), or at zero.
"""

from __future__ import annotations

from fedrun.errors import check
from fedrun.lazy import torch
from fedrun.state import Stateful


class ServerOptimizer(Stateful):
    """``server=sgd``: w <- w + server_lr * Delta (FedAvg's step when server_lr = 1).

    Args:
        server_lr: Server learning rate, > 0.
    """

    STATE = ()

    def __init__(self, server_lr: float = 1.0):
        check(server_lr > 0, "server_lr", server_lr, "a number > 0")
        self.server_lr = server_lr

    def step(self, params: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """The new flat global model."""
        if self.server_lr == 1:  # the same bits (1.0 * delta is delta), without a temporary as large as the model
            return params + delta
        return params + self.server_lr * delta


class ServerMomentum(ServerOptimizer):
    """FedAvgM (Hsu et al. 2019): v <- beta v + Delta, w <- w + server_lr v.

    Args:
        beta: Momentum in [0, 1).
        server_lr: See ``ServerOptimizer``.
    """

    STATE = ("velocity",)

    def __init__(self, server_lr: float = 1.0, beta: float = 0.9):
        super().__init__(server_lr)
        check(0 <= beta < 1, "beta", beta, "a number in [0, 1)")
        self.beta, self.velocity = beta, None

    def step(self, params, delta):
        self.velocity = delta.clone() if self.velocity is None else self.beta * self.velocity + delta
        return params + self.server_lr * self.velocity


class ServerAdaptive(ServerOptimizer):
    """FedOpt (Reddi et al. 2021, Algorithm 2): m <- beta1 m + (1 - beta1) Delta, v per the variant,
    w <- w + server_lr * m / (sqrt(v) + tau), with tau = ``eps``. No bias correction; m starts at 0.

    Algorithm 2's initialisation is v_{-1} >= tau^2 (``v0: paper`` starts at exactly tau^2), which damps
    the first steps: with v = 0 Adam's and Yogi's first step is server_lr (1 - beta1) Delta / (sqrt(1 - beta2) |Delta| + tau)
    (Adagrad's: server_lr (1 - beta1) Delta / (|Delta| + tau)), nearly sign-like. ``v0: zero`` starts at 0 as popular implementations do (Flower's FedAdam, FedYogi
    and FedAdagrad), so a user can match their numbers.

    Args:
        server_lr: Server learning rate.
        beta1: First-moment decay in [0, 1).
        beta2: Second-moment decay in [0, 1) (Adam, Yogi).
        eps: The adaptivity tau of the paper, > 0.
        v0: ``paper`` (v starts at tau^2) or ``zero``.
    """

    STATE = ("m", "v")

    def __init__(
        self, server_lr: float = 0.01, beta1: float = 0.9, beta2: float = 0.99, eps: float = 1e-3, v0: str = "paper"
    ):
        super().__init__(server_lr)
        check(0 <= beta1 < 1, "beta1", beta1, "a number in [0, 1)")
        check(0 <= beta2 < 1, "beta2", beta2, "a number in [0, 1)")
        check(eps > 0, "eps", eps, "a number > 0")
        check(v0 in ("paper", "zero"), "v0", v0, "paper (tau^2, Reddi et al. Algorithm 2) or zero")
        self.beta1, self.beta2, self.eps, self.v0 = beta1, beta2, eps, v0
        self.m = self.v = None

    def second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def step(self, params, delta):
        if self.m is None:
            self.m = torch.zeros_like(delta)
            self.v = torch.full_like(delta, self.eps**2 if self.v0 == "paper" else 0.0)
        self.m = self.beta1 * self.m + (1 - self.beta1) * delta
        self.v = self.second_moment(self.v, delta * delta)
        return params + self.server_lr * self.m / (self.v.sqrt() + self.eps)


class ServerAdam(ServerAdaptive):
    """FedAdam: v <- beta2 v + (1 - beta2) Delta^2."""

    def second_moment(self, v, delta_sq):
        return self.beta2 * v + (1 - self.beta2) * delta_sq


class ServerYogi(ServerAdaptive):
    """FedYogi: v <- v - (1 - beta2) Delta^2 sign(v - Delta^2)."""

    def second_moment(self, v, delta_sq):
        return v - (1 - self.beta2) * delta_sq * torch.sign(v - delta_sq)


class ServerAdagrad(ServerAdaptive):
    """FedAdagrad: v <- v + Delta^2 (beta2 unused)."""

    def second_moment(self, v, delta_sq):
        return v + delta_sq
