"""`TrainConfig`: everything a run needs, as nested dataclasses whose docstrings are the
documentation; TOML presets shipped with the package; ``--section.key=value`` overrides.

A config is plain data. :func:`validate` checks it (and the files it names) without creating
a process group or allocating a tensor, so a mistake costs seconds, not a queue slot.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """An invalid configuration; the message names the key and says what to do."""


@dataclass
class ModelConfig:
    """The model: a ``hlat_model.LlamaConfig`` preset, with any field overridden.

    Fields left at ``None`` take the preset's value.
    """

    preset: str = "tiny"
    """``hlat-7b``, ``llama2-7b``, ``llama3-8b``, ``llama2-70b``, ``llama3-70b``, ``1b`` or
    ``tiny`` (hlat-model presets)."""
    vocab_size: int | None = None
    """Embedding rows; 0 means the tokenizer's vocabulary rounded up to a multiple of 64."""
    dim: int | None = None
    """Hidden size."""
    n_layers: int | None = None
    """Transformer blocks."""
    n_heads: int | None = None
    """Query heads."""
    n_kv_heads: int | None = None
    """Key/value heads (fewer than ``n_heads``: GQA)."""
    ffn_dim: int | None = None
    """SwiGLU inner size."""
    max_seq_len: int | None = None
    """Longest sequence (RoPE positions)."""
    rope_theta: float | None = None
    """RoPE base."""
    norm_eps: float | None = None
    """RMSNorm epsilon (a Hugging Face config's ``rms_norm_eps``)."""
    tie_embeddings: bool | None = None
    """The LM head uses the input embedding's weight (a Hugging Face config's
    ``tie_word_embeddings``). Not with ``parallel.tp > 1`` or ``parallel.pp > 1``, or on the
    neuron backend."""
    init_std: float | None = None
    """Normal init standard deviation (HLAT: 0.021)."""
    scaled_init: bool | None = None
    """``o_proj``/``down_proj`` init scaled by ``1/sqrt(2 n_layers)``."""
    checkpointing: str | None = None
    """Activation checkpointing: ``none``, ``selective`` (HLAT) or ``full``."""
    attention: str | None = None
    """``auto``, ``sdpa``, ``flex`` or ``blocked`` (``auto``: on CPUs the blocked kernel, or
    hlat-model's flash kernels where they run, packed documents included; ``flex`` for packed
    documents on CUDA; else ``sdpa``)."""
    compile: bool | str = "auto"
    """``torch.compile`` each transformer block (after TP/SP and before FSDP2, as torchtitan
    does; backend ``neuron`` on TorchNeuron): ``true``, ``false`` or ``auto``, which
    compiles where it was measured to pay: bf16 runs of 10,000 steps or more on CPUs that
    multiply bf16 natively where hlat-model's fused CPU kernels do not run (no C++ compiler,
    or ``HLAT_MODEL_NATIVE=0``; 1.06x-1.07x eager in hlat-model's benchmark, 0.95x where the
    kernels run; fp32 1.01x-1.07x) and
    on CUDA GPUs with bf16 tensor cores (1.28x-1.29x on an H200), and nowhere else (Trainium
    is not measured here: set ``true``); the choice and its reason are logged at start
    (``hlat_train.compiling``). Not on ``parallel.backend =
    "neuron"`` (trn1), where XLA compiles the whole step."""
    init_from_hf: str = ""
    """A Hugging Face Llama ``save_pretrained`` directory (safetensors) to start from, for
    continued pre-training; its shape must be the model's (checked before any work). Each
    rank reads only the slices it holds. On resume the checkpoint's weights win."""


