from vattn.conformance.identity import compare
from vattn.conformance.models import check_not_degenerate
from vattn.conformance.protocol import RunResult


def _run(ids, lps=None):
    return RunResult(token_ids=ids, logprobs=lps, seconds=1.0, num_prompt_tokens=0,
                     num_generated_tokens=sum(map(len, ids)))


def test_exact_match_passes():
    rep = compare(_run([[1, 2, 3], [4, 5]]), _run([[1, 2, 3], [4, 5]]))
    assert rep.ok and rep.exact and rep.exact_match_rate == 1.0
    assert rep.first_divergence == [None, None]


def test_real_mismatch_fails():
    base = _run([[1, 2, 3]], [[{1: -0.1}, {2: -0.1, 9: -5.0}, {3: -0.1}]])
    cand = _run([[1, 9, 3]], [[{1: -0.1}, {9: -0.1, 2: -5.0}, {3: -0.1}]])
    rep = compare(base, cand)
    assert not rep.ok and rep.first_divergence == [1]
    assert rep.mismatches[0]["position"] == 1 and rep.worst_gap > 4


def test_near_tie_accepted_unless_exact_required():
    base = _run([[1, 2, 7]], [[{1: -0.1}, {2: -0.70, 9: -0.72}, {7: -0.1}]])
    cand = _run([[1, 9, 8]], [[{1: -0.1}, {9: -0.70, 2: -0.71}, {8: -0.1}]])
    assert compare(base, cand).ok
    assert compare(base, cand).near_ties == 1
    assert not compare(base, cand, require_exact=True).ok


def test_divergence_without_logprobs_fails():
    assert not compare(_run([[1, 2]]), _run([[1, 3]])).ok


def test_length_difference_is_divergence():
    rep = compare(_run([[1, 2, 3]]), _run([[1, 2]]))
    assert rep.first_divergence == [2] and not rep.ok


def test_degenerate_outputs_fail():
    cycle = [[5, 6] * 8 for _ in range(10)]
    assert not check_not_degenerate(cycle)["ok"]
    varied = [[i, i + 1, i + 2, i * 3 % 7, 9, 10, 11, 12] for i in range(10)]
    assert check_not_degenerate(varied)["ok"]


class _TopkRunner:
    """A runner whose full distribution at any prefix is fixed (tokens 2 and 9 nearly tied)."""

    def __init__(self, dist):
        self.dist, self.asked = dist, []

    def topk_logprobs(self, prompt, k=5):
        self.asked.append(list(prompt))
        return dict(list(self.dist.items())[:k])


def test_divergence_logprobs_filled_from_runner():
    from vattn.conformance.identity import fill_divergence_logprobs
    base = _run([[1, 2, 7], [4, 5]], [[{1: -0.1}, {2: -0.7}, {7: -0.1}], [{4: -0.1}, {5: -0.1}]])
    cand = _run([[1, 9, 8], [4, 5]], [[{1: -0.1}, {9: -0.7}, {8: -0.1}], [{4: -0.1}, {5: -0.1}]])
    assert not compare(base, cand).ok  # only the chosen token's log-prob: no near-tie can be judged
    runner = _TopkRunner({2: -0.70, 9: -0.72, 3: -3.0})
    assert fill_divergence_logprobs(runner, [[11, 12], [13]], {"stock": base, "vattn": cand}, "stock") == 1
    assert runner.asked == [[11, 12, 1]]  # prompt + the common prefix
    rep = compare(base, cand, max_gap=0.1)
    assert rep.ok and rep.near_ties == 1
    far = _TopkRunner({2: -0.1, 3: -3.0, 9: -4.0})
    base.logprobs[0][1], cand.logprobs[0][1] = {2: -0.7}, {9: -0.7}
    fill_divergence_logprobs(far, [[11, 12], [13]], {"stock": base, "vattn": cand}, "stock")
    assert not compare(base, cand, max_gap=0.1).ok


def test_schedule_difference_finds_the_first_differing_step():
    """Two engines' recorded schedules (``[(prompt index, tokens), ...]`` per step): equal ones
    give ``{}``, the first step that batches other tokens is named, a missing record is unknown."""
    from vattn.conformance.workers.vllm import _by_prompt, schedule_difference

    class Out:
        def __init__(self, rid):
            self.request_id = rid

    a = _by_prompt([[("r7", 300), ("r8", 200)], [("r7", 1), ("r8", 1)]], [Out("r7"), Out("r8")])
    b = _by_prompt([[("x1", 200), ("x0", 300)], [("x0", 1), ("x1", 1)]], [Out("x0"), Out("x1")])
    assert a == b == [[(0, 300), (1, 200)], [(0, 1), (1, 1)]]   # ids differ, prompts do not
    assert schedule_difference(a, b) == {}
    c = [a[0], [(0, 1)], [(1, 1)]]                               # request 1 decoded a step later
    assert schedule_difference(a, c) == {"step": 1, "a": a[1], "b": [(0, 1)]}
    assert schedule_difference(a, a + [[(0, 1)]]) == {"step": 2, "a": [], "b": [[(0, 1)]]}
    assert schedule_difference(a, None) is None


def test_generation_counters_keep_totals_of_histograms_and_counts():
    from vattn.conformance.workers.vllm import generation_counters
    m = {"apply_step_us": {"count": 4, "mean_us": 250.0}, "apply_device_wait_us": {"count": 4, "mean_us": 50.0},
         "pages_aliased": 64, "map_calls": 80, "unmap_calls": 3, "page_sets_staged": 0, "other": 1}
    assert generation_counters(m) == {"apply_ms": 1.0, "device_wait_ms": 0.2, "pages_aliased": 64,
                                      "map_calls": 80, "unmap_calls": 3, "page_sets_staged": 0}
    assert generation_counters({"error": "rpc failed"}) is None and generation_counters(None) is None
    assert generation_counters({"pages_aliased": 1})["device_wait_ms"] is None   # not recorded
