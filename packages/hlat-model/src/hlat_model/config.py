"""`LlamaConfig`: the shape and numerics of a Llama-family model, with named presets."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

CheckpointingMode = Literal["none", "selective", "full"]
AttentionBackend = Literal["auto", "sdpa", "flex", "blocked"]


class ConfigError(ValueError):
    """An invalid model configuration; the message says which field and what to do."""


@dataclass
class LlamaConfig:
    """Shape and numerics of a Llama-family decoder.

    Field names follow the Llama papers (``dim``, ``n_layers``, ``n_heads``). Use
    :meth:`preset` for the published shapes; every instance is validated on creation.
    """

    vocab_size: int = 32000
    """Rows of the token embedding and of the LM head."""
    dim: int = 4096
    """Hidden size."""
    n_layers: int = 32
    """Number of transformer blocks."""
    n_heads: int = 32
    """Attention (query) heads."""
    n_kv_heads: int | None = None
    """Key/value heads; ``None`` means ``n_heads`` (multi-head attention). Fewer gives GQA."""
    ffn_dim: int = 11008
    """Inner size of the SwiGLU MLP."""
    max_seq_len: int = 4096
    """Longest sequence the model is meant for: longer inputs are refused (explicit
    ``position_ids`` are not checked against it)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of every weight matrix."""
    scaled_init: bool = True
    """Initialise ``o_proj`` and ``down_proj`` with ``init_std / sqrt(2 * n_layers)``.

    Note: HLAT's stability measure; residual-stream variance stays flat with depth.
    """
    tie_embeddings: bool = False
    """Share the token embedding with the LM head (Llama 2/3 7-8B do not)."""
    checkpointing: CheckpointingMode = "none"
    """Activation checkpointing: ``none``; ``selective`` recomputes the attention core and the
    MLP activation in backward (HLAT's choice), but not a CPU flash kernel that keeps
    nothing recomputing would free (:func:`hlat_model.attention.runs_flash_kernel`);
    ``full`` recomputes whole blocks."""
    sequence_first: bool = False
    """Run the blocks on [S, B, H] activations instead of [B, S, H] (inputs and logits stay
    batch-first). Note: NeuronX Distributed's sequence parallelism splits dimension 0, so
    its SP layers need this layout; results are the same either way."""
    attention: AttentionBackend = "auto"
    """Attention kernel. ``sdpa``: ``scaled_dot_product_attention`` (flash kernels on GPU and
    CPU; an explicit block-diagonal mask for packed documents). ``flex``: compiled
    ``flex_attention`` with a document block mask (no training on CPUs: it has no CPU
    backward). ``blocked``:
    :func:`hlat_model.attention.blocked_causal_attention`, batched matrix products over
    query blocks (the fastest on CPUs; plain causal rows go to the CPU flash kernels where
    they run). ``auto``: on CPUs the flash kernels where they run, else ``blocked`` (on CPUs
    with AMX, ``sdpa`` for plain causal rows of 2,048 tokens or more:
    :func:`hlat_model.attention.cpu_attention_rule`); ``flex`` for packed documents on CUDA;
    else ``sdpa``."""

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        self.validate()

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads (``n_kv_heads`` resolved)."""
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def q_per_kv(self) -> int:
        """Query heads sharing one key/value head (1 for MHA)."""
        return self.n_heads // self.kv_heads

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first field that is wrong."""
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        kv = self.n_kv_heads
        if not isinstance(kv, int) or isinstance(kv, bool) or kv <= 0:
            raise ConfigError(f"n_kv_heads must be a positive integer, got {self.n_kv_heads!r}")
        if self.dim % self.n_heads:
            # the divisor of dim nearest a head_dim of 128, Llama's
            heads = min(
                (d for d in range(1, self.dim + 1) if self.dim % d == 0),
                key=lambda d: abs(self.dim / d - 128),
            )
            raise ConfigError(
                f"n_heads {self.n_heads} does not divide dim {self.dim}; pick n_heads among "
                f"the divisors of dim (e.g. {heads} for head_dim {self.dim // heads})"
            )
        if self.n_heads % self.kv_heads:
            raise ConfigError(
                f"n_kv_heads {self.kv_heads} does not divide n_heads {self.n_heads}; "
                "each key/value head must serve a whole number of query heads"
            )
        if self.head_dim % 2:
            raise ConfigError(
                f"head_dim dim/n_heads = {self.head_dim} is odd; RoPE rotates pairs of channels"
            )
        for name in ("norm_eps", "rope_theta", "init_std"):
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name} must be a positive number, got {value!r}")
        if self.checkpointing not in ("none", "selective", "full"):
            raise ConfigError(
                f"checkpointing must be 'none', 'selective' or 'full', got {self.checkpointing!r}"
            )
        if self.attention not in ("auto", "sdpa", "flex", "blocked"):
            raise ConfigError(
                f"attention must be 'auto', 'sdpa', 'flex' or 'blocked', got {self.attention!r}"
            )
        for name in ("tie_embeddings", "scaled_init", "sequence_first"):
            if not isinstance(getattr(self, name), bool):
                # Note: a string "false" is true, and hlat-parallel reads layouts by identity
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> LlamaConfig:
        """A named shape (``hlat-7b``, ``llama2-7b``, ``llama3-8b``, ``llama2-70b``,
        ``llama3-70b``, ``1b``, ``tiny``), with any field overridden by keyword. A
        multi-head preset stays multi-head when ``n_heads`` alone is overridden; a
        grouped-query one keeps its ``n_kv_heads``."""
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
        preset = PRESETS[name]
        fields = {**preset, **overrides}
        multi_head = preset.get("n_kv_heads", preset.get("n_heads")) == preset.get("n_heads")
        if "n_heads" in overrides and "n_kv_heads" not in overrides and multi_head:
            fields["n_kv_heads"] = overrides["n_heads"]
        unknown = set(fields) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigError(f"unknown LlamaConfig field(s): {', '.join(sorted(unknown))}")
        return cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_LLAMA2_7B: dict[str, Any] = dict(
    vocab_size=32000,
    dim=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=32,
    ffn_dim=11008,
    max_seq_len=4096,
    norm_eps=1e-5,
    rope_theta=10000.0,
)

PRESETS: dict[str, dict[str, Any]] = {
    # HLAT (arXiv 2404.10630): the Llama-2 7B shape, std 0.021 with scaled init.
    "hlat-7b": {**_LLAMA2_7B, "init_std": 0.021, "scaled_init": True},
    "llama2-7b": {**_LLAMA2_7B, "init_std": 0.02, "scaled_init": False},
    "llama3-8b": dict(
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        max_seq_len=8192,
        norm_eps=1e-5,
        rope_theta=500000.0,
        init_std=0.02,
        scaled_init=False,
    ),
    # Llama-2-70B (Touvron et al. 2023; Hugging Face meta-llama/Llama-2-70b-hf config): GQA
    # with 8 KV heads. HLAT's companion 70B recipe on trn1 (TP 32, PP 8) uses this shape.
    "llama2-70b": dict(
        vocab_size=32000,
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim=28672,
        max_seq_len=4096,
        norm_eps=1e-5,
        rope_theta=10000.0,
        init_std=0.02,
        scaled_init=False,
    ),
    # Llama-3-70B (Hugging Face meta-llama/Meta-Llama-3-70B config): Llama-2-70B's blocks
    # with the 128k vocabulary, RoPE theta 5e5 and 8k context.
    "llama3-70b": dict(
        vocab_size=128256,
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim=28672,
        max_seq_len=8192,
        norm_eps=1e-5,
        rope_theta=500000.0,
        init_std=0.02,
        scaled_init=False,
    ),
    # The TinyLlama-1.1B shape: Llama-2 vocabulary, GQA with 4 KV heads.
    "1b": dict(
        vocab_size=32000,
        dim=2048,
        n_layers=22,
        n_heads=32,
        n_kv_heads=4,
        ffn_dim=5632,
        max_seq_len=2048,
        init_std=0.02,
        scaled_init=True,
    ),
    # A few million parameters: CPU demos and tests.
    "tiny": dict(
        vocab_size=8192,
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=8,
        ffn_dim=688,
        max_seq_len=512,
        init_std=0.02,
        scaled_init=True,
    ),
}
