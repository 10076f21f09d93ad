"""The kiln command line: one click group; each command is one call into its package."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from kiln.cli.extras import missing_extra
from kiln.contract import KV_DTYPES
from kiln.errors import InvalidParamError, KilnError
from kiln.quant_scheme import RESCORED_HEAD_MAX_ROWS
from kiln.vision import EncoderQuantization

if TYPE_CHECKING:
    from kiln.runtime.params import SamplingParams, SpeculativeConfig
    from kiln.runtime.structured import StructuredOutput

CommandFunction = TypeVar("CommandFunction", bound=Callable[..., Any])


class _Group(click.Group):
    """Prints a KilnError (bad option, broken engine dir, unusable model or artifact) and a module of an
    extra that is not installed as one line; anything else is a bug and keeps its traceback, as
    KILN_DEBUG=1 keeps every one."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KilnError as exc:
            if os.environ.get("KILN_DEBUG"):
                raise
            raise click.ClickException(str(exc)) from exc
        except ImportError as exc:
            message = missing_extra(exc, ctx.invoked_subcommand)
            if message is None or os.environ.get("KILN_DEBUG"):
                raise
            raise click.ClickException(message) from exc


tensor_parallel_build_option = click.option(
    "--tensor-parallel", type=click.IntRange(min=1), default=1, show_default=True,
    help="write one graph per tensor-parallel rank (its attention heads and KV pool, its MLP columns, an all-reduce "
         "after each layer's attention and MLP; float32 or int4-q4_1 weights), to serve with one process per rank")


@click.group(cls=_Group)
@click.version_option(package_name="kiln")
def main() -> None:
    """kiln: an ahead-of-time LLM compiler and a thin serving runtime."""


@main.command()
@click.argument("model")
@click.option("-o", "--output", "output", required=True, type=click.Path(path_type=Path),
              help="engine directory to write")
@click.option("--kv-dtype", type=click.Choice(list(KV_DTYPES)), default="float16", show_default=True,
              help="KV-cache element type: float16 halves what attention reads at float32's measured perplexity "
                   "(CPU steps 4-8% faster); float32 keeps the model's own precision; int8 takes per-head scales "
                   "from --calibration")
@click.option("--block-size", type=int, default=16, show_default=True, help="tokens per KV-cache block")
@click.option("--max-seq-len", type=int, default=None,
              help="context length in tokens (default: the model's own, max_position_embeddings or the length its "
                   "rope scaling stretches it to; the server serves what its KV pool holds)")
@click.option("--quantization", default=None,
              help="none | int8-weight-only | int4-rtn-g{32,64,128} | int4-awq-g{32,64,128} | int4-q4_1 | "
                   "w8a8-smoothquant | gguf (a GGUF's Q4_0/Q8_0/Q4_K/Q5_K/Q6_K blocks executed as they are, int8 "
                   "activations as llama.cpp) | gguf-exact (the same blocks with float32 activations: slower). Default:"
                   " gguf for a .gguf file whose matrices are all of those types, else none")
@click.option("--calibration", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="artifact of `kiln calibrate` (needed by int4-awq-*, w8a8-smoothquant and --kv-dtype int8); "
                   "folding its scales reads every weight into memory (fp32), where other builds stream them")
@click.option("--lm-head", type=click.Choice(["int8", "int4", "int4-rescored", "w8a8"]), default="int8",
              show_default=True,
              help="the tied LM head under an int4 quantization: int8 weights (keeps more of fp32's perplexity "
                   "than int4), int4 (the scheme's own groups), int4-rescored (int4 with the logits of its top 256 "
                   "tokens recomputed from the 8-bit embedding table: int4's bytes near int8's perplexity; under "
                   "int4-q4_1 at every step, under int4-rtn/int4-awq for steps of up to "
                   f"{RESCORED_HEAD_MAX_ROWS} logits rows, larger steps taking the int8 head), or w8a8 (int8 weights "
                   "and per-token int8 activations: faster for batches)")
@click.option("--medusa", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="heads of `kiln train-medusa`: the graph also returns their logits (medusa_logits), or for "
                   "hydra heads the final norm's output (medusa_hidden) and the engine gets their draft graph")
