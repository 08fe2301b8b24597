"""The llama family from GGUF: llama (Llama 2/3, TinyLlama; Mixtral), mistral (sliding window), qwen2 (QKV bias).

:class:`LlamaModel` is a :class:`~ggmlpy.models.decoder.DecoderModel` (which creates, places and
loads the weights; :func:`~ggmlpy.models.load_model` does both steps). Its graph is the usual pre-norm
decoder, built of :mod:`~ggmlpy.models.blocks`: token embedding, per layer RMSNorm → attention (RoPE
on Q and K, grouped-query attention through the cache, with ``flash_attn_ext`` or ``mul_mat`` +
``soft_max_ext``) → residual → RMSNorm → SwiGLU feed-forward → residual; then the output norm and
the output head (``token_embd`` again when the file has no ``output.weight``). Rows that need no
output are dropped after the last layer's attention.

A ``llama`` file with ``llama.expert_count > 0`` is Mixtral, as llama.cpp's converter writes it: each
layer's feed-forward is then a mixture of experts (:func:`~ggmlpy.models.blocks.moe_ffn`: softmax
routing over ``ffn_gate_inp``, the ``expert_used_count`` most probable experts of ``ffn_gate_exps``,
``ffn_up_exps``, ``ffn_down_exps``, their outputs summed by renormalised probability), as llama.cpp
builds it. :class:`LlamaConfig` reads the expert keys for every architecture that extends it
(:attr:`LlamaConfig.EXPERTS`); see :mod:`~ggmlpy.models.qwen3` for qwen3moe.

Weights follow llama.cpp's converter: for ``llama``/``mistral`` the Q and K rows are permuted so
that ggml's "normal" RoPE (adjacent pairs) applies; for ``qwen2`` they are not and RoPE is
NEOX-style (halves).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from ggmlpy._core import Context, RopeType, Tensor
from ggmlpy.gguf import MetadataError, meta_int
from ggmlpy.weights import MetaReader, MissingTensor, check_expert_shapes

from . import blocks
from .base import UnknownArchitecture, register
from .config import DecoderConfig, read_routing
from .decoder import PreNormDecoder

__all__ = ["LlamaConfig", "LlamaModel", "MissingTensor"]


_MAX_EXPERTS = 1 << 12          # llama.cpp allows 1024 (LLAMA_MAX_EXPERTS)

#: Expert keys llama.cpp reads for some mixture-of-experts architectures, and the values that mean what
#: the graph here builds (softmax routing over every expert, no shared expert, weights unscaled); the
#: architectures of this module leave them unread in llama.cpp, so a file that sets another value
#: asks for a model neither builds.
_EXPERT_KEYS_BUILT = {
    "expert_gating_func": (0, 1),                      # none (the architecture's own: softmax), softmax
    "expert_group_count": (0, 1),                      # DeepSeek-V3's routing by groups
    "expert_shared_count": (0,),
    "expert_shared_feed_forward_length": (0,),
}


@dataclass(frozen=True)
class LlamaConfig(DecoderConfig):
    """Hyperparameters read from GGUF metadata (``{arch}.*`` keys); see :class:`DecoderConfig`.

    The expert fields are 0 for a dense model. With experts (``{arch}.expert_count > 0``, only for the
    architectures in :attr:`EXPERTS`): ``n_expert_used`` of the ``n_expert`` experts (``expert_used_count``)
    run for each token, each a gated feed-forward ``n_ff_exp`` wide (:meth:`_n_ff_exp`), and their
    routing probabilities are renormalised to sum to 1 unless ``{arch}.expert_weights_norm`` is false
    (llama.cpp always renormalises for llama and qwen3moe; their converters never write the key).
    """

    #: ``mistral3`` is the text model of Mistral Small 3.x (llama.cpp's converter names it so): llama's
    #: graph; a file with llama 4-style attention temperature (``attention.temperature_scale``, Ministral 3)
    #: is refused
    ROPE_TYPES = {"llama": RopeType.NORMAL, "mistral": RopeType.NORMAL, "mistral3": RopeType.NORMAL,
                  "qwen2": RopeType.NEOX}
    #: The architectures whose feed-forward may be a mixture of experts, and whether it must be
    #: (``True``) or may be (``False``: mixtral is a ``llama`` file with experts). Others have none.
    EXPERTS: ClassVar[dict[str, bool]] = {"llama": False}
    READS_EXPERTS = True              # _read_experts reads (or refuses) them per architecture

    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    expert_weights_norm: bool = True

    @classmethod
    def _read(cls, m: MetaReader, n_vocab: Optional[int]) -> dict[str, Any]:
        d = super()._read(m, n_vocab)
        if m.arch == "mistral3" and "attention.temperature_scale" in m:
            raise MetadataError(m.path, m.key("attention.temperature_scale"), "attention temperature scaling "
                                "(Ministral 3) is not supported")
        return dict(d, **cls._read_experts(m, d["n_ff"]))

    @classmethod
    def _read_experts(cls, m: MetaReader, n_ff: int) -> dict[str, Any]:
        """The expert fields, as llama.cpp reads them (``expert_count``, ``expert_used_count`` a value
        or a uniform per-layer array), and the refusal of every expert key that asks for another graph."""
        path, arch = m.path, m.arch
        n_expert = m.geti("expert_count", 0, lo=0, hi=_MAX_EXPERTS)
        required = cls.EXPERTS.get(arch)
        used_key = m.key("expert_used_count")
        if not n_expert:
            if required:
                raise MetadataError(path, m.key("expert_count"), f"{'is 0' if 'expert_count' in m else 'is missing'}"
                                                                 f": a {arch} model has experts")
            n_used = meta_int(m.md, used_key, 0, lo=0, per_layer=True, path=path)
            if n_used:
                raise MetadataError(path, used_key, f"{n_used}, but {arch}.expert_count is 0 (no experts)")
            return {}
        if required is None:
            raise UnknownArchitecture(f"{path}: mixture-of-experts {arch} models are not supported "
                                      f"({arch}.expert_count = {n_expert})")
        n_used = meta_int(m.md, used_key, lo=1, hi=n_expert, per_layer=True, path=path)
        norm = read_routing(m, arch, _EXPERT_KEYS_BUILT, norm_default=True)
        return dict(n_expert=n_expert, n_expert_used=n_used, n_ff_exp=cls._n_ff_exp(m, n_ff, n_used),
                    expert_weights_norm=norm)

    @classmethod
    def _n_ff_exp(cls, m: MetaReader, n_ff: int, n_expert_used: int) -> int:
        """Each expert's hidden size: llama.cpp's llama takes ``feed_forward_length`` (Mixtral's experts
        are the dense layer's size)."""
        return n_ff

    def _problems(self) -> list[str]:
        bad = super()._problems()
        if self.n_expert and not (1 <= self.n_expert_used <= self.n_expert and self.n_ff_exp >= 1):
            bad.append(f"{self.arch}.expert_used_count {self.n_expert_used} must be in [1, expert_count "
                       f"{self.n_expert}] and the experts' feed-forward length {self.n_ff_exp} >= 1")
        return bad


@register(*LlamaConfig.ROPE_TYPES)
class LlamaModel(PreNormDecoder):
    """A llama-family model: weights on their devices plus the graph builder (see :class:`PreNormDecoder`).

    A subclass for a related architecture (:class:`~ggmlpy.models.qwen3.Qwen3Model`) extends
    :meth:`_expected` and the hooks :meth:`_qk` (Q and K before attention) and :meth:`_ffn`; this class's
    :meth:`_ffn` is the mixture of experts when the file has them.

    Attributes
    ----------
    qkv_bias : bool
        The file has Q/K/V biases (qwen2).
    """

    config_class = LlamaConfig
    config: LlamaConfig

    @classmethod
    def read_config(cls, reader, path: str = "") -> LlamaConfig:
        """As :meth:`DecoderModel.read_config`, and with experts: ``expert_count`` and the experts'
        feed-forward length checked against layer 0's ``ffn_gate_inp`` and ``ffn_gate_exps``."""
        cfg = super().read_config(reader, path)
        if cfg.n_expert:
            a = cfg.arch
            exp_key = f"{a}.expert_feed_forward_length"
            # the key the width came from (llama's experts are feed_forward_length wide)
            ff_key = exp_key if reader.metadata.get(exp_key) == cfg.n_ff_exp else f"{a}.feed_forward_length"
            check_expert_shapes(reader, cfg, path, ff_key)
        return cfg

    def _inspect(self, reader) -> None:
        super()._inspect(reader)
        self.qkv_bias = "blk.0.attn_q.bias" in reader

    def _expected(self):
        c = self.config
        yield from self._expected_io()
        for i in range(c.n_layer):
            p = f"blk.{i}."
            yield self._expected_norm(i, "attn_norm")
            yield from self._expected_attention(i, bias=self.qkv_bias)
            yield self._expected_norm(i, "ffn_norm")
            if c.n_expert:
                # the router stays a plain matrix product; the experts are read by mul_mat_id
                yield p + "ffn_gate_inp.weight", (c.n_embd, c.n_expert), i, None, "mul_mat"
                yield p + "ffn_gate_exps.weight", (c.n_embd, c.n_ff_exp, c.n_expert), i, None, "mul_mat_id"
                yield p + "ffn_up_exps.weight", (c.n_embd, c.n_ff_exp, c.n_expert), i, None, "mul_mat_id"
                yield p + "ffn_down_exps.weight", (c.n_ff_exp, c.n_embd, c.n_expert), i, None, "mul_mat_id"
            else:
                yield from self._expected_ffn(i)

    def graph_size(self) -> int:
        c = self.config
        # a mixture of experts adds its routing and one view and add per expert used
        return super().graph_size() + (c.n_layer * (32 + 2 * c.n_expert_used) if c.n_expert else 0)

    def _ffn(self, ctx: Context, prefix: str, cur: Tensor) -> Tensor:
        """The feed-forward of the normed ``cur``: SwiGLU, or with experts the mixture of them."""
        c = self.config
        if c.n_expert:
            return blocks.moe_ffn(ctx, self.weights, prefix, cur, n_expert_used=c.n_expert_used,
                                  norm_weights=c.expert_weights_norm)
        return blocks.ffn_glu(ctx, self.weights, prefix, cur)
