"""TrainConfig: presets, overrides, suggestions, validation before any work starts."""

from __future__ import annotations

import sys
import tomllib

import pyarrow as pa
import pytest
import torch.distributed as dist
from train_helpers import tiny_config

from hlat_train import ConfigError, TrainConfig, Trainer, preset_names, validate
from hlat_train.cli import main


@pytest.mark.parametrize(
    "name",
    [
        "tiny-demo",
        "tiny-check",
        "hlat-7b",
        "hlat-7b-trn2",
        "llama2-7b-trn1-128",
        "llama3-8b",
        "llama3-70b",
        "llama3-8b-32k",
    ],
)
def test_every_preset_parses_and_validates(name):
    assert name in preset_names()
    config = TrainConfig.preset(name)
    llama = validate(config, check_files=False)
    assert llama.n_heads % config.parallel.tp == 0


@pytest.mark.parametrize("model", ["llama3-8b", "hlat-7b", "llama2-7b"])
def test_a_toml_that_sets_only_the_model_validates_with_the_default_schedule(model):
    """A TOML that sets neither train.steps nor the warmup (the README's continued
    pre-training one) takes the defaults, whose warmup fits in the run."""
    config = TrainConfig.from_dict(tomllib.loads(f'[model]\npreset = "{model}"\n'))
    assert (config.train.steps, config.optim.warmup_steps) == (10000, 200)
    validate(config, check_files=False)


def test_hlat_7b_preset_is_the_papers_recipe():
    c = TrainConfig.preset("hlat-7b")
    llama = validate(c, check_files=False)
    assert (llama.n_layers, llama.dim, llama.n_heads, llama.ffn_dim, llama.init_std) == (
        32,
        4096,
        32,
        11008,
        0.021,
    )
    assert (c.parallel.tp, c.parallel.sp) == (8, True)
    assert (c.train.global_batch_size, c.data.seq_len, c.data.micro_batch_size) == (1024, 4096, 1)
    assert (c.optim.beta1, c.optim.beta2, c.optim.weight_decay, c.optim.clip) == (
        0.9,
        0.95,
        0.1,
        1.0,
    )
    assert (c.optim.lr, c.optim.lr * c.optim.min_lr_ratio) == pytest.approx((3e-4, 3e-5))
    assert (c.optim.warmup_steps, c.optim.decay_steps, c.optim.precision) == (
        2000,
        500000,
        "bf16-sr",
    )
    assert (c.checkpoint.every, c.checkpoint.keep_last) == ("auto", 5)
    assert llama.checkpointing == "selective"


