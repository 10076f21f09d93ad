"""calibrate(): checkpoint + calibration text -> CalibrationArtifact (``kiln calibrate``)."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import zip_longest
from pathlib import Path
from typing import Any

import torch

from kiln import corpus as text_corpus
from kiln.corpus.windows import domain_windows

from . import awq, gptq, moe_awq, norm_tuning, sensitivity, smoothquant
from .artifact import METHODS, CalibrationArtifact, CalibrationError, apply_artifact
from .collect import collect, token_windows
from .smoothing import smooth_groups

Progress = Callable[[str], None]
ROUNDINGS = ("gptq", "rtn")
# AWQ's default int8 fallback: one decoder unit in FALLBACK_SHARE (sensitivity.units: q/k/v, o, gate/up,
# down per layer) stays int8, chosen on the validation split (docs/quantization.md, "int4 AWQ")
FALLBACK_SHARE = 4


@dataclass(frozen=True)
class CalibrationConfig:
    method: str  # "smoothquant" | "awq"
    num_windows: int = 16
    window: int = 512  # tokens per window
    rows_per_window: int = 64  # input rows kept per linear per window for the scale searches
    alpha: float | None = None  # SmoothQuant migration strength; None: searched per group
    group_size: int = 128  # AWQ: the int4 group size the scales are searched for
    clip: bool = True  # AWQ: search per-(channel, group) weight clip ratios after the scales
    tune_norms: bool = True  # AWQ: then train the norm gains of the int4-simulated model (norm_tuning.py)
    int8_fallback: int | None = None  # AWQ: keep this many most sensitive units int8; None: one in FALLBACK_SHARE
    rounding: str = "gptq"  # AWQ: how the int4 weights are rounded: "gptq" (gptq.py) or "rtn" (the build's own)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise CalibrationError(f"unknown calibration method {self.method!r}; choose one of {list(METHODS)}")
        if self.alpha is not None and not 0.0 <= self.alpha <= 1.0:
            raise CalibrationError(f"SmoothQuant alpha must be in [0, 1], not {self.alpha}")
        if self.int8_fallback is not None and self.int8_fallback < 0:
            raise CalibrationError(f"the int8 fallback is a number of decoder units, not {self.int8_fallback}")
        if self.rounding not in ROUNDINGS:
            raise CalibrationError(f"unknown int4 rounding {self.rounding!r}; choose one of {list(ROUNDINGS)}")
        if self.int8_fallback and self.method != "awq":
            raise CalibrationError("an int8 fallback goes with --method awq (the int4 schemes), "
                                   f"not {self.method}")

    def fallback_units(self, num_layers: int) -> int:
        """How many units the int8 fallback keeps for a model of num_layers decoder layers."""
        if self.method != "awq":
            return 0
        if self.int8_fallback is not None:
            return self.int8_fallback
        return len(sensitivity.units(num_layers)) // FALLBACK_SHARE

    def hyperparameters(self, num_layers: int) -> dict:
        hp = {"num_windows": self.num_windows, "window": self.window, "rows_per_window": self.rows_per_window}
        if self.method == "smoothquant":
            hp["alpha"] = "searched" if self.alpha is None else self.alpha
            hp["alpha_grid"] = list(smoothquant.ALPHA_GRID)
        else:
            hp["group_size"] = self.group_size
            hp["ratio_grid"] = list(awq.RATIO_GRID)
            hp["clip_grid"] = list(awq.CLIP_GRID) if self.clip else []
            hp["norm_tuning"] = ({"epochs": norm_tuning.EPOCHS, "learning_rate": norm_tuning.LEARNING_RATE}
                                 if self.tune_norms else None)
            hp["int8_fallback"] = self.fallback_units(num_layers)
            hp["rounding"] = self.rounding
            if self.rounding == "gptq":
                hp["gptq_damping"] = gptq.DAMPING
        return hp


def physical_memory() -> int:
    """This machine's memory in bytes."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_gptq_memory(spec, available: int) -> None:
    """Refuse, before any work, GPTQ Hessians that would take more than half of `available` bytes of memory."""
    need = gptq.hessian_bytes(spec)
    if need > available // 2:
        raise CalibrationError(f"GPTQ rounding would hold {need / 2**30:.1f} GiB of input Hessians for this model's "
                               f"{spec.num_layers} layers, more than half of this machine's {available / 2**30:.1f} "
                               f"GiB of memory; calibrate with --rounding rtn")


