"""The incremental block-table mirror (BlockTables, kept by the BlockManager) always equals a from-scratch
rebuild from the sequences' Python block tables, through admissions, growth, finishes, preemptions and
prefix-cache reuse driven by the real Scheduler."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgeinfer.backend.engine.block_manager import BlockManager
from edgeinfer.backend.engine.block_table import BlockTables
from edgeinfer.backend.engine.engine_config import EngineConfig
from edgeinfer.backend.engine.scheduler import Scheduler
from edgeinfer.backend.engine.sequence import Sequence
from edgeinfer.protocol.page_id import PageKeyContext
from edgeinfer.protocol.wire import SamplingParams

PAGE = 4


def rebuild(seqs: list[Sequence]) -> np.ndarray:
    width = max((len(s.block_table) for s in seqs), default=0)
    t = np.zeros((len(seqs), max(width, 1)), dtype=np.int32)
    for i, s in enumerate(seqs):
        t[i, : len(s.block_table)] = s.block_table
    return t


def check_mirror(blocks: BlockManager, seqs: list[Sequence]) -> None:
    tables = blocks.tables
    holding = [s for s in seqs if s.block_table]
    assert all(s.table_row == -1 for s in seqs if not s.block_table)
    rows = [s.table_row for s in holding]
    assert len(set(rows)) == len(rows) and all(r >= 0 for r in rows)
    assert not set(rows) & set(tables.free_rows)
    width = max((len(s.block_table) for s in holding), default=0)
    np.testing.assert_array_equal(tables.gather(holding, width), rebuild(holding))
    for s in holding:   # nothing stale past a table's end (a reused row was cleared)
        assert not tables.array[s.table_row, len(s.block_table):].any()


def make_seq(i: int, prompt_len: int, shared: bool) -> Sequence:
    ctx = PageKeyContext(b"seed", "t", "fp", "fp32", PAGE)
    prompt = ([7] * 9 if shared else []) + [100 + i] * prompt_len
    return Sequence(f"s{i}", prompt, SamplingParams(max_tokens=64), ctx, lambda *a, **k: None)


def advance(blocks: BlockManager, batch) -> None:
    """What the runner and engine do after a step: count computed tokens, append a token where due."""
    for s in batch.decodes:
        s.num_computed_tokens += 1
        s.output_ids.append(5)
    for s, n in batch.prefills:
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.output_ids.append(5)
    for s in [*batch.decodes, *(s for s, _ in batch.prefills)]:
        blocks.register_full_pages(s, s.extend_hashes())


ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 30), st.booleans()),
    st.tuples(st.just("step"), st.just(0), st.just(False)),
    st.tuples(st.just("finish"), st.integers(0, 50), st.just(False)),
), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops, st.integers(6, 40), st.integers(1, 3))
def test_incremental_tables_equal_a_rebuild(program, num_pages, rows):
    cfg = EngineConfig(page_size=PAGE, num_pages=num_pages, max_num_seqs=8, max_num_batched_tokens=16)
    blocks = BlockManager(num_pages, PAGE, tables=BlockTables(rows=rows, width=2))   # small: growth is exercised
    sched = Scheduler(cfg, blocks)
    seqs: list[Sequence] = []
    for i, (op, arg, flag) in enumerate(program):
        if op == "add":
            if blocks.pages_needed(arg + 10) > num_pages:
                continue
            s = make_seq(i, arg, flag)
            seqs.append(s)
            sched.add(s)
        elif op == "step":
            batch = sched.schedule()
            for s in batch.out_of_room:
                sched.remove(s)
            advance(blocks, batch)
        elif sched.running:
            sched.remove(sched.running[arg % len(sched.running)])
        check_mirror(blocks, seqs)


def test_preemption_clears_and_readmission_refills_the_row():
    cfg = EngineConfig(page_size=PAGE, num_pages=6, max_num_seqs=4, max_num_batched_tokens=64)
    blocks = BlockManager(6, PAGE, enable_prefix_cache=False)
    sched = Scheduler(cfg, blocks)
    a, b = make_seq(0, 10, False), make_seq(1, 10, False)
    sched.add(a)
    sched.add(b)
    advance(blocks, sched.schedule())            # both prefilled: 3 pages each, the pool is full
    check_mirror(blocks, [a, b])
    for _ in range(3):
        advance(blocks, sched.schedule())        # a grows into a 4th page: b is preempted
    assert sched.num_preemptions >= 1 and b.table_row == -1
    check_mirror(blocks, [a, b])
    sched.remove(a)
    advance(blocks, sched.schedule())            # b comes back with fresh pages
    assert b.block_table and b.table_row >= 0
    check_mirror(blocks, [a, b])


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError, match="rows=0"):
        BlockTables(rows=0)


def test_a_reused_row_holds_nothing_of_its_previous_sequence():
    blocks = BlockManager(16, PAGE, enable_prefix_cache=False, tables=BlockTables(rows=1, width=2))
    long, short = make_seq(0, 30, False), make_seq(1, 3, False)
    blocks.allocate(long, 8)
    row = long.table_row
    blocks.free(long)
    blocks.allocate(short, 1)
    assert short.table_row == row
    check_mirror(blocks, [long, short])
    blocks.free(short)
    blocks.assign(long, [])
    blocks.allocate(long, 2)
    check_mirror(blocks, [long, short])
