"""Local solvers beyond plain SGD: FedProx's proximal SGD and the STORM variance-reduced solver.

Solvers are torch optimizers built fresh for each client and round, right after the client's model was
set to the global one; ``step`` is always given a closure that recomputes the mini-batch loss.
"""

import numpy as np
import torch

from fedrun.errors import check


def eager_optimizer_methods() -> list[str]:
    """Let ``torch.optim.Optimizer``'s four compiler-guarded methods (``add_param_group``, ``zero_grad``,
    ``state_dict``, ``load_state_dict``) run without importing ``torch._dynamo``, which their wrapper does on the
    first call of each (``torch._compile._disable_dynamo``) only to build a "compiler disabled" version of the method
    and cache it on the method as ``__dynamo_disable``: 1.5 s of every fedrun process's start on an idle 2-core
    machine (2.5-4.6 s loaded), the largest single import after torch itself, for a compiler fedrun never runs.
    Here that cache is filled with the method itself, which is what the disabled version calls outside
    ``torch.compile``; under ``torch.compile`` (which fedrun never calls) the compiler would trace into these
    methods instead of around them. Where a torch release renames or drops the cache or the wrapper, nothing is filled
    and torch imports its compiler as before (slower, never different). Returns the methods filled;
    ``tests/unit/test_optimizers.py`` checks that a run's solvers leave ``torch._dynamo`` unimported. The upstream
    issue: pytorch#162595 ("Don't unconditionally import torch._dynamo, it's slow") removed the import from
    ``import torch`` but not from these wrappers."""
    disable = getattr(torch, "_disable_dynamo", None)
    wrapper = getattr(disable(lambda: None), "__code__", None) if callable(disable) else None
    if wrapper is None:  # a torch without that wrapper: nothing to fill
        return []
    filled = []
    for name, method in vars(torch.optim.Optimizer).items():
        inner = getattr(method, "__wrapped__", None)
        if inner is not None and getattr(method, "__code__", None) is wrapper:
            if getattr(inner, "__dynamo_disable", None) is None:
                setattr(inner, "__dynamo_disable", inner)
            filled.append(name)
    return filled


eager_optimizer_methods()


def base_lr(make_optimizer, default: float | None = None) -> float:
    """The learning rate a local optimizer factory (``functools.partial(SGD, lr=...)``, as Hydra builds the
    ``optimizer`` group) was given: the base rate that ``Schedule.lr`` decays. The one place that reads it."""
    keywords = getattr(make_optimizer, "keywords", {})
    if "lr" not in keywords and default is not None:
        return default
    return keywords["lr"]