@click.option("--backend", type=click.Choice(["onnxruntime-cpu", "tensorrt"]), default="onnxruntime-cpu",
              show_default=True, help="tensorrt: the graph lowered for TensorRT's ONNX parser with kiln's plugins, "
              "and model.plan where tensorrt is importable (else built later by python -m kiln.plugins_trt.trt_build)")
@click.option("--pipeline-stages", type=click.IntRange(min=1), default=1, show_default=True,
              help="write one graph per contiguous layer range (the first with the embedding, the last with the "
                   "final norm and LM head), each with its own layers' KV pools, to serve as a pipeline "
                   "(kiln serve --pipeline-parallel N)")
@click.option("--mmproj", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="llama.cpp's image encoder file (mmproj-*.gguf) of a LLaVA-1.5 text GGUF: build a "
                   "vision-language engine")
@click.option("--vision-quantization", type=click.Choice([scheme.value for scheme in EncoderQuantization]),
              default=EncoderQuantization.FLOAT32.value, show_default=True,
              help="a vision-language model's image encoder: float32; int8 (int8 weights per output channel and "
                   "per-token int8 activations: a quarter of the bytes and faster than float32; at CLIP "
                   "ViT-L/14-336's shape the embeddings moved by 3%% relative error); int8-weight-only (the same "
                   "weights in MatMulNBits, activations int8 per block of 128: slower than float32 on AVX2)")
@tensor_parallel_build_option
def build(model: str, output: Path, kv_dtype: str, block_size: int, max_seq_len: int | None,
          quantization: str | None, calibration: Path | None, lm_head: str, medusa: Path | None, backend: str,
          pipeline_stages: int, mmproj: Path | None, vision_quantization: str, tensor_parallel: int) -> None:
    """Compile MODEL (an HF checkpoint dir, a .gguf file, or `default` for SmolLM2) into an engine dir."""
    from kiln.manifest import BuildOptions
    from kiln.optimize.build import build_engine
    from kiln.quant_scheme import LmHead, QuantScheme

    if quantization is None:
        from kiln.optimize.quantize_gguf import default_quantization
        quantization = default_quantization(model)
    options = BuildOptions(quantization=QuantScheme.parse(quantization), kv_dtype=kv_dtype, block_size=block_size,
                           max_seq_len=max_seq_len, calibration=calibration, lm_head=LmHead.parse(lm_head),
                           medusa=medusa, pipeline_stages=pipeline_stages, tensor_parallel=tensor_parallel,
                           vision_quantization=EncoderQuantization.parse(vision_quantization))
    build_engine(model, output, options, backend=backend, mmproj=mmproj)


