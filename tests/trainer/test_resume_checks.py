"""A resume is refused unless telemetry's record of the step agrees with the checkpoint."""

from __future__ import annotations

import pytest

from scaletrain.errors import UserError
from trainer.checkpoint.resume import check_offsets
from trainer.data.loader import LoaderOffset

AT_96 = {r: LoaderOffset(96, 96 + 4 * r, 0) for r in range(4)}


def test_offsets_that_agree_let_the_run_resume():
    check_offsets("r", 6, 1, LoaderOffset(96, 100, 0), AT_96, same_slices=True)


def test_a_different_global_position_is_refused_naming_the_rank():
    recorded = AT_96 | {2: LoaderOffset(80, 88, 0)}
    with pytest.raises(UserError, match="global sample 96, telemetry recorded 80 for rank 2"):
        check_offsets("r", 6, 0, LoaderOffset(96, 96, 0), recorded, same_slices=True)


def test_a_different_slice_at_the_same_degree_is_refused():
    with pytest.raises(UserError, match="rank 1's data-loader offset"):
        check_offsets("r", 6, 1, LoaderOffset(96, 101, 0), AT_96, same_slices=True)


def test_another_data_parallel_degree_keeps_the_global_order_and_may_resume():
    check_offsets("r", 6, 1, LoaderOffset(96, 104, 0), AT_96, same_slices=False)


def test_a_step_telemetry_never_recorded_is_refused():
    with pytest.raises(UserError, match="no data-loader offsets for that step"):
        check_offsets("r", 6, 0, LoaderOffset(96, 96, 0), {}, same_slices=True)


def test_a_resized_job_missing_the_lost_nodes_records_still_resumes():
    """3 ranks saved step 6; the node of rank 2 was lost with its unsent record; 2 ranks resume.
    Two records at a size of two is no sign of an unchanged size: the slices are not compared."""
    saved_by_3 = {r: LoaderOffset(96, 96 + 8 * r, 0) for r in range(2)}
    check_offsets("r", 6, 1, LoaderOffset(96, 108, 0), saved_by_3, same_slices=False)


def test_at_the_same_size_a_rank_whose_record_was_lost_is_not_refused():
    lost = {r: o for r, o in AT_96.items() if r != 3}
    check_offsets("r", 6, 3, LoaderOffset(96, 108, 0), lost, same_slices=True)
