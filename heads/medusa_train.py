"""train_medusa(): checkpoint + calibration text -> MedusaArtifact (``kiln train-medusa``).

1. Prompts: windows of the text (continued as text) and paragraphs of it inside chat requests; every
   HOLDOUT_EVERY-th prompt of each kind is held out.
2. The fp32 reference greedy-decodes each prompt once (medusa_data.greedy_states) and its hidden states
   are cached: the model never runs again.
3. Only the heads train: cross-entropy of head i at row j against the greedy token j + i, through the
   frozen shared LM head (AdamW, cosine schedule, shuffled with the seed: the run is deterministic).
4. Scored on the held-out prompts and on CHAT_QUESTIONS (open questions, never trained on): per-head
   top-1 agreement with the greedy continuation, and the mean tokens a greedy chain of the K heads'
   guesses would get accepted per verification step (1 + the leading heads that are right).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kiln import medusa
from kiln.errors import require

from .medusa_data import CHAT_QUESTIONS, CHAT_REQUESTS, Continuations, greedy_states, lm_head_weight, render_chat
from .medusa_heads import HydraHeads, MedusaArtifact, MedusaError, MedusaHeads

Progress = Callable[[str], None]
HOLDOUT_EVERY = 8
PROMPT_SOURCES = ("mixed", "self", "templates")  # ChatAnswers: the model's own user turns and/or templated ones
SCORED_TRAIN_ROWS = 16384  # the training split's score (a fit diagnostic) is taken on a sample of this many rows
IGNORE = -100


@dataclass(frozen=True)
class MedusaConfig:
    num_heads: int = 4
    text_prompts: int = 24  # windows of the text, continued as text
    chat_prompts: int = 24  # paragraphs of the text inside a chat request
    prompt_tokens: int = 64  # tokens per text window
    new_tokens: int = 48  # greedy tokens generated after each prompt
    epochs: int = 5
    batch_rows: int = 32
    learning_rate: float = 1e-3
    seed: int = 0
    generate_batch: int = 32  # prompts decoded together
    label_vocabulary: bool = False  # train the softmax over the labels' and their rivals' tokens (label_vocabulary())
    weight_decay: float = 0.0  # AdamW's: pulls each head back toward the shared LM head (W, b = 0)
    kind: str = "medusa"  # kiln/medusa.py KINDS; "hydra": each head also reads the token before the one it guesses
    draft_vocabulary: int = 8192  # hydra: the most frequent answer tokens its guesses range over

    def __post_init__(self) -> None:
        for name in ("num_heads", "prompt_tokens", "new_tokens", "epochs", "batch_rows", "generate_batch"):
            value = getattr(self, name)
            require(isinstance(value, int) and value > 0, name, "a positive integer", value)
        for name in ("text_prompts", "chat_prompts"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 0, name, "a non-negative integer", value)
        require(self.text_prompts + self.chat_prompts >= HOLDOUT_EVERY, "text_prompts + chat_prompts",
                f"at least {HOLDOUT_EVERY} (one in {HOLDOUT_EVERY} is held out)", self.text_prompts + self.chat_prompts)
        require(self.new_tokens > self.num_heads, "new_tokens", f"more than num_heads ({self.num_heads})",
                self.new_tokens)
        require(self.learning_rate > 0, "learning_rate", "positive", self.learning_rate)
        require(self.weight_decay >= 0, "weight_decay", "non-negative", self.weight_decay)
        require(self.kind in medusa.KINDS, "kind", f"one of {medusa.KINDS}", self.kind)
        require(isinstance(self.draft_vocabulary, int) and self.draft_vocabulary > 0, "draft_vocabulary",
                "a positive integer", self.draft_vocabulary)


def build_prompts(checkpoint, text: str, config: MedusaConfig) -> list[list[int]]:
    """Text windows first, then chat requests around paragraphs, both spread evenly over the text."""
    from tokenizers import Tokenizer

    if checkpoint.tokenizer is None:
        raise MedusaError(f"{checkpoint.source} carries no tokenizer; training Medusa heads needs one to read text")
    tokenizer = Tokenizer.from_str(checkpoint.tokenizer.tokenizer_json)
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    windows = len(ids) // config.prompt_tokens
    if windows < config.text_prompts:
        raise MedusaError(f"the text has {len(ids)} tokens, too few for {config.text_prompts} prompts of "
                          f"{config.prompt_tokens}")
    prompts = [ids[w * config.prompt_tokens:(w + 1) * config.prompt_tokens]
               for w in _spread(windows, config.text_prompts)]
    paragraphs = [p for p in text.split("\n\n") if 200 <= len(p) <= 500]
    if config.chat_prompts and len(paragraphs) < config.chat_prompts:
        raise MedusaError(f"the text has {len(paragraphs)} paragraphs of 200-500 characters, too few for "
                          f"{config.chat_prompts} chat prompts")
    for n, p in enumerate(_spread(len(paragraphs), config.chat_prompts)):
        request = CHAT_REQUESTS[n % len(CHAT_REQUESTS)].format(paragraphs[p])
        prompts.append(_chat_ids(tokenizer, checkpoint, request))
    return prompts


def _chat_ids(tokenizer, checkpoint, message: str) -> list[int]:
    try:
        rendered = render_chat(checkpoint.tokenizer.tokenizer_config, message)
    except ValueError as exc:
        raise MedusaError(f"{checkpoint.source}: {exc}; chat prompts need one") from exc
    return list(tokenizer.encode(rendered, add_special_tokens=False).ids)


def _spread(available: int, count: int) -> list[int]:
    return [i * available // count for i in range(count)] if count else []


def generate(model, prompts: list[list[int]], config: MedusaConfig, say: Progress, what: str) -> list[Continuations]:
    out = []
    start = time.perf_counter()
    for first in range(0, len(prompts), config.generate_batch):
        out.append(greedy_states(model, prompts[first:first + config.generate_batch], config.new_tokens))
        done = min(first + config.generate_batch, len(prompts))
        elapsed = time.perf_counter() - start
        say(f"{what}: greedy continuations of {done}/{len(prompts)} prompts in {elapsed:.0f}s "
            f"(eta {elapsed / done * (len(prompts) - done):.0f}s)")
    return out


def chosen_tokens(batches: list[Continuations]) -> torch.Tensor:
    """[n]: the token each row of rows_and_labels chose (its own greedy prediction)."""
    return torch.cat([c.tokens[c.valid()] for c in batches])


def rows_and_labels(batches: list[Continuations], model, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, D]: the final norm's output at every continuation row; labels [n, K]: the greedy token i
    steps after row j's own prediction (IGNORE past the continuation's end)."""
    xs, labels = [], []
    for c in batches:
        valid = c.valid()
        n = c.tokens.shape[1]
        shifted = torch.full((*c.tokens.shape, num_heads), IGNORE, dtype=torch.int64)
        for i in range(1, num_heads + 1):
            target = torch.where(valid[:, i:], c.tokens[:, i:], IGNORE)
            shifted[:, :n - i, i - 1] = target
        with torch.no_grad():
            xs.append(model.model.norm(c.states[valid]))
        labels.append(shifted[valid])
    return torch.cat(xs), torch.cat(labels)


