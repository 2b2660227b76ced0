"""Evals: the eval split's loss (also by position in the document) and the passkey grid, in training and from
`python -m maxctx.evaluate`.

    step.py       the jitted eval step: loss sums, position buckets, per-row all-answers-right
    loop.py       Evaluator: the eval split and the passkey grid every eval_interval steps, to the metric writers
    passkey.py    the passkey grid: examples from the run's eval data or tokenizer, scored by teacher forcing
    cli.py        `python -m maxctx.evaluate`: the same evals on a checkpoint or a converted model
"""
