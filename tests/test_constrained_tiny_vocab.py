"""The grammar machinery step by step over a hand-built vocabulary of a few tokens."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from radixlm.constrained import (
    GRAMMAR_BACKENDS,
    GrammarCompiler,
    GrammarError,
    TokenVocabulary,
    allocate_token_bitmask,
    apply_token_bitmask_,
    bitmask_from_ids,
    ids_from_bitmask,
)
from radixlm.constrained.dfa_process import (
    Deadline,
    DfaBuilders,
    DfaRefused,
    RawDfa,
    TooManyStates,
    build_dfa,
)

TOKENS = [
    "<eos>",
    "a",
    "b",
    "c",
    "ab",
    "abc",
    "{",
    "}",
    '"',
    ":",
    ",",
    "1",
    "2",
    "12",
    "x",
    "y",
    " ",
    "-",
    '{"',
    '":',
    "\\",
]
EOS = 0
VOCAB = {t: i for i, t in enumerate(TOKENS)}


class FakeTokenizer:
    """The slice of a Hugging Face tokenizer the grammar compiler reads."""

    eos_token_id = EOS
    all_special_ids = [EOS]

    def get_vocab(self) -> dict[str, int]:
        return dict(VOCAB)


def ids(*tokens: str) -> list[int]:
    return [VOCAB[t] for t in tokens]


def texts(token_ids: list[int]) -> set[str]:
    return {TOKENS[i] for i in token_ids}


@pytest.fixture(scope="module", params=GRAMMAR_BACKENDS)
def compiler(request) -> GrammarCompiler:
    """Each backend in turn: what a user sees is the same on both. (Tests of what only the DFA
    backend has build their own `backend="outlines"` compiler.)"""
    # logits wider than the tokenizer: the extra ids must never be allowed
    return GrammarCompiler(
        FakeTokenizer(), vocab_size=40, compile_timeout=10, backend=request.param
    )


def outlines(**options) -> GrammarCompiler:
    """The DFA backend's compiler, for what only it has (its automaton, helper processes, max
    states, recursion unrolled to a depth)."""
    options = {"tokenizer": FakeTokenizer(), "vocab_size": 40, **options}
    return GrammarCompiler(backend="outlines", **options)


def where(matcher) -> tuple[tuple[int, ...], bool, int]:
    """What a user can see of where a matcher stands."""
    return tuple(matcher.allowed_token_ids()), matcher.is_accepting(), matcher.rollback_depth


def test_vocabulary_reads_the_tokenizer():
    v = TokenVocabulary.from_tokenizer(FakeTokenizer(), vocab_size=40)
    assert v.size == 40
    assert v.eos_token_ids == (EOS,)
    assert v.token_bytes[VOCAB["ab"]] == b"ab"
    assert v.token_bytes[EOS] is None and v.token_bytes[39] is None


def test_regex_walk_allows_exactly_the_continuations(compiler):
    matcher = compiler.compile("regex", "ab?c").matcher()
    # start: "a" and every token that is a prefix-consistent spelling
    assert texts(matcher.allowed_token_ids()) == {"a", "ab", "abc"}
    assert not matcher.accept_token(VOCAB["b"])  # refused, state unchanged
    assert texts(matcher.allowed_token_ids()) == {"a", "ab", "abc"}
    assert matcher.accept_token(VOCAB["a"])
    assert texts(matcher.allowed_token_ids()) == {"b", "c"}  # no EOS: not accepting yet
    assert not matcher.is_accepting()
    assert matcher.accept_token(VOCAB["c"])
    assert matcher.allowed_token_ids() == [EOS]  # only EOS once complete
    assert matcher.is_terminated()  # complete and nothing but EOS can follow
    assert matcher.accept_token(EOS)
    assert not matcher.accept_token(VOCAB["a"])


def test_eos_only_in_accepting_states(compiler):
    matcher = compiler.compile("regex", "12?").matcher()
    assert not matcher.accept_token(EOS)
    assert matcher.accept_token(VOCAB["1"])
    assert set(matcher.allowed_token_ids()) == {EOS, VOCAB["2"]}
    assert matcher.is_accepting() and not matcher.is_terminated()
    assert matcher.accept_token(EOS)
    assert matcher.is_terminated()


def test_bitmask_row_matches_the_allowed_ids(compiler):
    matcher = compiler.compile("regex", "(x|y)+").matcher()
    bitmask = allocate_token_bitmask(2, compiler.vocab_size)
    assert bitmask.shape == (2, 2) and bitmask.dtype == torch.int32
    assert (bitmask == -1).all()
    matcher.fill_next_token_bitmask(bitmask[1])
    assert ids_from_bitmask(bitmask[1]) == sorted(ids("x", "y"))
    assert (bitmask[0] == -1).all()  # other rows untouched
    matcher.fill_next_token_bitmask(bitmask, index=0)
    assert torch.equal(bitmask[0], bitmask[1])
    assert (bitmask[1].numpy() == bitmask_from_ids(ids("x", "y"), 40)).all()


def test_apply_token_bitmask_matches_the_naive_loop():
    torch.manual_seed(0)
    vocab = 70
    logits = torch.randn(3, vocab)
    allowed = [[0, 5, 31, 32, 69], [], list(range(vocab))]
    bitmask = allocate_token_bitmask(3, vocab)
    for row, a in enumerate(allowed):
        bitmask[row] = torch.from_numpy(bitmask_from_ids(a, vocab))
    expected = logits.clone()
    for row, a in enumerate(allowed):
        for t in range(vocab):
            if t not in a:
                expected[row, t] = float("-inf")
    apply_token_bitmask_(logits, bitmask)
    assert torch.equal(logits, expected)


def test_apply_token_bitmask_rejects_bad_shapes():
    with pytest.raises(ValueError):
        apply_token_bitmask_(torch.zeros(2, 40), allocate_token_bitmask(3, 40))
    with pytest.raises(ValueError):
        apply_token_bitmask_(torch.zeros(2, 40), allocate_token_bitmask(2, 40).to(torch.int64))


def test_jump_forward_returns_only_forced_text(compiler):
    matcher = compiler.compile("regex", r'\{"ab":(1|2)\}').matcher()
    assert matcher.jump_forward_string() == '{"ab":'
    assert matcher.accept_string('{"ab":')
    assert matcher.jump_forward_string() is None  # 1 or 2: a real choice
    assert matcher.accept_token(VOCAB["2"])
    assert matcher.jump_forward_string() == "}"
    assert matcher.accept_string("}")
    assert matcher.jump_forward_string() is None  # accepting: ending is a choice too
    assert matcher.accept_token(EOS)


def test_jump_forward_stops_where_the_grammar_may_end(compiler):
    matcher = compiler.compile("regex", "abc(ab)?").matcher()
    assert matcher.jump_forward_string() == "abc"
    assert matcher.accept_string("abc")
    assert matcher.jump_forward_string() is None


def test_accept_string_is_all_or_nothing(compiler):
    matcher = compiler.compile("regex", "abcx").matcher()
    before = where(matcher)
    assert not matcher.accept_string("abcy")
    assert where(matcher) == before
    assert matcher.accept_string("abcx")
    assert matcher.accept_token(EOS)


def test_accept_string_refuses_text_off_the_grammar_or_the_vocabulary(compiler):
    matcher = compiler.compile("regex", "a[bz]c").matcher()
    before = where(matcher)
    assert not matcher.accept_string("azd")  # "z" is allowed, "d" no token spells
    assert where(matcher) == before
    assert matcher.accept_string("abc") and matcher.accept_token(EOS)


def test_rollback_restores_states(compiler):
    matcher = compiler.compile("regex", "a(b|c)12").matcher()
    states = [where(matcher)]
    for t in ["a", "c", "1"]:
        assert matcher.accept_token(VOCAB[t])
        states.append(where(matcher))
    matcher.rollback(2)
    assert where(matcher) == states[1]
    assert texts(matcher.allowed_token_ids()) == {"b", "c"}
    with pytest.raises(GrammarError):
        matcher.rollback(5)
    assert matcher.accept_token(VOCAB["b"]) and matcher.accept_token(VOCAB["12"])
    assert matcher.accept_token(EOS)
    matcher.rollback(1)  # undo EOS: it can be accepted again
    assert matcher.is_accepting() and matcher.accept_token(EOS)


def test_choice_and_ebnf(compiler):
    m = compiler.compile("choice", ["abc", "xy"]).matcher()
    assert texts(m.allowed_token_ids()) == {"a", "ab", "abc", "x"}
    ebnf = 'root ::= item ("," item)*\nitem ::= "a" | num  # a comment\nnum ::= [12]+'
    m = compiler.compile("ebnf", ebnf).matcher()
    assert m.accept_string("a,12,1")
    assert m.accept_token(EOS)


def test_recursive_ebnf_is_refused_clearly():
    compiler = outlines()
    with pytest.raises(
        GrammarError, match="recursive.*not supported.*regex or a json_schema.*ebnf_recursion_depth"
    ):
        compiler.compile("ebnf", 'root ::= "{" root "}" | "x"')
    with pytest.raises(GrammarError, match="never defined"):
        compiler.compile("ebnf", "root ::= missing")


def test_recursive_ebnf_unrolled_to_the_configured_depth():
    compiler = outlines(ebnf_recursion_depth=2)
    grammar = compiler.compile("ebnf", 'root ::= "{" root "}" | "x"')
    for text in ["x", "{x}", "{{x}}"]:
        m = grammar.matcher()
        assert m.accept_string(text) and m.accept_token(EOS), text
    m = grammar.matcher()
    assert m.accept_string("{{") and texts(m.allowed_token_ids()) == {"x"}  # no third level
    assert not m.accept_string("{")
    with pytest.raises(GrammarError, match="at most 2 levels deep"):
        compiler.compile("ebnf", 'root ::= "(" root ")"')  # no way out of the recursion
    # the same in parentheses: the level past the depth matches nothing, not the empty string
    grouped = compiler.compile("ebnf", 'root ::= "{" ( root ) "}" | "x"')
    for text, ok in [("{{x}}", True), ("{{{}}}", False), ("{{}}", False)]:
        m = grouped.matcher()
        assert (m.accept_string(text) and m.accept_token(EOS)) == ok, text


def test_errors_are_grammar_errors(compiler):
    with pytest.raises(GrammarError, match="invalid regex"):
        compiler.compile("regex", "(a")
    with pytest.raises(GrammarError, match="unknown grammar kind"):
        compiler.compile("yaml", "a: b")
    with pytest.raises(GrammarError, match="not valid JSON"):
        compiler.compile("json_schema", "{")
    future = compiler.compile_async("regex", "(b")
    with pytest.raises(GrammarError):
        future.result(timeout=10)


def test_compile_is_cached_and_async(compiler):
    g1 = compiler.compile("regex", "x+y")
    assert compiler.compile("regex", "x+y") is g1
    fut = compiler.compile_async("regex", "y+x")
    g2 = fut.result(timeout=10)
    assert compiler.compile("regex", "y+x") is g2
    m = g2.matcher()
    assert m.accept_string("yyx") and m.accept_token(EOS)


def test_a_vocabulary_without_usable_tokens_is_a_grammar_error():
    # the EOS token and one spelling plane 16 (which the DFA backend never generates: its
    # automaton ends every match with U+10FFFF): nothing a grammar could allow
    compiler = outlines(
        tokenizer=TokenVocabulary([None, "\U00100000".encode()], [0]), vocab_size=None
    )
    with pytest.raises(GrammarError, match="no usable tokens"):
        compiler.compile("regex", "a")
    with pytest.raises(GrammarError, match="no usable tokens"):  # llguidance, at once
        GrammarCompiler(TokenVocabulary([None, None], [0])).compile("regex", "a")
    # llguidance generates plane 16 like any other plane
    grammar = GrammarCompiler(TokenVocabulary([None, "\U00100000".encode()], [0])).compile(
        "regex", "\U00100000+"
    )
    assert grammar.matcher().allowed_token_ids() == [1]


def test_a_grammar_that_fails_midway_allows_nothing_not_eos(compiler):
    """No token can follow "ab" (no token spells "z"): the mask is empty, so the engine fails the
    request ("cannot go on") instead of ending it as if it were complete."""
    matcher = compiler.compile("regex", "abz").matcher()
    assert matcher.accept_token(VOCAB["ab"])
    assert matcher.allowed_token_ids() == []
    assert not matcher.is_accepting() and not matcher.is_terminated()
    assert not matcher.accept_token(EOS)
    row = allocate_token_bitmask(1, compiler.vocab_size)[0]
    matcher.fill_next_token_bitmask(row)
    assert not row.any()


def test_lenient_validation_reports_outputs_cut_short(compiler):
    grammar = compiler.compile("json_schema", {"enum": [12, 21]}, lenient=True)
    assert grammar.lenient and grammar.notes == ()  # nothing had to be skipped
    assert grammar.validate_output("12") == {"valid": True, "error": None, "ignored_keywords": []}
    report = grammar.validate_output("1")
    assert report["valid"] is False and "is not one of" in report["error"]


def test_lenient_validation_skips_jsonschema_only_for_whole_matches(monkeypatch):
    compiler = outlines()
    grammar = compiler.compile("json_schema", {"enum": [12, 21]}, lenient=True)
    assert grammar.lenient and grammar.notes == ()  # nothing had to be skipped
    with monkeypatch.context() as m:
        m.setattr("radixlm.constrained.json_schema.schema_validator", _no_validator)
        assert grammar.validate_output("12") == {
            "valid": True,
            "error": None,
            "ignored_keywords": [],
        }
    # an output cut short (here by max_new_tokens) is checked: valid JSON, not valid for the schema
    report = grammar.validate_output("1")
    assert report["valid"] is False and "is not one of" in report["error"]
    assert not compiler.compile("json_schema", {"enum": [12, 21]}).lenient


def _no_validator(schema):
    raise AssertionError("jsonschema ran for an output the automaton had already checked")


def test_compile_timeout_is_a_grammar_error():
    slow = outlines(compile_timeout=0.05)
    start = time.perf_counter()
    with pytest.raises(GrammarError, match="took longer than"):
        slow.compile("regex", runaway("a", 22))  # a DFA of 2**23 states
    assert time.perf_counter() - start < 5


def test_compile_timeouts_fail_late_futures_in_their_order_and_leave_done_ones():
    """One thread fails every waiting compile at its own deadline: a later-added, earlier
    deadline is not held up behind a later one; a future done in time keeps its result; and
    submitting many compiles starts no thread per compile."""
    from concurrent.futures import Future

    from radixlm.constrained.compiler import _TIMEOUTS

    now = time.monotonic()
    late, soon, done = Future(), Future(), Future()
    _TIMEOUTS.add(now + 30, late, GrammarError("late"))
    _TIMEOUTS.add(now + 0.05, soon, GrammarError("soon"))
    _TIMEOUTS.add(now + 0.05, done, GrammarError("done"))
    done.set_result("kept")
    with pytest.raises(GrammarError, match="soon"):
        soon.result(timeout=5)
    assert time.monotonic() - now < 5 and not late.done() and done.result() == "kept"
    late.set_result(None)
    threads = threading.active_count()
    many = [Future() for _ in range(300)]
    for f in many:
        _TIMEOUTS.add(time.monotonic() + 30, f, GrammarError("never"))
        f.set_result(None)
    assert threading.active_count() <= threads + 1
    assert len(_TIMEOUTS._due) < 300  # (done ones dropped, not held until their time)


def test_a_long_bounded_json_string_compiles_at_once_and_exactly(compiler):
    """A JSON string's maxLength: its escapes can hold its own quote, which made outlines-core's
    build of the unanchored DFA exponential in the bound (20: 76 s) until every regex got a start
    mark. Exact still: 40 characters, escapes counting one each, and not 41."""
    start = time.perf_counter()
    grammar = compiler.compile("json_schema", {"type": "string", "maxLength": 40})
    assert time.perf_counter() - start < 2
    for text, ok in (
        ('"' + "a" * 40 + '"', True),
        ('"' + '\\"' * 40 + '"', True),
        ('"' + "a" * 41 + '"', False),
        ('"' + '\\"' * 41 + '"', False),
    ):
        matcher = grammar.matcher()
        assert (matcher.accept_string(text) and matcher.is_accepting()) is ok, text


# A counted repetition after an open-ended one: the DFA has 2**(n+1) states, and building it takes
# about 4x longer for every 2 more (n = 20: several seconds past any deadline these tests set).
def runaway(letter: str, n: int = 20) -> str:
    return f"[ab]*{letter}[ab]{{{n}}}"


def test_a_build_past_its_deadline_gives_its_worker_back():
    compiler = outlines(compile_timeout=1, max_workers=2)
    stuck = [compiler.compile_async("regex", runaway(letter)) for letter in "ab"]  # both workers
    for future in stuck:
        with pytest.raises(GrammarError, match="took longer than 1 s; bound its repetitions"):
            future.result()
    start = time.perf_counter()
    assert compiler.compile("regex", "ab?c").matcher().accept_string("abc")
    assert time.perf_counter() - start < 1  # not queued behind the runaway builds


def test_a_dfa_past_max_states_is_refused_with_what_to_simplify():
    compiler = outlines(max_states=1000)
    start = time.perf_counter()
    with pytest.raises(GrammarError, match="regex needs more than 1,000 automaton states; bound"):
        compiler.compile("regex", runaway("a", 12))
    with pytest.raises(GrammarError, match="json_schema needs more than 1,000 automaton states"):
        compiler.compile("json_schema", {"type": "string", "pattern": "^[ab]*a[ab]{12}$"})
    assert time.perf_counter() - start < 5
    assert compiler.compile("regex", runaway("a", 6)).matcher().accept_string("aabababa")


def test_a_grammar_that_ran_out_of_time_is_not_remembered_as_refused():
    compiler = outlines(compile_timeout=0.05)
    with pytest.raises(GrammarError, match="took longer than"):
        compiler.compile("regex", runaway("a", 14))  # ~0.3 s
    compiler.compile_timeout = 60  # as if the machine were less busy now
    assert compiler.compile("regex", runaway("a", 14)).automaton.n_states > 2**15


def test_a_deadline_moves_later_only_until_it_has_passed():
    deadline = Deadline(time.monotonic() + 0.05)
    assert deadline.extend(time.monotonic() + 0.1)  # a second caller joins: it waits longer
    assert deadline.remaining() > 0.05
    time.sleep(0.1)
    assert deadline.remaining() <= 0
    assert not deadline.extend(time.monotonic() + 60)  # the build gave up: start another
    assert deadline.remaining() <= 0


def test_close_stops_a_running_build():
    compiler = outlines(compile_timeout=60)
    future = compiler.compile_async("regex", runaway("a"))
    time.sleep(0.3)
    compiler.close()
    with pytest.raises(GrammarError, match="stopped: the compiler was closed"):
        future.result(timeout=5)


def test_the_helper_process_builds_the_dfa_the_in_process_build_does():
    builders = DfaBuilders()

    def in_helper(regex: str) -> RawDfa:
        return builders.build(regex, 1000, Deadline(time.monotonic() + 30))

    try:
        for regex in ("ab?c", runaway("a", 3), "(?:x|y)+\\U0010ffff", "[^a]\\u00e9{2,3}"):
            assert in_helper(regex) == build_dfa(regex, 1000)
        with pytest.raises(TooManyStates):
            in_helper(runaway("a", 12))
        with pytest.raises(DfaRefused):
            in_helper("a(")
    finally:
        builders.close()


def test_json_schema_on_tiny_vocab(compiler):
    grammar = compiler.compile(
        "json_schema",
        {"type": "object", "properties": {"ab": {"enum": [1, 12]}}, "required": ["ab"]},
    )
    m = grammar.matcher()
    assert m.jump_forward_string() == '{"ab":1'
    assert (
        m.accept_token(VOCAB['{"']) and m.accept_token(VOCAB["ab"]) and m.accept_token(VOCAB['":'])
    )
    assert texts(m.allowed_token_ids()) == {"1", "12"}
    assert m.accept_token(VOCAB["1"])
    assert texts(m.allowed_token_ids()) == {"2", "}"}
    assert m.accept_token(VOCAB["}"]) and m.accept_token(EOS)


def test_a_cached_refusal_is_raised_fresh_for_each_caller(compiler):
    """Raising one cached exception again adds each caller's frames (and what they hold: the
    request) to its traceback, without end."""

    def depth() -> int:
        with pytest.raises(GrammarError) as info:
            compiler.compile("regex", "[a-")
        n, tb = 0, info.value.__traceback__
        while tb is not None:
            n, tb = n + 1, tb.tb_next
        return n

    depth()  # compiled, refused and cached
    assert len({depth() for _ in range(20)}) == 1
