"""Pipeline parallelism: split a model's blocks into stages and run them with one of
``torch.distributed.pipelining``'s schedules.

Three pieces, usable alone:

* :func:`split_layers` decides which blocks each stage holds (plain data, pure);
* :class:`StageModule` / :func:`stage_modules` build this rank's stage modules from any model
  that follows the structural contract below, keeping the original parameter names;
* :func:`build_schedule` / :func:`build_pipeline` wrap them in torch's ``PipelineStage`` and
  schedule; :func:`bubble_fraction` states each schedule's idle time.

Structural contract of the model (names are arguments; the defaults are Llama's):

* ``pre`` modules (default ``("embed_tokens",)``) run in order on the first stage's input;
* ``layers`` (default ``"layers"``) is an ``nn.ModuleList`` of blocks, each called as
  ``block(h, *block_args)``;
* ``post`` modules (default ``("norm", "lm_head")``) run in order on the last stage's
  hidden state; their output is what the loss function receives;
* no other module holds parameters (checked).

``block_args(h, **kwargs) -> tuple`` builds the blocks' extra positional arguments (RoPE
tables, an attention mask...) from the hidden state entering the stage and the keyword
arguments every rank passes to ``schedule.step`` (e.g. ``position_ids``, ``doc_lens``, split
into micro-batches along dimension 0 like the input). Each stage calls it once per
micro-batch, so nothing model-specific crosses a pipeline boundary but the hidden state.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

from hlat_parallel.device import accelerator
from hlat_parallel.dims import ParallelConfigError, check_pipeline_torch
from hlat_parallel.plan import computes_sequence_first

ScheduleName = Literal["1F1B", "GPipe", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"]

SCHEDULES: tuple[str, ...] = (
    "1F1B",
    "GPipe",
    "Interleaved1F1B",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
)
"""Schedule names :func:`build_schedule` accepts (all run on CPU with gloo in torch 2.13)."""

_SINGLE_STAGE = ("1F1B", "GPipe")
_V_SHAPED = ("ZBVZeroBubble",)


@dataclass(frozen=True)
class StageSplit:
    """What one pipeline stage holds: plain data, picklable, comparable."""

    index: int
    """Stage index, 0 .. n_stages - 1, in the order the data flows."""
    layers: tuple[int, ...]
    """Indices of the blocks this stage runs (contiguous, ascending)."""
    first: bool
    """Holds the ``pre`` modules (the embedding) and takes the model's input."""
    last: bool
    """Holds the ``post`` modules (final norm and LM head) and produces the output."""


def default_virtual(schedule: str) -> int:
    """Stages per pipeline rank a schedule runs unless told otherwise: 1 for ``1F1B`` and
    ``GPipe``, 2 for the interleaved and V-shaped ones."""
    return 1 if schedule in _SINGLE_STAGE else 2