@main.command()
@click.argument("engine_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("output", type=click.Path(path_type=Path))
@tensor_parallel_build_option
@click.option("--pipeline-stages", type=click.IntRange(min=1), default=1, show_default=True,
              help="cut the engine's graph into N pipeline stages (as kiln build --pipeline-stages N)")
def split(engine_dir: Path, output: Path, tensor_parallel: int, pipeline_stages: int) -> None:
    """Write a copy of the one-graph engine ENGINE_DIR split into tensor-parallel ranks or pipeline stages into
    OUTPUT, without rebuilding it."""
    from kiln.optimize.shard_tensor_parallel import split_engine_tensor_parallel
    from kiln.optimize.split_stages import split_engine

    if (tensor_parallel > 1) == (pipeline_stages > 1):
        raise InvalidParamError("give one of --tensor-parallel N or --pipeline-stages N (N > 1)", "tensor_parallel")
    if output.exists():
        raise InvalidParamError(f"{output} already exists; choose a new directory", "output")
    if tensor_parallel > 1:
        manifest = split_engine_tensor_parallel(engine_dir, output, tensor_parallel)
    else:
        manifest = split_engine(engine_dir, output, pipeline_stages)
    click.echo(f"engine written to {output} ({', '.join(manifest.graph_files)})")


_speculative_options = [
    click.option("--speculative", "speculative", type=click.Choice(["ngram", "draft", "medusa"]), default=None,
                 help="speculative decoding: ngram (prompt lookup), draft (a second engine, --draft), medusa (the "
                      "engine's own heads: kiln build --medusa)"),
    click.option("--num-speculative-tokens", type=int, default=4, show_default=True,
                 help="tokens proposed per sequence and step (with --speculative)"),
    click.option("--draft", "draft", type=click.Path(exists=True, file_okay=False), default=None,
                 help="the draft engine dir of --speculative draft (same tokenizer)"),
    click.option("--min-guess-probability", type=click.FloatRange(0, 1, max_open=True), default=None,
                 help="--speculative medusa: propose a chain of guesses only as far as the product of the heads' "
                      "probabilities stays at least this (default: 0.2 for hydra heads, 0 for Medusa heads)"),
]


max_num_batched_tokens_option = click.option(
    "--max-num-batched-tokens", "max_num_tokens", type=click.IntRange(min=1), default=None,
    help="tokens computed per step, decodes first, then prompt chunks in arrival order (default: the runtime's "
         "step budget, see docs/design.md; at most the engine's max_num_tokens)")


def speculative_options(func: CommandFunction) -> CommandFunction:
    for option in reversed(_speculative_options):
        func = option(func)
    return func


def _speculative(method: str | None, num_tokens: int, draft: str | None,
                 min_guess_probability: float | None = None) -> SpeculativeConfig | None:
    from kiln.errors import InvalidParamError
    from kiln.runtime.params import SpeculativeConfig

    if method is None:
        if draft is not None:
            raise InvalidParamError("--draft needs --speculative draft", "draft")
        return None
    if method == "draft" and draft is None:
        raise InvalidParamError("--speculative draft needs --draft ENGINE_DIR", "draft")
    if min_guess_probability is not None and method != "medusa":
        raise InvalidParamError("--min-guess-probability needs --speculative medusa", "min_guess_probability")
    return SpeculativeConfig(method, num_tokens=num_tokens, draft_engine=draft,
                             min_guess_probability=min_guess_probability)


@main.command()
@click.argument("engine_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--api-key", envvar="KILN_API_KEY", default=None,
              help="require 'Authorization: Bearer KEY' on every route but /health (also from $KILN_API_KEY)")
@click.option("--served-model-name", default=None, help="model name clients use (default: the engine's)")
@click.option("--chat-template", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="a Jinja chat template file replacing the engine's")
@click.option("--max-model-len", type=click.IntRange(min=1), default=None,
              help="longest prompt + output served (default and at most: the engine's --max-seq-len)")
@click.option("--max-queue", type=click.IntRange(min=1), default=None,
              help="waiting requests before 503 + Retry-After (default: unbounded)")
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=64, show_default=True,
              help="sequences batched per step")
@max_num_batched_tokens_option
@click.option("--kv-cache-bytes", type=click.IntRange(min=1), default=None,
              help="KV pool size; must hold one --max-model-len sequence (default: 10% of available memory)")
@click.option("--num-threads", type=click.IntRange(min=1), default=None,
              help="onnxruntime threads (default: one per core)")
@click.option("--disable-prefix-caching", is_flag=True, help="never reuse the KV blocks of a shared prompt prefix")
@click.option("--shutdown-timeout", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="seconds running requests get after SIGTERM; streams still running then end with an error event")
@click.option("--no-web-ui", "no_web_ui", is_flag=True, help="leave out the chat page at /")
@click.option("--allowed-media-path", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="let image_url parts name files inside this directory by file:// URL (after symlinks and '..'; "
                   "anything outside is refused); without it only data: URLs are taken. http(s) URLs are never "
                   "fetched")
@click.option("--max-request-bytes", type=click.IntRange(min=1), default=None,
              help="request bodies above this are answered 413 before any parsing (default: 1 KiB per token of "
              "--max-model-len, at least 1 MiB)")
@click.option("--read-timeout", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              help="seconds a client has to send a request's headers, and again its body; slower ones get 408")
@click.option("--max-connections", type=click.IntRange(min=1), default=512, show_default=True,
              help="open connections; one more is answered 503 and closed (a quarter of them, at most 64, may be "
              "sending a request slowly at once: past that the slowest are closed)")