def label_vocabulary(x: torch.Tensor, labels: torch.Tensor, lm_head: torch.Tensor,
                     rivals: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(the LM head's rows of the training vocabulary, labels renumbered into it). The vocabulary: the tokens
    the labels use and, at every row, the LM head's own top `rivals` (where each head starts, so the tokens it
    must learn to push down). The softmax of training spans that, a fraction of the model's vocabulary
    (SmolLM2: ~10k of 49k tokens for 20k rows of chat answers), which is where the training time goes;
    scoring stays on the full head."""
    used = [labels[labels != IGNORE]]
    with torch.no_grad():
        for chunk in x.split(1024):
            used.append((chunk @ lm_head.T).topk(rivals, dim=-1).indices.reshape(-1))
    vocab = torch.unique(torch.cat(used))
    index = torch.full((lm_head.shape[0],), IGNORE, dtype=torch.int64)
    index[vocab] = torch.arange(len(vocab))
    renumbered = torch.where(labels == IGNORE, IGNORE, index[labels.clamp(min=0)])
    return lm_head[vocab], renumbered


def draft_vocabulary(chosen: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` tokens the rows chose most often, most frequent first (ties: lower id first)."""
    counts = torch.bincount(chosen)
    order = torch.argsort(-counts, stable=True)
    return order[:min(size, int((counts > 0).sum()))]


class HeadRows(NamedTuple):
    """Cached training rows: x [n, D] (the final norm's output), labels [n, K] (rows_and_labels) and, for
    hydra heads, chosen [n] (the token each row chose: chosen_tokens / medusa_chat.answer_tokens)."""

    x: torch.Tensor
    labels: torch.Tensor
    chosen: torch.Tensor | None = None


def train_heads(rows: HeadRows, lm_head: torch.Tensor, config: MedusaConfig, say: Progress,
                heldout: HeadRows | None = None, embed: torch.Tensor | None = None
                ) -> tuple[MedusaHeads | HydraHeads, list[dict]]:
    """Fit the heads on cached rows; returns them and one record per epoch (mean training loss, and with
    heldout the held-out chain's accepted tokens per step). Early stopping: with heldout, the heads are those
    of the epoch that scored best there (the heads overfit a few thousand prompts within a couple of epochs).
    Hydra heads (config.kind) also need the rows' chosen tokens and embed (the input embedding [V, D])."""
    x, labels, chosen = rows
    full_head = lm_head.detach()
    torch.manual_seed(config.seed)  # before the heads: hydra heads start from small random weights
    heads: MedusaHeads | HydraHeads
    if config.kind == "hydra":
        if chosen is None or embed is None:
            raise ValueError("hydra heads train on the token each row chose and the input embedding")
        vocab = draft_vocabulary(chosen, config.draft_vocabulary)
        say(f"draft vocabulary: {len(vocab)} tokens, {_coverage(chosen, vocab):.1%} of the answers' tokens")
        heads = HydraHeads(config.num_heads, vocab, embed, full_head)
    else:
        if config.label_vocabulary:
            lm_head, labels = label_vocabulary(x, labels, lm_head)
            say(f"training vocabulary: {lm_head.shape[0]} tokens")
        heads = MedusaHeads(config.num_heads, x.shape[1])
    optimizer = torch.optim.AdamW(heads.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    steps_per_epoch = math.ceil(x.shape[0] / config.batch_rows)
    total = steps_per_epoch * config.epochs
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / total)))
    order = torch.Generator().manual_seed(config.seed)
    lm_head = lm_head.detach()
    history: list[dict] = []
    best: tuple[float, dict[str, torch.Tensor]] | None = None
    start, step = time.perf_counter(), 0
    for epoch in range(config.epochs):
        total_loss = 0.0
        for batch in torch.randperm(x.shape[0], generator=order).split(config.batch_rows):
            if isinstance(heads, HydraHeads):
                assert chosen is not None
                logits, target = _hydra_logits(heads, x[batch], labels[batch], chosen[batch])
            else:
                logits, target = heads.logits(x[batch], lm_head), labels[batch]
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=IGNORE)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            total_loss += loss.item() * len(batch)
            step += 1
            if step % 50 == 0 or step == total:
                elapsed = time.perf_counter() - start
                say(f"training step {step}/{total} (epoch {epoch + 1}), loss {loss.item():.3f}, "
                    f"{elapsed:.0f}s (eta {elapsed / step * (total - step):.0f}s)")
        record = {"epoch": epoch + 1, "loss": round(total_loss / x.shape[0], 4)}
        if heldout is not None:
            result = score(heads, heldout.x, heldout.labels, full_head, heldout.chosen)
            record.update(heldout_top1=result["top1_accuracy"], heldout_accepted=result["mean_accepted_tokens"])
            say(f"epoch {epoch + 1}: held-out top-1 per head {result['top1_accuracy']}, accepted/step "
                f"{result['mean_accepted_tokens']}")
            if best is None or result["mean_accepted_tokens"] > best[0]:
                best = (result["mean_accepted_tokens"], {k: v.detach().clone() for k, v in heads.state_dict().items()})
        history.append(record)
    if best is not None:
        heads.load_state_dict(best[1])
    return heads.requires_grad_(False), history


