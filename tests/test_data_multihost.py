"""Multi-host loading: two local processes with four CPU devices each (jax.distributed on 127.0.0.1) build the
global batch from per-host rows.

- Context parallelism over all 8 devices spans both processes: both hold every row (half the columns each), form
  one loading group, and the assembled global batch equals the single-process batch of the same config.
- fsdp=4 x context=2: each process holds half the rows; the two read disjoint documents, and the data position
  both save is one global state, from which one process reads on.
"""

import json
import subprocess
import sys

import numpy as np
import pytest

from maxctx.attention.cp.load_balance import restore_order
from maxctx.data.pipeline import create_data_iterator
from maxctx.data.sources import encode_tokens
from maxctx.loader import load_config
from maxctx.mesh import create_mesh
from tests.support import fixtures as F
from tests.support.processes import ROOT, cpu_env, free_port

SEQ, STEPS = 64, 2
CASES = {
    "context_spans_processes": ["ici_context_parallelism=8", "ici_fsdp_parallelism=1", "per_device_batch_size=0.25"],
    "rows_split_over_processes": ["ici_fsdp_parallelism=4", "ici_context_parallelism=2", "per_device_batch_size=1"],
}

WORKER = r"""
import json, sys
import numpy as np
from maxctx import runtime
from maxctx.loader import load_config

pid, port, out, cases = int(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
common = [f"jax_coordinator_address=127.0.0.1:{port}", "jax_num_processes=2", f"jax_process_id={pid}",
          "cpu_devices=4"]
runtime.initialize(load_config(common + next(iter(cases.values()))))
from maxctx.data.pipeline import create_data_iterator
from maxctx.mesh import create_mesh

result = {}
for name, overrides in cases.items():
    config = load_config(common + overrides)
    it = create_data_iterator(config, create_mesh(config), "train")
    shards = []
    for step in range({steps}):
        batch = next(it)
        for key, value in batch.items():
            for shard in value.addressable_shards:
                rows, cols = shard.index
                shards.append([step, key, rows.start or 0, cols.start or 0, np.asarray(shard.data).tolist()])
    result[name] = {{"shards": shards, "state": it.get_state(), "local_rows": it.layout.local_rows,
                     "shard": [it.layout.shard_index, it.layout.shard_count]}}
    it.close()
with open(out, "w") as f:
    json.dump(result, f)
""".replace("{steps}", str(STEPS)).replace("{{", "{").replace("}}", "}")


@pytest.fixture(scope="module")
def shards_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("multihost")
    rng = np.random.default_rng(0)
    # Document i starts with the token 10 + i, so a batch says which documents it holds.
    docs = [[10 + i, *rng.integers(100, 250, size=rng.integers(5, 40))] for i in range(64)]
    return F.write_arrayrecord(str(root / "docs.array_record"), [encode_tokens(d) for d in docs]), root


def data_args(path):
    return ["dataset_type=arrayrecord", f"grain_train_files={path}", f"max_target_length={SEQ}", "packing=none"]


@pytest.fixture(scope="module")
def two_processes(shards_file):
    path, root = shards_file
    port = free_port()
    script = root / "worker.py"
    script.write_text(WORKER)
    cases = json.dumps({name: data_args(path) + args for name, args in CASES.items()})
    procs = [subprocess.Popen([sys.executable, str(script), str(pid), str(port), str(root / f"out{pid}.json"), cases],
                              cwd=ROOT, env=cpu_env(PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for pid in range(2)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return [json.loads((root / f"out{pid}.json").read_text()) for pid in range(2)]


def assemble(results, name, step, key, shape):
    """The global array from both processes' addressable shards; replicas must agree."""
    out = np.full(shape, -1, np.float64)
    for result in results:
        for s, k, row, col, data in result[name]["shards"]:
            if (s, k) == (step, key):
                data = np.asarray(data)
                block = out[row:row + data.shape[0], col:col + data.shape[1]]
                assert ((block == -1) | (block == data)).all(), "replicated shards differ"
                block[...] = data
    assert (out != -1).all(), "every element of the global batch is held by some device"
    return out


def single_process_batches(path, overrides, steps=STEPS):
    config = load_config(data_args(path) + overrides)
    it = create_data_iterator(config, create_mesh(config), "train")
    batches = [{k: np.asarray(v) for k, v in next(it).items()} for _ in range(steps)]
    it.close()
    return batches


def test_context_axis_spanning_processes_gives_the_single_process_batch(two_processes, shards_file):
    name = "context_spans_processes"
    for result in two_processes:
        assert result[name]["local_rows"] == 2 and result[name]["shard"] == [0, 1]
    expected = single_process_batches(shards_file[0], CASES[name])
    for step in range(STEPS):
        for key, value in expected[step].items():
            np.testing.assert_array_equal(assemble(two_processes, name, step, key, value.shape), value)


def test_processes_holding_different_rows_read_disjoint_documents(two_processes):
    name = "rows_split_over_processes"
    assert [r[name]["shard"] for r in two_processes] == [[0, 2], [1, 2]]
    assert [r[name]["local_rows"] for r in two_processes] == [4, 4]
    seen = [set(), set()]
    for step in range(STEPS):
        inputs = restore_order(assemble(two_processes, name, step, "inputs", (8, SEQ)), 2).astype(int)
        assert (inputs[:, 0] == 1).all()
        seen[0].update(inputs[:4, 1])  # rows 0-3 live on process 0's devices, 4-7 on process 1's
        seen[1].update(inputs[4:, 1])
    assert len(seen[0]) == len(seen[1]) == 4 * STEPS
    assert not seen[0] & seen[1]


def test_the_position_is_global_and_one_process_reads_on_from_it(two_processes, shards_file):
    """Both processes saved the same state (the global row stream's); one process of 8 devices restored from it
    reads the batch the straight single-process run reads next."""
    name = "rows_split_over_processes"
    states = [r[name]["state"] for r in two_processes]
    assert states[0] == states[1] and "process_count" not in states[0]
    config = load_config(data_args(shards_file[0]) + CASES[name])
    expected = single_process_batches(shards_file[0], CASES[name], steps=STEPS + 1)[-1]
    resumed = create_data_iterator(config, create_mesh(config), "train")
    resumed.set_state(json.loads(json.dumps(states[0])))
    for key, value in next(resumed).items():
        np.testing.assert_array_equal(np.asarray(value), expected[key])
    resumed.close()
