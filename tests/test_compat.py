"""MaxText users feel at home: MaxText's command lines load (entry point and config path changed, shell variables
filled in), its keys mean what they mean there, a key maxctx lacks gets "MaxText's X is not supported by maxctx",
config precedence is base.yml < preset < the user's YAML < command line, and a run's config.yml reruns it."""

from __future__ import annotations

import dataclasses
import os
import shlex

import pytest

from maxctx.config import ConfigError
from maxctx.loader import load_config, save_config

BASE = "configs/base.yml"


@pytest.fixture
def place(tmp_path, monkeypatch):
    """A working directory holding what MaxText's commands point at: a TFDS data dir, tokenizer files, ArrayRecord
    shards (load_config checks that input files exist; what is in them is the data pipeline's business)."""
    for name in ("data", "out", "gcsfuse/array-record/c4/en/3.0.1", "assets"):
        (tmp_path / name).mkdir(parents=True)
    for name in ("assets/tokenizer.llama2", "assets/tokenizer_llama3.tiktoken",
                 "gcsfuse/array-record/c4/en/3.0.1/c4-train.array_record-00000-of-00002"):
        (tmp_path / name).write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def maxtext(command: str, place) -> list[str]:
    """A MaxText command line as maxctx arguments: its config path replaced, $VARIABLES filled in."""
    values = {"OUT": str(place / "out"), "DATASET_PATH": str(place / "data"), "CKPT": str(place / "ckpt"),
              "ASYNC": "true", "DATASET_TYPE": "tfds", "REUSE": "0", "MTP": "0", "STEPS": "20", "EVAL_STEPS": "5",
              "EVAL_INTERVAL": "10", "PDBS": "4"}
    args = shlex.split(command)
    args = [a for a in args if not a.endswith("base.yml")]
    for key, value in values.items():
        args = [a.replace(f"${key}", value) for a in args]
    return [os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), BASE), *args]