def _positive_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ParallelConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def split_layers(
    n_layers: int,
    n_stages: int,
    *,
    split: Sequence[int] | None = None,
    pre_cost: float = 1.0,
    post_cost: float = 1.0,
) -> list[StageSplit]:
    """Which blocks each of ``n_stages`` stages holds; the embedding goes on the first stage,
    the final norm and LM head on the last.

    Balance rule: a stage costs its number of blocks, plus ``pre_cost`` block-equivalents
    on the first stage (the embedding) and ``post_cost`` on the last (norm, LM head and
    loss), as torchtitan's ``input_weight`` / ``output_weight``. Blocks are handed out one
    at a time to the cheapest stage so far, so stage costs differ by at most one block
    (except a first or last stage whose embedding or head alone costs more than the others'
    share: it gets no block). Blocks are then laid out in order, stage 0 first.

    ``split`` (block counts per stage, e.g. ``[3, 5, 5, 3]``) overrides the rule. It must
    have ``n_stages`` entries summing to ``n_layers``; a middle stage must hold at least one
    block, the first and last may hold none (they still hold the embedding or the head).

    Note: among stages of equal cost the later one gets the next block: under 1F1B the
    first stage keeps the most micro-batches' activations alive (one per stage), so it is
    the one to keep light.
    """
    n_layers = _positive_int("n_layers", n_layers)
    n_stages = _positive_int("n_stages", n_stages)
    for name, cost in (("pre_cost", pre_cost), ("post_cost", post_cost)):
        if not isinstance(cost, (int, float)) or isinstance(cost, bool) or not cost >= 0:
            raise ParallelConfigError(f"{name} must be a number >= 0, got {cost!r}")
    if split is not None:
        counts = _check_split(list(split), n_layers, n_stages)
    else:
        if n_layers < n_stages - 2:
            raise ParallelConfigError(
                f"{n_layers} blocks cannot fill {n_stages} pipeline stages: every stage but "
                f"the first and last needs a block; use at most {n_layers + 2} stages "
                "(pp x virtual stages) or a model with more layers"
            )
        fixed = [0.0] * n_stages
        fixed[0] += pre_cost
        fixed[-1] += post_cost
        counts = [0] * n_stages
        ends = (0, n_stages - 1)

        def priority(s: int) -> tuple[bool, float, int]:
            # an empty middle stage first (even when pre_cost or post_cost is 0), then the
            # cheapest stage, then the later one
            return (counts[s] > 0 or s in ends, fixed[s] + counts[s], -s)

        for _ in range(n_layers):
            counts[min(range(n_stages), key=priority)] += 1
    out, start = [], 0
    for index, count in enumerate(counts):
        layers = tuple(range(start, start + count))
        out.append(StageSplit(index, layers, index == 0, index == n_stages - 1))
        start += count
    return out


def _check_split(split: list[Any], n_layers: int, n_stages: int) -> list[int]:
    if len(split) != n_stages:
        raise ParallelConfigError(
            f"pipeline split {split} has {len(split)} entries for {n_stages} stages "
            "(pp x virtual stages); give one block count per stage"
        )
    for index, count in enumerate(split):
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ParallelConfigError(
                f"pipeline split {split}: entry {index} must be a block count >= 0, got {count!r}"
            )
        if count == 0 and 0 < index < n_stages - 1:
            raise ParallelConfigError(
                f"pipeline split {split}: stage {index} holds no block and is neither the "
                "first nor the last stage, so it would be empty; move a block to it"
            )
    if sum(split) != n_layers:
        raise ParallelConfigError(
            f"pipeline split {split} holds {sum(split)} blocks but the model has "
            f"{n_layers}; make the counts sum to {n_layers}"
        )
    return split


def stage_ids(
    pp_rank: int, pp: int, virtual: int = 1, *, style: Literal["loop", "v"] = "loop"
) -> list[int]:
    """The stage indices pipeline rank ``pp_rank`` of ``pp`` runs, of ``pp * virtual``.

    ``"loop"`` (1F1B, GPipe, interleaved schedules): rank r holds r, r + pp, r + 2 pp, ...
    ``"v"`` (ZBVZeroBubble; ``virtual`` must be 2): rank r holds r and 2 pp - 1 - r, so the
    first and the last stage sit on rank 0 and the data turns around on rank pp - 1.
    """
    pp = _positive_int("pp", pp)
    virtual = _positive_int("virtual", virtual)
    if not 0 <= pp_rank < pp:
        raise ParallelConfigError(f"pp_rank {pp_rank} is outside 0..{pp - 1}")
    if style == "v":
        if virtual != 2:
            raise ParallelConfigError(
                f"a V-shaped schedule places exactly 2 stages per rank, got virtual={virtual}"
            )
        return [pp_rank, 2 * pp - 1 - pp_rank]
    if style != "loop":
        raise ParallelConfigError(f"style must be 'loop' or 'v', got {style!r}")
    return [pp_rank + v * pp for v in range(virtual)]


def _attach(root: nn.Module, dotted: str, module: nn.Module) -> None:
    """Register ``module`` at ``dotted`` under ``root``, creating empty parents."""
    *parents, leaf = dotted.split(".")
    owner = root
    for name in parents:
        if not hasattr(owner, name):
            owner.add_module(name, nn.Module())
        owner = getattr(owner, name)
    owner.add_module(leaf, module)


