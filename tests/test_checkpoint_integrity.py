"""A checkpoint item's integrity record: written at save, checked at restore, and never a way to read outside the
item (its names come from a file anyone with write access to the bucket or disk can change)."""

import json

from etils import epath

from maxctx.checkpoint.integrity import RECORD, check_item, write_record


def _item(tmp_path):
    item = tmp_path / "step" / "state"
    item.mkdir(parents=True)
    (item / "a.bin").write_bytes(b"abc")
    write_record(epath.Path(item))
    return item


def test_a_written_item_verifies_and_a_changed_file_is_named(tmp_path):
    item = _item(tmp_path)
    assert check_item(epath.Path(item), "state") is None
    (item / "a.bin").write_bytes(b"abd")
    assert check_item(epath.Path(item), "state").startswith("state/a.bin fails its checksum")


def test_a_record_naming_a_file_outside_the_item_is_refused(tmp_path):
    """A forged record that names '../../outside.bin' (a file whose size and checksum it copies) must not verify:
    the check would read files outside the checkpoint."""
    item = _item(tmp_path)
    (tmp_path / "outside.bin").write_bytes(b"abc")
    record = json.loads((item / RECORD).read_text())
    entry = record["files"]["a.bin"]
    for name in ("../../outside.bin", str(tmp_path / "outside.bin"), "x/../../../outside.bin"):
        record["files"] = {name: entry}
        (item / RECORD).write_text(json.dumps(record))
        assert "is unreadable" in check_item(epath.Path(item), "state"), name
