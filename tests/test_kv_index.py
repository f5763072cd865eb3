"""disagg.triton.kv_index: one index file per engine instance, read by the orchestrators' cache-aware routing."""
from __future__ import annotations

import numpy as np

from disagg.triton import kv_index
from disagg.triton.load_board import BOARD_ENV


def test_an_index_being_written_is_not_read(tmp_path, monkeypatch):
    """While an instance rewrites its index, readers see the last complete one, never the half-written file."""
    monkeypatch.setenv(BOARD_ENV, str(tmp_path))
    kv_index.publish("k", "prefill", "0", 16, np.asarray([11, 12], dtype=np.uint64))
    final = kv_index._path("k", "prefill", "0")
    being_written = final.with_name(final.name + ".a1b2c3.tmp")  # named as disagg.atomic_file names it
    being_written.write_bytes(b"")  # the next version, opened and not yet written
    assert kv_index.IndexReader("k").held("prefill") == (16, {11, 12})
    being_written.unlink()
    kv_index.publish("k", "prefill", "0", 16, np.asarray([13], dtype=np.uint64))
    assert kv_index.IndexReader("k").held("prefill") == (16, {13})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disagg-kvindex-k-prefill-0.npy"]
