"""Altair charts of the run-health page, built from `telemetry.views` frames (pure functions, so
tests can check what a chart encodes without a browser)."""

from __future__ import annotations

import altair as alt
import pandas as pd

from telemetry.detect import StragglerPolicy
from telemetry.views.nodes import PHASE_COLUMNS

# One colour per marker kind, the same on every chart and in the legend.
MARKER_COLOURS = {
    "checkpoint": "#2ca02c",
    "restart": "#7f7f7f",
    "loss_spike": "#ff7f0e",
    "sdc": "#d62728",
    "replay": "#9467bd",
    "quarantine": "#8c564b",
    "recovery": "#e377c2",
}
# The validation loss beside the training loss.
EVAL_COLOUR = "#17becf"
PHASE_LABELS = {
    "data_s": "data",
    "forward_s": "forward",
    "backward_s": "backward",
    "optimizer_s": "optimizer",
    "comm_wait_s": "communication wait",
}


def loss_chart(
    points: pd.DataFrame,
    markers: pd.DataFrame,
    evals: pd.DataFrame | None = None,
    recoveries: pd.DataFrame | None = None,
) -> alt.LayerChart:
    """Mean loss over ranks as a line over the min-max band of the ranks, and the validation
    loss (`views.run.eval_points`) as a dashed line with a point per evaluation. Restarts, loss
    spikes, SDC events and replays are vertical rules; checkpoints, which may be hundreds, are
    triangles along the bottom so that they never hide the curve; each fault's recovery
    (`views.run.recoveries`) is a band over the steps it spans (those it lost, or those it
    lasted), so that a recovery shows where on the curve its time went. Colours by kind, one
    legend for all."""
    base = alt.Chart(points).encode(
        x=alt.X("step:Q", title="step", axis=alt.Axis(format="d", tickMinStep=1))
    )
    band = base.mark_area(opacity=0.2).encode(
        y=alt.Y("loss_min:Q", title="loss", scale=alt.Scale(zero=False)), y2="loss_max:Q"
    )
    line = base.mark_line().encode(y="loss:Q", tooltip=["step", "loss", "loss_min", "loss_max"])
    kinds = list(MARKER_COLOURS)
    colour = alt.Color(
        "kind:N",
        title="marker",
        scale=alt.Scale(domain=kinds, range=[MARKER_COLOURS[k] for k in kinds]),
    )
    # Just above the lowest loss drawn (a mark on the edge is clipped in half), in data
    # coordinates, so that zooming keeps them on their steps.
    low, high = float(points["loss_min"].min()), float(points["loss_max"].max())
    checkpoints = markers[markers["kind"] == "checkpoint"].assign(at=low + 0.03 * (high - low))
    ticks = (
        alt.Chart(checkpoints)
        .mark_point(shape="triangle-up", filled=True, size=110, opacity=0.9)
        .encode(x="step:Q", y="at:Q", color=colour, tooltip=["step:Q", "label:N"])
    )
    rules = (
        alt.Chart(markers[markers["kind"] != "checkpoint"])
        .mark_rule(strokeWidth=1.5, opacity=0.8)
        .encode(x="step:Q", color=colour, tooltip=["step:Q", "kind:N", "label:N"])
    )
    layers = band + line + ticks + rules
    if recoveries is not None and not recoveries.empty:
        spans = recoveries.assign(kind="recovery", to_step=recoveries["to_step"] + 0.5)
        layers += (
            alt.Chart(spans[["kind", "target", "from_step", "to_step", "mttr_s", "steps_lost"]])
            .mark_rect(opacity=0.15)
            .encode(
                x="from_step:Q",
                x2="to_step:Q",
                color=colour,
                tooltip=[
                    alt.Tooltip("kind:N", title="marker"),
                    "target:N",
                    "from_step:Q",
                    alt.Tooltip("mttr_s:Q", format=".1f", title="MTTR s"),
                    "steps_lost:Q",
                ],
            )
        )
    if evals is not None and not evals.empty:
        validation = (
            alt.Chart(evals)
            .mark_line(point=True, strokeDash=[4, 3], color=EVAL_COLOUR)
            .encode(x="step:Q", y="eval_loss:Q", tooltip=["step", "eval_loss"])
        )
        layers += validation
    return layers.interactive(bind_y=False)