@click.option("--ssl-keyfile", type=click.Path(exists=True, dir_okay=False), default=None,
              help="the TLS private key (PEM), with --ssl-certfile")
@click.option("--ssl-certfile", type=click.Path(exists=True, dir_okay=False), default=None,
              help="serve HTTPS with this TLS certificate chain (PEM)")
@click.option("--allowed-origins", multiple=True, help="CORS: an origin (scheme://host[:port]) whose pages may call "
              "the API, e.g. the chat page served elsewhere; repeat it or separate by commas; '*' for any")
@click.option("--reasoning-parser", type=click.Choice(["auto", "qwen3", "none"]), default="auto", show_default=True,
              help="split a reasoning model's <think>...</think> into reasoning_content: auto when the tokenizer "
              "has both tags as tokens, qwen3 always, none never")
@speculative_options
@click.option("--replicas", type=click.IntRange(min=1), default=None,
              help="serve on N engine replicas (Ray Serve; kiln[cluster]), each with its own KV pool and threads")
@click.option("--prefill-replicas", type=click.IntRange(min=1), default=None,
              help="disaggregate: P replicas compute prompts and hand their KV to --decode-replicas")
@click.option("--decode-replicas", type=click.IntRange(min=1), default=None,
              help="with --prefill-replicas: D replicas that decode from the handed-over KV")
@click.option("--routing", type=click.Choice(["prefix", "least-loaded", "round-robin"]), default="prefix",
              show_default=True, help="with replicas: to the replica caching the longest prompt prefix (else the "
              "less loaded of two), the less loaded of two, or in turn")
@click.option("--pipeline-parallel", type=click.IntRange(min=1), default=1, show_default=True,
              help="serve an engine of N pipeline stages (kiln build --pipeline-stages N) with each stage in its own "
                   "Ray actor (--num-threads each; a local Ray, or the cluster RAY_ADDRESS names); 1: a staged "
                   "engine's stages run in this process")
@click.option("--pipeline-micro-batches", type=click.IntRange(min=1), default=None,
              help="with a staged engine: run each step as M micro-batches of whole sequences, stage k computing one "
                   "while stage k+1 computes the one before (default: one per stage with --pipeline-parallel, else "
                   "1; at most the step's sequences); 1: each step whole, one stage at a time")
@click.option("--stage-memory-bytes", type=click.IntRange(min=1), default=None,
              help="with --pipeline-parallel: the memory each stage actor may take beyond its Ray worker's own, "
                   "enforced (RLIMIT_DATA); a stage that does not fit fails to load")
@click.option("--tensor-parallel", type=click.IntRange(min=1), default=None,
              help="serve an engine of N tensor-parallel ranks (kiln build --tensor-parallel N): one process per rank, "
                   "pinned to its own CPUs, --num-threads (default 1) threads each; such an engine always runs its "
                   "ranks, and N must equal its rank count")
@click.option("--ray-address", default=None, help="with replicas: an existing Ray cluster (e.g. ray://head:10001 or "
              "auto) instead of a local Ray on this machine")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="info",
              show_default=True, help="info logs the start-up summary and one line per request")
@click.option("--no-access-log", "no_access_log", is_flag=True,
              help="leave out uvicorn's line per HTTP request (client, path, status); kiln's own line per request "
                   "(tokens, finish reason, latency) stays")
