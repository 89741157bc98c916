"""Clients as devices (``devices`` group): each client's compute speed and link bandwidths, and the time a round
takes on them, on a virtual clock.

A client's time in a synchronous round is FedScale's completion time (``ClientMetadata.get_completion_time``:
computation plus communication), written per direction:

    download_mb / down + passes * speed + upload_mb / up

with ``passes`` the sample-passes (forward and backward) of its local work this round (``fedrun.backends.passes``),
``download_mb`` the messages it receives (the model, and a client program's extra ones: SCAFFOLD's variate) and
``upload_mb`` what it sends through the stages (a compressed message counts its real size, ``fedrun.rounds.Bits``).
The round lasts as long as its slowest client (the server waits for the cohort), or until a deadline or its last
report kept (``Profiled``: Bonawitz et al.'s over-selection); ``virtual_time`` is the sum of the rounds' durations,
and the summary's ``R<target>_time`` the virtual time at which test accuracy first reached the target. Availability
windows (``Windows``) say who can be drawn when. On the asynchronous engine the same time is each job's, from when its
client is next online (``Profiled.arrival``). ``devices=none`` models no device: no clock, today's runs bit for bit.

Units: ``speed`` in seconds per sample-pass, ``up`` and ``down`` in megabytes per second (1 MB = 1e6 bytes).
"""

import math
import pickle
from pathlib import Path

import numpy as np

from fedrun.errors import ConfigError, check
from fedrun.seeding import numpy_rng, stream_key