@dataclass
class SourceConfig:
    """One source of a weighted mixture: a ``[[data.sources]]`` table
    (``hlat_data.MixtureSource``)."""

    name: str = ""
    """Unique name; it keys the source's loader state and its metrics."""
    paths: list[str] = field(default_factory=list)
    """The source's files, directories or URLs."""
    weight: float = 1.0
    """Relative share of the training tokens (normalised over the sources)."""
    epochs: int | None = None
    """Passes over the source before it ends (unset: it repeats)."""
    max_tokens: int | None = None
    """Tokens drawn from it over the whole run, all ranks together (unset: no cap)."""
    valid_paths: list[str] = field(default_factory=list)
    """Held-out documents of this source: a validation loss of its own."""


@dataclass
class DataConfig:
    """Corpus, tokenizer and packing (``hlat_data.PackedLoader``, or
    ``hlat_data.MixedLoader`` for a mixture)."""

    paths: list[str] = field(default_factory=list)
    """Training Arrow/Parquet or JSON-lines (``.jsonl``, ``.gz``, ``.zst``) files,
    directories or ``s3://`` URLs (or use ``sources``)."""
    sources: list[SourceConfig] = field(default_factory=list)
    """A weighted mixture instead of ``paths``: ``[[data.sources]]`` tables with ``name``,
    ``paths``, ``weight`` and optionally ``epochs``, ``max_tokens``, ``valid_paths``. Rows
    are blended so that each source's share of the tokens follows its weight."""
    mixture_change: str = "error"
    """Resuming under a mixture other than the checkpoint's: ``"error"`` refuses and names
    the change; ``"continue"`` keeps the sources by name where they stood, starts new ones at
    their beginning and blends by the new weights."""
    valid_paths: list[str] = field(default_factory=list)
    """Held-out documents for the validation loss (empty: no validation)."""
    tokenizer: str = ""
    """SentencePiece ``.model`` (or Hugging Face ``tokenizer.json``)."""
    text_column: str = "text"
    """Column (Arrow, Parquet) or field (JSON lines) holding the documents."""
    on_bad_record: str = "error"
    """A record that is not UTF-8, broken JSON, or lacks its text (null, missing):
    ``"error"`` stops the run naming its file and line; ``"skip"`` skips it and counts it
    in the metrics (``bad_records``)."""
    seq_len: int = 4096
    """Tokens per packed row."""
    micro_batch_size: int = 1
    """Rows per micro-batch per data-parallel rank."""
    add_bos: bool = False
    """Prepend BOS to every document (HLAT: EOS only, GPT-3 style)."""
    document_mask: bool = False
    """Restart positions at each packed document and block attention across documents.
    HLAT attends across documents (``false``, the default of every preset); masking is a
    known improvement. On the tiny demo model on CPU it costs about 3 % per step."""
    tokenizer_threads: int = 0
    """Threads each process encodes with; 0: its cores shared by the processes of its node
    (``hlat_data.default_threads``)."""
    num_workers: int = 0
    """Tokenizer processes per rank (0: tokenize in the training process)."""
    seed: int = 1234
    """Seed of the document order (changes per epoch)."""
    block_size: int = 1024
    """Documents per shuffle block; each data-parallel rank needs at least one block."""

    def held_out_sets(self) -> list[tuple[str, list[str]]]:
        """(name, paths) of each held-out set: ``valid_paths`` as ``""``, then each mixture
        source's own."""
        sets = [("", self.valid_paths)] if self.valid_paths else []
        return sets + [(s.name, s.valid_paths) for s in self.sources if s.valid_paths]


