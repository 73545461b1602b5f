"""Token identity between a baseline run and a candidate run.

Exact match is expected when both sides use the same kernel family. Otherwise a divergence
is accepted only at a near-tie: at the first differing position each side's token is in the
other's top-k with a log-prob gap below ``max_gap`` (the convention of vLLM's
``check_logprobs_close``). After a near-tie the two continuations are unrelated, so only the
first divergence of each prompt is judged.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .protocol import RunResult

__all__ = ["IdentityReport", "compare", "fill_divergence_logprobs"]


@dataclass
class IdentityReport:
    ok: bool
    exact: bool
    exact_match_rate: float          # fraction of prompts with identical outputs
    token_match_rate: float          # fraction of positions equal before each first divergence
    first_divergence: list[int | None]
    near_ties: int
    mismatches: list[dict] = field(default_factory=list)
    worst_gap: float = 0.0
    gaps: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def compare(base: RunResult, cand: RunResult, *, require_exact: bool = False,
            max_gap: float = 0.1) -> IdentityReport:
    """Compare ``cand`` against ``base`` prompt by prompt.

    Parameters
    ----------
    base, cand
        Runs of the same prompts; ``logprobs`` are needed to accept near-ties.
    require_exact
        Any divergence fails (same kernel family on both sides).
    max_gap
        Largest accepted ``|logprob(a) - logprob(b)|`` at a divergence (nats).
    """
    firsts, gaps, mismatches, near, matched, compared = [], [], [], 0, 0, 0
    for i, (a, b) in enumerate(zip(base.token_ids, cand.token_ids)):
        pos = _first_divergence(a, b)
        firsts.append(pos)
        upto = min(len(a), len(b)) if pos is None else pos
        matched += upto
        compared += max(len(a), len(b)) if pos is None else pos + 1
        if pos is None:
            continue
        gap = _tie_gap(base, cand, i, pos)
        if gap is not None:
            gaps.append(gap)
        if require_exact or gap is None or gap > max_gap:
            mismatches.append({"prompt": i, "position": pos, "base": _at(a, pos), "cand": _at(b, pos),
                               "gap": gap})
        else:
            near += 1
    n = max(len(base.token_ids), 1)
    exact_rate = sum(p is None for p in firsts) / n
    ok = not mismatches and len(base.token_ids) == len(cand.token_ids)
    return IdentityReport(ok=ok, exact=exact_rate == 1.0, exact_match_rate=exact_rate,
                          token_match_rate=matched / max(compared, 1), first_divergence=firsts,
                          near_ties=near, mismatches=mismatches, worst_gap=max(gaps, default=0.0),
                          gaps=gaps)


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for pos, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return pos
    return None if len(a) == len(b) else min(len(a), len(b))


def _at(ids: list[int], pos: int) -> int | None:
    return ids[pos] if pos < len(ids) else None


def _tie_gap(base: RunResult, cand: RunResult, i: int, pos: int) -> float | None:
    """Gap between the two chosen tokens if each is in the other's top-k, else None."""
    if base.logprobs is None or cand.logprobs is None:
        return None
    if pos >= len(base.logprobs[i]) or pos >= len(cand.logprobs[i]):
        return None
    la, lb = base.logprobs[i][pos], cand.logprobs[i][pos]
    ta, tb = base.token_ids[i][pos], cand.token_ids[i][pos]
    if tb not in la or ta not in lb:
        return None
    return max(abs(la[ta] - la[tb]), abs(lb[tb] - lb[ta]))


def fill_divergence_logprobs(runner, prompts: list[list[int]], results: dict[str, RunResult],
                             baseline: str, *, k: int = 5) -> int:
    """Put top-``k`` log-probs at each first divergence, for engines that return fewer.

    Uses the runner's optional ``topk_logprobs(prompt_ids, k) -> {token: logprob}`` (a plain
    forward of the baseline model on the prompt plus the common prefix). Both sides share that
    prefix, so the one distribution is stored in both runs at that position; :func:`compare` then
    accepts the divergence only if each chosen token is in it within ``max_gap``.

    Returns
    -------
    int
        How many positions were filled (0 when the runner has no ``topk_logprobs``).
    """
    topk = getattr(runner, "topk_logprobs", None)
    base = results[baseline]
    if topk is None or base.logprobs is None:
        return 0
    filled: dict[tuple[int, int], dict] = {}
    for mode, cand in results.items():
        if mode == baseline or cand.logprobs is None:
            continue
        for i, (a, b) in enumerate(zip(base.token_ids, cand.token_ids)):
            pos = _first_divergence(a, b)
            if pos is None or pos >= min(len(a), len(b)):
                continue
            if (i, pos) not in filled:
                filled[i, pos] = topk(list(prompts[i]) + list(a[:pos]), k)
            base.logprobs[i][pos] = cand.logprobs[i][pos] = filled[i, pos]
    return len(filled)