def _get(model: nn.Module, dotted: str, role: str) -> nn.Module:
    try:
        return model.get_submodule(dotted)
    except AttributeError:
        raise ParallelConfigError(
            f"{type(model).__name__} has no module {dotted!r} (given as {role}); pass the "
            "names of its modules as layers=, pre= and post="
        ) from None


def _blocks(model: nn.Module, layers: str) -> nn.ModuleList:
    blocks = _get(model, layers, "layers")
    if not isinstance(blocks, nn.ModuleList):
        raise ParallelConfigError(
            f"{type(model).__name__}.{layers} is a {type(blocks).__name__}, not an "
            "nn.ModuleList of blocks; pass the name of the block list as layers="
        )
    return blocks


class StageModule(nn.Module):
    """The part of a model one pipeline stage runs, with the model's parameter names.

    Holds the model's own ``pre`` modules (first stage), the blocks of ``split.layers`` in a
    ``ModuleDict`` keyed by their index in the model (so ``layers.5.mlp.down_proj.weight``
    keeps its name, and a checkpoint saved from the stages loads into the whole model and
    back) and the ``post`` modules (last stage). The modules are shared with ``model``, not
    copied.

    ``forward(x, **kwargs)``: ``x`` is the model's input on the first stage (token ids) and
    the hidden state from the previous stage otherwise; ``kwargs`` go to ``block_args``.
    ``checkpoint_blocks`` recomputes each block in the backward pass (full activation
    checkpointing); checkpointing inside the blocks keeps working either way.

    ``model_type`` and ``model_module_names`` name the model and all of its modules, so
    that :func:`stage_plan` checks a plan against the whole model.
    """

    def __init__(
        self,
        model: nn.Module,
        split: StageSplit,
        *,
        layers: str = "layers",
        pre: Sequence[str] = ("embed_tokens",),
        post: Sequence[str] = ("norm", "lm_head"),
        block_args: Callable[..., tuple[Any, ...]] | None = None,
        checkpoint_blocks: bool = False,
    ):
        super().__init__()
        self.split = split
        self.pre_names = tuple(pre) if split.first else ()
        self.post_names = tuple(post) if split.last else ()
        self.layers_name = layers
        self.block_args = block_args
        self.checkpoint_blocks = checkpoint_blocks
        self.model_type = type(model).__name__
        self.model_module_names = tuple(name for name, _ in model.named_modules() if name)
        blocks = _blocks(model, layers)
        for name in self.pre_names:
            _attach(self, name, _get(model, name, "pre"))
        _attach(self, layers, nn.ModuleDict({str(i): blocks[i] for i in split.layers}))
        for name in self.post_names:
            _attach(self, name, _get(model, name, "post"))

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        h = x
        for name in self.pre_names:
            h = self.get_submodule(name)(h)
        blocks = self.get_submodule(self.layers_name)
        extra: tuple[Any, ...] = ()
        if self.block_args is not None and len(blocks):  # type: ignore[arg-type]
            extra = self.block_args(h, **kwargs)
        for block in blocks.values():  # type: ignore[operator]
            if self.checkpoint_blocks and torch.is_grad_enabled():
                h = checkpoint(block, h, *extra, use_reentrant=False)
            else:
                h = block(h, *extra)
        for name in self.post_names:
            h = self.get_submodule(name)(h)
        return h


