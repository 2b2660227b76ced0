"""Hugging Face checkpoints in and out: `python -m maxctx.convert from_hf|to_hf ...` (see maxctx.convert.cli).

    safetensors.py  the file format, read and written with numpy, tensor by tensor
    hf_layout.py    config.json <-> model keys, HF tensor names and layouts <-> maxctx parameters
    streaming.py    Orbax checkpoints written and read one parameter at a time
    from_hf.py      HF directory -> maxctx parameter checkpoint (load_parameters_path)
    to_hf.py        maxctx checkpoint -> HF directory (sharded safetensors, index, config.json)
"""
