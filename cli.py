"""The `radixlm` command.

    radixlm serve [--model-path P] [--host 127.0.0.1] [--port 30000] [--api-key K] [engine options]
    radixlm generate "The capital of France is" --max-new-tokens 32 [--chat] [--temperature T]

Imports stay inside the commands, so `radixlm --help` answers at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

# Engine options: EngineConfig field -> help. Every field of EngineConfig becomes an option; one
# missing here still gets an option, with a generic help line.
_ENGINE_HELP = {
    "model_path": "a Hugging Face model folder (config.json, *.safetensors, tokenizer) or a GGUF "
    "file; default: the embedded SmolLM2-135M-Instruct",
    "tokenizer_path": "a tokenizer folder, when it is not the model's",
    "chat_template": "the chat template in place of the tokenizer's own, as SGLang's: a Jinja "
    'file, a JSON file holding {"chat_template": ...}, or a name radixlm ships (chatml, plain)',
    "device": "cpu, cuda or cuda:N (default: cuda when available)",
    "dtype": "weights and KV dtype: auto (float32 on CPU; on GPU the checkpoint's float16, else "
    "bfloat16), float32, float16, "
    "bfloat16 (half and float: float16 and float32, as in SGLang)",
    "context_length": "the longest sequence (prompt + output) in tokens (default: the model's)",
    "mem_fraction_static": "the share of free memory given to the KV pool (default: 0.85 on GPU, "
    "0.25 on CPU)",
    "max_total_tokens": "the KV pool's size in tokens (overrides --mem-fraction-static)",
    "max_running_requests": "requests decoded together at most",
    "chunked_prefill_size": "prompt tokens computed in one step at most (long prompts are "
    "chunked; default: 8192 on GPU, 2048 on CPU; -1: no chunking)",
    "max_admission_delay": "with many decodes running, steps a waiting prompt may wait so that "
    "prompts are admitted together (0: admit at once)",
    "schedule_policy": "the order of waiting requests: lpm (longest cached prefix first) or fcfs",
    "enable_priority_scheduling": "admit waiting requests by their priority, most urgent first, "
    "and let one preempt running requests it outranks by more than "
    "--priority-scheduling-preemption-threshold (they resume later); without it a request's "
    "priority is ignored",
    "schedule_low_priority_values_first": "with --enable-priority-scheduling, a smaller priority "
    "value is more urgent (default: a larger one)",
    "priority_scheduling_preemption_threshold": "with --enable-priority-scheduling, how much more "
    "urgent a request must be than a running one to preempt it",
    "disable_radix_cache": "do not reuse the KV of shared prefixes across requests",
    "attention_backend": "auto, torch (the plain reference) or triton",
    "kv_cache_dtype": "what the KV pool stores: auto (the model's dtype) or fp8_e4m3 (float8 with "
    "per-layer scales: twice the tokens in the same memory)",
    "quantization": "weight quantization: fp8 (a bf16/fp16/fp32 checkpoint's linear layers "
    "quantized at load to float8 with a scale per output channel, activations per token: W8A8) "
    "or w4a16 (to INT4 in groups of 128, activations as they are); "
    "a quantized checkpoint (compressed-tensors FP8 or W4A16, AWQ, GPTQ) is detected from its "
    "config.json and run as stored, as its format's name does (awq, awq_marlin, gptq, "
    "gptq_marlin, compressed-tensors: SGLang's; refused for a checkpoint of another format); "
    "gguf runs a GGUF file's Q4_0/Q4_1/Q8_0/Q4_K/Q6_K blocks as stored, none (the default) "
    "dequantizes it to float",
    "random_seed": "the seed of the engine's own random choices (per-request seeds otherwise)",
    "cache_dir": "where converted models are kept (default: $RADIXLM_CACHE or ~/.cache/radixlm)",
    "load_format": "auto (the checkpoint's weights) or dummy (random weights of the config's shape, "
    "for benchmarks)",
    "cuda_graph_max_bs": "decode batches up to this size replay CUDA graphs (default: "
    "max_running_requests, at most 256)",
    "cuda_graph_max_prefill_tokens": "other steps (prompt chunks, with or without decodes) of up "
    "to this many tokens replay CUDA graphs too (0: run them eagerly)",
    "disable_cuda_graph": "run every step eagerly (no CUDA graphs)",
    "disable_overlap_schedule": "apply each step's tokens before scheduling the next (no overlap of "
    "host work with the GPU)",
    "grammar_compile_timeout": "seconds a grammar may take to compile before its request fails",
    "json_whitespace": "whitespace JSON constraints allow: compact (none) or flexible",
    "enable_jump_forward": "append text a grammar forces without decoding it token by token",
    "ebnf_recursion_depth": "outlines backend: unroll recursive EBNF rules this many levels (0: "
    "refuse recursive grammars; llguidance parses recursion as written)",
    "grammar_backend": "the grammar engine: llguidance (Earley parser, the default) or outlines "
    "(one byte DFA per grammar, recursion unrolled)",
    "json_integer_digits": "digits before the point of a JSON number whose schema sets no "
    "bounds (18: integers within 64 bits; 0: no limit)",
    "json_fraction_digits": "digits after the point of a JSON number whose schema sets no "
    "bounds (-1: no limit)",
    "json_exponent_digits": "digits of a JSON number's exponent where its schema sets no bounds "
    "(0: no exponent; -1: no limit)",
    "speculative_algorithm": "speculative decoding: NGRAM (drafts from earlier occurrences of "
    "the context's own ending), MEDUSA (heads over the model's last hidden state), STANDALONE "
    "(a smaller model of the same tokenizer, --speculative-draft-model-path), EAGLE3 (a "
    "one-layer draft over three of the model's layers, --speculative-draft-model-path) or EAGLE "
    "(an EAGLE-1/2 draft over the model's final hidden state, --speculative-draft-model-path), "
    "verified in one forward (default: off)",
    "speculative_num_draft_tokens": "positions one verify step computes: the newest token and up "
    "to this many - 1 draft tokens (default: 12 with NGRAM; with MEDUSA one more than its heads; "
    "5 with STANDALONE; 4 with EAGLE and EAGLE3; --speculative-num-steps + 1 where that is "
    "given)",
    "speculative_num_steps": "STANDALONE: the draft model's steps a round; EAGLE, EAGLE3: the draft's "
    "steps a round; MEDUSA: the heads used (SGLang's name)",
    "speculative_draft_model_path": "MEDUSA: the heads' folder, as `radixlm train-draft` writes "
    "it (default: the heads shipped for the embedded default model); STANDALONE: the draft "
    "model, a folder or a GGUF file (required); EAGLE3: the draft's folder, as `radixlm "
    "train-draft --algorithm EAGLE3` writes it (default: the draft shipped for the embedded "
    "default model); EAGLE: an EAGLE-1/2 draft's folder (required: none ships; `train-draft "
    "--algorithm EAGLE` makes one)",
    "speculative_ngram_min_match_window_size": "NGRAM: the shortest ending of the context matched "
    "(default: 1)",
    "speculative_ngram_max_match_window_size": "NGRAM: the longest ending of the context matched, "
    "tried first (default: 12)",
    "speculative_eagle_topk": "candidate paths a draft holds: 1, a chain; more, a tree verified "
    "in one step (MEDUSA: the first head's top-k; NGRAM: matches of different lengths; EAGLE, "
    "EAGLE3: the chain and the draft's next topk - 1 candidates at each depth)",
    "speculative_adaptive": "speculation only at the batch sizes where verify steps were "
    "measured to give more tokens a second than plain decode steps (--no-speculative-adaptive: "
    "at every step)",
    "tp_size": "tensor parallelism: the model split over this many processes, one a GPU (gloo "
    "on the CPU), rank 0 scheduling every step",
    "pp_size": "pipeline parallelism: the model's layers split into this many stages, one "
    "process (and GPU) each, the first scheduling every step; not with tp_size above 1 yet",
    "pp_micro_batch_min_tokens": "pipeline parallelism: a step of several requests and at "
    "least twice this many tokens goes down the stages as micro-batches (up to pp_size, and no "
    "more than its tokens / this), so that the stages overlap",
    "nnodes": "machines the tensor-parallel ranks or pipeline stages span (tp_size / nnodes or "
    "pp_size / nnodes on each)",
    "node_rank": "this machine's index among nnodes; a node other than 0 runs its ranks only "
    "(no HTTP server) until node 0's engine stops",
    "dist_init_addr": "host:port where node 0 (rank 0) meets the other ranks (default: a free "
    "loopback port; needed with nnodes > 1)",
    "dist_timeout": "seconds a tensor-parallel collective, or a rank's start, may take before "
    "the engine stops with an error",
    "disable_gc_freeze": "leave the objects alive at start in the garbage collector's full passes "
    "(by default they are frozen once the engine is ready: a pass over them stalls every request)",
    "gc_warning_threshold_secs": "log a warning when one pass of Python's garbage collector takes "
    "longer than this many seconds (0: never)",
}


# SGLang's other spellings of an engine option
_ENGINE_ALIASES = {
    "tp_size": ("--tp", "--tensor-parallel-size"),
    "pp_size": ("--pipeline-parallel-size",),
}


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    from radixlm.runtime.config import EngineConfig

    group = parser.add_argument_group("engine options")
    for f in dataclasses.fields(EngineConfig):
        flags = ["--" + f.name.replace("_", "-"), *_ENGINE_ALIASES.get(f.name, ())]
        help = _ENGINE_HELP.get(f.name, f"EngineConfig.{f.name}")
        if f.default not in (None, dataclasses.MISSING, False) and "default" not in help:
            help += f" (default: {f.default})"
        kind = _field_kind(f)
        if kind is bool and f.default is True:  # on by default: --no-... turns it off
            group.add_argument(
                *flags, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help
            )
        elif kind is bool:
            group.add_argument(*flags, dest=f.name, action="store_true", default=None, help=help)
        else:
            group.add_argument(*flags, dest=f.name, type=kind, default=None, help=help)


def _field_kind(f: dataclasses.Field) -> type:
    text = str(f.type)
    if text.startswith("bool"):
        return bool
    if text.startswith("int"):
        return int
    if text.startswith("float"):
        return float
    return str


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from radixlm.runtime.config import EngineConfig

    return {
        name: getattr(args, name)
        for name in EngineConfig.field_names()
        if getattr(args, name, None) is not None
    }


class _HelpFormatter(argparse.HelpFormatter):
    """Shows an option's default unless it is None, False, or already in the help text."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        if (
            "default" not in help
            and action.default not in (None, False, argparse.SUPPRESS)
            and action.option_strings
        ):
            help += " (default: %(default)s)"
        return help


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0-65535)")
    return port