def stage_modules(
    model: nn.Module,
    splits: Sequence[StageSplit],
    stage_indices: Sequence[int],
    *,
    layers: str = "layers",
    pre: Sequence[str] = ("embed_tokens",),
    post: Sequence[str] = ("norm", "lm_head"),
    block_args: Callable[..., tuple[Any, ...]] | None = None,
    checkpoint_blocks: bool = False,
) -> list[StageModule]:
    """The :class:`StageModule` of each stage in ``stage_indices`` (this rank's stages).

    Checks the model against the contract first: ``layers`` is an ``nn.ModuleList`` with
    as many blocks as ``splits`` cover, every parameter belongs to a ``pre``, block or
    ``post`` module, and no parameter is shared by two stages (tied input and output
    embeddings on different stages would need their gradients summed over the pipeline,
    which is not done here). Models computing sequence-first are refused: stages exchange
    the batch-first hidden state.

    Note: the stages share modules with ``model`` (nothing is copied), so drop ``model``
    to free the blocks this rank does not run; build it on the meta device and
    materialise the stages (``to_empty``, then load a checkpoint) for models that do not
    fit one rank.
    """
    blocks = _blocks(model, layers)
    covered = sum(len(s.layers) for s in splits)
    if covered != len(blocks):
        raise ParallelConfigError(
            f"the pipeline split covers {covered} blocks but {type(model).__name__}.{layers} "
            f"holds {len(blocks)}; split with n_layers={len(blocks)}"
        )
    if computes_sequence_first(model):
        raise ParallelConfigError(
            f"{type(model).__name__} computes sequence-first; pipeline stages pass "
            "batch-first hidden states, so build it with sequence_first=False"
        )
    owned = [*pre, *post, *(f"{layers}.{i}" for i in range(len(blocks)))]
    owner_of: dict[int, str] = {}
    for name in owned:
        for param in _get(model, name, "pre/post/layers").parameters():
            owner_of.setdefault(id(param), name)
    stray = [n for n, p in model.named_parameters() if id(p) not in owner_of]
    if stray:
        raise ParallelConfigError(
            f"parameters {stray[:3]} of {type(model).__name__} belong to no pipeline stage; "
            f"list their modules in pre= (first stage) or post= (last stage)"
        )
    stage_of: dict[int, int] = {}
    for split in splits:
        names = [*(pre if split.first else ()), *(post if split.last else ())]
        names += [f"{layers}.{i}" for i in split.layers]
        for name in names:
            for param in _get(model, name, "pre/post/layers").parameters():
                other = stage_of.setdefault(id(param), split.index)
                if other != split.index:
                    raise ParallelConfigError(
                        f"a parameter of {name!r} is shared by stages {other} and "
                        f"{split.index} (tied embeddings?); untie the weights "
                        "(e.g. tie_embeddings=False) to pipeline this model"
                    )
    by_index = {s.index: s for s in splits}
    return [
        StageModule(
            model,
            by_index[i],
            layers=layers,
            pre=pre,
            post=post,
            block_args=block_args,
            checkpoint_blocks=checkpoint_blocks,
        )
        for i in stage_indices
    ]


def _pp_group(group: Any) -> dist.ProcessGroup:
    if group is None:
        return dist.group.WORLD  # type: ignore[return-value]
    if hasattr(group, "get_group"):  # a 1-D DeviceMesh, e.g. mesh["pp"]
        return group.get_group()
    return group


def _mesh_device(group: Any) -> torch.device:
    """The device of a ``DeviceMesh`` ``group`` (its type, on the current index of that
    accelerator when there is one); the CPU for a process group or ``None``."""
    kind = getattr(group, "device_type", None)
    if not isinstance(kind, str) or kind == "cpu":
        return torch.device("cpu")
    found = accelerator()
    if found is not None and found.type == kind:
        return torch.device(kind, torch.accelerator.current_device_index())
    return torch.device(kind)


def check_schedule(name: str, pp: int, virtual: int, n_microbatches: int) -> None:
    """Raise :class:`ParallelConfigError` if schedule ``name`` cannot run ``virtual``
    stages per rank on ``pp`` ranks with ``n_microbatches``; pure, so it runs before any
    process group exists."""
    pp = _positive_int("pp", pp)
    virtual = _positive_int("virtual", virtual)
    if name not in SCHEDULES:
        raise ParallelConfigError(f"unknown pipeline schedule {name!r}; pick one of {SCHEDULES}")
    n_microbatches = _positive_int("n_microbatches", n_microbatches)
    if name in _SINGLE_STAGE and virtual != 1:
        raise ParallelConfigError(
            f"schedule {name} runs one stage per rank, got virtual={virtual}; use "
            "Interleaved1F1B or InterleavedZeroBubble for more stages per rank"
        )
    if name in _V_SHAPED and virtual != 2:
        raise ParallelConfigError(
            f"schedule {name} runs exactly 2 stages per rank, got virtual={virtual}"
        )
    if name == "1F1B" and n_microbatches < pp:
        raise ParallelConfigError(
            f"schedule 1F1B needs at least as many micro-batches as stages: "
            f"n_microbatches {n_microbatches} < pp {pp}"
        )
    if name in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, n_microbatches // pp)
        if n_microbatches % rounds:
            raise ParallelConfigError(
                f"schedule {name} runs micro-batches in rounds of about pp={pp}: "
                f"n_microbatches {n_microbatches} must be a multiple of {rounds} "
                f"(or at most {pp})"
            )


