"""Hugging Face checkpoints in and out: `python -m maxctx.convert from_hf|to_hf ...` (see maxctx.convert.cli).

    safetensors.py  the file format, read and written with numpy, tensor by tensor
    streaming.py    Orbax checkpoints written and read one parameter at a time
    from_hf.py      HF directory -> maxctx parameter checkpoint (load_parameters_path)
    to_hf.py        maxctx checkpoint -> HF directory (sharded safetensors, index, config.json)
    cli.py          the command line of from_hf and to_hf (`__main__.py` runs it)

A family's own layout (config.json <-> model keys, HF tensor names <-> maxctx parameters) is its `hf_layout`
(maxctx.model.llama.hf_layout for Llama/Mistral).
"""