def _tool_call_parsers() -> tuple[str, ...]:
    from radixlm.server.tool_parsers import TOOL_CALL_PARSERS

    return TOOL_CALL_PARSERS


def _reasoning_parsers() -> tuple[str, ...]:
    from radixlm.protocol.reasoning import REASONING_PARSERS

    return REASONING_PARSERS


def _add_sglang_options(parser: argparse.ArgumentParser) -> None:
    """SGLang's launch flags that radixlm takes with one meaning only, or refuses saying why."""
    group = parser.add_argument_group("SGLang compatibility")
    group.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted, no effect: radixlm runs its own model code, never a checkpoint's",
    )


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixlm",
        description="Structured generation and agent serving over a RadixAttention prefix cache.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    serve = commands.add_parser(
        "serve",
        help="serve a model over HTTP (SGLang's native API and the OpenAI API)",
        description="Serve a model over HTTP: POST /generate (SGLang's native API), "
        "/v1/completions, /v1/chat/completions, /v1/models, /metrics, /health.",
        formatter_class=_HelpFormatter,
    )
    net = serve.add_argument_group("server options")
    net.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    net.add_argument("--port", type=_port, default=30000, help="the port to listen on")
    net.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health* and /metrics "
        "(default: $RADIXLM_API_KEY, else none)",
    )
    net.add_argument(
        "--admin-api-key",
        default=None,
        help="require this key, not --api-key, on the admin routes: /flush_cache, "
        "/start_profile, /stop_profile, /abort_request (a user key gets 403 there); without it "
        "they are guarded by --api-key like the others (default: $RADIXLM_ADMIN_API_KEY, else "
        "none)",
    )
    net.add_argument(
        "--audit-log",
        default=None,
        metavar="PATH",
        help="write one JSON line per request (time, ids, a hash naming the key, endpoint, "
        "status, tokens, latency, finish reasons) to PATH, rotated at 100 MB, 5 kept; '-' for "
        "standard output",
    )
    net.add_argument(
        "--log-requests",
        action="store_true",
        help="put the request bodies and the output texts in the audit log too",
    )
    net.add_argument(
        "--served-model-name",
        default=None,
        help="the model id of the OpenAI API (default: the model's folder or file name)",
    )
    net.add_argument(
        "--log-level",
        default="info",
        type=str.lower,
        choices=["debug", "info", "warning", "error", "critical"],
        help="logging level; at info, one line per request (id, route, status, tokens in/out, "
        "cached tokens, latency)",
    )
    net.add_argument(
        "--engine-in-process",
        action="store_true",
        help="run the engine in the server's process (a thread) instead of a process of its own; "
        "the HTTP work and the engine then share one GIL",
    )
    net.add_argument(
        "--dp-size",
        "--data-parallel-size",
        dest="dp_size",
        type=int,
        default=1,
        help="data parallelism: this many engine replicas (one a GPU, or tp-size x pp-size GPUs; "
        "each its own process and radix cache) behind the one server",
    )
    net.add_argument(
        "--load-balance-method",
        default="cache_aware",
        choices=["cache_aware", "round_robin", "shortest_queue"],
        help="with --dp-size: where a request goes. cache_aware: the replica holding the "
        "longest prefix of its prompt, unless that one is far busier; else the least busy",
    )
    net.add_argument(
        "--graceful-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to let in-flight requests finish before they are aborted",
    )
    net.add_argument(
        "--tool-call-parser",
        default=None,
        choices=_tool_call_parsers(),
        help="the model's tool-call format, as SGLang names them (auto: read from the chat "
        "template; default: the server's own, <tool_call> blocks and bare JSON calls)",
    )
    net.add_argument(
        "--reasoning-parser",
        default=None,
        choices=_reasoning_parsers(),
        help="return the thinking between <think> and </think> as reasoning_content",
    )
    limits = serve.add_argument_group("limits")
    limits.add_argument(
        "--max-body-bytes", type=int, default=8 * 2**20, help="the largest request body (413 above)"
    )
    limits.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="the longest prompt in tokens (default: the model's context)",
    )
    limits.add_argument(
        "--max-new-tokens-limit",
        dest="max_new_tokens_limit",
        type=int,
        default=None,
        help="the most tokens one completion may ask for (default: the model's context)",
    )
    limits.add_argument("--max-n", type=int, default=16, help="the most completions per prompt")
    limits.add_argument(
        "--max-batch-size", type=int, default=256, help="the most prompts in one request"
    )
    limits.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="generations accepted and not finished at most; past it a 503 with Retry-After "
        "at once (default: no bound)",
    )
    limits.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds a generation may run before it is aborted (finish_reason abort, its KV "
        "freed); a request's own request_timeout may ask for less (default: none)",
    )
    limits.add_argument(
        "--rate-limit",
        type=float,
        default=None,
        help="requests per minute per API key (per client address without a key); "
        "429 with Retry-After above it (default: no limit)",
    )
    limits.add_argument(
        "--rate-limit-burst",
        type=int,
        default=None,
        help="requests allowed at once before the rate applies (default: a tenth of a minute's)",
    )
    _add_engine_options(serve)
    _add_sglang_options(serve)
    serve.set_defaults(run=_serve)

    gen = commands.add_parser(
        "generate",
        help="generate a completion for one prompt and print it",
        description="Generate a completion for one prompt, printed as it is generated.",
        formatter_class=_HelpFormatter,
    )
    gen.add_argument("prompt", help="the prompt (use '-' to read it from standard input)")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most")
    gen.add_argument(
        "--chat", action="store_true", help="send the prompt as a user message (chat template)"
    )
    gen.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)"
    )
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    _add_engine_options(gen)
    _add_sglang_options(gen)
    gen.set_defaults(run=_generate)
    _add_train_draft(commands)
    return parser


