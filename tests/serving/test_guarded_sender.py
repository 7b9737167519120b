"""GuardedSender: no call reaches a BLS request's sender once its FINAL send began (Triton frees
the response factory then; a late is_cancelled() crashed tritonserver with SIGSEGV)."""
import threading
import time

from serving.bls import GuardedSender

FINAL = 1


class SlowFinalSender:
    """Stands in for Triton's sender: records every call, and holds the FINAL send open for a
    while, the window in which the old watcher asked is_cancelled() of a freed factory."""

    def __init__(self):
        self.calls = []
        self.final_began = threading.Event()

    def _record(self, name):
        self.calls.append((name, self.final_began.is_set()))

    def is_cancelled(self):
        self._record("is_cancelled")
        return False

    def send(self, response=None, flags=0):
        self._record("send_final" if flags == FINAL else "send")
        if flags == FINAL:
            self.final_began.set()
            time.sleep(0.05)


def test_no_call_reaches_the_sender_after_the_final_send_began():
    raw = SlowFinalSender()
    sender = GuardedSender(raw, FINAL)
    answers = []

    def watcher():  # asks while the final send is under way, as the cancellation watcher may
        raw.final_began.wait()
        answers.append(sender.is_cancelled())

    thread = threading.Thread(target=watcher)
    thread.start()
    sender.send("chunk")
    sender.send_final(None)
    thread.join()
    sender.send("late chunk")
    sender.send_final("late final")
    assert answers == [False]
    assert raw.calls == [("send", False), ("send_final", False)]  # nothing during or after FINAL


def test_cancellation_is_asked_of_triton_until_the_final_send():
    class Cancelled(SlowFinalSender):
        def is_cancelled(self):
            super().is_cancelled()
            return True

    raw = Cancelled()
    sender = GuardedSender(raw, FINAL)
    assert sender.is_cancelled() is True
    sender.send_final("error response")
    assert sender.is_cancelled() is False and sender.closed
    assert [name for name, _ in raw.calls] == ["is_cancelled", "send_final"]
