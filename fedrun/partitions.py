"""Partitions: pure functions of (labels, config, rng) that split a pool of training samples over clients.

Every partition first draws its pool (all training samples, or ``num_clients * samples_per_client`` of
them when capped), then returns one index array per client: disjoint, and together covering the pool
exactly once (McMahan's shards, ``shard_source: dataset``, deal only some of the dataset's shards). The one
exception is ``label_split`` with ``draw: independent`` (the authors' code of paper 000): every client draws
its own samples, which may overlap another client's.
"""

import os

import numpy as np

from fedrun.errors import ConfigError, check

# What a synchronous run keeps per client of a population at its peak, measured with tracemalloc over 10 million
# clients on two rounds (55 bytes with the uniform sampler, 64 with importance sampling): each client's selection
# count (int64), its float copy for the summary, the importance sampler's norms and probabilities.
BYTES_PER_CLIENT = 64
INT64_MAX = 2**63 - 1  # client ids are numpy int64: the most clients the draws can index


class Partition:
    """Base of the ``partition`` group.

    Args:
        num_clients: Number of clients.
        samples_per_client: Optional cap: the pool is ``num_clients * samples_per_client`` samples
            drawn at random first (the papers use 200).
    """

    # A capability (fedrun.compat): clients that exist only once drawn, so a round names a count of them.
    draws_clients_when_they_train = False

    def __init__(self, num_clients: int = 20, samples_per_client: int | None = None):
        check(_integer(num_clients) and num_clients >= 1, "num_clients", num_clients, "an integer >= 1")
        check(
            samples_per_client is None or (_integer(samples_per_client) and samples_per_client >= 1),
            "samples_per_client",
            samples_per_client,
            "null or an integer >= 1",
        )
        self.num_clients, self.samples_per_client = num_clients, samples_per_client

    def __call__(
        self, labels: np.ndarray, rng: np.random.Generator, natural: list[np.ndarray] | None = None
    ) -> list[np.ndarray]:
        """Split the training samples with these ``labels`` over the clients.

        Args:
            labels: Label of every training sample.
            rng: The run's partition stream.
            natural: The dataset's own per-client split, when it comes split.

        Returns:
            One sorted index array per client.
        """
        self._refuse_natural(natural)
        eligible = self._eligible(labels)
        size = self._pool_size(len(eligible))
        check(
            self.num_clients <= size,
            "num_clients",
            self.num_clients,
            f"at most the {size} samples in the pool",
        )
        pool = rng.choice(eligible, size=size, replace=False) if size < len(eligible) else rng.permutation(eligible)
        return [np.sort(part) for part in self._split(pool, labels, rng)]

    def _refuse_natural(self, natural: list[np.ndarray] | None) -> None:
        if natural is not None:
            raise ConfigError("partition", type(self).__name__.lower(), "natural: this dataset comes split per client")

    def _eligible(self, labels: np.ndarray) -> np.ndarray:
        return np.arange(len(labels))

    def _pool_size(self, available: int) -> int:
        check(
            self.num_clients <= available,
            "num_clients",
            self.num_clients,
            f"at most {available}, the samples there are to split",
        )
        if self.samples_per_client is None:
            return available
        wanted = self.num_clients * self.samples_per_client
        check(
            wanted <= available,
            "samples_per_client",
            self.samples_per_client,
            f"at most {available // self.num_clients} ({available} samples over {self.num_clients} clients)",
        )
        return wanted

    def _split(self, pool: np.ndarray, labels: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
        raise NotImplementedError


class IID(Partition):
    """Shuffle the pool and cut it into equal parts, or log-normal sizes when ``unbalanced`` > 0.

    Args:
        unbalanced: Sigma of the log-normal client sizes; 0 gives equal sizes.
        num_clients, samples_per_client: See ``Partition``.
    """

    def __init__(self, num_clients: int = 20, samples_per_client: int | None = None, unbalanced: float = 0.0):
        super().__init__(num_clients, samples_per_client)
        check(unbalanced >= 0, "unbalanced", unbalanced, "a log-normal sigma >= 0 (0 = equal sizes)")
        self.unbalanced = unbalanced

    def _split(self, pool, labels, rng):
        if self.unbalanced == 0:
            return np.array_split(pool, self.num_clients)
        # Every client keeps at least one sample; the rest is shared in log-normal proportions.
        share = rng.lognormal(0.0, self.unbalanced, self.num_clients)
        sizes = 1 + np.floor(share / share.sum() * (len(pool) - self.num_clients)).astype(int)
        sizes[np.argsort(-share)[: len(pool) - sizes.sum()]] += 1
        return np.split(pool, np.cumsum(sizes)[:-1])


class Shards(Partition):
    """McMahan et al. (2017): sort samples by label, cut them into shards, deal ``shards_per_client`` random
    shards to each client.

    ``shard_source`` says which samples are cut:

    - ``dataset`` (McMahan's protocol, the papers' "non-IID"): all eligible training samples are sorted by
      label and cut into shards of ``shard_size``; ``num_clients * shards_per_client`` of them are drawn at
      random without replacement. When only part of the dataset is used (50 x 200 of MNIST's 60,000), the
      federation's label marginal is itself random and uneven, as in the papers.
    - ``pool``: a pool of ``num_clients * samples_per_client`` samples is drawn first, sorted and cut, and
      all of its shards are dealt, so every label is about equally represented over the federation.

    Within a label, samples are in random order (the run's partition stream), so shards differ by seed.

    ``deal`` says how shards reach clients:

    - ``equal`` (McMahan's): ``shards_per_client`` random shards to each client, all clients the same size.
    - ``random``: every shard cut is dealt, each client first getting one (the first ``num_clients`` shards, to
      the clients in random order), then each further shard to a client drawn uniformly, so client sizes vary
      (binomially, about the mean ``samples_per_client``). This is paper 001's code (github
      alexandreduplessis/Tamaya_Federated_Learning at 10622fb, src/datasplitting.py:7-23: the label-sorted
      shards are popped from the end, the first ones to clients still without a shard). Its first shards all
      come from the last labels (9 on MNIST-like data), as there.

    Args:
        shard_size: Samples per shard; null derives it (``samples_per_client / shards_per_client``, else from
            the pool). A larger shard gives each client fewer labels ("non-IID" vs "very non-IID").
        shards_per_client: Shards dealt to each client (with ``deal: random``, its mean).
        shard_source: ``dataset`` or ``pool`` (above).
        deal: ``equal`` or ``random`` (above).
        num_clients, samples_per_client: See ``Partition``.
    """

    def __init__(
        self,
        num_clients: int = 20,
        samples_per_client: int | None = None,
        shard_size: int | None = None,
        shards_per_client: int = 2,
        shard_source: str = "dataset",
        deal: str = "equal",
    ):
        super().__init__(num_clients, samples_per_client)
        check(
            deal in ("equal", "random"),
            "deal",
            deal,
            "equal (shards_per_client shards to every client) or random (every shard to a random client, the authors' code of paper 001)",
        )
        self.deal = deal
        check(
            _integer(shards_per_client) and shards_per_client >= 1,
            "shards_per_client",
            shards_per_client,
            "an integer >= 1",
        )
        check(
            shard_size is None or (_integer(shard_size) and shard_size >= 1),
            "shard_size",
            shard_size,
            "null or an integer >= 1",
        )
        check(
            shard_source in ("dataset", "pool"),
            "shard_source",
            shard_source,
            "dataset (McMahan et al.: shards of the whole training set) or pool",
        )
        if shard_size is not None and samples_per_client is not None:
            check(
                shard_size * shards_per_client == samples_per_client,
                "shard_size",
                shard_size,
                f"{samples_per_client // shards_per_client} or null: shard_size x shards_per_client must equal "
                f"samples_per_client={samples_per_client} (or choose shards_per_client to divide it)",
            )
        if shard_size is None and samples_per_client is not None and shard_source == "dataset":
            check(
                samples_per_client % shards_per_client == 0,
                "shards_per_client",
                shards_per_client,
                f"a divisor of samples_per_client={samples_per_client} with shard_source=dataset (or set shard_size)",
            )
            shard_size = samples_per_client // shards_per_client
        self.shard_size, self.shards_per_client, self.shard_source = shard_size, shards_per_client, shard_source

    def _pool_size(self, available):
        num_shards = self.num_clients * self.shards_per_client
        most = available // self.shards_per_client
        check(
            self.num_clients <= most,
            "num_clients",
            self.num_clients,
            f"at most {most}: {available} samples give at most that many clients {self.shards_per_client} shards each",
        )
        if self.shard_source == "dataset" and self.shard_size is not None:
            check(
                num_shards * self.shard_size <= available,
                "shard_size",
                self.shard_size,
                f"at most {available // num_shards}: {self.num_clients} clients x {self.shards_per_client} shards "
                f"must fit in {available} samples",
            )
            return available  # every eligible sample is cut into shards; the dealt ones are drawn later
        if self.shard_size is None:
            base = super()._pool_size(available)
            check(
                base >= num_shards,
                "shards_per_client",
                self.shards_per_client,
                f"at most {base // self.num_clients}: {base} samples cannot give {num_shards} shards",
            )
            return num_shards * (base // num_shards)  # drop the remainder so shards are equal
        wanted = num_shards * self.shard_size
        check(
            wanted <= available,
            "shard_size",
            self.shard_size,
            f"at most {available // num_shards}: {self.num_clients} clients x {self.shards_per_client} shards "
            f"must fit in {available} samples",
        )
        return wanted

    def _split(self, pool, labels, rng):
        num_shards = self.num_clients * self.shards_per_client
        size = self.shard_size or len(pool) // num_shards
        cut = len(pool) // size  # shards the pool makes; a remainder of random samples (pool is shuffled) is left out
        by_label = pool[: cut * size][np.argsort(labels[pool[: cut * size]], kind="stable")]
        shards = np.split(by_label, cut)
        if self.deal == "random":  # datasplitting.py:17-22: shards.pop() from the end; clients without one first
            owner = np.concatenate(
                [rng.permutation(self.num_clients), rng.integers(self.num_clients, size=cut - self.num_clients)]
            )
            mine = [np.flatnonzero(owner == client) for client in range(self.num_clients)]
            return [np.concatenate([shards[cut - 1 - k] for k in ks]) for ks in mine]
        dealt = rng.choice(cut, size=num_shards, replace=False).reshape(self.num_clients, self.shards_per_client)
        return [np.concatenate([shards[s] for s in row]) for row in dealt]


class Dirichlet(Partition):
    """Per-class proportions over clients drawn from Dirichlet(alpha); redrawn until every client has
    at least ``min_size`` samples.

    Args:
        alpha: Concentration; small values give few classes per client (0.5 in the VR paper).
        min_size: Smallest client size accepted.
        max_tries: Draws attempted before giving up with an error.
        num_clients, samples_per_client: See ``Partition``.
    """

    def __init__(
        self,
        num_clients: int = 20,
        samples_per_client: int | None = None,
        alpha: float = 0.5,
        min_size: int = 10,
        max_tries: int = 1000,
    ):
        super().__init__(num_clients, samples_per_client)
        check(alpha > 0, "alpha", alpha, "a concentration > 0")
        check(_integer(min_size) and min_size >= 1, "min_size", min_size, "an integer >= 1")
        self.alpha, self.min_size, self.max_tries = alpha, min_size, max_tries

    def _split(self, pool, labels, rng):
        check(
            self.num_clients * self.min_size <= len(pool),
            "min_size",
            self.min_size,
            f"at most {len(pool) // self.num_clients} for {len(pool)} samples over {self.num_clients} clients",
        )
        classes = [pool[labels[pool] == c] for c in np.unique(labels[pool])]
        for _ in range(self.max_tries):
            parts = [[] for _ in range(self.num_clients)]
            for members in classes:
                cuts = np.cumsum(rng.dirichlet(np.full(self.num_clients, self.alpha)))[:-1]
                for client, chunk in enumerate(np.split(members, (cuts * len(members)).astype(int))):
                    parts[client].append(chunk)
            parts = [np.concatenate(p) for p in parts]
            if min(len(p) for p in parts) >= self.min_size:
                return parts
        raise ConfigError(
            "min_size",
            self.min_size,
            f"a size reached within {self.max_tries} Dirichlet({self.alpha}) draws; lower it or raise alpha",
        )


class Pathological(Partition):
    """PFLlib's pathological split (``partition='pat'``; github TsingZ0/PFLlib, dataset/utils/dataset_utils.py,
    ``separate_data``), with the run's partition stream in place of numpy's global one.

    Each client has ``classes_per_client`` classes. Class by class, in label order, the class goes to the first
    ceil(N / C * classes_per_client) clients that still lack classes (PFLlib's ``selected_clients``): with 20 clients,
    10 classes and 2 each, clients 0-3 get classes 0 and 1, clients 4-7 classes 2 and 3, and so on. The class's samples
    are cut between them: equal shares with ``balance``, else each but the last gets an integer drawn uniformly from
    [max(n / 10, 1 / C), n) (n = the class's samples / its clients; the bounds truncated to integers, as numpy's
    ``randint`` does with PFLlib's float bounds) and the last gets the rest. PFLlib cuts each class in dataset order;
    here the pool is shuffled first (the run's partition stream), so that chunks differ by seed.

    Args:
        classes_per_client: Classes each client holds (PFLlib's ``class_per_client``, 2 for its pathological
            settings).
        balance: Equal shares of each class (PFLlib's ``balance``; its pathological leaderboard uses false).
        num_clients, samples_per_client: See ``Partition``.
    """

    def __init__(
        self,
        num_clients: int = 20,
        samples_per_client: int | None = None,
        classes_per_client: int = 2,
        balance: bool = False,
    ):
        super().__init__(num_clients, samples_per_client)
        check(
            _integer(classes_per_client) and classes_per_client >= 1,
            "classes_per_client",
            classes_per_client,
            "an integer >= 1",
        )
        check(isinstance(balance, bool), "balance", balance, "true or false")
        self.classes_per_client, self.balance = classes_per_client, balance

    def _split(self, pool, labels, rng):
        classes = np.unique(labels[pool])
        n, c, k = self.num_clients, len(classes), self.classes_per_client
        check(k <= c, "classes_per_client", k, f"at most the {c} classes")
        # ceil(n k / c) clients a class, c classes: n k places or more, so every client gets its k classes
        lacking, parts = np.full(n, k), [[] for _ in range(n)]
        for label in classes:
            members = pool[labels[pool] == label]
            chosen = np.flatnonzero(lacking > 0)[: int(np.ceil(n / c * k))]
            check(
                len(chosen) > 0,
                "num_clients",
                n,
                f"a count that leaves no class without a client: classes go to ceil({n} / {c} * {k}) clients each, "
                f"so class {label} finds none (PFLlib's separate_data divides by zero here)",
            )
            share = len(members) / len(chosen)
            low, high = int(max(share / 10, 1 / c)), int(share)
            check(
                self.balance or len(chosen) == 1 or low < high,
                "num_clients",
                n,
                f"fewer: class {label} has {len(members)} samples for {len(chosen)} clients (PFLlib's draw needs "
                f"[max(n / 10, 1 / C), n) to hold an integer)",
            )
            if self.balance:
                sizes = [int(share)] * (len(chosen) - 1)
            else:
                sizes = rng.integers(low, high, size=len(chosen) - 1).tolist()
            sizes.append(len(members) - sum(sizes))
            for client, chunk in zip(chosen, np.split(members, np.cumsum(sizes)[:-1])):
                parts[client].append(chunk)
            lacking[chosen] -= 1
        return [np.concatenate(p) for p in parts]


class LabelSplit(Partition):
    """Explicit groups of clients owning explicit label sets (e.g. the FedStaleWeight paper's
    10 clients on labels 4-9 and 5 clients on labels 0-3).

    ``draw: deal`` (the default): each label's samples are shuffled and dealt round-robin over the clients
    that own it; labels no group owns are left out of the pool; clients are disjoint.

    ``draw: independent``: each client takes ``int(samples_per_client / len(labels))`` samples of each of its
    labels, drawn without replacement from all of that label's samples, independently of the other clients,
    so two clients may share samples. This is the split of paper 000's code (github
    alexandreduplessis/Tamaya_Federated_Learning at 4e1a5a1, src/datasplitting.py:52-75: per label
    ``int(share * size)`` items after a fresh shuffle of the label's whole list, for every client); its shares
    are equal over a client's labels (train.py:115, 1/2 for pairs; the commented line above it, 1/3 for triples).

    Args:
        groups: A list of ``{clients: int, labels: [int, ...]}``; clients are numbered group by group.
        num_clients: Null, or the total of the groups' clients.
        samples_per_client: See ``Partition``; with ``draw: independent``, each client's size (required).
        draw: ``deal`` or ``independent``.
    """

    def __init__(
        self, groups: list, num_clients: int | None = None, samples_per_client: int | None = None, draw: str = "deal"
    ):
        check(len(groups) >= 1, "groups", groups, "a non-empty list of {clients: n, labels: [...]}")
        check(
            draw in ("deal", "independent"),
            "draw",
            draw,
            "deal (each label's samples dealt over its owners, disjoint) or independent (every client draws its own, the authors' code of paper 000)",
        )
        check(
            draw == "deal" or samples_per_client is not None,
            "samples_per_client",
            samples_per_client,
            "an integer with draw=independent (each client's size)",
        )
        self.draw = draw
        self.groups = [(int(g["clients"]), [int(label) for label in g["labels"]]) for g in groups]
        for clients, owned in self.groups:
            check(clients >= 1 and len(owned) >= 1, "groups", groups, "groups with clients >= 1 and at least one label")
        total = sum(clients for clients, _ in self.groups)
        check(num_clients in (None, total), "num_clients", num_clients, f"null or {total}, the groups' total")
        super().__init__(total, samples_per_client)

    def owners(self) -> dict[int, list[int]]:
        """For each label, the clients that own it."""
        owners, first = {}, 0
        for clients, owned in self.groups:
            for label in owned:
                owners.setdefault(label, []).extend(range(first, first + clients))
            first += clients
        return owners

    def __call__(self, labels, rng, natural=None):
        if self.draw == "deal":
            return super().__call__(labels, rng, natural)
        self._refuse_natural(natural)
        by_label = {label: np.flatnonzero(labels == label) for label in self.owners()}
        parts = []
        for clients, owned in self.groups:
            per_label = int(self.samples_per_client / len(owned))  # int(numbers_list[c][n] * size), datasplitting.py:69
            check(
                per_label >= 1,
                "samples_per_client",
                self.samples_per_client,
                f"at least {len(owned)} for clients owning labels {owned}",
            )
            for label in owned:
                check(
                    per_label <= len(by_label[label]),
                    "samples_per_client",
                    self.samples_per_client,
                    f"at most {len(by_label[label]) * len(owned)} ({len(by_label[label])} samples of label {label})",
                )
            for _ in range(clients):
                parts.append(
                    np.sort(np.concatenate([rng.choice(by_label[label], per_label, replace=False) for label in owned]))
                )
        return parts

    def _eligible(self, labels):
        return np.flatnonzero(np.isin(labels, list(self.owners())))

    def _split(self, pool, labels, rng):
        parts = [[] for _ in range(self.num_clients)]
        for label, clients in self.owners().items():
            members = pool[labels[pool] == label]
            start = rng.integers(len(clients))  # rotate so the first owner is not always favoured
            for i, sample in enumerate(members):
                parts[clients[(start + i) % len(clients)]].append(sample)
        for client, part in enumerate(parts):
            check(
                len(part) > 0,
                "groups",
                self.groups,
                f"label sets with samples for every client (client {client} got none)",
            )
        return [np.asarray(p, dtype=np.int64) for p in parts]


class Natural(Partition):
    """The dataset's own per-client split (datasets that come split, such as ``synthetic``).

    Args:
        num_clients: Null for all of the dataset's clients, or exactly their number.
        samples_per_client: Optional cap on each client's samples (a random subset).
    """

    def __init__(self, num_clients: int | None = None, samples_per_client: int | None = None):
        super().__init__(1 if num_clients is None else num_clients, samples_per_client)
        self.requested = num_clients

    def __call__(self, labels, rng, natural=None):
        if natural is None:
            raise ConfigError(
                "partition",
                "natural",
                "iid, shards, dirichlet or label_split: this dataset does not come split per client",
            )
        check(
            self.requested in (None, len(natural)),
            "num_clients",
            self.requested,
            f"null or {len(natural)}, the dataset's clients",
        )
        if self.samples_per_client is None:
            return [np.sort(part) for part in natural]
        return [np.sort(rng.permutation(part)[: self.samples_per_client]) for part in natural]


def hold_out(
    parts: list[np.ndarray], fraction: float, rng: np.random.Generator, key: str = "client_test_fraction"
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Split each client's samples into (train, own test): ``fraction`` of them, at least one, held out.

    Returns:
        The clients' training parts and their held-out parts, both sorted.
    """
    train, test = [], []
    for part in parts:
        check(len(part) >= 2, key, fraction, "0 when clients have a single sample")
        shuffled = rng.permutation(part)
        n_test = min(len(part) - 1, max(1, int(round(fraction * len(part)))))
        test.append(np.sort(shuffled[:n_test]))
        train.append(np.sort(shuffled[n_test:]))
    return train, test


class LazyClients:
    """Clients made when asked for (``clients[i]``, each time), for populations too large to list: nothing exists
    per client beforehand. ``sizes`` holds each client's sample count. Engines and tracking never iterate over all
    of them (no partition.csv; the asynchronous engine's fairness covers the clients whose updates were applied)."""

    sizes: np.ndarray

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i) -> np.ndarray:
        raise NotImplementedError


class PopulationClients(LazyClients):
    """A cross-device population's clients: ``clients[i]`` draws client i's samples from its own stream (seed,
    ``population``, i) each time; nothing exists per client before (no array, no generator)."""

    def __init__(self, num_clients: int, samples: int, by_label: list[np.ndarray], labels_per_client, seed: int):
        self.num_clients, self.samples, self.by_label = num_clients, samples, by_label
        self.labels_per_client, self.seed = labels_per_client, seed
        self.everything = np.sort(np.concatenate(by_label))
        self.sizes = np.broadcast_to(np.int64(samples), (num_clients,))  # read-only, one element of memory

    def __getitem__(self, i) -> np.ndarray:
        i = int(i)
        if not 0 <= i < self.num_clients:
            raise IndexError(f"client {i} of {self.num_clients}")
        from fedrun.seeding import numpy_rng

        rng = numpy_rng(self.seed, "population", i)
        if self.labels_per_client is None:
            source = self.everything
        else:
            chosen = rng.choice(len(self.by_label), size=self.labels_per_client, replace=False)
            source = np.concatenate([self.by_label[c] for c in np.sort(chosen)])
        return np.sort(rng.choice(source, size=self.samples, replace=len(source) < self.samples))


class Population(Partition):
    """A synthetic cross-device population sharing one pool: ``num_clients`` clients (a million, say), each holding
    ``samples_per_client`` samples of the training set drawn by its own stream when it first trains, so clients
    overlap and a round costs what its cohort costs, whatever the population (``PopulationClients``).

    Args:
        num_clients: The population.
        samples_per_client: Samples each client holds (drawn without replacement from its source).
        labels_per_client: Null (from every label) or k: the client's samples come from k labels its stream picks.
    """

    draws_clients_when_they_train = True  # so a round's clients are a count, not a fraction (fedrun.compat)

    def __init__(
        self, num_clients: int = 1_000_000, samples_per_client: int = 20, labels_per_client: int | None = None
    ):
        super().__init__(num_clients, samples_per_client)
        most, memory = most_clients()
        check(
            num_clients <= most,
            "num_clients",
            num_clients,
            f"an integer from 1 to {most:,}: a run keeps about {BYTES_PER_CLIENT} bytes a client (its selection "
            f"count and copies of it), {num_clients * BYTES_PER_CLIENT / 2**30:,.0f} GiB here"
            + (f", and this machine has {memory / 2**30:,.0f} GiB" if memory else ""),
        )
        check(samples_per_client is not None, "samples_per_client", samples_per_client, "an integer >= 1 (population)")
        check(
            labels_per_client is None or (_integer(labels_per_client) and labels_per_client >= 1),
            "labels_per_client",
            labels_per_client,
            "null or an integer >= 1",
        )
        self.labels_per_client = labels_per_client

    def __call__(self, labels, rng, natural=None):
        self._refuse_natural(natural)
        classes = np.unique(labels)
        check(
            self.labels_per_client is None or self.labels_per_client <= len(classes),
            "labels_per_client",
            self.labels_per_client,
            f"at most the {len(classes)} labels",
        )
        seed = int(rng.integers(2**63))  # the clients' streams hang off the run's partition stream
        by_label = [np.flatnonzero(labels == c) for c in classes]
        return PopulationClients(self.num_clients, self.samples_per_client, by_label, self.labels_per_client, seed)


def _integer(value) -> bool:
    """An int, not a bool (YAML's true is an int to Python: ``labels_per_client=true`` is not 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def most_clients() -> tuple[int, int | None]:
    """The largest population a run can hold here, and this machine's memory in bytes (None where the system does
    not say: then the bound is int64's)."""
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows), or no such name
        return INT64_MAX, None
    return min(INT64_MAX, memory // BYTES_PER_CLIENT), memory


def client_sizes(clients) -> np.ndarray:
    """Each client's sample count: a population's shared array, else counted."""
    if isinstance(clients, LazyClients):
        return np.asarray(clients.sizes)
    return np.array([len(part) for part in clients], dtype=np.int64)
