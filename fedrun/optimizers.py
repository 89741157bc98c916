"""Local solvers beyond plain SGD: FedProx's proximal SGD and the STORM variance-reduced solver.

Solvers are torch optimizers built fresh for each client and round, right after the client's model was
set to the global one; ``step`` is always given a closure that recomputes the mini-batch loss.
"""

import numpy as np
import torch

from fedrun.errors import check


def coefficient_norm(steps: int, lr: float, momentum: float = 0.0, mu: float = 0.0) -> float:
    """||a||_1 of FedNova (Wang et al. 2020): the update of ``steps`` local steps is -lr * sum_j a_j g_j.

    Found by running the solver's linear recursion (heavy-ball momentum, proximal pull towards the start)
    on unit gradients: plain SGD gives ``steps``, momentum rho gives (steps - rho(1 - rho^steps)/(1 - rho))
    / (1 - rho), the proximal term gives (1 - (1 - lr mu)^steps) / (lr mu).
    """
    if steps == 0:
        return 0.0
    if momentum == 0 and mu == 0:
        return float(steps)
    # Column j: the displacement (in units of lr) caused by a unit gradient at step j, so no division by lr.
    moved, buffer = np.zeros(steps), np.zeros(steps)
    for k in range(steps):
        buffer = momentum * buffer + lr * mu * moved
        buffer[k] += 1.0
        moved = moved - buffer
    return float(-moved.sum())


class ProxSGD(torch.optim.SGD):
    """FedProx's local solver: SGD on F_i(w) + (mu / 2) ||w - w_global||^2.

    The anchor w_global is the parameters' value when the optimizer is built (the global model).

    Args:
        params: Model parameters.
        lr, momentum, weight_decay: As ``torch.optim.SGD``.
        mu: Proximal strength >= 0; 0 is plain SGD.
    """

    def __init__(self, params, lr: float = 0.05, mu: float = 0.01, momentum: float = 0.0, weight_decay: float = 0.0):
        check(mu >= 0, "mu", mu, "a number >= 0")
        super().__init__(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
        for group in self.param_groups:
            group["mu"] = mu
            for p in group["params"]:
                self.state[p]["anchor"] = p.detach().clone()

    @torch.no_grad()
    def step(self, closure=None):
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and group["mu"] != 0:
                    p.grad.add_(p - self.state[p]["anchor"], alpha=group["mu"])
        super().step()
        return loss


class STORM(torch.optim.Optimizer):
    """The STORM local solver of paper 002 (Cutkosky & Orabona 2019):
    d_k = g(w_k; B_k) + (1 - beta)(d_{k-1} - g(w_{k-1}; B_k)), w_{k+1} = w_k - eta_k d_k,
    both gradients on the same mini-batch B_k (the closure is called again at w_{k-1}); d_0 = g(w_0; B_0).

    Args:
        params: Model parameters.
        lr: The fixed step when ``adaptive`` is false.
        beta: Momentum weight in (0, 1]; 1 is plain SGD.
        adaptive: Use eta_k = k0 / (w0 + sum of squared gradient norms so far)^(1/3).
        k0, w0: Constants of the adaptive step.
        weight_decay: L2 term added to every gradient.
    """

    def __init__(self, params, lr: float = 0.05, beta: float = 0.2, adaptive: bool = False, k0: float = 0.1,
                 w0: float = 0.1, weight_decay: float = 0.0):
        check(lr > 0, "lr", lr, "a number > 0")
        check(0 < beta <= 1, "beta", beta, "a number in (0, 1]")
        check(k0 > 0, "k0", k0, "a number > 0")
        check(w0 > 0, "w0", w0, "a number > 0")
        check(weight_decay >= 0, "weight_decay", weight_decay, "a number >= 0")
        super().__init__(params, dict(lr=lr, beta=beta, adaptive=adaptive, k0=k0, w0=w0, weight_decay=weight_decay))
        self.grad_sq_sum = 0.0

    def coefficient_norm(self, steps: int) -> float:
        """FedNova's ||a||_1, counting each STORM step as one plain step."""
        return float(steps)

    def _gradients(self, closure, params, weight_decay):
        with torch.enable_grad():
            loss = closure()
        return loss, [p.grad.detach().clone() + weight_decay * p.detach() for p in params]

    @torch.no_grad()
    def step(self, closure):
        group = self.param_groups[0]
        params = group["params"]
        loss, grads = self._gradients(closure, params, group["weight_decay"])
        first = "direction" not in self.state[params[0]]
        if first or group["beta"] == 1:
            directions = grads
        else:
            current = [p.detach().clone() for p in params]
            for p in params:
                p.copy_(self.state[p]["previous"])
            _, previous_grads = self._gradients(closure, params, group["weight_decay"])  # g(w_{k-1}; B_k)
            for p, value in zip(params, current):
                p.copy_(value)
            keep = 1 - group["beta"]
            directions = [g + keep * (self.state[p]["direction"] - gp) for p, g, gp in zip(params, grads, previous_grads)]
        self.grad_sq_sum += float(sum(g.pow(2).sum() for g in grads))
        eta = group["k0"] / (group["w0"] + self.grad_sq_sum) ** (1 / 3) if group["adaptive"] else group["lr"]
        for p, d in zip(params, directions):
            self.state[p]["direction"] = d
            self.state[p]["previous"] = p.detach().clone()
            p.sub_(eta * d)
        return loss
