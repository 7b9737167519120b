"""InflightRequests with the engine's real Response/Result types and a fake response sender."""
import numpy as np
import pytest

from engine.executor.request import FinishReason, RequestPerfMetrics, Response, Result
from serving.inflight import InflightRequests
from serving.requests import convert_request


class Sender:
    def __init__(self):
        self.cancelled = False

    def is_cancelled(self):
        return self.cancelled


def specs(rows=1, streaming=False, n=1, exclude=True, **extra):
    tensors = {"input_ids": np.arange(1, 4 * rows + 1, dtype=np.int32).reshape(rows, 4),
               "request_output_len": np.full((rows, 1), 8, np.int32),
               "streaming": np.full((rows, 1), streaming), "num_return_sequences": np.full((rows, 1), n, np.int32),
               "exclude_input_in_output": np.full((rows, 1), exclude), **extra}
    return convert_request(tensors, decoupled=True)


def result(tokens, final, index=0, perf=None):
    reason = FinishReason.LENGTH if final else FinishReason.NOT_FINISHED
    return Result(output_token_ids=[tokens], is_final=final, finish_reasons=[reason], sequence_index=index, perf=perf)


def test_final_flag_goes_on_the_response_completing_the_last_row():
    inflight = InflightRequests(decoupled=True)
    sender = Sender()
    inflight.add(sender, "u1", specs(rows=2, streaming=True), [10, 11])
    sends, _ = inflight.on_response(Response(10, result=result([5], final=False)))
    assert len(sends) == 1 and not sends[0].final and sends[0].tensors["batch_index"].tolist() == [[0]]
    sends, finished = inflight.on_response(Response(11, result=result([6, 7], final=True)))
    assert not sends[0].final and sends[0].tensors["batch_index"].tolist() == [[1]]
    assert finished[0].output_tokens == 2 and finished[0].input_tokens == 4
    sends, finished = inflight.on_response(Response(10, result=result([], final=True)))
    assert sends[0].final and sends[0].tensors["output_ids"].shape == (1, 1, 0)
    assert finished[0].output_tokens == 1
    assert inflight.exec_ids_for_user("u1") == [] and not inflight.triton_requests


def test_num_return_sequences_end_after_every_stream():
    inflight = InflightRequests(decoupled=True)
    inflight.add(Sender(), "", specs(streaming=False, n=2), [3])
    sends, finished = inflight.on_response(Response(3, result=result([1, 2], final=True, index=1)))
    assert not sends[0].final and sends[0].tensors["sequence_index"].tolist() == [[1]] and not finished
    sends, finished = inflight.on_response(Response(3, result=result([4], final=True, index=0)))
    assert sends[0].final and finished[0].output_tokens == 3


def test_non_decoupled_rows_are_stacked_into_one_response():
    inflight = InflightRequests(decoupled=False)
    inflight.add(Sender(), "", specs(rows=2), [1, 2])
    assert inflight.on_response(Response(2, result=result([7, 8, 9], final=True)))[0] == []
    sends, _ = inflight.on_response(Response(1, result=result([6], final=True)))
    assert len(sends) == 1 and sends[0].final
    assert sends[0].tensors["output_ids"].tolist() == [[[7, 8, 9]], [[6, -1, -1]]]
    assert sends[0].tensors["batch_index"].tolist() == [[1], [0]]


def test_errors_are_final_per_request_and_unknown_ids_are_ignored():
    inflight = InflightRequests(decoupled=False)
    inflight.add(Sender(), "", specs(rows=2), [1, 2])
    assert inflight.on_response(Response(1, error="max_tokens must be a positive integer, got 0"))[0] == []
    sends, finished = inflight.on_response(Response(2, result=result([1], final=True)))
    assert sends[0].final and "max_tokens must be" in sends[0].error
    assert inflight.on_response(Response(99, result=result([1], final=True))) == ([], [])


def test_streams_hold_back_unfinished_characters():
    # A fake decoder: token 0 alone is half a character.
    decode = lambda ids: "".join("\ufffd" if t == 0 and i == len(ids) - 1 else "x" for i, t in enumerate(ids))
    inflight = InflightRequests(decoupled=True, decode=decode)
    inflight.add(Sender(), "", specs(streaming=True), [1])
    assert inflight.on_response(Response(1, result=result([5, 0], final=False)))[0][0].tensors[
        "output_ids"].tolist() == [[[5]]]
    assert inflight.on_response(Response(1, result=result([0], final=False)))[0] == []
    sends, _ = inflight.on_response(Response(1, result=result([6], final=True)))
    assert sends[0].tensors["output_ids"].tolist() == [[[0, 0, 6]]] and sends[0].final


def test_prompt_echo_is_not_counted_as_output_and_perf_feeds_latency():
    inflight = InflightRequests(decoupled=False)
    inflight.add(Sender(), "", specs(exclude=False), [1])
    perf = RequestPerfMetrics(arrival_time_ns=1_000_000_000, first_scheduled_time_ns=1_100_000_000,
                              first_token_time_ns=1_500_000_000, last_token_time_ns=2_000_000_000)
    sends, finished = inflight.on_response(Response(1, result=result([1, 2, 3, 4, 9, 9, 9], True, perf=perf)))
    assert finished[0].output_tokens == 3
    assert finished[0].latency.time_to_first_token() == pytest.approx(0.5)
    assert finished[0].latency.inter_token_latency() == pytest.approx(0.25)
    assert "arrival_time_ns" not in sends[0].tensors  # perf outputs only when the client asked


