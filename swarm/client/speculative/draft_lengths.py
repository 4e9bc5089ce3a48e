"""How many drafts a speculative trip carries (``swarm.client.speculative.loop``): pure, driven by the measurements the
decode loop feeds it, so it is tested with made-up trips."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Rate:
    """Decayed counts of one kind of draft's kept tokens and rejections (a prior of a = 1/3)."""

    kept: float = 0.5
    rejected: float = 1.0
    quiet: int = 0  # trips this kind was not drafted since it last was
    gap: int = 0  # quiet trips before a probe (doubled by each probe that fails, so a dead end costs less and less)

    @property
    def value(self) -> float:
        return self.kept / (self.kept + self.rejected)


@dataclass
class Lengths:
    """How many drafts the next trip carries: the k of 0..``max_k`` with the most tokens per second expected from
    this session's measurements. With acceptance rate a, a trip of k drafts yields (1 - a^(k+1)) / (1 - a) tokens.
    A trip of one position takes t1; of n >= 2, t2 + s (n - 2): on CPUs the step from one position to two costs far
    more than each one after (one-row products take a faster path), so the two are fitted apart (decayed means and
    least squares), and g, the drafter's time per token, adds to each draft. Acceptance is kept per kind of draft
    (the n-gram drafter's by the length of its match, a model drafter's as one), so a run of long matches is
    drafted far while single-token guesses are not.

    ``fixed``: always that many (the drafter may offer fewer). A kind chosen 0 is still drafted 1 after ``probe``
    quiet trips, so it is noticed when the text turns predictable; each probe that fails doubles the wait (up to
    ``max_gap``). The first trip carries none: it measures t1; the first that would carry none after it carries a
    stand-in draft (the last token again, not scored) to measure t2."""

    max_k: int = 8
    fixed: int | None = None
    probe: int = 8
    max_gap: int = 256
    decay: float = 0.8  # of acceptance counts and trip times, per trip: text turns from free to copied and back
    prior_jump: float = 0.5  # t2 - t1 before a trip of several positions is measured, as a share of t1
    prior_slope: float = 0.05  # s before the multi-position trips' lengths vary, as a share of t1
    margin: float = 1.1  # drafting must promise this many times plain decoding's tokens per second
    draft_s: float = 0.0  # the drafter's seconds per drafted token (EMA)
    rates: dict[str, Rate] = field(default_factory=dict)
    _one: list[float] = field(default_factory=lambda: [0.0, 0.0])  # decayed w, w t of one-position trips
    _many: list[float] = field(default_factory=lambda: [0.0] * 5)  # decayed w, w n, w t, w n^2, w n t of the rest

    def rate(self, kind: str = "") -> float:
        return self.rates.get(kind, Rate()).value

    def unmeasured(self) -> bool:
        """Whether a one-position trip was timed and no trip of more positions yet (then t2 is only a guess)."""
        return self.fixed is None and self._one[0] > 0 and self._many[0] <= 0

    def trip(self, positions: int, seconds: float, drafted: int, kept: int, kind: str = "") -> None:
        """A trip of ``positions`` took ``seconds``; of its ``drafted`` drafts (of ``kind``), ``kept`` were kept."""
        if drafted:
            r = self.rates.setdefault(kind, Rate())
            r.kept = r.kept * self.decay + kept
            r.rejected = r.rejected * self.decay + (1.0 if kept < drafted else 0.0)
            r.gap = self.probe if kept else min(max(r.gap, self.probe) * 2, self.max_gap)
        if positions == 1:
            self._one = [self._one[0] * self.decay + 1.0, self._one[1] * self.decay + seconds]
            return
        s = self._many
        for j, v in enumerate((1.0, positions, seconds, positions * positions, positions * seconds)):
            s[j] = s[j] * self.decay + v

    def drafted(self, tokens: int, seconds: float) -> None:
        if tokens:
            per = seconds / tokens
            self.draft_s = per if self.draft_s == 0.0 else 0.8 * self.draft_s + 0.2 * per

    def cost(self) -> tuple[float, float, float]:
        """(t1, t2, s) as fitted so far (t1 from the trips of several positions where none had one)."""
        w1, wt1 = self._one
        w, wn, wt, wnn, wnt = self._many
        t1 = wt1 / w1 if w1 > 0 else (wt / w if w > 0 else 1.0)
        if w <= 0:
            return t1, t1 * (1.0 + self.prior_jump), t1 * self.prior_slope
        mean_n, mean_t = wn / w, wt / w
        spread, co = wnn - w * mean_n * mean_n, wnt - w * mean_n * mean_t
        slope = max((co + self.prior_slope * t1) / (spread + 1.0), 0.0)  # one pseudo-trip of the prior slope
        return t1, max(mean_t - slope * (mean_n - 2.0), 1e-6), slope

    def choose(
        self,
        kind: str = "",
        draft_s: float | None = None,
        behind: float = 0.0,
        remaining: int = 1 << 30,
        prior: float = 1.0 / 3.0,
    ) -> int:
        """Drafts for the next trip, of ``kind``: ``draft_s`` their cost per token (default: the one measured),
        ``behind`` what the drafter needs first to catch up (drafting only if the ``remaining`` tokens repay it),
        ``prior`` their expected acceptance until one is measured."""
        if self.fixed is not None:
            return self.fixed
        if self._one[0] + self._many[0] <= 0:
            return 0
        t1, t2, slope = self.cost()
        g = self.draft_s if draft_s is None else draft_s
        r = self.rates.setdefault(kind, Rate(kept=2.0 * prior, rejected=2.0 * (1.0 - prior)))
        a = min(r.value, 0.999)
        best, best_rate = 0, self.margin / t1
        for k in range(1, self.max_k + 1):
            rate = (1.0 - a ** (k + 1)) / (1.0 - a) / (t2 + slope * (k - 1) + g * k)
            if rate > best_rate:
                best, best_rate = k, rate
        if best and behind > remaining * (t1 - 1.0 / best_rate):  # catching up costs more than it would save
            best = 0
        if best:
            r.quiet = 0
            return best
        r.quiet += 1
        if r.quiet >= max(r.gap, self.probe) and behind <= t1:  # a probe that would cost a trip's time waits
            r.quiet = 0
            return 1
        return 0