def serve(engine_dir: Path, host: str, port: int, api_key: str | None, served_model_name: str | None,
          chat_template: Path | None, max_model_len: int | None, max_queue: int | None, max_num_seqs: int,
          max_num_tokens: int | None, kv_cache_bytes: int | None, num_threads: int | None, disable_prefix_caching: bool,
          shutdown_timeout: float, no_web_ui: bool, allowed_media_path: Path | None, max_request_bytes: int | None,
          read_timeout: float, max_connections: int, ssl_keyfile: str | None, ssl_certfile: str | None,
          allowed_origins: tuple[str, ...],
          reasoning_parser: str, speculative: str | None, num_speculative_tokens: int,
          draft: str | None, min_guess_probability: float | None, replicas: int | None,
          prefill_replicas: int | None, decode_replicas: int | None,
          routing: str, pipeline_parallel: int, pipeline_micro_batches: int | None, stage_memory_bytes: int | None,
          tensor_parallel: int | None, ray_address: str | None, log_level: str, no_access_log: bool) -> None:
    """Serve ENGINE_DIR over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions), with a
    chat page at /; on several replicas with --replicas N (or --prefill-replicas P --decode-replicas D)."""
    from kiln.runtime.params import RuntimeConfig
    from kiln.runtime.server.launch import ServeOptions
    from kiln.runtime.server.launch import serve as run_server

    config = RuntimeConfig(kv_cache_bytes=kv_cache_bytes, max_num_seqs=max_num_seqs, max_num_tokens=max_num_tokens,
                           num_threads=num_threads, max_model_len=max_model_len,
                           enable_prefix_caching=not disable_prefix_caching,
                           chat_template=chat_template.read_text() if chat_template else None,
                           speculative=_speculative(speculative, num_speculative_tokens, draft, min_guess_probability),
                           pipeline_parallel=pipeline_parallel, stage_memory_bytes=stage_memory_bytes,
                           pipeline_micro_batches=pipeline_micro_batches,
                           allowed_media_path=None if allowed_media_path is None else str(allowed_media_path),
                           tensor_parallel=tensor_parallel)
    options = ServeOptions(host=host, port=port, served_model_name=served_model_name, max_queue=max_queue,
                           shutdown_timeout=shutdown_timeout, log_level=log_level, access_log=not no_access_log,
                           api_key=api_key or None, web_ui=not no_web_ui, max_request_bytes=max_request_bytes,
                           read_timeout=read_timeout, max_connections=max_connections, ssl_keyfile=ssl_keyfile,
                           ssl_certfile=ssl_certfile,
                           allowed_origins=tuple(o.strip() for value in allowed_origins for o in value.split(",")
                                                 if o.strip()), reasoning_parser=reasoning_parser)
    cluster = _cluster_options(replicas, prefill_replicas, decode_replicas, routing, ray_address)
    if cluster is not None and pipeline_parallel > 1:
        raise InvalidParamError("--pipeline-parallel serves one engine; it does not combine with replicas",
                                "pipeline_parallel")
    if cluster is not None and allowed_media_path is not None:  # the replicas' front end takes no images
        raise InvalidParamError("--allowed-media-path is for one engine's images; replicas serve text only",
                                "allowed_media_path")
    if cluster is not None and tensor_parallel is not None and tensor_parallel > 1:
        raise InvalidParamError("--tensor-parallel serves one engine; it does not combine with replicas",
                                "tensor_parallel")
    if cluster is None:
        run_server(engine_dir, config, options)
    else:
        from kiln.runtime.cluster.launch import serve_cluster

        serve_cluster(engine_dir, config, cluster, options)


def _cluster_options(replicas: int | None, prefill: int | None, decode: int | None, routing: str,
                     ray_address: str | None) -> Any:
    """ClusterOptions when a replica option is given, else None (one engine in this process)."""
    if (prefill is None) != (decode is None):
        raise InvalidParamError("--prefill-replicas and --decode-replicas go together", "prefill_replicas")
    if prefill is not None and replicas is not None:
        raise InvalidParamError("give --replicas, or --prefill-replicas with --decode-replicas, not both", "replicas")
    if replicas is None and prefill is None:
        if ray_address is not None or routing != "prefix":
            option = "--ray-address" if ray_address is not None else "--routing"
            raise InvalidParamError(f"{option} needs --replicas (or --prefill-replicas/--decode-replicas)",
                                    option.lstrip("-").replace("-", "_"))
        return None
    from kiln.runtime.cluster.launch import ClusterOptions

    return ClusterOptions(replicas=replicas or decode or 1, prefill_replicas=prefill or 0, routing=routing,
                          ray_address=ray_address)


def _sampling(max_tokens: int | None, temperature: float, top_p: float, top_k: int, seed: int | None
              ) -> SamplingParams:
    from kiln.runtime.params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)