@dataclass
class OptimConfig:
    """AdamW, the LR schedule, clipping and the precision mode (``hlat_optim``)."""

    lr: float = 3e-4
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final LR as a fraction of ``lr`` (HLAT: 3e-5 / 3e-4)."""
    warmup_steps: int = 200
    """Linear warmup steps (at most ``train.steps`` or ``decay_steps``)."""
    constant_steps: int = 0
    """Steps at peak LR between warmup and cosine decay."""
    decay_steps: int = 0
    """Horizon of the cosine (HLAT: 500000); 0 means ``train.steps``."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to every parameter (norms too, as HLAT does)."""
    clip: float = 1.0
    """Global gradient-norm clip (0: none)."""
    precision: str = "bf16-sr"
    """``bf16-sr`` (bf16 params, stochastic rounding), ``bf16-kahan`` (bf16 params with a
    bf16 Kahan compensation), ``bf16`` (round to nearest), ``mixed`` (fp32 master weights),
    ``fp32``, or ``auto``: bf16-sr where the device multiplies bf16 natively (CUDA with bf16
    tensor cores, Trainium, CPUs with AVX512-BF16, AMX or Arm's BF16, unless oneDNN is held
    below them by ``ONEDNN_MAX_CPU_ISA``), else fp32; the choice and its reason are logged at
    start."""
    impl: str = "auto"
    """AdamW update: ``auto`` (C++ loop on CPU, compiled elsewhere, eager fallback),
    ``native``, ``compiled`` or ``reference``."""


@dataclass
class ParallelConfig:
    """Layout (``hlat_parallel``): mesh ("pp", "dp", "cp", "tp"). DP is what is left:
    world size / (pp x cp x tp)."""

    tp: int = 1
    """Tensor-parallel degree."""
    sp: bool = False
    """Sequence parallelism (needs tp > 1)."""
    pp: int = 1
    """Pipeline-parallel degree: ranks the blocks are split over (torch backend)."""
    pp_schedule: str = "1F1B"
    """Pipeline schedule: ``1F1B``, ``GPipe``, ``Interleaved1F1B``,
    ``InterleavedZeroBubble`` or ``ZBVZeroBubble`` (``torch.distributed.pipelining``)."""
    pp_virtual: int = 0
    """Stages per pipeline rank; 0: the schedule's own (1 for 1F1B and GPipe, 2 for the
    interleaved and V-shaped ones)."""
    pp_microbatches: int = 0
    """Micro-batches per pipeline step, the gradient-accumulation micro-batches
    (``train.global_batch_size / (data.micro_batch_size x dp)``); 0: that number. Set, it
    must equal it."""
    pp_split: list[int] = field(default_factory=list)
    """Blocks per stage (pp x virtual entries), e.g. ``[7, 9, 9, 7]``; empty: balanced, the
    embedding and the LM head each counted as one block (``hlat_parallel.split_layers``)."""
    cp: int = 1
    """Context-parallel degree: shards of each sequence (torch backend; no document
    masking)."""
    dp: int = 0
    """Expected data-parallel degree (0: whatever was launched); a mismatch is an error."""
    dp_shard: str = "auto"
    """What data parallelism shards over dp (x cp): ``fsdp`` (parameters, gradients and
    optimizer state; FSDP2, one all-gather and one reduce-scatter per step), ``zero1``
    (optimizer state only; parameters and gradients whole, one all-reduce and one
    all-gather per step, HLAT's layout), ``none`` (nothing: every rank holds everything,
    one all-reduce per step). ``auto``: ``fsdp`` on the torch backend, ``zero1`` on the
    neuron backend (NxD's ZeRO-1, its only layout)."""
    nodes: int = 0
    """Expected number of nodes (0: any); checked against torchrun's world."""
    backend: str = "auto"
    """``torch``: the native path on any device (DTensor TP/SP, FSDP2, DCP): CPUs, GPUs and
    Trainium trn2/trn3 through TorchNeuron's ``neuron`` device. ``neuron``: the legacy
    PyTorch/XLA + NeuronX Distributed path, for trn1. ``auto``: ``torch`` wherever a
    ``neuron`` device is registered or NxD is absent, ``neuron`` on trn1 (the log says why)."""
    dist_backend: str = "auto"
    """Process-group backend (``gloo``, ``nccl``, ``neuron``...); ``auto``: torch's default
    for the device type."""