# Typical dark, 2x the median and above bright: noise of a few per cent stays one colour and a
# straggler's (or a slow node's) row stands out.
_RELATIVE_SCALE = alt.Scale(scheme="inferno", domain=[0.8, 2.0], clamp=True)


def node_heatmap(grid: pd.DataFrame) -> alt.Chart:
    """A nodes x steps grid (`views.nodes.node_steps`), each cell the node's worst rank relative
    to the step's median rank, slowest nodes at the top."""
    order = list(
        grid.groupby("node")["relative"].max().sort_values(ascending=False, kind="stable").index
    )
    return (
        alt.Chart(grid)
        .mark_rect()
        .encode(
            x=alt.X("step:O", title="step", axis=alt.Axis(labelOverlap=True)),
            y=alt.Y("node:N", title="node", sort=order),
            color=alt.Color("relative:Q", title="worst rank x median", scale=_RELATIVE_SCALE),
            tooltip=[
                "step",
                "node",
                "worst_rank",
                "ranks",
                alt.Tooltip("worst_compute_s:Q", title="worst compute_s", format=".4f"),
                alt.Tooltip("relative:Q", format=".2f"),
            ],
        )
        .properties(height=max(160, min(720, 14 * len(order))))
    )


def rank_heatmap(steps: pd.DataFrame, metric: str) -> alt.Chart:
    """A ranks x steps grid of `metric` (a column of the frame), coloured relative to the step's
    median rank: its `median_<metric>` column (all ranks of the job) when the frame has one, else
    the median of the ranks drawn, so a slow rank is a bright row whatever the absolute times."""
    median = (
        steps[f"median_{metric}"]
        if f"median_{metric}" in steps
        else steps.groupby("step")[metric].transform("median")
    )
    frame = steps.assign(value=steps[metric], relative=steps[metric] / median.where(median > 0))
    return (
        alt.Chart(frame)
        .mark_rect()
        .encode(
            x=alt.X("step:O", title="step", axis=alt.Axis(labelOverlap=True)),
            y=alt.Y("rank:O", title="rank"),
            color=alt.Color("relative:Q", title="x median rank", scale=_RELATIVE_SCALE),
            tooltip=[
                "step",
                "rank",
                alt.Tooltip("value:Q", title=metric, format=".4f"),
                alt.Tooltip("relative:Q", format=".2f"),
            ],
        )
        .properties(height=max(160, min(640, 10 * steps["rank"].nunique())))
    )


def throughput_chart(points: pd.DataFrame) -> alt.Chart | alt.LayerChart:
    """Tokens/s of all ranks at each sampled step (`views.run.loss_points`), and, where the job
    changed size (elastic), the ranks that trained each step on an axis of their own."""
    x = alt.X("step:Q", title="step", axis=alt.Axis(format="d", tickMinStep=1))
    tooltip = ["step", alt.Tooltip("tokens_per_s:Q", format=",.0f"), "ranks"]
    tokens = (
        alt.Chart(points)
        .mark_line(color="#4c78a8")
        .encode(
            x=x,
            y=alt.Y("tokens_per_s:Q", title="tokens/s", scale=alt.Scale(zero=False)),
            tooltip=tooltip,
        )
        .interactive(bind_y=False)
    )
    if points["ranks"].nunique() < 2:
        return tokens
    ranks = (
        alt.Chart(points)
        .mark_line(color="#999999", interpolate="step-after", strokeDash=[4, 2])
        .encode(
            x=x,
            y=alt.Y("ranks:Q", title="ranks", axis=alt.Axis(format="d", tickMinStep=1)),
            tooltip=tooltip,
        )
    )
    return alt.layer(tokens, ranks).resolve_scale(y="independent")


