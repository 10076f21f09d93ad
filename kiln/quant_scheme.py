"""The weight-quantization schemes of ``kiln build --quantization``, as one value type.

    none                   fp32 weights
    int8-weight-only       int8 per output channel (MatMulNBits bits=8)
    int4-rtn-g{32,64,128}  int4 round-to-nearest, group-wise along K, zero points
    int4-awq-g{32,64,128}  AWQ scales folded in, then int4 as rtn; needs an awq artifact
    int4-q4_1              llama.cpp's Q4_1 (groups of 32, exact minimum): lossless on Q4_1 GGUFs
    gguf                   a GGUF file's own blocks (Q4_0, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) executed as they are
                           (kiln.MatMulGGUF): the file's weights exactly, activations int8 per row block and
                           integer block dots as llama.cpp computes them (Q5_0 / Q5_1: float32 activations);
                           other linears int8 per channel
    gguf-exact             gguf with float32 activations: x @ the file's dequantized weights within float32
                           rounding (a reference; slower)
    w8a8-smoothquant       SmoothQuant scales folded in, then int8 weights and per-token int8
                           activations; needs a smoothquant artifact

A name is parsed once (the CLI, a manifest) into a QuantScheme; its ``name`` is what the
manifest stores, and the optimizer passes dispatch on ``method``. ``kiln build --lm-head`` picks
the LM head's precision under the int4 schemes (LmHead); the other schemes quantize it like any linear.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kiln.errors import InvalidParamError, parse_choice, require


class QuantMethod(Enum):
    NONE = "none"
    INT8_WEIGHT_ONLY = "int8-weight-only"
    INT4_RTN = "int4-rtn"
    INT4_AWQ = "int4-awq"
    INT4_Q4_1 = "int4-q4_1"
    W8A8_SMOOTHQUANT = "w8a8-smoothquant"
    GGUF = "gguf"
    GGUF_EXACT = "gguf-exact"

    @property
    def keeps_file_blocks(self) -> bool:
        """The GGUF methods: the file's blocks executed as they are."""
        return self in (QuantMethod.GGUF, QuantMethod.GGUF_EXACT)


# Behind a 4-bit MatMulNBits head (int4-rtn, int4-awq), steps of up to this many logits rows (a few streams, or one
# stream verifying 4 speculative tokens) take an int4-rescored head's rescored path; larger steps, bound by
# arithmetic rather than bytes, its int8 head (measured on SmolLM2: rescoring +3.5% output tok/s at 4 rows a step,
# -2.5% at 8). int4-q4_1's head (kiln.MatMulQ4_1) is rescored at every step (optimize/rescore_lm_head.py).
RESCORED_HEAD_MAX_ROWS = 5


class LmHead(Enum):
    """The tied LM head under an int4 scheme: int8 per channel (the default: on SmolLM2 an int4 head alone
    costs a third of int4-g32's perplexity loss), the scheme's own int4 groups, int4 with its best candidates
    rescored from the 8-bit embedding table (int4-rescored: int4's bytes per token, optimize/rescore_lm_head.py),
    or int8 per channel with per-token int8 activations (w8a8: ONNX Runtime's integer GEMM, ~2x faster than int8
    weight-only from 8 rows)."""

    INT8 = "int8"
    INT4 = "int4"
    INT4_RESCORED = "int4-rescored"
    W8A8 = "w8a8"

    @property
    def is_int4(self) -> bool:
        """The head's full matmul is int4 (the scheme's groups)."""
        return self in (LmHead.INT4, LmHead.INT4_RESCORED)

    @classmethod
    def parse(cls, name: str) -> LmHead:
        return parse_choice(cls, name, "LM head precision", "lm_head")


INT4_GROUP_SIZES = (32, 64, 128)
# The methods whose name chooses an int4 group size ("int4-rtn-g128"); Q4_1's groups are fixed at 32.
_GROUPED = (QuantMethod.INT4_RTN, QuantMethod.INT4_AWQ)
# The methods whose linears are int4, the ones that may take an int4 LM head.
_INT4 = (QuantMethod.INT4_RTN, QuantMethod.INT4_AWQ, QuantMethod.INT4_Q4_1)
# The `kiln calibrate --method` whose artifact a method folds into the weights before export.
_CALIBRATION = {QuantMethod.INT4_AWQ: "awq", QuantMethod.W8A8_SMOOTHQUANT: "smoothquant"}


@dataclass(frozen=True)
class QuantScheme:
    method: QuantMethod = QuantMethod.NONE
    group_size: int | None = None  # int4-rtn / int4-awq: weights per scale along K; None for the others

    def __post_init__(self) -> None:
        require(isinstance(self.method, QuantMethod), "method", "a QuantMethod", self.method)
        if self.method in _GROUPED:
            require(self.group_size in INT4_GROUP_SIZES, "group_size", f"one of {list(INT4_GROUP_SIZES)} for "
                    f"{self.method.value}", self.group_size)
        else:
            require(self.group_size is None, "group_size", f"None for {self.method.value}", self.group_size)

    @property
    def name(self) -> str:
        """The name the CLI takes and the manifest stores: parse(scheme.name) == scheme."""
        return f"{self.method.value}-g{self.group_size}" if self.method in _GROUPED else self.method.value

    @property
    def calibration(self) -> str | None:
        """The calibration method whose artifact the scheme needs ("awq", "smoothquant"), or None."""
        return _CALIBRATION.get(self.method)

    @property
    def is_int4(self) -> bool:
        """True for the int4 schemes (rtn, awq, q4_1): the ones --lm-head int4 applies to."""
        return self.method in _INT4

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(cls, name: str) -> QuantScheme:
        scheme = SCHEMES.get(name)
        if scheme is None:
            raise InvalidParamError(f"unknown quantization {name!r}; choose one of {list(SCHEMES)}", "quantization")
        return scheme


def _all_schemes() -> list[QuantScheme]:
    schemes = [QuantScheme(method) for method in QuantMethod if method not in _GROUPED]
    schemes += [QuantScheme(method, group) for method in _GROUPED for group in INT4_GROUP_SIZES]
    return schemes


SCHEMES: dict[str, QuantScheme] = {scheme.name: scheme for scheme in _all_schemes()}