@dataclass
class CheckpointConfig:
    """Sharded checkpoints and auto-resume (``hlat_ckpt``)."""

    dir: str = ""
    """Directory or ``s3://`` URL; empty means ``<train.out_dir>/checkpoints``."""
    every: int | str = 1000
    """Save every this many steps (and at the end, and on SIGTERM). ``"auto"``: the first
    save after 50 steps, then an interval re-estimated at every save from the run's own
    measured save stall, background write and step time and ``mtbf_hours`` (Young/Daly,
    see ``hlat_train.interval``), logged as a ``checkpoint_interval`` record."""
    keep_last: int = 5
    """Complete checkpoints kept."""
    async_save: bool = True
    """Write in the background after copying the state to host memory."""
    resume: bool = True
    """Start from the newest complete checkpoint when there is one. ``false``: start over;
    checkpoints already in ``checkpoint.dir`` are not resumed, and each is deleted once this
    run has saved a step at least as new (their lineage is abandoned, ``hlat_ckpt``); their
    spike-guard file is not read, and goes at this run's first checkpoint."""
    verify_checksums: bool = True
    """Before resuming, read the checkpoint's files back and compare them with the checksums
    its manifest recorded; a damaged checkpoint is skipped for the one before it."""
    mtbf_hours: float = 12.0
    """Mean time between failures that stop the whole job, for ``every = "auto"``. An
    assumption until you know your cluster's: its own history of interrupted jobs is the
    figure to put here."""
    preempt_budget: float = 25.0
    """Seconds a scheduler grants between SIGTERM and SIGKILL that a save may use (Slurm
    and Kubernetes give 30 s by default; see docs/cluster/preemption.md). On SIGTERM the
    run saves only if the slowest of its recent measured saves fits in what is left of the
    budget; otherwise it exits at once and logs the steps that will be lost. 0: always
    save on SIGTERM (the budget is the scheduler's business)."""


@dataclass
class LoggingConfig:
    """Console, JSONL, TensorBoard and the end-of-run plot."""

    every: int = 1
    """Log every this many steps. Logged steps (and checkpoint steps) are the only ones
    that read values from the device (one transfer); the steps between them never make the
    host wait for the device."""
    progress: bool = True
    """Progress bar with ETA on rank 0 (tqdm when installed). Off, the lines it would print
    (loss spikes, validation losses) go to the log (stderr, rank 0)."""
    jsonl: bool = True
    """Write ``<out_dir>/metrics.jsonl``."""
    tensorboard: bool = False
    """Write TensorBoard events to ``<out_dir>/tb`` (needs ``tensorboard``)."""
    plot: bool = True
    """Write ``<out_dir>/training.png`` at the end (needs ``matplotlib``; skipped without)."""
    peak_tflops: float = 0.0
    """Peak per-device TFLOP/s for MFU; 0: the built-in table, or a measured CPU matmul."""
    param_norm: bool = True
    """Log the global parameter norm at logged steps (a pass over every weight and one
    all-reduce per layout; the large presets turn it off)."""
    wandb: bool = False
    """Log to Weights & Biases on rank 0 (``pip install 'hlat-train[wandb]'``): the metrics
    and the whole config; a resumed run logs into the same W&B run (its id is kept in
    ``<out_dir>/wandb_run_id``). Mode and credentials come from W&B's environment
    (``WANDB_MODE=offline``, ``WANDB_API_KEY``)."""
    wandb_project: str = "hlat"
    """W&B project."""
    wandb_name: str = ""
    """W&B run name (empty: W&B picks one)."""
    profile_steps: list[int] = field(default_factory=list)
    """Trace these steps with ``torch.profiler`` on every rank: ``[first, last]`` (or
    ``[step]``), written to ``<out_dir>/profile`` as Chrome traces (TensorBoard's profiler
    plugin, Perfetto). Empty: no tracing."""
    memory_snapshot_step: int = 0
    """Record the CUDA allocator's history and dump a snapshot after this step and on an
    out-of-memory error, to ``<out_dir>/memory`` (open in pytorch.org/memory_viz); 0: off.
    Other devices have no allocator history: the run logs that none is taken."""