def test_cancelled_senders_are_reported_once_and_user_ids_map_to_live_requests():
    inflight = InflightRequests(decoupled=True)
    first, second = Sender(), Sender()
    inflight.add(first, "same", specs(rows=2, streaming=True), [1, 2])
    assert inflight.exec_ids_for_user("same") == [1, 2]
    inflight.add(second, "same", specs(streaming=True), [3])
    assert inflight.exec_ids_for_user("same") == [3]  # a later request with the id replaces it
    first.cancelled = True
    assert sorted(inflight.newly_cancelled()) == [1, 2]
    assert inflight.newly_cancelled() == []


def test_fail_all_ends_every_request_with_the_message_on_its_final_response():
    inflight = InflightRequests(decoupled=True)
    inflight.add(Sender(), "", specs(rows=2, streaming=True), [1, 2])
    inflight.add(Sender(), "", specs(streaming=True), [3])
    assert inflight.fail_all("the server is shutting down") == [1, 2, 3]
    assert inflight.fail_all("again") == []  # already failing: nothing more to cancel
    assert inflight.on_response(Response(1, result=result([5], final=False)))[0] == []  # tokens stop
    sends, _ = inflight.on_response(Response(1, result=result([], final=True)))
    assert sends[0].error == "the server is shutting down" and not sends[0].final  # row 2 still runs
    sends, _ = inflight.on_response(Response(2, result=result([], final=True)))
    assert sends[0].error == "the server is shutting down" and sends[0].final
    sends, _ = inflight.on_response(Response(3, error="cancelled"))
    assert sends[0].final and sends[0].error == "the server is shutting down"
    assert not inflight.triton_requests


def test_a_caller_asking_for_error_message_gets_failures_as_that_output():
    inflight = InflightRequests(decoupled=True)
    inflight.add(Sender(), "", specs(streaming=True), [1], errors_as_output=True)
    sends, _ = inflight.on_response(Response(1, result=result([5], final=False)))
    assert sends[0].error is None and "error_message" not in sends[0].tensors
    sends, finished = inflight.on_response(Response(1, error="the engine process exited (killed by SIGKILL)"))
    assert sends[0].final and sends[0].error is None and finished[0].error
    assert sends[0].tensors["error_message"].tolist() == [[b"the engine process exited (killed by SIGKILL)"]]


def test_stream_counts_tell_coalesced_tokens_from_tokens_sent_alone():
    inflight = InflightRequests(decoupled=True)
    inflight.add(Sender(), "s", specs(streaming=True), [4])
    inflight.add(Sender(), "u", specs(streaming=False), [5])
    for tokens, final in (([1], False), ([2], False), ([3, 4, 5], False), ([6], True)):
        inflight.on_response(Response(4, result=result(tokens, final=final)))
    inflight.on_response(Response(5, result=result([1, 2, 3], final=True)))  # unary: not a stream
    counts = inflight.stream_counts
    assert (counts.tokens, counts.coalesced_tokens, counts.responses) == (6, 3, 4)


def test_keys_start_at_first_key_so_instances_sharing_an_engine_never_collide():
    from serving.cancellation import stop_id_for_key
    from serving.shared_engine import KEY_STRIDE

    second = InflightRequests(decoupled=True, first_key=1 * KEY_STRIDE)
    second.add(Sender(), "a", specs(streaming=True), [1])
    (key,) = second.triton_requests
    assert key == KEY_STRIDE
    assert second.stop(stop_id_for_key(0)) == [] and second.stop(stop_id_for_key(KEY_STRIDE)) == [1]


@pytest.mark.parametrize("decoupled", [True, False])
def test_responses_carry_only_the_outputs_the_caller_asked_for(decoupled):
    # The Python backend of Triton 2.51 frees unrequested outputs of a decoupled send without the
    # interpreter lock (a SIGSEGV of the stub under Python 3.12): none may reach the sender.
    inflight = InflightRequests(decoupled=decoupled)
    wanted = frozenset({"output_ids", "sequence_length", "error_message"})
    inflight.add(Sender(), "", specs(rows=2, streaming=decoupled), [1, 2], errors_as_output=True,
                 requested_outputs=wanted)
    sends, _ = inflight.on_response(Response(1, result=result([5, 6], final=True)))
    sends += inflight.on_response(Response(2, result=result([7], final=True)))[0]
    assert sends and all(set(send.tensors) == {"output_ids", "sequence_length"} for send in sends)
    assert sends[-1].final
    inflight.add(Sender(), "", specs(streaming=True), [3], errors_as_output=True, requested_outputs=wanted)
    sends, _ = inflight.on_response(Response(3, error="the engine process exited"))
    if decoupled:  # (a non-decoupled caller gets an error response: no tensors)
        assert set(sends[0].tensors) == {"error_message"}
    else:
        assert sends[0].tensors is None and "engine process exited" in sends[0].error
    everything = InflightRequests(decoupled=True)
    everything.add(Sender(), "", specs(rows=2), [4, 5])  # no list: every output, as before
    sends, _ = everything.on_response(Response(4, result=result([8], final=True)))
    assert {"output_ids", "sequence_length", "batch_index"} <= set(sends[0].tensors)
