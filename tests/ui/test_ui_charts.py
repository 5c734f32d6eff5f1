"""What the run-health charts encode, checked on their Vega-Lite specs (no browser needed)."""

from __future__ import annotations

import pandas as pd
import pytest

from ui import charts


def rows(spec: dict, part: dict) -> list[dict]:
    """The data rows `part` of `spec` draws (Altair keeps frames in the spec's datasets)."""
    return spec["datasets"][part["data"]["name"]]


def test_the_loss_chart_puts_checkpoints_on_its_floor_and_events_across_it() -> None:
    points = pd.DataFrame(
        {
            "step": [1, 2, 3],
            "loss": [3.0, 2.0, 1.5],
            "loss_min": [2.9, 1.9, 1.4],
            "loss_max": [3.1, 2.1, 1.6],
        }
    )
    markers = pd.DataFrame(
        {"step": [2, 3], "kind": ["checkpoint", "sdc"], "label": ["checkpoint of step 2", "flip"]}
    )
    spec = charts.loss_chart(points, markers).to_dict()
    _, _, floor, rules = spec["layer"]
    assert [part["mark"]["type"] for part in spec["layer"]] == ["area", "line", "point", "rule"]
    assert floor["mark"]["shape"] == "triangle-up"
    # 3% of the drawn range (1.4 to 3.1) above its floor.
    assert [(row["step"], row["at"]) for row in rows(spec, floor)] == [(2, pytest.approx(1.451))]
    assert [(row["step"], row["kind"]) for row in rows(spec, rules)] == [(3, "sdc")]


def test_the_heatmap_colours_each_rank_relative_to_the_median_rank_of_its_step() -> None:
    steps = pd.DataFrame(
        [(step, rank, 0.2 if rank == 3 else 0.1) for step in (1, 2) for rank in range(5)],
        columns=["step", "rank", "compute_s"],
    )
    spec = charts.rank_heatmap(steps, "compute_s").to_dict()
    relative = {(row["step"], row["rank"]): row["relative"] for row in rows(spec, spec)}
    assert relative[(1, 3)] == relative[(2, 3)] == 2.0
    assert relative[(1, 0)] == relative[(2, 4)] == 1.0


def test_the_loss_chart_draws_the_validation_loss_beside_the_training_loss() -> None:
    points = pd.DataFrame(
        {
            "step": [1, 2, 3],
            "loss": [3.0, 2.0, 1.5],
            "loss_min": [2.9, 1.9, 1.4],
            "loss_max": [3.1, 2.1, 1.6],
        }
    )
    markers = pd.DataFrame(columns=["step", "kind", "label"])
    evals = pd.DataFrame({"step": [2, 3], "eval_loss": [2.4, 1.9]})
    spec = charts.loss_chart(points, markers, evals).to_dict()
    validation = spec["layer"][-1]
    assert validation["mark"]["strokeDash"] and validation["encoding"]["y"]["field"] == "eval_loss"
    assert [(row["step"], row["eval_loss"]) for row in rows(spec, validation)] == [
        (2, 2.4), (3, 1.9)
    ]  # fmt: skip
    without = charts.loss_chart(points, markers, evals.iloc[:0]).to_dict()
    assert len(without["layer"]) == 4


def test_the_throughput_chart_shows_the_ranks_only_where_an_elastic_job_changed_size() -> None:
    points = pd.DataFrame(
        {"step": [1, 2, 3, 4], "tokens_per_s": [900.0, 910.0, 700.0, 905.0], "ranks": [6, 6, 4, 6]}
    )
    spec = charts.throughput_chart(points).to_dict()
    tokens, ranks = spec["layer"]
    assert tokens["encoding"]["y"]["field"] == "tokens_per_s"
    assert spec["resolve"] == {"scale": {"y": "independent"}}
    assert ranks["encoding"]["y"]["field"] == "ranks"
    assert ranks["mark"]["interpolate"] == "step-after"
    assert [row["ranks"] for row in rows(spec, spec)] == [6, 6, 4, 6]  # the layers share it
    fixed = charts.throughput_chart(points.assign(ranks=6)).to_dict()
    assert "layer" not in fixed and fixed["encoding"]["y"]["field"] == "tokens_per_s"