def phase_chart(phases: pd.DataFrame) -> alt.Chart:
    """Each rank's mean step split into data, forward, backward, optimizer and communication
    wait, as stacked horizontal bars: a straggler's peers show long communication waits."""
    long = phases.melt(
        id_vars=["rank"], value_vars=list(PHASE_COLUMNS), var_name="phase", value_name="seconds"
    )
    long["phase"] = long["phase"].map(PHASE_LABELS)
    return (
        alt.Chart(long)
        .mark_bar()
        .encode(
            y=alt.Y("rank:O", title="rank"),
            x=alt.X("seconds:Q", title="mean seconds per step", stack="zero"),
            color=alt.Color("phase:N", sort=list(PHASE_LABELS.values()), title="phase"),
            order=alt.Order("phase_order:Q"),
            tooltip=["rank", "phase", alt.Tooltip("seconds:Q", format=".4f")],
        )
        .transform_calculate(phase_order=f"indexof({list(PHASE_LABELS.values())}, datum.phase)")
        .properties(height=max(160, min(640, 12 * phases["rank"].nunique())))
    )


def straggler_chart(phases: pd.DataFrame) -> alt.LayerChart:
    """Each rank's straggler score (peers' median compute time over its own) with the line below
    which the detector counts a rank as slow."""
    slow_below = StragglerPolicy().slow_below
    bars = (
        alt.Chart(phases)
        .mark_bar()
        .encode(
            y=alt.Y("rank:O", title="rank"),
            x=alt.X("relative_score:Q", title="straggler score (1 = typical)"),
            color=alt.condition(
                alt.datum.relative_score < slow_below, alt.value("#d62728"), alt.value("#4c78a8")
            ),
            tooltip=[
                "rank",
                alt.Tooltip("relative_score:Q", format=".2f"),
                alt.Tooltip("compute_s:Q", format=".4f"),
            ],
        )
    )
    threshold = (
        alt.Chart(pd.DataFrame({"x": [slow_below]}))
        .mark_rule(color="#d62728", strokeDash=[4, 3])
        .encode(x="x:Q")
    )
    return (bars + threshold).properties(height=max(160, min(640, 12 * phases["rank"].nunique())))


def checkpoint_chart(timeline: pd.DataFrame) -> alt.Chart:
    """Each checkpoint's blocking time (training stopped) and background time (streaming to
    ckptd while training went on), stacked per step."""
    long = timeline.melt(
        id_vars=["step"],
        value_vars=["blocking_s", "background_s"],
        var_name="part",
        value_name="seconds",
    ).dropna(subset=["seconds"])
    long["part"] = long["part"].map({"blocking_s": "blocking", "background_s": "background"})
    return (
        alt.Chart(long)
        .mark_bar()
        .encode(
            x=alt.X("step:O", title="checkpoint step", axis=alt.Axis(labelOverlap=True)),
            y=alt.Y("seconds:Q", title="seconds", stack="zero"),
            color=alt.Color(
                "part:N",
                title="time",
                scale=alt.Scale(domain=["blocking", "background"], range=["#d62728", "#9ecae9"]),
            ),
            tooltip=["step", "part", alt.Tooltip("seconds:Q", format=".3f")],
        )
    )


def badput_chart(badput_s: dict[str, float], productive_s: float) -> alt.Chart:
    """Where the run's wall time went: productive time and each cause of badput."""
    frame = pd.DataFrame(
        [("productive", productive_s), *badput_s.items()], columns=["use", "seconds"]
    )
    return (
        alt.Chart(frame)
        .mark_bar()
        .encode(
            y=alt.Y("use:N", title=None, sort=None),
            x=alt.X("seconds:Q", title="seconds"),
            color=alt.condition(
                alt.datum.use == "productive", alt.value("#2ca02c"), alt.value("#ff7f0e")
            ),
            tooltip=["use", alt.Tooltip("seconds:Q", format=".1f")],
        )
    )