_sampling_options = [
    click.option("--max-tokens", type=int, default=256, show_default=True),
    click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy"),
    click.option("--top-p", type=float, default=1.0, show_default=True),
    click.option("--top-k", type=int, default=0, show_default=True, help="0 = off"),
    click.option("--seed", type=int, default=None),
]


def sampling_options(func: CommandFunction) -> CommandFunction:
    for option in reversed(_sampling_options):
        func = option(func)
    return func


@main.command()
@click.argument("engine_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("prompt", required=False)
@click.option("--chat", "chat", default=None, help="a user message, wrapped in the engine's chat template")
@click.option("--image", "images", multiple=True, type=click.Path(dir_okay=False),
              help="an image for a vision-language engine (repeat for several): before the --chat message, or one "
                   "per image token of PROMPT")
@sampling_options
@click.option("--json-schema", "json_schema", type=click.Path(exists=True, dir_okay=False), default=None,
              help="a JSON schema file the output must validate against")
@click.option("--regex", default=None, help="a regex the whole output must match")
@click.option("--choice", multiple=True, help="the output is exactly one of these (repeat the option)")
@speculative_options
def generate(engine_dir: str, prompt: str | None, chat: str | None, images: tuple[str, ...], max_tokens: int,
             temperature: float, top_p: float, top_k: int, seed: int | None, json_schema: str | None, regex: str | None,
             choice: tuple[str, ...], speculative: str | None, num_speculative_tokens: int, draft: str | None,
             min_guess_probability: float | None) -> None:
    """Generate from ENGINE_DIR for PROMPT (or --chat TEXT), streaming the text to stdout."""
    from kiln.cli.generation import PromptInput
    from kiln.cli.generation import generate as run
    from kiln.runtime.params import RuntimeConfig

    config = RuntimeConfig(speculative=_speculative(speculative, num_speculative_tokens, draft, min_guess_probability))
    params = dataclasses.replace(_sampling(max_tokens, temperature, top_p, top_k, seed),
                                 structured=_structured(json_schema, regex, choice))
    run(engine_dir, PromptInput(prompt, chat, images), params, config)


def _structured(json_schema: str | None, regex: str | None, choice: tuple[str, ...]) -> StructuredOutput | None:
    """The one output constraint given (--json-schema FILE, --regex or --choice), or None."""
    from kiln.runtime.structured import StructuredOutput

    given = [name for name, value in (("json_schema", json_schema), ("regex", regex), ("choice", choice)) if value]
    if len(given) > 1:
        raise InvalidParamError(f"give at most one of --json-schema, --regex, --choice (got {len(given)})", given[1])
    if json_schema is not None:
        return StructuredOutput.json_schema(Path(json_schema).read_text(encoding="utf-8"), "json_schema")
    if regex is not None:
        return StructuredOutput.regex(regex, "regex")
    return StructuredOutput.choice(choice, "choice") if choice else None


@main.command()
@click.argument("engine_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--system", default=None, help="a system message that starts the conversation")
@sampling_options
@speculative_options
def chat(engine_dir: str, system: str | None, max_tokens: int, temperature: float, top_p: float, top_k: int,
         seed: int | None, speculative: str | None, num_speculative_tokens: int, draft: str | None,
         min_guess_probability: float | None) -> None:
    """Chat with ENGINE_DIR interactively (history kept; /help lists the commands)."""
    from kiln.cli.generation import chat_repl
    from kiln.runtime.params import RuntimeConfig

    config = RuntimeConfig(speculative=_speculative(speculative, num_speculative_tokens, draft, min_guess_probability))
    chat_repl(engine_dir, _sampling(max_tokens, temperature, top_p, top_k, seed), system, config)


def _weight_bytes_per_token(engine_dir: Path) -> int | None:
    """What a decode step of the engine reads, counted from its graphs; None without onnx (the compile extra)."""
    try:
        from kiln.optimize.weight_bytes import weight_bytes_per_token
    except ImportError:
        return None
    return weight_bytes_per_token(engine_dir)


@main.command()
@click.argument("engine_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--num-requests", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--input-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--output-len", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--concurrency", type=click.IntRange(min=1), multiple=True,
              help="max requests in flight; repeat for several runs (default: all at once)")
@click.option("--request-rate", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Poisson arrivals per second (default: all at t=0)")
@click.option("--kv-cache-bytes", type=click.IntRange(min=1), default=None)
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=64, show_default=True)
@max_num_batched_tokens_option
@click.option("--num-threads", type=click.IntRange(min=1), default=None)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="write the report here")
@click.option("--server", "server_url", default=None, help="run the workload over HTTP against a running "
              "`kiln serve` at this URL instead (ENGINE_DIR gives the vocabulary)")
