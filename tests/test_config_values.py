"""Config values the code downstream would reject with a traceback are refused up front in one line (issue 13,
item 8), and YAML syntax errors say file, line and column."""

import pytest

from maxctx.config import ConfigError
from maxctx.loader import load_config
from maxctx.train import main
from tests.support.processes import BASE_YML


@pytest.mark.parametrize("value, message", [
    ("seed=-1", "seed=-1 must be >= 0"),  # was ValueError: expected non-negative integer (jax.random.key)
    ("data_shuffle_seed=-1", "data_shuffle_seed=-1 must be >= 0"),
    ("adam_b1=-1", "adam_b1=-1.0 must be in [0, 1)"),  # was a NaN stop at step 2
    ("adam_b2=1e30", "adam_b2=1e+30 must be in [0, 1)"),
    ("adam_eps=-1", "adam_eps=-1.0 must be >= 0"),
    ("adam_weight_decay=-1", "adam_weight_decay=-1.0 must be >= 0"),
    ("gradient_clipping_threshold=-1", "gradient_clipping_threshold=-1.0 must be >= 0"),
    ("cosine_learning_rate_final_fraction=-1", "cosine_learning_rate_final_fraction=-1.0 must be in [0, 1]"),
    ("normalization_layer_epsilon=-1", "normalization_layer_epsilon=-1.0 must be >= 0"),
    ("vocab_size=1000000000000", "vocab_size=1000000000000 is beyond int32"),  # was numpy's 29 TiB allocation
    ("max_target_length=1000000000000", "max_target_length=1000000000000 is beyond int32"),  # was a JAX traceback
    ("gradient_accumulation_steps=1000000000000", "gradient_accumulation_steps=1000000000000 is beyond int32"),
    ("per_device_batch_size=1e30", "tokens per device per step is beyond int32"),  # was killed for host memory
])
def test_values_that_tracebacked_downstream_are_config_errors(value, message):
    with pytest.raises(ConfigError) as error:
        load_config([str(BASE_YML), value])
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


@pytest.mark.parametrize("text, where", [
    ("steps: 3\nfoo: [1, 2\nbar: 1\n", "line 3, column 4: expected ',' or ']', but got ':' (while parsing a flow "
                                       "sequence started at line 2, column 6)"),
    ("steps: 3\n  bad: :\n", "line 2, column 6: mapping values are not allowed here"),
    ('steps: "3\n', "line 2, column 1: found unexpected end of stream"),
])
def test_yaml_syntax_errors_give_file_line_and_column(tmp_path, capsys, text, where):
    path = tmp_path / "run.yml"
    path.write_text(text)
    assert main([str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"config error: config file '{path}', {where}"), err
    assert err.endswith("; fix the YAML there") and len(err.splitlines()) == 1, err