def tokenize(checkpoint, text: str) -> list[int]:
    if checkpoint.tokenizer is None:
        raise CalibrationError(f"{checkpoint.source} carries no tokenizer; calibration needs one to read text")
    from tokenizers import Tokenizer

    return Tokenizer.from_str(checkpoint.tokenizer.tokenizer_json).encode(text, add_special_tokens=False).ids


def corpus_windows(checkpoint, config: CalibrationConfig,
                   calibration_text: Path | None = None) -> tuple[list[list[int]], dict[str, Any]]:
    """The calibration windows and their manifest: config.num_windows windows of the corpus's calibration
    split, shared evenly by its domains (chat rendered with the model's template; skipped, and said so
    in the manifest, when the tokenizer has none) and interleaved; or of the user's own text."""
    from kiln.chat_template import ChatTemplate

    if checkpoint.tokenizer is None:
        raise CalibrationError(f"{checkpoint.source} carries no tokenizer; calibration needs one to read text")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(checkpoint.tokenizer.tokenizer_json)

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    if calibration_text is not None:
        docs = text_corpus.user_documents(calibration_text)
        texts = ((p.document.name, p.text) for p in text_corpus.passage_stream(docs))
        per_domain = [text_corpus.cut_windows("user", texts, encode, config.window, config.num_windows)]
        sources = [{"package": "user", "licence": "supplied by the user",
                    "files": [{"path": d.name[len("file:"):], "chars": len(d.text),
                               "sha256": hashlib.sha256(d.text.encode()).hexdigest()} for d in docs]}]
    else:
        template = ChatTemplate(checkpoint.tokenizer.tokenizer_config)
        domains = [d for d in text_corpus.DOMAINS if d != "chat" or template.template is not None]
        counts = [config.num_windows // len(domains) + (i < config.num_windows % len(domains))
                  for i in range(len(domains))]
        per_domain = [domain_windows(d, "calibration", encode, config.window, n, template)
                      for d, n in zip(domains, counts, strict=True) if n]
        sources = text_corpus.source_records(tuple(domains))
    if not any(d.windows for d in per_domain):
        raise CalibrationError(f"the calibration text has fewer than {config.window} tokens, not one window")
    manifest = text_corpus.manifest("calibration", config.window, per_domain, sources)
    if calibration_text is None and "chat" not in manifest["domains"]:
        manifest["skipped"] = {"chat": "the tokenizer has no chat template"}
    interleaved = [w for batch in zip_longest(*(d.windows for d in per_domain)) for w in batch if w is not None]
    return interleaved, manifest


def moe_config(config: CalibrationConfig, family: str, say: Progress) -> CalibrationConfig:
    """The calibration a mixture-of-experts model gets: AWQ with the experts' groups (moe_awq.py). SmoothQuant's
    int8 activations are the dense linears' (w8a8 leaves kiln.MoE's experts as they are), and the int8 fallback's
    units and the norm tuning's int4 student are a dense MLP's (the experts are one torch custom op without a
    backward), so AWQ runs here without them, and says so."""
    if config.method != "awq":
        raise CalibrationError(f"{config.method} calibration does not support mixture-of-experts models ({family}); "
                               "calibrate them with --method awq, or build with int4-q4_1 or int4-rtn, which need none")
    if config.int8_fallback:
        raise CalibrationError(f"the int8 fallback chooses among a dense MLP's linears; a mixture-of-experts model "
                               f"({family}) is calibrated without it (drop --int8-fallback)")
    if config.tune_norms:
        say("mixture of experts: AWQ scales, clips and rounding without norm tuning (written for dense MLPs)")
    return replace(config, tune_norms=False, int8_fallback=0)


def calibrate(checkpoint, token_ids: list[int], config: CalibrationConfig,
              progress: Progress | None = None, corpus: str | dict[str, Any] = "") -> CalibrationArtifact:
    """Calibrate on the first config.num_windows windows of one token stream."""
    windows = [w.tolist() for w in token_windows(token_ids, config.window, config.num_windows)]
    return calibrate_windows(checkpoint, windows, config, progress, corpus)