def build_schedule(
    name: str,
    stages: Sequence[Any],
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
    *,
    scale_grads: bool = True,
) -> Any:
    """torch's pipeline schedule ``name`` (one of :data:`SCHEDULES`) over this rank's
    ``PipelineStage`` objects.

    ``loss_fn(output, target)`` runs on the last stage per micro-batch; with
    ``scale_grads`` (default) gradients are divided by ``n_microbatches``, which makes a
    per-micro-batch mean loss give the gradient of the whole-batch mean. ``None`` builds a
    forward-only schedule (no backward). Run a step on every pipeline rank with
    ``schedule.step(x, target=y, losses=out, **kwargs)`` on the rank holding the first
    stage (``x`` omitted elsewhere, ``target`` and ``losses`` only where the last stage is).

    Every tensor passed to ``step`` or ``eval`` (``x``, ``target``, the keyword arguments)
    is split along dimension 0 into ``n_microbatches`` equal micro-batches, so its size
    there must be a multiple of ``n_microbatches``: the schedule returned (a subclass of
    torch's) refuses any other batch with a :class:`ParallelConfigError` on each rank that
    is passed one, before the step communicates.
    """
    from torch.distributed import pipelining

    stages = list(stages)
    if not stages:
        raise ParallelConfigError("build_schedule needs this rank's stages, got none")
    check_schedule(name, stages[0].group_size, len(stages), n_microbatches)
    cls = _whole_microbatches(getattr(pipelining, f"Schedule{name}"))
    first = stages[0] if name in _SINGLE_STAGE else stages
    return cls(first, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)


def check_microbatches(n_microbatches: int, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """Raise :class:`ParallelConfigError` unless every tensor of a schedule step's ``args``
    and ``kwargs`` (``target`` and the model's keyword arguments; ``losses`` and
    ``loss_kwargs`` are not split) has a multiple of ``n_microbatches`` rows (dimension 0)."""
    named = [(f"positional argument {i}", arg) for i, arg in enumerate(args)]
    named += [(k, v) for k, v in kwargs.items() if k not in ("losses", "loss_kwargs")]
    for name, value in named:
        for tensor in tree_flatten(value)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.dim() > 0:
                rows = tensor.shape[0]
                if rows % n_microbatches:
                    raise ParallelConfigError(
                        f"the pipeline schedule splits each batch into n_microbatches="
                        f"{n_microbatches} equal micro-batches, but {name} has {rows} rows "
                        f"(dimension 0 of shape {tuple(tensor.shape)}); pass a multiple of "
                        f"{n_microbatches} rows on every rank, or change n_microbatches"
                    )


class _WholeMicrobatches:
    """Checks the batch of each step (:func:`check_microbatches`) before torch's schedule
    splits it; ``eval`` runs through ``step``."""

    _n_microbatches: int

    def step(self, *args: Any, **kwargs: Any) -> Any:
        check_microbatches(self._n_microbatches, args, kwargs)
        return super().step(*args, **kwargs)  # type: ignore[misc]


@functools.cache
def _whole_microbatches(cls: type) -> type:
    return type(cls.__name__, (_WholeMicrobatches, cls), {"__module__": cls.__module__})


@dataclass
class Pipeline:
    """This rank's part of a pipeline: the schedule to step and what it runs."""

    schedule: Any
    """The ``torch.distributed.pipelining`` schedule; call ``step`` on every pipeline rank."""
    modules: list[StageModule]
    """This rank's stage modules (parameters, ``state_dict`` and optimizers go here)."""
    stages: list[Any]
    """The ``PipelineStage`` wrapping each module."""
    splits: list[StageSplit]
    """Every stage's split (all ranks), for logging and checks."""

    @property
    def has_first_stage(self) -> bool:
        """Whether this rank feeds the model's input to ``schedule.step``."""
        return any(m.split.first for m in self.modules)

    @property
    def has_last_stage(self) -> bool:
        """Whether this rank passes ``target`` and receives the losses."""
        return any(m.split.last for m in self.modules)

    def parameters(self) -> list[nn.Parameter]:
        """The parameters of this rank's stages (for the optimizer)."""
        return [p for m in self.modules for p in m.parameters()]

    def rank_module(self) -> nn.Module:
        """This rank's stages as one module (:func:`rank_module`)."""
        return rank_module(self.modules)


class RankModule(nn.Module):
    """What one pipeline rank holds of a model, under the model's own names: its stages'
    ``pre`` modules, blocks (``layers.<i>``) and ``post`` modules, shared with the stage
    modules. Hand it to the optimizer, the checkpointer (its ``state_dict`` keys are the
    whole model's, so a checkpoint reshards across pipeline layouts) and the gradient
    clipping; run the model through the pipeline schedule, not through this module.
    """

    def __init__(self, stages: Sequence[StageModule]):
        super().__init__()
        if not stages:
            raise ParallelConfigError("rank_module needs this rank's stage modules, got none")
        self.stage_modules = list(stages)  # a plain list: not registered twice
        names = {m.layers_name for m in stages}
        if len(names) != 1:
            raise ParallelConfigError(f"the stages name their blocks differently: {names}")
        (layers,) = names
        blocks: dict[int, nn.Module] = {}
        ordered = sorted(stages, key=lambda m: m.split.index)
        for stage in ordered:
            for name in stage.pre_names:
                _attach(self, name, stage.get_submodule(name))
            for key, block in stage.get_submodule(layers).items():  # type: ignore[operator]
                blocks[int(key)] = block
        _attach(self, layers, nn.ModuleDict({str(i): blocks[i] for i in sorted(blocks)}))
        for stage in ordered:
            for name in stage.post_names:
                _attach(self, name, stage.get_submodule(name))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "a RankModule holds one pipeline rank's stages for the optimizer and the "
            "checkpoint; run the model with the pipeline schedule's step()"
        )


