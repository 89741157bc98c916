"""Local SGD that waits a fixed wall time before each client trains: the numbers of ``client=sgd`` (a sleep changes
none), and a run as long on every machine and nearly idle. The submitit time-limit test paces its run with it, so
that the job outlasts its first leg in a few rounds on a fast CPU and a slow one alike, and the CPU it does not use
goes to the tier's other tests (its 150 unpaced rounds took 228 s of a worker on the slower CI machine)."""

import time

from fedrun.programs import LocalSGD


class Paced(LocalSGD):
    name = "paced"

    def __init__(self, seconds: float = 1.0, memory_mb: float = 1024.0):
        super().__init__(memory_mb)
        self.seconds = seconds

    def start(self, client, start, own, shared):
        time.sleep(self.seconds)
        return super().start(client, start, own, shared)
