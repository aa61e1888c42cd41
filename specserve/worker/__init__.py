"""Workers: what executes a step. ``step.py`` holds the records a step flows through
(:class:`StepBatch` in, :class:`StepResult` out), ``model_runner.py`` runs one model over flat
ragged batches, ``target_worker.py`` runs the target and samples. The speculative worker that wraps
the target worker lives with the methods, in :mod:`specserve.spec_decode.worker`."""
