"""The TF-free event-file framing: checksums equal TensorBoard's, files read back by TensorBoard's own loader,
and writing never imports TensorFlow (TensorBoard's EventFileWriter would, whenever TF is installed)."""

import os
import subprocess
import sys

import numpy as np
import pytest
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tb_masked_crc32c

from tb_gradhealth import _eventfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.unit
def test_checksum_matches_tensorboard():
    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 8, 1000):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert _eventfile.masked_crc32c(data) == tb_masked_crc32c(data)


@pytest.mark.unit
def test_file_round_trip_and_truncation(tmp_path):
    f = _eventfile.EventFile(str(tmp_path), max_queue=1000)
    for step in range(5):
        f.add_event(event_pb2.Event(step=step, wall_time=1.0))
    f.close()
    problems: list[str] = []
    events = [event_pb2.Event.FromString(p) for p in _eventfile.iter_records(f.path, problems)]
    assert [e.file_version for e in events[:1]] == ["brain.Event:2"]
    assert [e.step for e in events[1:]] == [0, 1, 2, 3, 4]
    assert problems == []
    data = open(f.path, "rb").read()
    with open(f.path, "wb") as out:
        out.write(data[:-5])  # a writer mid-record
    problems = []
    assert len(list(_eventfile.iter_records(f.path, problems))) == 5
    assert problems and "partial record" in problems[0]


@pytest.mark.unit
def test_tensorboard_loader_reads_our_files(tmp_path):
    from tensorboard.backend.event_processing import event_file_loader

    f = _eventfile.EventFile(str(tmp_path))
    f.add_event(event_pb2.Event(step=3, wall_time=2.0))
    f.close()
    steps = [e.step for e in event_file_loader.EventFileLoader(f.path).Load()]
    assert steps == [0, 3]


@pytest.mark.e2e
def test_writer_does_not_import_tensorflow(tmp_path):
    code = (
        "import sys, numpy as np\n"
        "from tb_gradhealth import Writer\n"
        f"w = Writer({str(tmp_path)!r}); w.add_gradients(0, {{'a': np.ones(4)}}); w.flush(); w.close()\n"
        "assert 'tensorflow' not in sys.modules, 'writing imported tensorflow'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