# From MaxText's docs, end-to-end scripts and recipes (after the config path): what should load.
LOADS = {
    "first_run": "run_name=first base_output_directory=$OUT dataset_type=synthetic steps=10",
    "llama2_7b_finetune": "load_parameters_path=$CKPT run_name=runner_finetuning base_output_directory=$OUT "
                          "dataset_path=$DATASET_PATH async_checkpointing=$ASYNC per_device_batch_size=1 "
                          "model_name='llama2-7b' ici_tensor_parallelism=4 steps=10 max_target_length=1024 "
                          "per_device_batch_size=1 checkpoint_period=5",
    "llama2_context_parallel": "ici_context_parallelism=-1 ici_fsdp_parallelism=1 enable_checkpointing=false "
                               "base_output_directory=$OUT dataset_path=$DATASET_PATH run_name=context_test "
                               "enable_goodput_recording=false monitor_goodput=false per_device_batch_size=10 "
                               "steps=30 profiler=xplane profiler_steps=20 max_target_length=65536",
    "gpu_llama2_7b": "run_name=gpu hardware=gpu steps=30 dcn_data_parallelism=1 ici_fsdp_parallelism=8 "
                     "per_device_batch_size=4 max_target_length=4096 model_name=llama2-7b enable_checkpointing=true "
                     "attention=cudnn_flash_te remat_policy=minimal_flash use_iota_embed=true scan_layers=false "
                     "dataset_type=synthetic async_checkpointing=$ASYNC base_output_directory=$OUT",
    "convergence_1b": "steps=$STEPS eval_steps=$EVAL_STEPS eval_interval=$EVAL_INTERVAL per_device_batch_size=$PDBS "
                      "learning_rate=3e-4 enable_checkpointing=false max_target_length=2048 global_parameter_scale=1 "
                      "metrics_file=metrics.txt base_output_directory=$OUT dataset_path=$DATASET_PATH "
                      "dataset_type=$DATASET_TYPE log_period=150 remat_policy=minimal enable_data_shuffling=false "
                      "mtp_num_layers=$MTP",
    "determinism": "run_name=det_1 steps=5 metrics_file=run_1_metrics.txt enable_checkpointing=False "
                   "enable_data_shuffling=True enable_dropout=False base_output_directory=$OUT "
                   "dataset_path=$DATASET_PATH",
    "grain": "run_name=grain base_output_directory=$OUT dataset_type=grain grain_file_type=arrayrecord "
             "grain_train_files=gcsfuse/array-record/c4/en/3.0.1/c4-train.array_record* grain_worker_count=2",
    "v5p_llama2_7b": "model_name=llama2-7b base_output_directory=$OUT dataset_path=$DATASET_PATH "
                     "tokenizer_path=assets/tokenizer.llama2 remat_policy=minimal per_device_batch_size=4 steps=30 "
                     "enable_checkpointing=false use_iota_embed=true max_target_length=4096 profiler=xplane "
                     "skip_first_n_steps_for_profiler=10 profiler_steps=5 gcs_metrics=true dataset_type=$DATASET_TYPE "
                     "reuse_example_batch=$REUSE",
    "v5p_llama2_70b": "model_name=llama2-70b base_output_directory=$OUT dataset_path=$DATASET_PATH "
                      "tokenizer_path=assets/tokenizer.llama2 remat_policy=save_dot_except_mlpwi "
                      "per_device_batch_size=4 steps=30 enable_checkpointing=false use_iota_embed=true "
                      "max_target_length=4096 profiler=xplane skip_first_n_steps_for_profiler=10 profiler_steps=5 "
                      "gcs_metrics=true dataset_type=$DATASET_TYPE reuse_example_batch=$REUSE",
    "aot_scaled_default": "run_name=example global_parameter_scale=16 per_device_batch_size=4 steps=10000 "
                          "learning_rate=1e-3 base_output_directory=$OUT dataset_path=$DATASET_PATH",
    "mistral_offload": "model_name=mistral-7b per_device_batch_size=6 ici_fsdp_parallelism=-1 remat_policy=custom "
                       "decoder_layer_input=offload out_proj=offload query_proj=offload key_proj=offload "
                       "value_proj=offload max_target_length=8192 attention=flash use_iota_embed=True "
                       "dataset_path=$DATASET_PATH dataset_type=synthetic enable_checkpointing=False sa_block_q=2048 "
                       "sa_block_kv=2048 sa_block_kv_compute=2048 sa_block_q_dkv=2048 sa_block_kv_dkv=2048 "
                       "sa_block_kv_dkv_compute=2048 sa_block_q_dq=2048 sa_block_kv_dq=2048 profiler=xplane",
    "usp": "dataset_type=synthetic steps=2 enable_checkpointing=False enable_goodput_recording=False "
           "base_num_query_heads=4 base_num_kv_heads=4 max_target_length=128 attention=flash "
           "ici_context_parallelism=2 ici_context_usp_ulysses_parallelism=2 context_parallel_strategy=usp "
           "context_parallel_load_balance=false packing=false",
    "tiktoken": "tokenizer_path=assets/tokenizer_llama3.tiktoken tokenizer_type=tiktoken packing=false",
    "v6e_llama2_7b_blocks": "model_name=llama2-7b steps=15 per_device_batch_size=12 enable_checkpointing=false "
                            "remat_policy=full ici_fsdp_parallelism=-1 max_target_length=4096 "
                            "base_output_directory=$OUT reuse_example_batch=1 dataset_type=synthetic "
                            "gcs_metrics=true attention='flash' sa_block_q=1024 sa_block_q_dkv=2048 "
                            "sa_block_q_dq=2048",
    "v5e_llama3_8b": "model_name=llama3-8b base_output_directory=$OUT dataset_path=$DATASET_PATH "
                     "max_target_length=8192 tokenizer_path=assets/tokenizer_llama3.tiktoken per_device_batch_size=1 "
                     "remat_policy=full ici_fsdp_transpose_parallelism=16 steps=30 enable_checkpointing=false",
    # v5e/1b-tfds-eval.sh without its eval_batch_num=5, which is no MaxText key (test_unknown_keys_...)
    "tfds_eval": "steps=19 per_device_batch_size=8 enable_checkpointing=False max_target_length=2048 "
                 "global_parameter_scale=1 base_output_directory=$OUT dataset_path=$DATASET_PATH run_name=eval "
                 "eval_per_device_batch_size=4 eval_interval=10",
}
# ... and what maxctx refuses, each with its one line.
REFUSED = {
    "fp8": ("quantization=fp8 dataset_type=synthetic", "MaxText's quantization=fp8 is not supported by maxctx"),
    "hf": ("dataset_type=hf", "MaxText's dataset_type=hf is not supported by maxctx"),
    "llama4": ("model_name=llama4-17b-16e attention=flash", "MaxText's model_name=llama4-17b-16e is not supported "
               "by maxctx: mixture-of-experts"),
}


