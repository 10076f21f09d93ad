"""GPTQ rounding for the int4 group-wise weights (Frantar et al., "GPTQ", ICLR 2023).

Round-to-nearest rounds every weight on its own. GPTQ rounds the input columns of a linear one at a
time and moves each column's rounding error onto the columns not yet rounded, weighted by the inverse
Hessian of the layer's squared output error, H = sum over calibration rows of x x^T: the rounding
decisions then cancel each other's error on the inputs the layer really sees, not on unit inputs.

The grid is the build's own (kiln.optimize.quant.rtn.quantize_groupwise: asymmetric, the range
including 0), taken per group from the weights as they stand when GPTQ reaches the group's first
column. Each group's lowest and highest weight keep codes 0 and 15 whatever the error feedback does,
so the rounded weights span exactly their group's grid: the build's round-to-nearest re-derives the
same scale and zero point from them and reproduces every code (``gptq_quantize`` output is a fixed
point of RTN; tested). So the artifact carries GPTQ's codes (``pack``), ``apply_artifact`` puts their
dequantized weights in place, and the build's int4 pass, unchanged, keeps every code.
"""

from __future__ import annotations

import torch

from .fake_quant import int4_codes, int4_grid

# k_proj and v_proj keep round-to-nearest. Measured on SmolLM2-135M (int4 g128, validation split, 2 windows a
# domain): GPTQ on v_proj alone took prose perplexity from RTN's 53.7 to 66.7 (k_proj: 54.5), while q, o, gate,
# up and down each gained. Its per-token objective weighs every calibration row alike, but the attention-sink
# position's value (and key) reach every query: an error GPTQ moves there is multiplied by the attention mass.
LINEARS = ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
DAMPING = 0.01  # of the mean diagonal, added to H: GPTQ's default (keeps the Cholesky factor well-conditioned)
BLOCK = 128  # columns rounded before their error is pushed onto the rest (lazy batch update)


def inverse_hessian_factor(hessian: torch.Tensor, damping: float = DAMPING) -> torch.Tensor:
    """The upper Cholesky factor of H^-1 (H damped; channels that never fired get a unit diagonal)."""
    h = hessian.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    h += damping * torch.diag(h).mean() * torch.eye(h.shape[0], dtype=h.dtype)
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(inverse, upper=True).float()


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, group_size: int, damping: float = DAMPING) -> torch.Tensor:
    """w [N, K] rounded to int4 group-wise along K by GPTQ on the input Hessian [K, K]; returns the
    dequantized weights (every group on its build grid, its extremes at codes 0 and 15)."""
    if BLOCK % group_size:
        raise ValueError(f"group size {group_size} must divide GPTQ's block of {BLOCK}")
    w = w.float().clone()
    n, k = w.shape
    hinv = inverse_hessian_factor(hessian, damping)
    out = torch.zeros_like(w)
    rows = torch.arange(n)
    for b0 in range(0, k, BLOCK):
        b1 = min(b0 + BLOCK, k)
        block = w[:, b0:b1].clone()
        errors = torch.zeros_like(block)
        h = hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            if i % group_size == 0:
                group = block[:, i:i + group_size]
                scale, zero = int4_grid(group)
                low_col = torch.where(group.amin(-1) < 0, group.argmin(-1) + i, -1)
                high_col = torch.where(group.amax(-1) > 0, group.argmax(-1) + i, -1)
            code = int4_codes(block[:, i, None], scale, zero)[:, 0]
            code = torch.where(low_col == i, 0.0, torch.where(high_col == i, 15.0, code))
            q = (code - zero) * scale
            out[rows, b0 + i] = q
            err = (block[:, i] - q) / h[i, i]
            block[:, i:] -= err[:, None] * h[i, i:][None, :]
            errors[:, i] = err
        w[:, b1:] -= errors @ hinv[b0:b1, b1:]
    return out


PREFIX = "gptq."  # artifact keys: gptq.<linear>.codes / .scale / .zero


def hessian_bytes(spec) -> int:
    """What collect(hessians=True) holds for a model: one float32 [K, K] per distinct linear input of each
    layer (q/k/v's, o's, gate/up's, down's). 0.4 GB for SmolLM2-135M; 22 GB for a 7B Llama."""
    per_layer = 2 * spec.hidden_size**2 + spec.q_size**2 + spec.intermediate_size**2
    return 4 * spec.num_layers * per_layer


def round_linears(weights: dict[str, torch.Tensor], hessians: dict[str, torch.Tensor],
                  input_scales: dict[str, torch.Tensor], group_size: int,
                  skip: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """GPTQ weights {<linear>.weight: [N, K]} for every linear of LINEARS with a Hessian (module names) but
    those in skip. `weights` are the build's (AWQ scales folded, clips applied); a linear whose group scales s are in
    input_scales reads x / s, so its Hessian is H / (s s^T)."""
    from kiln.export.progress import track

    out = {}
    names = [name for name in hessians if name.endswith(LINEARS) and name not in skip]
    for name in track(names, "gptq rounding", "linear"):
        h = hessians[name]
        s = input_scales.get(name)
        if s is not None:
            h = h / (s[:, None] * s[None, :])
        out[f"{name}.weight"] = gptq_quantize(weights[f"{name}.weight"], h, group_size)
    return out


def pack(linear: str, w: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """The artifact entries of GPTQ weights w [N, K] (on their build grid): int4 codes two a byte, the
    groups' float32 scales and uint8 zero points; ``unpack`` gives back the same codes on the same grid
    (scales re-derived from w: equal to within a float32 rounding)."""
    n, k = w.shape
    g = torch.nn.functional.pad(w, (0, -k % group_size)).reshape(n, -1, group_size)
    scale, zero = int4_grid(g)
    codes = int4_codes(g, scale, zero).to(torch.uint8).reshape(n, -1)
    codes = torch.nn.functional.pad(codes, (0, codes.shape[1] % 2))
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return {f"{PREFIX}{linear}.codes": packed, f"{PREFIX}{linear}.scale": scale,
            f"{PREFIX}{linear}.zero": zero.to(torch.uint8)}


def unpack(entries: dict[str, torch.Tensor], linear: str, k: int) -> torch.Tensor:
    """The GPTQ weights [N, k] of `linear` from its artifact entries (see pack)."""
    packed = entries[f"{PREFIX}{linear}.codes"]
    scale, zero = entries[f"{PREFIX}{linear}.scale"].float(), entries[f"{PREFIX}{linear}.zero"].float()
    n, groups = scale.shape
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(n, -1).float()
    g = codes.reshape(n, groups, -1)  # whole groups (an even count of codes)
    return ((g - zero[..., None]) * scale[..., None]).reshape(n, -1)[:, :k]


def linears_in(entries: dict[str, torch.Tensor]) -> list[str]:
    """The linears an artifact's entries hold GPTQ weights for."""
    suffix = ".codes"
    return [key[len(PREFIX):-len(suffix)] for key in entries if key.startswith(PREFIX) and key.endswith(suffix)]
