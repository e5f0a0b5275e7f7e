"""The recorder never takes training down: real write faults injected into the writer and into a real Keras ``fit``.

The faults are real where this machine allows: a full disk is a small tmpfs filled to the last byte, a logdir that
cannot be written is a read-only remount of one (both need root and ``mount``; skipped with the reason otherwise),
an object store that is down is moto's S3 server behind a TCP relay that the test cuts and restores. Each test
checks that nothing raises, that one warning says what happened, what was dropped is counted, and that writing
resumes by itself when the fault clears, with every record that was not dropped readable and no torn record.
"""

from __future__ import annotations

import logging
import os
import socket
import threading

import numpy as np
import pytest

from tb_gradhealth import Writer, _eventfile, reader
from tests.write_faults import logged

#: The tests mount file systems or start servers: real processes (the failsafe's own test is a unit test).
pytestmark = pytest.mark.e2e


def _grads(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {"dense/kernel": rng.standard_normal((64, 64)), "dense/bias": rng.standard_normal(64)}


def _read(logdir: str):
    (run,) = reader.read_logdir(logdir).runs
    return run


def test_a_full_disk_costs_a_warning_and_writing_resumes_when_space_is_freed(tmpfs, caplog):
    caplog.set_level(logging.WARNING, logger="tb_gradhealth")
    logdir = str(tmpfs.path / "run")
    with Writer(logdir, max_queue=1, seed=0) as w:
        for step in range(3):
            w.add_gradients(step, _grads(step))
        tmpfs.fill()
        for step in range(3, 30):  # past the last page's slack every write fails: queued, nothing raised
            w.add_gradients(step, _grads(step))
        assert w._writer.failing
        tmpfs.free()
        assert w.flush()  # an explicit flush tries now, whatever the back-off says
        for step in range(30, 32):
            w.add_gradients(step, _grads(step))
        assert not w._writer.failing and w.dropped_records == 0
    assert len(logged(caplog, "cannot write to")) == 1, caplog.text
    assert len(logged(caplog, "works again after")) == 1, caplog.text
    run = _read(logdir)
    assert run.steps.tolist() == list(range(32)) and run.problems == ()
    problems: list[str] = []
    for name in os.listdir(logdir):
        list(_eventfile.iter_framed(os.path.join(logdir, name), problems))
    assert problems == []  # the failed writes were cut back: no torn record


def test_events_beyond_the_queue_limit_are_dropped_oldest_first_and_counted(tmpfs, caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger="tb_gradhealth")
    monkeypatch.setattr(_eventfile, "MAX_PENDING_BYTES", 5_000)  # a few events' worth
    logdir = str(tmpfs.path / "run")
    w = Writer(logdir, max_queue=1, seed=0)
    w.add_gradients(0, _grads(0))
    tmpfs.fill()
    for step in range(1, 80):
        w.add_gradients(step, _grads(step))
    dropped = w.dropped_records
    assert 0 < dropped < 79
    tmpfs.free()
    w.close()
    assert w.dropped_records == dropped
    run = _read(logdir)
    # what was dropped is one contiguous run of the oldest queued steps: those written before the disk filled up
    # (the last page's slack) and the newest queued survive, in order
    written = run.steps.tolist()
    missing = sorted(set(range(80)) - set(written))
    assert written == sorted(written) and written[0] == 0 and written[-1] == 79
    assert len(missing) == dropped and missing == list(range(missing[0], missing[0] + dropped))


def test_a_logdir_that_cannot_be_made_is_retried_until_it_can(tmpfs, caplog):
    caplog.set_level(logging.WARNING, logger="tb_gradhealth")
    tmpfs.remount("ro")
    logdir = str(tmpfs.path / "not" / "yet")
    w = Writer(logdir, max_queue=1, seed=0)  # no exception: the directory cannot be made yet
    w.add_gradients(0, _grads(0))
    assert w._writer.failing and not os.path.exists(logdir)
    tmpfs.remount("rw")
    w.add_gradients(1, _grads(1))
    assert w.flush()
    w.close()
    assert _read(logdir).steps.tolist() == [0, 1]
    assert len(logged(caplog, "cannot write to")) == 1


class Relay:
    """A TCP relay from a local port to ``target``, that can be cut (new and open connections refused/closed) and
    restored: an object store that goes down and comes back, with its state kept."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.up = threading.Event()
        self.up.set()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            if not self.up.is_set():
                client.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self._open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        self.up.clear()
        for s in self._open:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._open.clear()

    def restore(self) -> None:
        self.up.set()

    def close(self) -> None:
        self._server.close()


def test_an_object_store_that_goes_down_costs_nothing_once_it_is_back(tmp_path, caplog):
    from tests.test_object_storage import _s3

    caplog.set_level(logging.WARNING, logger="tb_gradhealth")
    server = _s3(tmp_path)
    target = int(server.options["endpoint_url"].rsplit(":", 1)[1])
    relay = Relay(target)
    options = {**server.options, "endpoint_url": f"http://127.0.0.1:{relay.port}",
               "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 5}}
    try:
        url = server.url("down-and-back")
        w = Writer(url, max_queue=1, seed=0, storage_options=options)
        w.add_gradients(0, _grads(0))
        relay.cut()
        for step in range(1, 5):
            w.add_gradients(step, _grads(step))
        assert w._writer.failing
        relay.restore()
        w.add_gradients(5, _grads(5))
        assert w.flush()
        w.close()
        assert w.dropped_records == 0
        run = reader.read_logdir(url, storage_options=server.options).runs[0]
        assert run.steps.tolist() == list(range(6)) and run.problems == ()
        assert len(logged(caplog, "cannot write to")) == 1 and len(logged(caplog, "works again after")) == 1
    finally:
        relay.close()
        server.stop()


@pytest.mark.unit
def test_the_failsafe_turns_any_host_side_failure_into_one_warning_and_a_count(caplog):
    from tb_gradhealth._failsafe import Failsafe

    caplog.set_level(logging.WARNING, logger="tb_gradhealth")
    safe = Failsafe()

    def broken(step: int) -> None:
        raise RuntimeError(f"bug at {step}")

    for step in range(5):
        assert safe.run("writing a record", broken, step, records=1) is None
    assert safe.run("writing a record", lambda: 7) == 7
    assert (safe.failures, safe.dropped_records) == (5, 5)
    assert len(logged(caplog, "writing a record failed")) == 1

