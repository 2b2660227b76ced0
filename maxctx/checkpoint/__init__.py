"""Checkpoints you can trust, and the run they belong to.

    manager.py        Checkpointer: Orbax saves on a period, verified restore, fallback to the last good step
    steps.py          a checkpoints directory's steps: listing, setting aside, load paths
    local_tier.py     the local tier: each host's own shards on its own disk, often; resumed on the same slice
    data_position.py  the data-iterator state a step resumes from, on any process count
    integrity.py      each item's sizes and CRC-32, recorded at save and checked at restore
    failure.py        failed saves (disk full, quota, I/O): the `checkpoint_failure_policy`
    compatibility.py  a checkpoint against the config resuming it (shapes, seed, data source)
    preemption.py     SIGTERM and Ctrl-C: the step every process agrees to save at
    divergence.py     known-good states; a non-finite state is never saved
    run_dir.py        the run directory and the lock that gives it one live run

Nothing is imported here, so that importing one module does not import the manager and its JAX.
"""