def _add_train_draft(commands) -> None:
    train = commands.add_parser(
        "train-draft",
        help="train a speculative draft (MEDUSA heads, an EAGLE or EAGLE3 draft) on the model's "
        "own outputs",
        description="Make a draft for a model: generate data with the engine (the model's "
        "greedy answers to built-in prompts, prompts it writes itself or random-token ones, "
        "under its chat template), capture "
        "its hidden states (MEDUSA: the final ones along each answer; EAGLE3: three layers' "
        "inputs at every position; EAGLE: the final ones at every position), train (MEDUSA: "
        "heads through the frozen LM head; EAGLE, EAGLE3: one decoder layer with training-time "
        "test), and write the folder "
        "--speculative-draft-model-path takes. Resumable "
        "(--resume), reproducible from --seed.",
        formatter_class=_HelpFormatter,
    )
    from radixlm.runtime.speculative.train_options import TrainDraftOptions

    d = TrainDraftOptions(output="")
    add = train.add_argument
    add("--output", required=True, help="the head folder to write (data and checkpoint too)")
    add(
        "--algorithm", default=d.algorithm,
        help="the draft kind: MEDUSA heads, an EAGLE3 draft (one decoder layer over three of "
        "the model's hidden states) or an EAGLE one (EAGLE-1/2: one layer over the final "
        "hidden state, drafting through the model's LM head)",
    )  # fmt: skip
    add(
        "--num-heads", type=int, default=d.num_heads,
        help="heads (MEDUSA), or the depth trained (EAGLE, EAGLE3): tokens a chain drafts",
    )  # fmt: skip
    add("--num-layers", type=int, default=d.num_layers, help="residual blocks per head (MEDUSA)")
    add("--num-prompts", type=int, default=d.num_prompts, help="conversations generated")
    add(
        "--random-prompt-fraction", type=float, default=d.random_prompt_fraction,
        help="the share of prompts made of random tokens (the rest: built-in instructions)",
    )  # fmt: skip
    add(
        "--model-prompt-fraction", type=float, default=d.model_prompt_fraction,
        help="the share of prompts the model writes itself (asked, with sampling, for a "
        "question or task about a built-in subject): more varied than the built-in ones",
    )  # fmt: skip
    add(
        "--prompts-file", default=None,
        help="user messages the model answers for the data instead of the built-in ones: JSON "
        "Lines (\"prompt\"/\"text\"/\"content\", or the first user turn of \"messages\" or "
        "ShareGPT \"conversations\") or text, one a line; up to --num-prompts, a seeded sample",
    )  # fmt: skip
    add("--max-new-tokens", type=int, default=d.max_new_tokens, help="each answer's length")
    add(
        "--held-out-fraction", type=float, default=d.held_out_fraction,
        help="conversations kept out of training for the held-out accuracy",
    )  # fmt: skip
    add("--epochs", type=float, default=d.epochs, help="passes over the training positions")
    add("--steps", type=int, default=None, help="optimizer steps (default: from --epochs)")
    add("--batch-size", type=int, default=d.batch_size, help="answer positions a step")
    add("--lr", type=float, default=d.lr, help="peak learning rate (AdamW)")
    add("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay")
    add("--head-decay", type=float, default=d.head_decay, help="head i's loss weight: this**i")
    add(
        "--draft-vocab-size", type=int, default=None,
        help="EAGLE3: the draft drafts only the this many tokens most frequent in the answers "
        "(a smaller LM head, read at every draft step; default: the whole vocabulary)",
    )  # fmt: skip
    add(
        "--save-dtype", default=d.save_dtype, choices=["float32", "bfloat16", "float16"],
        help="the written weights' dtype (bfloat16: half the bytes, for a draft to ship)",
    )  # fmt: skip
    add(
        "--intermediate-size", type=int, default=None,
        help="EAGLE, EAGLE3: the draft layer's MLP width (default: the model's)",
    )  # fmt: skip
    add("--seed", type=int, default=d.seed, help="seeds the prompts, the order and the init")
    add("--resume", action="store_true", help="continue from the checkpoint in --output")
    add("--save-every", type=int, default=d.save_every, help="steps between checkpoints")
    add("--log-every", type=int, default=d.log_every, help="steps between log entries")
    _add_engine_options(train)
    train.set_defaults(run=_train_draft)


