"""The Keras callback's step bookkeeping, without TensorFlow: a fit is simulated as Keras drives its callbacks
(``on_epoch_begin``, then per train-function call ``on_train_batch_begin(first batch)`` and
``on_train_batch_end(last batch)``), and the calls the book sends to the capturing step are compared with the
calls that contain a logged step, found by enumerating the optimizer steps of each call."""

from __future__ import annotations

import numpy as np
import pytest

from tb_gradhealth._stepbook import MAX_BUFFER_BYTES, MAX_CALLS_PER_READ, LossBook, StepBook, batch_loss, ring_plan

pytestmark = pytest.mark.unit


def simulate(book: StepBook, epochs: int, epoch_steps: int, spe: int, start: int = 0):
    """``(calls, modes, reads)``: the optimizer steps of each call (1-based, continuing from ``start``), the mode
    the book chose for it, and after which calls it asked to read the ring buffer."""
    calls, modes, reads, step = [], [], [], start
    for _ in range(epochs):
        book.epoch_begin(step)
        for first in range(0, epoch_steps, spe):
            last = min(first + spe, epoch_steps) - 1
            book.batch_begin(first)
            modes.append(book.next_mode())
            calls.append(list(range(step + 1, step + last - first + 2)))
            step += last - first + 1
            _, read = book.batch_end(last)
            if read:
                reads.append(len(calls) - 1)
                book.take_pending()
    return calls, modes, reads


@pytest.mark.parametrize(("period", "spe", "epoch_steps", "start"),
                         [(1, 1, 7, 0), (3, 1, 10, 0), (5, 4, 13, 0), (10, 3, 7, 0), (4, 8, 20, 0), (3, 1, 10, 7),
                          (100, 1, 250, 0), (2, 5, 11, 123)])
def test_captures_exactly_the_calls_that_hold_a_logged_step(period, spe, epoch_steps, start):
    book = StepBook(period, spe, epoch_steps, calls_per_read=1, host_step=start)
    calls, modes, _ = simulate(book, 3, epoch_steps, spe, start)
    logs = [any(s % period == 0 for s in steps) for steps in calls]
    want = ["capture" if log else "plain" for log in logs]
    assert modes == want


@pytest.mark.parametrize(("spe", "epoch_steps"), [(1, 6), (4, 10), (3, 9), (5, 3)])
def test_epoch_mode_captures_the_call_with_the_epoch_s_last_step(spe, epoch_steps):
    book = StepBook(0, spe, epoch_steps, calls_per_read=1, host_step=0)
    calls, modes, reads = simulate(book, 3, epoch_steps, spe)
    last_steps = {epoch_steps * (e + 1) for e in range(3)}
    want = ["capture" if last_steps & set(steps) else "plain" for steps in calls]
    assert modes == want
    assert reads == []  # epoch mode reads at the epoch's end, not after calls


def test_epoch_mode_with_an_unknown_length_records_the_first_step_of_each_epoch():
    book = StepBook(0, 1, None, calls_per_read=1, host_step=0)
    modes = []
    for epoch in range(3):
        assert book.epoch_begin(epoch * 5) == 1  # the device records the next step
        for batch in range(5):
            assert book.batch_begin(batch) is None
            modes.append(book.next_mode())
            book.batch_end(batch)
    assert modes == (["capture"] + ["plain"] * 4) * 3


def test_a_resumed_fit_continues_the_count_from_the_device():
    book = StepBook(4, 1, 6, calls_per_read=1, host_step=10)  # a second fit: the optimizer is at step 10
    calls, modes, _ = simulate(book, 1, 6, 1, start=10)
    assert [steps for steps, m in zip(calls, modes, strict=True) if m == "capture"] == [[12], [16]]


def test_reads_are_batched_over_calls_and_a_lag_is_noticed():
    book = StepBook(1, 1, 40, calls_per_read=4, host_step=0)
    _, _, reads = simulate(book, 1, 40, 1)
    assert reads == [3, 7, 11, 15, 19, 23, 27, 31, 35, 39]
    assert StepBook.lags(read=3, pending=4) and not StepBook.lags(read=4, pending=4)


