"""Triton `tensorrt_llm` model (Python backend): Triton tensors <-> engine.executor.Executor.

Glue only. Parsing and validation: serving/requests.py; bookkeeping of in-flight requests and
where the FINAL flag goes: serving/inflight.py; metric math: serving/metrics.py.

Threads: `execute` converts and enqueues, then returns at once (responses always go through
each request's response sender, decoupled or not). One thread forwards executor responses, one
polls client cancellation every `cancellation_check_period_ms`, one publishes iteration stats
every `stats_check_period_ms` (and notices a dead engine). A lock guards the shared bookkeeping.

Several instances (instance_group count n > 1) share one engine process (serving/shared_engine.py):
each relays its own requests' responses with its own stub, so n sends are in flight at once. A
stop request (a user's, or a postprocessing step's for a gone client) may reach any instance; it
is passed to the others through the engine process.

A dead engine process (killed, out of memory, a crash in a kernel): its in-flight requests get an
error at once (EngineProcess), then this model unloads itself and, from `finalize`, loads itself
again, so Triton reports it (and the ensemble) not ready until a fresh engine process is up. The
reload carries the restart count in the `engine_restarts` parameter, shown by the
`tritonllm_engine_restarts_total` counter. Needs --model-control-mode=explicit (the launcher
always sets it). In leader mode a lost rank unloads the model (not ready) for good.
"""
import dataclasses
import json
import os
import sys
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

if os.environ.get("TRITONLLM_ROOT"):  # a source checkout not installed into the environment
    sys.path.insert(0, os.environ["TRITONLLM_ROOT"])
from serving.executor_config import executor_settings, to_executor_config  # noqa: E402
from serving.inflight import InflightRequests  # noqa: E402
from serving.loop_threads import join_by_deadline, where_blocked  # noqa: E402
from serving.metrics import (COUNTER_FAMILIES, HISTOGRAMS, GaugeChanges, gauge_specs,  # noqa: E402
                             gauge_values, cumulative_counts)
from serving.params import get_parameter, model_parameters  # noqa: E402
from serving.responses import requested_outputs, wants_errors_as_output  # noqa: E402
from serving.requests import (MISSING_STOP_ID, conversion_error_message, convert_request, request_type_of,  # noqa: E402
                              is_stop_request, kv_transfer_of, to_executor_request)
from serving.server_stop import ServerStopWatcher, ShutdownHooks, server_http_endpoint  # noqa: E402
from serving.shared_engine import KEY_STRIDE, open_shared_engine, rendezvous_paths  # noqa: E402
from serving.stub_watchdog import start_server_watchdog, stop_crash_dumps  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# finalize: the loops' stop deadline beyond their longest period (the stop watcher's liveness request and
# latch refresh time out after 1 s each), and an unload slow enough to log where its time went.
LOOP_STOP_MARGIN_S = 2.5
SLOW_UNLOAD_S = 3.0
RESTARTS_PARAMETER = "engine_restarts"  # set by the model's own reload after an engine death
SHUTTING_DOWN = ("the server is shutting down; this request was ended before it finished "
                 "(it had run for the shutdown grace period, graceful_shutdown_timeout_ms)")


def read_inputs(request, names):
    """name -> numpy array for every input present in the request."""
    tensors = {}
    for name in names:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is None:
            continue
        if tensor.is_cpu():
            tensors[name] = tensor.as_numpy()
        else:
            from torch.utils.dlpack import from_dlpack

            tensors[name] = from_dlpack(tensor.to_dlpack()).cpu().numpy()
    return tensors


# Streamed tokens, and how many went out coalesced (serving/inflight.py StreamCounts).
STREAM_COUNTERS = (
    ("tokens", "tritonllm_streamed_tokens_total", "Tokens sent in streamed responses (beam width 1)"),
    ("coalesced_tokens", "tritonllm_coalesced_tokens_total",
     "Streamed tokens that went out in a response together with other tokens (the relay was behind "
     "the engine, or a multi-byte character's tokens were held back to go together)"),
    ("responses", "tritonllm_streamed_responses_total",
     "Streamed responses sent (beam width 1), empty final ones included"),
)