def coefficient_norm(
    steps: int, lr: float, momentum: float = 0.0, mu: float = 0.0, dampening: float = 0.0, nesterov: bool = False
) -> float:
    """||a||_1 of FedNova (Wang et al. 2020): the update of ``steps`` local steps is -lr * sum_j a_j g_j.

    Found by running the solver's linear recursion (torch's SGD: heavy-ball momentum with its dampening, which its
    first step skips, or Nesterov's; the proximal pull towards the start) on unit gradients: plain SGD gives
    ``steps``, momentum rho gives (steps - rho(1 - rho^steps)/(1 - rho)) / (1 - rho), the proximal term gives
    (1 - (1 - lr mu)^steps) / (lr mu).
    """
    if steps == 0:
        return 0.0
    if momentum == 0 and mu == 0:
        return float(steps)
    # Column j: the displacement (in units of lr) caused by a unit gradient at step j, so no division by lr.
    moved, buffer = np.zeros(steps), np.zeros(steps)
    for k in range(steps):
        pull = lr * mu * moved  # the proximal term's gradient, in units of lr
        kept = 1.0 if k == 0 or momentum == 0 else 1.0 - dampening  # torch's first step takes the gradient whole
        buffer = momentum * buffer + kept * pull
        buffer[k] += kept
        if nesterov:  # the step is g + rho * buffer
            direction = pull + momentum * buffer
            direction[k] += 1.0
        else:
            direction = buffer
        moved = moved - direction
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
    """The STORM local solver of paper 002 (Cutkosky & Orabona 2019; paper 002 eq. 3 and Algorithm 1):
    d_k = g(w_k; B_k) + (1 - beta)(d_{k-1} - g(w_{k-1}; B_k)), w_{k+1} = w_k - eta_t d_k,
    both gradients on the same mini-batch B_k (the closure is called again at w_{k-1}).

    d_0 is the first mini-batch's gradient (``init: minibatch``) or the gradient over all of the client's
    samples at the round's starting model (``init: full``, paper 002 line 159: "the full gradient is
    considered in the computation of the initial gradient"; Algorithm 1 line 6). With ``full`` that
    gradient takes the place of the first mini-batch's, so the step count does not change. Paper 002 runs
    beta = 0 (line 159: "similar to 3 where beta = 0"), the pure recursive correction.

    The step eta_t belongs to the round, not to the client (Algorithm 1 line 13 updates omega and
    omega-hat with the same eta_t): ``lr`` when ``adaptive`` is false, else Theorem A.1's schedule
    (paper 002 line 259) eta_t = k0 / (w0 + sigma2 * t)^(1/3), with t the round the server announces
    (``start_round``). It is constant during a round, decreases across rounds, and needs no client
    state between rounds. (Algorithm 1 line 10 writes the gradient in place of sigma^2 t; its garbled
    text does not say over which steps it accumulates, Theorem A.1 does.) Theorem A.1's w is
    max{(4LkE)^3 - sigma^2 t, 2 sigma^2, (ck/16LE)^3}, which needs the smoothness L that no experiment knows;
    fedrun takes w as the constant ``w0``, to be tuned with ``k0`` and ``sigma2`` (the theorem asks w >= 2 sigma2).

    Args:
        params: Model parameters.
        lr: The fixed step when ``adaptive`` is false.
        beta: Momentum weight in [0, 1]; 1 is plain SGD, 0 the paper's pure recursion.
        init: ``minibatch`` or ``full`` (see above).
        adaptive: Use Theorem A.1's eta_t instead of ``lr``.
        k0, w0, sigma2: k, w and sigma^2 of eta_t = k0 / (w0 + sigma2 * t)^(1/3).
        weight_decay: L2 term added to every gradient.
    """

    def __init__(
        self,
        params,
        lr: float = 0.05,
        beta: float = 0.2,
        init: str = "minibatch",
        adaptive: bool = False,
        k0: float = 0.1,
        w0: float = 0.1,
        sigma2: float = 1.0,
        weight_decay: float = 0.0,
    ):
        check(lr > 0, "lr", lr, "a number > 0")
        check(0 <= beta <= 1, "beta", beta, "a number in [0, 1]")
        check(init in ("minibatch", "full"), "init", init, "minibatch or full")
        check(k0 > 0, "k0", k0, "a number > 0")
        check(w0 > 0, "w0", w0, "a number > 0")
        check(sigma2 >= 0, "sigma2", sigma2, "a number >= 0")
        check(weight_decay >= 0, "weight_decay", weight_decay, "a number >= 0")
        super().__init__(params, dict(lr=lr, beta=beta, weight_decay=weight_decay))
        self.init, self.adaptive, self.k0, self.w0, self.sigma2 = init, adaptive, k0, w0, sigma2
        self.eta = lr
        self.etas: list[float] = []  # the step of every update taken, for tests and diagnostics
        self._full_closure, self._round = None, None

    @staticmethod
    def step_size(round_: int, k0: float, w0: float, sigma2: float) -> float:
        """Theorem A.1's eta_t = k0 / (w0 + sigma2 * t)^(1/3)."""
        return k0 / (w0 + sigma2 * round_) ** (1 / 3)

    def start_round(self, round_: int, full_closure) -> None:
        """Called before the client's first step: the round t the server announced, and a closure giving
        the loss over all of the client's samples (for ``init: full``)."""
        self.eta = (
            self.step_size(round_, self.k0, self.w0, self.sigma2) if self.adaptive else self.param_groups[0]["lr"]
        )
        self._full_closure, self._round = full_closure, round_

    def coefficient_norm(self, steps: int) -> float:
        """FedNova's ||a||_1 in units of the base rate lr (the update is -lr sum_j a_j g_j): each STORM step counts as
        one plain step of eta, so eta / lr of one (1 without ``adaptive``, where eta is lr). FedNova's normaliser and
        SCAFFOLD's option II read it."""
        lr = self.param_groups[0]["lr"]
        eta = getattr(self, "eta", lr)
        return float(steps) if eta == lr else float(steps) * eta / lr

    def _gradients(self, closure, params, weight_decay):
        with torch.enable_grad():
            loss = closure()
        return loss, [p.grad.detach().clone() + weight_decay * p.detach() for p in params]

    @torch.no_grad()
    def step(self, closure):
        group = self.param_groups[0]
        params = group["params"]
        first = "direction" not in self.state[params[0]]
        check(
            not self.adaptive or self._round is not None,
            "adaptive",
            self.adaptive,
            "false when the trainer announces no round (start_round)",
        )
        if first and self.init == "full":
            check(
                self._full_closure is not None,
                "init",
                self.init,
                "minibatch when the trainer gives no full-data closure",
            )
            with torch.enable_grad():
                loss = closure()  # the mini-batch's loss, for the running local loss; its gradient is not used
            _, directions = self._gradients(self._full_closure, params, group["weight_decay"])
        else:
            loss, grads = self._gradients(closure, params, group["weight_decay"])
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
                directions = [
                    g + keep * (self.state[p]["direction"] - gp) for p, g, gp in zip(params, grads, previous_grads)
                ]
        for p, d in zip(params, directions):
            self.state[p]["direction"] = d
            self.state[p]["previous"] = p.detach().clone()
            p.sub_(self.eta * d)
        self.etas.append(self.eta)
        return loss