def calibrate_windows(checkpoint, token_windows: list[list[int]], config: CalibrationConfig,
                      progress: Progress | None = None, corpus: str | dict[str, Any] = "") -> CalibrationArtifact:
    """Calibrate on the given windows (see corpus_windows); `corpus` describes them in the artifact."""
    from kiln.export.reference import ReferenceModel

    say = progress or (lambda _m: None)
    if checkpoint.spec.is_moe:
        config = moe_config(config, checkpoint.spec.family, say)
    use_gptq = config.method == "awq" and config.rounding == "gptq"
    if use_gptq:
        check_gptq_memory(checkpoint.spec, physical_memory())
    start = time.perf_counter()
    model = ReferenceModel.from_checkpoint(checkpoint)
    windows = [torch.tensor(w, dtype=torch.int64) for w in token_windows]
    stats = collect(model, windows, config.rows_per_window, say, hessians=use_gptq)
    say(f"collected statistics on {stats.num_tokens} tokens in {time.perf_counter() - start:.1f}s")
    # o_proj through v_proj under GQA (tied scales, smoothing.py) folds exactly but measured no better on
    # SmolLM2-135M int4 g128 (ppl 53.33 vs 53.40 unclipped, 52.75 vs 52.37 with v/o clips): off
    groups = smooth_groups(checkpoint.spec)
    weights = {k: v.float() for k, v in checkpoint.weights.items()}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the searches are many small ops: one thread is faster than two
    try:
        with torch.no_grad():
            if config.method == "smoothquant":
                scales, report = smoothquant.search(groups, stats, weights, config.alpha)
            else:
                scales, report = awq.search([g for g in groups if not moe_awq.is_moe_group(g)], stats, weights,
                                            config.group_size)
                if checkpoint.spec.is_moe:
                    expert_scales, expert_report = moe_awq.search(groups, stats, weights, config.group_size,
                                                                  checkpoint.spec.experts_per_token)
                    scales.update(expert_scales)
                    report.update(expert_report)
                if config.clip:
                    clips, clip_report = awq.clip_all(groups, stats, weights, scales, config.group_size)
                    say(f"awq clip ratios for {len(clips)} linears in {time.perf_counter() - start:.1f}s")
    finally:
        torch.set_num_threads(threads)
    say(f"{config.method} scales for {len(scales)} groups in {time.perf_counter() - start:.1f}s")
    if config.method == "awq" and config.clip:
        scales.update(clips)
    scales["kv.k_absmax"] = stats.k_absmax
    scales["kv.v_absmax"] = stats.v_absmax
    info = {"model_source": checkpoint.source, "corpus": corpus, "num_tokens": stats.num_tokens, "groups": report}
    if config.method == "awq" and config.clip:
        info["clips"] = clip_report
    hyperparameters = config.hyperparameters(checkpoint.spec.num_layers)
    fallback = config.fallback_units(checkpoint.spec.num_layers)
    artifact = CalibrationArtifact(config.method, checkpoint.fingerprint(), hyperparameters, scales, info)
    if config.method != "awq" or not (config.tune_norms or fallback or use_gptq):
        return artifact
    hessians = {name: st.hessian for name, st in stats.linears.items() if st.hessian is not None}
    input_scales = {lin: scales[g.name] for g in groups if g.name in scales for lin in g.linears}
    del model, stats
    # the weights exactly as the build will see them: scales folded, clips applied
    quant_weights = {k: v.float() for k, v in apply_artifact(checkpoint, artifact).weights.items()}
    int8: list[str] = []
    if fallback:
        scores = sensitivity.unit_scores(checkpoint.spec, quant_weights, windows, config.group_size, say)
        chosen = sensitivity.most_sensitive(scores, fallback)
        int8 = [name for unit in chosen for name in unit]
        info["int8_fallback"] = {"+".join(u): round(scores[u], 6) for u in chosen}
        info["int8_fallback_scores"] = {"+".join(u): round(s, 6) for u, s in scores.items()}
        hyperparameters = {**hyperparameters, "int8_linears": int8}
        say(f"int8 fallback: {', '.join(info['int8_fallback'])}")
    if use_gptq:  # after the fallback's choice (made on RTN's error), whose linears stay int8
        rounded = gptq.round_linears(quant_weights, hessians, input_scales, config.group_size, frozenset(int8))
        for name, w in rounded.items():
            linear = name[: -len(".weight")]
            entries = gptq.pack(linear, w, config.group_size)
            scales.update(entries)
            quant_weights[name] = gptq.unpack(entries, linear, w.shape[1])  # bit for bit what the build gets
        say(f"gptq rounding of {len(rounded)} linears in {time.perf_counter() - start:.1f}s")
    del hessians
    if config.tune_norms:
        student = norm_tuning.int4_simulated(quant_weights, config.group_size, frozenset(int8))
        gains, tuning_report = norm_tuning.tune_norms(checkpoint.spec, weights, student, windows, progress=say)
        scales = {**scales, **{f"{norm_tuning.GAIN_PREFIX}{name}": g for name, g in gains.items()}}
        info = {**info, "norm_tuning": tuning_report}
    return CalibrationArtifact(config.method, artifact.model_fingerprint, hyperparameters, scales, info)
