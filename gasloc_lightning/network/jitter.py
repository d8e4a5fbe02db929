"""Per-step compute jitter: heavy-tailed noise on every inner step, and transient slowdowns.

A real worker's step time is not constant: kernels, data loading and neighbours on a shared host add
noise with a long tail, and now and then a worker runs several times slower for a while (a noisy
neighbour, thermal throttling, a failing disk). :class:`ComputeJitter` gives the multiplier of step k
of rank r as a pure function of ``(seed, rank, k)``, so every engine (the strategies' clocks, one per
process, and the simulator's, all in one) draws the same times without sharing a generator:

* noise: ``1 + tail_scale * (U^(-1/tail_index) - 1)``, U uniform in (0, 1]: a Lomax (Pareto II)
  excess with tail index alpha = ``tail_index`` (heavier for a smaller alpha; mean
  ``tail_scale / (alpha - 1)`` above 1 for alpha > 1);
* slowdown: time is cut into episodes of ``slowdown_steps`` inner steps; in each, a rank is slowed
  with probability ``slowdown_probability``, by a factor drawn uniformly in
  ``[slowdown_min, slowdown_max]`` (2-5x by default) for the whole episode.

The uniforms come from a counter-based hash (splitmix64), not from a generator's state: step k's
time does not depend on how many steps other ranks took, and a clock restored from a checkpoint
draws the same times.
"""

from __future__ import annotations

from gasloc_lightning.network.validation import _non_negative, _positive_finite, _positive_int

_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _uniform(*keys: int) -> float:
    """A uniform in (0, 1] from integer keys (deterministic, independent across keys)."""
    h = 0
    for key in keys:
        h = _splitmix64(h ^ (key & _MASK))
    return ((h >> 11) + 1) / float(1 << 53)


class ComputeJitter:
    """Multiplier of every inner step's time: heavy-tailed noise times transient slowdowns.

    Args:
        tail_scale: s, the scale of the per-step noise, >= 0 (0: no noise).
        tail_index: alpha, the tail index of the noise, > 0 (smaller: heavier tail; the mean exists for alpha > 1).
        slowdown_probability: p, the chance that a rank is slowed during one episode, in [0, 1].
        slowdown_min, slowdown_max: the range of a slowdown's factor, 1 <= min <= max.
        slowdown_steps: episode length in inner steps, >= 1 (a slowdown lasts one episode).
        seed: seed of the draws.
    """

    def __init__(
        self,
        *,
        tail_scale: float = 0.1,
        tail_index: float = 2.5,
        slowdown_probability: float = 0.05,
        slowdown_min: float = 2.0,
        slowdown_max: float = 5.0,
        slowdown_steps: int = 20,
        seed: int = 0,
    ) -> None:
        self.tail_scale = _non_negative("tail_scale", tail_scale)
        self.tail_index = _positive_finite("tail_index", tail_index)
        probability = _non_negative("slowdown_probability", slowdown_probability)
        if probability > 1:
            raise ValueError(f"slowdown_probability must lie in [0, 1], got {slowdown_probability!r}")
        self.slowdown_probability = probability
        low, high = _positive_finite("slowdown_min", slowdown_min), _positive_finite("slowdown_max", slowdown_max)
        if not 1.0 <= low <= high:
            raise ValueError(f"slowdown_min and slowdown_max must satisfy 1 <= min <= max, got {low!r}, {high!r}")
        self.slowdown_min, self.slowdown_max = low, high
        self.slowdown_steps = _positive_int("slowdown_steps", slowdown_steps)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.seed = seed

    def __repr__(self) -> str:
        return (f"ComputeJitter(tail_scale={self.tail_scale}, tail_index={self.tail_index}, "
                f"slowdown_probability={self.slowdown_probability}, slowdown=[{self.slowdown_min}, "
                f"{self.slowdown_max}] x {self.slowdown_steps} steps, seed={self.seed})")

    def noise(self, rank: int, step: int) -> float:
        """The heavy-tailed factor of step ``step`` of ``rank`` (>= 1)."""
        if self.tail_scale == 0.0:
            return 1.0
        u = _uniform(self.seed, 1, rank, step)
        return 1.0 + self.tail_scale * (u ** (-1.0 / self.tail_index) - 1.0)

    def slowdown(self, rank: int, step: int) -> float:
        """The slowdown factor of ``rank`` during the episode holding step ``step`` (1: not slowed)."""
        if self.slowdown_probability == 0.0:
            return 1.0
        episode = step // self.slowdown_steps
        if _uniform(self.seed, 2, rank, episode) > self.slowdown_probability:
            return 1.0
        u = _uniform(self.seed, 3, rank, episode)
        return self.slowdown_min + (self.slowdown_max - self.slowdown_min) * u

    def factor(self, rank: int, step: int) -> float:
        """The multiplier of the time of step ``step`` (counted from 0) of ``rank``: noise x slowdown."""
        return self.noise(rank, step) * self.slowdown(rank, step)