@dataclass
class SpikeConfig:
    """Loss-spike guard: a spike is a loss above mean + k std of the recent window, or a
    non-finite gradient norm."""

    policy: str = "warn"
    """``off``, ``warn``, ``skip`` (drop the update) or ``rollback`` (reload the last
    checkpoint and skip the batches that caused the spike). The guard judges on the device:
    ``skip`` and ``rollback`` drop the spiking step's update there at once, without a host
    read. ``rollback`` goes back when the verdict is next read on the host, at the next
    logged step (``logging.every``) or before the next checkpoint, whichever comes first, so
    a checkpoint never holds a state past an unhandled spike. Whatever the policy, an update
    with a non-finite loss or gradient norm is always dropped (on trn1, where NxD's ZeRO-1
    clips by the norm inside its step, one with a non-finite loss)."""
    window: int = 50
    """Steps in the running mean and standard deviation."""
    k: float = 6.0
    """Standard deviations above the mean that count as a spike."""
    min_history: int = 10
    """Steps seen before loss spikes are judged (non-finite norms always are); at most
    ``window``."""
    new_level_after: int = 10
    """Steps in a row with a loss above the band after which the loss has moved to a new
    level (harder data, a changed mixture) that the window takes in, so the band follows it
    (``hlat_train.SpikeGuard``); 0: never, every later step stays a spike. Under ``warn``
    and ``skip``: ``rollback`` goes back at the first spike."""
    max_rollbacks: int = 5
    """Rollbacks allowed in one run before giving up with an error."""
    inject_at: list[int] = field(default_factory=list)
    """Fire drill: report the loss of these steps 100x too high, once each, to see the
    policy act on a real run (leave empty in production)."""
    inject_nan_at: list[int] = field(default_factory=list)
    """Fire drill: report the loss of these steps as NaN, once each per process, to see a
    non-finite loss handled on a real run: the update is dropped whatever the policy
    (``rollback`` also rolls back). Leave empty in production."""


@dataclass
class NeuronConfig:
    """Trainium settings (``hlat_train.neuron``); ignored on other backends."""

    llm_training_strategy: bool = True
    """Add ``--distribution-strategy=llm-training`` to ``NEURON_CC_FLAGS`` (disabled in newer
    NxD examples because of a compiler bug: switch off if compilation fails)."""
    cc_flags: str = "--model-type transformer"
    """Other neuronx-cc flags."""
    cache_dir: str = ""
    """Compile cache (``--cache_dir``); copy it to node-local disk for large clusters."""
    inflight_requests: int = 3
    """``NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS`` (host/device overlap)."""
    malloc_arena_max: int = 64
    """``MALLOC_ARENA_MAX``."""
    fuse_softmax: bool = True
    """``NEURON_FUSE_SOFTMAX``."""
    efa: bool = True
    """EFA settings for multi-node (``FI_PROVIDER=efa`` ...)."""


