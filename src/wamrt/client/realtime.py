"""Real-time chunk execution on the robot's clock: the arm keeps moving while the policy thinks.

`RealtimeRunner` turns a policy that answers an openpi DROID observation with a chunk of action rows into one
joint-target row per control tick (15 Hz). It keeps an action queue keyed by control step; when the current
chunk has run `execute_steps` rows it sends the next observation in the background, and the reply is spliced in
after the rows the arm ran while it was in flight: a reply to an observation of step t that arrives at step
t + d, while the arm ran e <= d committed rows and stood for the other d - e steps (the queue ran dry), replaces
the queue from its row e on. Its rows 0..e-1 are history; rows for steps the arm stood still were never run,
so they are not skipped. At the start of an episode (e = 0) every strategy runs the first chunk from row 0, as
Kinetix's RTC evaluation (whose first chunk is computed before the clock starts) and LeRobot's async client (which
drops rows by the count of actions executed) do: a first chunk entered at its row d would ask a standing arm to
be where d planned steps would have taken it. Strategies:

* `sync`: the arm holds its last target until the reply arrives, then runs the chunk from row 0 (openpi's
  action-chunk broker): every request costs d standing-still steps, and the chunk is d steps stale.
* `async`: naive switch: the arm runs the old chunk while the request is in flight, then jumps to the new
  chunk's row e, which was planned as if the arm had followed the new chunk's rows 0..e-1 (it did not).
* `blend`: as async, but the first d rows after the switch cross-fade linearly from the old chunk to the new one
  (LeRobot's overlap aggregation, with a ramp instead of its constant 0.3 / 0.7 weights, so the first row is
  mostly old and the last mostly new). Over d rows: at d = 0 it is the plain switch. Where the old queue had run
  dry (the first chunk of an episode), the old rows are the arm standing where it stands.
* `prefix`: the request carries the rows the arm is committed to while it is in flight (`action_prefix`, robot
  space, the first of them executed at the observation's own step) and the reply continues from them. With
  `seam_rows` = k, the reply's first k rows after the prefix cross-fade from the rows the arm was committed to
  beyond it (the old chunk's plan) into the reply's own: a continuation that does not quite meet the prefix's
  last row then does not jump (a request that carried no prefix, as at d = 0, has no seam). This is the
  execution-side counterpart of the soft mask RTC applies in denoising.

`binary_gripper` rounds the gripper column of every queued row to 0 or 1 at 0.5, as openpi's DROID client does
before each step. The gripper is a position servo: closed on a cube, it squeezes with the distance between its
target and the cube, so a command of 0.8 holds the cube loosely and a chunk whose far rows hedge between holding
and releasing drops it. The rounded rows are also what a prefix request sends (the rows the arm runs).

The prefix is as long as the delay estimate: a high quantile of recent delays, the warm-up requests left out
(a warm-up spike must not set the estimate forever). Over-estimating is harmless -- a reply that arrives before
the prefix ends is spliced inside the prefix, whose rows equal the old ones -- so the quantile errs high. Where
the queue runs dry before the estimate, the prefix is the rows the queue has: standing rows are never sent (a
policy trained on expert prefixes has never seen an arm stand), and the reply is spliced after the last row the
arm ran, which is where the prefix ends. At the start of an episode nothing is committed and no prefix is sent.

One implementation, two clocks (`wamrt.client.clocks`): `WallClock` runs each request in a background thread
and ticks at the control rate (a real robot, a real server); `SimClock` delivers each reply a seeded number of
steps after its request, so simulated episodes replay bit for bit. No torch here: this runs on a robot PC.
"""

from __future__ import annotations

import inspect
import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .clocks import WallClock

STRATEGIES = ("sync", "async", "blend", "prefix")
PREFIX_KEY = "action_prefix"  # float [d, 8] robot-space rows, 0 <= d <= MAX_PREFIX
PREFIX_MODE_KEY = "action_prefix_mode"  # one of PREFIX_MODES
PREFIX_MODES = ("auto", "clean", "inpaint", "guided")
MAX_PREFIX = 16
JOINT_KEY = "observation/joint_position"
GRIPPER_KEY = "observation/gripper_position"


def request_seed(episode_seed: int, request: int) -> int:
    """Sampling seed of the request-th inference of an episode: a pure function of (episode, request), so two
    runs of one seed draw the same noise request by request (paired gates)."""
    return int(np.random.SeedSequence([episode_seed, request]).generate_state(1)[0] % 2**31)