def test_inert_and_failed_books_never_capture():
    book = StepBook(1, 1, 5, calls_per_read=1, host_step=0)
    assert book.next_mode(inert=True) == "plain"
    book.capture_failed = True
    assert book.next_mode() == "plain"


def test_a_book_that_stops_capturing_counts_the_failed_call_and_every_later_one_as_plain():
    book = StepBook(1, 1, 6, calls_per_read=1, host_step=0)
    book.epoch_begin(0)
    book.batch_begin(0)
    assert book.next_mode() == "capture"
    book.stop_capturing()  # the capturing call failed and ran as the plain step
    assert book.batch_end(0) == (True, False)  # nothing pending: no read for a call that stored nothing
    calls, modes, reads = simulate(book, 1, 6, 1, start=1)
    assert modes == ["plain"] * 6 and reads == []


def test_a_resynced_book_predicts_from_the_device_s_count():
    book = StepBook(4, 1, None, calls_per_read=1, host_step=0)
    book.resync(6)  # two steps the host did not hear of
    assert book.next_mode() == "plain"  # step 7 (from its own count, step 1)
    book.batch_end(0)
    assert book.next_mode() == "capture"  # step 8 (from its own count, step 2: plain)


@pytest.mark.parametrize("per_call", [1, 2])
def test_the_loss_book_gives_each_logged_call_its_own_batches_mean(per_call):
    """Keras' running mean (float64 here) of two epochs, after each call of ``per_call`` batches: each value is
    the mean of the batches since the last mean the book saw (the callback shows it every call's: then the call's
    own batches); here it sees only every third call's, so the others' values span the calls between."""
    losses = np.random.default_rng(per_call).lognormal(0.0, 1.0, (2, 12))
    book = LossBook()
    for epoch in range(2):
        book.epoch_begin()
        seen_upto = 0
        for first in range(0, 12, per_call):
            book.call_begin(first, per_call)
            mean = float(losses[epoch, :first + per_call].mean())
            assert book.batch_loss(mean) == pytest.approx(losses[epoch, seen_upto:first + per_call].mean())
            if first % (3 * per_call) == 0:  # an unlogged call's mean is not seen: the next value spans it
                book.saw(mean)
                seen_upto = first + per_call
    assert book.batch_loss("not a number") == "not a number"


def test_ring_plan():
    assert ring_plan("epoch", 4, 1000, False) == (0, 5, 1)
    period, slots, per_read = ring_plan(1, 1, 1000, False)
    assert (period, per_read) == (1, MAX_CALLS_PER_READ) and slots == per_read + 2
    assert ring_plan(1, 1, 1000, True)[2] == 1  # stop_on reads after every call
    assert ring_plan(1, 1, MAX_BUFFER_BYTES // 2, False)[2] == 2  # large records: fewer calls per read
    assert ring_plan(10, 3, 1000, False) == (10, 3, 1)  # a call logs at most once; reads follow each capture


@pytest.mark.parametrize("per_call", [1, 3])
def test_batch_loss_recovers_each_calls_batches_from_the_running_mean(per_call):
    # Keras' running mean of an epoch (float32 sums, as its Mean metric keeps them) read after every call of
    # ``per_call`` batches; each recovered value is the mean of that call's own batch losses.
    losses = np.random.default_rng(per_call).lognormal(0.0, 2.0, 30 * per_call)
    total, before = np.float32(0.0), (0, 0.0)
    for call in range(30):
        batches = losses[call * per_call:(call + 1) * per_call]
        for v in batches:
            total = np.float32(total + np.float32(v))
        k = (call + 1) * per_call
        now = (k, float(total / np.float32(k)))
        assert batch_loss(before, now) == pytest.approx(batches.mean(), rel=1e-3, abs=1e-4 * losses.max())
        before = now


def test_batch_loss_of_an_epoch_whose_start_was_not_seen_is_the_mean_given():
    assert batch_loss((12, 3.0), (5, 2.5)) == 2.5