def _train_draft(args: argparse.Namespace) -> int:
    from radixlm.runtime.speculative.train_options import TrainDraftOptions
    from radixlm.runtime.speculative.training import train_draft

    names = [f.name for f in dataclasses.fields(TrainDraftOptions)]
    opts = TrainDraftOptions(**{name: getattr(args, name) for name in names})
    opts.check()  # (before the model loads)
    train_draft(opts, _engine_kwargs(args), say=lambda text: print(text, file=sys.stderr))
    return 0


def _check_address(host: str, port: int) -> None:
    """Bind the address the server will listen on, and let it go: a busy port or an unknown host
    is refused at once, not after the model has loaded. (As uvicorn binds: SO_REUSEADDR, so a
    port left in TIME_WAIT by a server that just stopped is not refused.)"""
    import errno
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as e:
        where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        if e.errno == errno.EADDRINUSE:
            why = f"port {port} is in use on {host} (another server?)"
        elif e.errno == errno.EACCES:
            why = f"no permission to listen on port {port}"
        elif isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:
            raise ValueError(
                f"cannot listen on {where}: {host!r} is not an address of this machine; "
                'pick another with --host (make serve ARGS="--host 127.0.0.1")'
            ) from e
        else:
            why = e.strerror or str(e)
        raise ValueError(
            f"cannot listen on {where}: {why}; pick another port with --port "
            f'(make serve ARGS="--port {port + 1 if 0 < port < 65535 else 30001}")'
        ) from e


