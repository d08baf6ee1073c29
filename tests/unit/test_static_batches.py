from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tests.bench import static_batches as batching
from tests.bench.static_batches import Cost


def _costs(inputs: list[int], new: int = 64) -> list[Cost]:
    return [Cost(i, new) for i in inputs]


def test_similar_costs_are_grouped_and_caps_hold() -> None:
    costs = _costs([100, 2000, 100, 2000, 100, 2000])
    groups = batching.form_batches(costs, max_jobs=3, token_budget=10_000)
    assert [sorted(g) for g in groups] == [[0, 2, 4], [1, 3, 5]]


def test_budget_splits_batches_and_a_lone_giant_still_runs() -> None:
    groups = batching.form_batches(_costs([536, 536, 536, 4936]), max_jobs=8, token_budget=1500)
    assert groups == [[0, 1], [2], [3]]


def test_padding_is_bounded_so_unequal_inputs_do_not_share_a_batch() -> None:
    # ~1,780 and ~2,360 tokens shared a batch before (25 % of its prefill was padding).
    costs = _costs([1780, 2360, 1780, 2360, 1790])
    groups = batching.form_batches(costs, max_jobs=8, token_budget=100_000, max_waste=0.10)
    assert [sorted(g) for g in groups] == [[0, 2, 4], [1, 3]]
    assert all(batching.waste([costs[i].input_tokens for i in g]) <= 0.10 for g in groups)


def test_a_long_generation_never_makes_its_neighbours_decode_for_it() -> None:
    costs = [Cost(1000, 16), Cost(1000, 512), Cost(1000, 16), Cost(1000, 500)]
    groups = batching.form_batches(costs, max_jobs=8, token_budget=100_000, max_waste=0.10)
    assert [sorted(g) for g in groups] == [[0, 2], [1, 3]]


def test_equal_jobs_sit_together_and_far_ones_never_meet() -> None:
    costs = _costs([1326] * 4 + [2340] * 4 + [1260] * 4)
    groups = batching.form_batches(costs, max_jobs=8, token_budget=100_000, max_waste=0.10)
    assert [sorted(costs[i].input_tokens for i in g) for g in groups] == [
        [1260] * 4 + [1326] * 4,  # 2.5 % padding: within the bound, one model call saved
        [2340] * 4,
    ]


@given(
    st.lists(st.tuples(st.integers(1, 3000), st.integers(1, 512)), max_size=40),
    st.integers(1, 16),
    st.integers(1, 40_000),
    st.sampled_from([0.0, 0.1, 0.5, 1.0]),
)
def test_every_job_lands_in_exactly_one_batch_within_every_bound(
    jobs: list[tuple[int, int]], max_jobs: int, budget: int, max_waste: float
) -> None:
    costs = [Cost(i, n) for i, n in jobs]
    groups = batching.form_batches(costs, max_jobs, budget, max_waste)
    assert sorted(i for g in groups for i in g) == list(range(len(costs)))
    for group in groups:
        members = [costs[i] for i in group]
        assert len(group) == 1 or batching.fits(members, max_jobs, budget, max_waste)


def test_waste() -> None:
    assert batching.waste([10, 10]) == 0.0
    assert batching.waste([5, 10]) == 0.25
    assert batching.waste([]) == 0.0


def test_interactive_jobs_get_the_first_model_batches() -> None:
    costs = _costs([100, 900, 100, 100, 900, 100])
    lanes = [1, 0, 1, 1, 0, 1]  # 0 = interactive, 1 = backlog
    groups = batching.form_batches_by_lane(costs, lanes, max_jobs=8, token_budget=100_000)
    assert groups == [[1, 4], [0, 2, 3, 5]]


@given(st.lists(st.tuples(st.integers(1, 3000), st.integers(0, 1)), max_size=40), st.integers(1, 16))
def test_by_lane_keeps_every_job_once_and_lanes_in_order(jobs: list[tuple[int, int]], max_jobs: int) -> None:
    costs, lanes = _costs([c for c, _ in jobs]), [lane for _, lane in jobs]
    groups = batching.form_batches_by_lane(costs, lanes, max_jobs, 20_000, 0.1)
    assert sorted(i for g in groups for i in g) == list(range(len(jobs)))
    order = [lanes[g[0]] for g in groups]
    assert order == sorted(order)
    assert all(len({lanes[i] for i in g}) == 1 for g in groups)


def test_a_measured_cap_per_input_length_bounds_each_batch() -> None:
    """Long inputs capped at 1 (a compute-bound prefill), short ones at 4: neither rule leaks."""
    costs = [Cost(100, 16)] * 6 + [Cost(2000, 16)] * 3
    groups = batching.form_batches(costs, lambda inputs: 1 if max(inputs) > 1000 else 4, 10**6, max_waste=0.1)
    assert sorted(len(g) for g in groups) == [1, 1, 1, 2, 4]
    for group in groups:
        if any(costs[i].input_tokens > 1000 for i in group):
            assert len(group) == 1