@pytest.mark.parametrize("name", sorted(LOADS))
def test_maxtext_command_lines_load(name, place):
    load_config(maxtext(LOADS[name], place))


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_maxtext_features_maxctx_lacks_are_named(name, place):
    command, message = REFUSED[name]
    with pytest.raises(ConfigError, match=message):
        load_config(maxtext(command, place))


def test_maxtext_meanings(place):
    c = load_config(maxtext(LOADS["llama2_context_parallel"], place))
    assert (c.tfds_data_dir, c.dataset_type, c.profile_start_step, c.profile_steps) == (
        str(place / "data"), "tfds", 1, 20)  # dataset_path: TFDS, MaxText's default pipeline
    c = load_config(maxtext(LOADS["gpu_llama2_7b"], place))
    assert (c.attention, c.remat_policy, c.use_iota_embed, c.hardware) == ("cudnn", "minimal_flash", True, "gpu")
    c = load_config(maxtext(LOADS["grain"], place))
    assert c.dataset_type == "arrayrecord" and c.grain_worker_count == 2
    c = load_config(maxtext(LOADS["v6e_llama2_7b_blocks"], place))  # splash's backward blocks, MaxText's sa_block_*
    assert (c.flash_block_q, c.flash_block_kv, c.flash_block_q_dkv, c.flash_block_q_dq, c.flash_block_kv_dkv) == (
        1024, 512, 2048, 2048, 0)
    assert load_config([BASE, "sa_use_fused_bwd_kernel=true"]).splash_fused_backward
    # fsdp_transpose: folded into fsdp (-1 still fills the rest; an explicit fsdp is multiplied)
    assert load_config(maxtext(LOADS["v5e_llama3_8b"], place)).ici_fsdp_parallelism == -1
    c = load_config([BASE, "ici_fsdp_parallelism=2", "ici_fsdp_transpose_parallelism=4",
                     "dcn_fsdp_transpose_parallelism=2"])
    assert (c.ici_fsdp_parallelism, c.dcn_fsdp_parallelism) == (8, 2)
    with pytest.raises(ConfigError, match="both -1"):
        load_config([BASE, "ici_fsdp_transpose_parallelism=-1"])
    c = load_config(maxtext(LOADS["usp"], place))  # MaxText: ring 2 x ulysses 2 = our C = 4, A2A degree 2
    assert (c.ici_context_parallelism, c.context_parallel_a2a_degree, c.packing) == (4, 2, "none")
    c = load_config([BASE, "tokenizer_path=assets/tokenizer_llama3.tiktoken"])  # MaxText infers tiktoken
    assert c.tokenizer_type == "tiktoken"
    assert load_config([BASE, "model_name=llama3-8b", "rope_type=llama3.1"]).rope_type == "llama3"
    assert load_config([BASE, "tokenizer_path=assets/tokenizer_llama3.tiktoken",
                        "tokenizer_type=huggingface"]).tokenizer_type == "huggingface"
    # global_parameter_scale=16 on MaxText's default model: heads and MLP x4, width x2, layers x2.
    c = load_config(maxtext(LOADS["aot_scaled_default"], place) + ["model_name=default"])
    assert (c.base_emb_dim, c.base_num_query_heads, c.base_mlp_dim, c.base_num_decoder_layers) == (
        4096, 64, 28672, 32)
    c = load_config([BASE, "steps=-1", "learning_rate_schedule_steps=40", "eval_interval=-1",
                     "max_num_checkpoints_to_keep=None", "init_weights_seed=7", "learning_rate_final_fraction=0.05",
                     "attention=autoselected", "train_split=train[:90%]", "context_parallel_strategy=RING"])
    assert (c.steps, c.eval_interval, c.max_num_checkpoints_to_keep, c.seed) == (40, 0, 0, 7)
    assert (c.cosine_learning_rate_final_fraction, c.attention, c.dataset_split) == (0.05, "auto", "train[:90%]")
    assert c.context_parallel_strategy == "p2p"


