"""disagg.atomic_file: a file replaced by several writers at once (two servers started from one repository
publish under the same instance names)."""
from __future__ import annotations

import threading

from disagg.atomic_file import replace_file


def test_writers_of_one_file_at_once_never_fail_and_a_reader_sees_whole_versions(tmp_path):
    path = tmp_path / "disagg-load-k-prefill-prefill_0_0.json"
    versions = {bytes([w]) * 4096 for w in range(4)}
    errors: list[BaseException] = []
    seen: set[bytes] = set()

    def write(data: bytes) -> None:
        try:
            for _ in range(300):
                replace_file(path, data)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion below
            errors.append(exc)

    writers = [threading.Thread(target=write, args=(v,)) for v in versions]
    for t in writers:
        t.start()
    while any(t.is_alive() for t in writers):
        if path.exists():
            seen.add(path.read_bytes())
    for t in writers:
        t.join()
    assert errors == []
    assert seen <= versions and path.read_bytes() in versions
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left behind
    assert path.stat().st_mode & 0o777 == 0o644  # readable by every reader, as a file written in place would be