def test_trn2_preset_is_the_same_recipe_on_the_native_path():
    trn1, trn2 = TrainConfig.preset("hlat-7b"), TrainConfig.preset("hlat-7b-trn2")
    assert (trn2.parallel.backend, trn2.train.device, trn2.parallel.tp) == ("torch", "auto", 4)
    assert (trn2.optim, trn2.model.preset, trn2.data.seq_len) == (
        trn1.optim,
        trn1.model.preset,
        trn1.data.seq_len,
    )
    # 16 nodes of 64 logical NeuronCores: dp 256, 4 micro-batches of 1 per step
    validate(trn2, world_size=16 * 64, local_world_size=64, check_files=False)
    assert trn2.grad_accum(dp=16 * 64 // 4) == 4
    assert not trn2.logging.param_norm


def test_trn1_128_node_preset_needs_512_data_parallel_replicas_and_accumulates_twice():
    c = TrainConfig.preset("llama2-7b-trn1-128")
    assert c.grad_accum(dp=512) == 2
    validate(c, world_size=4096, local_world_size=32, check_files=False)
    with pytest.raises(ConfigError, match="dp 8"):
        validate(c, world_size=64, check_files=False)


def test_overrides_convert_to_the_field_types():
    c = TrainConfig.preset(
        "tiny-demo",
        [
            "--optim.lr=3e-4",
            "--parallel.sp=true",
            "--data.paths=a.arrow,b.arrow",
            "--model.dim=none",
            "--spike.inject_at=[3, 5]",
            "train.out_dir=somewhere",
        ],
    )
    assert c.optim.lr == 3e-4 and c.parallel.sp is True
    assert c.data.paths == ["a.arrow", "b.arrow"] and c.model.dim is None
    assert c.spike.inject_at == [3, 5] and c.train.out_dir == "somewhere"


def test_unknown_key_suggests_the_closest_one():
    with pytest.raises(ConfigError, match=r"unknown key 'optim.lrr'; did you mean 'optim.lr'"):
        TrainConfig.preset("tiny-demo", ["--optim.lrr=3e-4"])
    with pytest.raises(ConfigError, match=r"unknown section 'optm'.*did you mean 'optim'"):
        TrainConfig.preset("tiny-demo", ["--optm.lr=3e-4"])
    with pytest.raises(ConfigError, match="did you mean 'hlat-7b'"):
        TrainConfig.preset("hlat7b")


def test_wrong_value_type_names_the_key():
    with pytest.raises(ConfigError, match=r"train.steps must be an integer"):
        TrainConfig.preset("tiny-demo", ["--train.steps=ten"])


def test_merged_config_round_trips_through_toml():
    c = TrainConfig.preset("hlat-7b", ["--optim.lr=1e-4", "--data.paths=x.arrow"])
    again = TrainConfig.from_dict(tomllib.loads(c.to_toml()))
    assert again == c


def test_strings_with_newlines_and_control_characters_round_trip_through_toml(tmp_path):
    prompt = 'def main():\n\t"""Say \\hi\\."""\r\n    \x00\x1b\x7f\u00e9\u2581'
    c = TrainConfig.preset("tiny-demo", ['--train.sample_prompt="def main():\\n    "'])
    assert c.train.sample_prompt == "def main():\n    "
    c.train.sample_prompt = prompt
    c.data.paths = ["a\nb.arrow", "c\\d\x01.arrow"]
    path = tmp_path / "run.toml"
    path.write_text(c.to_toml(), encoding="utf-8")
    again = TrainConfig.from_toml(path)
    assert again == c and again.train.sample_prompt == prompt
    assert again.data.paths == ["a\nb.arrow", "c\\d\x01.arrow"]


def test_the_comma_form_of_a_list_override_parses_each_item():
    c = TrainConfig.preset(
        "tiny-demo",
        [
            "--logging.profile_steps=5,10",
            "--parallel.pp_split=7,9",
            "--spike.inject_at=3,",
            "--data.paths=a.arrow,b.arrow",
        ],
    )
    assert c.logging.profile_steps == [5, 10] and c.parallel.pp_split == [7, 9]
    assert c.spike.inject_at == [3] and c.data.paths == ["a.arrow", "b.arrow"]
    with pytest.raises(ConfigError, match=r"logging.profile_steps must be an integer, got 'x'"):
        TrainConfig.preset("tiny-demo", ["--logging.profile_steps=5,x"])


def test_a_single_item_override_of_a_list_is_a_list_of_that_item():
    c = TrainConfig.preset(
        "tiny-demo",
        [
            "--spike.inject_at=3",
            "--logging.profile_steps=5",
            "--parallel.pp_split=7",
            "--data.paths=2024",
            "--data.valid_paths=2024-01-01",
        ],
    )
    assert c.spike.inject_at == [3] and c.logging.profile_steps == [5]
    assert c.parallel.pp_split == [7] and c.data.paths == ["2024"]
    assert c.data.valid_paths == ["2024-01-01"]
    with pytest.raises(ConfigError, match=r"spike.inject_at must be an integer, got 3.5"):
        TrainConfig.preset("tiny-demo", ["--spike.inject_at=3.5"])


def test_tp_that_does_not_divide_the_heads_fails_before_any_process_group(corpus, tmp_path):
    with pytest.raises(ConfigError, match="tp 3 does not divide the 4 attention heads"):
        Trainer(tiny_config(corpus, tmp_path, "--parallel.tp=3"))
    assert not dist.is_initialized()
    assert not (tmp_path / "checkpoints").exists()


def test_missing_data_path_fails_before_any_process_group(corpus, tmp_path):
    with pytest.raises(
        ConfigError, match=r"data.paths: training data '.*nowhere.arrow' does not exist"
    ):
        Trainer(tiny_config(corpus, tmp_path, f'--data.paths=["{tmp_path}/nowhere.arrow"]'))
    assert not dist.is_initialized()


def test_tokenizer_larger_than_the_vocabulary_is_refused(corpus, tmp_path):
    with pytest.raises(ConfigError, match=r"has 384 pieces but model.vocab_size is 256"):
        Trainer(tiny_config(corpus, tmp_path, "--model.vocab_size=256"))


def test_global_batch_must_be_a_whole_number_of_micro_batches(corpus, tmp_path):
    config = tiny_config(corpus, tmp_path, "--train.global_batch_size=5")
    with pytest.raises(ConfigError, match=r"not a multiple of data.micro_batch_size x dp"):
        validate(config, world_size=1)
    assert tiny_config(corpus, tmp_path, "--train.global_batch_size=6").grad_accum(dp=1) == 3


def test_sequence_longer_than_the_model_is_refused():
    with pytest.raises(ConfigError, match=r"data.seq_len 8192 exceeds max_seq_len 4096"):
        validate(TrainConfig.preset("hlat-7b", ["--data.seq_len=8192"]), check_files=False)


def test_print_config_shows_the_merged_config(capsys):
    assert main(["print-config", "--config", "hlat-7b", "--optim.lr=2e-4", "--no-check-files"]) == 0
    text = capsys.readouterr().out
    assert "[optim]\nlr = 0.0002\n" in text and 'preset = "hlat-7b"' in text


def test_command_line_error_exits_2_with_the_suggestion(capsys):
    assert main(["print-config", "--config", "tiny-demo", "--optim.warmup=3"]) == 2
    assert "did you mean 'optim.warmup_steps'" in capsys.readouterr().err


def test_module_entry_point_is_what_torchrun_runs():
    import subprocess

    result = subprocess.run(
        [sys.executable, "-m", "hlat_train", "presets"], capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == preset_names()


def test_too_few_documents_for_the_data_parallel_ranks_fails_before_any_process_group(
    corpus, tmp_path
):
    config = tiny_config(corpus, tmp_path, "--data.block_size=1024")
    with pytest.raises(
        ConfigError,
        match=r"fewer than dp 2.*data.block_size to at most 28 for a new run .*resume this one "
        r"at dp 1 or fewer, or start it over with checkpoint.resume = false",
    ):
        validate(config, world_size=2)
    assert not dist.is_initialized()


def test_a_held_out_set_with_fewer_documents_than_dp_fails_before_any_process_group(
    corpus, tmp_path
):
    # 56 training documents in blocks of 1 serve 16 ranks; the 8 held-out ones do not
    config = tiny_config(corpus, tmp_path, "--data.block_size=1")
    validate(config, world_size=8)
    with pytest.raises(
        ConfigError, match=r"data.valid_paths hold\(s\) 8 documents, fewer than dp 16"
    ):
        validate(config, world_size=16)
    assert not dist.is_initialized()


def test_an_empty_held_out_set_fails_before_any_process_group(corpus, tmp_path):
    empty = tmp_path / "empty.arrow"
    table = pa.table({"text": pa.array([], pa.string())})
    with pa.OSFile(str(empty), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    config = tiny_config(corpus, tmp_path, f'--data.valid_paths=["{empty}"]')
    with pytest.raises(ConfigError, match=r"data.valid_paths: the corpus is empty: 1 file"):
        validate(config, world_size=1)
    mixture = tiny_config(
        corpus,
        tmp_path,
        "--data.paths=[]",
        "--data.valid_paths=[]",
        f'--data.sources=[{{name="code", paths=["{corpus["train"]}"], valid_paths=["{empty}"]}}]',
    )
    with pytest.raises(ConfigError, match=r"data.sources\[code\].valid_paths: the corpus is"):
        validate(mixture)
    assert not dist.is_initialized()


def test_a_held_out_directory_or_glob_of_json_lines_is_left_to_the_loader(corpus, tmp_path):
    # a damaged gzip file fails when indexed: validate passing shows it was not read
    held_out = tmp_path / "held_out"
    held_out.mkdir()
    (held_out / "a.jsonl").write_text('{"text": "a held-out document"}\n')
    (held_out / "b.jsonl.gz").write_bytes(b"not gzip data")
    for entry in (held_out, held_out / "*.jsonl*", f"file://{held_out}"):
        validate(tiny_config(corpus, tmp_path, f'--data.valid_paths=["{entry}"]'), world_size=1)


@pytest.mark.parametrize(
    "override, needle",
    [
        ("--optim.clip=-1", "optim.clip .* must be >= 0"),
        ("--optim.beta2=1.5", r"optim.beta2 must be in \[0, 1\)"),
        ("--optim.beta1=-0.1", r"optim.beta1 must be in \[0, 1\)"),
        ("--optim.eps=-1", "optim.eps must be a positive number"),
        ("--optim.weight_decay=-0.1", "optim.weight_decay must be >= 0"),
        ("--optim.lr=inf", "optim.lr must be a positive number"),
        ("--optim.constant_steps=-5", "optim.constant_steps must be at least 0"),
        ("--optim.decay_steps=-1", "optim.decay_steps must be at least 0"),
        ("--train.time_limit=-5", "train.time_limit must be a number of seconds >= 0"),
        ("--spike.k=-3", r"spike.k \(standard deviations above the mean\) must be positive"),
        ("--spike.inject_at=[-3]", r"spike.inject_at: steps start at 1, got \[-3\]"),
        ("--spike.max_rollbacks=-1", "spike.max_rollbacks must be at least 0"),
        ("--spike.min_history=0", "spike.min_history must be at least 1"),
        ("--spike.min_history=10 --spike.window=5", r"spike.min_history \(10\) exceeds"),
        ("--data.block_size=0", "data.block_size must be at least 1"),
        ("--train.gc_every=-1", "train.gc_every must be at least 0"),
        ("--checkpoint.mtbf_hours=inf", "checkpoint.mtbf_hours must be a finite number > 0"),
        ("--checkpoint.mtbf_hours=nan", "checkpoint.mtbf_hours must be a finite number > 0"),
        ("--checkpoint.preempt_budget=nan", "checkpoint.preempt_budget must be a finite number"),
        ("--train.sample_temperature=inf", "train.sample_temperature must be a finite number"),
        ("--checkpoint.dir=s3://bucket/run[1]", "object-store checkpoint root cannot contain"),
        ("--spike.new_level_after=1", "spike.new_level_after must be 0 .never. or at least 2"),
    ],
)
def test_values_out_of_range_fail_before_any_process_group(corpus, tmp_path, override, needle):
    config = tiny_config(corpus, tmp_path, *override.split())
    with pytest.raises(ConfigError, match=needle):
        validate(config, world_size=2)
    assert not dist.is_initialized()


def test_local_paths_may_be_file_urls(corpus, tmp_path):
    config = tiny_config(
        corpus,
        tmp_path,
        f'--data.paths=["file://{corpus["train"]}"]',
        f'--data.valid_paths=["file://{corpus["valid"]}"]',
    )
    validate(config, world_size=1)
    config.data.paths = [f"file://{tmp_path}/nowhere.arrow"]
    with pytest.raises(ConfigError, match=r"data.paths: training data 'file://.*nowhere"):
        validate(config, world_size=1)


def test_sharded_init_with_torch_tensor_parallelism_is_accepted():
    config = TrainConfig.preset("hlat-7b", ["--train.init=sharded", "--parallel.backend=torch"])
    validate(config, check_files=False)


def test_a_device_this_torch_lacks_fails_before_any_process_group(corpus, tmp_path):
    with pytest.raises(ConfigError, match=r"train.device: device 'neuron'.*torch-neuronx"):
        Trainer(tiny_config(corpus, tmp_path, "--train.device=neuron"))
    assert not dist.is_initialized()
    assert not (tmp_path / "checkpoints").exists()


def test_flex_attention_over_packed_documents_is_refused_on_a_cpu():
    from hlat_parallel.device import accelerator

    flex = ["--model.attention=flex", "--data.document_mask=true"]
    message = r"model.attention = 'flex' with data.document_mask = true on a CPU.*'auto', "
    with pytest.raises(ConfigError, match=message):
        validate(TrainConfig.preset("tiny-demo", [*flex, "--train.device=cpu"]), check_files=False)
    auto = TrainConfig.preset("tiny-demo", [*flex, "--train.device=auto"])
    if accelerator() is None:
        with pytest.raises(ConfigError, match=message):
            validate(auto, check_files=False)
    else:
        validate(auto, check_files=False)
    for allowed in (["--model.attention=blocked", "--data.document_mask=true"], flex[:1]):
        validate(
            TrainConfig.preset("tiny-demo", [*allowed, "--train.device=cpu"]), check_files=False
        )


def test_the_legacy_neuron_backend_refuses_another_device():
    config = TrainConfig.preset("hlat-7b", ["--parallel.backend=neuron", "--train.device=cpu"])
    with pytest.raises(ConfigError, match="computes on the XLA device"):
        validate(config, check_files=False)


def test_a_precision_nxd_cannot_honour_is_refused_before_any_work():
    config = TrainConfig.preset("hlat-7b", ["--parallel.backend=neuron"])
    validate(config, check_files=False)  # bf16-sr: HLAT's mode on NxD
    config.set("optim.precision", "bf16-kahan")
    with pytest.raises(ConfigError, match=r"optim\.precision on parallel\.backend = 'neuron'"):
        validate(config, check_files=False)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["--parallel.dp_shard=zero2"], "parallel.dp_shard must be auto, fsdp, zero1 or none"),
        (
            ["--parallel.backend=neuron", "--parallel.dp_shard=fsdp"],
            "NeuronX Distributed's data parallelism is ZeRO-1",
        ),
    ],
)
def test_a_data_parallel_layout_that_does_not_exist_is_refused(overrides, needle):
    c = TrainConfig.preset("hlat-7b", overrides)
    with pytest.raises(ConfigError, match=needle):
        validate(c, world_size=64, check_files=False)