def rank_module(stages: Sequence[StageModule]) -> RankModule:
    """This rank's stage modules as one :class:`RankModule` (the model's names)."""
    return RankModule(stages)


def stage_plan(plan: Mapping[str, Any], stage: nn.Module) -> dict[str, Any]:
    """The entries of a parallel plan (see ``hlat_parallel.match_plan``) whose patterns
    match a module of ``stage``: a middle stage has no embedding and no head, and
    ``parallelize`` requires every pattern to match.

    For a :class:`StageModule` the whole plan is first checked against the whole model it
    was cut from, as ``match_plan`` checks it, so a pattern that matches no module of the
    model (a typo) is an error on every rank. For any other module, check the whole plan
    against the whole model first (``match_plan(model, plan)``).
    """
    from hlat_parallel.plan import _match_names, parse_plan

    entries = parse_plan(plan)
    if isinstance(stage, StageModule):
        _match_names(entries, list(stage.model_module_names), stage.model_type)
    names = [name for name, _ in stage.named_modules() if name]
    keep = {e.pattern for e in entries if any(e.matches(n) for n in names)}
    return {pattern: value for pattern, value in plan.items() if pattern in keep}


def build_pipeline(
    model: nn.Module,
    *,
    schedule: str,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
    group: Any = None,
    device: torch.device | str | None = None,
    virtual: int | None = None,
    split: Sequence[int] | None = None,
    pre_cost: float = 1.0,
    post_cost: float = 1.0,
    layers: str = "layers",
    pre: Sequence[str] = ("embed_tokens",),
    post: Sequence[str] = ("norm", "lm_head"),
    block_args: Callable[..., tuple[Any, ...]] | None = None,
    checkpoint_blocks: bool = False,
    scale_grads: bool = True,
    prepare: Callable[[StageModule], Any] | None = None,
) -> Pipeline:
    """Split ``model`` over the pipeline ``group`` (a process group or a 1-D "pp"
    ``DeviceMesh``; default: all processes) and build this rank's stages and schedule.

    ``virtual`` stages per rank default to 1, and 2 for the multi-stage schedules;
    ``split``, ``pre_cost`` and ``post_cost`` go to :func:`split_layers`, the module names
    and ``block_args`` to :func:`stage_modules`. ``prepare(stage_module)`` runs on each of
    this rank's stage modules before torch wraps it: the place to apply tensor and data
    parallelism (``parallelize(m, dims, stage_plan(plan, m))``) or to materialise it. Every
    check runs before any communication.

    ``device``: where the stages run and receive their inputs; by default the device type of
    ``group`` when it is a ``DeviceMesh`` (``dims.pp_mesh``), on the current device index
    as DTensor takes it, and the CPU otherwise.
    """
    check_pipeline_torch()
    if virtual is None:
        virtual = default_virtual(schedule)
    pg = _pp_group(group)
    pp, pp_rank = dist.get_world_size(pg), dist.get_rank(pg)
    check_schedule(schedule, pp, virtual, n_microbatches)
    blocks = _blocks(model, layers)
    splits = split_layers(
        len(blocks), pp * virtual, split=split, pre_cost=pre_cost, post_cost=post_cost
    )
    style: Literal["loop", "v"] = "v" if schedule in _V_SHAPED else "loop"
    ids = stage_ids(pp_rank, pp, virtual, style=style)
    modules = stage_modules(
        model,
        splits,
        ids,
        layers=layers,
        pre=pre,
        post=post,
        block_args=block_args,
        checkpoint_blocks=checkpoint_blocks,
    )
    if prepare is not None:
        for m in modules:
            prepare(m)
    from torch.distributed.pipelining import PipelineStage

    where = torch.device(device) if device is not None else _mesh_device(group)
    stages = [PipelineStage(m, m.split.index, pp * virtual, where, group=pg) for m in modules]
    built = build_schedule(schedule, stages, n_microbatches, loss_fn, scale_grads=scale_grads)
    return Pipeline(built, modules, stages, splits)