@dataclass
class RunConfig:
    """The run itself: length, batch, output and evaluation."""

    steps: int = 10000
    """Optimizer steps to train (the run ends there; resume continues up to it)."""
    time_limit: float = 0.0
    """Stop (with a checkpoint) after this many seconds of training, 0 for none; running
    the same command again continues. For wall-clock-limited jobs and the demo."""
    global_batch_size: int = 0
    """Sequences per optimizer step over all ranks; 0 means micro_batch_size x dp (no
    accumulation). Must be a multiple of micro_batch_size x dp; the quotient is the number
    of gradient-accumulation micro-steps."""
    out_dir: str = "runs/hlat"
    """Where metrics, plots and (by default) checkpoints go."""
    seed: int = 0
    """Seed of the weight initialisation and the stochastic rounding."""
    device: str = "auto"
    """``auto`` (the accelerator ``torch.accelerator`` reports, else the CPU), ``cpu``,
    ``cuda``, ``neuron`` (Trainium trn2/trn3 through TorchNeuron) or any other device torch
    knows; each local process takes the device of its local rank. A device this torch lacks
    stops the run before any work, naming what to install."""
    host_malloc: str = "auto"
    """What the C library's ``malloc`` does with freed host memory
    (:mod:`hlat_train.host_memory`). ``system``: the C library's defaults. ``retain``: keep
    it for reuse (glibc's mmap and trim thresholds raised for the whole process), so that a
    CPU run does not page-fault its activations in again every step; glibc 2.35 or later
    only. ``auto``: ``retain`` for runs computing on the CPU where the C library is glibc
    2.35 or later (older ones refuse the mmap threshold), else ``system``."""
    init: str = "auto"
    """How weights are created. ``full``: every rank builds the whole model from ``seed``
    and keeps its shard, so every parallel layout starts from the same weights. ``sharded``:
    the model is built on the meta device, split, and each rank initialises only its shard
    (needed when the model does not fit in host memory; weights then depend on the
    layout). ``auto``: ``full`` below 2B parameters, else ``sharded``."""
    hang_timeout: float = 0.0
    """Hang watchdog (``hlat_train.watchdog``): seconds a rank may go without progress (a
    new step, or a new region of one: forward/backward, optimizer step, stop-flag
    all-reduce, checkpoint save, validation) before it prints its rank, step, last activity
    and every thread's Python stack and exits with status 124, so that torchrun restarts
    the job instead of waiting forever on a stopped rank or a hung collective. 0 (auto):
    1800 s until a few steps are timed, then max(300 s, 10 x the slowest step so far);
    checkpoint saves and validation get at least 1800 s. A positive value: that many
    seconds everywhere (keep it above the slowest checkpoint save). In both modes set-up,
    checkpoint loads and the first step of each process (compilation) get at least
    1800 s. Negative: no watchdog. The process group's own timeout is set above it:
    max(1800 s, this) + 300 s (torch's default without a watchdog)."""
    gc_every: int = 50
    """Python's garbage collector during training, as torchtitan's ``training.gc_freq``: off
    between steps, and a young-generation collection (``gc.collect(1)``) on every rank
    after every this many steps, so that no rank stops in the middle of a step for an
    automatic collection that the other ranks then wait for (on a 2-core Xeon, the demo's
    automatic full collections took about 70 ms each, a step's time). A full collection
    runs before each checkpoint save (a pause already), so that what outlives the young
    collections is not kept for the whole run; what set-up left is collected once and
    frozen (``gc.freeze``, unless the process froze objects itself), so that those full
    collections skip it. The collector's state is restored when the loop ends, however it
    ends. 0: Python collects on its own, as outside training."""
    eval_every: int = 0
    """Validation loss every this many steps (0: at checkpoints only, when valid data exists)."""
    eval_batches: int = 8
    """Micro-batches of held-out data per validation."""
    sample_prompt: str = ""
    """Text that ``hlat-train demo`` continues at the end of its run (empty: none). ``hlat-train
    train`` and ``Trainer.fit()`` do not sample; generate from the run's checkpoint instead
    (``Trainer.generate``, or ``export-hf`` and ``transformers``)."""
    sample_tokens: int = 48
    """Most tokens to generate for the sample; it also ends at the end of the prompt's first
    block of lines (a blank line) or at the end-of-sequence token."""
    sample_temperature: float = 0.0
    """Sampling temperature for the sample (0: greedy, the most likely token each time)."""
    sample_top_k: int = 0
    """Sample among this many most likely tokens (0: all); with a positive temperature."""