@click.option("--api-key", envvar="KILN_API_KEY", default=None, help="with --server: the server's API key "
              "(also from $KILN_API_KEY)")
@click.option("--sweep", is_flag=True, help="one run per concurrency 1, 2, 4, ... up to --num-requests")
@click.option("--plot", "plot_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="write PNG charts of the sweep here: output tok/s, TTFT and ITL against concurrency "
              "(needs kiln[plot])")
@speculative_options
@click.option("--pipeline-parallel", type=click.IntRange(min=1), default=1, show_default=True,
              help="an engine of N pipeline stages with each stage in its own Ray actor (as kiln serve)")
@click.option("--tensor-parallel", type=click.IntRange(min=1), default=None,
              help="an engine of N tensor-parallel ranks (as kiln serve); reports each rank's seconds and all-reduce "
                   "waits")
def bench(engine_dir: str, num_requests: int, input_len: int, output_len: int, concurrency: tuple[int, ...],
          request_rate: float | None, kv_cache_bytes: int | None, max_num_seqs: int, max_num_tokens: int | None,
          num_threads: int | None, json_path: str | None, server_url: str | None, api_key: str | None, sweep: bool,
          plot_dir: Path | None, speculative: str | None, num_speculative_tokens: int, draft: str | None,
          min_guess_probability: float | None, pipeline_parallel: int, tensor_parallel: int | None) -> None:
    """Offline throughput/latency of ENGINE_DIR on a synthetic workload, vs the memory-bandwidth floor."""
    from kiln.cli.charts import check_plottable, concurrency_sweep, write_bench_charts
    from kiln.runtime.bench.offline import BenchConfig, say
    from kiln.runtime.bench.offline import bench as run
    from kiln.runtime.params import RuntimeConfig

    if sweep and concurrency:
        raise InvalidParamError("give --sweep or --concurrency values, not both", "sweep")
    levels: tuple[int | None, ...] = concurrency_sweep(num_requests) if sweep else (concurrency or (None,))
    if plot_dir is not None:
        check_plottable({c or num_requests for c in levels})  # before minutes of benchmark, not after
    cfg = BenchConfig(num_requests, input_len, output_len, None, request_rate)
    spec = _speculative(speculative, num_speculative_tokens, draft, min_guess_probability)
    if server_url:
        from kiln.runtime.bench.serving import bench_server

        if spec is not None:
            raise InvalidParamError("--speculative is the server's setting (kiln serve --speculative), not the "
                                    "client's, with --server", "speculative")
        if pipeline_parallel > 1:
            raise InvalidParamError("--pipeline-parallel is the server's setting (kiln serve --pipeline-parallel), "
                                    "not the client's, with --server", "pipeline_parallel")
        report = bench_server(server_url, engine_dir, cfg, levels, json_path, api_key or None)
    else:
        config = RuntimeConfig(kv_cache_bytes=kv_cache_bytes, max_num_seqs=max_num_seqs, max_num_tokens=max_num_tokens,
                               num_threads=num_threads, enable_prefix_caching=False, speculative=spec,
                               pipeline_parallel=pipeline_parallel, tensor_parallel=tensor_parallel)
        report = run(engine_dir, cfg, levels, config, json_path, _weight_bytes_per_token(Path(engine_dir)))
    if plot_dir is not None:
        for path in write_bench_charts(report, plot_dir):
            say(f"chart written to {path}")


from kiln.cli.calibration import calibrate  # noqa: E402
from kiln.cli.evaluation import evaluate  # noqa: E402
from kiln.cli.medusa import train_medusa  # noqa: E402

main.add_command(calibrate)
main.add_command(evaluate)
main.add_command(train_medusa)
