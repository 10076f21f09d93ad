"""The kiln command line: one click group; each command is one call into its package."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from kiln.contract import KV_DTYPES
from kiln.errors import KilnError

if TYPE_CHECKING:
    from kiln.runtime.params import SamplingParams

CommandFunction = TypeVar("CommandFunction", bound=Callable[..., Any])


class _Group(click.Group):
    """Prints a KilnError (bad option, broken engine dir, unusable model or artifact) as one line;
    anything else is a bug and keeps its traceback, as KILN_DEBUG=1 keeps every one."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KilnError as exc:
            if os.environ.get("KILN_DEBUG"):
                raise
            raise click.ClickException(str(exc)) from exc


@click.group(cls=_Group)
@click.version_option(package_name="kiln")
def main() -> None:
    """kiln: an ahead-of-time LLM compiler and a thin serving runtime."""


@main.command()
@click.argument("model")
@click.option("-o", "--output", "output", required=True, type=click.Path(path_type=Path),
              help="engine directory to write")
@click.option("--kv-dtype", type=click.Choice(list(KV_DTYPES)), default="float32", show_default=True,
              help="KV-cache element type; int8 takes per-head scales from --calibration")
@click.option("--block-size", type=int, default=16, show_default=True, help="tokens per KV-cache block")
@click.option("--max-seq-len", type=int, default=2048, show_default=True)
@click.option("--quantization", default="none", show_default=True,
              help="none | int8-weight-only | int4-rtn-g{32,64,128} | int4-awq-g{32,64,128} | int4-q4_1 | "
                   "w8a8-smoothquant")
@click.option("--calibration", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="artifact of `kiln calibrate` (needed by int4-awq-*, w8a8-smoothquant and --kv-dtype int8)")
@click.option("--lm-head", type=click.Choice(["int8", "int4"]), default="int8", show_default=True,
              help="the tied LM head's weights under an int4 quantization (int8 keeps more of fp32's perplexity)")
@click.option("--medusa", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="heads of `kiln train-medusa`: the graph also returns their logits (medusa_logits)")
def build(model: str, output: Path, kv_dtype: str, block_size: int, max_seq_len: int, quantization: str,
          calibration: Path | None, lm_head: str, medusa: Path | None) -> None:
    """Compile MODEL (an HF checkpoint dir, a .gguf file, or `default` for SmolLM2) into an engine dir."""
    from kiln.manifest import BuildOptions
    from kiln.optimize.build import build_engine
    from kiln.quant_scheme import LmHead, QuantScheme

    options = BuildOptions(quantization=QuantScheme.parse(quantization), kv_dtype=kv_dtype, block_size=block_size,
                           max_seq_len=max_seq_len, calibration=calibration, lm_head=LmHead.parse(lm_head),
                           medusa=medusa)
    build_engine(model, output, options)


@main.command()
@click.argument("engine_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--max-queue", type=int, default=None,
              help="waiting requests before 503 + Retry-After (default: unbounded)")
@click.option("--kv-cache-bytes", type=int, default=None, help="KV pool size (default: a fraction of memory)")
@click.option("--max-num-seqs", type=int, default=64, show_default=True, help="sequences batched per step")
@click.option("--served-model-name", default=None, help="model name clients use (default: the engine's)")
def serve(engine_dir: Path, host: str, port: int, max_queue: int | None, kv_cache_bytes: int | None,
          max_num_seqs: int, served_model_name: str | None) -> None:
    """Serve ENGINE_DIR over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)."""
    from kiln.runtime.params import RuntimeConfig
    from kiln.runtime.server.app import ServeOptions
    from kiln.runtime.server.app import serve as run_server

    run_server(engine_dir, RuntimeConfig(kv_cache_bytes=kv_cache_bytes, max_num_seqs=max_num_seqs),
               ServeOptions(host=host, port=port, served_model_name=served_model_name, max_queue=max_queue))


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
@sampling_options
def generate(engine_dir: str, prompt: str | None, chat: str | None, max_tokens: int, temperature: float,
             top_p: float, top_k: int, seed: int | None) -> None:
    """Generate from ENGINE_DIR for PROMPT (or --chat TEXT), streaming the text to stdout."""
    from kiln.cli.generation import generate as run

    run(engine_dir, prompt, chat, _sampling(max_tokens, temperature, top_p, top_k, seed))


@main.command()
@click.argument("engine_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--system", default=None, help="a system message that starts the conversation")
@sampling_options
def chat(engine_dir: str, system: str | None, max_tokens: int, temperature: float, top_p: float, top_k: int,
         seed: int | None) -> None:
    """Chat with ENGINE_DIR interactively (history kept; /reset, /exit)."""
    from kiln.cli.generation import chat_repl

    chat_repl(engine_dir, _sampling(max_tokens, temperature, top_p, top_k, seed), system)


@main.command()
@click.argument("engine_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--num-requests", type=int, default=32, show_default=True)
@click.option("--input-len", type=int, default=128, show_default=True)
@click.option("--output-len", type=int, default=64, show_default=True)
@click.option("--concurrency", type=int, multiple=True, help="max requests in flight; repeat for several runs "
              "(default: all at once)")
@click.option("--request-rate", type=float, default=None, help="Poisson arrivals per second (default: all at t=0)")
@click.option("--kv-cache-bytes", type=int, default=None)
@click.option("--max-num-seqs", type=int, default=64, show_default=True)
@click.option("--num-threads", type=int, default=None)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="write the report here")
@click.option("--server", "server_url", default=None, help="run the workload over HTTP against a running "
              "`kiln serve` at this URL instead (ENGINE_DIR gives the vocabulary)")
def bench(engine_dir: str, num_requests: int, input_len: int, output_len: int, concurrency: tuple[int, ...],
          request_rate: float | None, kv_cache_bytes: int | None, max_num_seqs: int, num_threads: int | None,
          json_path: str | None, server_url: str | None) -> None:
    """Offline throughput/latency of ENGINE_DIR on a synthetic workload, vs the memory-bandwidth floor."""
    from kiln.runtime.bench.offline import BenchConfig
    from kiln.runtime.bench.offline import bench as run
    from kiln.runtime.params import RuntimeConfig

    if server_url:
        from kiln.runtime.bench.serving import bench_server

        bench_server(server_url, engine_dir, BenchConfig(num_requests, input_len, output_len, None, request_rate),
                     concurrency or (None,), json_path)
        return
    run(engine_dir, BenchConfig(num_requests, input_len, output_len, None, request_rate), concurrency or (None,),
        RuntimeConfig(kv_cache_bytes=kv_cache_bytes, max_num_seqs=max_num_seqs, num_threads=num_threads,
                      enable_prefix_caching=False), json_path)


from kiln.cli.calibration import calibrate, evaluate  # noqa: E402
from kiln.cli.medusa import train_medusa  # noqa: E402

main.add_command(calibrate)
main.add_command(evaluate)
main.add_command(train_medusa)