def chunk_rows(reply: Any) -> np.ndarray:
    """An openpi reply dict (`actions`) or an object with `.actions` -> float32 [n, 8]."""
    actions = reply["actions"] if isinstance(reply, Mapping) else getattr(reply, "actions", reply)
    rows = np.asarray(actions, dtype=np.float32)
    if rows.ndim != 2 or rows.shape[1] != 8 or len(rows) == 0 or not np.isfinite(rows).all():
        raise ValueError(f"policy returned actions of shape {rows.shape}, expected finite [chunk, 8]")
    return rows


def infer_caller(policy: Any, **infer_kwargs: Any) -> Callable[[dict[str, Any], int | None], np.ndarray]:
    """`policy.infer` as `(request, seed) -> rows`: the seed goes as a keyword where `infer` takes one (wamrt's
    Policy, its engine, eval.remote.RemotePolicy), else into the request dict (openpi-client's
    WebsocketClientPolicy; a wamrt server reads `seed` there, others ignore it)."""
    params = inspect.signature(policy.infer).parameters
    takes_seed = "seed" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())

    def call(request: dict[str, Any], seed: int | None) -> np.ndarray:
        if takes_seed:
            return chunk_rows(policy.infer(request, seed=seed, **infer_kwargs))
        if seed is not None:
            request = {**request, "seed": seed}
        return chunk_rows(policy.infer(request, **infer_kwargs))

    return call


class DelayEstimator:
    """Recent request delays (control steps) -> the delay to plan the next request for.

    The first `warmup` requests of a runner are left out (graph capture, connection set-up); the estimate is the
    `quantile` of the last `window` delays, or `initial` before any has been measured."""

    def __init__(self, *, window: int = 10, quantile: float = 0.9, warmup: int = 1, initial: int = 0) -> None:
        if window < 1 or not 0.0 <= quantile <= 1.0 or warmup < 0 or initial < 0:
            raise ValueError("need window >= 1, 0 <= quantile <= 1, warmup >= 0, initial >= 0")
        self.window, self.quantile, self.warmup, self.initial = window, quantile, warmup, initial
        self.reset()

    def reset(self) -> None:
        self.seen = 0
        self.recent: deque[int] = deque(maxlen=self.window)
        self.last_warmup: int | None = None

    def record(self, steps: int) -> None:
        self.seen += 1
        if self.seen > self.warmup:
            self.recent.append(int(steps))
        else:
            self.last_warmup = int(steps)

    def estimate(self) -> int:
        """Until a request past the warm-up has been timed, the last warm-up delay stands in (one request's
        worth of a spike, not a spike kept forever)."""
        if not self.recent:
            return self.initial if self.last_warmup is None else self.last_warmup
        return int(math.ceil(np.quantile(np.asarray(self.recent, dtype=np.float64), self.quantile)))


@dataclass
class Request:
    """One request in flight: what was sent, when, and which prefix it carried."""

    obs: dict[str, Any]
    seed: int | None
    step: int  # control step of the observation (= the step it was sent at)
    index: int  # request number within the episode
    prefix_rows: int
    ran: int = 0  # committed rows the arm ran while this request was in flight (its steps minus standing ones)


@dataclass
class RunnerLog:
    """Per-episode record: one entry per control step, one per request."""

    rows: list[np.ndarray] = field(default_factory=list)  # the row executed at each step
    chunk: list[int] = field(default_factory=list)  # which reply each executed row came from (-1: none yet)
    stalled: list[bool] = field(default_factory=list)  # the queue had no row: the arm held its last target
    delays: list[int] = field(default_factory=list)  # per request: arrival step - observation step
    prefix_rows: list[int] = field(default_factory=list)  # per request: rows sent as action_prefix
    trace: list[str] = field(default_factory=list)  # per request: filled by callers that digest requests
    lost: int = 0  # replies that arrived after every one of their rows was history
    errors: list[str] = field(default_factory=list)  # failed requests (raise_errors=False): the arm went on