class TritonMetrics:
    """The model's custom metric families: gauges from iteration stats, per-request histograms,
    counters. Instances of one model share the metrics of the same labels (Triton sums them)."""

    def __init__(self, model_name, model_version, static_batching=False, restarts=0):
        labels = {"model": model_name, "version": model_version}
        self.labels = labels
        self.counter_families, self.counters = {}, {}  # created when their stats first arrive
        self.static_batching = static_batching
        self.families = []  # kept alive: a family must outlive its metrics
        restarts_family = pb_utils.MetricFamily(
            name="tritonllm_engine_restarts_total", kind=pb_utils.MetricFamily.COUNTER,
            description="Times the engine process died and this model restarted it")
        self.families.append(restarts_family)
        self.restarts = restarts_family.Metric(labels=labels)
        if restarts:
            self.restarts.increment(restarts)  # the count survives the model's own reload
        self.stream_counters = {}  # StreamCounts field -> counter, increased by deltas
        for field, family_name, description in STREAM_COUNTERS:
            family = pb_utils.MetricFamily(name=family_name, kind=pb_utils.MetricFamily.COUNTER,
                                           description=description)
            self.families.append(family)
            self.stream_counters[field] = family.Metric(labels=labels)
        self.published_counts = dict.fromkeys(self.stream_counters, 0)
        self.gauges = {}
        self.gauge_changes = GaugeChanges()  # a gauge is set again only when its value changed
        for family_name, description, category, getters in gauge_specs(static_batching):
            family = pb_utils.MetricFamily(name=family_name, description=description,
                                           kind=pb_utils.MetricFamily.GAUGE)
            self.families.append(family)
            for label_value in getters:
                self.gauges[(family_name, label_value)] = family.Metric(
                    labels={**labels, category: label_value})
        self.histograms = {}
        for family_name, description, response_type, buckets in HISTOGRAMS:
            family = pb_utils.MetricFamily(name=family_name, description=description,
                                           kind=pb_utils.MetricFamily.HISTOGRAM)
            self.families.append(family)
            extra = {"response_metric_type": response_type} if response_type else {}
            self.histograms[family_name] = family.Metric(labels={**labels, **extra}, buckets=buckets)

    def update_gauges(self, stats):
        for key, value in self.gauge_changes.changed(gauge_values(stats, self.static_batching)).items():
            self.gauges[key].set(value)
        self._publish_counts(stats)

    def _publish_counts(self, stats):
        """Cumulative counts (KV blocks by source, LoRA) as counters by their growth; a new label
        value (an adapter name) gets its metric on first sight."""
        for key, value in cumulative_counts(stats).items():
            if key not in self.counters:
                family_name = key[0]
                if family_name not in self.counter_families:
                    _, description, label = next(spec for spec in COUNTER_FAMILIES if spec[0] == family_name)
                    family = pb_utils.MetricFamily(name=family_name, description=description,
                                                   kind=pb_utils.MetricFamily.COUNTER)
                    self.families.append(family)
                    self.counter_families[family_name] = (family, label)
                family, label = self.counter_families[family_name]
                extra = {label: key[1]} if label else {}  # a label-less family has one series
                self.counters[key] = [family.Metric(labels={**self.labels, **extra}), 0]
            counter = self.counters[key]
            if value > counter[1]:
                counter[0].increment(value - counter[1])
                counter[1] = value

    def publish_stream_counts(self, counts):
        """Add what ``counts`` (a StreamCounts) grew by since the last call; batched here, every
        stats period, because each metric call is a round trip to the server."""
        for field, counter in self.stream_counters.items():
            value = getattr(counts, field)
            if value > self.published_counts[field]:
                counter.increment(value - self.published_counts[field])
                self.published_counts[field] = value

    def observe_finished(self, finished):
        self.histograms["nv_llm_input_token_len"].observe(finished.input_tokens)
        self.histograms["nv_llm_output_token_len"].observe(finished.output_tokens)
        ttft = finished.latency.time_to_first_token()
        if ttft is not None:
            self.histograms["nv_llm_time_to_first_token_seconds"].observe(ttft)
        itl = finished.latency.inter_token_latency()
        if itl is not None:
            self.histograms["nv_llm_inter_token_latency_seconds"].observe(itl)


