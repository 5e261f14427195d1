"""``ContextParallelAttention``: Megatron-Core's ``core_attention`` slot, served by context-parallel attention.

Megatron's ``Attention`` (``SelfAttention``, ``MLASelfAttention``) projects Q/K/V, applies RoPE (already
sliced to this rank's zigzag chunks under CP) and calls its ``core_attention`` with
q ``[s/cp, b, np, hn]``, k/v ``[s/cp, b, ng, hn]`` (GQA groups not expanded).  This module reads the
process groups Megatron gives it (``pg_collection.cp``; ``parallel_state`` as the fallback) and the
algorithm Megatron's own knobs ask for (``--cp-comm-type``: ``p2p`` ring, ``all_gather`` all-gather,
``a2a`` Ulysses, ``a2a+p2p`` hybrid), and calls :func:`megatron_longctx.attention.cp_attention`.
With one CP rank the same call runs the block kernels locally (no communication); dropout, arbitrary
masks and inference shapes (``sq != sk``) take :mod:`~megatron_longctx.megatron.local_attention`.

Supported: causal / no-mask self-attention, sliding windows (``--window-size``, per layer with
``--window-attn-skip-freq``), attention sinks (``--softmax-type off-by-one|learnable``: Megatron's
``softmax_offset``, created as Megatron creates it, so checkpoints load either way; see
:mod:`megatron_longctx.attention.sinks`), GQA/MQA, MLA head dims (``k_channels``/``v_channels``), TP
(heads split before we see them), THD packed sequences, attention dropout with one CP rank.  Anything
else is a ``ValueError`` naming the flag.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_longctx import cp_algorithms as algorithms
from megatron_longctx.attention import cp_attention
from megatron_longctx.attention.sinks import SOFTMAX_TYPES
from megatron_longctx.config import ContextParallelConfig
from megatron_longctx.memory.tiled_recompute import ReplayPort
from megatron_longctx.megatron.local_attention import LocalAttentionArgs, local_attention_sbhd, local_attention_thd
from megatron_longctx.megatron.tiled_attention import attend_tile

# Self-attention (sq == sk): bottom-right aligned causal is plain causal.
_CAUSAL_TYPES = tuple(t for t in (AttnMaskType.causal, AttnMaskType.padding_causal,
                                  getattr(AttnMaskType, "causal_bottom_right", None)) if t is not None)
_SUPPORTED_TYPES = (*_CAUSAL_TYPES, AttnMaskType.no_mask)


@dataclasses.dataclass(frozen=True)
class CoreAttentionSettings:
    """What one ``ContextParallelAttention`` layer computes (fixed at construction)."""

    algorithm: str  # ring | allgather | ulysses | hybrid
    softmax_scale: float
    window_size: Optional[tuple[int, int]]  # (left, right), -1 = unbounded; None = full
    backend: Optional[str]  # kernel backend; None = automatic
    ulysses_size: Optional[int]  # hybrid: size of the all-to-all sub-group
    dropout_p: float


def _layer_comm_type(config: TransformerConfig, layer_number: int, passed: Optional[str]) -> str:
    """This layer's ``--cp-comm-type``.

    A per-layer list is indexed here by ``layer_number - 1`` (layer numbers start at 1): Megatron-Core
    0.19's ``TransformerLayer`` does the same, 0.16's indexes ``[layer_number]`` (one layer off), so the
    value it passes in is ignored when the config holds a list.
    """
    value = config.cp_comm_type
    if isinstance(value, (list, tuple)):
        if not 1 <= layer_number <= len(value):
            raise ValueError(f"--cp-comm-type lists {len(value)} values but layer {layer_number} needs one; "
                             f"give one value per layer (--num-layers {config.num_layers}) or a single value")
        return value[layer_number - 1]
    return value or passed or "p2p"


def resolve_algorithm(config: TransformerConfig, layer_number: int, passed_comm_type: Optional[str],
                      cp_config: ContextParallelConfig) -> str:
    """The CP algorithm of this layer: ``--longctx-cp-algorithm`` if set, else from ``--cp-comm-type``."""
    if cp_config.cp_algorithm != "auto":
        return cp_config.cp_algorithm
    comm_type = _layer_comm_type(config, layer_number, passed_comm_type)
    return algorithms.for_cp_comm_type(comm_type, f" (layer {layer_number})").name


def _window(config: TransformerConfig, layer_number: int) -> Optional[tuple[int, int]]:
    """``config.window_size`` if this layer uses windowed attention (``--window-attn-skip-freq``: every
    N-th layer full, or a 0/1 list per layer, 1 = windowed)."""
    from megatron.core.transformer.utils import is_layer_window_attention

    pattern = getattr(config, "window_attn_skip_freq", None)
    if config.window_size and isinstance(pattern, (list, tuple)) and len(pattern) != config.num_layers:
        raise ValueError(f"--window-attn-skip-freq lists {len(pattern)} layers but --num-layers is "
                         f"{config.num_layers}; give one 0/1 per layer (1 = windowed), or an integer N "
                         "(every N-th layer full)")
    if not is_layer_window_attention(config.window_size, getattr(config, "window_attn_skip_freq", None),
                                     layer_number):
        return None
    left, right = config.window_size
    return (int(left), int(right))


class ContextParallelAttention(MegatronModule):
    """Megatron ``core_attention`` backed by context-parallel attention (ring / all-gather / Ulysses / hybrid).

    Built by Megatron's ``Attention.__init__`` with keywords ``config, layer_number, attn_mask_type,
    attention_type, cp_comm_type, softmax_scale, pg_collection`` (MLA adds ``k_channels, v_channels``);
    unknown keywords from newer Megatron versions are accepted and ignored.  ``cp_config`` comes from
    the layer spec (:func:`megatron_longctx.apply_to_spec`).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Any = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        cp_config: Optional[ContextParallelConfig] = None,
        **_newer_megatron_kwargs: Any,
    ) -> None:
        super().__init__(config=config)
        if attention_type != "self":
            raise ValueError(f"ContextParallelAttention serves self-attention only, got attention_type="
                             f"{attention_type!r}; keep Megatron's core_attention for cross-attention")
        softmax_type = getattr(config, "softmax_type", "vanilla")
        if softmax_type not in SOFTMAX_TYPES:
            raise ValueError(f"--softmax-type {softmax_type!r} is not one of {', '.join(SOFTMAX_TYPES)}")
        self.cp_config = cp_config if cp_config is not None else ContextParallelConfig()
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.tp_group, self.cp_group, self.hcp_groups = _groups(pg_collection)
        self.replay_port = ReplayPort()  # --longctx-recompute-tiles hands a layer's replay in here
        self.cp_size = self.cp_group.size() if self.cp_group is not None else 1
        tp_size = self.tp_group.size() if self.tp_group is not None else 1
        self.num_heads = _divide(config.num_attention_heads, tp_size, "--num-attention-heads",
                                 "--tensor-model-parallel-size")
        self.num_kv_heads = _divide(config.num_query_groups or config.num_attention_heads, tp_size,
                                    "--num-query-groups", "--tensor-model-parallel-size")
        self.k_channels = k_channels if k_channels is not None else config.kv_channels
        self.v_channels = v_channels if v_channels is not None else config.kv_channels
        algorithm = resolve_algorithm(config, self.layer_number, cp_comm_type, self.cp_config)
        self.settings = CoreAttentionSettings(
            algorithm=algorithm,
            softmax_scale=softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.k_channels),
            window_size=_window(config, self.layer_number),
            backend=self.cp_config.backend,
            ulysses_size=self._ulysses_size(algorithm, config),
            dropout_p=config.attention_dropout if attention_dropout is None else attention_dropout,
        )
        self._check_heads()
        self.softmax_type = softmax_type
        self._make_softmax_offset(config)

    def _make_softmax_offset(self, config: TransformerConfig) -> None:
        """``softmax_offset`` ``[heads per TP rank]`` as Megatron's ``DotProductAttention`` makes it (same
        name, shape, dtype and init; sharded over TP on axis 0 in checkpoints): zeros for off-by-one (not a
        parameter, not saved), a parameter for learnable, None for vanilla."""
        if self.softmax_type == "vanilla":
            self.softmax_offset = None
            return
        device = torch.cuda.current_device() if torch.cuda.is_available() else torch.device("cpu")
        offset = torch.zeros(self.num_heads, device=device, dtype=config.params_dtype)
        if self.softmax_type == "off-by-one":
            self.softmax_offset = offset
            return
        self.register_parameter("softmax_offset", torch.nn.Parameter(offset))
        if config.perform_initialization:
            self.softmax_offset = config.init_method(self.softmax_offset)

    def _sink(self, like: torch.Tensor) -> Optional[torch.Tensor]:
        """``softmax_offset`` on ``like``'s device (the off-by-one zeros are a plain tensor: ``.to()`` of the
        module does not move them, as in Megatron, which moves them per call too)."""
        return None if self.softmax_offset is None else self.softmax_offset.to(like.device)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """The learnable ``softmax_offset`` sharded over TP on axis 0, as Megatron's attention saves it."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True) if self.softmax_type == "learnable" else {}
        dp_cp = (metadata or {}).get("dp_cp_group")
        if dp_cp is None and parallel_state.model_parallel_is_initialized():
            dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, {"softmax_offset": 0}, sharded_offsets,
                                                   tp_group=self.tp_group, dp_cp_group=dp_cp)

    def _ulysses_size(self, algorithm: str, config: TransformerConfig) -> Optional[int]:
        heads = algorithms.get(algorithm).heads
        if heads == "all":
            return self.cp_size
        if heads != "groups":
            return None
        if self.cp_config.cp_ulysses_size:
            size = self.cp_config.cp_ulysses_size
        else:
            sizes = getattr(config, "hierarchical_context_parallel_sizes", None)
            if not sizes:
                raise ValueError("the hybrid CP algorithm (--cp-comm-type a2a+p2p) needs the all-to-all group size: "
                                 "set --hierarchical-context-parallel-sizes A P (A*P = --context-parallel-size) "
                                 "or --longctx-cp-ulysses-size A")
            size = int(sizes[0])
        if self.cp_size > 1 and self.cp_size % size != 0:
            raise ValueError(f"hybrid CP: the all-to-all size {size} must divide --context-parallel-size "
                             f"{self.cp_size}; fix --hierarchical-context-parallel-sizes or --longctx-cp-ulysses-size")
        return size

    def _check_heads(self) -> None:
        """Ulysses moves whole heads between ranks: heads per TP rank must split over the all-to-all group."""
        a2a = self.settings.ulysses_size
        if self.cp_size == 1 or not a2a or a2a == 1:
            return
        if self.num_heads % a2a != 0:
            raise ValueError(
                f"--cp-comm-type {algorithms.get(self.settings.algorithm).cp_comm_type} (Ulysses) splits heads "
                f"over {a2a} ranks, but each tensor-parallel rank has {self.num_heads} query heads "
                f"(--num-attention-heads / --tensor-model-parallel-size); make them divisible, change "
                f"--context-parallel-size, or use --cp-comm-type p2p")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Any = None,
        **_newer_megatron_kwargs: Any,
    ) -> torch.Tensor:
        """q ``[sq, b, np, hn]``, k/v ``[sk, b, ng, hn]`` -> ``[sq, b, np*hn_v]`` (THD: ``[t, np, hn]`` -> ``[t, np*hn_v]``)."""
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by ContextParallelAttention; remove the bias "
                             "(e.g. drop --position-embedding-type alibi-style biases) or use Megatron's attention")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        dropout_p = self.settings.dropout_p if self.training else 0.0
        replay = self.replay_port.replay
        if replay is not None:  # a layer replayed in sequence tiles handed us its replay
            return attend_tile(self, replay, query, key, value, causal=mask_type in _CAUSAL_TYPES,
                               dense_mask=self._dense_mask(attention_mask, mask_type), dropout_p=dropout_p,
                               packed=packed_seq_params is not None)
        if self.cp_size > 1 and dropout_p > 0:
            raise ValueError(f"attention dropout ({dropout_p}) is not supported with context parallelism "
                             f"(--context-parallel-size {self.cp_size}); set --attention-dropout 0")
        if packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", "thd") == "thd":
            return self._forward_thd(query, key, value, mask_type, dropout_p, packed_seq_params)
        dense_mask = self._dense_mask(attention_mask, mask_type)
        if self.cp_size == 1 and (dropout_p > 0 or dense_mask is not None or query.shape[0] != key.shape[0]):
            # What the block kernels do not serve: dropout, an arbitrary mask, sq != sk (inference).
            args = LocalAttentionArgs(self.settings.softmax_scale, mask_type in _CAUSAL_TYPES,
                                      self.settings.window_size, dropout_p)
            out = self._with_dropout_rng(dropout_p, local_attention_sbhd, query, key, value, args, dense_mask,
                                         self._sink(query))
        elif self.cp_size == 1:
            # One rank: the block kernels of --longctx-cp-kernel-backend, no communication.
            out = self._cp_attention(query, key, value, causal=mask_type in _CAUSAL_TYPES)
        else:
            if query.shape[0] % 2 != 0:
                raise ValueError(f"each CP rank holds two zigzag chunks, but got {query.shape[0]} local tokens: "
                                 f"--seq-length must be divisible by 2 x --context-parallel-size "
                                 f"({2 * self.cp_size})")
            out = self._cp_attention(query, key, value, causal=mask_type in _CAUSAL_TYPES)
        # [sq, b, np, hn_v] -> [sq, b, np*hn_v]
        return out.reshape(out.shape[0], out.shape[1], -1)

    def _dense_mask(self, attention_mask: Optional[torch.Tensor], mask_type: AttnMaskType) -> Optional[torch.Tensor]:
        """Causal / no-mask layers ignore ``attention_mask`` (as TE does); others need one CP rank."""
        if mask_type in _SUPPORTED_TYPES or attention_mask is None:
            return None
        if self.cp_size > 1:
            raise ValueError(
                f"an arbitrary dense attention_mask ({mask_type.name}) is not supported with context parallelism "
                f"(--context-parallel-size {self.cp_size}): use causal masking (the default GPT mask, "
                "--no-create-attention-mask-in-dataloader) or packed sequences, or --context-parallel-size 1")
        return ~attention_mask.bool()  # Megatron: True = masked; ours: True = visible

    def _with_dropout_rng(self, dropout_p: float, fn, *args):
        """Dropout draws from Megatron's tensor-parallel RNG stream (as DotProductAttention does)."""
        if dropout_p > 0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return fn(*args)
        return fn(*args)

    def _cp_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                      packing: Any = None) -> torch.Tensor:
        extra: dict[str, Any] = {} if packing is None else {"packing": packing}
        if algorithms.get(self.settings.algorithm).heads == "groups":
            hcp = self._hierarchical_groups()
            extra.update({"hcp_groups": hcp} if hcp is not None else {"ulysses_size": self.settings.ulysses_size})
        return cp_attention(
            q, k, v, self.cp_group, algorithm=self.settings.algorithm, causal=causal,
            softmax_scale=self.settings.softmax_scale, window_size=self.settings.window_size,
            backend=self.settings.backend, softmax_offset=self._sink(q),
            **extra,
        )  # [s/cp, b, np, hn_v]

    def _hierarchical_groups(self) -> Optional[tuple]:
        """Megatron's (a2a, p2p) groups from --hierarchical-context-parallel-sizes, when they fit these settings."""
        groups = self.hcp_groups
        if not groups or len(groups) != 2 or groups[0] is None or groups[0].size() != self.settings.ulysses_size:
            return None
        return tuple(groups)

    def _forward_thd(self, q, k, v, mask_type, dropout_p, params) -> torch.Tensor:
        if mask_type not in _SUPPORTED_TYPES:
            raise ValueError(f"packed sequences support causal/padding_causal/no_mask attention, got {mask_type.name}")
        if self.cp_size > 1:
            from megatron_longctx.attention import Packing

            out = self._cp_attention(q, k, v, causal=mask_type in _CAUSAL_TYPES,
                                     packing=Packing.from_packed_seq_params(params))  # [t/cp, np, hn_v]
            return out.reshape(out.shape[0], -1)  # [t/cp, np*hn_v]
        args = LocalAttentionArgs(self.settings.softmax_scale, mask_type in _CAUSAL_TYPES, self.settings.window_size,
                                  dropout_p)
        out = self._with_dropout_rng(
            dropout_p, local_attention_thd, q, k, v, args, params.cu_seqlens_q, params.cu_seqlens_kv,
            getattr(params, "cu_seqlens_q_padded", None), getattr(params, "cu_seqlens_kv_padded", None),
            self._sink(q),
        )  # [t, np, hn_v]
        return out.reshape(out.shape[0], -1)  # [t, np*hn_v]


def _divide(n: int, d: int, n_flag: str, d_flag: str) -> int:
    if n % d != 0:
        raise ValueError(f"{n_flag} {n} is not divisible by {d_flag} {d}")
    return n // d


def _groups(pg_collection: Any):
    """(tp, cp, hierarchical cp groups): from ``pg_collection`` first, ``parallel_state`` as the fallback."""
    tp = getattr(pg_collection, "tp", None)
    cp = getattr(pg_collection, "cp", None)
    hcp = getattr(pg_collection, "hcp", None)
    if parallel_state.model_parallel_is_initialized():
        if tp is None:
            tp = parallel_state.get_tensor_model_parallel_group()
        if cp is None:
            cp = parallel_state.get_context_parallel_group()
        if hcp is None:
            hcp = parallel_state.get_hierarchical_context_parallel_groups(check_initialized=False)
    return tp, cp, hcp
