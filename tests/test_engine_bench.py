"""`bench engine`'s decode rate is timed over steps in which the whole batch decodes."""
from __future__ import annotations

import numpy as np

from disagg.bench.engine import build_engine, decode_rate
from disagg.engine.engine import LLMEngine


def test_decode_is_timed_only_over_steps_that_decode_every_sequence(tmp_path, tiny_checkpoint):
    root = tmp_path / "root"
    (root / "checkpoints").mkdir(parents=True)
    (root / "checkpoints" / "tiny").symlink_to(tiny_checkpoint)
    engine = LLMEngine(build_engine(root, "tiny", 4, 48, 3))
    steps: list[list[int]] = []
    forward = engine.model.forward
    engine.model.forward = lambda batch: (steps.append([len(s.token_ids) for s in batch]), forward(batch))[1]
    rng = np.random.default_rng(0)

    rate = decode_rate(engine, lambda: tuple(int(t) for t in rng.integers(2, 200, 48)), 4, 3)

    # The token budget admits one 48-token prompt per step beside the decodes; only the last three steps are timed.
    assert steps == [[48], [48, 1], [48, 1, 1], [48, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]]
    assert rate > 0
    assert not engine.has_work() and engine.blocks.num_used == 0  # the batch is aborted once timed