def _serve(args: argparse.Namespace) -> int:
    if (args.node_rank or 0) > 0:  # another node's ranks: no server of its own
        return _serve_node(args)
    _check_address(args.host, args.port)  # before the model loads: a busy port fails at once
    import logging

    from radixlm.runtime import startup

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    startup.say("loading the server and the engine (torch)")

    import uvicorn

    from radixlm.server.app import create_app
    from radixlm.server.state import ServerLimits

    limits = ServerLimits(
        max_body_bytes=args.max_body_bytes,
        max_prompt_tokens=args.max_prompt_tokens,
        max_new_tokens=args.max_new_tokens_limit,
        max_n=args.max_n,
        max_batch_size=args.max_batch_size,
        rate_limit_per_minute=args.rate_limit,
        rate_limit_burst=args.rate_limit_burst,
        max_queued_requests=args.max_queued_requests,
        request_timeout=args.request_timeout,
    )
    if args.log_requests and args.audit_log is None:
        raise ValueError("--log-requests writes into the audit log: give --audit-log PATH too")
    engine = _start_engine(args)
    try:
        app = create_app(
            engine,
            api_key=args.api_key or os.environ.get("RADIXLM_API_KEY") or None,
            served_model_name=args.served_model_name,
            limits=limits,
            owns_engine=True,
            server_info={"host": args.host, "port": args.port},
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            admin_api_key=args.admin_api_key or os.environ.get("RADIXLM_ADMIN_API_KEY") or None,
            audit_log=args.audit_log,
            log_requests=args.log_requests,
        )
        # uvicorn handles SIGTERM/SIGINT: it stops accepting, lets in-flight requests finish for
        # the graceful timeout (then cancels them, which aborts their generations), and runs the
        # app's shutdown, which stops the engine. Its access log is off: the app logs each request
        # itself.
        uvicorn.run(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            access_log=False,
            timeout_graceful_shutdown=args.graceful_timeout,
        )
    finally:
        # Whatever ended the server (uvicorn failing to start, too), the engine stops with it: its
        # process ignores SIGINT/SIGTERM and would wait on the channel forever. A second shutdown,
        # after the app's, does nothing.
        engine.shutdown()
    return 0