def _hydra_logits(heads: HydraHeads, x: torch.Tensor, labels: torch.Tensor, chosen: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher forced: head i reads the true token before its own (the row's chosen one for head 1); its
    logits over the draft vocabulary and its label's row there (IGNORE outside it)."""
    before = torch.cat([chosen[:, None], labels[:, :-1]], 1).clamp(min=0)  # past an answer's end: ignored anyway
    rows = heads.index[labels.clamp(min=0)]
    target = torch.where((labels == IGNORE) | (rows == len(heads.vocab)), IGNORE, rows)
    return heads.logits(heads(x, before)), target


def _coverage(chosen: torch.Tensor, vocab: torch.Tensor) -> float:
    return float(torch.isin(chosen, vocab).float().mean())


@torch.no_grad()
def score(heads: MedusaHeads | HydraHeads, x: torch.Tensor, labels: torch.Tensor, lm_head: torch.Tensor,
          chosen: torch.Tensor | None = None) -> dict:
    """Per-head top-1 agreement with the greedy continuation, and the chain's mean accepted tokens per step.
    Hydra heads run free (each on the one before's guess, as the draft graph does) from the chosen tokens."""
    correct = torch.zeros(labels.shape, dtype=torch.bool)
    for chunk in torch.arange(x.shape[0]).split(256):
        if isinstance(heads, HydraHeads):
            assert chosen is not None, "hydra heads are scored from the token each row chose"
            guesses = heads.guess(x[chunk], chosen[chunk])
        else:
            guesses = heads.logits(x[chunk], lm_head).argmax(-1)
        correct[chunk] = guesses == labels[chunk]
    valid = labels != IGNORE
    accuracy = [float(correct[:, i][valid[:, i]].float().mean()) if valid[:, i].any() else float("nan")
                for i in range(labels.shape[1])]
    full = valid.all(1)  # rows with all K labels: the chain can be scored to its end
    leading = correct[full].int().cumprod(1).sum(1)
    return {"rows": int(x.shape[0]), "top1_accuracy": [round(a, 4) for a in accuracy],
            "chain_rows": int(full.sum()),
            "mean_accepted_tokens": round(float(1 + leading.float().mean()) if full.any() else float("nan"), 4)}


def train_medusa(checkpoint, text: str, config: MedusaConfig, progress: Progress | None = None,
                 corpus: str = "") -> MedusaArtifact:
    from kiln.export.reference import ReferenceModel

    say = progress or (lambda _m: None)
    start, cpu_start = time.perf_counter(), time.process_time()
    model = ReferenceModel.from_checkpoint(checkpoint)
    prompts = build_prompts(checkpoint, text, config)
    held = [p for n, p in enumerate(prompts) if n % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
    train = [p for n, p in enumerate(prompts) if n % HOLDOUT_EVERY != HOLDOUT_EVERY - 1]
    tokenizer_ids = _question_ids(checkpoint)
    data = {}
    for name, p in (("train", train), ("heldout", held), ("chat", tokenizer_ids)):
        batches = generate(model, p, config, say, name)
        data[name] = (*rows_and_labels(batches, model, config.num_heads), chosen_tokens(batches))
    sizes = {"train_prompts": len(train), "heldout_prompts": len(held), "chat_questions": len(tokenizer_ids)}
    return _fit(checkpoint, model, data, config, say, _Provenance(corpus, sizes, start, cpu_start))


@dataclass(frozen=True)
class ChatAnswers:
    """Where `train_medusa_chat` gets its rows: the greedy answers of `engine` (an fp32 engine of the same
    checkpoint, served by the runtime) to `prompts` chat prompts, written by the model itself
    (prompt_source "self": medusa_chat.self_instructed_prompts), made from templates ("templates":
    medusa_chat.chat_prompts: open questions over the dictionary's headwords, 1 in 15 a corpus chat request),
    or half of each ("mixed", the default: it measured best on the open questions, docs/design.md "Hydra
    heads"); 1 prompt in HOLDOUT_EVERY is held out, and CHAT_QUESTIONS are scored apart.
    `cache`: a .jsonl file of answers reused across runs (medusa_chat.engine_answers; self-instructed prompts
    are kept beside it, prompt_cache); `rows_cache`: a torch file of their teacher-forced rows, reused when it
    fits the answers (medusa_chat.cached_rows)."""

    engine: str
    prompts: int = 200
    threads: int | None = None
    cache: Path | None = None
    rows_cache: Path | None = None
    prompt_source: str = "mixed"

    def __post_init__(self) -> None:
        require(isinstance(self.prompts, int) and self.prompts >= HOLDOUT_EVERY, "prompts",
                f"an integer >= {HOLDOUT_EVERY}", self.prompts)
        require(self.prompt_source in PROMPT_SOURCES, "prompt_source", f"one of {PROMPT_SOURCES}", self.prompt_source)

    @property
    def prompt_cache(self) -> Path | None:
        return None if self.cache is None else self.cache.with_suffix(".prompts.json")

    def chat_prompts(self, seed: int, say: Progress) -> list[str]:
        from .medusa_chat import chat_prompts, self_instructed_prompts

        if self.prompt_source == "templates":
            return chat_prompts(self.prompts)
        own = self.prompts if self.prompt_source == "self" else self.prompts // 2
        written = self_instructed_prompts(self.engine, own, self.threads, say, self.prompt_cache, seed)
        if self.prompt_source == "self":
            return written
        return interleave_runs(written, chat_prompts(self.prompts - own), HOLDOUT_EVERY)


def interleave_runs(a: list[str], b: list[str], run: int) -> list[str]:
    """a and b alternating in runs of `run` items (then whichever is longer): with run = HOLDOUT_EVERY the
    held-out split (every run-th prompt) takes from both lists alike."""
    out: list[str] = []
    for first in range(0, max(len(a), len(b)), run):
        out += a[first:first + run] + b[first:first + run]
    return out


def train_medusa_chat(checkpoint, source: ChatAnswers, config: MedusaConfig,
                      progress: Progress | None = None) -> MedusaArtifact:
    """Heads self-distilled on the model's own chat answers (config.new_tokens tokens each)."""
    from kiln.export.reference import ReferenceModel

    from .medusa_chat import answer_tokens, cached_rows, engine_answers

    say = progress or (lambda _m: None)
    start, cpu_start = time.perf_counter(), time.process_time()
    prompts = source.chat_prompts(config.seed, say)
    held = [p for n, p in enumerate(prompts) if n % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
    train = [p for n, p in enumerate(prompts) if n % HOLDOUT_EVERY != HOLDOUT_EVERY - 1]
    answers = engine_answers(source.engine, train + held + list(CHAT_QUESTIONS), config.new_tokens, source.threads,
                             say, cache=source.cache)
    model = ReferenceModel.from_checkpoint(checkpoint)
    cut = (0, len(train), len(train) + len(held), len(answers))
    splits = {name: answers[a:b] for name, a, b in zip(("train", "heldout", "chat"), cut[:-1], cut[1:], strict=True)}
    rows = cached_rows(model, splits, config.num_heads, say, source.rows_cache)
    data = {name: (*rows[name], answer_tokens(seqs)) for name, seqs in splits.items()}
    sizes = {"train_prompts": len(train), "heldout_prompts": len(held), "chat_questions": len(CHAT_QUESTIONS),
             "answers_from": str(source.engine), "prompt_source": source.prompt_source}
    return _fit(checkpoint, model, data, config, say, _Provenance("chat answers", sizes, start, cpu_start))


@dataclass(frozen=True)
class _Provenance:
    corpus: str
    data: dict
    start: float  # perf_counter and process_time when the run began
    cpu_start: float


def _fit(checkpoint, model, data: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], config: MedusaConfig,
         say: Progress, about: _Provenance) -> MedusaArtifact:
    """Train on data["train"] (x, labels, chosen tokens), score every split, and record how the artifact was made."""
    start, cpu_start = about.start, about.cpu_start
    lm_head = lm_head_weight(model)
    generation_s = time.perf_counter() - start
    say(f"cached {sum(rows[0].shape[0] for rows in data.values())} hidden states in {generation_s:.0f}s")
    heads, history = train_heads(HeadRows(*data["train"]), lm_head, config, say, heldout=HeadRows(*data["heldout"]),
                                 embed=model.model.embed_tokens.weight)
    training_s = time.perf_counter() - start - generation_s
    results = {}
    for name, rows in data.items():
        x, labels, chosen = _sample(*rows, SCORED_TRAIN_ROWS if name == "train" else None)
        results[name] = score(heads, x, labels, lm_head, chosen)
    for name, result in results.items():
        say(f"{name}: top-1 accuracy per head {result['top1_accuracy']}, "
            f"mean accepted tokens per step {result['mean_accepted_tokens']}")
    info = {
        "format": medusa.ARTIFACT_FORMAT, "kind": config.kind, "num_heads": config.num_heads,
        "hidden_size": checkpoint.spec.hidden_size,
        "vocab_size": checkpoint.spec.vocab_size, "model_source": checkpoint.source,
        "model_fingerprint": checkpoint.fingerprint(), "corpus": about.corpus, "config": asdict(config),
        "data": {**about.data, "train_rows": int(data["train"][0].shape[0])},  # all of them: the score's are a sample
        "epochs": history,  # the heads are those of the epoch with the best held-out accepted tokens per step
        "seconds": {"generation": round(generation_s, 1), "training": round(training_s, 1),
                    "total": round(time.perf_counter() - start, 1),
                    "cpu_total": round(time.process_time() - cpu_start, 1)},  # all threads: what a shared machine's
                                                                               # wall time hides
        **results,
    }
    return MedusaArtifact(heads.state(), info)


def _sample(x: torch.Tensor, labels: torch.Tensor, chosen: torch.Tensor, rows: int | None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """At most `rows` rows, drawn with a fixed seed (scoring 100k rows on the full vocabulary costs minutes)."""
    if rows is None or x.shape[0] <= rows:
        return x, labels, chosen
    pick = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))[:rows]
    return x[pick], labels[pick], chosen[pick]


def _question_ids(checkpoint) -> list[list[int]]:
    from tokenizers import Tokenizer

    assert checkpoint.tokenizer is not None  # build_prompts checked
    tokenizer = Tokenizer.from_str(checkpoint.tokenizer.tokenizer_json)
    return [_chat_ids(tokenizer, checkpoint, q) for q in CHAT_QUESTIONS]
