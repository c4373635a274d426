"""The step planner's choices by step shape (layers/step_plan.py); the GEMM and fused-rope rules are tested beside
their kernels (test_gemv_fused.py, test_silu_mul_gemv.py, test_decode_rope_attention.py)."""

from nanoserve.kernels.prefill import PrefillPlanner
from nanoserve.layers.step_plan import DECODE_ORDER_MIN_BATCH, EAGER, FUSED_DECODE_MERGE_MAX_BATCH, KernelPlanner


def test_decode_merge_and_order_only_in_decode_graphs():
    planner = KernelPlanner()
    ladder = [1, 2, 4, 8, 16, 64, 112, 128, 256, 512]
    merged = {bs for bs in ladder if planner.plan(bs, bs, bs, graph=True).fused_decode_merge}
    ordered = {bs for bs in ladder if planner.plan(bs, bs, bs, graph=True).decode_order}
    assert merged == {bs for bs in ladder if bs <= FUSED_DECODE_MERGE_MAX_BATCH} == {1, 2, 4}
    assert ordered == {bs for bs in ladder if bs >= DECODE_ORDER_MIN_BATCH} == {128, 256, 512}
    for bs in (1, 256):
        eager = planner.plan(bs, bs, bs)
        assert not (eager.fused_decode_merge or eager.decode_order or eager.skinny_gemm or eager.fused_prologues)
        prefill_graph = planner.plan(min(bs, 16), 0, 16 * bs, graph=True)
        assert not (prefill_graph.fused_decode_merge or prefill_graph.decode_order)


def test_graph_gemms_by_rows():
    """In graphs the skinny GEMM takes steps of up to 32 rows, decode or prefill bucket alike; the prologues only
    one row. Eager steps keep PyTorch's GEMMs at any size."""
    planner = KernelPlanner()
    for rows, skinny, prologues in ((1, True, True), (2, True, False), (16, True, False), (32, True, False),
                                    (48, False, False), (512, False, False)):
        for plan in (planner.plan(rows, rows, rows, graph=True), planner.plan(min(rows, 4), 0, rows, graph=True)):
            assert (plan.skinny_gemm, plan.fused_prologues) == (skinny, prologues)
        assert planner.plan(rows, rows, rows) == EAGER


def test_the_default_plan_is_the_plain_path():
    assert EAGER == KernelPlanner().plan(3, 1, 40)
    assert not any(vars(EAGER).values())


def test_the_planner_holds_the_one_prefill_planner():
    prefill = PrefillPlanner(16, 8, 132)
    assert KernelPlanner(prefill=prefill).prefill is prefill and KernelPlanner().prefill is None