def _serve_node(args: argparse.Namespace) -> int:
    """Node `--node-rank` (> 0) of a tensor-parallel group: its ranks, until rank 0 stops."""
    from radixlm.runtime.config import EngineConfig
    from radixlm.runtime.tp_worker import rank_name, run_node

    config = EngineConfig.from_kwargs(**_engine_kwargs(args))
    print(
        f"radixlm serve: node {config.node_rank} of {config.nnodes}: running its "
        f"{rank_name(config)}s for node 0 at {config.dist_init_addr}",
        file=sys.stderr,
    )
    return run_node(config)


class _EngineStartFailed(Exception):
    """The engine process failed to start; its own log has already said why in full."""


def _start_engine(args: argparse.Namespace) -> Any:
    """The engine `radixlm serve` runs: a `radixlm.Engine` in this process, or its process."""
    import radixlm

    if args.dp_size != 1:
        return _start_replicas(args)
    if args.engine_in_process:
        return radixlm.Engine(**_engine_kwargs(args))
    from radixlm.server.engine_process import EngineProcessBackend

    try:
        return EngineProcessBackend(_engine_kwargs(args), log_level=args.log_level)
    except RuntimeError as e:
        raise _EngineStartFailed(str(e)) from e


def _start_replicas(args: argparse.Namespace) -> Any:
    """--dp-size N: N engine processes, started side by side, GPU i for replica i (its ranks
    from GPU i x tp_size x pp_size onwards under tensor or pipeline parallelism; all on the CPU
    where there is no GPU), behind one DataParallelBackend."""
    from concurrent.futures import ThreadPoolExecutor

    from radixlm.server.data_parallel import DataParallelBackend
    from radixlm.server.engine_process import EngineProcessBackend

    n = args.dp_size
    kwargs = _engine_kwargs(args)
    if n < 1:
        raise ValueError(f"--dp-size {n}; it must be at least 1")
    if args.engine_in_process:
        raise ValueError(
            "--dp-size runs each replica in a process of its own: drop --engine-in-process"
        )
    per_replica = kwargs.get("tp_size", 1) * kwargs.get("pp_size", 1)
    if per_replica > 1 and (kwargs.get("nnodes", 1) != 1 or kwargs.get("dist_init_addr")):
        raise ValueError(
            "--dp-size with --nnodes or --dist-init-addr is not supported yet: the replicas run "
            "on this machine, each its ranks' rendezvous on a free loopback port"
        )
    devices = _replica_devices(n, kwargs.get("device"), per_replica)
    # (each start loads a tokenizer in this process: resolve transformers' lazy names first, as
    # two threads resolving one at once can fail)
    from transformers import AutoTokenizer  # noqa: F401

    with ThreadPoolExecutor(n) as pool:
        starts = [
            pool.submit(EngineProcessBackend, {**kwargs, "device": d}, log_level=args.log_level)
            for d in devices
        ]
    replicas, failure = [], None
    for start in starts:
        try:
            replicas.append(start.result())
        except Exception as e:  # (the others are stopped: none is left running)
            failure = failure or e
    if failure is not None:
        for replica in replicas:
            replica.shutdown()
        if isinstance(failure, RuntimeError):
            raise _EngineStartFailed(str(failure)) from failure
        raise failure
    return DataParallelBackend(replicas, load_balance_method=args.load_balance_method)


