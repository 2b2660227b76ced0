"""Code shared by the tests (and the benchmarks), kept out of the `maxctx` package:

- processes: child processes (their environments, `python train.py ...` commands, free ports) and the metrics a
  run wrote;
- meshes: small CP meshes over the simulated CPU devices and fast-compile options;
- hlo: collective bytes of a compiled program, read from its HLO text;
- tpu_compile: `python -m maxctx.compile` for an abstract TPU topology in a subprocess, its report read back;
- fixtures: tiny generated corpora (text, a sentencepiece model, ArrayRecord shards, a TFDS dataset);
- hooked_train.py: train.py with test hooks (a slow checkpoint write, SIGTERM after a step).
"""