class RealtimeRunner:
    """One control tick in, one joint-target row out. `step(obs)` per tick; `obs` is an openpi DROID dict, or a
    zero-argument callable returning one (called only when the tick needs it: a request, or the first hold)."""

    def __init__(self, policy: Any = None, *, strategy: str = "prefix", execute_steps: int = 8,
                 clock: Any = None, prefix_mode: str = "auto", estimator: DelayEstimator | None = None,
                 max_prefix: int = MAX_PREFIX, seeded: bool = True, raise_errors: bool = True,
                 seam_rows: int = 0, binary_gripper: bool = False, **infer_kwargs: Any) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
        if prefix_mode not in PREFIX_MODES:
            raise ValueError(f"prefix_mode must be one of {', '.join(PREFIX_MODES)}, got {prefix_mode!r}")
        if execute_steps < 1 or not 0 <= max_prefix <= MAX_PREFIX or seam_rows < 0:
            raise ValueError(f"need execute_steps >= 1, 0 <= max_prefix <= {MAX_PREFIX} and seam_rows >= 0")
        self.strategy, self.execute_steps, self.prefix_mode = strategy, execute_steps, prefix_mode
        self.seam_rows, self.binary_gripper = seam_rows, binary_gripper
        self.max_prefix, self.seeded, self.raise_errors = max_prefix, seeded, raise_errors
        self.call = infer_caller(policy, **infer_kwargs) if policy is not None else None
        self.clock = clock if clock is not None else WallClock()
        self.estimator = estimator or DelayEstimator()
        self.start(None)

    # ---- episode ---------------------------------------------------------------------------------------
    def start(self, episode_seed: int | None) -> None:
        """A new episode (robot reset): empty queue, request count and log (the log is per episode); the clock
        starts over too. With a seed, request k carries `request_seed(seed, k)` (replayable noise)."""
        self.episode_seed = episode_seed
        self.t = 0
        self.queue = np.zeros((0, 8), np.float32)  # rows for steps queue_start, queue_start + 1, ...
        self.queue_start = 0
        self.queue_chunk = -1
        self.chunk_t0: int | None = None  # the step the current chunk's row 0 belongs to
        self.in_flight: Request | None = None
        self.requests = 0
        self.hold: np.ndarray | None = None  # the last executed row: what the arm keeps when the queue is dry
        self.log = RunnerLog()
        self._obs: Any = None
        self._obs_cached: dict[str, Any] | None = None
        if getattr(self.clock, "replays", False):
            # Simulated time: an episode must not depend on which episodes ran before it on this runner.
            self.estimator.reset()
        self.clock.start(episode_seed)

    # ---- one tick ----------------------------------------------------------------------------------------
    def step(self, obs: Any) -> np.ndarray:
        request = self.begin(obs)
        if request is not None:
            self.dispatch(request)
        self.clock.flush()
        return self.end()

    def begin(self, obs: Any) -> Request | None:
        """First half of a tick: take in a reply that has arrived, and decide whether to send a request now
        (returned, marked in flight, not yet dispatched: `step` dispatches it; a batching harness may instead)."""
        self.clock.tick()  # real time: wait for this control period to start (then read a callable obs)
        self._obs, self._obs_cached = obs, None
        self._take_arrival()
        if self.in_flight is not None or not self._due():
            return None
        prefix = self._prefix() if self.strategy == "prefix" else None
        request = dict(self._observation())
        if prefix is not None and len(prefix):  # no rows committed: the key is left out (= no prefix)
            request[PREFIX_KEY] = prefix
            request[PREFIX_MODE_KEY] = self.prefix_mode
        seeded = self.seeded and self.episode_seed is not None  # start(None): the server draws its own noise
        seed = request_seed(self.episode_seed, self.requests) if seeded else None
        self.in_flight = Request(request, seed, self.t, self.requests, 0 if prefix is None else len(prefix))
        self.log.prefix_rows.append(self.in_flight.prefix_rows)
        self.requests += 1
        return self.in_flight

    def dispatch(self, request: Request) -> None:
        if self.call is None:
            raise RuntimeError("this runner has no policy: dispatch its requests yourself (clock.submit)")
        call = self.call
        self.clock.submit(request, lambda: call(request.obs, request.seed))

    def end(self) -> np.ndarray:
        """Second half of a tick: a reply due now (delay 0) is spliced, then the row for this step is returned."""
        self._take_arrival()
        t = self.t
        k = t - self.queue_start
        if 0 <= k < len(self.queue):
            row, stalled = self.queue[k], False
            self.hold = row
        else:
            row, stalled = self._hold_row(), True
        if self.in_flight is not None and not stalled:
            self.in_flight.ran += 1
        self.log.rows.append(row.copy())
        held_from = self.log.chunk[-1] if self.log.chunk else -1  # a held row belongs to the chunk it ended
        self.log.chunk.append(held_from if stalled else self.queue_chunk)
        self.log.stalled.append(stalled)
        self.t += 1
        return row.copy()

    # ---- internals ---------------------------------------------------------------------------------------
    def _observation(self) -> dict[str, Any]:
        if self._obs_cached is None:
            obs = self._obs() if callable(self._obs) else self._obs
            if not isinstance(obs, Mapping):
                raise TypeError(f"observation must be a dict (openpi DROID keys), got {type(obs).__name__}")
            self._obs_cached = dict(obs)
        return self._obs_cached

    def _hold_row(self) -> np.ndarray:
        if self.hold is None:  # nothing executed yet: hold the measured pose, gripper as it is
            obs = self._observation()
            joints = np.asarray(obs[JOINT_KEY], dtype=np.float32).reshape(7)
            self.hold = np.r_[joints, np.float32(obs[GRIPPER_KEY])].astype(np.float32)
        return self.hold

    def _due(self) -> bool:
        """A request goes out when the current chunk has run `execute_steps` rows, or the queue is dry."""
        if self.chunk_t0 is None or self.t - self.queue_start >= len(self.queue):
            return True
        return self.t - self.chunk_t0 >= self.execute_steps

    def _ahead(self) -> np.ndarray:
        """The queued rows from this step on (a view; empty where the queue has run dry)."""
        k = self.t - self.queue_start
        return self.queue[k:] if 0 <= k < len(self.queue) else self.queue[:0]

    def _prefix(self) -> np.ndarray:
        """The queued rows the arm will run while the request is in flight: as many as the delay estimate, or as
        the queue has (never standing rows: the reply is spliced after the last row the arm ran)."""
        return self._ahead()[: min(self.estimator.estimate(), self.max_prefix)].copy()

    def _committed(self, n: int) -> np.ndarray:
        """The next n rows the arm runs from this step on without a new chunk: the queue's, then -- where it runs
        dry first -- its last row held (a standing arm is committed to standing)."""
        ahead = self._ahead()
        if len(ahead) >= n:
            return ahead[:n].copy()
        last = ahead[-1] if len(ahead) else self._hold_row()
        return np.concatenate([ahead, np.repeat(last[None], n - len(ahead), axis=0)]).astype(np.float32)

    def _take_arrival(self) -> None:
        if self.in_flight is None:
            return
        reply = self.clock.arrived(self.t)
        if reply is None:
            return
        request, self.in_flight = self.in_flight, None
        try:
            if isinstance(reply, BaseException):
                raise reply
            rows = chunk_rows(reply)
        except Exception as e:
            if self.raise_errors:
                raise
            self.log.errors.append(f"request {request.index}: {type(e).__name__}: {e}")
            return  # the arm goes on with what it has; the next tick asks again
        delay = self.t - request.step
        self.estimator.record(delay)
        self.log.delays.append(delay)
        self._splice(rows, request, delay)

    def _splice(self, rows: np.ndarray, request: Request, delay: int) -> None:
        t = self.t
        if self.strategy == "sync":  # the arm waited: the chunk runs from its row 0, now
            self.queue, self.queue_start, self.chunk_t0 = rows[: self.execute_steps].copy(), t, t
        else:
            new = rows[request.ran:].copy()  # the arm ran `ran` rows of the old plan; it stood the rest
            if len(new) == 0:
                self.log.lost += 1
            if self.strategy == "blend" and len(new):
                self._cross_fade(new, 0, min(delay, len(new)), delay + 1)
            elif self.strategy == "prefix" and self.seam_rows and request.prefix_rows and len(new):
                k = max(0, request.prefix_rows - request.ran)  # rows still inside the prefix equal the committed
                n = min(self.seam_rows, len(new) - k)
                self._cross_fade(new, k, n, n + 1)
            self.queue, self.queue_start, self.chunk_t0 = new, t, t - request.ran
        if self.binary_gripper:  # after any cross-fade: a faded gripper is as loose as a hedged one
            self.queue[:, 7] = (self.queue[:, 7] > 0.5).astype(np.float32)
        self.queue_chunk = request.index

    def _cross_fade(self, new: np.ndarray, k: int, n: int, steps: int) -> None:
        """new[k:k+n] := (1 - w) * what the arm was committed to + w * new, w = 1/steps .. n/steps (blend, seam)."""
        if n <= 0:
            return
        old = self._committed(k + n)[k:]  # what the arm would run without the reply (a standing arm: standing)
        w = (np.arange(1, n + 1, dtype=np.float32) / steps)[:, None]
        new[k:k + n] = (1.0 - w) * old + w * new[k:k + n]

    # ---- read-outs -----------------------------------------------------------------------------------------
    def delay_estimate(self) -> int:
        return self.estimator.estimate()
