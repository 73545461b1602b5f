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