def test_maxtext_eval_keys(place):
    c = load_config(maxtext(LOADS["tfds_eval"], place) + ["cpu_devices=2"])
    assert (c.eval_per_device_batch_size, c.eval_batch_size(2), c.global_batch_size(2)) == (4, 8, 16)
    c = load_config(maxtext(LOADS["tfds_eval"], place) + ["eval_steps=-1", "eval_per_device_batch_size=-1"])
    assert (c.eval_steps, c.eval_per_device_batch_size, c.eval_batch_size(2)) == (-1, 0, 16)  # the whole split
    with pytest.raises(ConfigError, match="eval_steps=-1 .* synthetic data does not"):
        load_config([BASE, "eval_interval=5", "eval_steps=-1"])
    with pytest.raises(ConfigError, match="eval_per_device_batch_size=0.25 x 2 devices = 0.5 sequences"):
        load_config([BASE, "cpu_devices=2", "eval_interval=5", "eval_per_device_batch_size=0.25"])
    with pytest.raises(ConfigError, match=r"eval_steps=-2 must be > 0, 0 \(no eval batches"):
        load_config([BASE, "eval_steps=-2"])


def test_a_command_naming_data_never_trains_on_synthetic(place):
    assert load_config([BASE, f"dataset_path={place / 'data'}"]).dataset_type == "tfds"
    assert load_config([BASE, "dataset_name=my_corpus:1.0.0"]).dataset_type == "tfds"
    assert load_config([BASE, "grain_train_files=gcsfuse/array-record/c4/en/3.0.1/*"]).dataset_type == "arrayrecord"
    assert load_config([BASE]).dataset_type == "synthetic"


def test_a_key_given_twice_keeps_the_last(capsys):
    assert load_config([BASE, "steps=3", "steps=5"]).steps == 5
    assert "steps is given twice on the command line; using the last, steps=5" in capsys.readouterr().err


def test_unknown_keys_get_no_unrelated_suggestion():
    with pytest.raises(ConfigError) as e:
        load_config([BASE, "eval_batch_num=5"])
    assert "unknown config key 'eval_batch_num'" in str(e.value) and "did you mean" not in str(e.value)


def test_precedence_base_preset_user_yaml_command_line(tmp_path):
    user = tmp_path / "mine.yml"
    user.write_text("model_name: llama3-8b\nbase_num_decoder_layers: 4\nsteps: 9\n")
    c = load_config([str(user), "steps=11"])
    assert (c.base_emb_dim, c.base_num_decoder_layers, c.steps) == (4096, 4, 11)  # preset < user YAML < CLI


@pytest.mark.parametrize("overrides", [
    ["model_name=llama3-8b", "base_num_decoder_layers=4", "base_emb_dim=256", "head_dim=64"],
    ["base_num_decoder_layers=4", "base_emb_dim=256", "cpu_devices=8", "ici_fsdp_parallelism=2",
     "ici_context_parallelism=4", "context_parallel_strategy=usp", "max_target_length=256"],
    ["dataset_type=arrayrecord", "grain_train_files=gcsfuse/array-record/c4/en/3.0.1/*", "packing=concat",
     "remat_policy=custom", "decoder_layer_input=offload", "profiler=xplane", "global_parameter_scale=2"],
])
def test_a_runs_config_yml_reruns_it(overrides, place):
    config = load_config([BASE, *overrides])
    save_config(config, str(place / "run"))
    again = load_config([str(place / "run" / "config.yml")])
    assert dataclasses.asdict(again) == dataclasses.asdict(config)