class TritonPythonModel:
    def initialize(self, args):
        # Not engine.executor.executor here (torch, 2-3 s of CPU at every start): the executor runs in
        # its engine process unless engine_process is false.
        from engine.config import EngineConfig
        from engine.executor.engine_process import EngineProcess
        from engine.executor.executor_config import ExecutorConfig

        self.model_config = json.loads(args["model_config"])
        self.model_name = args["model_name"]
        params = model_parameters(self.model_config)
        self.restarts = get_parameter(params, RESTARTS_PARAMETER, int) or 0
        self.restart_requested = False
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(self.model_config)
        self.input_names = [tensor["name"] for tensor in self.model_config["input"]]
        settings = executor_settings(params, self.model_config)
        self.exclude_input_default = settings.get("exclude_input_from_output")
        self.cancellation_period = (get_parameter(params, "cancellation_check_period_ms", int) or 100) / 1000
        self.stats_period = (get_parameter(params, "stats_check_period_ms", int) or 100) / 1000
        grace_ms = get_parameter(params, "graceful_shutdown_timeout_ms", int)
        self.shutdown_grace = (3000 if grace_ms is None else grace_ms) / 1000
        self.stop_watcher = None
        engine_dir = get_parameter(params, "gpt_model_path", str)
        if engine_dir is None:
            raise ValueError("tensorrt_llm: the gpt_model_path parameter (engine_dir) must be set")
        self._run_as_worker_rank_unless_leader(engine_dir)
        engine_config = EngineConfig.load(engine_dir)
        # An encoder-decoder's decoder/ (engine/encoder_decoder/): input_ids go to its encoder
        self.encoder_decoder = engine_config.extra.get("stack") == "decoder"
        self.max_input_len = (engine_config.extra["max_encoder_input_len"] if self.encoder_decoder
                              else engine_config.build.max_input_len)
        # Llama 3.2 Vision (engine/encoder_decoder/mllama_*.py): images as encoder_input_features + cross_attention_mask
        self.cross_attention = "mllama" in engine_config.extra
        # mrope_rotary_cos_sin items are (positions, head_dim) wide (serving/mrope.py); the executor
        # refuses them by name for a model without M-RoPE
        self.rotary_width = engine_config.model.head_dim
        config, ignored = to_executor_config(ExecutorConfig, settings)
        if ignored:
            pb_utils.Logger.log_info(f"tensorrt_llm: accepted but not used by this backend: {ignored}")
        if settings.get("guided_decoding_backend"):
            pb_utils.Logger.log_info(
                f"tensorrt_llm: guided decoding on ({settings['guided_decoding_backend']}, vocabulary from "
                f"{settings.get('tokenizer_dir') or engine_dir})")
        device_ids = settings.get("device_ids")
        device = f"cuda:{device_ids[0]}" if device_ids else None
        # Default: the executor in its own process (engine/executor/engine_process.py), so its loop
        # does not share this stub's GIL with the response threads; engine_process:false keeps it here.
        instances = sum(int(group.get("count", 1)) for group in self.model_config.get("instance_group", [])) or 1
        self.shared_engine = None
        if get_parameter(params, "engine_process", bool) is False:
            if instances > 1:
                raise ValueError(f"tensorrt_llm: engine_process: false keeps the executor in the stub, so it needs "
                                 f"one model instance (instance_group count 1), not {instances}")
            from engine.executor.executor import Executor

            self.executor = Executor(engine_dir, config, device=device)
        elif instances == 1:
            self.executor = EngineProcess(engine_dir, config, device=device)
        else:
            self.shared_engine = open_shared_engine(
                *rendezvous_paths(self.model_name, args["model_version"], self.restarts),
                start=lambda path: EngineProcess(engine_dir, config, device=device, listen_path=path),
                attach=lambda path, owner_alive: EngineProcess.attach(path, owner_alive=owner_alive))
            self.executor = self.shared_engine.engine
            self.executor.on_peer_message = self._on_peer_message
        self.is_engine_owner = self.shared_engine is None or self.shared_engine.is_owner
        logits_config = pb_utils.get_output_config_by_name(self.model_config, "generation_logits")
        logits_dtype = pb_utils.triton_string_to_numpy(logits_config["data_type"]) if logits_config else np.float32
        self.inflight = InflightRequests(decoupled=self.decoupled, decode=self._stream_decoder(params, engine_dir),
                                         logits_dtype=logits_dtype,
                                         first_key=getattr(self.executor, "client_index", 0) * KEY_STRIDE)
        self.lock = threading.Lock()
        self.metrics = TritonMetrics(args["model_name"], args["model_version"],
                                     static_batching=settings.get("batching_type") == "static",
                                     restarts=self.restarts if self.is_engine_owner else 0)
        if self.restarts:
            pb_utils.Logger.log_info(f"tensorrt_llm: engine process restarted ({self.restarts} restarts); serving")
        self.running = True
        self.warned = set()
        start_server_watchdog()
        self._profiler = self._start_profiling() if os.environ.get("TRITONLLM_PROFILE_DIR") else None
        self.threads = [threading.Thread(target=loop, daemon=True, name=loop.__name__)
                        for loop in (self._forward_responses, self._poll_cancellation, self._publish_stats,
                                     self._watch_server_stop)]
        for thread in self.threads:
            thread.start()

    def _stream_decoder(self, params, engine_dir):
        """A token decoder for the streaming UTF-8 holdback, from tokenizer_dir or the engine dir."""
        from serving.tokenization import holdback_decoder_for

        tokenizer_dir = get_parameter(params, "tokenizer_dir", str) or engine_dir
        try:
            return holdback_decoder_for(tokenizer_dir)
        except Exception as error:  # streams still work, only without the holdback
            pb_utils.Logger.log_warn(f"tensorrt_llm: no tokenizer in {tokenizer_dir} ({error}); "
                                     "streamed chunks may split multi-byte characters")
            return None

    # ----------------------------------------------------------------------------- requests

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                tensors = read_inputs(request, self.input_names)
                if is_stop_request(tensors):
                    self._stop(request.request_id(), sender)
                    continue
                if self._server_stopping():
                    raise RuntimeError("the server is shutting down and admits no new requests")
                specs, registration, tracked = self._convert(request, tensors)
                executor_requests = [self._executor_request(spec) for spec in specs]
            except Exception as error:
                self._send_error(sender, conversion_error_message(request.request_id(), error))
                continue
            # Enqueue and register under the lock, so no response can arrive unregistered.
            with self.lock:
                try:
                    exec_ids = self.executor.enqueue_requests(executor_requests)
                except Exception as error:  # e.g. the executor is shut down
                    self._send_error(sender, f"tensorrt_llm could not accept the request: {error}")
                    continue
                self.inflight.add(sender, request.request_id(), specs, exec_ids, **registration)
                if tracked is not None:
                    self._track(exec_ids, tracked)
        return None

    def _convert(self, request, tensors):
        """A Triton request's input tensors -> (its RequestSpecs, keyword arguments of
        InflightRequests.add, per-request state for ``_track`` or None). Another interface over the
        same executor (all_models/llmapi) overrides this and ``_track``."""
        specs = convert_request(tensors, decoupled=self.decoupled, exclude_input_default=self.exclude_input_default,
                                max_input_len=self.max_input_len, encoder_decoder=self.encoder_decoder,
                                request_type=request_type_of(request.parameters()),
                                rotary_width=self.rotary_width, cross_attention=self.cross_attention,
                                kv_transfer=kv_transfer_of(request.parameters()))
        registration = {"errors_as_output": wants_errors_as_output(request.parameters()),
                        "requested_outputs": requested_outputs(request)}
        return specs, registration, None

    def _track(self, exec_ids, tracked) -> None:
        """Keep ``_convert``'s per-request state once the request is registered (under self.lock)."""

    @staticmethod
    def _executor_request(spec):
        request = to_executor_request(spec)
        request.output.return_perf_metrics = True  # always: the latency histograms use it
        return request

    def _stop(self, user_id, sender):
        """A stop request cancels every executor request of the live request with that id (held
        by this instance or, with a shared engine, by another one)."""
        if not user_id:
            self._send_error(sender, MISSING_STOP_ID)
            return
        self._stop_local(user_id)
        if self.shared_engine is not None:
            self.executor.send_peer_message(("stop", user_id))
        sender.send(pb_utils.InferenceResponse(output_tensors=[]), flags=FINAL)

    def _stop_local(self, user_id):
        with self.lock:
            exec_ids = self.inflight.stop(user_id)
        for exec_id in exec_ids:
            self.executor.cancel_request(exec_id)

    def _on_peer_message(self, message):
        """From another instance through the shared engine process (its reader thread)."""
        if message[0] == "stop":
            self._stop_local(message[1])

    @staticmethod
    def _send_error(sender, message):
        sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message)),
                    flags=FINAL)

    # ----------------------------------------------------------------------------- threads

    def _start_profiling(self):
        """Diagnostics ($TRITONLLM_PROFILE_DIR): a cProfile of this stub's threads and a GIL probe,
        rewritten every 3 s. They cost time themselves; not for measuring throughput.

        One profiler: from Python 3.12 cProfile sees every thread (sys.monitoring is process-wide)
        and refuses a second active one; before 3.12 it sees only the forwarding thread."""
        import cProfile
        self._gil_lateness = []

        def probe():  # how late a 0.5 ms sleep wakes: long waits mean another thread holds the GIL
            while self.running:
                started = time.perf_counter()
                time.sleep(0.0005)
                self._gil_lateness.append(time.perf_counter() - started - 0.0005)
                del self._gil_lateness[:-20000]

        threading.Thread(target=probe, daemon=True, name="gil-probe").start()
        return cProfile.Profile()

    def _dump_profiles(self):
        import io
        import pstats
        late = sorted(self._gil_lateness)
        if late:
            with open(os.path.join(os.environ["TRITONLLM_PROFILE_DIR"], "gil_probe.txt"), "w") as f:
                f.write(f"0.5 ms sleeps: {len(late)}, lateness ms p50 {late[len(late) // 2] * 1e3:.3f} "
                        f"p90 {late[int(len(late) * 0.9)] * 1e3:.3f} p99 {late[int(len(late) * 0.99)] * 1e3:.3f} "
                        f"max {late[-1] * 1e3:.3f}\n")
        stream = io.StringIO()
        try:
            pstats.Stats(self._profiler, stream=stream).sort_stats("tottime").print_stats(60)
        except TypeError:  # nothing recorded yet
            return
        with open(os.path.join(os.environ["TRITONLLM_PROFILE_DIR"], "stub_threads.txt"), "w") as f:
            f.write(stream.getvalue())

    def _forward_responses(self):
        last_dump = time.monotonic()
        if self._profiler:
            self._profiler.enable()
        while self.running:
            if self._profiler and time.monotonic() - last_dump > 3:
                self._dump_profiles()
                self._profiler.enable()
                last_dump = time.monotonic()
            try:
                responses = self.executor.await_responses(timeout=0.05)
            except Exception as error:
                pb_utils.Logger.log_error(f"tensorrt_llm: await_responses failed: {error}")
                time.sleep(0.05)
                continue
            for response in responses:
                with self.lock:
                    sends, finished = self.inflight.on_response(response)
                for send in sends:
                    self._deliver(send)
                for item in finished:
                    self.metrics.observe_finished(item)

    def _deliver(self, send):
        if send.error is not None:
            response = pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(send.error))
        else:
            response = pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor(name, value) for name, value in send.tensors.items()])
        try:
            send.sender.send(response, flags=FINAL if send.final else 0)
        except Exception as error:  # the client is gone: stop generating for it
            with self.lock:
                exec_ids = self.inflight.cancel_key(send.key)
            for exec_id in exec_ids:
                self.executor.cancel_request(exec_id)
            if exec_ids:
                pb_utils.Logger.log_verbose(f"tensorrt_llm: a send failed ({error}); request cancelled")

    def _poll_cancellation(self):
        while self.running:
            time.sleep(self.cancellation_period)
            with self.lock:
                exec_ids = self.inflight.newly_cancelled()
            for exec_id in exec_ids:
                self.executor.cancel_request(exec_id)

    def _publish_stats(self):
        while self.running:
            time.sleep(self.stats_period)
            self._recover_if_engine_failed()
            if self._server_stopping():
                return  # calls into a stopping server may block; nobody scrapes gauges now
            try:
                stats = self.executor.get_latest_iteration_stats()
                if stats is not None:
                    self.metrics.update_gauges(stats)
                with self.lock:
                    counts = dataclasses.replace(self.inflight.stream_counts)
                self.metrics.publish_stream_counts(counts)
            except Exception as error:
                self._warn_once(f"tensorrt_llm: could not publish stats: {error}")

    def _watch_server_stop(self):
        """Graceful shutdown (serving/server_stop.py says why and how): once the server begins to
        stop, admit nothing new, give running requests graceful_shutdown_timeout_ms to finish, end
        the rest with a clear error, and only then let the server stop its core."""
        endpoint = server_http_endpoint()
        if endpoint is None:
            pb_utils.Logger.log_warn("tensorrt_llm: the server has no HTTP endpoint, so a shutdown is not "
                                     "seen early; long requests may hold it for its exit timeout")
            return
        hooks = ShutdownHooks(has_requests=self._has_requests, end_requests=self._end_unfinished_requests,
                              paused=lambda: self.restart_requested,
                              log=lambda message: pb_utils.Logger.log_info(f"tensorrt_llm: {message}"))
        self.stop_watcher = ServerStopWatcher(endpoint, self.shutdown_grace, hooks)
        self.stop_watcher.watch(lambda: self.running)

    def _server_stopping(self):
        return self.stop_watcher is not None and self.stop_watcher.stopping

    def _has_requests(self):
        with self.lock:
            return bool(self.inflight.triton_requests)

    def _end_unfinished_requests(self):
        with self.lock:
            count = len(self.inflight.triton_requests)
            exec_ids = self.inflight.fail_all(SHUTTING_DOWN)
        for exec_id in exec_ids:
            self.executor.cancel_request(exec_id)
        return count

    def _recover_if_engine_failed(self):
        """Once the executor cannot serve (a dead engine process, a lost rank in leader mode; its
        requests have already failed with that error), unload this model, so that it and the
        ensemble report not ready; after an engine process death, `finalize` loads it again."""
        failure = self.executor.failure
        if failure is None or self.restart_requested:
            return
        if not self.is_engine_owner:  # the instance that started the engine unloads the model
            self.restart_requested = True  # (or it is being unloaded anyway: no error to log here)
            pb_utils.Logger.log_info(f"tensorrt_llm: this instance's shared engine is gone: {failure}")
            return
        self.restart_requested = True
        self.restartable = self._leader_mode_world_size() == 1
        action = "restarting the engine process" if self.restartable else "unloading the model (not ready)"
        pb_utils.Logger.log_error(f"tensorrt_llm: {failure}; {action}")
        threading.Thread(target=self._unload_self, daemon=True, name="unload-on-engine-failure").start()

    @staticmethod
    def _run_as_worker_rank_unless_leader(engine_dir):
        """On a rank other than 0 of a leader-mode job started as tritonservers (NVIDIA's Slurm and
        Kubernetes recipes), be that rank's engine worker: blocks, then raises (serving/worker_rank.py)."""
        from engine.tensor_parallel.rank_info import rank_info_from_env

        rank = rank_info_from_env().rank
        if rank == 0:
            return
        from engine.executor.engine_process import engine_python
        from serving.worker_rank import run_worker_rank

        pb_utils.Logger.log_info(f"tensorrt_llm: rank {rank} of a leader-mode job: running its engine worker here; "
                                 "this server never serves (rank 0 does)")
        run_worker_rank(engine_dir, rank, engine_python())

    @staticmethod
    def _leader_mode_world_size():
        from engine.tensor_parallel.rank_info import rank_info_from_env

        return rank_info_from_env().world_size

    def _unload_self(self):
        try:
            pb_utils.unload_model(self.model_name)
            self.reload_in_finalize = self.restartable  # not when the server itself is stopping
        except Exception as error:  # not in explicit model-control mode: requests keep failing clearly
            pb_utils.Logger.log_error(
                f"tensorrt_llm: could not unload itself to restart the engine ({error}); start "
                "tritonserver with --model-control-mode=explicit --load-model=* (the launcher does)")

    def _reload_self(self):
        """Called from `finalize` after an engine death: load this model again (a fresh engine
        process in `initialize`); Triton reports it not ready until that load completes."""
        config = json.loads(json.dumps(self.model_config))
        config.setdefault("parameters", {})[RESTARTS_PARAMETER] = {"string_value": str(self.restarts + 1)}
        try:
            pb_utils.load_model(self.model_name, config=json.dumps(config))
        except Exception as error:
            pb_utils.Logger.log_error(f"tensorrt_llm: could not load itself again after the engine "
                                      f"died: {error}")

    def _warn_once(self, message):
        if message not in self.warned:
            self.warned.add(message)
            pb_utils.Logger.log_warn(message)

    def finalize(self):
        started = time.monotonic()
        self.running = False
        # One deadline for the four loops, not a timeout each (serving/loop_threads.py says why): each
        # sees `running` within its period, the stop watcher within its liveness requests' timeouts.
        stuck = join_by_deadline(self.threads, max(self.cancellation_period, self.stats_period)
                                 + LOOP_STOP_MARGIN_S)
        loops_s = time.monotonic() - started
        if stuck:  # to the log directly: a logging call through the backend could block as they do
            print(f"tensorrt_llm: unloading without waiting for threads blocked in a call: {where_blocked(stuck)}",
                  file=sys.__stderr__, flush=True)
        self.executor.shutdown()
        took = time.monotonic() - started
        if took > SLOW_UNLOAD_S:  # Ctrl-C waits for it: say where the time went
            print(f"tensorrt_llm: finalize took {took:.1f} s (loop threads {loops_s:.1f} s, the engine process's "
                  f"shutdown {took - loops_s:.1f} s)", file=sys.__stderr__, flush=True)
        if self.shared_engine is not None:
            self.shared_engine.release()
        if getattr(self, "reload_in_finalize", False):
            self._reload_self()
        stop_crash_dumps()
