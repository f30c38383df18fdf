"""Checks of a :class:`~hlat_train.config.TrainConfig` that run before any process group,
tensor or file is created. Pure arithmetic plus file-existence checks."""

from __future__ import annotations

import glob
import math
import os
from typing import Any

from hlat_train.config import ConfigError, TrainConfig
from hlat_train.host_memory import CHOICES as HOST_MALLOC_CHOICES

PRECISIONS = ("bf16-sr", "bf16-kahan", "bf16", "mixed", "fp32", "auto")
SPIKE_POLICIES = ("off", "warn", "skip", "rollback")


def _is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _check_path(key: str, path: str, what: str) -> None:
    if _is_url(path):
        return  # remote objects are checked when opened, with the URL in the error
    if not glob.glob(path.removeprefix("file://")):
        raise ConfigError(
            f"{key}: {what} {path!r} does not exist (working directory {os.getcwd()}); "
            f"fix the path or create it first (e.g. `hlat-data` to write Arrow files or train a "
            "tokenizer)"
        )


def _check_mixture(data: Any) -> None:
    if data.on_bad_record not in ("error", "skip"):
        raise ConfigError(
            f"data.on_bad_record must be 'error' or 'skip', got {data.on_bad_record!r}"
        )
    if data.mixture_change not in ("error", "continue"):
        raise ConfigError(
            f"data.mixture_change must be 'error' or 'continue', got {data.mixture_change!r}"
        )
    if not data.sources:
        return
    if data.paths:
        raise ConfigError(
            "data.paths and data.sources are both set: give one corpus (paths) or a mixture "
            "(sources); a mixture of one source is [[data.sources]] with one table"
        )
    seen: set[str] = set()
    for i, source in enumerate(data.sources):
        where = f"data.sources[{i}]"
        if not source.name:
            raise ConfigError(f"{where} needs a name (it keys its loader state and metrics)")
        if source.name in seen:
            raise ConfigError(f"{where}: the name {source.name!r} is used twice")
        seen.add(source.name)
        if not source.paths:
            raise ConfigError(f"{where} ({source.name}) has no paths")
        if not (math.isfinite(source.weight) and source.weight > 0):
            raise ConfigError(f"{where} ({source.name}): weight must be > 0, got {source.weight}")
        for key in ("epochs", "max_tokens"):
            value = getattr(source, key)
            if value is not None and value < 1:
                raise ConfigError(f"{where} ({source.name}): {key} must be at least 1, got {value}")


def _check_checkpoint_dir(url: str) -> None:
    """Refuse what ``hlat_ckpt``'s storage refuses when the trainer opens it: an object-store
    root whose name fsspec would read as a pattern."""
    from hlat_ckpt.storage import check_object_store_root

    scheme, sep, rest = url.partition("://")
    if sep and scheme not in ("file", "local"):
        try:
            check_object_store_root(url, rest)
        except ValueError as error:
            raise ConfigError(f"checkpoint.dir {error}") from None