class Unmodelled:
    """``devices=none``: clients are not devices; rounds take no virtual time (nothing is logged)."""

    clocked, drops_clients, loses_clients, kind = False, False, False, "none"
    windows = None  # availability windows (``Traced``): who is online when

    def bind(self, context) -> None:
        pass

    def available(self) -> np.ndarray | None:
        """The clients online at the round's start (a bool mask over the population), or None: all of them."""
        return None

    def columns(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class Profiled(Unmodelled):
    """Each client's ``speed``, ``up`` and ``down`` (arrays indexed by client id), the run's virtual clock, and
    what the server does with late clients (Bonawitz et al. 2019, "Towards Federated Learning at Scale", sec. 2:
    the server selects more devices than it needs, keeps the first reports and abandons a round with too few).

    Args:
        deadline: Virtual seconds the server waits for reports; a client whose time is longer is dropped (null:
            it waits for every client).
        reports: Reports the server keeps, the first to arrive (null: all that arrive in time); draw more clients
            than this (``schedule.cohort``) to over-select, as Bonawitz et al.'s 130%.
        min_reports: A round with fewer reports in time fails: nothing is aggregated (an empty round's zero
            update), ``round_failed`` is 1, and it lasts until the deadline.
    """

    clocked = True

    def __init__(self, deadline: float | None = None, reports: int | None = None, min_reports: int = 1):
        check(deadline is None or _positive(deadline), "deadline", deadline, "null or virtual seconds > 0")
        check(
            reports is None or (isinstance(reports, int) and reports >= 1),
            "reports",
            reports,
            "null or an integer >= 1",
        )
        check(isinstance(min_reports, int) and min_reports >= 1, "min_reports", min_reports, "an integer >= 1")
        check(reports is None or min_reports <= reports, "min_reports", min_reports, f"at most reports={reports}")
        self.deadline, self.reports, self.min_reports = deadline, reports, min_reports
        self.speed = self.up = self.down = None
        self.clock = 0.0  # virtual seconds since the run began: the sum of the rounds' durations
        self.last: dict = {}  # the last round's columns
        self.waited = 0.0  # this round's wait for a client to come online (nobody was, at the round's start)
        self.online = math.nan  # the share of the population online at this round's start

    @property
    def drops_clients(self) -> bool:
        """Whether some drawn clients may not report (a deadline, or a cap on the reports kept)."""
        return self.deadline is not None or self.reports is not None

    @property
    def loses_clients(self) -> bool:
        """Whether a drawn client may go offline before its report arrives (availability windows: ``round``)."""
        return self.windows is not None

    def profiles(self, num_clients: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(speed, up, down) of clients 0 .. num_clients - 1."""
        raise NotImplementedError

    def bind(self, context) -> None:
        self.speed, self.up, self.down = self.profiles(len(context.sizes))
        self.population = len(context.sizes)

    def available(self) -> np.ndarray | None:
        """The clients online at the round's start (``windows``): when nobody is, the round starts when the first
        window opens, and waits until then (``round_virtual_s`` counts the wait). None without windows."""
        self.waited = 0.0
        if self.windows is None:
            return None
        mask = self.windows.online(self.clock, self.population)
        if not mask.any():
            opens = self.windows.next_opening(self.clock)
            self.waited, self.clock = opens - self.clock, opens
            mask = self.windows.online(self.clock, self.population)
        self.online = float(mask.mean())
        return mask

    def times(self, cohort: np.ndarray, passes, download_mb: float, upload_mb: float) -> np.ndarray:
        """Each cohort client's seconds this round: download + compute + upload (the module's formula)."""
        cohort = np.asarray(cohort, dtype=np.int64)
        return (
            download_mb / self.down[cohort]
            + np.asarray(passes, dtype=np.float64) * self.speed[cohort]
            + upload_mb / self.up[cohort]
        )

    def arrival(self, client: int, now: float, passes: int, download_mb: float, upload_mb: float) -> float:
        """When a job of ``client`` started at ``now`` arrives, on the asynchronous engine: when the client is next
        online (``now`` if it is), plus its time (a client that goes offline mid-job still delivers)."""
        begin = now if self.windows is None else self.windows.next_online(client, now)
        return begin + float(self.times(np.array([client]), [passes], download_mb, upload_mb)[0])

    def probing(self, probe) -> float:
        """How long a round's loss probe lasts (``probe``: Power-of-Choice's candidates, their sample counts, the
        model's and a loss's megabytes): each candidate downloads the model, passes its samples forward once and
        sends its loss, and the server waits for every candidate before it chooses (Cho et al. 2020). A forward
        pass costs a third of a training sample-pass (FedScale's factor: its training time is three inferences)."""
        candidates, samples, download_mb, loss_mb = probe
        candidates = np.asarray(candidates, dtype=np.int64)
        times = download_mb / self.down[candidates] + np.asarray(samples) * self.speed[candidates] / 3
        return float((times + loss_mb / self.up[candidates]).max(initial=0.0))

    def round(self, cohort: np.ndarray, passes, download_mb: float, upload_mb: float, probe=None) -> np.ndarray:
        """Which cohort clients report (a bool mask in cohort order), and the round's duration on the clock.

        With a loss ``probe`` (``probing``) the round first lasts as long as the probe, from whose end the cohort
        (candidates that already hold the model: ``download_mb`` is then only a program's extra messages) trains
        and reports; the deadline counts from the probe's end (it bounds the reporting phase, as Bonawitz et al.'s).

        A client offline when its report would arrive is lost (FedScale's rule, ``Aggregator.tictak_client_tasks``:
        "if the client is not active by the time of collection, we consider it is lost in this round",
        ``isClientActive(client, virtual clock + its completion time)``). In time order (ties in cohort order), the
        clients not lost and within ``deadline`` report until ``reports`` have; a round with fewer than
        ``min_reports`` fails (no client reports). The round lasts until its last kept report when it kept
        ``reports``, until the deadline when a client missed it, was lost or the round failed, else until its
        slowest report (FedScale's, without a deadline: a lost client is not waited for; for a round that failed,
        its slowest client not lost, or its slowest client when every one was lost; 0 for a round that drew
        nobody)."""
        probing = 0.0 if probe is None else self.probing(probe)
        times = self.times(cohort, passes, download_mb, upload_mb)
        order = np.argsort(times, kind="stable")
        lost = np.zeros(len(times), dtype=bool)
        if self.windows is not None:
            lost = ~self.windows.online_at(np.asarray(cohort), self.clock + probing + times)
        in_time = (times[order] <= (self.deadline if self.deadline is not None else math.inf)) & ~lost[order]
        eligible = order[in_time]  # in time order
        kept = np.zeros(len(times), dtype=bool)
        count = len(eligible) if self.reports is None else min(len(eligible), self.reports)
        kept[eligible[:count]] = True
        failed = len(times) > 0 and count < self.min_reports
        if failed:
            kept[:] = False
        if not len(times):
            duration = 0.0
        elif not failed and self.reports is not None and count == self.reports:
            duration = float(times[eligible[count - 1]])  # the last report it needed
        elif self.deadline is not None and (failed or not in_time.all()):
            duration = float(self.deadline)
        elif failed:  # the clients not lost, as long as the slowest of them (every one, when all were lost)
            duration = float(times[~lost].max() if (~lost).any() else times.max())
        else:
            duration = float(times[kept].max())
        duration += probing
        self.clock += duration
        self.last = {"round_virtual_s": self.waited + duration, "virtual_time": self.clock}
        if probe is not None:
            self.last["probe_virtual_s"] = probing
        if self.drops_clients or self.loses_clients:
            self.last |= {"devices_dropped": int(len(times) - kept.sum()), "round_failed": float(failed)}
        if self.windows is not None:
            self.last |= {"devices_online": self.online, "devices_lost": int(lost.sum())}
        return kept

    def columns(self) -> dict:
        """The last round's ``round_virtual_s`` and ``virtual_time``; with a deadline, a cap on reports or windows
        also ``devices_dropped`` and ``round_failed``; with windows ``devices_online`` and ``devices_lost``; after a
        loss probe ``probe_virtual_s``."""
        return dict(self.last)

    def state_dict(self) -> dict:
        return {"clock": self.clock}

    def load_state_dict(self, state: dict) -> None:
        clock = state.get("clock", 0.0)
        if not isinstance(clock, float) or not math.isfinite(clock) or clock < 0:
            raise ValueError(f"devices clock {clock!r}: a finite number of seconds >= 0")
        self.clock = clock


PROFILE_COLUMNS = ("client", "speed", "up", "down")


class Traced(Profiled):
    """``devices=trace``: the clients' profiles from a file, one row per client: ``client`` (ids 0 .. n - 1, each
    once), ``speed`` (seconds per sample-pass), ``up`` and ``down`` (megabytes per second), all finite and > 0.
    CSV, or Parquet by its ``.parquet`` suffix. ``scripts/fedscale_profiles.py`` writes one from FedScale's device
    capacities. A run with more clients than the file has rows is refused; with fewer, the first ids are used.

    Args:
        profiles: The file's path (relative to the folder fedrun was started in).
    """

    kind = "trace"

    def __init__(
        self,
        profiles: str,
        deadline: float | None = None,
        reports: int | None = None,
        min_reports: int = 1,
        availability: str | None = None,
        period: float | None = None,
    ):
        super().__init__(deadline, reports, min_reports)
        check(isinstance(profiles, str) and profiles != "", "profiles", profiles, "a CSV or Parquet file's path")
        check(availability is None or (isinstance(availability, str) and availability != ""), "availability",
              availability, "null or a CSV or Parquet file's path")  # fmt: skip
        check(period is None or _positive(period), "period", period, "null or virtual seconds > 0")
        check(period is None or availability is not None, "period", period, "null without devices.availability")
        self.path = profiles
        self.table = read_table(Path(profiles))  # checked when the run is built, before the dataset is read
        self.windows = None if availability is None else Windows.read(Path(availability), period)

    def profiles(self, num_clients: int):
        if self.windows is not None:
            self.windows.keep_clients(num_clients)
        return for_clients(Path(self.path), *self.table, num_clients)

    def __getstate__(self) -> dict:  # to a worker process: no table (only the server times a round)
        return {**self.__dict__, "table": None, "speed": None, "up": None, "down": None}


class Generated(Profiled):
    """``devices=generated``: each client's speed drawn once from the run's seed, ``seconds_per_sample`` x
    LogNormal(``mu``, ``sigma``) seconds per sample-pass, FedScale's lognormal device model
    (``ClientMetadata.get_completion_time_lognormal``: 0.005 s a sample, mu 1, sigma 0.6, after the on-device
    measurements of PAPAYA, Huba et al. 2022): a median of 0.0136 s and a long tail of slow devices. FedScale draws
    a new speed for each task; here a device keeps its speed. Bandwidths are the user's (``up``, ``down``): no
    published distribution of them is shipped. Availability, when asked for, is drawn slot by slot (``Slotted``).

    Args:
        up, down: Every client's uplink and downlink, megabytes per second.
        seconds_per_sample, mu, sigma: The speed's scale and log-normal parameters.
        availability: null (every client always online), ``homogeneous`` or ``lognormal`` (``Slotted``).
        beta, slot, diurnal: The availability's parameter, its slot in virtual seconds and its daily wave.
    """

    kind = "generated"

    def __init__(
        self,
        up: float,
        down: float,
        seconds_per_sample: float = 0.005,
        mu: float = 1.0,
        sigma: float = 0.6,
        deadline: float | None = None,
        reports: int | None = None,
        min_reports: int = 1,
        availability: str | None = None,
        beta: float = 0.1,
        slot: float = 3600.0,
        diurnal: bool = False,
    ):
        super().__init__(deadline, reports, min_reports)
        for key, value in (("up", up), ("down", down), ("seconds_per_sample", seconds_per_sample)):
            check(_positive(value), key, value, "a number > 0")
        check(isinstance(mu, (int, float)) and math.isfinite(mu), "mu", mu, "a finite number")
        check(_positive(sigma) or sigma == 0, "sigma", sigma, "a number >= 0")
        self.bandwidth, self.scale, self.mu, self.sigma = (float(up), float(down)), seconds_per_sample, mu, sigma
        check(not diurnal or availability is not None, "diurnal", diurnal, "false without devices.availability")
        self.windows = None if availability is None else Slotted(availability, beta, slot, diurnal)

    def bind(self, context) -> None:
        self.seed = context.seed
        super().bind(context)
        if self.windows is not None:
            self.windows.bind(self.seed, self.population)

    def profiles(self, num_clients: int):
        speed = self.scale * numpy_rng(self.seed, "devices").lognormal(self.mu, self.sigma, num_clients)
        return speed, np.full(num_clients, self.bandwidth[0]), np.full(num_clients, self.bandwidth[1])


class Slotted:
    """Generated availability (``devices=generated devices.availability=...``): virtual time is cut into slots of
    ``slot`` seconds, and client i is online for the whole of slot k with probability p_i f(k), drawn for each
    (client, slot) independently, as FLGo's availability modes draw each round's (``flgo/simulator/
    default_simulator.py``; the slot stands for their round, so a round that outlasts its slot sees the next one):

    - ``homogeneous``: p_i = 1 - ``beta`` for every client (FLGo's ``HOMO``);
    - ``lognormal``: c_i ~ LogNormal(0, -ln(1 - ``beta``)), p_i = c_i / max_j c_j (FLGo's ``LN``, after Ribero,
      Vikalo and de Veciana 2022, "Federated learning under intermittent client availability and time-varying
      communication constraints"); the maximum is the population's, as in FLGo, so the rates depend on the
      population's size (the median rate is 0.83 among 20 clients and 0.62 among a million at beta 0.1, 0.29 and
      0.04 at beta 0.5);
    - ``diurnal``: f(k) = 0.4 sin(2 pi k / 24) + 0.5, a day of 24 slots between 0.1 and 0.9 (FLGo's ``SLN``, whose
      24 points include both ends of the sine, 0 and 2 pi, so its slots 0 and 23 repeat a value, and whose rounds
      count from 1, so its first round is at 0.61; here a true period from slot 0 at 0.5); without it, f = 1.
      FLGo's defaults are beta 0.2 for ``HOMO`` and 0.1 for ``LN`` and ``SLN``; fedrun's is 0.1 for both.

    Who is online is a pure function of (seed, client, slot): nothing is stored but the rates (one float a client),
    a cohort's lookups cost the cohort, and a resumed run sees the same availability. The uniform of each (client,
    slot) is a counter-based hash (SplitMix64's finaliser applied twice), since NumPy's generators cannot be keyed
    per element; ``test_devices.py`` checks its frequencies."""

    MODES = ("homogeneous", "lognormal")
    # Slots looked ahead for a client's next slot online (its rate times the wave is > 0, but a log-normal rate
    # c / max c has no lower bound: 3e-7 at beta 0.9 among 1,000 clients), and for the population's next; past them
    # it is taken as never online again (``t``, as ``Windows`` says of windows that never open again).
    SCAN = 100_000_000
    SCAN_POPULATION = 100_000

    def __init__(self, mode: str, beta: float, slot: float, diurnal: bool):
        check(mode in self.MODES, "availability", mode, "null, homogeneous or lognormal")
        check(_number(beta) and 0 <= beta < 1, "beta", beta, "a number in [0, 1)")
        check(_positive(slot), "slot", slot, "virtual seconds > 0")
        check(isinstance(diurnal, bool), "diurnal", diurnal, "true or false")
        self.mode, self.beta, self.slot, self.diurnal = mode, float(beta), float(slot), diurnal
        self.path = mode  # the value of devices.availability, as a trace's path is (``fedrun.compat`` names it)
        self.rates, self.key = None, 0

    def bind(self, seed: int, num_clients: int) -> None:
        """Each client's rate p_i, and the hash's key, from the run's seed."""
        self.key = stream_key(seed, "devices.availability")
        if self.mode == "homogeneous":
            self.rates = np.full(num_clients, 1.0 - self.beta)
        else:
            c = numpy_rng(seed, "devices.availability.rates").lognormal(0.0, -math.log1p(-self.beta), num_clients)
            self.rates = c / c.max() if num_clients else c

    def wave(self, slots: np.ndarray) -> np.ndarray:
        """f(k) of each slot."""
        if not self.diurnal:
            return np.ones(np.shape(slots))
        return 0.4 * np.sin(2 * math.pi * (np.asarray(slots) % 24) / 24) + 0.5

    def _online(self, clients: np.ndarray, slots: np.ndarray) -> np.ndarray:
        clients, slots = np.asarray(clients, dtype=np.int64), np.asarray(slots, dtype=np.int64)
        return _uniform(self.key, clients, slots) < self.rates[clients] * self.wave(slots)

    def _slot(self, t) -> np.ndarray:
        return np.floor_divide(np.asarray(t, dtype=np.float64), self.slot).astype(np.int64)

    def online(self, t: float, num_clients: int) -> np.ndarray:
        """Who is online at virtual time ``t``: a bool mask over the population."""
        clients = np.arange(num_clients)
        return self._online(clients, np.full(num_clients, self._slot(t)))

    def online_at(self, clients: np.ndarray, times: np.ndarray) -> np.ndarray:
        """Whether each of ``clients`` is online at its own time in ``times``."""
        return self._online(clients, self._slot(times))

    def start(self, k: int) -> float:
        """The first time in slot ``k``: ``k * slot``, or the next float up where the product rounded down into slot
        k - 1 (with slot 0.1, about half of them do), so that ``_slot(start(k)) == k`` always."""
        t = k * self.slot
        while self._slot(t) < k:
            t = float(np.nextafter(t, math.inf))
        return float(t)

    def next_online(self, client: int, t: float) -> float:
        """The first time >= ``t`` at which ``client`` is online: ``t`` when it is, else its next slot's start
        (``t`` when it is not online within ``SCAN`` slots)."""
        now, block = int(self._slot(t)), 65536
        for first in range(now, now + self.SCAN, block):
            slots = np.arange(first, first + block)
            hits = np.flatnonzero(self._online(np.full(len(slots), client), slots))
            if len(hits):
                return t if slots[hits[0]] == now else self.start(int(slots[hits[0]]))
        return t

    def next_opening(self, t: float) -> float:
        """The start of the first slot after ``t``'s in which some client is online (``t`` when none is within
        ``SCAN_POPULATION`` slots)."""
        clients, after = np.arange(len(self.rates)), int(self._slot(t)) + 1
        for slot in range(after, after + self.SCAN_POPULATION):
            if self._online(clients, np.full(len(clients), slot)).any():
                return self.start(slot)
        return t


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser (Steele, Lea and Flood 2014), on uint64 arrays (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _uniform(key: int, clients: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """A uniform in [0, 1) for each (client, slot) under ``key``: 53 bits of mix(mix(key + client g) + slot g)."""
    with np.errstate(over="ignore"):
        x = _mix(np.uint64(key) + clients.astype(np.uint64) * _GOLDEN)
        x = _mix(x + slots.astype(np.uint64) * _GOLDEN)
    return (x >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _positive(value) -> bool:
    """A finite number > 0 (not a bool)."""
    return _number(value) and value > 0


def read_profiles(path: Path, num_clients: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(speed, up, down) of clients 0 .. num_clients - 1 from a profiles file (``Traced``); anything else is one
    ConfigError naming the file, the row or column and what is allowed."""
    return for_clients(path, *read_table(path), num_clients)


def read_frame(path: Path, key: str, columns: tuple[str, ...]) -> "pd.DataFrame":  # noqa: F821
    """A CSV or Parquet file (by its ``.parquet`` suffix) with at least ``columns``; one ConfigError for ``key``
    otherwise: no file there, a file pandas cannot read, a column missing."""
    import pandas as pd

    names = ", ".join(columns)
    if not path.is_file():
        raise ConfigError(key, str(path), f"a CSV or Parquet file of {names} (none there)")
    try:
        table = pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path)
    except Exception as exc:  # a file pandas cannot parse: its own message, in one line
        raise ConfigError(key, str(path), f"a CSV or Parquet file pandas reads ({type(exc).__name__}: {exc})") from None
    missing = [c for c in columns if c not in table.columns]
    check(not missing, key, str(path), f"columns {names} (missing: {', '.join(missing)})")
    return table


def read_table(path: Path) -> tuple[np.ndarray, ...]:
    """A profiles file's (client, speed, up, down) columns, each value checked (one ConfigError otherwise)."""
    import pandas as pd

    key = "devices.profiles"
    table = read_frame(path, key, PROFILE_COLUMNS)
    values = {}
    for column in PROFILE_COLUMNS:
        numbers = pd.to_numeric(table[column], errors="coerce").to_numpy(dtype=np.float64)
        bad = np.flatnonzero(~np.isfinite(numbers) | (numbers <= 0 if column != "client" else numbers < 0))
        if len(bad):
            allowed = "an integer client id >= 0" if column == "client" else "a finite number > 0"
            value = table[column].iloc[bad[0]]
            raise ConfigError(
                f"{key} {path} row {bad[0] + 2} {column}", getattr(value, "item", lambda: value)(), allowed
            )
        values[column] = numbers
    ids = values["client"]
    whole = ids == np.round(ids)
    check(bool(whole.all()), f"{key} {path} client", ids[~whole][:1].tolist(), "integer client ids")
    ids = ids.astype(np.int64)
    unique, counts = np.unique(ids, return_counts=True)
    check(bool((counts == 1).all()), f"{key} {path} client", unique[counts > 1][:3].tolist(), "each id once")
    return ids, values["speed"], values["up"], values["down"]


def for_clients(path: Path, ids, speed, up, down, num_clients: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The profiles of clients 0 .. num_clients - 1 (every one of them in the file: one ConfigError otherwise)."""
    key, unique = "devices.profiles", np.sort(ids)
    check(
        len(unique) >= num_clients and unique[num_clients - 1] == num_clients - 1 if num_clients else True,
        key,
        str(path),
        f"a row for each of the run's {num_clients} clients, ids 0 to {num_clients - 1} ({len(unique)} rows, ids "
        f"{unique[:1].tolist()}..{unique[-1:].tolist()})",
    )
    order = np.argsort(ids)[:num_clients]
    return speed[order], up[order], down[order]


class Windows:
    """Availability windows: client ``client`` is online in [``start``, ``end``) virtual seconds, each row one
    window (a client may have several); a window with a period repeats every ``period`` seconds (a diurnal trace:
    86400), as FedScale's availability traces repeat, each client's over its own ``finish_time``. A client with no
    window is always online (FedScale's rule for a client without a trace)."""

    def __init__(self, client: np.ndarray, start: np.ndarray, end: np.ndarray, period: np.ndarray, path: str):
        self.client, self.start, self.end, self.period, self.path = client, start, end, period, path
        self._index()

    def _index(self) -> None:
        self.windowed = np.unique(self.client)  # the clients online only in their windows
        self._order = np.argsort(self.client, kind="stable")  # a client's rows, found by bisection (a trace of a
        self._sorted = self.client[self._order]  # million clients: a cohort's lookups cost the cohort, not the file)

    def rows(self, client: int) -> np.ndarray:
        """The rows of ``client``'s windows (none for a client always online)."""
        lo, hi = np.searchsorted(self._sorted, [client, client + 1], side="left")
        return self._order[lo:hi]

    @classmethod
    def read(cls, path: Path, period: float | None) -> "Windows":
        """The windows of a CSV or Parquet file (client, start, end, and optionally each window's own ``period``,
        else ``period`` for all: None, they do not repeat); one ConfigError for anything else."""
        import pandas as pd

        key = "devices.availability"
        table = read_frame(path, key, ("client", "start", "end"))
        columns = ("client", "start", "end") + (("period",) if "period" in table.columns else ())
        values = {c: pd.to_numeric(table[c], errors="coerce").to_numpy(dtype=np.float64) for c in columns}
        own = values.get("period", np.full(len(table), np.nan))
        given = math.inf if period is None else float(period)
        repeat = np.where(np.isnan(own), given, own)  # a row's own period, else the run's
        bad = ~np.isfinite(values["client"]) | (values["client"] < 0) | (values["client"] != np.round(values["client"]))
        bad |= ~np.isfinite(values["start"]) | (values["start"] < 0) | ~(values["end"] > values["start"])
        bad |= np.isnan(values["end"]) | (values["end"] > repeat) | ~(repeat > 0)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            allowed = "a client id >= 0 and 0 <= start < end <= its period (the row's, or devices.period)"
            raise ConfigError(f"{key} {path} row {row + 2}", table.iloc[row].to_dict(), allowed)
        return cls(values["client"].astype(np.int64), values["start"], values["end"], repeat, str(path))

    def keep_clients(self, num_clients: int) -> None:
        """Keep the windows of the run's clients 0 .. num_clients - 1 (a file for more clients serves a smaller run,
        its first ids, as a profiles file does)."""
        rows = self.client < num_clients
        self.client, self.start, self.end, self.period = (
            a[rows] for a in (self.client, self.start, self.end, self.period)
        )
        self._index()

    def online(self, t: float, num_clients: int) -> np.ndarray:
        """Who is online at virtual time ``t``: a bool mask over the population."""
        mask = np.ones(num_clients, dtype=bool)
        mask[self.windowed] = False  # a client with windows is online only in them
        mask[self.client[self._open(slice(None), t)]] = True
        return mask

    def next_online(self, client: int, t: float) -> float:
        """The first time >= ``t`` at which ``client`` is online (``t`` itself for a client without windows, or one
        that is online then; ``t`` too when its windows never open again)."""
        rows = self.rows(client)
        if not len(rows) or self._inside(rows, t):
            return t
        return _soonest(self.start[rows], self.period[rows], t)

    def online_at(self, clients: np.ndarray, times: np.ndarray) -> np.ndarray:
        """Whether each of ``clients`` is online at its own time in ``times`` (a bool per client)."""
        return np.array(
            [not len(rows := self.rows(int(c))) or self._inside(rows, float(t)) for c, t in zip(clients, times)],
            dtype=bool,
        )

    def _inside(self, rows: np.ndarray, t: float) -> bool:
        return bool(self._open(rows, t).any())

    def _open(self, rows, t: float) -> np.ndarray:
        """Whether each of the windows ``rows`` is open at ``t``: [start, end) within its period (``t`` itself for a
        window that does not repeat: an infinite period)."""
        now = np.remainder(t, self.period[rows])
        return (self.start[rows] <= now) & (now < self.end[rows])

    def next_opening(self, t: float) -> float:
        """The first time after ``t`` at which a window opens (a repeating one's next period when its start is
        past in this one; ``t`` itself when none ever opens after it: nobody is online again, every later round is
        empty)."""
        return _soonest(self.start, self.period, t)


def _soonest(start: np.ndarray, period: np.ndarray, t: float) -> float:
    """The first time after ``t`` at which one of these windows opens (a repeating one's next period when its start
    is past in this one), or ``t`` when none ever opens again."""
    now = np.remainder(t, period)
    base = np.where(np.isinf(period), 0.0, t - now)
    opens = np.where(start > now, base + start, base + period + start)
    soonest = float(opens.min()) if len(opens) else math.inf
    return soonest if math.isfinite(soonest) else t


class _PlainUnpickler(pickle.Unpickler):
    """An unpickler that builds plain containers and numbers only: any class or function a pickle names (the way a
    pickle runs code) is refused."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"a trace names {module}.{name}: only dicts, lists, tuples, strings and numbers")


def read_plain_pickle(path: Path, what: str):
    """A pickle read by an unpickler that builds plain containers and numbers only (one ConfigError otherwise)."""
    try:
        with open(path, "rb") as f:
            return _PlainUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as exc:
        raise ConfigError(what, str(path), f"a pickle of plain dicts and numbers ({exc})") from None


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_fedscale(path: Path) -> dict:
    """FedScale's ``client_device_capacity`` (a pickled {client id: {"computation": ms per sample of inference,
    "communication": kbps}}), read by an unpickler that allows only plain containers and numbers. Returns the dict."""
    content = read_plain_pickle(path, "fedscale trace")
    check(isinstance(content, dict), "fedscale trace", str(path), "a dict of client id -> {computation, communication}")
    for client, capacity in content.items():
        ok = isinstance(capacity, dict) and all(_number(capacity.get(k)) for k in ("computation", "communication"))
        check(ok, f"fedscale trace {path} client {client!r}", capacity, "{computation: ms, communication: kbps}")
    return content


def read_fedscale_behaviour(path: Path) -> dict:
    """FedScale's ``client_behave_trace`` (a pickled {client id: {"active": [s, ...], "inactive": [s, ...],
    "finish_time": s, ...}}: client online from each active time to the inactive one, the whole repeating over its
    finish_time), read as ``read_fedscale`` reads. Returns the dict."""
    content = read_plain_pickle(path, "fedscale behaviour trace")
    check(isinstance(content, dict), "fedscale behaviour trace", str(path), "a dict of client id -> its trace")
    for client, trace in content.items():
        ok = (
            isinstance(trace, dict)
            and _number(trace.get("finish_time"))
            and trace["finish_time"] > 0
            and all(
                isinstance(trace.get(k), (list, tuple)) and all(_number(v) for v in trace[k])
                for k in ("active", "inactive")
            )
            and len(trace["active"]) == len(trace["inactive"])
        )
        check(ok, f"fedscale behaviour trace {path} client {client!r}", "...",
              "{active: [seconds], inactive: [seconds] as many, finish_time: seconds > 0}")  # fmt: skip
    return content


def fedscale_windows(behaviour: dict, ids: list) -> "pd.DataFrame":  # noqa: F821
    """FedScale's behaviour traces as availability windows (``Windows``): each (active, inactive) pair of a client a
    window, cut to its finish_time, repeating with the client's finish_time as its period. Client ``ids[i]`` (the
    capacity file's order, ``fedscale_profiles``) becomes client i; a client without a trace gets no window (always
    online, as in FedScale). FedScale counts both ends of a window in; here the end is out ([start, end))."""
    import pandas as pd

    rows = []
    for index, fedscale_id in enumerate(ids):
        trace = behaviour.get(fedscale_id)
        if trace is None:
            continue
        finish = float(trace["finish_time"])
        for start, end in zip(trace["active"], trace["inactive"]):
            start, end = max(0.0, float(start)), min(float(end), finish)
            if end > start:
                rows.append((index, start, end, finish))
    return pd.DataFrame(rows, columns=["client", "start", "end", "period"])


def fedscale_ids(capacity: dict) -> list:
    """FedScale's client ids in the order fedrun numbers them 0 .. n - 1 (numbers before strings, each sorted)."""
    return sorted(capacity, key=lambda c: (str(type(c)), c))


FEDSCALE_PASS = 3.0  # FedScale's augmentation_factor: a training sample-pass costs 3 inferences (backward ~ 2x)


def fedscale_profiles(capacity: dict) -> "pd.DataFrame":  # noqa: F821
    """FedScale's device capacities as ``Traced``'s profiles, clients renumbered 0 .. n - 1 in FedScale's id
    order: speed = 3 x computation / 1000 (seconds per training sample-pass, FedScale's own completion time), up =
    down = communication / 8000 (kbps to megabytes per second: FedScale gives one bandwidth for both directions)."""
    import pandas as pd

    ids = fedscale_ids(capacity)
    computation = np.array([capacity[c]["computation"] for c in ids], dtype=np.float64)
    communication = np.array([capacity[c]["communication"] for c in ids], dtype=np.float64)
    bandwidth = communication / 8000.0
    return pd.DataFrame(
        {
            "client": np.arange(len(ids)),
            "speed": FEDSCALE_PASS * computation / 1000.0,
            "up": bandwidth,
            "down": bandwidth,
            "fedscale_id": [str(c) for c in ids],
        }
    )
