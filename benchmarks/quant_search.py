"""Fake-quant perplexity per domain on the corpus's VALIDATION split: the harness the int4 choices
were made with (never the evaluation split, which only `kiln eval` reads for RESULTS.md).

The PyTorch reference model with the weights exactly as a build would quantize them (artifact folded,
clipped and norm-tuned by `apply_artifact`; decoder linears int4 RTN group-wise, or int8 per channel
where --int8 names them; the tied LM head int8 per channel). It matched the engine to 0.1% on
SmolLM2 (docs/quantization.md).

    python benchmarks/quant_search.py [--artifact DIR] [--group-size 128] [--int8 PATTERN ...] [--windows 4]
    python benchmarks/quant_search.py --fp32          (the reference row)
    python benchmarks/quant_search.py --artifact DIR --no-gains    (the artifact as --no-tune-norms made it)
    python benchmarks/quant_search.py --artifact DIR --scores-out S.json --windows 4   (int8-fallback scores
        on the first calibration windows, calibration/sensitivity.py; then --int8-top N --scores S.json)
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time

import torch
import torch.nn.functional as F


def simulated_weights(weights: dict[str, torch.Tensor], group_size: int, int8: list[str]) -> dict[str, torch.Tensor]:
    from kiln.calibration.fake_quant import int4_groupwise, int8_per_channel

    out = dict(weights)
    for name, w in weights.items():
        if ".layers." in name and name.endswith("_proj.weight"):
            module = name[: -len(".weight")]
            if any(re.search(p, module) for p in int8):
                out[name] = int8_per_channel(w.float())
            else:
                out[name] = int4_groupwise(w.float(), group_size)
    return out


def validation_windows(checkpoint, count: int, window: int = 512, split: str = "validation") -> dict[str, list]:
    from tokenizers import Tokenizer

    from kiln.chat_template import ChatTemplate
    from kiln.corpus.windows import domain_windows

    tok = Tokenizer.from_str(checkpoint.tokenizer.tokenizer_json)
    template = ChatTemplate(checkpoint.tokenizer.tokenizer_config)

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    return {d: domain_windows(d, split, encode, window, count, template).windows
            for d in ("prose", "technical", "code", "chat")}


@torch.no_grad()
def perplexities(spec, weights: dict[str, torch.Tensor], head: torch.Tensor, windows: dict[str, list],
                 int8_activations: bool = False) -> dict:
    from kiln.calibration.collect import run_layers
    from kiln.calibration.fake_quant import int8_per_token
    from kiln.export.reference import ReferenceModel

    model = ReferenceModel(spec, weights)
    if int8_activations:  # W8A8: every decoder linear reads per-token int8 activations
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in name:
                module.register_forward_pre_hook(lambda _m, args: (int8_per_token(args[0]),))
    out = {}
    for domain, ws in windows.items():
        nll, n = 0.0, 0
        for w in ws:
            ids = torch.tensor(w, dtype=torch.int64)
            x = run_layers(model, ids[None], torch.arange(ids.numel())[None])
            h = model.model.norm(x)[0]
            logits = F.linear(int8_per_token(h) if int8_activations else h, head)  # W8A8 quantizes the head too
            nll += float(F.cross_entropy(logits[:-1], ids[1:], reduction="sum"))
            n += ids.numel() - 1
        out[domain] = math.exp(nll / n)
    return out


def write_scores(checkpoint, weights: dict[str, torch.Tensor], group_size: int, count: int, path: str) -> None:
    from kiln.calibration.calibrate import CalibrationConfig, corpus_windows
    from kiln.calibration.sensitivity import unit_scores

    windows, _ = corpus_windows(checkpoint, CalibrationConfig("awq", num_windows=count))
    scores = unit_scores(checkpoint.spec, weights, [torch.tensor(w) for w in windows], group_size, print)
    with open(path, "w") as f:
        json.dump({"+".join(u): s for u, s in scores.items()}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", default=None, help="calibration artifact to fold (AWQ); none: plain RTN")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--int8", nargs="*", default=[], help="regexes of decoder linears kept int8 per channel")
    ap.add_argument("--windows", type=int, default=4, help="validation windows of 512 tokens per domain")
    ap.add_argument("--fp32", action="store_true", help="no quantization at all (the reference row)")
    ap.add_argument("--w8a8", action="store_true", help="W8A8: int8 per-channel weights, per-token int8 activations")
    ap.add_argument("--no-gains", action="store_true", help="drop the artifact's tuned norm gains")
    ap.add_argument("--scores-out", default=None, help="write int8-fallback scores (calibration split) and stop")
    ap.add_argument("--scores", default=None, help="int8-fallback scores from --scores-out")
    ap.add_argument("--int8-top", type=int, default=0, help="keep the N top-scored units int8")
    ap.add_argument("--label", default="")
    args = ap.parse_args()

    from kiln.calibration.artifact import CalibrationArtifact, apply_artifact
    from kiln.calibration.fake_quant import int8_per_channel
    from kiln.export.checkpoint import load_checkpoint
    from kiln.export.checkpoint_types import lm_head_weight_name

    start = time.perf_counter()
    checkpoint = load_checkpoint("default")
    if args.artifact:
        artifact = CalibrationArtifact.load(args.artifact)
        if args.no_gains:
            from kiln.calibration.norm_tuning import GAIN_PREFIX

            scales = {k: v for k, v in artifact.scales.items() if not k.startswith(GAIN_PREFIX)}
            artifact = CalibrationArtifact(artifact.method, artifact.model_fingerprint, artifact.hyperparameters,
                                           scales)
        args.int8 += [f"^{m}$" for m in artifact.hyperparameters.get("int8_linears", [])]
        checkpoint = apply_artifact(checkpoint, artifact)
    weights = {k: v.float() for k, v in checkpoint.weights.items()}
    spec = checkpoint.spec
    if args.scores_out:
        write_scores(checkpoint, weights, args.group_size, args.windows, args.scores_out)
        return
    if args.int8_top:
        scores = json.loads(open(args.scores).read())
        args.int8 += [f"^{m}$" for unit in sorted(scores, key=lambda u: -scores[u])[: args.int8_top]
                      for m in unit.split("+")]
    head = weights[lm_head_weight_name(spec)]
    if args.w8a8:
        weights = simulated_weights(weights, args.group_size, [".*"])
        head = int8_per_channel(head)
    elif not args.fp32:
        weights = simulated_weights(weights, args.group_size, args.int8)
        head = int8_per_channel(head)
    ppl = perplexities(spec, weights, head, validation_windows(checkpoint, args.windows), args.w8a8)
    print(json.dumps({"label": args.label or ("fp32" if args.fp32 else args.artifact or "rtn"), "w8a8": args.w8a8,
                      "group_size": args.group_size, "int8": args.int8, "windows": args.windows,
                      "perplexity": {d: round(p, 3) for d, p in ppl.items()},
                      "seconds": round(time.perf_counter() - start, 1)}))


if __name__ == "__main__":
    main()