def validate(
    config: TrainConfig,
    world_size: int | None = None,
    *,
    local_world_size: int | None = None,
    check_files: bool = True,
) -> Any:
    """Raise :class:`ConfigError` for the first problem; return the model's ``LlamaConfig``.

    ``world_size`` (processes launched) enables the layout checks that depend on it;
    ``check_files`` checks that data and tokenizer paths exist and reads the tokenizer's
    vocabulary size (a few KB).
    """
    from hlat_model import ConfigError as ModelConfigError
    from hlat_parallel import DeviceError, ParallelConfigError, check_device, check_parallel_config

    run, data, optim, par = config.train, config.data, config.optim, config.parallel
    for key, value, low in (
        ("train.steps", run.steps, 1),
        ("train.eval_batches", run.eval_batches, 1),
        ("data.seq_len", data.seq_len, 1),
        ("data.micro_batch_size", data.micro_batch_size, 1),
        ("checkpoint.keep_last", config.checkpoint.keep_last, 1),
        ("logging.every", config.logging.every, 1),
        ("spike.window", config.spike.window, 2),
        ("train.global_batch_size", run.global_batch_size, 0),
        ("train.eval_every", run.eval_every, 0),
        ("data.num_workers", data.num_workers, 0),
        ("data.tokenizer_threads", data.tokenizer_threads, 0),
        ("optim.warmup_steps", optim.warmup_steps, 0),
        ("optim.constant_steps", optim.constant_steps, 0),
        ("optim.decay_steps", optim.decay_steps, 0),
        ("data.block_size", data.block_size, 1),
        ("spike.min_history", config.spike.min_history, 1),
        ("spike.max_rollbacks", config.spike.max_rollbacks, 0),
        ("parallel.pp", par.pp, 1),
        ("parallel.cp", par.cp, 1),
        ("parallel.pp_virtual", par.pp_virtual, 0),
        ("parallel.pp_microbatches", par.pp_microbatches, 0),
        ("logging.memory_snapshot_step", config.logging.memory_snapshot_step, 0),
        ("checkpoint.preempt_budget", config.checkpoint.preempt_budget, 0),
        ("train.sample_tokens", run.sample_tokens, 1),
        ("train.sample_temperature", run.sample_temperature, 0),
        ("train.sample_top_k", run.sample_top_k, 0),
        ("train.gc_every", run.gc_every, 0),
    ):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value}")
        if value < low:
            raise ConfigError(f"{key} must be at least {low}, got {value}")
    every = config.checkpoint.every
    if isinstance(every, str) and every != "auto":
        raise ConfigError(f"checkpoint.every must be a number of steps or 'auto', got {every!r}")
    if isinstance(every, int) and every < 1:
        raise ConfigError(f"checkpoint.every must be at least 1, got {every}")
    mtbf = config.checkpoint.mtbf_hours
    if not (math.isfinite(mtbf) and mtbf > 0):
        raise ConfigError(f"checkpoint.mtbf_hours must be a finite number > 0, got {mtbf}")
    _check_checkpoint_dir(config.checkpoint_dir)
    _check_observability(config)
    _check_hang_timeout(run.hang_timeout)
    _check_mixture(data)
    for key, steps in (
        ("spike.inject_nan_at", config.spike.inject_nan_at),
        ("spike.inject_at", config.spike.inject_at),
    ):
        bad_drill = [s for s in steps if s < 1]
        if bad_drill:
            raise ConfigError(f"{key}: steps start at 1, got {bad_drill}")
    spike = config.spike
    if spike.min_history > spike.window:
        raise ConfigError(
            f"spike.min_history ({spike.min_history}) exceeds spike.window ({spike.window}): "
            "the guard keeps only the last window losses, so it would never judge a spike; "
            "lower min_history or widen the window"
        )
    if spike.new_level_after == 1 or spike.new_level_after < 0:
        raise ConfigError(
            f"spike.new_level_after must be 0 (never) or at least 2, got "
            f"{spike.new_level_after}: at 1 every spike would enter the window at once"
        )
    if not (math.isfinite(spike.k) and spike.k > 0):
        raise ConfigError(
            f"spike.k (standard deviations above the mean) must be positive, got {spike.k}"
        )
    if not (math.isfinite(run.time_limit) and run.time_limit >= 0):
        raise ConfigError(
            f"train.time_limit must be a number of seconds >= 0 (0: no limit), got {run.time_limit}"
        )
    if run.host_malloc not in HOST_MALLOC_CHOICES:
        raise ConfigError(
            f"train.host_malloc must be 'auto', 'system' or 'retain', got {run.host_malloc!r}"
        )
    if run.init not in ("auto", "full", "sharded"):
        raise ConfigError(f"train.init must be 'auto', 'full' or 'sharded', got {run.init!r}")
    try:
        check_device(run.device)
    except DeviceError as e:
        raise ConfigError(f"train.device: {e}") from None
    if optim.precision not in PRECISIONS:
        raise ConfigError(
            f"optim.precision must be one of {', '.join(PRECISIONS)}, got {optim.precision!r}"
        )
    if optim.impl not in ("auto", "native", "compiled", "reference"):
        raise ConfigError(
            f"optim.impl must be auto, native, compiled or reference, got {optim.impl!r}"
        )
    if not (optim.lr > 0 and math.isfinite(optim.lr)):
        raise ConfigError(f"optim.lr must be a positive number, got {optim.lr}")
    for key, value in (("optim.beta1", optim.beta1), ("optim.beta2", optim.beta2)):
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{key} must be in [0, 1), got {value}")
    if not (optim.eps > 0 and math.isfinite(optim.eps)):
        raise ConfigError(f"optim.eps must be a positive number, got {optim.eps}")
    if not (optim.weight_decay >= 0 and math.isfinite(optim.weight_decay)):
        raise ConfigError(f"optim.weight_decay must be >= 0, got {optim.weight_decay}")
    if not (optim.clip >= 0 and math.isfinite(optim.clip)):
        raise ConfigError(
            f"optim.clip (the maximum gradient norm) must be >= 0 (0: no clipping), got "
            f"{optim.clip}"
        )
    if not 0.0 <= optim.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio must be in [0, 1], got {optim.min_lr_ratio}")
    horizon = optim.decay_steps or run.steps
    if horizon < optim.warmup_steps + optim.constant_steps:
        raise ConfigError(
            f"the LR schedule horizon ({'optim.decay_steps' if optim.decay_steps else 'train.steps'}"
            f" = {horizon}) is shorter than optim.warmup_steps + optim.constant_steps "
            f"({optim.warmup_steps} + {optim.constant_steps}); shorten the warmup or lengthen "
            "the horizon"
        )
    if config.spike.policy not in SPIKE_POLICIES:
        raise ConfigError(
            f"spike.policy must be one of {', '.join(SPIKE_POLICIES)}, got {config.spike.policy!r}"
        )
    if config.spike.policy == "rollback" and not config.checkpoint.resume:
        raise ConfigError(
            "spike.policy = 'rollback' reloads checkpoints: set checkpoint.resume = true"
        )
    if config.model.compile not in (True, False, "auto"):
        raise ConfigError(
            f"model.compile must be true, false or 'auto', got {config.model.compile!r}"
        )
    if par.backend not in ("auto", "torch", "neuron"):
        raise ConfigError(f"parallel.backend must be auto, torch or neuron, got {par.backend!r}")
    if par.dp_shard not in ("auto", "fsdp", "zero1", "none"):
        raise ConfigError(
            f"parallel.dp_shard must be auto, fsdp, zero1 or none, got {par.dp_shard!r}"
        )
    if par.backend == "neuron" and par.dp_shard in ("fsdp", "none"):
        raise ConfigError(
            f"parallel.dp_shard = {par.dp_shard!r} on parallel.backend = 'neuron': NeuronX "
            "Distributed's data parallelism is ZeRO-1; set parallel.dp_shard = 'zero1' or 'auto'"
        )
    if par.backend == "neuron":
        from hlat_parallel.neuron_backend import zero1_precision

        try:
            # auto on trn1 is bf16-sr (hlat_train.precision: NeuronCores multiply bf16)
            zero1_precision("bf16-sr" if optim.precision == "auto" else optim.precision)
        except (ParallelConfigError, ValueError) as e:
            raise ConfigError(f"optim.precision on parallel.backend = 'neuron': {e}") from None
    if par.backend == "neuron" and config.model.compile is True:
        raise ConfigError(
            "model.compile = true on parallel.backend = 'neuron' (trn1): XLA compiles the "
            "whole step there; set model.compile = false, or use the torch backend"
        )
    if config.model.compile is True and (par.pp > 1 or par.cp > 1):
        raise ConfigError(
            f"model.compile = true with parallel.pp = {par.pp}, cp = {par.cp}: compiled blocks "
            "are tested on one process, under FSDP2 (data parallelism) and under tensor and "
            "sequence parallelism; with pipeline and context parallelism they are untested. "
            "Set model.compile = false for this layout"
        )
    if par.backend == "neuron" and (par.pp > 1 or par.cp > 1):
        raise ConfigError(
            f"parallel.pp = {par.pp}, parallel.cp = {par.cp}: pipeline and context parallelism "
            "run on the native torch backend (CPUs, GPUs, trn2/trn3 through TorchNeuron); "
            "hlat's NeuronX Distributed path for trn1 (parallel.backend = 'neuron') does not "
            "run them yet. Set parallel.backend = 'torch', or pp = 1 and cp = 1"
        )
    if par.pp_split and par.pp == 1:
        raise ConfigError(
            f"parallel.pp_split = {par.pp_split} splits blocks over pipeline stages, but "
            "parallel.pp is 1; set parallel.pp or leave pp_split empty"
        )
    if par.cp > 1 and data.document_mask:
        raise ConfigError(
            f"parallel.cp = {par.cp} with data.document_mask = true: context parallelism does "
            "not support document masking yet (each rank would need the documents of every "
            "other rank's tokens); set data.document_mask = false or parallel.cp = 1"
        )
    if par.backend == "neuron" and run.device not in ("auto", "xla"):
        raise ConfigError(
            f"parallel.backend = 'neuron' (NeuronX Distributed, trn1) computes on the XLA device "
            f"it creates; train.device = {run.device!r} does not apply: leave it at 'auto'"
        )

    tokenizer_vocab = None
    held_out_documents: dict[str, int] = {}  # by held-out set, where counted
    if check_files:
        if not data.paths and not data.sources:
            raise ConfigError(
                "data.paths is empty: give the training Arrow files, e.g. "
                "--data.paths=corpus/train.arrow, or a mixture as [[data.sources]] tables"
            )
        for path in data.paths:
            _check_path("data.paths", path, "training data")
        for path in data.valid_paths:
            _check_path("data.valid_paths", path, "validation data")
        for source in data.sources:
            for path in source.paths:
                _check_path(f"data.sources[{source.name}].paths", path, "training data")
            for path in source.valid_paths:
                _check_path(f"data.sources[{source.name}].valid_paths", path, "validation data")
        held_out_documents = _check_held_out_not_empty(data)
        if not data.tokenizer:
            raise ConfigError("data.tokenizer is empty: give a SentencePiece .model file")
        _check_path("data.tokenizer", data.tokenizer, "tokenizer")
        tokenizer_vocab = tokenizer_pieces(data.tokenizer)

    try:
        # without the tokenizer, vocab_size = 0 is checked as one padded block of 64
        llama = config.llama_config(tokenizer_vocab if check_files else 64)
    except ModelConfigError as e:
        raise ConfigError(f"model (preset {config.model.preset!r}): {e}") from None
    if tokenizer_vocab is not None and tokenizer_vocab > llama.vocab_size:
        raise ConfigError(
            f"tokenizer {data.tokenizer} has {tokenizer_vocab} pieces but model.vocab_size is "
            f"{llama.vocab_size}; set model.vocab_size >= {tokenizer_vocab} (or 0 to follow "
            "the tokenizer)"
        )
    if (
        llama.attention == "flex"
        and data.document_mask
        and par.backend != "neuron"
        and compute_device_type(run.device) == "cpu"
    ):
        raise ConfigError(
            "model.attention = 'flex' with data.document_mask = true on a CPU: flex attention "
            "has no CPU backward, so the first step would fail; set model.attention = 'auto', "
            "'blocked' or 'sdpa', or train on an accelerator"
        )
    selective_tp = par.tp > 1 and llama.checkpointing == "selective"
    if (
        config.model.compile is True
        and selective_tp
        and compiled_tp_checkpoints_fail()
        and not runs_hlat_attention(
            llama.attention, run.device, data.document_mask, data.seq_len, llama.head_dim
        )
    ):
        import torch

        raise ConfigError(
            f"model.compile = true with parallel.tp = {par.tp} and model.checkpointing = "
            f"'selective' on torch {torch.__version__}, with model.attention = "
            f"{llama.attention!r} on this device (SDPA or flex attention): torch 2.13 fails "
            "to compile the backward of a tensor-parallel block with SDPA in a checkpointed "
            "region (AOT autograd saves the device mesh for backward: 'expected all "
            "tensors_saved_with_vc_check to be Tensors'; torch 2.9 compiles it, the "
            "versions between are untested; the blocked attention kernel compiles). Set "
            "model.checkpointing = 'full' or 'none', model.attention = 'blocked', or "
            "model.compile = false"
        )
    if data.seq_len > llama.max_seq_len:
        raise ConfigError(
            f"data.seq_len {data.seq_len} exceeds max_seq_len {llama.max_seq_len} of preset "
            f"{config.model.preset!r}; set model.max_seq_len or data.seq_len"
        )
    try:
        # the model's rules first (they hold for any world size), then the launch's
        for world in (par.tp * par.pp * par.cp, world_size):
            if world is not None:
                check_parallel_config(
                    world,
                    par.tp,
                    par.sp,
                    pp=par.pp,
                    cp=par.cp,
                    n_heads=llama.n_heads,
                    n_kv_heads=llama.kv_heads,
                    seq_len=data.seq_len,
                )
    except ParallelConfigError as e:
        raise ConfigError(
            f"parallel (tp {par.tp}, pp {par.pp}, cp {par.cp}, sp {str(par.sp).lower()}): {e}"
        ) from None
    if par.pp > 1:
        _check_pipeline(config, llama, world_size)
    if llama.tie_embeddings and (par.tp > 1 or par.backend == "neuron"):
        where = f"parallel.tp = {par.tp}" if par.tp > 1 else "parallel.backend = 'neuron'"
        raise ConfigError(
            f"model.tie_embeddings = true with {where}: the embedding and the LM head are "
            "split differently and cannot share one weight; set model.tie_embeddings = false "
            "(an untied copy of the weights) or train without tensor parallelism on the torch "
            "backend"
        )
    if llama.vocab_size % par.tp:
        raise ConfigError(
            f"parallel.tp {par.tp} does not divide model.vocab_size {llama.vocab_size} "
            "(the embedding and LM head are split by vocabulary rows); pad the vocabulary "
            "to a multiple of tp (model.vocab_size)"
        )
    if world_size is not None:
        replica = par.tp * par.pp * par.cp
        dp = world_size // replica
        if par.dp and par.dp != dp:
            raise ConfigError(
                f"parallel.dp = {par.dp} but {world_size} processes at tp x pp x cp = {replica} "
                f"give dp {dp}; launch {par.dp * replica} processes or set parallel.dp = 0"
            )
        if par.nodes and local_world_size and world_size // local_world_size != par.nodes:
            raise ConfigError(
                f"parallel.nodes = {par.nodes} but torchrun started "
                f"{world_size // local_world_size} nodes of {local_world_size} processes"
            )
        if check_files and dp > 1:
            from hlat_data import open_source

            corpora = [("data.paths", data.paths)] if data.paths else []
            corpora += [(f"data.sources[{s.name}]", s.paths) for s in data.sources]
            for key, paths in corpora:
                documents = len(open_source(paths, data.text_column))
                blocks = -(-documents // data.block_size)
                if blocks < dp:
                    raise ConfigError(
                        f"{key} hold(s) {documents} documents, {blocks} shuffle block(s) of "
                        f"data.block_size {data.block_size}: fewer than dp {dp}, so some ranks "
                        f"would get no data; set data.block_size to at most {documents // dp} "
                        "for a new run (a run resumes with the block_size it started with, as "
                        "its data order depends on it: resume this one at dp "
                        f"{max(blocks, 1)} or fewer, or start it over with "
                        "checkpoint.resume = false)"
                    )
            # held-out sets are read in order, one document a block, split over dp
            for name, paths in data.held_out_sets():
                count = held_out_documents.get(name)
                if count is None:
                    count = len(open_source(paths, data.text_column))
                key = _held_out_key(name)
                if count < dp:
                    raise ConfigError(
                        f"{key} hold(s) {count} documents, fewer than dp {dp}: each "
                        "data-parallel rank reads its own held-out documents, so some ranks "
                        f"would get none; give at least {dp} documents"
                    )
        per_step = data.micro_batch_size * dp
        if run.global_batch_size % per_step:
            raise ConfigError(
                f"train.global_batch_size {run.global_batch_size} is not a multiple of "
                f"data.micro_batch_size x dp = {data.micro_batch_size} x {dp} = {per_step}; "
                "gradient accumulation needs a whole number of micro-steps"
            )
        capped = [s.max_tokens for s in data.sources if s.max_tokens is not None]
        if data.sources and len(capped) == len(data.sources):
            # every source ends at its token cap: the run needs no more rows than they hold
            # (each rank's share of a cap rounds up to whole rows)
            row_tokens = data.seq_len * dp
            available = sum(-(-cap // row_tokens) for cap in capped) * row_tokens
            needed = run.steps * data.seq_len * (run.global_batch_size or per_step)
            if needed > available:
                raise ConfigError(
                    f"the mixture holds at most {available} tokens (every data.sources entry "
                    f"has max_tokens: {sum(capped)} in all), but train.steps {run.steps} "
                    f"need {needed}; raise a max_tokens, leave one source uncapped, or "
                    "train fewer steps"
                )
    if config.model.init_from_hf and check_files:
        _check_hf_init(config.model.init_from_hf, llama)
    return llama


def tokenizer_pieces(path: str) -> int:
    """The vocabulary size of the tokenizer file at ``path`` (``hlat_data.Tokenizer``)."""
    from hlat_data import Tokenizer

    return Tokenizer.from_file(path, num_threads=1).vocab_size


def _held_out_key(name: str) -> str:
    """The config key of the held-out set ``name`` of ``DataConfig.held_out_sets``."""
    return f"data.sources[{name}].valid_paths" if name else "data.valid_paths"


def _check_held_out_not_empty(data: Any) -> dict[str, int]:
    """Refuse a held-out set of local Arrow/Parquet files without rows (their row counts are
    metadata; JSON lines, named or found in a directory or glob, and remote sets are left to
    the loader, which reads them whole); the documents of each set counted, by name."""
    from hlat_data import DataError, open_source
    from hlat_data.jsonl import _kinds

    documents: dict[str, int] = {}
    for name, paths in data.held_out_sets():
        if any(_is_url(p) for p in paths) or any(
            kind == "jsonl" for p in paths for kind, _ in _kinds(p, {})
        ):
            continue
        key = _held_out_key(name)
        try:
            documents[name] = len(open_source(paths, data.text_column))  # refuses no rows
        except DataError as error:
            raise ConfigError(
                f"{key}: {error}; give at least one held-out document, or leave {key} empty"
            ) from None
    return documents


def _check_hf_init(path: str, llama: Any) -> None:
    """model.init_from_hf names a safetensors ``save_pretrained`` directory whose config is
    the model's, field by field."""
    import json

    from hlat_model.hf import config_from_hf
    from hlat_model.hf_load import hf_files

    config_path = os.path.join(path, "config.json")
    if not os.path.isdir(path) or not os.path.exists(config_path):
        raise ConfigError(
            f"model.init_from_hf {path!r} is not a Hugging Face save_pretrained directory "
            "(no config.json there)"
        )
    try:
        names = hf_files(path)
        with open(config_path) as f:
            theirs = config_from_hf(json.load(f))
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"model.init_from_hf {path!r}: {e}") from None
    for field in (
        "vocab_size", "dim", "n_layers", "n_heads", "kv_heads", "ffn_dim", "rope_theta",
        "norm_eps", "tie_embeddings",
    ):  # fmt: skip
        mine, hf = getattr(llama, field), getattr(theirs, field)
        if mine != hf:
            key = "n_kv_heads" if field == "kv_heads" else field
            value = str(hf).lower() if isinstance(hf, bool) else hf
            raise ConfigError(
                f"model.init_from_hf {path!r}: its {field} is {hf}, the model's is {mine}; "
                f"set model.{key} = {value} (or a preset of the checkpoint's shape)"
            )
    if not llama.tie_embeddings and not {"lm_head.weight", "model.lm_head.weight"} & set(names):
        raise ConfigError(
            f"model.init_from_hf {path!r} holds no lm_head.weight, but the model does not tie "
            "its embeddings (model.tie_embeddings = false): the head would have no weights"
        )


def _check_pipeline(config: TrainConfig, llama: Any, world_size: int | None) -> None:
    """The pipeline settings against the model and, when known, the launch."""
    from hlat_parallel import (
        SCHEDULES,
        ParallelConfigError,
        check_schedule,
        default_virtual,
        split_layers,
    )

    par = config.parallel
    if par.pp_schedule not in SCHEDULES:
        raise ConfigError(
            f"parallel.pp_schedule {par.pp_schedule!r} is not one of {', '.join(SCHEDULES)}"
        )
    virtual = par.pp_virtual or default_virtual(par.pp_schedule)
    if llama.tie_embeddings:
        raise ConfigError(
            "parallel.pp > 1 with tied input and output embeddings: the embedding and the LM "
            "head sit on different stages; set model.tie_embeddings = false"
        )
    if llama.sequence_first:
        raise ConfigError(
            "parallel.pp > 1 with model.sequence_first = true: pipeline stages pass "
            "batch-first hidden states; set model.sequence_first = false"
        )
    try:
        split_layers(llama.n_layers, par.pp * virtual, split=par.pp_split or None)
        if world_size is not None:
            dp = world_size // (par.tp * par.pp * par.cp)
            micro = config.grad_accum(dp)
            if par.pp_microbatches and par.pp_microbatches != micro:
                raise ConfigError(
                    f"parallel.pp_microbatches = {par.pp_microbatches}, but the pipeline runs the "
                    f"{micro} gradient-accumulation micro-batches of a step (global batch "
                    f"{config.train.global_batch_size or config.data.micro_batch_size * dp} / "
                    f"(data.micro_batch_size {config.data.micro_batch_size} x dp {dp})); set "
                    "train.global_batch_size to match or parallel.pp_microbatches = 0"
                )
            check_schedule(par.pp_schedule, par.pp, virtual, micro)
    except ParallelConfigError as e:
        raise ConfigError(
            f"parallel (pp {par.pp}, schedule {par.pp_schedule}, virtual {virtual}): {e}"
        ) from None


def _check_observability(config: TrainConfig) -> None:
    """logging.profile_steps is a range of steps; W&B is installed when asked for."""
    import importlib.util

    log = config.logging
    steps = log.profile_steps
    if steps and (
        len(steps) > 2 or any(s < 1 for s in steps) or (len(steps) == 2 and steps[0] > steps[1])
    ):
        raise ConfigError(
            f"logging.profile_steps must be [first, last] (or [step]) with 1 <= first <= last, "
            f"got {steps}"
        )
    if log.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "logging.wandb = true needs the wandb package: pip install 'hlat-train[wandb]'"
        )
    if log.wandb and not log.wandb_project:
        raise ConfigError("logging.wandb_project must not be empty when logging.wandb = true")


MIN_HANG_TIMEOUT = 1.0


def _check_hang_timeout(value: float) -> None:
    """train.hang_timeout: 0 (auto), negative (off) or a fixed timeout of at least 1 s."""
    if not math.isfinite(value):
        raise ConfigError(
            f"train.hang_timeout must be a finite number of seconds (0: auto, a negative "
            f"value: no watchdog), got {value}"
        )
    if 0 < value < MIN_HANG_TIMEOUT:
        raise ConfigError(
            f"train.hang_timeout = {value:g} s is too short for a hang timeout (a rank that "
            f"is merely busy would be ended): give at least {MIN_HANG_TIMEOUT:g} s, 0 for the "
            "automatic timeout, or a negative value to turn the watchdog off"
        )


def compute_device_type(device: str) -> str:
    """The type of the device ``train.device`` names: ``auto`` is the accelerator torch
    sees, else the CPU."""
    import torch

    from hlat_parallel.device import accelerator

    found = accelerator() if device == "auto" else torch.device(device)
    return found.type if found is not None else "cpu"


def runs_hlat_attention(
    attention: str, device: str, documents: bool, seq_len: int, head_dim: int
) -> bool:
    """Whether the model's attention runs one of ``hlat_model``'s own kernels on ``device``
    (``train.device``; ``auto`` is the accelerator torch sees, else the CPU) rather than
    torch's SDPA or flex attention: the blocked kernel by hlat-model's rule
    (``hlat_model.attention.resolve_backend``, for these documents and sequence length), or
    on a CPU its flash kernels, by hlat-model's own test
    (``hlat_model.attention.runs_flash_kernel``) for both bf16 and fp32 tensors of this
    sequence and head size, so whatever dtype the step computes in."""
    import torch

    from hlat_model import attention as hlat_attention

    device_type = compute_device_type(device)
    rule = hlat_attention.resolve_backend(
        attention, device_type, documents=documents, seq_len=seq_len
    )
    if rule == "blocked":
        return True
    if device_type != "cpu":
        return False
    # packed documents on a CPU are the blocked rule's, above; this is plain causal attention
    mask = hlat_attention.AttentionMask.build(None, seq_len, attention, torch.device("cpu"))
    shape = (1, 1, seq_len, head_dim)
    heads = [
        torch.empty((), dtype=dtype).expand(shape) for dtype in (torch.bfloat16, torch.float32)
    ]
    return all(hlat_attention.runs_flash_kernel(q, q, q, mask) for q in heads)


def compiled_tp_checkpoints_fail() -> bool:
    """Whether the installed torch is one that cannot compile a tensor-parallel block with
    SDPA inside a ``torch.utils.checkpoint`` region (``selective`` checkpointing): 2.13
    fails, 2.9 works; 2.10 and later count as failing until tested. The blocked attention
    kernel (plain operators in compiled code) compiles there on 2.13
    (``tests/test_compile.py``)."""
    import torch
    from torch.torch_version import TorchVersion

    return TorchVersion(torch.__version__) >= "2.10"