@dataclass
class TrainConfig:
    """A complete training run: ``TrainConfig.preset("hlat-7b")``, ``from_toml`` or the
    ``hlat-train`` command; every section is a dataclass documented field by field."""

    train: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    neuron: NeuronConfig = field(default_factory=NeuronConfig)

    # --- construction ----------------------------------------------------------------------

    @classmethod
    def preset(cls, name: str, overrides: list[str] | None = None) -> TrainConfig:
        """A shipped preset (see :func:`preset_names`), with ``--section.key=value`` overrides."""
        names = preset_names()
        if name not in names:
            hint = difflib.get_close_matches(name, names, n=1)
            extra = f"; did you mean {hint[0]!r}?" if hint else ""
            raise ConfigError(f"unknown preset {name!r}{extra} (presets: {', '.join(names)})")
        text = resources.files("hlat_train.presets").joinpath(f"{name}.toml").read_text()
        return cls.from_dict(tomllib.loads(text), source=f"preset {name}", overrides=overrides)

    @classmethod
    def from_toml(
        cls, path: str | os.PathLike[str], overrides: list[str] | None = None
    ) -> TrainConfig:
        """A config file, or a preset name, with overrides applied."""
        path = os.fspath(path)
        if not os.path.exists(path) and not path.endswith(".toml"):
            return cls.preset(path, overrides)
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} not found") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path} is not valid TOML: {e}") from None
        return cls.from_dict(data, source=path, overrides=overrides)

    @classmethod
    def from_dict(
        cls, data: dict[str, Any], source: str = "config", overrides: list[str] | None = None
    ) -> TrainConfig:
        """Build from nested plain data; unknown keys are errors that suggest the closest."""
        config = cls()
        for section, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError(
                    f"{source}: top-level key {section!r} must be a [section] table"
                    + _suggest(section, _sections())
                )
            for key, value in values.items():
                config.set(f"{section}.{key}", value, source=source)
        for item in overrides or []:
            config.set_override(item)
        return config

    def set(self, dotted: str, value: Any, source: str = "override") -> None:
        """Set ``section.key`` to ``value``, converted to the field's type."""
        obj, key, hint = self._field(dotted, source)
        setattr(obj, key, _convert(value, hint, f"{source}: {dotted}"))

    def _field(self, dotted: str, source: str) -> tuple[Any, str, Any]:
        """The section object, key and type hint of ``section.key``."""
        section, _, key = dotted.partition(".")
        if section not in _sections():
            raise ConfigError(
                f"{source}: unknown section {section!r} in {dotted!r}"
                + _suggest(section, _sections())
            )
        obj = getattr(self, section)
        names = [f.name for f in dataclasses.fields(obj)]
        if key not in names:
            keys = [f"{section}.{n}" for n in names]
            everything = [
                f"{s}.{f.name}" for s in _sections() for f in dataclasses.fields(getattr(self, s))
            ]
            raise ConfigError(
                f"{source}: unknown key {dotted!r}"
                + _suggest(dotted, keys + everything)
                + f" (keys of [{section}]: {', '.join(names)})"
            )
        return obj, key, typing.get_type_hints(type(obj))[key]

    def set_override(self, item: str) -> None:
        """Apply one ``--section.key=value`` (the leading dashes are optional)."""
        text = item[2:] if item.startswith("--") else item
        if "=" not in text:
            raise ConfigError(f"override {item!r} must look like --section.key=value")
        key, raw = text.split("=", 1)
        source = f"override {item!r}"
        value = _parse_scalar(raw)
        _, _, hint = self._field(key.strip(), source)
        if typing.get_origin(hint) is list and not isinstance(value, list | dict | str):
            value = raw.strip()  # one item of a list (--spike.inject_at=3): the a,b form
        self.set(key.strip(), value, source=source)

    # --- output ----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Nested plain data (TOML- and JSON-ready)."""
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        """The merged config as TOML (``None`` fields are left out: they mean "default")."""
        lines: list[str] = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            for key, value in values.items():
                if value is not None:
                    lines.append(f"{key} = {_toml_value(value)}")
            lines.append("")
        return "\n".join(lines)

    # --- derived ---------------------------------------------------------------------------

    @property
    def checkpoint_dir(self) -> str:
        """Where checkpoints go."""
        return self.checkpoint.dir or os.path.join(self.train.out_dir, "checkpoints")

    def llama_config(self, tokenizer_vocab: int | None = None) -> Any:
        """The ``hlat_model.LlamaConfig`` this config describes."""
        from hlat_model import LlamaConfig

        fields = {
            f.name: getattr(self.model, f.name)
            for f in dataclasses.fields(self.model)
            if f.name not in ("preset", "init_from_hf", "compile")
            and getattr(self.model, f.name) is not None
        }
        if fields.get("vocab_size") == 0:
            if tokenizer_vocab is None:
                raise ConfigError("model.vocab_size = 0 needs a tokenizer (data.tokenizer)")
            fields["vocab_size"] = -(-tokenizer_vocab // 64) * 64
        from hlat_model import PRESETS

        preset = PRESETS.get(self.model.preset, {})
        multi_head = preset.get("n_kv_heads", preset.get("n_heads")) == preset.get("n_heads")
        if "n_heads" in fields and "n_kv_heads" not in fields and multi_head:
            # Note: a multi-head preset stays multi-head when only n_heads is changed
            fields["n_kv_heads"] = fields["n_heads"]
        return LlamaConfig.preset(self.model.preset, **fields)

    def grad_accum(self, dp: int) -> int:
        """Micro-steps per optimizer step at data-parallel degree ``dp``."""
        per_step = self.data.micro_batch_size * dp
        gbs = self.train.global_batch_size or per_step
        return gbs // per_step


def preset_names() -> list[str]:
    """The presets shipped with this package."""
    root = resources.files("hlat_train.presets")
    return sorted(p.name[: -len(".toml")] for p in root.iterdir() if p.name.endswith(".toml"))


def _sections() -> list[str]:
    return [f.name for f in dataclasses.fields(TrainConfig)]


def _suggest(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


def _parse_scalar(raw: str) -> Any:
    raw = raw.strip()
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # a bare string such as a path


def _convert(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) < len(typing.get_args(hint)) and (
            value is None or (isinstance(value, str) and value.lower() in ("none", "null"))
        ):
            return None
        for arg in args[:-1]:  # the first type the value converts to (int before str)
            try:
                return _convert(value, arg, where)
            except ConfigError:
                continue
        return _convert(value, args[-1], where)
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return _convert_table(value, hint, where)
    if origin is list:
        (inner,) = typing.get_args(hint)
        if isinstance(value, str):  # the a,b form of an override: each item a TOML value
            value = [v if inner is str else _parse_scalar(v) for v in value.split(",") if v]
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return [_convert(v, inner, where) for v in value]
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    if hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where} must be a string, got {value!r}")
    return value


def _convert_table(value: Any, hint: type, where: str) -> Any:
    """A dataclass from a TOML table (``[[section.key]]`` or ``{k = v}``)."""
    if dataclasses.is_dataclass(value) and isinstance(value, hint):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"{where} entries must be tables, got {value!r}")
    names = [f.name for f in dataclasses.fields(hint)]
    hints = typing.get_type_hints(hint)
    out = hint()
    for key, item in value.items():
        if key not in names:
            raise ConfigError(
                f"{where}: unknown key {key!r}"
                + _suggest(key, names)
                + f" (keys: {', '.join(names)})"
            )
        setattr(out, key, _convert(item, hints[key], f"{where}.{key}"))
    return out


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        # JSON's string escapes are TOML basic-string escapes; TOML also refuses a raw DEL
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        items = [f"{k} = {_toml_value(v)}" for k, v in value.items() if v is not None]
        return "{" + ", ".join(items) + "}"
    return repr(value)
