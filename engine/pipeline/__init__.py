"""Pipeline parallelism: an engine's decoder layers split into ``pp_size`` stages, one per group of
``tp_size`` ranks (rank = stage * tp_size + tp_rank, as TensorRT-LLM's mapping numbers them).

    layout.py   which layers each stage holds (even, or an explicit split), rank <-> (stage, tp rank),
                and the build's split of one tensor-parallel rank's weights into its stages' files
    stage.py    a model trimmed to one stage, and its forward (embed on the first stage, the final
                norm and logits on the last, hidden states in between)
    runner.py   StageRunner: one rank's stage with its own KV pool (its layers only), running each
                step as micro-batches that flow stage to stage over torch.distributed send/recv,
                decode micro-batches through the stage's own CUDA graphs
    step_cost.py  how many micro-batches a step is cut into (one pass over a stage's weights per
                micro-batch against the work that splits), and when steps in flight pay
    in_flight.py  several steps in flight: the executor launches a step on stage 0 before it samples
                the one before, each step with its own sequences, where the cost model says they
                pay (TRITONLLM_PP_STEPS_IN_FLIGHT overrides)
"""
