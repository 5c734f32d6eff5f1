"""Read-only views of runs for the run-health UI, built to stay fast on 16,384 ranks x 1M steps.

Kept apart from `telemetry.queries` (which aggregates every record of a run) because the UI must
answer in well under a second on a long run, where one pass over a run's millions of rank records
takes seconds. So every view here reads bounded slices through a primary key: of the step rollups
(one row per step, kept for the whole run: loss, throughput, the slowest ranks), of the node steps
(one row per node and step, for the latest steps: the nodes x steps view) or of the rank rows of
one node's or rank's ranks; the latest `window` steps, or a fixed number of steps spread evenly
("sampled steps"), never the whole run, and never every rank. Sampling can miss a one-step loss
spike between two samples; the spike detector's events are drawn as markers, so a detected spike
always shows.

Where a step was recorded by several attempts, each rank's latest attempt counts, as in
`telemetry.queries`.

One module per page of the UI: `overview` (the runs overview), and for a run's health page `run`
(headline, loss curve and its markers, recoveries, event kinds), `nodes` (nodes and ranks) and
`checkpoints`; `common` holds what they share, among it `rollups_at`, the one read of rollups at
sampled steps (in chunks below the databases' limits on bound parameters).
"""