def bubble_fraction(schedule: str, pp: int, n_microbatches: int, virtual: int = 1) -> float:
    """Idle time of a pipeline rank over its compute time in one step, in theory.

    ``p`` = ``pp``, ``m`` = ``n_microbatches``, ``v`` = ``virtual`` stages per rank; the
    ratio bubble / ideal compute as in Megatron-LM's "bubble time fraction" (Narayanan et
    al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters", arXiv
    2104.04473, section 2.2):

    * ``GPipe``, ``1F1B``: ``(p - 1) / m`` (section 2.2.1; 1F1B has GPipe's bubble with
      at most ``p`` micro-batches in flight instead of ``m``);
    * ``Interleaved1F1B``: ``(p - 1) / (v m)`` (section 2.2.2);
    * ``InterleavedZeroBubble`` (torch's ZB1P): ``(p - 1) / (3 v m)``. Qi et al. 2023,
      "Zero Bubble Pipeline Parallelism" (arXiv 2401.10241), section 3.1: ZB-H1's bubble
      is ``(p - 1)(T_F + T_B - T_W)`` against ``m (T_F + T_B + T_W)`` of compute, i.e.
      ``(p - 1) / (3 m)`` when forward, input-backward and weight-backward take equal time;
      interleaving ``v`` chunks divides it by ``v`` as above;
    * ``ZBVZeroBubble``: ``0`` (ibid., section 6: ZB-V's bubble is
      ``(p - 1)(T_F + T_B - 2 T_W)`` with per-chunk times, zero when they are equal).

    Note: these are the paper's idealised figures (equal stage costs and F/B/W times, free
    communication); measured bubbles are larger.
    """
    pp = _positive_int("pp", pp)
    m = _positive_int("n_microbatches", n_microbatches)
    v = _positive_int("virtual", virtual)
    if schedule not in SCHEDULES:
        raise ParallelConfigError(
            f"unknown pipeline schedule {schedule!r}; pick one of {SCHEDULES}"
        )
    if schedule in _SINGLE_STAGE:
        if v != 1:
            raise ParallelConfigError(f"schedule {schedule} runs one stage per rank")
        return (pp - 1) / m
    if schedule == "Interleaved1F1B":
        return (pp - 1) / (v * m)
    if schedule == "InterleavedZeroBubble":
        return (pp - 1) / (3 * v * m)
    return 0.0