def _replica_devices(n: int, device: str | None, per_replica: int = 1) -> list[str]:
    """The device of each of n replicas' first rank: on a machine with n x `per_replica` GPUs
    (its tensor-parallel ranks times pipeline stages), replica i's ranks on GPUs i x per_replica
    onwards; the CPU for all where there is none or the CPU is asked for."""
    if device == "cpu":
        return ["cpu"] * n
    import torch

    count = torch.cuda.device_count()
    if device not in (None, "cuda"):
        raise ValueError(f"--dp-size {n} places replica i on GPU i: drop --device {device}")
    if count == 0:
        if device == "cuda":
            raise ValueError("--device cuda: no CUDA device here")
        return ["cpu"] * n
    need = n * per_replica
    if count < need:
        each = "one a replica" if per_replica == 1 else f"{per_replica} a replica"
        raise ValueError(f"--dp-size {n} needs {need} GPUs, {each}; this machine has {count}")
    return [f"cuda:{i * per_replica}" for i in range(n)]


def _generate(args: argparse.Namespace) -> int:
    import radixlm

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    params = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
    }
    if args.seed is not None:
        params["seed"] = args.seed
    from radixlm.runtime import startup

    startup.say("loading the engine (torch)")
    with radixlm.Engine(**_engine_kwargs(args)) as engine:
        if args.chat:
            prompt = engine.apply_chat_template([{"role": "user", "content": prompt}])
        shown = 0
        for snapshot in engine.generate(prompt, params, stream=True):
            text = snapshot["text"]
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = max(shown, len(text))
        sys.stdout.write("\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except ValueError as e:  # bad options (EngineConfig, limits, prompt): say what, not a trace
        print(f"radixlm {args.command}: error: {e}", file=sys.stderr)
        return 2
    except _EngineStartFailed as e:
        print(f"radixlm {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
