"""A client program of the tests' own (issue 50: a new local objective runs on every backend with no edit under
fedrun/): Gaussian noise on each gradient from a stream keyed by (client, round, step), and a per-client state (the
sum of its updates) kept from round to round and fed back into its steps."""

import torch

from fedrun.programs import LocalSGD


class NoisyGradient(LocalSGD):
    keeps, name = True, "noisy"

    def __init__(self, sigma: float = 0.01, memory_mb: float = 1024.0):
        super().__init__(memory_mb)
        self.sigma = sigma

    def initial(self, d: int) -> torch.Tensor:
        return torch.zeros(d)

    def corrected(self, local) -> None:
        key = (local.client.id * 1_000_003 + local.client.round) * 1_009 + len(local.losses)
        generator = torch.Generator().manual_seed(key)
        offset = 0
        for p in local.client.model.parameters():
            n = p.numel()
            noise = torch.randn(p.shape, generator=generator, dtype=p.dtype).to(p.device)
            p.grad.add_(noise, alpha=self.sigma).add_(local.own[offset : offset + n].view_as(p), alpha=0.01)
            offset += n

    def kept(self, local, delta, steps):
        return local.own + delta
