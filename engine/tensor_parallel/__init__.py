"""Leader mode across ranks: one rank per GPU running one tensor-parallel engine.

    distributed.py    process groups, the leader's runner (LeaderRunner) and the workers' loop
    step_protocol.py  what rank 0 sends every rank before each step, and the channel that carries it
    shm_broadcast.py  the shared-memory plan segment used when every rank is on one node
    worker.py         ``python -m engine.tensor_parallel.worker``: a non-leader rank's process
    rank_info.py      this process's rank and world size from the launcher's environment (no torch)
"""
